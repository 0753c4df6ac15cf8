//! The models and derive suites on every backend.

mod embedded {
    crate::models_suite!(crate::support::EmbeddedBackend);
    crate::derive_suite!(crate::support::EmbeddedBackend);
}

mod tikv {
    crate::models_suite!(crate::support::TikvBackend);
    crate::derive_suite!(crate::support::TikvBackend);
}
