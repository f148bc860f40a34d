//! Connecting and serving: channels with the token, optional TLS, retry with backoff,
//! explicit message limits, and port binding with clear errors.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rlhf_core::{Error, FailureKind, Result};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

use crate::auth::AddToken;
pub use crate::direct::Transport;

/// What every client of the cluster calls through: the token added to each request, over
/// tonic's reconnecting channel ([`connect`]) or one direct connection ([`connect_direct`]).
pub type AuthChannel = InterceptedService<Transport, AddToken>;

/// HTTP/2 flow-control windows. The 64 KiB defaults cap a streamed batch at a fraction of
/// what the link carries (a window update per 64 KiB); a few MiB keep the pipe full.
const STREAM_WINDOW: u32 = 8 << 20;
const CONNECTION_WINDOW: u32 = 32 << 20;
/// Bigger DATA frames: 16 KiB frames cost a frame header and a wakeup each.
const MAX_FRAME: u32 = 1 << 20;

/// The server builder every service of the cluster uses: same windows as the clients.
pub fn server_builder() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .initial_stream_window_size(Some(STREAM_WINDOW))
        .initial_connection_window_size(Some(CONNECTION_WINDOW))
        .max_frame_size(Some(MAX_FRAME))
        // A peer that vanished without closing (power loss, a cut link) is found by pings,
        // not by waiting on a connection forever.
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .tcp_keepalive(Some(Duration::from_secs(60)))
}

/// Socket settings for a connection a server of this crate accepted itself (tonic sets
/// them only on connections it accepts): no Nagle delay, and TCP keepalive probes after
/// 60 s of silence (every 10 s, 6 times), so an idle connection from a peer that vanished
/// is closed within about two minutes instead of held forever.
pub(crate) fn tune_accepted(s: &tokio::net::TcpStream) {
    use nix::sys::socket::{setsockopt, sockopt};
    let _ = s.set_nodelay(true);
    let set = setsockopt(s, sockopt::KeepAlive, &true)
        .and_then(|()| setsockopt(s, sockopt::TcpKeepIdle, &60))
        .and_then(|()| setsockopt(s, sockopt::TcpKeepInterval, &10))
        .and_then(|()| setsockopt(s, sockopt::TcpKeepCount, &6));
    if let Err(e) = set {
        tracing::debug!("TCP keepalive on an accepted connection: {e}");
    }
}

/// How a client reaches a server of this cluster.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    pub token: String,
    /// CA certificate (PEM) that verifies the server; enables TLS.
    pub tls_ca: Option<PathBuf>,
    /// Name expected in the server certificate; defaults to the host of the address.
    pub tls_domain: Option<String>,
    pub connect_timeout: Duration,
    /// HTTP/2 keepalive ping period of the channel (a silent server is found within this
    /// plus 20 s).
    pub keepalive: Duration,
    /// Whether [`connect_direct`] sends unary calls as control frames (`crate::frames`) to a
    /// server that speaks them; true unless a test or bench compares with HTTP/2.
    pub control_frames: bool,
}

impl ClientOptions {
    pub fn new(token: impl Into<String>) -> Self {
        Self {
            token: token.into(),
            tls_ca: None,
            tls_domain: None,
            connect_timeout: Duration::from_secs(30),
            keepalive: Duration::from_secs(10),
            control_frames: true,
        }
    }
}

/// Server TLS from `--tls-cert`/`--tls-key`.
#[derive(Clone, Debug, Default)]
pub struct ServerTls {
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// The cluster CA, for peers this process connects to directly (role processes'
    /// collectives); None where only gRPC clients verify.
    pub ca: Option<PathBuf>,
}

impl ServerTls {
    /// `--tls-cert` and `--tls-key`: both, or neither (no TLS).
    pub fn identity_files(&self) -> Result<Option<(&PathBuf, &PathBuf)>> {
        match (&self.cert, &self.key) {
            (None, None) => Ok(None),
            (Some(c), Some(k)) => Ok(Some((c, k))),
            _ => Err(Error::invalid(
                "--tls-cert and --tls-key must be given together",
            )),
        }
    }

    pub fn config(&self) -> Result<Option<ServerTlsConfig>> {
        let Some((c, k)) = self.identity_files()? else {
            return Ok(None);
        };
        let cert = read_pem(c, "--tls-cert", "CERTIFICATE")?;
        let key = read_pem(k, "--tls-key", "PRIVATE KEY")?;
        Ok(Some(
            ServerTlsConfig::new().identity(Identity::from_pem(cert, key)),
        ))
    }
}

impl ServerTls {
    /// The cluster's server builder, with TLS when configured.
    pub fn server(&self) -> Result<tonic::transport::Server> {
        let b = server_builder();
        match self.config()? {
            Some(tls) => b
                .tls_config(tls)
                .map_err(|e| Error::invalid(format!("--tls-cert/--tls-key: {e}"))),
            None => Ok(b),
        }
    }

    /// The flags that hand this identity to a child process.
    pub fn args(&self) -> Vec<std::ffi::OsString> {
        let mut v: Vec<std::ffi::OsString> = match (&self.cert, &self.key) {
            (Some(c), Some(k)) => vec![
                "--tls-cert".into(),
                c.clone().into_os_string(),
                "--tls-key".into(),
                k.clone().into_os_string(),
            ],
            _ => return vec![],
        };
        if let Some(ca) = &self.ca {
            v.push("--tls-ca".into());
            v.push(ca.clone().into_os_string());
        }
        v
    }
}

fn read(p: &PathBuf, flag: &str) -> Result<Vec<u8>> {
    std::fs::read(p).map_err(|e| Error::io(format!("{flag} {}", p.display()), e))
}

/// Reads a PEM file and checks it holds a block of `kind` (the TLS stack only says
/// "transport error" about a file that is not one).
pub(crate) fn read_pem(p: &PathBuf, flag: &str, kind: &str) -> Result<Vec<u8>> {
    let bytes = read(p, flag)?;
    let text = String::from_utf8_lossy(&bytes);
    let found = text
        .lines()
        .any(|l| l.starts_with("-----BEGIN ") && l.contains(kind));
    if !found {
        return Err(Error::invalid(format!(
            "{flag} {}: no PEM block with a {kind} in it (a file starting with `-----BEGIN ...{kind}-----`)",
            p.display()
        )));
    }
    Ok(bytes)
}

/// The name a server's certificate must carry: `--tls-domain`, or the address's host.
pub(crate) fn tls_domain(addr: &str, opts: &ClientOptions) -> String {
    opts.tls_domain.clone().unwrap_or_else(|| {
        addr.rsplit_once(':')
            .map(|(h, _)| h)
            .unwrap_or(addr)
            .to_string()
    })
}

fn endpoint(addr: &str, opts: &ClientOptions) -> Result<Endpoint> {
    let scheme = if opts.tls_ca.is_some() {
        "https"
    } else {
        "http"
    };
    let mut ep = Endpoint::from_shared(format!("{scheme}://{addr}"))
        .map_err(|e| Error::invalid(format!("bad address '{addr}': {e}; expected HOST:PORT")))?
        .connect_timeout(Duration::from_secs(3))
        .tcp_nodelay(true)
        .initial_stream_window_size(Some(STREAM_WINDOW))
        .initial_connection_window_size(Some(CONNECTION_WINDOW))
        // Same frame size as the servers, for batches that stream back (role outputs).
        .max_frame_size(Some(MAX_FRAME))
        .http2_keep_alive_interval(opts.keepalive)
        .keep_alive_timeout(Duration::from_secs(20))
        // A peer whose host vanished without a reset is found by the kernel too, also
        // while no HTTP/2 ping is running yet (during the TLS handshake).
        .tcp_keepalive(Some(Duration::from_secs(60)));
    if let Some(ca) = &opts.tls_ca {
        let pem = read_pem(ca, "--tls-ca", "CERTIFICATE")?;
        let domain = tls_domain(addr, opts);
        ep = ep
            .tls_config(
                ClientTlsConfig::new()
                    .ca_certificate(Certificate::from_pem(pem))
                    .domain_name(domain)
                    // tonic waits for a handshake without limit: a peer that accepts the
                    // connection and then says nothing would hold the connect (and every
                    // reconnect of a cached channel) forever.
                    .timeout(crate::tls::HANDSHAKE_WITHIN),
            )
            .map_err(|e| Error::invalid(format!("TLS configuration for {addr}: {e}")))?;
    }
    Ok(ep)
}

/// Connects with exponential backoff until `connect_timeout`, then fails naming the address.
/// The channel reconnects by itself when the peer comes back (a restarted head).
pub async fn connect(addr: &str, opts: &ClientOptions) -> Result<AuthChannel> {
    let ep = endpoint(addr, opts)?;
    let ch = with_backoff(addr, opts, || async {
        ep.connect()
            .await
            .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
    })
    .await?;
    Ok(InterceptedService::new(
        Transport::Channel(ch),
        AddToken::new(&opts.token)?,
    ))
}

/// Connects as [`connect`] does, to a peer whose address dies with it (a role process): one
/// HTTP/2 connection used directly, without tonic's buffer task (see `crate::direct`), and
/// never reconnected; unary calls go as control frames when the server speaks them
/// (`crate::frames`). Over TLS when the options name a CA (`crate::tls`).
pub async fn connect_direct(addr: &str, opts: &ClientOptions) -> Result<AuthChannel> {
    Ok(connect_direct_framed(addr, opts).await?.0)
}

/// [`connect_direct`], and whether the connection speaks control frames (so batch calls
/// may carry their batch as a `crate::frames::FramedBatch`).
pub async fn connect_direct_framed(
    addr: &str,
    opts: &ClientOptions,
) -> Result<(AuthChannel, bool)> {
    let t = direct_transport(addr, opts).await?;
    let framed = t.frames().is_some();
    Ok((with_token(t, &opts.token)?, framed))
}

/// A transport with the cluster token added to every request.
pub fn with_token(t: Transport, token: &str) -> Result<AuthChannel> {
    Ok(InterceptedService::new(t, AddToken::new(token)?))
}

/// The transport of [`connect_direct`], before the token is added: benches and tests look
/// at it (whether unary calls go as frames) and shape it.
pub async fn direct_transport(addr: &str, opts: &ClientOptions) -> Result<Transport> {
    let authority: http::uri::Authority = addr
        .parse()
        .map_err(|e| Error::invalid(format!("bad address '{addr}': {e}; expected HOST:PORT")))?;
    let tls = crate::tls::Connector::new(addr, opts, crate::tls::ALPN_H2)?;
    let mut direct = with_backoff(addr, opts, || async {
        let tcp =
            tokio::time::timeout(Duration::from_secs(3), tokio::net::TcpStream::connect(addr))
                .await
                .map_err(|_| "tcp connect error: timed out after 3 s")??;
        tcp.set_nodelay(true)?;
        let io = match &tls {
            Some(c) => c.connect(tcp).await?,
            None => crate::tls::Io::Plain(tcp),
        };
        let (send, conn) =
            hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                .timer(hyper_util::rt::TokioTimer::new())
                .initial_stream_window_size(STREAM_WINDOW)
                .initial_connection_window_size(CONNECTION_WINDOW)
                .max_frame_size(MAX_FRAME)
                .keep_alive_interval(opts.keepalive)
                .keep_alive_timeout(Duration::from_secs(20))
                .handshake(hyper_util::rt::TokioIo::new(io))
                .await?;
        let peer = addr.to_string();
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("connection to {peer} ended: {e}");
            }
        });
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(crate::direct::Direct {
            send,
            authority: authority.clone(),
            scheme: if tls.is_some() {
                http::uri::Scheme::HTTPS
            } else {
                http::uri::Scheme::HTTP
            },
            frames: None,
        })
    })
    .await?;
    direct.frames = if opts.control_frames {
        // The HTTP/2 connection is up, so the server is: a failure here only means no frames.
        let tls = tls.map(|c| c.offering(crate::tls::ALPN_FRAMES));
        match crate::frames::FramesClient::connect(addr, &opts.token, tls).await {
            Ok(f) => f,
            // The server is up but frames failed (a wrong token, a TLS handshake that did
            // not finish): worth a line, since every call to it then pays HTTP/2.
            Err(e) => {
                tracing::warn!(
                    "no control frames to {addr} ({e}); its calls and batches use HTTP/2"
                );
                None
            }
        }
    } else {
        None
    };
    Ok(Transport::Direct(direct))
}

/// Runs `attempt` with exponential backoff until `connect_timeout`, then fails naming the
/// address and the last error.
async fn with_backoff<T, F, Fut>(addr: &str, opts: &ClientOptions, mut attempt: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<
        Output = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>,
    >,
{
    let start = Instant::now();
    let mut delay = Duration::from_millis(50);
    loop {
        match attempt().await {
            Ok(v) => return Ok(v),
            Err(e) => {
                let chain = error_chain(&*e);
                let hint = tls_hint(
                    &chain,
                    "this process",
                    addr,
                    "pass the CA that signed it with --tls-ca",
                );
                if let Some(hint) = hint {
                    // Retrying cannot change a certificate: say so at once.
                    return Err(Error::new(
                        FailureKind::Unauthenticated,
                        format!("{hint} ({chain})"),
                    ));
                }
                if start.elapsed() + delay > opts.connect_timeout {
                    return Err(Error::new(
                        FailureKind::Unavailable,
                        format!(
                            "cannot reach {addr} after {:.1}s ({}); check the address and that the process is running there, or wait longer with --connect-timeout",
                            start.elapsed().as_secs_f64(),
                            error_chain(&*e)
                        ),
                    ));
                }
                tracing::debug!("connect {addr} failed: {e}; retrying in {delay:?}");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// Whether a failed call never reached the server: the channel could not connect (refused,
/// or the connect timed out). Such a call is safe to send again; any other failure may have
/// been acted on.
pub fn never_sent(s: &tonic::Status) -> bool {
    s.code() == tonic::Code::Unavailable && error_chain(s).contains("tcp connect error")
}

/// A channel that connects on first use and reconnects by itself (for long-lived peers).
pub fn connect_lazy(addr: &str, opts: &ClientOptions) -> Result<AuthChannel> {
    let ch = endpoint(addr, opts)?.connect_lazy();
    Ok(InterceptedService::new(
        Transport::Channel(ch),
        AddToken::new(&opts.token)?,
    ))
}

/// A certificate verification failure found in an error chain, as one line that names who
/// did not trust whom, why, and the fix: `this` (e.g. "the head") checked `peer`'s
/// certificate; `ca_fix` says how to give `this` the right CA. `None` for any other error.
pub fn tls_hint(chain: &str, this: &str, peer: &str, ca_fix: &str) -> Option<String> {
    let why = if chain.contains("UnknownIssuer") || chain.contains("BadSignature") {
        format!("it is not signed by a CA {this} trusts; {ca_fix}")
    } else if chain.contains("NotValidForName") {
        format!(
            "it does not name the address {this} reached it at; give that node a certificate \
             for its IP or name (or pass --tls-domain with the name it carries)"
        )
    } else if chain.contains("Expired") || chain.contains("NotValidYet") {
        "it is outside its validity period; renew it (and check the clocks)".to_string()
    } else if chain.contains("invalid peer certificate") {
        format!(
            "it was refused ({}); {ca_fix}",
            chain.rsplit(": ").next().unwrap_or("")
        )
    } else {
        return None;
    };
    Some(format!(
        "{this} does not trust the TLS certificate of {peer}: {why}"
    ))
}

pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Binds a listener, turning "address in use" into an error that names the port and the flag.
pub async fn bind(host: &str, port: u16, flag: &str) -> Result<tokio::net::TcpListener> {
    let addr = format!("{host}:{port}");
    let l = tokio::net::TcpListener::bind(&addr).await.map_err(|e| {
        if e.kind() == std::io::ErrorKind::AddrInUse {
            Error::invalid(format!(
                "port {port} is already in use on {host}; choose another with {flag} PORT, or {flag} 0 to pick a free one"
            ))
        } else {
            Error::io(format!("binding {addr} ({flag})"), e)
        }
    })?;
    nodelay_for_accepted(&l);
    Ok(l)
}

/// Sets TCP_NODELAY on a listening socket; Linux copies it to every accepted connection.
/// Servers here take their connections from a listener stream, where tonic's own
/// `tcp_nodelay` setting does not apply, so without this every reply would wait on Nagle's
/// algorithm (up to a delayed-ACK timeout, 40 ms, behind the previous small write).
fn nodelay_for_accepted(l: &tokio::net::TcpListener) {
    use std::os::fd::AsRawFd;
    if let Err(e) = set_int_option(l.as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_NODELAY, 1) {
        tracing::debug!("TCP_NODELAY on the listener: {e}");
    }
}

/// Sets an integer socket option on `fd`, which must be a live socket for the call.
pub(crate) fn set_int_option(
    fd: std::os::fd::RawFd,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> std::io::Result<()> {
    // SAFETY: the caller passes a live socket; the option value points to a c_int of the
    // size passed, alive for the call.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The address of this machine's interface that routes to `peer` (no packet is sent).
pub fn local_ip_towards(peer: &str) -> Option<std::net::IpAddr> {
    use std::net::ToSocketAddrs;
    let target: SocketAddr = peer.to_socket_addrs().ok()?.next()?;
    let bind = if target.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    };
    let sock = std::net::UdpSocket::bind(bind).ok()?;
    sock.connect(target).ok()?;
    sock.local_addr().ok().map(|a| a.ip())
}

/// The first non-loopback IPv4 address of this machine, to print an address other nodes can
/// use when the head binds every interface; loopback when there is none.
pub fn primary_ip() -> std::net::IpAddr {
    nix::ifaddrs::getifaddrs()
        .ok()
        .and_then(|mut addrs| {
            addrs.find_map(|a| {
                let ip = a.address?.as_sockaddr_in()?.ip();
                (!ip.is_loopback()).then_some(std::net::IpAddr::V4(ip))
            })
        })
        .unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn port_in_use_names_port_and_flag() {
        let l = bind("127.0.0.1", 0, "--port").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let e = bind("127.0.0.1", port, "--port").await.unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains(&format!("port {port} is already in use")) && m.contains("--port 0"),
            "{m}"
        );
    }

    #[tokio::test]
    async fn accepted_connections_have_nodelay() {
        let l = bind("127.0.0.1", 0, "--port").await.unwrap();
        let addr = l.local_addr().unwrap();
        let _c = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (s, _) = l.accept().await.unwrap();
        assert!(
            s.nodelay().unwrap(),
            "server side of a connection must not use Nagle"
        );
    }

    #[tokio::test]
    async fn unreachable_fails_after_timeout_naming_address() {
        // Bind then drop to get a port with nothing listening.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut o = ClientOptions::new("t");
        o.connect_timeout = Duration::from_millis(400);
        let t = Instant::now();
        let e = connect(&format!("127.0.0.1:{port}"), &o).await.unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5));
        assert_eq!(e.kind(), FailureKind::Unavailable);
        assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
        assert!(e.to_string().contains("--connect-timeout"), "{e}");
    }

    #[tokio::test]
    async fn a_call_that_could_not_connect_is_known_as_never_sent() {
        use rlhf_proto::v1::worker_service_client::WorkerServiceClient;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let ch = connect_lazy(&format!("127.0.0.1:{port}"), &ClientOptions::new("t")).unwrap();
        let s = WorkerServiceClient::new(ch)
            .shutdown_worker(rlhf_proto::v1::ShutdownWorkerRequest {})
            .await
            .unwrap_err();
        assert!(never_sent(&s), "{s:?}");
        // A server's own answer, even Unavailable, may have been acted on.
        assert!(!never_sent(&tonic::Status::unavailable(
            "worker is shutting down"
        )));
        assert!(!never_sent(&tonic::Status::internal("tcp connect error")));
    }

    #[test]
    fn local_ip_towards_loopback() {
        assert_eq!(
            local_ip_towards("127.0.0.1:6344").unwrap().to_string(),
            "127.0.0.1"
        );
    }
}
