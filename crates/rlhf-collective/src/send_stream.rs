//! The root side of a bucketed weight sync whose parameters are produced one at a time: a
//! ZeRO-3 trainer gathers its whole weights a layer at a time and sends each layer before
//! gathering the next, so it never holds the whole model.
//!
//! The wire is [`BucketedSync::send`]'s: the same manifest check, then the concatenated
//! parameter bytes cut into buckets of `bucket_bytes` (the last one shorter), one broadcast
//! each. Receivers call [`BucketedSync::recv`] and cannot tell the two apart; the checksum is
//! [`crate::checksum`]'s over the same bytes.

use std::time::Instant;

use crate::bucket::{check_len, BucketedSync, DType, Listed, SyncStats};
use crate::checksum::ChecksumStream;
use crate::error::{Error, Op, Result};
use crate::Communicator;

/// A parameter's name, shape and dtype, without its bytes: what a streamed sync lists before
/// the bytes exist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamMeta {
    name: String,
    shape: Vec<usize>,
    dtype: DType,
}

impl ParamMeta {
    pub fn new(name: impl Into<String>, shape: &[usize], dtype: DType) -> Self {
        Self {
            name: name.into(),
            shape: shape.to_vec(),
            dtype,
        }
    }
}

impl Listed for ParamMeta {
    fn listed_name(&self) -> &str {
        &self.name
    }
    fn listed_shape(&self) -> &[usize] {
        &self.shape
    }
    fn listed_dtype(&self) -> DType {
        self.dtype
    }
}

/// A sync in progress from the root ([`BucketedSync::send_stream`]): [`SendStream::push`]
/// each listed parameter's bytes in order, then [`SendStream::finish`]. A full bucket goes
/// out as soon as it is full, so the stream holds at most one bucket.
pub struct SendStream<'c, C: Communicator + ?Sized> {
    comm: &'c mut C,
    bucket_bytes: usize,
    params: Vec<ParamMeta>,
    /// The next parameter to push.
    next: usize,
    /// The bytes of the bucket being filled.
    buf: Vec<u8>,
    hash: ChecksumStream,
    bytes: u64,
    buckets: usize,
    start: Instant,
}

impl BucketedSync {
    /// Starts a sync from this rank (the root) of `params`, whose bytes are pushed later:
    /// the manifest is checked with every rank now, as [`BucketedSync::send`] does.
    pub fn send_stream<'c, C: Communicator + ?Sized>(
        &self,
        comm: &'c mut C,
        params: Vec<ParamMeta>,
    ) -> Result<SendStream<'c, C>> {
        let start = Instant::now();
        let root = comm.rank();
        self.check_manifest(comm, root, &params)?;
        let hash = ChecksumStream::new(params.len());
        Ok(SendStream {
            comm,
            bucket_bytes: self.bucket_bytes(),
            params,
            next: 0,
            buf: Vec::new(),
            hash,
            bytes: 0,
            buckets: 0,
            start,
        })
    }
}

impl<C: Communicator + ?Sized> SendStream<'_, C> {
    fn invalid(detail: String) -> Error {
        Error::InvalidArgument {
            op: Op::WeightSync,
            detail,
        }
    }

    /// Sends the bytes of the next listed parameter, `name`; they must be its whole data.
    pub fn push(&mut self, name: &str, data: &[u8]) -> Result<()> {
        let p = self.params.get(self.next).ok_or_else(|| {
            Self::invalid(format!(
                "parameter '{name}' pushed after all {} listed ones",
                self.params.len()
            ))
        })?;
        if p.name != name {
            return Err(Self::invalid(format!(
                "parameter '{name}' pushed where '{}' (number {}) is listed",
                p.name, self.next
            )));
        }
        check_len(name, &p.shape, p.dtype, data.len())?;
        self.hash.add_listed(p, data);
        self.next += 1;
        self.bytes += data.len() as u64;
        let mut rest = data;
        while !rest.is_empty() {
            if self.buf.is_empty() && rest.len() >= self.bucket_bytes {
                // A whole bucket straight from the caller's bytes, with no copy.
                let (bucket, tail) = rest.split_at(self.bucket_bytes);
                self.comm.broadcast_send_parts(&[bucket])?;
                self.buckets += 1;
                rest = tail;
                continue;
            }
            let take = (self.bucket_bytes - self.buf.len()).min(rest.len());
            self.buf.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
            if self.buf.len() == self.bucket_bytes {
                self.flush()?;
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        self.comm.broadcast_send_parts(&[&self.buf])?;
        self.buckets += 1;
        self.buf.clear();
        Ok(())
    }

    /// Sends the last bucket once every listed parameter was pushed; the sync's stats and
    /// the checksum of what was sent ([`crate::checksum`]'s).
    pub fn finish(mut self) -> Result<(SyncStats, u64)> {
        if let Some(p) = self.params.get(self.next) {
            return Err(Self::invalid(format!(
                "the sync ended before parameter '{}' (number {} of {})",
                p.name,
                self.next,
                self.params.len()
            )));
        }
        if !self.buf.is_empty() {
            self.flush()?;
        }
        let stats = SyncStats {
            params: self.params.len(),
            bytes: self.bytes,
            buckets: self.buckets,
            elapsed: self.start.elapsed(),
        };
        Ok((stats, self.hash.finish()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{checksum, CommConfig, Param, ParamMut, TcpCommunicator};

    /// Three parameters of 10, 0 and 7 f32 values: with 12-byte buckets one spans buckets,
    /// one is empty and one shares a bucket with the first's tail.
    fn values() -> Vec<(String, Vec<usize>, Vec<f32>)> {
        vec![
            ("a".into(), vec![2, 5], (0..10).map(|i| i as f32).collect()),
            ("b".into(), vec![0], vec![]),
            ("c".into(), vec![7], (0..7).map(|i| -(i as f32)).collect()),
        ]
    }

    #[test]
    fn a_streamed_send_is_received_as_a_plain_one_with_the_same_checksum() {
        for bucket in [12, 4, 1 << 20] {
            let mut comms = TcpCommunicator::loopback_group(2, CommConfig::default()).unwrap();
            let mut receiver = comms.pop().unwrap();
            let mut root = comms.pop().unwrap();
            let recv = std::thread::spawn(move || {
                let mut got: Vec<(String, Vec<usize>, Vec<f32>)> = values()
                    .into_iter()
                    .map(|(n, s, v)| (n, s, vec![0.0; v.len()]))
                    .collect();
                let mut views: Vec<ParamMut<'_>> = got
                    .iter_mut()
                    .map(|(n, s, v)| ParamMut::f32(n.clone(), s, v).unwrap())
                    .collect();
                let stats = BucketedSync::new(bucket)
                    .unwrap()
                    .recv(&mut receiver, 0, &mut views)
                    .unwrap();
                let sum = checksum(&views);
                drop(views);
                (got, stats.buckets, sum)
            });
            let sent = values();
            let metas = sent
                .iter()
                .map(|(n, s, _)| ParamMeta::new(n.clone(), s, DType::F32))
                .collect();
            let sync = BucketedSync::new(bucket).unwrap();
            let mut stream = sync.send_stream(&mut root, metas).unwrap();
            for (n, _, v) in &sent {
                stream.push(n, crate::as_bytes(v)).unwrap();
            }
            let (stats, sum) = stream.finish().unwrap();
            let (got, buckets, recv_sum) = recv.join().unwrap();
            assert_eq!(got, sent, "bucket {bucket}");
            assert_eq!(stats.bytes, 68);
            assert_eq!(stats.buckets, buckets);
            assert_eq!(stats.buckets, 68usize.div_ceil(bucket));
            let views: Vec<Param<'_>> = sent
                .iter()
                .map(|(n, s, v)| Param::f32(n.clone(), s, v).unwrap())
                .collect();
            assert_eq!(sum, checksum(&views), "the checksum of a plain send");
            assert_eq!(sum, recv_sum);
        }
    }

    #[test]
    fn a_checksum_stream_is_the_checksum_and_counts_its_parameters() {
        let sent = values();
        let views: Vec<Param<'_>> = sent
            .iter()
            .map(|(n, s, v)| Param::f32(n.clone(), s, v).unwrap())
            .collect();
        let mut h = crate::ChecksumStream::new(views.len());
        views.iter().for_each(|p| h.add(p));
        assert_eq!(h.finish().unwrap(), checksum(&views));
        let mut short = crate::ChecksumStream::new(views.len());
        short.add(&views[0]);
        let err = short.finish().unwrap_err().to_string();
        assert!(
            err.contains("3 parameters") && err.contains("given 1"),
            "{err}"
        );
    }

    #[test]
    fn pushing_out_of_order_a_wrong_length_or_too_few_is_refused() {
        let mut comm = TcpCommunicator::single(CommConfig::default());
        let metas = || {
            values()
                .iter()
                .map(|(n, s, _)| ParamMeta::new(n.clone(), s, DType::F32))
                .collect::<Vec<_>>()
        };
        let sync = BucketedSync::new(16).unwrap();
        let mut s = sync.send_stream(&mut comm, metas()).unwrap();
        let err = s.push("c", &[0; 28]).unwrap_err().to_string();
        assert!(err.contains("'c'") && err.contains("'a'"), "{err}");
        let err = s.push("a", &[0; 12]).unwrap_err().to_string();
        assert!(err.contains("'a'") && err.contains("40"), "{err}");
        s.push("a", &[0; 40]).unwrap();
        let err = s.finish().unwrap_err().to_string();
        assert!(err.contains("'b'"), "{err}");
        let mut s = sync.send_stream(&mut comm, metas()).unwrap();
        s.push("a", &[0; 40]).unwrap();
        s.push("b", &[]).unwrap();
        s.push("c", &[0; 28]).unwrap();
        let err = s.push("d", &[0; 4]).unwrap_err().to_string();
        assert!(err.contains("'d'") && err.contains("3 listed"), "{err}");
        s.finish().unwrap();
    }
}
