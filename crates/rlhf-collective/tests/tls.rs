//! Collectives over TLS on loopback: with a `CommTls` every link is a TLS session verified
//! against the cluster CA. A proxy between two ranks sees the weights a broadcast carries in
//! the clear without TLS and not a trace of them with it; a rank whose peer's certificate
//! comes from another CA refuses the link by name.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread;

use common::{config, pattern, run_all};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use rlhf_collective::{
    CommConfig, CommSecret, CommTls, Communicator, ErrorKind, TcpCommunicator, TcpRendezvous,
};

/// A CA and a certificate for 127.0.0.1 signed by it, as PEM files; returns the `CommTls`.
fn tls(dir: &std::path::Path, name: &str) -> CommTls {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    let (c, k, a) = (
        dir.join(format!("{name}.crt")),
        dir.join(format!("{name}.key")),
        dir.join(format!("{name}-ca.crt")),
    );
    std::fs::write(&c, cert.pem()).unwrap();
    std::fs::write(&k, key.serialize_pem()).unwrap();
    std::fs::write(&a, ca_cert.pem()).unwrap();
    CommTls::from_pem_files(&c, &k, &a).unwrap()
}

fn cfg(tls: Option<&CommTls>, secret: &CommSecret) -> CommConfig {
    let mut c = config(15_000);
    c.secret = Some(secret.clone());
    c.tls = tls.cloned();
    c
}

/// Forwards connections to `target` and keeps every byte sent towards it.
fn proxy(target: String) -> (String, Arc<Mutex<Vec<u8>>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let keep = seen.clone();
    thread::spawn(move || {
        for client in l.incoming().flatten() {
            let Ok(server) = TcpStream::connect(&target) else {
                return;
            };
            let (mut c_in, mut s_out) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            let keep = keep.clone();
            thread::spawn(move || {
                let mut buf = [0u8; 65536];
                while let Ok(n) = c_in.read(&mut buf) {
                    if n == 0 || s_out.write_all(&buf[..n]).is_err() {
                        break;
                    }
                    keep.lock().unwrap().extend_from_slice(&buf[..n]);
                }
            });
            let (mut s_in, mut c_out) = (server, client);
            thread::spawn(move || {
                let _ = std::io::copy(&mut s_in, &mut c_out);
            });
        }
    });
    (addr, seen)
}

/// A world of two where rank 1 reaches rank 0 through a proxy; rank 1 broadcasts `payload`;
/// returns what the proxy saw.
fn broadcast_through_proxy(tls: Option<&CommTls>, payload: &[u8]) -> Vec<u8> {
    let secret = CommSecret::generate();
    let rv = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let (via, seen) = proxy(rv.local_addr().to_string());
    let c1 = cfg(tls, &secret);
    let one = thread::spawn(move || TcpCommunicator::connect(1, 2, &via, c1).unwrap());
    let zero = rv.accept(2, cfg(tls, &secret)).unwrap();
    let mut comms = vec![zero, one.join().unwrap()];
    let got = run_all(&mut comms, |r, c| {
        let mut buf = if r == 1 {
            payload.to_vec()
        } else {
            vec![0; payload.len()]
        };
        c.broadcast(&mut buf, 1).map(|_| buf)
    });
    for g in got {
        assert!(g.unwrap() == payload);
    }
    let bytes = seen.lock().unwrap().clone();
    bytes
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn tls_hides_the_weights_from_the_wire() {
    let dir = tempfile::tempdir().unwrap();
    let t = tls(dir.path(), "node");
    let weights = pattern(200_000, 11);
    let probe = &weights[100_000..100_064];
    let clear = broadcast_through_proxy(None, &weights);
    assert!(
        contains(&clear, probe),
        "without TLS the proxy sees the weights"
    );
    let hidden = broadcast_through_proxy(Some(&t), &weights);
    assert!(
        hidden.len() > weights.len(),
        "the weights went through the proxy"
    );
    assert!(!contains(&hidden, probe), "with TLS it does not");
}

#[test]
fn a_peer_from_another_ca_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (tls(dir.path(), "a"), tls(dir.path(), "b"));
    let secret = CommSecret::generate();
    let rv = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let addr = rv.local_addr().to_string();
    let mut c1 = cfg(Some(&b), &secret);
    c1.timeout = std::time::Duration::from_secs(3);
    let one = thread::spawn(move || TcpCommunicator::connect(1, 2, &addr, c1));
    let mut c0 = cfg(Some(&a), &secret);
    c0.timeout = std::time::Duration::from_secs(3);
    let zero = rv.accept(2, c0);
    let e = one.join().unwrap().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Auth, "{e}");
    assert!(e.to_string().contains("TLS handshake"), "{e}");
    assert!(zero.is_err());
}
