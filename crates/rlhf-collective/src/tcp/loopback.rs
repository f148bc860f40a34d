//! A whole group in one process, over loopback TCP: how tests and benches get the real
//! communicator for several ranks on threads.

use super::{TcpCommunicator, TcpRendezvous};
use crate::error::{Error, Op, Result};
use crate::CommConfig;

impl TcpCommunicator {
    /// `n` connected communicators on 127.0.0.1, in rank order (rank 0 listens on a free
    /// port, the others connect from threads of their own).
    pub fn loopback_group(n: usize, config: CommConfig) -> Result<Vec<Self>> {
        let rv = TcpRendezvous::bind("127.0.0.1:0")?;
        let addr = rv.local_addr().to_string();
        let peers: Vec<_> = (1..n)
            .map(|r| {
                let (a, c) = (addr.clone(), config.clone());
                std::thread::spawn(move || Self::connect(r, n, &a, c))
            })
            .collect();
        let mut out = vec![rv.accept(n, config)?];
        for p in peers {
            out.push(p.join().map_err(|_| Error::InvalidArgument {
                op: Op::Rendezvous,
                detail: "a connecting rank's thread panicked".into(),
            })??);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Communicator, ReduceOp};

    #[test]
    fn a_loopback_group_reduces_across_its_ranks() {
        let group = TcpCommunicator::loopback_group(3, CommConfig::default()).unwrap();
        let handles: Vec<_> = group
            .into_iter()
            .map(|mut c| {
                std::thread::spawn(move || {
                    let mut v = [c.rank() as f32 + 1.0];
                    c.all_reduce_f32(&mut v, ReduceOp::Sum).unwrap();
                    (c.rank(), v[0])
                })
            })
            .collect();
        let got: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(got, vec![(0, 6.0), (1, 6.0), (2, 6.0)]);
    }
}
