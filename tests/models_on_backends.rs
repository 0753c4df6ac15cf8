//! The models suite on every backend.

mod embedded {
    crate::models_suite!(crate::support::EmbeddedBackend);
}

mod tikv {
    crate::models_suite!(crate::support::TikvBackend);
}
