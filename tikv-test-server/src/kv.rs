//! The TiKV service: every transactional call is checked against its region (id, epoch, key
//! range) as TiKV does, then served by the MVCC store.

// Region errors are protocol messages built once per failed call and sent as they are.
#![allow(clippy::result_large_err)]

use std::collections::HashMap;
use std::sync::Arc;

use tonic::Status;

use crate::grpc::{self, HttpRequest, Router};
use crate::mvcc::{Mutation, Prewrite};
use crate::proto::{errorpb, kvrpcpb};
use crate::{Fault, RegionFault, RegionInfo, Shared, State, pd};

/// A response type that can carry a region error.
trait Reply: Default {
    fn with_region_error(error: errorpb::Error) -> Self;
}

macro_rules! reply {
    ($($t:ident),* $(,)?) => {$(
        impl Reply for kvrpcpb::$t {
            fn with_region_error(error: errorpb::Error) -> Self {
                kvrpcpb::$t { region_error: Some(error), ..Default::default() }
            }
        }
    )*};
}

reply!(
    GetResponse,
    BatchGetResponse,
    ScanResponse,
    PrewriteResponse,
    CommitResponse,
    BatchRollbackResponse,
    CleanupResponse,
    CheckTxnStatusResponse,
    CheckSecondaryLocksResponse,
    ResolveLockResponse,
    ScanLockResponse,
    TxnHeartBeatResponse,
    GcResponse,
    DeleteRangeResponse,
    UnsafeDestroyRangeResponse,
);

/// A request: its context and the keys fault rules match on.
trait Call {
    fn context(&self) -> Option<&kvrpcpb::Context>;
    fn keys(&self) -> Vec<&[u8]>;
}

macro_rules! call {
    ($t:ident, |$r:ident| $keys:expr) => {
        impl Call for kvrpcpb::$t {
            fn context(&self) -> Option<&kvrpcpb::Context> {
                self.context.as_ref()
            }
            fn keys(&self) -> Vec<&[u8]> {
                let $r = self;
                $keys
            }
        }
    };
}

call!(GetRequest, |r| vec![&r.key[..]]);
call!(BatchGetRequest, |r| r
    .keys
    .iter()
    .map(Vec::as_slice)
    .collect());
call!(ScanRequest, |r| vec![&r.start_key[..]]);
call!(PrewriteRequest, |r| r
    .mutations
    .iter()
    .map(|m| &m.key[..])
    .collect());
call!(CommitRequest, |r| r
    .keys
    .iter()
    .map(Vec::as_slice)
    .collect());
call!(BatchRollbackRequest, |r| r
    .keys
    .iter()
    .map(Vec::as_slice)
    .collect());
call!(CleanupRequest, |r| vec![&r.key[..]]);
call!(CheckTxnStatusRequest, |r| vec![&r.primary_key[..]]);
call!(CheckSecondaryLocksRequest, |r| r
    .keys
    .iter()
    .map(Vec::as_slice)
    .collect());
call!(ResolveLockRequest, |r| r
    .keys
    .iter()
    .map(Vec::as_slice)
    .collect());
call!(ScanLockRequest, |r| vec![&r.start_key[..]]);
call!(TxnHeartBeatRequest, |r| vec![&r.primary_lock[..]]);
call!(GcRequest, |_r| Vec::new());
call!(DeleteRangeRequest, |r| vec![&r.start_key[..]]);
call!(UnsafeDestroyRangeRequest, |r| vec![&r.start_key[..]]);

fn region_not_found(region_id: u64) -> errorpb::Error {
    errorpb::Error {
        message: format!("region {region_id} not found"),
        region_not_found: Some(errorpb::RegionNotFound { region_id }),
        ..Default::default()
    }
}

fn epoch_not_match(state: &State) -> errorpb::Error {
    errorpb::Error {
        message: "epoch not match".to_string(),
        epoch_not_match: Some(errorpb::EpochNotMatch {
            current_regions: state.regions.iter().map(pd::region_message).collect(),
        }),
        ..Default::default()
    }
}

/// The region a request addresses, if its id and epoch are current.
fn locate(state: &State, context: Option<&kvrpcpb::Context>) -> Result<RegionInfo, errorpb::Error> {
    let context = context.ok_or_else(|| region_not_found(0))?;
    let region = state
        .region_by_id(context.region_id)
        .ok_or_else(|| region_not_found(context.region_id))?;
    let epoch = context.region_epoch.clone().unwrap_or_default();
    if epoch.version != region.version || epoch.conf_ver != 1 {
        return Err(epoch_not_match(state));
    }
    Ok(region.clone())
}

fn contains(region: &RegionInfo, key: &[u8]) -> bool {
    region.start_key.as_slice() <= key
        && (region.end_key.is_empty() || key < region.end_key.as_slice())
}

fn check_keys<'a>(
    region: &RegionInfo,
    keys: impl IntoIterator<Item = &'a [u8]>,
) -> Result<(), errorpb::Error> {
    for key in keys {
        if !contains(region, key) {
            return Err(errorpb::Error {
                message: format!("key {key:?} is not in region {}", region.id),
                key_not_in_region: Some(errorpb::KeyNotInRegion {
                    key: key.to_vec(),
                    region_id: region.id,
                    start_key: region.start_key.clone(),
                    end_key: region.end_key.clone(),
                }),
                ..Default::default()
            });
        }
    }
    Ok(())
}

/// `[lower, upper)` clipped to the region (empty `upper`: unbounded); the lower bound must lie
/// in the region.
fn clip(
    region: &RegionInfo,
    lower: &[u8],
    upper: &[u8],
) -> Result<(Vec<u8>, Vec<u8>), errorpb::Error> {
    let lower = if lower < region.start_key.as_slice() {
        region.start_key.clone()
    } else {
        lower.to_vec()
    };
    check_keys(region, [lower.as_slice()])?;
    let upper = match (upper.is_empty(), region.end_key.is_empty()) {
        (true, _) => region.end_key.clone(),
        (false, true) => upper.to_vec(),
        (false, false) => upper.min(region.end_key.as_slice()).to_vec(),
    };
    Ok((lower, upper))
}

fn injected(
    fault: RegionFault,
    state: &State,
    context: Option<&kvrpcpb::Context>,
) -> errorpb::Error {
    let region_id = context.map(|c| c.region_id).unwrap_or_default();
    match fault {
        RegionFault::NotLeader => errorpb::Error {
            message: "injected: not leader".to_string(),
            not_leader: Some(errorpb::NotLeader {
                region_id,
                leader: Some(pd::leader(region_id)),
            }),
            ..Default::default()
        },
        RegionFault::EpochNotMatch => errorpb::Error {
            message: "injected: epoch not match".to_string(),
            ..epoch_not_match(state)
        },
        RegionFault::ServerIsBusy => errorpb::Error {
            message: "injected: server is busy".to_string(),
            server_is_busy: Some(errorpb::ServerIsBusy {
                reason: "injected".to_string(),
                ..Default::default()
            }),
            ..Default::default()
        },
    }
}

/// Serves one call: fault rules, injected region errors, the region check (unless the call is
/// addressed to the store, not a region), then `f` under the store's lock.
async fn serve<Req, Resp>(
    shared: Arc<Shared>,
    method: &'static str,
    request: Req,
    by_region: bool,
    f: impl FnOnce(&mut State, &RegionInfo, Req) -> Result<Resp, errorpb::Error>,
) -> Result<Resp, Status>
where
    Req: Call,
    Resp: Reply,
{
    let mut region_fault = None;
    shared.delay().await;
    let lose = match shared.on_call(method, &request.keys()) {
        None => false,
        Some(Fault::Unavailable) => {
            return Err(Status::unavailable(format!("injected fault on {method}")));
        }
        Some(Fault::LoseResponse) => true,
        Some(Fault::Delay(delay)) => {
            tokio::time::sleep(delay).await;
            false
        }
        Some(Fault::Region(fault)) => {
            region_fault = Some(fault);
            false
        }
    };
    let response = {
        let mut state = shared.state();
        check_api_version(&state, method, &request)?;
        if let Some(fault) = region_fault.or_else(|| shared.take_region_fault(method)) {
            return Ok(Resp::with_region_error(injected(
                fault,
                &state,
                request.context(),
            )));
        }
        let region = if by_region {
            match locate(&state, request.context()) {
                Ok(region) => region,
                Err(error) => return Ok(Resp::with_region_error(error)),
            }
        } else {
            RegionInfo {
                id: 0,
                start_key: Vec::new(),
                end_key: Vec::new(),
                version: 0,
            }
        };
        f(&mut state, &region, request).unwrap_or_else(Resp::with_region_error)
    };
    if lose {
        return Err(Status::unavailable(format!(
            "injected lost response of {method}"
        )));
    }
    Ok(response)
}

/// An API v2 request carries only keys of a keyspace, an API v1 request none (TiKV refuses a
/// request of the other API version than its storage's; this server holds both).
fn check_api_version(state: &State, method: &str, request: &impl Call) -> Result<(), Status> {
    let v2 = request
        .context()
        .is_some_and(|c| c.api_version == kvrpcpb::ApiVersion::V2 as i32);
    for key in request.keys() {
        if key.is_empty() || (v2 && state.is_a_keyspace_end(key)) {
            continue;
        }
        if state.in_a_keyspace(key) != v2 {
            return Err(Status::invalid_argument(format!(
                "{method}: an API {} request with the key {key:?}, {} a keyspace",
                if v2 { "v2" } else { "v1" },
                if v2 { "outside" } else { "inside" }
            )));
        }
    }
    Ok(())
}

fn resolved(context: Option<&kvrpcpb::Context>) -> Vec<u64> {
    context
        .map(|c| c.resolved_locks.clone())
        .unwrap_or_default()
}

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    Arc::new(move |request: HttpRequest| {
        let shared = shared.clone();
        Box::pin(async move {
            let path = request.uri().path().to_string();
            let method = path.rsplit('/').next().unwrap_or_default().to_string();
            macro_rules! route {
                ($req:ty, $by_region:expr, $f:expr) => {
                    grpc::unary(request, move |r: $req| async move {
                        let name: &'static str = method_name(&method);
                        serve(shared, name, r, $by_region, $f).await
                    })
                    .await
                };
            }
            match path.as_str() {
                "/tikvpb.Tikv/KvGet" => route!(kvrpcpb::GetRequest, true, |state, region, r| {
                    check_keys(region, [r.key.as_slice()])?;
                    Ok(
                        match state
                            .mvcc
                            .get(&r.key, r.version, &resolved(r.context.as_ref()))
                        {
                            Ok(Some(value)) => kvrpcpb::GetResponse {
                                value,
                                ..Default::default()
                            },
                            Ok(None) => kvrpcpb::GetResponse {
                                not_found: true,
                                ..Default::default()
                            },
                            Err(error) => kvrpcpb::GetResponse {
                                error: Some(error),
                                ..Default::default()
                            },
                        },
                    )
                }),
                "/tikvpb.Tikv/KvBatchGet" => {
                    route!(kvrpcpb::BatchGetRequest, true, |state, region, r| {
                        check_keys(region, r.keys.iter().map(Vec::as_slice))?;
                        let pairs =
                            state
                                .mvcc
                                .batch_get(&r.keys, r.version, &resolved(r.context.as_ref()));
                        Ok(kvrpcpb::BatchGetResponse {
                            pairs,
                            ..Default::default()
                        })
                    })
                }
                "/tikvpb.Tikv/KvScan" => route!(kvrpcpb::ScanRequest, true, |state, region, r| {
                    // A reverse scan names its upper bound in `start_key` and its lower bound in
                    // `end_key`.
                    let (lower, upper) = if r.reverse {
                        clip(region, &r.end_key, &r.start_key)?
                    } else {
                        clip(region, &r.start_key, &r.end_key)?
                    };
                    let pairs = state.mvcc.scan(
                        &lower,
                        &upper,
                        r.limit as usize,
                        r.version,
                        r.key_only,
                        r.reverse,
                        &resolved(r.context.as_ref()),
                    );
                    Ok(kvrpcpb::ScanResponse {
                        pairs,
                        ..Default::default()
                    })
                }),
                "/tikvpb.Tikv/KvPrewrite" => {
                    route!(kvrpcpb::PrewriteRequest, true, |state, region, r| {
                        check_keys(region, r.mutations.iter().map(|m| m.key.as_slice()))?;
                        let mutations: Vec<Mutation<'_>> = r
                            .mutations
                            .iter()
                            .map(|m| Mutation {
                                op: kvrpcpb::Op::try_from(m.op).unwrap_or(kvrpcpb::Op::Rollback),
                                key: &m.key,
                                value: &m.value,
                            })
                            .collect();
                        let errors = state.mvcc.prewrite(
                            &mutations,
                            &Prewrite {
                                primary: &r.primary_lock,
                                start_ts: r.start_version,
                                ttl: r.lock_ttl,
                                txn_size: r.txn_size,
                                min_commit_ts: r.min_commit_ts,
                                // Served as two-phase commit, which the client accepts.
                                use_async_commit: false,
                                secondaries: &r.secondaries,
                            },
                        );
                        Ok(kvrpcpb::PrewriteResponse {
                            errors,
                            ..Default::default()
                        })
                    })
                }
                "/tikvpb.Tikv/KvCommit" => {
                    route!(kvrpcpb::CommitRequest, true, |state, region, r| {
                        check_keys(region, r.keys.iter().map(Vec::as_slice))?;
                        Ok(
                            match state
                                .mvcc
                                .commit(&r.keys, r.start_version, r.commit_version)
                            {
                                Ok(()) => kvrpcpb::CommitResponse {
                                    commit_version: r.commit_version,
                                    ..Default::default()
                                },
                                Err(error) => kvrpcpb::CommitResponse {
                                    error: Some(error),
                                    ..Default::default()
                                },
                            },
                        )
                    })
                }
                "/tikvpb.Tikv/KvBatchRollback" => {
                    route!(kvrpcpb::BatchRollbackRequest, true, |state, region, r| {
                        check_keys(region, r.keys.iter().map(Vec::as_slice))?;
                        Ok(kvrpcpb::BatchRollbackResponse {
                            error: state.mvcc.batch_rollback(&r.keys, r.start_version).err(),
                            ..Default::default()
                        })
                    })
                }
                "/tikvpb.Tikv/KvCleanup" => {
                    route!(kvrpcpb::CleanupRequest, true, |state, region, r| {
                        check_keys(region, [r.key.as_slice()])?;
                        Ok(
                            match state.mvcc.cleanup(&r.key, r.start_version, r.current_ts) {
                                Ok(0) => kvrpcpb::CleanupResponse::default(),
                                Ok(commit_version) => kvrpcpb::CleanupResponse {
                                    commit_version,
                                    error: Some(kvrpcpb::KeyError {
                                        abort: format!(
                                            "Committed {{ commit_ts: {commit_version} }}"
                                        ),
                                        ..Default::default()
                                    }),
                                    ..Default::default()
                                },
                                Err(error) => kvrpcpb::CleanupResponse {
                                    error: Some(error),
                                    ..Default::default()
                                },
                            },
                        )
                    })
                }
                "/tikvpb.Tikv/KvCheckTxnStatus" => {
                    route!(kvrpcpb::CheckTxnStatusRequest, true, |state, region, r| {
                        check_keys(region, [r.primary_key.as_slice()])?;
                        Ok(
                            match state.mvcc.check_txn_status(
                                &r.primary_key,
                                r.lock_ts,
                                r.current_ts,
                                r.rollback_if_not_exist,
                            ) {
                                Ok(status) => kvrpcpb::CheckTxnStatusResponse {
                                    lock_ttl: status.lock_ttl,
                                    commit_version: status.commit_version,
                                    action: status.action as i32,
                                    lock_info: status.lock_info,
                                    ..Default::default()
                                },
                                Err(error) => kvrpcpb::CheckTxnStatusResponse {
                                    error: Some(error),
                                    ..Default::default()
                                },
                            },
                        )
                    })
                }
                "/tikvpb.Tikv/KvCheckSecondaryLocks" => {
                    route!(
                        kvrpcpb::CheckSecondaryLocksRequest,
                        true,
                        |state, region, r| {
                            check_keys(region, r.keys.iter().map(Vec::as_slice))?;
                            let (locks, commit_ts) =
                                state.mvcc.check_secondary_locks(&r.keys, r.start_version);
                            Ok(kvrpcpb::CheckSecondaryLocksResponse {
                                locks,
                                commit_ts,
                                ..Default::default()
                            })
                        }
                    )
                }
                "/tikvpb.Tikv/KvResolveLock" => {
                    route!(kvrpcpb::ResolveLockRequest, true, |state, region, r| {
                        check_keys(region, r.keys.iter().map(Vec::as_slice))?;
                        let txns: HashMap<u64, u64> = if r.txn_infos.is_empty() {
                            HashMap::from([(r.start_version, r.commit_version)])
                        } else {
                            r.txn_infos
                                .iter()
                                .map(|info| (info.txn, info.status))
                                .collect()
                        };
                        state.mvcc.resolve_locks(
                            &region.start_key,
                            &region.end_key,
                            &txns,
                            &r.keys,
                        );
                        Ok(kvrpcpb::ResolveLockResponse::default())
                    })
                }
                "/tikvpb.Tikv/KvScanLock" => {
                    route!(kvrpcpb::ScanLockRequest, true, |state, region, r| {
                        let (lower, upper) = clip(region, &r.start_key, &r.end_key)?;
                        let locks =
                            state
                                .mvcc
                                .scan_locks(&lower, &upper, r.max_version, r.limit as usize);
                        Ok(kvrpcpb::ScanLockResponse {
                            locks,
                            ..Default::default()
                        })
                    })
                }
                "/tikvpb.Tikv/KvTxnHeartBeat" => {
                    route!(kvrpcpb::TxnHeartBeatRequest, true, |state, region, r| {
                        check_keys(region, [r.primary_lock.as_slice()])?;
                        Ok(
                            match state.mvcc.heart_beat(
                                &r.primary_lock,
                                r.start_version,
                                r.advise_lock_ttl,
                            ) {
                                Ok(lock_ttl) => kvrpcpb::TxnHeartBeatResponse {
                                    lock_ttl,
                                    ..Default::default()
                                },
                                Err(error) => kvrpcpb::TxnHeartBeatResponse {
                                    error: Some(error),
                                    ..Default::default()
                                },
                            },
                        )
                    })
                }
                "/tikvpb.Tikv/KvGC" => route!(kvrpcpb::GcRequest, true, |state, _region, r| {
                    state.mvcc.gc(r.safe_point.min(state.safe_point));
                    Ok(kvrpcpb::GcResponse::default())
                }),
                "/tikvpb.Tikv/KvDeleteRange" => {
                    route!(kvrpcpb::DeleteRangeRequest, true, |state, region, r| {
                        let (lower, upper) = clip(region, &r.start_key, &r.end_key)?;
                        if !r.notify_only {
                            state.mvcc.destroy_range(&lower, &upper);
                        }
                        Ok(kvrpcpb::DeleteRangeResponse::default())
                    })
                }
                "/tikvpb.Tikv/UnsafeDestroyRange" => {
                    // Sent to every store, not to a region.
                    route!(
                        kvrpcpb::UnsafeDestroyRangeRequest,
                        false,
                        |state, _region, r| {
                            state.mvcc.destroy_range(&r.start_key, &r.end_key);
                            Ok(kvrpcpb::UnsafeDestroyRangeResponse::default())
                        }
                    )
                }
                other => grpc::unimplemented(other),
            }
        })
    })
}

/// The method names, as `'static` strings for the call counters.
fn method_name(method: &str) -> &'static str {
    const NAMES: &[&str] = &[
        "KvGet",
        "KvBatchGet",
        "KvScan",
        "KvPrewrite",
        "KvCommit",
        "KvBatchRollback",
        "KvCleanup",
        "KvCheckTxnStatus",
        "KvCheckSecondaryLocks",
        "KvResolveLock",
        "KvScanLock",
        "KvTxnHeartBeat",
        "KvGC",
        "KvDeleteRange",
        "UnsafeDestroyRange",
    ];
    NAMES
        .iter()
        .find(|name| **name == method)
        .copied()
        .unwrap_or("unknown")
}
