//! The storage contract on TiKV: the test server by default, a real cluster with `TITO_PD_ENDPOINTS`.

crate::conformance_suite!(crate::support::TikvBackend);
