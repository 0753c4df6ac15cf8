//! The PD service: membership, the timestamp oracle, region routing, stores and the GC safe
//! point.

use std::sync::Arc;

use futures::StreamExt;
use futures::stream::BoxStream;
use tonic::Status;

use crate::grpc::{self, HttpRequest, Router};
use crate::proto::{keyspacepb, metapb, pdpb};
use crate::{CLUSTER_ID, Fault, STORE_ID, Shared, codec};

fn header() -> Option<pdpb::ResponseHeader> {
    Some(pdpb::ResponseHeader {
        cluster_id: CLUSTER_ID,
        error: None,
    })
}

fn error_header(message: String) -> Option<pdpb::ResponseHeader> {
    Some(pdpb::ResponseHeader {
        cluster_id: CLUSTER_ID,
        error: Some(pdpb::Error {
            r#type: pdpb::ErrorType::Unknown as i32,
            message,
        }),
    })
}

/// The region as PD sends it: boundaries in memcomparable encoding, one peer on the one store.
pub(crate) fn region_message(region: &crate::RegionInfo) -> metapb::Region {
    metapb::Region {
        id: region.id,
        start_key: codec::encode_boundary(&region.start_key),
        end_key: codec::encode_boundary(&region.end_key),
        region_epoch: Some(metapb::RegionEpoch {
            conf_ver: 1,
            version: region.version,
        }),
        peers: vec![leader(region.id)],
        ..Default::default()
    }
}

/// The leader peer of a region; peer ids are derived from region ids.
pub(crate) fn leader(region_id: u64) -> metapb::Peer {
    metapb::Peer {
        id: region_id * 1000 + STORE_ID,
        store_id: STORE_ID,
        ..Default::default()
    }
}

fn store(shared: &Shared) -> metapb::Store {
    metapb::Store {
        id: STORE_ID,
        address: shared
            .tikv_address
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone(),
        state: metapb::StoreState::Up as i32,
        version: "tito-test-server".to_string(),
        ..Default::default()
    }
}

/// Applies a fault before a PD call: `Err` to fail it, `Ok(lose)` to serve it (and, when `lose`
/// is set, fail it afterwards).
async fn before(shared: &Shared, method: &str) -> Result<bool, Status> {
    shared.delay().await;
    match shared.on_call(method, &[]) {
        None => Ok(false),
        Some(Fault::Unavailable) => Err(Status::unavailable(format!("injected fault on {method}"))),
        Some(Fault::LoseResponse) => Ok(true),
        Some(Fault::Delay(delay)) => {
            tokio::time::sleep(delay).await;
            Ok(false)
        }
        // PD has no region errors: a region fault on a PD method fails the call.
        Some(Fault::Region(fault)) => Err(Status::unavailable(format!(
            "injected fault on {method} ({fault:?})"
        ))),
    }
}

async fn serve<T>(
    shared: Arc<Shared>,
    method: &'static str,
    f: impl FnOnce(&Shared) -> T,
) -> Result<T, Status> {
    let lose = before(&shared, method).await?;
    let response = f(&shared);
    if lose {
        return Err(Status::unavailable(format!(
            "injected lost response of {method}"
        )));
    }
    Ok(response)
}

/// Answers each TSO request of the stream with the last of `count` fresh timestamps.
#[allow(clippy::result_large_err)] // the item type is tonic's
fn tso_stream(
    shared: Arc<Shared>,
    requests: tonic::codec::Streaming<pdpb::TsoRequest>,
) -> BoxStream<'static, Result<pdpb::TsoResponse, Status>> {
    requests
        .then(move |request| {
            let shared = shared.clone();
            async move {
                shared.delay().await;
                tso_reply(&shared, request)
            }
        })
        .boxed()
}

/// One timestamp request's answer.
// The stream's items are tonic's `Result<_, Status>`: the error is the protocol's, not ours.
#[allow(clippy::result_large_err)]
fn tso_reply(
    shared: &Shared,
    request: Result<pdpb::TsoRequest, Status>,
) -> Result<pdpb::TsoResponse, Status> {
    let request = request?;
    if request.count == 0 {
        return Err(Status::invalid_argument("a TSO request for 0 timestamps"));
    }
    let (physical, logical) = shared.state().timestamps(request.count);
    Ok(pdpb::TsoResponse {
        header: header(),
        count: request.count,
        timestamp: Some(pdpb::Timestamp {
            physical: physical as i64,
            logical: logical as i64,
            suffix_bits: 0,
        }),
    })
}

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    Arc::new(move |request: HttpRequest| {
        let shared = shared.clone();
        Box::pin(async move {
            let path = request.uri().path().to_string();
            match path.as_str() {
                "/pdpb.PD/GetMembers" => {
                    grpc::unary(request, move |_: pdpb::GetMembersRequest| {
                        serve(shared, "GetMembers", |shared| {
                            let url = format!(
                                "http://{}",
                                shared.pd_address.lock().unwrap_or_else(|e| e.into_inner())
                            );
                            let member = pdpb::Member {
                                name: "tito-test-pd".to_string(),
                                member_id: 1,
                                client_urls: vec![url.clone()],
                                peer_urls: vec![url],
                                ..Default::default()
                            };
                            pdpb::GetMembersResponse {
                                header: header(),
                                members: vec![member.clone()],
                                leader: Some(member.clone()),
                                etcd_leader: Some(member),
                                ..Default::default()
                            }
                        })
                    })
                    .await
                }
                "/pdpb.PD/Tso" => {
                    shared.on_call("Tso", &[]);
                    grpc::streaming(request, move |requests| tso_stream(shared, requests)).await
                }
                "/pdpb.PD/GetRegion" => {
                    grpc::unary(request, move |request: pdpb::GetRegionRequest| {
                        serve(shared, "GetRegion", move |shared| {
                            // Like PD, compare the key as given with the encoded boundaries: the
                            // transactional client sends encoded keys, the raw client raw ones.
                            let state = shared.state();
                            let region = state.region_for_encoded_key(&request.region_key);
                            pdpb::GetRegionResponse {
                                header: header(),
                                region: Some(region_message(region)),
                                leader: Some(leader(region.id)),
                                ..Default::default()
                            }
                        })
                    })
                    .await
                }
                "/keyspacepb.Keyspace/LoadKeyspace" => {
                    grpc::unary(request, move |request: keyspacepb::LoadKeyspaceRequest| {
                        serve(shared, "LoadKeyspace", move |shared| {
                            // An unknown name: no keyspace in an OK answer, which the client
                            // reports as `KeyspaceNotFound`.
                            let state = shared.state();
                            let keyspace = state.keyspaces.get(&request.name).map(|id| {
                                keyspacepb::KeyspaceMeta {
                                    id: *id,
                                    name: request.name.clone(),
                                    state: keyspacepb::KeyspaceState::Enabled as i32,
                                    ..Default::default()
                                }
                            });
                            keyspacepb::LoadKeyspaceResponse {
                                header: header(),
                                keyspace,
                            }
                        })
                    })
                    .await
                }
                "/pdpb.PD/GetRegionByID" => {
                    grpc::unary(request, move |request: pdpb::GetRegionByIdRequest| {
                        serve(shared, "GetRegionByID", move |shared| {
                            let state = shared.state();
                            // An unknown id is an empty answer, as PD gives for a merged region.
                            let region = state.region_by_id(request.region_id);
                            pdpb::GetRegionResponse {
                                header: header(),
                                region: region.map(region_message),
                                leader: region.map(|r| leader(r.id)),
                                ..Default::default()
                            }
                        })
                    })
                    .await
                }
                "/pdpb.PD/GetStore" => {
                    grpc::unary(request, move |request: pdpb::GetStoreRequest| {
                        serve(shared, "GetStore", move |shared| {
                            if request.store_id != STORE_ID {
                                return pdpb::GetStoreResponse {
                                    header: error_header(format!(
                                        "invalid store ID {}, not found",
                                        request.store_id
                                    )),
                                    ..Default::default()
                                };
                            }
                            pdpb::GetStoreResponse {
                                header: header(),
                                store: Some(store(shared)),
                                ..Default::default()
                            }
                        })
                    })
                    .await
                }
                "/pdpb.PD/GetAllStores" => {
                    grpc::unary(request, move |_: pdpb::GetAllStoresRequest| {
                        serve(shared, "GetAllStores", |shared| {
                            pdpb::GetAllStoresResponse {
                                header: header(),
                                stores: vec![store(shared)],
                            }
                        })
                    })
                    .await
                }
                "/pdpb.PD/GetGCSafePoint" => {
                    grpc::unary(request, move |_: pdpb::GetGcSafePointRequest| {
                        serve(shared, "GetGCSafePoint", |shared| {
                            pdpb::GetGcSafePointResponse {
                                header: header(),
                                safe_point: shared.state().safe_point,
                            }
                        })
                    })
                    .await
                }
                "/pdpb.PD/UpdateGCSafePoint" => {
                    grpc::unary(request, move |request: pdpb::UpdateGcSafePointRequest| {
                        serve(shared, "UpdateGCSafePoint", move |shared| {
                            let mut state = shared.state();
                            // Forward only: an older safe point leaves the current one in force,
                            // and the answer tells the caller which one that is.
                            if request.safe_point > state.safe_point {
                                state.safe_point = request.safe_point;
                                state.mvcc.gc(request.safe_point);
                            }
                            pdpb::UpdateGcSafePointResponse {
                                header: header(),
                                new_safe_point: state.safe_point,
                            }
                        })
                    })
                    .await
                }
                other => grpc::unimplemented(other),
            }
        })
    })
}
