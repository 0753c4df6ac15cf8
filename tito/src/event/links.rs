//! The links a workflow step's or a batch child's row carries (see `crate::queue::graph`).

use serde::{Deserialize, Serialize};

/// Which workflow and step a delivered invocation is ([`crate::QueueEvent::workflow`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct StepOf {
    /// The workflow's id.
    pub workflow: String,
    /// The step's name.
    pub step: String,
}

/// A workflow step's link, kept on its row.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct StepLink {
    #[serde(rename = "wf")]
    pub workflow: String,
    pub step: String,
    /// While it waits: the dependencies whose end it has not seen yet.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waiting_on: Vec<String>,
    /// What its dependencies' deaths and cancellations do to it.
    #[serde(default, skip_serializing_if = "OnFailure::is_default")]
    pub on_failure: OnFailure,
}

/// A batch child's link, kept on its row.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct BatchLink {
    pub id: String,
    pub shard: u32,
}

/// What a step does when one of its dependencies dies (a failure policy gave up on it) or is
/// cancelled, instead of completing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum OnFailure {
    /// The default: the step is cancelled too (its reason names the dependency), and so are
    /// the steps after it that cancel on failure.
    #[default]
    Cancel,
    /// The step keeps waiting: when the dead dependency is retried
    /// ([`Queue::retry_dead`](crate::Queue::retry_dead)) and completes, it runs; a cancelled
    /// dependency holds it until the workflow is cancelled.
    Hold,
    /// The step runs anyway, as if the dependency had completed; it reads the dependency's
    /// end (`Finished::Dead` or `Finished::Cancelled`) with [`Graphs::dependency`](crate::queue::graph::Graphs::dependency).
    RunAnyway,
}

impl OnFailure {
    pub(crate) fn is_default(&self) -> bool {
        *self == OnFailure::Cancel
    }
}
