//! Node liveness at scale: one long-lived heartbeat stream per node instead of a call per
//! beat. A beat on an open stream is one small HTTP/2 frame, and the head records it with
//! one atomic store in the node's slot — no lock, no allocation. The health tick folds the
//! slots into the registry (`HeadState::merge_beats`) before it judges silence, and ends the
//! stream of every node the registry no longer holds alive, telling the node to register
//! again.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rlhf_proto::v1 as pb;
use tokio_util::sync::CancellationToken;
use tonic::{Status, Streaming};

use crate::clock::Clock;

/// How long a new stream may take to name its node.
const FIRST_BEAT: Duration = Duration::from_secs(10);

/// One node's newest beat, and the switch that ends its stream.
pub struct Slot {
    last_ms: AtomicI64,
    ended: CancellationToken,
}

/// The heartbeat streams' slots, by node id.
#[derive(Default)]
pub struct Beats {
    slots: RwLock<HashMap<String, Arc<Slot>>>,
}

impl Beats {
    /// A fresh slot for `node_id`; a previous stream of the node is ended.
    pub fn open(&self, node_id: &str, now_ms: i64) -> Arc<Slot> {
        let slot = Arc::new(Slot {
            last_ms: AtomicI64::new(now_ms),
            ended: CancellationToken::new(),
        });
        let old = crate::lock_write(&self.slots).insert(node_id.to_string(), slot.clone());
        if let Some(old) = old {
            old.ended.cancel();
        }
        slot
    }

    /// Every open stream's newest beat.
    pub fn newest(&self) -> Vec<(String, i64)> {
        crate::lock_read(&self.slots)
            .iter()
            .map(|(id, s)| (id.clone(), s.last_ms.load(Ordering::Relaxed)))
            .collect()
    }

    /// Ends the streams of nodes `keep` rejects (dead or gone from the registry).
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        crate::lock_write(&self.slots).retain(|id, s| {
            let k = keep(id);
            if !k {
                s.ended.cancel();
            }
            k
        });
    }
}

pub type BeatStream =
    Pin<Box<dyn futures::Stream<Item = Result<pb::HeartbeatResponse, Status>> + Send>>;

fn answer(known: bool) -> Result<pb::HeartbeatResponse, Status> {
    Ok(pb::HeartbeatResponse { known })
}

/// Serves one node's stream: `first` is its first message, already checked and recorded
/// (`known` is the registry's answer to it).
pub fn serve(
    mut inbound: Streaming<pb::HeartbeatRequest>,
    slot: Option<Arc<Slot>>,
    clock: Arc<dyn Clock>,
) -> BeatStream {
    let (tx, rx) = tokio::sync::mpsc::channel(2);
    let Some(slot) = slot else {
        // Unknown or dead: register again.
        let _ = tx.try_send(answer(false));
        return Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx));
    };
    let _ = tx.try_send(answer(true));
    tokio::spawn(async move {
        loop {
            tokio::select! {
                biased;
                _ = slot.ended.cancelled() => {
                    let _ = tx.send(answer(false)).await;
                    break;
                }
                m = inbound.message() => match m {
                    Ok(Some(_)) => slot.last_ms.store(clock.now_ms(), Ordering::Relaxed),
                    // The node closed the stream or the connection broke: the health
                    // check judges its silence from the last beat.
                    _ => break,
                },
            }
        }
    });
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// The first message of a stream, within [`FIRST_BEAT`].
pub async fn first(
    inbound: &mut Streaming<pb::HeartbeatRequest>,
) -> Result<pb::HeartbeatRequest, Status> {
    match tokio::time::timeout(FIRST_BEAT, inbound.message()).await {
        Ok(Ok(Some(m))) => Ok(m),
        Ok(Ok(None)) => Err(Status::invalid_argument(
            "HeartbeatStream ended before its first message (which names the node)",
        )),
        Ok(Err(s)) => Err(s),
        Err(_) => Err(Status::deadline_exceeded(format!(
            "HeartbeatStream sent no first message within {} s",
            FIRST_BEAT.as_secs()
        ))),
    }
}
