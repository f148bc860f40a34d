//! Node liveness at scale. A node beats over UDP ([`crate::beat`]: signed datagrams the
//! head drains in batches every [`DRAIN_EVERY`]) and keeps one long-lived gRPC stream open,
//! over which the head tells it when its UDP beats arrive and when to register again; a node
//! whose datagrams do not get through beats on the stream instead. Either way a beat is an
//! atomic store in the node's slot — no lock on the registry, no allocation. The health tick
//! ([`Beats::check`]) folds the slots into the registry before it judges silence, and ends
//! the stream of every node the registry no longer holds alive.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use rlhf_proto::v1 as pb;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tonic::{Status, Streaming};

use crate::beat;
use crate::clock::Clock;

use super::state::{HeadState, NodeState};

/// How long a new stream may take to name its node.
const FIRST_BEAT: Duration = Duration::from_secs(10);
/// The UDP socket is drained this often: 10,000 nodes at 1 Hz leave ~100 datagrams per
/// drain, well inside the receive buffer, for one wakeup.
const DRAIN_EVERY: Duration = Duration::from_millis(10);
/// Receive buffer asked for the heartbeat socket (the kernel may cap it).
const UDP_RCVBUF: libc::c_int = 4 << 20;

/// One registration of a node: its newest beat, its UDP key, and its stream's switches.
pub struct Slot {
    last_ms: AtomicI64,
    last_seq: AtomicU64,
    key: ring::hmac::Key,
    /// The node is no longer held alive (dead, or gone from the registry): say so, end.
    dead: CancellationToken,
    /// The open stream's switch: a newer stream or registration ends the older stream.
    stream: Mutex<CancellationToken>,
    udp_seen: AtomicBool,
    udp_first: Notify,
}

/// The slots of registered nodes, by node id.
#[derive(Default)]
pub struct Beats {
    slots: RwLock<HashMap<String, Arc<Slot>>>,
}

impl Beats {
    /// A fresh slot for a registration; returns the secret that signs its UDP beats. A
    /// stream of the previous registration ends.
    pub fn register(&self, node_id: &str, now_ms: i64) -> rlhf_core::Result<Vec<u8>> {
        let secret = beat::new_key()?;
        let slot = Arc::new(Slot {
            last_ms: AtomicI64::new(now_ms),
            last_seq: AtomicU64::new(0),
            key: beat::hmac_key(&secret),
            dead: CancellationToken::new(),
            stream: Mutex::new(CancellationToken::new()),
            udp_seen: AtomicBool::new(false),
            udp_first: Notify::new(),
        });
        let old = crate::lock_write(&self.slots).insert(node_id.to_string(), slot);
        if let Some(old) = old {
            crate::lock(&old.stream).cancel();
        }
        Ok(secret)
    }

    /// The slot of a stream opening for `node_id`, with the stream's switch (the previous
    /// stream's is flipped); None without a registration since this head started.
    pub fn attach(&self, node_id: &str, now_ms: i64) -> Option<(Arc<Slot>, CancellationToken)> {
        let slot = crate::lock_read(&self.slots).get(node_id)?.clone();
        slot.last_ms.fetch_max(now_ms, Ordering::Relaxed);
        let tok = CancellationToken::new();
        std::mem::replace(&mut *crate::lock(&slot.stream), tok.clone()).cancel();
        Some((slot, tok))
    }

    /// The health check: folds the newest beats into the registry, marks nodes silent past
    /// `threshold_ms` dead (returned), and ends the streams of every node the registry does
    /// not hold alive. One pass over the nodes with hash lookups: it runs up to twice a second
    /// with 10,000 nodes.
    pub fn check(
        &self,
        state: &mut HeadState,
        now_ms: i64,
        threshold_ms: i64,
    ) -> rlhf_core::Result<Vec<String>> {
        let mut gone = Vec::new();
        {
            let slots = crate::lock_read(&self.slots);
            for n in state.nodes.values_mut() {
                match (n.state, slots.get(&n.node_id)) {
                    (NodeState::Alive, Some(s)) => {
                        n.last_heartbeat_ms =
                            n.last_heartbeat_ms.max(s.last_ms.load(Ordering::Relaxed));
                    }
                    (NodeState::Dead, Some(_)) => gone.push(n.node_id.clone()),
                    _ => {}
                }
            }
        }
        let dead = state.check_health(now_ms, threshold_ms)?;
        let mut slots = crate::lock_write(&self.slots);
        for id in dead.iter().chain(&gone) {
            if let Some(s) = slots.remove(id) {
                s.dead.cancel();
            }
        }
        Ok(dead)
    }
}

/// Takes one datagram: true when it was a valid, new beat of a registered node.
fn take(slots: &HashMap<String, Arc<Slot>>, d: &[u8], now_ms: i64) -> bool {
    let Some(b) = beat::parse(d) else {
        return false;
    };
    let Some(slot) = slots.get(b.node_id) else {
        return false;
    };
    // Verified before the sequence moves, so a forged datagram cannot block real ones.
    if !b.verify(&slot.key) || slot.last_seq.fetch_max(b.seq, Ordering::Relaxed) >= b.seq {
        return false;
    }
    slot.last_ms.fetch_max(now_ms, Ordering::Relaxed);
    if !slot.udp_seen.swap(true, Ordering::Relaxed) {
        slot.udp_first.notify_one();
    }
    true
}

/// Binds the heartbeat socket beside the gRPC port; None (nodes beat on their streams)
/// when it cannot.
pub fn bind_udp(host: &str, port: u16) -> Option<std::net::UdpSocket> {
    match std::net::UdpSocket::bind((host, port)) {
        Ok(s) => {
            use std::os::fd::AsRawFd;
            // The kernel may cap it; a smaller buffer only drops beats under a burst.
            let _ = crate::net::set_int_option(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                UDP_RCVBUF,
            );
            Some(s)
        }
        Err(e) => {
            tracing::warn!(
                "no UDP heartbeats ({host}:{port}/udp: {e}); nodes beat on their gRPC streams"
            );
            None
        }
    }
}

/// Datagrams taken per `recvmmsg` call.
const BATCH: usize = 64;

/// Buffers for one `recvmmsg` call: [`BATCH`] datagrams in one syscall.
struct RecvBatch {
    bufs: Box<[u8]>,
    iov: Box<[libc::iovec]>,
    hdrs: Box<[libc::mmsghdr]>,
}

// SAFETY: the raw pointers in `iov` and `hdrs` point only into this value's own heap
// buffers, which move with it and are never reallocated; nothing else aliases them.
unsafe impl Send for RecvBatch {}

impl RecvBatch {
    fn new() -> Self {
        let size = beat::MAX_DATAGRAM + 1;
        let mut bufs = vec![0u8; BATCH * size].into_boxed_slice();
        let mut iov: Box<[libc::iovec]> = (0..BATCH)
            .map(|i| libc::iovec {
                // SAFETY: i * size is within the BATCH * size bytes of `bufs`.
                iov_base: unsafe { bufs.as_mut_ptr().add(i * size) }.cast(),
                iov_len: size,
            })
            .collect();
        let hdrs = (0..BATCH)
            .map(|i| {
                // SAFETY: mmsghdr is plain C data; all-zero is a valid empty header.
                let mut h: libc::mmsghdr = unsafe { std::mem::zeroed() };
                // SAFETY: i < BATCH, the length of `iov`.
                h.msg_hdr.msg_iov = unsafe { iov.as_mut_ptr().add(i) };
                h.msg_hdr.msg_iovlen = 1;
                h
            })
            .collect();
        RecvBatch { bufs, iov, hdrs }
    }

    /// Takes up to [`BATCH`] queued datagrams without blocking; WouldBlock when none.
    fn recv(&mut self, fd: std::os::fd::RawFd) -> std::io::Result<usize> {
        debug_assert_eq!(self.iov.len(), BATCH);
        // SAFETY: `hdrs` holds BATCH headers, each pointing at its own iovec of `iov`, which
        // points at its own region of `bufs`; all live for the call. No source address is
        // asked for (msg_name is null) and MSG_DONTWAIT keeps the call from blocking.
        let n = unsafe {
            libc::recvmmsg(
                fd,
                self.hdrs.as_mut_ptr(),
                BATCH as libc::c_uint,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
            )
        };
        if n < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }

    fn datagram(&self, i: usize) -> &[u8] {
        let size = beat::MAX_DATAGRAM + 1;
        let len = (self.hdrs[i].msg_len as usize).min(size);
        &self.bufs[i * size..i * size + len]
    }
}

/// Drains the heartbeat socket every [`DRAIN_EVERY`] until `shutdown`, on a thread of its
/// own: the socket is not in the async runtime's epoll set, where every arriving datagram
/// would wake a worker thread (thousands of wakeups a second at scale, for nothing).
pub fn spawn_receiver(
    socket: std::net::UdpSocket,
    beats: Arc<Beats>,
    clock: Arc<dyn Clock>,
    shutdown: CancellationToken,
) -> rlhf_core::Result<()> {
    std::thread::Builder::new()
        .name("rlhf-head-beats".into())
        .spawn(move || receive(socket, &beats, clock.as_ref(), &shutdown))
        .map(|_| ())
        .map_err(|e| rlhf_core::Error::io("starting the heartbeat receiver", e))
}

fn receive(
    socket: std::net::UdpSocket,
    beats: &Beats,
    clock: &dyn Clock,
    shutdown: &CancellationToken,
) {
    use std::os::fd::AsRawFd;
    let fd = socket.as_raw_fd();
    let mut batch = RecvBatch::new();
    let (mut dropped, mut last_warn) = (0u64, std::time::Instant::now());
    while !shutdown.is_cancelled() {
        let now = clock.now_ms();
        {
            let slots = crate::lock_read(&beats.slots);
            loop {
                match batch.recv(fd) {
                    Ok(n) => {
                        for i in 0..n {
                            dropped += u64::from(!take(&slots, batch.datagram(i), now));
                        }
                        if n < BATCH {
                            break;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        tracing::debug!("heartbeat socket: {e}");
                        break;
                    }
                }
            }
        }
        if dropped > 0 && last_warn.elapsed() > Duration::from_secs(10) {
            tracing::warn!(
                "{dropped} heartbeat datagrams dropped: unknown node, bad signature or a replay"
            );
            (dropped, last_warn) = (0, std::time::Instant::now());
        }
        std::thread::sleep(DRAIN_EVERY);
    }
}

pub type BeatStream =
    Pin<Box<dyn futures::Stream<Item = Result<pb::HeartbeatResponse, Status>> + Send>>;

fn answer(known: bool, udp_confirmed: bool) -> Result<pb::HeartbeatResponse, Status> {
    Ok(pb::HeartbeatResponse {
        known,
        udp_confirmed,
    })
}

/// Serves one node's stream, whose first message was answered by the registry (`attached`
/// is None when the node must register again). It ends when the head shuts down, so the
/// server's graceful stop does not wait for the nodes' streams, which never end by themselves.
pub fn serve(
    mut inbound: Streaming<pb::HeartbeatRequest>,
    attached: Option<(Arc<Slot>, CancellationToken)>,
    clock: Arc<dyn Clock>,
    shutdown: CancellationToken,
) -> BeatStream {
    let (tx, rx) = tokio::sync::mpsc::channel(2);
    let Some((slot, superseded)) = attached else {
        let _ = tx.try_send(answer(false, false));
        return Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx));
    };
    let _ = tx.try_send(answer(true, false));
    tokio::spawn(async move {
        loop {
            tokio::select! {
                biased;
                _ = slot.dead.cancelled() => {
                    let _ = tx.send(answer(false, false)).await;
                    break;
                }
                _ = superseded.cancelled() => break,
                _ = shutdown.cancelled() => break,
                _ = slot.udp_first.notified() => {
                    let _ = tx.send(answer(true, true)).await;
                }
                m = inbound.message() => match m {
                    Ok(Some(_)) => {
                        slot.last_ms.fetch_max(clock.now_ms(), Ordering::Relaxed);
                    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn last(beats: &Beats, id: &str) -> i64 {
        crate::lock_read(&beats.slots)[id]
            .last_ms
            .load(Ordering::Relaxed)
    }

    #[test]
    fn only_signed_new_beats_of_a_registered_node_count() {
        let beats = Beats::default();
        let key = beat::hmac_key(&beats.register("n1", 1000).unwrap());
        let take_at = |d: &[u8], now| take(&crate::lock_read(&beats.slots), d, now);
        let d1 = beat::encode("n1", 1, &key).unwrap();
        assert!(take_at(&d1, 2000));
        assert_eq!(last(&beats, "n1"), 2000);
        assert!(!take_at(&d1, 3000), "a replay counted");
        let forged = beat::hmac_key(&beat::new_key().unwrap());
        assert!(!take_at(&beat::encode("n1", 9, &forged).unwrap(), 3000));
        assert!(!take_at(&beat::encode("n2", 9, &key).unwrap(), 3000));
        assert_eq!(last(&beats, "n1"), 2000);
        // The forged datagram did not move the sequence: the real next beat still counts.
        assert!(take_at(&beat::encode("n1", 2, &key).unwrap(), 4000));
        assert_eq!(last(&beats, "n1"), 4000);
        // A new registration has a new key; the old one is refused.
        let key2 = beat::hmac_key(&beats.register("n1", 5000).unwrap());
        assert!(!take_at(&beat::encode("n1", 3, &key).unwrap(), 6000));
        assert!(take_at(&beat::encode("n1", 1, &key2).unwrap(), 6000));
        assert_eq!(last(&beats, "n1"), 6000);
    }
}
