//! The application's types a tool was built with: its models and inbox models, each usable
//! whatever the engine.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use tito::model::{TitoModel, TitoModelTrait};
use tito::schema::{AuditReport, Progress, Step, TableSchema};
use tito::{TitoEngine, TitoResult};
use tito_admin::InboxSource;

use crate::Failure;

/// What one registered model can do, whatever the engine.
pub(crate) trait ModelOps: Send + Sync {
    fn schema(&self) -> BoxFuture<'_, TitoResult<TableSchema>>;
    fn step(&self) -> BoxFuture<'_, TitoResult<Step>>;
    fn restart(&self, index: String) -> BoxFuture<'_, TitoResult<()>>;
    fn audit(
        &self,
        repair: bool,
        progress: Box<dyn FnMut(&Progress) + Send>,
    ) -> BoxFuture<'_, TitoResult<AuditReport>>;
}

pub(crate) struct Typed<E: TitoEngine, T>(pub(crate) TitoModel<E, T>);

impl<E: TitoEngine, T: TitoModelTrait> ModelOps for Typed<E, T> {
    fn schema(&self) -> BoxFuture<'_, TitoResult<TableSchema>> {
        Box::pin(self.0.schema())
    }
    fn step(&self) -> BoxFuture<'_, TitoResult<Step>> {
        Box::pin(self.0.schema_step(tito::schema::DEFAULT_BATCH))
    }
    fn restart(&self, index: String) -> BoxFuture<'_, TitoResult<()>> {
        Box::pin(async move { self.0.restart_build(&index).await })
    }
    fn audit(
        &self,
        repair: bool,
        progress: Box<dyn FnMut(&Progress) + Send>,
    ) -> BoxFuture<'_, TitoResult<AuditReport>> {
        Box::pin(async move {
            if repair {
                self.0.repair(progress).await
            } else {
                self.0.audit(progress).await
            }
        })
    }
}

/// The registered models and inboxes, opened on the store of this run.
pub(crate) struct Typing {
    pub(crate) models: BTreeMap<String, Arc<dyn ModelOps>>,
    pub(crate) inboxes: BTreeMap<String, Arc<dyn InboxSource>>,
}

impl Typing {
    pub(crate) fn model(&self, table: &str) -> Result<&Arc<dyn ModelOps>, Failure> {
        self.models.get(table).ok_or_else(|| {
            Failure(format!(
                "table {table:?} has no model in this binary: index builds, audits and repairs \
                 run the model's code; build your own tool with \
                 tito_cli::Tool::new().model::<YourModel>().main()"
            ))
        })
    }

    pub(crate) fn inbox(&self, table: &str) -> Result<&Arc<dyn InboxSource>, Failure> {
        self.inboxes.get(table).ok_or_else(|| {
            Failure(format!(
                "table {table:?} has no inbox model in this binary (its roles are the model's); \
                 build your own tool with tito_cli::Tool::new().inbox::<YourModel>().main()"
            ))
        })
    }
}
