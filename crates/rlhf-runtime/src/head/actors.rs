//! Starting and stopping role processes on the workers for the head: an actor is reserved
//! in the state, started by its node's worker (retried while the request never left), and
//! recorded as started or dead; at shutdown every live worker is asked to stop.

use std::time::Duration;

use rlhf_core::{Error, FailureKind, Result};
use rlhf_proto::v1 as pb;
use tonic::Status;

use super::{state, Head};
use crate::{convert, net};

impl Head {
    pub(super) async fn create_actor(
        &self,
        spec: state::ActorSpec,
        timeout: Duration,
    ) -> Result<pb::ActorInfo> {
        // An actor in a group on a node that has not registered again since a head restart
        // waits for it (within the call's deadline), as a placement waits for resources.
        let deadline = tokio::time::Instant::now() + timeout;
        let rec = loop {
            let r = self.lock().reserve_actor(spec.clone());
            match r {
                Err(_)
                    if tokio::time::Instant::now() < deadline
                        && self.lock().bundle_node_rejoining(&spec) =>
                {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                r => break r?,
            }
        };
        let address = self
            .lock()
            .nodes
            .get(&rec.node_id)
            .map(|n| n.address.clone())
            .unwrap_or_default();
        let mut client = self.worker_client(&address)?;
        let req = pb::StartActorRequest {
            actor_id: rec.actor_id.clone(),
            spec: Some(convert::spec_to_proto(&rec.spec)),
            timeout_ms: timeout.as_millis() as u64,
        };
        let res = tokio::time::timeout(timeout + Duration::from_secs(5), async {
            // A request that never left (the connection to the worker could not be made, as
            // under heavy load) is safe to send again until the deadline; anything else is
            // the worker's answer.
            let mut delay = Duration::from_millis(100);
            loop {
                match client.start_actor(req.clone()).await {
                    // Unless the node was marked dead meanwhile (its actors with it): then the
                    // caller places again, elsewhere.
                    Err(s) if net::never_sent(&s) && self.actor_dead(&rec.actor_id) => {
                        return Err(Status::from(Error::new(
                            FailureKind::ActorDied,
                            format!(
                                "node {} died before actor {} started; place it again",
                                rec.node_id, rec.actor_id
                            ),
                        )));
                    }
                    Err(s) if net::never_sent(&s) => {
                        tracing::warn!(
                            node = %rec.node_id,
                            "StartActor {}: {}; trying again in {delay:?}",
                            rec.actor_id,
                            s.message()
                        );
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(Duration::from_secs(2));
                    }
                    r => return r,
                }
            }
        })
        .await;
        let info = match res {
            Ok(Ok(r)) => r.into_inner().actor.unwrap_or_default(),
            Ok(Err(status)) => {
                let chain = net::error_chain(&status);
                // Only a failure to reach the worker is about its certificate; the worker's
                // own errors (a download behind a proxy) may quote certificate errors too.
                let transport = status.code() == tonic::Code::Unavailable
                    || status.code() == tonic::Code::Unknown && chain.contains("transport error");
                let hint = net::tls_hint(
                    &chain,
                    "the head",
                    &format!("the worker of node {} ({address})", rec.node_id),
                    "start the head with --tls-ca CA, the CA that signed the workers' \
                     certificates (without it the head trusts only its own --tls-cert)",
                );
                let e = match hint.filter(|_| transport) {
                    Some(h) => Error::new(FailureKind::Unauthenticated, format!("{h} ({chain})")),
                    None => Error::from(status),
                };
                self.lock()
                    .actor_died(&rec.actor_id, format!("failed to start: {e}"), None)?;
                return Err(e);
            }
            Err(_) => {
                let e = Error::new(
                    FailureKind::Timeout,
                    format!(
                        "node {} did not start actor {} within {:?}",
                        rec.node_id, rec.actor_id, timeout
                    ),
                );
                self.lock().actor_died(&rec.actor_id, e.to_string(), None)?;
                return Err(e);
            }
        };
        let mut s = self.lock();
        s.actor_started(
            &rec.actor_id,
            info.address,
            info.pid,
            info.devices,
            info.log_file,
        )?;
        Ok(convert::actor_to_proto(&s.actors[&rec.actor_id]))
    }

    pub(super) fn actor_dead(&self, actor_id: &str) -> bool {
        self.lock()
            .actors
            .get(actor_id)
            .is_none_or(|a| a.state == state::ActorState::Dead)
    }

    pub(super) async fn stop_workers(&self) {
        let addrs: Vec<String> = self
            .lock()
            .nodes
            .values()
            .filter(|n| n.state.up())
            .map(|n| n.address.clone())
            .collect();
        let calls = addrs.into_iter().filter_map(|a| {
            let mut c = self.worker_client(&a).ok()?;
            Some(async move {
                let r = tokio::time::timeout(
                    Duration::from_secs(10),
                    c.shutdown_worker(pb::ShutdownWorkerRequest {}),
                )
                .await;
                if !matches!(r, Ok(Ok(_))) {
                    tracing::warn!(worker = %a, "worker did not confirm shutdown");
                }
            })
        });
        futures::future::join_all(calls).await;
    }
}
