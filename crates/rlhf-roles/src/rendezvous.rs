//! A communicator's rendezvous through the head's KV store: rank 0 publishes where the
//! other ranks meet it (its TCP rendezvous address, its shared-memory segment, or its NCCL
//! unique id) under a key the driver picked, and the other ranks read it from there.
//!
//! Why: the ranks learn the rendezvous from the cluster's own store, as Ray's and
//! torch.distributed's ranks do, instead of from the driver (which only picks the key and
//! hands each rank the communicator's secret). The key lives only while the group forms:
//! rank 0 deletes it when its join is over, failed or not. Reading the store needs the
//! cluster token; a TCP communicator still admits only ranks that prove its secret.
//!
//! A role process started without a head (`RLHF_HEAD_ADDRESS` unset, as in tests that
//! serve a role directly) answers the rendezvous to the driver as before.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use prost::Message;
use rlhf_core::CommGroup;
use rlhf_proto::v1 as pb;
use rlhf_proto::v1::head_service_client::HeadServiceClient;
use rlhf_runtime::net::{self, AuthChannel};
use tonic::{Code, Status};

use crate::comm::Prepared;

/// Logged once by a role process whose communicator rendezvous came from the head's KV
/// store (the end-to-end tests look for it).
pub const KV_RENDEZVOUS_LOG: &str = "communicator rendezvous read from the head's KV store";

/// Keys a role process publishes under start with this (no other key of the store can be
/// written or deleted through PrepareComm / JoinComm).
pub const KEY_PREFIX: &str = "comm/";

/// The longest a rank waits for rank 0's rendezvous when the join names no deadline.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(60);

/// Bound on a single publish or delete call to the head.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The head's KV store as a role process reaches it.
#[derive(Clone)]
pub struct HeadKv {
    client: HeadServiceClient<AuthChannel>,
    address: String,
}

fn check_key(key: &str, field: &str) -> Result<(), Status> {
    if !key.starts_with(KEY_PREFIX) || key.len() == KEY_PREFIX.len() || key.len() > 256 {
        return Err(Status::invalid_argument(format!(
            "{field} '{key}' is not a communicator key: it must start with '{KEY_PREFIX}', \
             name something after it and be at most 256 bytes"
        )));
    }
    Ok(())
}

impl HeadKv {
    /// A client for the head at `address` (connected on first use).
    pub fn new(address: &str, opts: &net::ClientOptions) -> rlhf_core::Result<Self> {
        Ok(Self {
            client: HeadServiceClient::new(net::connect_lazy(address, opts)?),
            address: address.to_string(),
        })
    }

    fn unreachable(&self, what: &str, key: &str, s: &Status) -> Status {
        Status::new(
            s.code(),
            format!(
                "{what} the communicator rendezvous '{key}' on the head at {} ({} from the \
                 worker) failed: {}; check that this host reaches the head, and on a TLS \
                 cluster that the worker's --tls-domain names the head's certificate",
                self.address,
                rlhf_runtime::actor::HEAD_ADDRESS_ENV,
                net::error_chain(s)
            ),
        )
    }

    /// Rank 0: stores `p` under `key`; a key already there is an error (two groups forming
    /// under one key would meet the wrong rank 0).
    pub async fn publish(&self, key: &str, p: &Prepared) -> Result<(), Status> {
        check_key(key, "PrepareCommRequest.kv_key")?;
        let value = pb::CommRendezvous {
            address: p.address.clone(),
            unique_id: p.unique_id.clone(),
        }
        .encode_to_vec();
        let mut c = self.client.clone();
        let req = pb::KvPutRequest {
            key: key.to_string(),
            value,
            overwrite: false,
        };
        let stored = tokio::time::timeout(CALL_TIMEOUT, c.kv_put(req))
            .await
            .map_err(|_| {
                Status::deadline_exceeded(format!(
                    "publishing the communicator rendezvous '{key}': the head at {} did not \
                     answer within {CALL_TIMEOUT:?}",
                    self.address
                ))
            })?
            .map_err(|s| self.unreachable("publishing", key, &s))?
            .into_inner()
            .stored;
        if !stored {
            return Err(Status::already_exists(format!(
                "the communicator key '{key}' is already in the head's KV store; each \
                 PrepareComm needs a fresh kv_key"
            )));
        }
        Ok(())
    }

    /// Ranks other than 0: waits up to `wait` for rank 0's rendezvous.
    pub async fn fetch(&self, key: &str, wait: Duration) -> Result<Prepared, Status> {
        check_key(key, "JoinCommRequest.kv_key")?;
        let mut c = self.client.clone();
        let req = pb::KvWaitRequest {
            key: key.to_string(),
            timeout_ms: wait.as_millis().max(1) as u64,
        };
        // The head answers at its deadline; this one only covers a head that stopped.
        let got = tokio::time::timeout(wait + CALL_TIMEOUT, c.kv_wait(req))
            .await
            .map_err(|_| {
                Status::deadline_exceeded(format!(
                    "waiting for the communicator rendezvous '{key}': the head at {} did not \
                     answer within {:?}",
                    self.address,
                    wait + CALL_TIMEOUT
                ))
            })?
            .map_err(|s| {
                if s.code() == tonic::Code::DeadlineExceeded {
                    Status::deadline_exceeded(format!(
                        "rank 0's communicator rendezvous '{key}' was not in the head's KV \
                         store within {wait:?}: rank 0's PrepareComm failed, or its join \
                         already ended (see rank 0's error)"
                    ))
                } else {
                    self.unreachable("reading", key, &s)
                }
            })?
            .into_inner();
        let r = pb::CommRendezvous::decode(&got.value[..]).map_err(|e| {
            Status::invalid_argument(format!(
                "the head's KV store holds '{key}' but not as a communicator rendezvous: {e}"
            ))
        })?;
        Ok(Prepared {
            address: r.address,
            unique_id: r.unique_id,
        })
    }

    /// Rank 0, when its join is over: the key is of no use to anyone any more. A failure is
    /// logged, not returned: the join's own outcome is what the driver needs.
    pub async fn forget(&self, key: &str) {
        if check_key(key, "JoinCommRequest.kv_key").is_err() {
            return;
        }
        let mut c = self.client.clone();
        let req = pb::KvDeleteRequest {
            key: key.to_string(),
        };
        match tokio::time::timeout(CALL_TIMEOUT, c.kv_delete(req)).await {
            Ok(Ok(_)) => {}
            Ok(Err(s)) => tracing::warn!("{}", self.unreachable("deleting", key, &s)),
            Err(_) => tracing::warn!(
                "deleting the communicator rendezvous '{key}': the head at {} did not answer \
                 within {CALL_TIMEOUT:?}",
                self.address
            ),
        }
    }
}

/// The rendezvous side of PrepareComm and JoinComm in one role process: the head's store
/// (if any) and the key rank 0 published each group under, until its join is over or the
/// group is prepared again. The RPC handlers only hand requests through.
pub struct Rendezvous {
    kv: Option<HeadKv>,
    published: Mutex<HashMap<CommGroup, String>>,
}

impl Rendezvous {
    /// `kv` is `None` for a role process served without a head: every rendezvous is then
    /// answered for the driver to relay.
    pub fn new(kv: Option<HeadKv>) -> Self {
        Self {
            kv,
            published: Mutex::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<CommGroup, String>> {
        // A panic elsewhere cannot leave the map half written: take it as it is.
        self.published.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Rank 0, once `group` is prepared as `p`: publishes it under `key` when the driver
    /// named one and a head is there; otherwise (or when the head cannot be reached)
    /// answers it for the driver to relay.
    pub async fn publish_or_relay(
        &self,
        group: CommGroup,
        key: &str,
        p: Prepared,
    ) -> Result<pb::PrepareCommResponse, Status> {
        if let Some(kv) = self.kv.as_ref().filter(|_| !key.is_empty()) {
            // A group prepared again replaces its rendezvous: the old key is of no use.
            let old = self.lock().remove(&group);
            if let Some(old) = old {
                kv.forget(&old).await;
            }
            match kv.publish(key, &p).await {
                Ok(()) => {
                    self.lock().insert(group, key.to_string());
                    return Ok(pb::PrepareCommResponse {
                        published: true,
                        ..Default::default()
                    });
                }
                // The head cannot be reached from here: the driver can still relay it.
                Err(e) if matches!(e.code(), Code::Unavailable | Code::DeadlineExceeded) => {
                    tracing::warn!("{}; the driver relays the rendezvous instead", e.message())
                }
                Err(e) => return Err(e),
            }
        }
        Ok(pb::PrepareCommResponse {
            address: p.address,
            unique_id: p.unique_id,
            published: false,
        })
    }

    /// Joins `req`'s group through `join` (the compute thread's JoinComm). A rank other
    /// than 0 given only a key reads rank 0's rendezvous from the store first, waiting up
    /// to the join's timeout; `join` gets the request's timeout unchanged (it is the
    /// communicator's op timeout too). Rank 0 deletes the key it published once `join` is over,
    /// failed or not, in a task of its own: a driver that gives up on the call (another
    /// rank failed) drops the handler, and the delete must not go with it.
    pub async fn join<F, Fut>(&self, mut req: pb::JoinCommRequest, join: F) -> Result<(), Status>
    where
        F: FnOnce(pb::JoinCommRequest) -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), Status>> + Send,
    {
        let group = CommGroup::from_wire(req.group, "JoinCommRequest.group")?;
        let (key, rank) = (req.kv_key.clone(), req.rank);
        if !key.is_empty() && rank != 0 && req.address.is_empty() && req.unique_id.is_empty() {
            let Some(kv) = &self.kv else {
                return Err(Status::failed_precondition(format!(
                    "JoinComm rank {rank}: rank 0's rendezvous is in the head's KV store \
                     ('{key}') but this role process has no head address \
                     ({}); pass the address or unique id in the request",
                    rlhf_runtime::actor::HEAD_ADDRESS_ENV
                )));
            };
            // The wait is bounded by the join's timeout; the join then keeps the whole
            // timeout, because `timeout_ms` is also every op's timeout on this communicator
            // and must be the same on every rank (rank 0 never waits here). The wait is
            // normally nil: the driver sends JoinComm only after rank 0's PrepareComm
            // published the key.
            let wait = match req.timeout_ms {
                0 => DEFAULT_WAIT,
                ms => Duration::from_millis(ms),
            };
            let p = kv.fetch(&key, wait).await?;
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| tracing::info!("{KV_RENDEZVOUS_LOG} ('{key}')"));
            (req.address, req.unique_id) = (p.address, p.unique_id);
        }
        let mine = if rank == 0 {
            self.lock().remove(&group)
        } else {
            None
        };
        let kv = self.kv.clone();
        tokio::spawn(async move {
            let joined = join(req).await;
            if let (Some(kv), Some(k)) = (kv, mine) {
                kv.forget(&k).await;
            }
            joined
        })
        .await
        .map_err(|e| Status::internal(format!("the join task failed: {e}")))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_communicator_keys_are_accepted() {
        assert!(check_key("comm/weights/ab12", "k").is_ok());
        for bad in [
            "",
            "comm/",
            "nccl/id",
            "jobs/x",
            &format!("comm/{}", "a".repeat(300)),
        ] {
            let e = check_key(bad, "JoinCommRequest.kv_key").unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{bad}");
            assert!(e.message().contains("JoinCommRequest.kv_key"), "{e}");
        }
    }
}
