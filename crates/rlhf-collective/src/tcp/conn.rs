//! One connection of the TCP backend, plain or TLS. With a [`CommTls`] in the
//! [`CommConfig`](crate::CommConfig), every rendezvous and ring connection runs a TLS
//! handshake first (the connecting side verifies the accepting side's certificate against
//! the cluster CA, by the peer's IP), then the secret handshake and every payload go inside
//! it. Reads and writes take `&Conn`, as they took `&TcpStream`: a link is read by one
//! thread and written by another at most, each TLS session sits behind its own lock, and
//! shutting a link down goes to the socket directly, so a blocked reader is always freed.

use std::io::{self, Read, Write};
use std::net::{IpAddr, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// TLS for collectives: this node's certificate and key (it serves the links it accepts
/// with them) and the CA that verifies the peers it connects to.
#[derive(Clone)]
pub struct CommTls {
    client: Arc<rustls::ClientConfig>,
    server: Arc<rustls::ServerConfig>,
}

impl std::fmt::Debug for CommTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CommTls(..)")
    }
}

impl CommTls {
    /// Reads PEM files; the error names the file and what is wrong with it.
    pub fn from_pem_files(cert: &Path, key: &Path, ca: &Path) -> Result<Self, String> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
            .and_then(|it| it.collect::<Result<_, _>>())
            .map_err(|e| format!("TLS certificate {}: {e}", cert.display()))?;
        if certs.is_empty() {
            return Err(format!(
                "TLS certificate {}: no certificate in it",
                cert.display()
            ));
        }
        let key = PrivateKeyDer::from_pem_file(key)
            .map_err(|e| format!("TLS key {}: {e}", key.display()))?;
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_file_iter(ca)
            .map_err(|e| format!("TLS CA {}: {e}", ca.display()))?
        {
            let c = c.map_err(|e| format!("TLS CA {}: {e}", ca.display()))?;
            roots
                .add(c)
                .map_err(|e| format!("TLS CA {}: {e}", ca.display()))?;
        }
        if roots.is_empty() {
            return Err(format!("TLS CA {}: no certificate in it", ca.display()));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let client = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS setup: {e}"))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let server = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS setup: {e}"))?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .map_err(|e| format!("TLS certificate {} and key: {e}", cert.display()))?;
        Ok(Self {
            client: Arc::new(client),
            server: Arc::new(server),
        })
    }
}

enum Tls {
    Client(rustls::ClientConnection),
    Server(rustls::ServerConnection),
}

/// A plain or TLS connection.
pub(super) struct Conn {
    pub(super) tcp: TcpStream,
    tls: Option<Mutex<Tls>>,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Conn({:?}, tls: {})", self.tcp, self.tls.is_some())
    }
}

fn io_other(e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}

impl Conn {
    pub(super) fn plain(tcp: TcpStream) -> Self {
        Self { tcp, tls: None }
    }

    /// The connecting side: TLS when configured, verifying the peer at `host` ("ip" or a name).
    pub(super) fn connect(tcp: TcpStream, tls: Option<&CommTls>, host: &str) -> io::Result<Self> {
        let Some(tls) = tls else {
            return Ok(Self::plain(tcp));
        };
        let name = match host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
        {
            Ok(ip) => ServerName::IpAddress(ip.into()),
            Err(_) => ServerName::try_from(host.to_string()).map_err(io_other)?,
        };
        let mut c = rustls::ClientConnection::new(tls.client.clone(), name).map_err(io_other)?;
        while c.is_handshaking() {
            c.complete_io(&mut &tcp)?;
        }
        Ok(Self {
            tcp,
            tls: Some(Mutex::new(Tls::Client(c))),
        })
    }

    /// The accepting side: TLS when configured.
    pub(super) fn accept(tcp: TcpStream, tls: Option<&CommTls>) -> io::Result<Self> {
        let Some(tls) = tls else {
            return Ok(Self::plain(tcp));
        };
        let mut s = rustls::ServerConnection::new(tls.server.clone()).map_err(io_other)?;
        while s.is_handshaking() {
            s.complete_io(&mut &tcp)?;
        }
        Ok(Self {
            tcp,
            tls: Some(Mutex::new(Tls::Server(s))),
        })
    }

    /// Runs `f` on the plain socket or on the TLS stream over it.
    fn io<R>(&self, f: impl FnOnce(&mut dyn ReadWrite) -> io::Result<R>) -> io::Result<R> {
        let mut sock = &self.tcp;
        match &self.tls {
            None => f(&mut sock),
            Some(m) => {
                let mut g = m
                    .lock()
                    .map_err(|_| io::Error::other("a thread panicked inside a TLS link"))?;
                match &mut *g {
                    Tls::Client(c) => f(&mut rustls::Stream::new(c, &mut sock)),
                    Tls::Server(s) => f(&mut rustls::Stream::new(s, &mut sock)),
                }
            }
        }
    }
}

/// Read + Write behind one trait object.
trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

impl Read for &Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.io(|s| s.read(buf))
    }
}

impl Write for &Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.io(|s| s.write(buf))
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        self.io(|s| s.write_all(buf))
    }

    fn flush(&mut self) -> io::Result<()> {
        self.io(|s| s.flush())
    }
}
