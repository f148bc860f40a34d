//! How the ranks find each other (see the module docs of `super` for the protocol): rank 0's
//! rendezvous, the JOIN and its address table, the RING links, and connecting with retry.
//! Every connection is checked before it is trusted (the hello's bytes: `hello.rs`); strays
//! are dropped.

use std::collections::VecDeque;
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::conn::Conn;
use super::frame::{check_args, io_err, mismatch, remaining, set_io_timeout, tune};
use super::hello::{
    authenticate, put_str, read_hello, read_join_answer, send_hello, send_join_error, Hello,
};
use super::{Link, TcpCommunicator};
use crate::error::{Error, Op, Result};
use crate::{CommConfig, Communicator};

pub(super) const HELLO_MAGIC: [u8; 8] = *b"RLHFCOL\x02";
pub(super) const KIND_JOIN: u8 = 1;
pub(super) const KIND_RING: u8 = 2;
/// Connections dropped by one wait that are logged; the rest are only counted.
const MAX_LOGGED_DROPS: u32 = 10;
/// JOIN answer status codes.
pub(super) const JOIN_MISMATCH: u8 = 1;
pub(super) const JOIN_TIMEOUT: u8 = 2;

/// Rank 0's listening side of the rendezvous.
#[derive(Debug)]
pub struct TcpRendezvous {
    listener: TcpListener,
    addr: SocketAddr,
}

impl TcpRendezvous {
    /// Listens on `addr` ("host:port"; port 0 picks a free port).
    pub fn bind(addr: &str) -> Result<Self> {
        let listener = TcpListener::bind(addr).map_err(|e| Error::Io {
            op: Op::Rendezvous,
            rank: 0,
            peer: None,
            context: format!(
                "rank 0 cannot listen on master address {addr} (in use? pass port 0 to pick a free one)"
            ),
            source: e,
        })?;
        let addr = listener.local_addr().map_err(|e| Error::Io {
            op: Op::Rendezvous,
            rank: 0,
            peer: None,
            context: "reading the bound master address".into(),
            source: e,
        })?;
        Ok(Self { listener, addr })
    }

    /// The address rank 0 actually listens on; publish it to the other ranks.
    /// When bound to `0.0.0.0`, publish this host's reachable IP with this port.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits for ranks `1..world_size` to join and builds rank 0's communicator.
    pub fn accept(self, world_size: usize, config: CommConfig) -> Result<TcpCommunicator> {
        check_args(0, world_size, &config)?;
        if world_size == 1 {
            return Ok(TcpCommunicator::new(0, 1, config, None));
        }
        let deadline = Instant::now() + config.timeout;
        let master = self.addr.to_string();
        let n = world_size;

        // JOIN phase: collect every other rank's hello.
        let mut joined: Vec<Option<(Conn, String)>> = (0..n).map(|_| None).collect();
        let mut missing = n - 1;
        let result = (|| {
            let never = AtomicBool::new(false);
            let mut gate = HelloGate::new(&self.listener, &config, 0)?;
            while missing > 0 {
                let (stream, hello) = gate.next(
                    deadline,
                    &never,
                    || {
                        let left: Vec<String> = (1..n)
                            .filter(|r| joined[*r].is_none())
                            .map(|r| r.to_string())
                            .collect();
                        format!(
                        "; ranks {} never joined at {master}: were they started, with this address?",
                        left.join(", ")
                    )
                    },
                )?;
                if hello.kind != KIND_JOIN {
                    continue;
                }
                if hello.world != n {
                    let msg = format!(
                        "rank {} was started with world_size {} but rank 0 with {n}: \
                         every rank must get the same world_size",
                        hello.rank, hello.world
                    );
                    let _ = send_join_error(&stream, JOIN_MISMATCH, &msg);
                    return Err(mismatch(Op::Rendezvous, 0, Some(hello.rank), msg));
                }
                if hello.rank == 0 || hello.rank >= n {
                    let msg = format!(
                        "a process joined as rank {} but ranks must be 1..{} (rank 0 is the master)",
                        hello.rank,
                        n - 1
                    );
                    let _ = send_join_error(&stream, JOIN_MISMATCH, &msg);
                    return Err(mismatch(Op::Rendezvous, 0, Some(hello.rank), msg));
                }
                if joined[hello.rank].is_some() {
                    let msg = format!(
                        "two processes joined as rank {}: give each process its own rank",
                        hello.rank
                    );
                    let _ = send_join_error(&stream, JOIN_MISMATCH, &msg);
                    return Err(mismatch(Op::Rendezvous, 0, Some(hello.rank), msg));
                }
                joined[hello.rank] = Some((stream, hello.addr));
                missing -= 1;
            }
            Ok(())
        })();
        if let Err(e) = result {
            for (s, _) in joined.iter().flatten() {
                let code = if e.kind() == crate::ErrorKind::Timeout {
                    JOIN_TIMEOUT
                } else {
                    JOIN_MISMATCH
                };
                let _ = send_join_error(s, code, &format!("rank 0 aborted the rendezvous: {e}"));
            }
            return Err(e);
        }

        // Answer everyone with the address table.
        let mut table = Vec::new();
        table.push(0u8);
        for entry in &joined {
            let a = entry.as_ref().map(|(_, a)| a.as_str()).unwrap_or("");
            put_str(&mut table, a);
        }
        for (r, entry) in joined.iter().enumerate() {
            if let Some((s, _)) = entry {
                (&*s).write_all(&table).map_err(|e| {
                    io_err(Op::Rendezvous, 0, Some(r), "sending the address table", e)
                })?;
            }
        }
        // Ring phase: its own timeout, so a late joiner does not eat into it.
        let deadline = Instant::now() + config.timeout;
        let next_addr = joined[1]
            .as_ref()
            .map(|(_, a)| a.clone())
            .unwrap_or_default();
        let (next, prev) = ring_links(&self.listener, 0, n, &next_addr, deadline, &config)?;
        drop(joined);
        let mut comm = TcpCommunicator::new(0, n, config, Some((next, prev)));
        comm.barrier()?;
        Ok(comm)
    }
}

impl TcpCommunicator {
    /// Joins a group: rank 0 listens on `master` and waits for the others; other
    /// ranks connect to it. With port 0 on rank 0 use [`TcpRendezvous`] instead, so
    /// the chosen port can be published before the others connect.
    pub fn init(rank: usize, world_size: usize, master: &str, config: CommConfig) -> Result<Self> {
        check_args(rank, world_size, &config)?;
        if rank == 0 {
            TcpRendezvous::bind(master)?.accept(world_size, config)
        } else {
            Self::connect(rank, world_size, master, config)
        }
    }

    /// Rank ≥ 1: connects to rank 0 at `master`, retrying until the timeout.
    pub fn connect(
        rank: usize,
        world_size: usize,
        master: &str,
        config: CommConfig,
    ) -> Result<Self> {
        check_args(rank, world_size, &config)?;
        if rank == 0 {
            return Err(Error::InvalidArgument {
                op: Op::Rendezvous,
                detail: "rank 0 listens: use TcpRendezvous::bind(..).accept(..) or TcpCommunicator::init".into(),
            });
        }
        let n = world_size;
        let deadline = Instant::now() + config.timeout;
        let master_conn = connect_conn(rank, 0, master, deadline, &config)?;
        let local_ip = master_conn
            .tcp
            .local_addr()
            .map_err(|e| io_err(Op::Rendezvous, rank, Some(0), "reading local address", e))?
            .ip();
        let listener = TcpListener::bind((local_ip, 0)).map_err(|e| {
            io_err(
                Op::Rendezvous,
                rank,
                None,
                &format!("binding the ring listener on {local_ip}"),
                e,
            )
        })?;
        let my_addr = listener
            .local_addr()
            .map_err(|e| io_err(Op::Rendezvous, rank, None, "reading listener address", e))?;
        set_io_timeout(&master_conn.tcp, remaining(deadline));
        send_hello(
            &master_conn,
            KIND_JOIN,
            (rank, 0),
            n,
            &my_addr.to_string(),
            &config,
        )?;

        // The table arrives only when every rank has joined.
        let table = read_join_answer(&master_conn, rank, n, &config)?;
        let deadline = Instant::now() + config.timeout;
        let next_rank = (rank + 1) % n;
        let next_addr = if next_rank == 0 {
            master.to_string()
        } else {
            table[next_rank].clone()
        };
        let (next, prev) = ring_links(&listener, rank, n, &next_addr, deadline, &config)?;
        drop(master_conn);
        let mut comm = TcpCommunicator::new(rank, n, config, Some((next, prev)));
        comm.barrier()?;
        Ok(comm)
    }
}

/// Connects (with retry) and, with TLS configured, runs the handshake that verifies the
/// peer's certificate; a failed handshake is an authentication error naming the peer.
fn connect_conn(
    rank: usize,
    peer: usize,
    addr: &str,
    deadline: Instant,
    config: &CommConfig,
) -> Result<Conn> {
    let tcp = connect_retry(rank, peer, addr, deadline, config)?;
    set_io_timeout(&tcp, remaining(deadline));
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    Conn::connect(tcp, config.tls.as_ref(), host).map_err(|e| Error::Auth {
        rank,
        peer: Some(peer),
        detail: format!(
            "TLS handshake with {addr} failed ({e}): its certificate must be signed by the cluster CA and name that address"
        ),
    })
}

fn connect_retry(
    rank: usize,
    peer: usize,
    addr: &str,
    deadline: Instant,
    config: &CommConfig,
) -> Result<TcpStream> {
    let mut backoff = Duration::from_millis(10);
    let mut last: String;
    loop {
        match addr.to_socket_addrs() {
            Ok(addrs) => {
                last = format!("{addr} resolved to no address");
                for a in addrs {
                    let t =
                        remaining(deadline).clamp(Duration::from_millis(1), Duration::from_secs(2));
                    match TcpStream::connect_timeout(&a, t) {
                        Ok(s) => {
                            tune(&s, config);
                            set_io_timeout(&s, config.timeout);
                            return Ok(s);
                        }
                        Err(e) => last = format!("{a}: {e}"),
                    }
                }
            }
            Err(e) => {
                return Err(io_err(
                    Op::Rendezvous,
                    rank,
                    Some(peer),
                    &format!("resolving address {addr:?} of rank {peer} (expected host:port)"),
                    e,
                ))
            }
        }
        if Instant::now() + backoff >= deadline {
            return Err(Error::Timeout {
                op: Op::Rendezvous,
                rank,
                peer: Some(peer),
                timeout: config.timeout,
                detail: format!(
                    "; could not connect to {addr} (last error: {last}): is rank {peer} running, \
                     and is that address reachable from this host?"
                ),
            });
        }
        std::thread::sleep(backoff);
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

/// The whole handshake of one accepted connection (TLS, hello, authentication) must end
/// within this, however its bytes trickle in: a peer that dribbles is cut off then.
pub(super) const HANDSHAKE_LIMIT: Duration = Duration::from_secs(5);
/// Handshakes in flight at once; one more evicts the oldest (a real rank's handshake takes
/// well under a millisecond, so only a flood of strangers is ever evicted).
const MAX_PENDING: usize = 64;

/// What a handshake thread reports: the authenticated connection, or why it was dropped.
type Verdict = std::result::Result<(Conn, Hello), String>;

/// A handshake in flight: its socket (to cut it off) and when its time is up.
struct Pending {
    id: u64,
    tcp: TcpStream,
    peer: String,
    until: Instant,
}

/// Accepts connections and runs each one's handshake on its own thread, so a stranger that
/// connects first and then dribbles bytes holds nothing but its own thread, and only for
/// [`HANDSHAKE_LIMIT`]. [`HelloGate::next`] returns the next connection that sent a hello
/// and, with a secret, authenticated; the others are dropped and logged. Dropping the gate
/// cuts off every handshake still in flight.
struct HelloGate<'a> {
    listener: &'a TcpListener,
    config: &'a CommConfig,
    rank: usize,
    tx: mpsc::Sender<(u64, Verdict)>,
    rx: mpsc::Receiver<(u64, Verdict)>,
    pending: VecDeque<Pending>,
    next_id: u64,
    dropped: u32,
}

impl<'a> HelloGate<'a> {
    fn new(listener: &'a TcpListener, config: &'a CommConfig, rank: usize) -> Result<Self> {
        listener
            .set_nonblocking(true)
            .map_err(|e| io_err(Op::Rendezvous, rank, None, "configuring the listener", e))?;
        let (tx, rx) = mpsc::channel();
        Ok(Self {
            listener,
            config,
            rank,
            tx,
            rx,
            pending: VecDeque::new(),
            next_id: 0,
            dropped: 0,
        })
    }

    fn drop_one(&mut self, peer: &str, why: &str) {
        self.dropped += 1;
        if self.dropped <= MAX_LOGGED_DROPS {
            tracing::warn!(
                "collective rendezvous, rank {}: dropped a connection from {peer}: {why}{}",
                self.rank,
                if self.dropped == MAX_LOGGED_DROPS {
                    " (further drops in this wait are not logged)"
                } else {
                    ""
                }
            );
        }
    }

    /// Cuts off a handshake: its thread's blocked read or write fails at once.
    fn cut(&mut self, index: usize, why: &str) {
        if let Some(p) = self.pending.remove(index) {
            let _ = p.tcp.shutdown(Shutdown::Both);
            self.drop_one(&p.peer, why);
        }
    }

    fn start(&mut self, s: TcpStream) {
        let _ = s.set_nonblocking(false);
        tune(&s, self.config);
        let until = Instant::now() + HANDSHAKE_LIMIT;
        set_io_timeout(&s, HANDSHAKE_LIMIT);
        let peer = s
            .peer_addr()
            .map_or_else(|_| "an unknown address".to_string(), |a| a.to_string());
        let Ok(handle) = s.try_clone() else {
            self.drop_one(
                &peer,
                "cannot watch the connection (out of file descriptors?)",
            );
            return;
        };
        if self.pending.len() >= MAX_PENDING {
            self.cut(0, "evicted: too many handshakes in flight at once");
        }
        let id = self.next_id;
        self.next_id += 1;
        let (tx, config) = (self.tx.clone(), self.config.clone());
        let spawned = std::thread::Builder::new()
            .name("rendezvous-hello".into())
            .spawn(move || {
                let verdict = handshake(s, &config);
                let _ = tx.send((id, verdict));
            });
        match spawned {
            Ok(_) => self.pending.push_back(Pending {
                id,
                tcp: handle,
                peer,
                until,
            }),
            Err(e) => self.drop_one(&peer, &format!("cannot start its handshake thread: {e}")),
        }
    }

    /// Waits for the next authenticated hello until `deadline` (or until `stop` is set).
    fn next(
        &mut self,
        deadline: Instant,
        stop: &AtomicBool,
        who_is_missing: impl Fn() -> String,
    ) -> Result<(Conn, Hello)> {
        let rank = self.rank;
        loop {
            while let Ok((id, verdict)) = self.rx.try_recv() {
                let Some(i) = self.pending.iter().position(|p| p.id == id) else {
                    continue; // cut off already (and counted then)
                };
                let p = self.pending.remove(i).expect("index from position");
                match verdict {
                    Ok((s, h)) => {
                        set_io_timeout(&s.tcp, self.config.timeout);
                        return Ok((s, h));
                    }
                    Err(why) => self.drop_one(&p.peer, &why),
                }
            }
            let now = Instant::now();
            // Checked on every pass, not only when no connection waits: a peer that keeps
            // connecting must not keep the wait past its deadline.
            if stop.load(Ordering::Relaxed) {
                return Err(Error::Unavailable {
                    backend: "tcp",
                    reason: format!("rank {rank}: the rendezvous was abandoned"),
                });
            }
            if now >= deadline {
                return Err(Error::Timeout {
                    op: Op::Rendezvous,
                    rank,
                    peer: None,
                    timeout: self.config.timeout,
                    detail: who_is_missing(),
                });
            }
            while self.pending.front().is_some_and(|p| p.until <= now) {
                self.cut(
                    0,
                    &format!("no complete hello within {}s", HANDSHAKE_LIMIT.as_secs()),
                );
            }
            match self.listener.accept() {
                Ok((s, _)) => self.start(s),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // A peer that reset before its accept, or no descriptor free for a moment
                // (a flood of strangers): the wait goes on.
                Err(e)
                    if e.kind() == io::ErrorKind::ConnectionAborted
                        || e.raw_os_error() == Some(libc::EMFILE)
                        || e.raw_os_error() == Some(libc::ENFILE) =>
                {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => {
                    return Err(io_err(
                        Op::Rendezvous,
                        rank,
                        None,
                        "accepting a connection",
                        e,
                    ))
                }
            }
        }
    }
}

impl Drop for HelloGate<'_> {
    fn drop(&mut self) {
        for p in self.pending.drain(..) {
            let _ = p.tcp.shutdown(Shutdown::Both);
        }
    }
}

/// One accepted connection's handshake, on its own thread: TLS, the hello, authentication.
fn handshake(s: TcpStream, config: &CommConfig) -> Verdict {
    match Conn::accept(s, config.tls.as_ref()) {
        Err(e) => Err(format!("TLS handshake: {e}")),
        Ok(s) => match read_hello(&s) {
            Ok(Some(h)) => authenticate(&s, &h, config).map(|()| (s, h)),
            Ok(None) => Err("not a collective hello".to_string()),
            Err(e) => Err(format!("reading its hello: {e}")),
        },
    }
}

/// Connects the link to the next rank while accepting the one from the previous rank: with
/// authentication each connection waits for its acceptor's answer, so doing one after the
/// other would leave every rank waiting on the next around the ring.
fn ring_links(
    listener: &TcpListener,
    rank: usize,
    n: usize,
    next_addr: &str,
    deadline: Instant,
    config: &CommConfig,
) -> Result<(Link, Link)> {
    let next_rank = (rank + 1) % n;
    let stop = AtomicBool::new(false);
    let (next, prev) = std::thread::scope(|s| {
        let prev = s.spawn(|| accept_ring(listener, rank, n, deadline, &stop, config));
        let next = connect_ring(rank, n, next_rank, next_addr, deadline, config);
        if next.is_err() {
            // The ring cannot form: stop waiting for the previous rank.
            stop.store(true, Ordering::Relaxed);
        }
        let prev = prev.join().unwrap_or_else(|_| {
            Err(Error::Unavailable {
                backend: "tcp",
                reason: format!("rank {rank}: the thread accepting the ring link panicked"),
            })
        });
        (next, prev)
    });
    Ok((next?, prev?))
}

fn connect_ring(
    rank: usize,
    n: usize,
    next: usize,
    addr: &str,
    deadline: Instant,
    config: &CommConfig,
) -> Result<Link> {
    let s = connect_conn(rank, next, addr, deadline, config)?;
    send_hello(&s, KIND_RING, (rank, next), n, "", config)?;
    set_io_timeout(&s.tcp, config.timeout);
    Ok(Link {
        stream: s,
        peer: next,
    })
}

fn accept_ring(
    listener: &TcpListener,
    rank: usize,
    n: usize,
    deadline: Instant,
    stop: &AtomicBool,
    config: &CommConfig,
) -> Result<Link> {
    let prev = (rank + n - 1) % n;
    let mut gate = HelloGate::new(listener, config, rank)?;
    loop {
        let (s, h) = gate.next(deadline, stop, || {
            format!("; rank {prev} never connected its ring link")
        })?;
        if h.kind == KIND_RING && h.rank == prev && h.world == n {
            return Ok(Link {
                stream: s,
                peer: prev,
            });
        }
    }
}
