//! The feature suites (models, derive, queue, cluster, kv, inbox, defects, boundary, shapes) on every backend
//! (embedded, TiKV through the test server, memory, SQLite): one line per suite.

mod embedded {
    mod models {
        crate::models_suite!(crate::support::EmbeddedBackend);
    }
    mod derive {
        crate::derive_suite!(crate::support::EmbeddedBackend);
    }
    mod queue {
        crate::queue_suite!(crate::support::EmbeddedBackend);
    }
    mod queue_composed {
        crate::queue_composed_suite!(crate::support::EmbeddedBackend);
    }
    mod graphs {
        crate::graphs_suite!(crate::support::EmbeddedBackend);
    }
    mod queue_declared {
        crate::queue_declared_suite!(crate::support::EmbeddedBackend);
    }
    mod kv {
        crate::kv_suite!(crate::support::EmbeddedBackend);
    }
    mod cluster {
        crate::cluster_suite!(crate::support::EmbeddedBackend);
    }
    mod inbox {
        crate::inbox_suite!(crate::support::EmbeddedBackend);
    }
    mod defects {
        crate::defects_suite!(crate::support::EmbeddedBackend);
    }
    mod boundary {
        crate::boundary_suite!(crate::support::EmbeddedBackend);
    }
    mod shapes {
        crate::shapes_suite!(crate::support::EmbeddedBackend);
    }
}

mod tikv {
    mod models {
        crate::models_suite!(crate::support::TikvBackend);
    }
    mod derive {
        crate::derive_suite!(crate::support::TikvBackend);
    }
    mod queue {
        crate::queue_suite!(crate::support::TikvBackend);
    }
    mod queue_composed {
        crate::queue_composed_suite!(crate::support::TikvBackend);
    }
    mod graphs {
        crate::graphs_suite!(crate::support::TikvBackend);
    }
    mod queue_declared {
        crate::queue_declared_suite!(crate::support::TikvBackend);
    }
    mod kv {
        crate::kv_suite!(crate::support::TikvBackend);
    }
    mod cluster {
        crate::cluster_suite!(crate::support::TikvBackend);
    }
    mod inbox {
        crate::inbox_suite!(crate::support::TikvBackend);
    }
    mod defects {
        crate::defects_suite!(crate::support::TikvBackend);
    }
    mod boundary {
        crate::boundary_suite!(crate::support::TikvBackend);
    }
    mod shapes {
        crate::shapes_suite!(crate::support::TikvBackend);
    }
}

/// The queue and model suites once more over TLS (the storage contract too: `engine_tikv`).
mod tikv_tls {
    mod models {
        crate::models_suite!(crate::support::TikvTlsBackend);
    }
    mod queue {
        crate::queue_suite!(crate::support::TikvTlsBackend);
    }
}

/// The queue and model suites on two keyspaces of one cluster at once.
mod tikv_keyspaces {
    mod models {
        crate::models_suite!(crate::support::TikvKeyspacesBackend);
    }
    mod queue {
        crate::queue_suite!(crate::support::TikvKeyspacesBackend);
    }
}

mod memory {
    mod models {
        crate::models_suite!(crate::support::MemoryBackend);
    }
    mod derive {
        crate::derive_suite!(crate::support::MemoryBackend);
    }
    mod queue {
        crate::queue_suite!(crate::support::MemoryBackend);
    }
    mod queue_composed {
        crate::queue_composed_suite!(crate::support::MemoryBackend);
    }
    mod graphs {
        crate::graphs_suite!(crate::support::MemoryBackend);
    }
    mod queue_declared {
        crate::queue_declared_suite!(crate::support::MemoryBackend);
    }
    mod kv {
        crate::kv_suite!(crate::support::MemoryBackend);
    }
    mod cluster {
        crate::cluster_suite!(crate::support::MemoryBackend);
    }
    mod inbox {
        crate::inbox_suite!(crate::support::MemoryBackend);
    }
    mod defects {
        crate::defects_suite!(crate::support::MemoryBackend);
    }
    mod boundary {
        crate::boundary_suite!(crate::support::MemoryBackend);
    }
    mod shapes {
        crate::shapes_suite!(crate::support::MemoryBackend);
    }
}

mod sqlite {
    mod models {
        crate::models_suite!(crate::support::SqliteBackend);
    }
    mod derive {
        crate::derive_suite!(crate::support::SqliteBackend);
    }
    mod queue {
        crate::queue_suite!(crate::support::SqliteBackend);
    }
    mod queue_composed {
        crate::queue_composed_suite!(crate::support::SqliteBackend);
    }
    mod graphs {
        crate::graphs_suite!(crate::support::SqliteBackend);
    }
    mod queue_declared {
        crate::queue_declared_suite!(crate::support::SqliteBackend);
    }
    mod kv {
        crate::kv_suite!(crate::support::SqliteBackend);
    }
    mod cluster {
        crate::cluster_suite!(crate::support::SqliteBackend);
    }
    mod inbox {
        crate::inbox_suite!(crate::support::SqliteBackend);
    }
    mod defects {
        crate::defects_suite!(crate::support::SqliteBackend);
    }
    mod boundary {
        crate::boundary_suite!(crate::support::SqliteBackend);
    }
    mod shapes {
        crate::shapes_suite!(crate::support::SqliteBackend);
    }
}
