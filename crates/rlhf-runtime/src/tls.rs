//! TLS for the connections this crate makes and accepts itself rather than through tonic's
//! transport: the driver's direct HTTP/2 connection to a role process (`crate::direct`) and
//! control frames (`crate::frames`), on a cluster run with `--tls-cert`/`--tls-key`/`--tls-ca`.
//!
//! Why: a TLS cluster used to keep tonic's channel and HTTP/2 for everything, so its batches
//! streamed at a third of what control frames move on a plain cluster. Now a role process's
//! listener does the TLS handshake itself and lets the negotiated ALPN protocol pick the
//! protocol inside: [`ALPN_H2`] goes to tonic's server (as its own TLS listener did), and
//! [`ALPN_FRAMES`] to the frames loop, whose token challenge and per-call token check then
//! run inside the encrypted stream. A client that offers only frames to a server that does
//! not speak them fails the handshake (no common protocol) and keeps HTTP/2.
//!
//! The same certificates and checks as tonic's: the server presents `--tls-cert`, the client
//! verifies it against `--tls-ca` under `--tls-domain` (or the address's host); every
//! handshake has [`HANDSHAKE_WITHIN`] to finish.

use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rlhf_core::{Error, Result};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::net::{ClientOptions, ServerTls};

/// ALPN id of HTTP/2 (what tonic's clients and servers negotiate).
pub const ALPN_H2: &[u8] = b"h2";
/// ALPN id of control frames.
pub const ALPN_FRAMES: &[u8] = b"rlhf-frames/1";

/// A handshake that has not finished within this is abandoned.
pub const HANDSHAKE_WITHIN: Duration = Duration::from_secs(10);

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The server side: `--tls-cert`/`--tls-key`, offering HTTP/2 and control frames.
pub fn acceptor(tls: &ServerTls) -> Result<Option<tokio_rustls::TlsAcceptor>> {
    let Some((cert, key)) = tls.identity_files()? else {
        return Ok(None);
    };
    let certs =
        CertificateDer::pem_slice_iter(&crate::net::read_pem(cert, "--tls-cert", "CERTIFICATE")?)
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::invalid(format!("--tls-cert {}: {e}", cert.display())))?;
    let key =
        PrivateKeyDer::from_pem_slice(&crate::net::read_pem(key, "--tls-key", "PRIVATE KEY")?)
            .map_err(|e| Error::invalid(format!("--tls-key {}: {e}", key.display())))?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::internal(format!("TLS versions: {e}")))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| Error::invalid(format!("--tls-cert/--tls-key: {e}")))?;
    config.alpn_protocols = vec![ALPN_H2.to_vec(), ALPN_FRAMES.to_vec()];
    Ok(Some(tokio_rustls::TlsAcceptor::from(Arc::new(config))))
}

/// The client side for one server: the cluster CA and the name its certificate must carry.
#[derive(Clone)]
pub struct Connector {
    config: Arc<rustls::ClientConfig>,
    name: ServerName<'static>,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Connector {
    /// `None` on a plain cluster (no `--tls-ca`); `alpn` is the one protocol offered.
    pub fn new(addr: &str, opts: &ClientOptions, alpn: &[u8]) -> Result<Option<Connector>> {
        let Some(ca) = &opts.tls_ca else {
            return Ok(None);
        };
        let mut roots = rustls::RootCertStore::empty();
        for c in
            CertificateDer::pem_slice_iter(&crate::net::read_pem(ca, "--tls-ca", "CERTIFICATE")?)
        {
            let c = c.map_err(|e| Error::invalid(format!("--tls-ca {}: {e}", ca.display())))?;
            roots
                .add(c)
                .map_err(|e| Error::invalid(format!("--tls-ca {}: {e}", ca.display())))?;
        }
        let mut config = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::internal(format!("TLS versions: {e}")))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![alpn.to_vec()];
        let domain = crate::net::tls_domain(addr, opts);
        let name = match domain.parse::<IpAddr>() {
            Ok(ip) => ServerName::IpAddress(ip.into()),
            Err(_) => ServerName::try_from(domain.clone()).map_err(|e| {
                Error::invalid(format!(
                    "TLS name '{domain}' for {addr}: {e}; pass the name in the server's certificate with --tls-domain"
                ))
            })?,
        };
        Ok(Some(Connector {
            config: Arc::new(config),
            name,
        }))
    }

    /// The same server and checks, offering `alpn` instead (no second read of the CA).
    pub fn offering(&self, alpn: &[u8]) -> Connector {
        let mut config = (*self.config).clone();
        config.alpn_protocols = vec![alpn.to_vec()];
        Connector {
            config: Arc::new(config),
            name: self.name.clone(),
        }
    }

    /// The handshake over `tcp`, within [`HANDSHAKE_WITHIN`].
    ///
    /// A server that completes the handshake without choosing the one protocol offered (no
    /// ALPN configured) is refused as one without a common protocol.
    pub async fn connect(&self, tcp: TcpStream) -> io::Result<Io> {
        let c = tokio_rustls::TlsConnector::from(self.config.clone());
        let s = handshake(c.connect(self.name.clone(), tcp)).await?;
        let offered = self.config.alpn_protocols.first().map(Vec::as_slice);
        if s.get_ref().1.alpn_protocol() != offered {
            return Err(io::Error::new(io::ErrorKind::InvalidData, NoCommonProtocol));
        }
        Ok(Io::Tls(Box::new(s.into())))
    }
}

/// `h`, a handshake, within [`HANDSHAKE_WITHIN`].
async fn handshake<T>(h: impl std::future::Future<Output = io::Result<T>>) -> io::Result<T> {
    tokio::time::timeout(HANDSHAKE_WITHIN, h)
        .await
        .map_err(|_| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!("TLS handshake timed out after {HANDSHAKE_WITHIN:?}"),
            )
        })?
}

/// The handshake on an accepted connection, within [`HANDSHAKE_WITHIN`]; the stream and
/// whether the client chose control frames.
pub async fn accept(a: &tokio_rustls::TlsAcceptor, tcp: TcpStream) -> io::Result<(Io, bool)> {
    let s = handshake(a.accept(tcp)).await?;
    let frames = s.get_ref().1.alpn_protocol() == Some(ALPN_FRAMES);
    Ok((Io::Tls(Box::new(s.into())), frames))
}

/// The server chose no protocol in the handshake, though it completed it.
#[derive(Debug)]
struct NoCommonProtocol;

impl std::fmt::Display for NoCommonProtocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the server chose none of the offered protocols (ALPN)")
    }
}

impl std::error::Error for NoCommonProtocol {}

/// Whether a client's handshake failed because the server offered none of its protocols
/// (a server that does not speak control frames refuses a client that offers only them).
pub fn no_common_protocol(e: &io::Error) -> bool {
    let inner = e.get_ref();
    inner.is_some_and(|i| i.is::<NoCommonProtocol>())
        || matches!(
            inner.and_then(|i| i.downcast_ref::<rustls::Error>()),
            Some(rustls::Error::AlertReceived(
                rustls::AlertDescription::NoApplicationProtocol
            )) | Some(rustls::Error::NoApplicationProtocol)
        )
}

/// A connection of the cluster, plain or TLS, either end.
pub enum Io {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::TlsStream<TcpStream>>),
}

impl Io {
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Io::Plain(s) => s,
            Io::Tls(s) => s.get_ref().0,
        }
    }
}

/// tonic's server reads the peer's address from this (the token check logs it).
impl Connected for Io {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.tcp().connect_info()
    }
}

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Io {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}
