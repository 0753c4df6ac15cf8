//! Counters shared by a handle and its workers, and the plain snapshots handed to users.

/// Declares a snapshot struct of plain `u64`s (public) and its atomic twin (crate-private) with
/// the same field names, plus `snapshot()` and `bump()` on the twin.
macro_rules! counters {
    (
        $(#[$meta:meta])*
        pub struct $snapshot:ident / $atomic:ident {
            $( $(#[$field_meta:meta])* $field:ident, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        #[non_exhaustive]
        pub struct $snapshot {
            $( $(#[$field_meta])* pub $field: u64, )*
        }

        /// The live, shared counters behind the snapshot.
        #[derive(Debug, Default)]
        pub(crate) struct $atomic {
            $( pub(crate) $field: std::sync::atomic::AtomicU64, )*
        }

        impl $atomic {
            /// The counters' values now (each read on its own: not one atomic instant).
            pub(crate) fn snapshot(&self) -> $snapshot {
                $snapshot {
                    $( $field: self.$field.load(std::sync::atomic::Ordering::Relaxed), )*
                }
            }

            /// Adds `by` to one counter.
            #[allow(dead_code)]
            pub(crate) fn bump(counter: &std::sync::atomic::AtomicU64, by: u64) {
                counter.fetch_add(by, std::sync::atomic::Ordering::Relaxed);
            }
        }
    };
}

pub(crate) use counters;
