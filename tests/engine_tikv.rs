//! The storage contract on TiKV: the test server by default, a real cluster with `TITO_PD_ENDPOINTS`.

crate::conformance_suite!(crate::support::TikvBackend);

/// The storage contract once more over TLS.
mod tls {
    crate::conformance_suite!(crate::support::TikvTlsBackend);
}

/// The storage contract on two keyspaces of one cluster at once.
mod keyspaces {
    crate::conformance_suite!(crate::support::TikvKeyspacesBackend);
}
