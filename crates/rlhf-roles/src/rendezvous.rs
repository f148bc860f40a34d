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

use std::time::Duration;

use prost::Message;
use rlhf_proto::v1 as pb;
use rlhf_proto::v1::head_service_client::HeadServiceClient;
use rlhf_runtime::net::{self, AuthChannel};
use tonic::Status;

use crate::comm::Prepared;

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

    /// Ranks other than 0: waits up to `wait` (0 = 60 s) for rank 0's rendezvous.
    pub async fn fetch(&self, key: &str, wait: Duration) -> Result<Prepared, Status> {
        check_key(key, "JoinCommRequest.kv_key")?;
        let wait = if wait.is_zero() { DEFAULT_WAIT } else { wait };
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
