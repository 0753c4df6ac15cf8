//! Tito's integration tests, in one binary so they build once.
//!
//! Engine-generic suites are written once in a module and instantiated per backend with one
//! line (see `support::engine_suite!`).

mod support;

mod boundary;
mod clock;
mod cluster;
mod crash;
mod defects;
mod derive;
mod embedded;
mod engine_conformance;
mod engine_embedded;
mod engine_memory;
mod engine_sqlite;
mod engine_tikv;
mod forms;
mod graphs;
mod guarantees;
mod inbox;
mod inspect;
mod keyspaces;
mod kv;
mod layers;
mod models;
mod nudges;
mod order_desk;
mod queue;
mod queue_composed;
mod queue_declared;
mod rpc_counts;
mod schema;
mod shapes;
mod simulation;
mod soak;
mod store_copy;
mod suites;
mod telemetry;
mod tikv_server;
mod tls;
mod transactions;
mod unknown_outcomes;
