//! What the router reads through the application's types: inboxes (typed by their model) and
//! models it may audit.

use std::sync::Arc;

use futures::future::BoxFuture;
use tito::inbox::{Inbox, InboxCounts, InboxModel, InboxRow, InboxRowState};
use tito::model::{TitoModel, TitoModelTrait};
use tito::schema::AuditReport;
use tito::{TitoEngine, TitoPage, TitoResult};

/// An inbox as the dashboard reads it.
pub trait InboxSource: Send + Sync {
    /// The inbox's table.
    fn table(&self) -> &str;
    /// The groups shown.
    fn groups(&self) -> &[String];
    /// [`Inbox::counts`].
    fn counts<'a>(&'a self, group: &'a str) -> BoxFuture<'a, TitoResult<InboxCounts>>;
    /// [`Inbox::scan`].
    fn scan<'a>(
        &'a self,
        group: &'a str,
        state: Option<InboxRowState>,
        cursor: Option<&'a str>,
        limit: usize,
    ) -> BoxFuture<'a, TitoResult<TitoPage<InboxRow>>>;
    /// [`Inbox::bad_rows`].
    fn bad_rows(&self) -> BoxFuture<'_, TitoResult<Vec<String>>>;
    /// [`Inbox::requeue`].
    fn requeue<'a>(&'a self, id: &'a str, group: &'a str) -> BoxFuture<'a, TitoResult<()>>;
}

pub(crate) struct TypedInbox<E: TitoEngine, M> {
    pub inbox: Arc<Inbox<E, M>>,
    pub groups: Vec<String>,
}

impl<E: TitoEngine, M: InboxModel> InboxSource for TypedInbox<E, M> {
    fn table(&self) -> &str {
        self.inbox.table()
    }
    fn groups(&self) -> &[String] {
        &self.groups
    }
    fn counts<'a>(&'a self, group: &'a str) -> BoxFuture<'a, TitoResult<InboxCounts>> {
        Box::pin(self.inbox.counts(group))
    }
    fn scan<'a>(
        &'a self,
        group: &'a str,
        state: Option<InboxRowState>,
        cursor: Option<&'a str>,
        limit: usize,
    ) -> BoxFuture<'a, TitoResult<TitoPage<InboxRow>>> {
        Box::pin(self.inbox.scan(group, state, cursor, limit))
    }
    fn bad_rows(&self) -> BoxFuture<'_, TitoResult<Vec<String>>> {
        Box::pin(self.inbox.bad_rows())
    }
    fn requeue<'a>(&'a self, id: &'a str, group: &'a str) -> BoxFuture<'a, TitoResult<()>> {
        Box::pin(self.inbox.requeue(id, group))
    }
}

/// A model the dashboard may audit.
pub trait Auditor: Send + Sync {
    /// Runs [`TitoModel::audit`] to the end.
    fn audit(&self) -> BoxFuture<'_, TitoResult<AuditReport>>;
}

pub(crate) struct TypedModel<E: TitoEngine, T>(pub TitoModel<E, T>);

impl<E: TitoEngine, T: TitoModelTrait> Auditor for TypedModel<E, T> {
    fn audit(&self) -> BoxFuture<'_, TitoResult<AuditReport>> {
        Box::pin(self.0.audit(|_| {}))
    }
}
