//! Batch calls over control frames: a role call's request batch and its answer batch travel
//! as their raw encoding (`rlhf_core::batch::encode`'s bytes) right after a small frame,
//! instead of as a gRPC stream of chunks over HTTP/2.
//!
//! Why: between hosts, where shared memory cannot reach, a 64–256 MiB batch streamed over
//! HTTP/2 moved at 0.47–0.60 of a raw TCP copy between the same processes. The difference
//! is user-space work: HTTP/2 framing and flow control, protobuf chunks, and a decoder
//! that copies every byte once more into freshly allocated (so page-faulting) buffers.
//! Here the sender writes the tensors' bytes from where they live, and the receiver reads
//! them straight into one buffer of a small pool (so its pages are already mapped after the
//! first batch) and decodes the batch as views of it, without a copy
//! (`rlhf_core::batch::decode_view`).
//!
//! How it fits the gRPC services: the call itself is still a gRPC call, dispatched into the
//! same tonic routes behind the same token check. The batch rides beside it as a request
//! extension ([`FramedBatch`]) with an empty message stream, and a handler that finds one
//! answers with its batch in the response's extensions. A client puts the extension on a
//! request only for a server it reaches over frames (`crate::direct::Transport::frames`).

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rlhf_core::batch::{decode_view, SharedRegion};
use rlhf_core::DataBatch;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A batch that travels beside a gRPC call over control frames: in a request's extensions,
/// the batch the call is about; in a response's, the answer.
#[derive(Clone, Debug)]
pub struct FramedBatch(pub DataBatch);

impl FramedBatch {
    /// Takes the batch out of a tonic request or response's extensions.
    pub fn take(ext: &mut http::Extensions) -> Option<DataBatch> {
        ext.remove::<FramedBatch>().map(|f| f.0)
    }
}

/// Largest request batch a server reads over frames: what it takes streamed.
pub const MAX_REQUEST_BYTES: u64 = crate::actor::MAX_BATCH_BYTES;
/// Largest answer batch a client reads over frames.
pub const MAX_ANSWER_BYTES: u64 = 8 << 30;

/// Bytes moved per socket read or write, each under its own deadline.
const PIECE: usize = 4 << 20;

/// The slowest a whole batch may move, bytes per second, beyond one piece's limit: a peer
/// that keeps every piece just inside its limit (4 MiB per 30 s) would otherwise hold a
/// 4 GiB batch for hours; at this floor it gets about an hour. Low on purpose: the driver
/// sends to every rank at once over one link, so a rank's share of a 1 Gbit/s link with a
/// hundred ranks is about this much.
pub(super) const MIN_RATE: f64 = (1u64 << 20) as f64;

/// The deadlines of one batch's transfer: each piece within `limit`, and the whole within
/// `limit` plus its size at [`MIN_RATE`].
#[derive(Debug, Clone, Copy)]
struct Pace {
    limit: Duration,
    start: tokio::time::Instant,
    whole: Duration,
    len: u64,
    min_rate: f64,
}

impl Pace {
    fn new(limit: Duration, len: u64, min_rate: f64) -> Self {
        Self {
            limit,
            start: tokio::time::Instant::now(),
            whole: limit + Duration::from_secs_f64(len as f64 / min_rate),
            len,
            min_rate,
        }
    }

    /// Moves one piece by `io` under both deadlines; `done` bytes moved before it.
    async fn piece<F, T>(&self, what: &str, done: usize, io: F) -> std::io::Result<T>
    where
        F: std::future::Future<Output = std::io::Result<T>>,
    {
        let left = self.whole.saturating_sub(self.start.elapsed());
        match tokio::time::timeout(self.limit.min(left), io).await {
            Ok(r) => r,
            Err(_) if left < self.limit => Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "a batch of {} bytes too slow: {done} bytes {what} in {:?}, the most it \
                     may take is {:?} (at least {:.1} MiB/s; the link or the peer is \
                     overloaded)",
                    self.len,
                    self.start.elapsed(),
                    self.whole,
                    self.min_rate / (1u64 << 20) as f64
                ),
            )),
            Err(_) => Err(stalled(what, self.limit)),
        }
    }
}

/// Writes `batch`'s encoding: the header, then every tensor's bytes from its own storage.
/// Each piece must leave within `limit` (a reader that stopped reading fails the call), and
/// the whole encoding at no less than [`MIN_RATE`].
pub(super) async fn write_batch<W: AsyncWriteExt + Unpin>(
    w: &mut W,
    head: &[u8],
    batch: &DataBatch,
    limit: Duration,
) -> std::io::Result<()> {
    let len = head.len() + batch.tensors.values().map(|t| t.data.len()).sum::<usize>();
    let pace = Pace::new(limit, len as u64, MIN_RATE);
    let pieces = std::iter::once(head).chain(batch.tensors.values().map(|t| &t.data[..]));
    let mut done = 0;
    for bytes in pieces {
        for piece in bytes.chunks(PIECE) {
            pace.piece("sent", done, w.write_all(piece)).await?;
            done += piece.len();
        }
    }
    // Under TLS the last records may still wait in the session's buffer for a peer that
    // stopped reading: the flush keeps the same deadlines.
    pace.piece("sent", done, w.flush()).await
}

fn stalled(what: &str, limit: Duration) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("no batch bytes {what} for {limit:?} (the peer stopped or is unreachable)"),
    )
}

/// Reads a `len`-byte batch encoding into a pooled buffer and decodes it as views of it.
/// `len` is checked against `max` before anything is allocated; each piece must arrive
/// within `limit`. The outer error leaves the stream out of step (close it); the inner one,
/// bytes that are not a batch, leaves it in step (the call can be answered).
pub(super) async fn read_batch<R: AsyncReadExt + Unpin>(
    r: &mut R,
    len: u64,
    max: u64,
    limit: Duration,
) -> std::io::Result<std::result::Result<DataBatch, String>> {
    read_into(r, len, max, Pace::new(limit, len, MIN_RATE), global()).await
}

async fn read_into<R: AsyncReadExt + Unpin>(
    r: &mut R,
    len: u64,
    max: u64,
    pace: Pace,
    pool: &'static BufferPool,
) -> std::io::Result<std::result::Result<DataBatch, String>> {
    if len > max {
        return Err(super::invalid(format!(
            "a framed batch of {len} bytes is over the {max}-byte limit"
        )));
    }
    let len = usize::try_from(len)
        .map_err(|_| super::invalid(format!("a framed batch of {len} bytes does not fit")))?;
    let mut buf = pool.take(len);
    for (i, piece) in buf[..len].chunks_mut(PIECE).enumerate() {
        // A failed read drops the buffer: whatever it holds is not a batch.
        pace.piece("received", i * PIECE, r.read_exact(piece))
            .await?;
    }
    let region: Arc<dyn SharedRegion> = Arc::new(Received {
        buf: Some(buf),
        len,
        pool,
    });
    Ok(decode_view(region, 0).map_err(|e| e.to_string()))
}

/// A received encoding: the tensors of the batch decoded from it are views of it; when the
/// last one is gone the buffer goes back to its pool.
struct Received {
    buf: Option<Box<[u8]>>,
    len: usize,
    pool: &'static BufferPool,
}

impl SharedRegion for Received {
    fn bytes(&self) -> &[u8] {
        self.buf.as_deref().map_or(&[], |b| &b[..self.len])
    }
}

impl Drop for Received {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.give_back(b);
        }
    }
}

/// Buffers kept for the next batches: at most this many,
const POOL_BUFFERS: usize = 4;
/// none bigger than this (a bigger batch pays its page faults, and its memory goes back
/// to the system as soon as the batch is dropped),
const POOL_MAX_BUFFER: usize = 1 << 30;
/// and none idle longer than this (dropped by the next batch, or by the sweeper thread
/// within a quarter of this).
const POOL_IDLE: Duration = Duration::from_secs(60);
/// Smallest buffer made.
const MIN_BUFFER: usize = 1 << 20;

/// Receive buffers kept between batches, so their pages stay mapped: a fresh buffer costs
/// a page fault per 4 KiB on its first fill, which took longer than the copy itself here.
#[derive(Default)]
struct BufferPool(Mutex<Vec<(Box<[u8]>, Instant)>>);

/// The pool every framed batch of this process is received into. A thread drops its idle
/// buffers, so a process that stops receiving batches gives their memory back (up to 4 GiB)
/// without waiting for a next batch that may never come.
fn global() -> &'static BufferPool {
    static POOL: OnceLock<BufferPool> = OnceLock::new();
    POOL.get_or_init(|| {
        let spawned = std::thread::Builder::new()
            .name("rlhf-batch-pool".into())
            .spawn(|| loop {
                std::thread::sleep(POOL_IDLE / 4);
                if let Some(p) = POOL.get() {
                    p.sweep();
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("no sweeper for idle batch buffers ({e}); the next batch drops them");
        }
        BufferPool::default()
    })
}

/// Rounds a size up to a quarter step of its power of two (at most 19 % unused), so
/// batches of slightly different sizes reuse the same buffer.
fn buffer_size(need: usize) -> usize {
    let need = need.max(MIN_BUFFER);
    let step = (need.next_power_of_two() / 8).max(4096);
    need.div_ceil(step) * step
}

impl BufferPool {
    /// The smallest pooled buffer of at least `len` bytes, or a new one.
    fn take(&self, len: usize) -> Box<[u8]> {
        if let Ok(mut p) = self.0.lock() {
            p.retain(|(_, t)| t.elapsed() <= POOL_IDLE);
            let best = p
                .iter()
                .enumerate()
                // Not a buffer far bigger than the batch: a view kept would pin all of it.
                .filter(|(_, (b, _))| b.len() >= len && b.len() <= buffer_size(len) * 2)
                .min_by_key(|(_, (b, _))| b.len())
                .map(|(i, _)| i);
            if let Some(i) = best {
                return p.swap_remove(i).0;
            }
        }
        // Zeroed by the allocator (fresh pages from the system): no pass over them here.
        vec![0u8; buffer_size(len)].into_boxed_slice()
    }

    /// Drops the buffers idle longer than [`POOL_IDLE`].
    fn sweep(&self) {
        if let Ok(mut p) = self.0.lock() {
            p.retain(|(_, t)| t.elapsed() <= POOL_IDLE);
        }
    }

    fn give_back(&self, b: Box<[u8]>) {
        if b.len() > POOL_MAX_BUFFER {
            return;
        }
        if let Ok(mut p) = self.0.lock() {
            p.retain(|(_, t)| t.elapsed() <= POOL_IDLE);
            p.push((b, Instant::now()));
            if p.len() > POOL_BUFFERS {
                // Keep the biggest: a small batch fits a big buffer, not the other way round.
                p.sort_by_key(|(b, _)| std::cmp::Reverse(b.len()));
                p.truncate(POOL_BUFFERS);
            }
        }
    }

    /// Buffers in the pool now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.0.lock().map(|p| p.len()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlhf_core::batch::{encode, TensorData};

    fn batch(floats: usize, seed: f32) -> DataBatch {
        let v: Vec<f32> = (0..floats).map(|i| i as f32 + seed).collect();
        DataBatch::new()
            .with_tensor("a", TensorData::from_f32(vec![1, floats], &v).unwrap())
            .with_tensor("b", TensorData::from_i64(vec![1, 3], &[1, 2, 3]).unwrap())
            .with_column("prompt", vec![serde_json::json!("p")])
    }

    fn pace(limit: Duration, len: u64) -> Pace {
        Pace::new(limit, len, MIN_RATE)
    }

    /// Writes `b` as the sender does and reads it into `pool`.
    async fn round_trip(b: &DataBatch, pool: &'static BufferPool) -> DataBatch {
        let (mut w, mut r) = tokio::io::duplex(1 << 16);
        let (head, len) = rlhf_core::batch::encode_header_sized(b).unwrap();
        assert_eq!(len as usize, encode(b).unwrap().len());
        let limit = Duration::from_secs(5);
        let (sent, got) = tokio::join!(
            write_batch(&mut w, &head, b, limit),
            read_into(&mut r, len, u64::MAX, pace(limit, len), pool)
        );
        sent.unwrap();
        got.unwrap().unwrap()
    }

    #[tokio::test]
    async fn a_batch_arrives_as_views_of_a_buffer_reused_for_the_next() {
        static POOL: OnceLock<BufferPool> = OnceLock::new();
        let pool = POOL.get_or_init(BufferPool::default);
        let first = batch(3 << 18, 0.0);
        let got = round_trip(&first, pool).await;
        assert_eq!(got, first);
        assert!(got.tensors["a"].data.is_view());
        let at = got.tensors["a"].data.as_ptr();
        // A view alive keeps the buffer out of the pool; a copy of a tensor does not.
        let kept = got.tensors["b"].clone();
        drop(got);
        assert_eq!(pool.len(), 0);
        drop(kept);
        assert_eq!(pool.len(), 1);
        let second = batch(3 << 18, 7.0);
        let again = round_trip(&second, pool).await;
        assert_eq!(again, second);
        assert_eq!(
            again.tensors["a"].data.as_ptr(),
            at,
            "the second batch of the same size lands in the first one's buffer"
        );
        assert_eq!(pool.len(), 0);
    }

    #[tokio::test]
    async fn over_the_limit_stalled_or_corrupt_is_an_error_not_a_hang() {
        static POOL: OnceLock<BufferPool> = OnceLock::new();
        let pool = POOL.get_or_init(BufferPool::default);
        let (mut w, mut r) = tokio::io::duplex(1 << 16);
        let limit = Duration::from_millis(200);
        let e = read_into(&mut r, 10 << 30, 8 << 30, pace(limit, 10 << 30), pool)
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains("over the 8589934592-byte limit"),
            "{e}"
        );
        // Half the announced bytes, then silence: the reader gives up within its limit.
        let b = encode(&batch(1000, 0.0)).unwrap();
        w.write_all(&b[..b.len() / 2]).await.unwrap();
        let t = Instant::now();
        let e = read_into(
            &mut r,
            b.len() as u64,
            u64::MAX,
            pace(limit, b.len() as u64),
            pool,
        )
        .await
        .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        // Bytes that are not a batch encoding are refused by the decoder's checks.
        let (mut w, mut r) = tokio::io::duplex(1 << 16);
        w.write_all(&[7u8; 64]).await.unwrap();
        let e = read_into(&mut r, 64, u64::MAX, pace(limit, 64), pool)
            .await
            .unwrap()
            .unwrap_err();
        assert!(e.contains("malformed batch encoding"), "{e}");
    }

    #[test]
    fn the_sweeper_drops_only_idle_buffers() {
        let pool = BufferPool::default();
        pool.give_back(vec![0u8; MIN_BUFFER].into_boxed_slice());
        let Some(then) = Instant::now().checked_sub(POOL_IDLE + Duration::from_secs(1)) else {
            return; // a clock too young to hold an idle buffer
        };
        pool.0
            .lock()
            .unwrap()
            .push((vec![0u8; MIN_BUFFER].into_boxed_slice(), then));
        assert_eq!(pool.len(), 2);
        pool.sweep();
        assert_eq!(
            pool.len(),
            1,
            "the idle buffer is dropped, the fresh one kept"
        );
    }

    // Paused time: the clock moves only when every task waits, so the trickle's pieces and
    // the deadlines fall exactly where the comments say, however loaded the machine is.
    #[tokio::test(start_paused = true)]
    async fn a_batch_trickled_inside_each_pieces_limit_still_ends_at_the_rate_floor() {
        static POOL: OnceLock<BufferPool> = OnceLock::new();
        let pool = POOL.get_or_init(BufferPool::default);
        // 3 pieces; each arrives within the 2 s piece limit (one per 1.5 s), but the whole
        // may take 2 s + 12 MiB at 16 MiB/s = 2.75 s: the third piece is cut off there.
        let len = 3 * PIECE;
        let (mut w, mut r) = tokio::io::duplex(PIECE);
        let trickle = tokio::spawn(async move {
            for _ in 0..3 {
                tokio::time::sleep(Duration::from_millis(1500)).await;
                if w.write_all(&vec![0u8; PIECE]).await.is_err() {
                    return;
                }
            }
        });
        let limit = Duration::from_secs(2);
        let t = tokio::time::Instant::now();
        let e = read_into(
            &mut r,
            len as u64,
            u64::MAX,
            Pace::new(limit, len as u64, (16u64 << 20) as f64),
            pool,
        )
        .await
        .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
        assert!(e.to_string().contains("too slow"), "{e}");
        assert_eq!(t.elapsed(), Duration::from_millis(2750), "{e}");
        trickle.abort();
    }

    /// Takes every write, never finishes a flush: a TLS session whose peer stopped reading
    /// with the last records still buffered.
    struct StuckFlush;

    impl tokio::io::AsyncWrite for StuckFlush {
        fn poll_write(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            std::task::Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Pending
        }
        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Pending
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_and_a_frame_whose_flush_never_ends_fail_at_their_deadline() {
        let b = batch(1000, 1.0);
        let (head, _) = rlhf_core::batch::encode_header_sized(&b).unwrap();
        let limit = Duration::from_secs(2);
        let t = tokio::time::Instant::now();
        // Without a deadline of its own the write would wait forever: the hour says so.
        let e = tokio::time::timeout(
            Duration::from_secs(3600),
            write_batch(&mut StuckFlush, &head, &b, limit),
        )
        .await
        .expect("the write waits on the flush with no deadline")
        .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
        assert_eq!(t.elapsed(), limit, "{e}");
        let t = tokio::time::Instant::now();
        let e = tokio::time::timeout(
            Duration::from_secs(3600),
            super::super::write_frame(&mut StuckFlush, super::super::Kind::Request, b"x"),
        )
        .await
        .expect("the frame waits on the flush with no deadline")
        .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
        assert!(t.elapsed() >= super::super::IDLE_LIMIT, "{:?}", t.elapsed());
    }
}
