//! The worker's heartbeats: signed UDP datagrams while the head confirms them, else beats on
//! the gRPC stream, which stays open either way for the head to say "register again"; and
//! registering again, with backoff, whenever the head does not know the node.

use std::sync::Arc;
use std::time::Duration;

use rlhf_core::{Error, FailureKind, Resources, Result};
use rlhf_proto::v1 as pb;
use rlhf_proto::PROTOCOL_VERSION;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use super::{fatal, Agent};
use crate::beat;

pub(super) async fn run(
    agent: &Arc<Agent>,
    resources: &Resources,
    address: &str,
    interval: Duration,
    mut reg: pb::RegisterNodeResponse,
    shutdown: &CancellationToken,
) -> Result<()> {
    let mut need_register = false;
    let mut backoff = interval;
    // Set for good once UDP beats were not confirmed: a firewall does not open by itself.
    let mut udp_blocked = false;
    loop {
        if need_register {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tokio::time::sleep(backoff) => {}
            }
            match agent.register(resources, address).await {
                Ok(r) => {
                    tracing::info!(node = %r.node_id, "registered again with the head");
                    need_register = false;
                    backoff = interval;
                    reg = r;
                }
                Err(e) if fatal(&e) => return Err(e),
                Err(e) => {
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    tracing::warn!("head unreachable ({e}); retrying in {backoff:?}");
                }
            }
            continue;
        }
        let udp = match (reg.heartbeat_udp_port, udp_blocked) {
            (0, _) | (_, true) => None,
            (port, false) => {
                let port = u16::try_from(port).map_err(|_| {
                    Error::invalid(format!("the head sent heartbeat UDP port {port}"))
                })?;
                match beat::Sender::connect(
                    &agent.opts.head_address,
                    port,
                    &reg.node_id,
                    &reg.heartbeat_key,
                )
                .await
                {
                    Ok(s) => Some(s),
                    Err(e) => {
                        tracing::warn!("no UDP heartbeats ({e}); beating on the gRPC stream");
                        None
                    }
                }
            }
        };
        match beat_stream(agent, interval, udp, &mut udp_blocked, shutdown).await {
            Ok(StreamEnd::Shutdown) => return Ok(()),
            Ok(StreamEnd::Unknown) => {
                tracing::warn!("the head does not know this node (restarted or marked it dead); registering again");
                need_register = true;
            }
            Err(e) if fatal(&e) => return Err(e),
            Err(e) => {
                tracing::warn!("heartbeat stream broke: {e}");
                need_register = true;
            }
        }
    }
}

/// How a heartbeat stream ended without an error.
enum StreamEnd {
    Shutdown,
    /// The head does not hold this node alive: register again.
    Unknown,
}

fn ended() -> Error {
    Error::new(
        FailureKind::Unavailable,
        "the head ended the heartbeat stream",
    )
}

/// Deadline for the head to accept a heartbeat stream and answer its first message.
const STREAM_OPEN: Duration = Duration::from_secs(5);

/// UDP beats sent, and beat periods passed (at least [`UDP_CONFIRM_MIN`]), without the head
/// confirming one before the node beats on the stream instead.
const UDP_UNCONFIRMED_BEATS: u32 = 3;
const UDP_CONFIRM_MIN: Duration = Duration::from_secs(2);

/// One heartbeat stream: a beat every `interval` (over `udp` while the head confirms it,
/// else on the stream) until the head says the node is unknown, the connection breaks (the
/// channel's HTTP/2 keepalive finds a silent head) or shutdown.
async fn beat_stream(
    agent: &Arc<Agent>,
    interval: Duration,
    mut udp: Option<beat::Sender>,
    udp_blocked: &mut bool,
    shutdown: &CancellationToken,
) -> Result<StreamEnd> {
    let mut head = agent.head.clone();
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let hello = pb::HeartbeatRequest {
        protocol_version: PROTOCOL_VERSION,
        node_id: crate::lock(&agent.node_id).clone(),
    };
    let _ = tx.try_send(hello);
    let opened = async {
        let mut answers = head
            .heartbeat_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await?
            .into_inner();
        let first = answers.message().await?;
        Ok::<_, Status>((answers, first))
    };
    let (mut answers, first) = match tokio::time::timeout(STREAM_OPEN, opened).await {
        Ok(r) => r.map_err(Error::from)?,
        Err(_) => {
            return Err(Error::new(
                FailureKind::Timeout,
                format!(
                    "the head did not answer a heartbeat stream within {} s",
                    STREAM_OPEN.as_secs()
                ),
            ))
        }
    };
    match first {
        Some(a) if a.known => {}
        Some(_) => return Ok(StreamEnd::Unknown),
        None => return Err(ended()),
    }
    let mut tick = tokio::time::interval(interval);
    // After a stall (a loaded machine, a paused process) beats resume at their period, not
    // in a burst of the missed ones.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    let (mut confirmed, mut unconfirmed) = (false, 0u32);
    let udp_since = std::time::Instant::now();
    let confirm_within = (interval * UDP_UNCONFIRMED_BEATS).max(UDP_CONFIRM_MIN);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(StreamEnd::Shutdown),
            a = answers.message() => match a.map_err(Error::from)? {
                Some(a) if !a.known => return Ok(StreamEnd::Unknown),
                Some(a) => confirmed |= a.udp_confirmed,
                None => return Err(ended()),
            },
            _ = tick.tick() => {
                if let Some(u) = udp.as_mut() {
                    if confirmed
                        || unconfirmed < UDP_UNCONFIRMED_BEATS
                        || udp_since.elapsed() < confirm_within
                    {
                        unconfirmed += u32::from(!confirmed);
                        u.send()?;
                        continue;
                    }
                    tracing::warn!(
                        "UDP heartbeats to {} do not reach the head (is UDP port {} open?); beating on the gRPC stream instead",
                        u.to,
                        u.to.port()
                    );
                    udp = None;
                    *udp_blocked = true;
                }
                // A full queue skips this beat: the connection is slow, and a dead one is
                // found by the channel's keepalive, not here.
                if tx.try_send(pb::HeartbeatRequest::default()).is_err() {
                    tracing::debug!("heartbeat queue full; beat skipped");
                }
            }
        }
    }
}
