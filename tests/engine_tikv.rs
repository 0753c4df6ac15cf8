//! The storage contract on a TiKV cluster named by `TITO_PD_ENDPOINTS` (skipped without it).

crate::conformance_suite!(crate::support::TikvBackend);
