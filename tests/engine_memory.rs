//! The storage contract on the in-memory engine.

crate::conformance_suite!(crate::support::MemoryBackend);
