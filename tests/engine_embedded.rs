//! The storage contract on the embedded engine.

crate::conformance_suite!(crate::support::EmbeddedBackend);
