//! The storage contract on the SQLite engine.

crate::conformance_suite!(crate::support::SqliteBackend);
