//! Device memory handed to another process of the node by handle: the data path of the
//! trainer → rollout weight sync when every rank of the sync computes on a GPU of one node
//! (CUDA IPC, as OpenRLHF and slime do), while a communicator carries only the control
//! messages. rlhf-roles runs the protocol (its `weights/ipc.rs`); this module owns what
//! touches candle's storage.
//!
//! - [`Region`]: memory this process allocates and exports as a [`Handle`] (on a GPU with
//!   `cuMemAlloc`, since candle's stream-ordered pool allocations cannot be exported).
//! - [`Mapped`]: another process's region, opened by its handle; closed on drop.
//! - [`Dest`]: a new tensor filled piece by piece from a mapping.
//! - [`hash`]: a content hash of a contiguous tensor's bytes computed where the tensor lives
//!   (a kernel on the GPU); [`hash_bytes`] is the same function on the host.
//!
//! Copies are enqueued on candle's stream; [`Region::flush`] and [`Mapped::flush`] wait for
//! them. On the CPU a region is memory of this process that [`Mapped::open`] finds by handle
//! in the same process only: it lets the protocol run in tests without a GPU. A job never
//! uses it ([`supported`] is false on the CPU; CPU ranks sync through the shared-memory
//! communicator).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use candle_core::{CpuStorage, DType, Device, Shape, Storage, Tensor};

use crate::error::{Error, Result};

/// Bytes of a handle (CUDA's IPC memory handle).
pub const HANDLE_BYTES: usize = 64;
/// What another process opens a [`Region`] with.
pub type Handle = [u8; HANDLE_BYTES];

/// Whether tensors on `device` can be handed to another process by handle (a CUDA device in
/// a build with the `cuda` feature).
pub fn supported(device: &Device) -> bool {
    cfg!(feature = "cuda") && device.is_cuda()
}

fn ipc(msg: impl Into<String>) -> Error {
    Error::Ipc(msg.into())
}

fn check_range(what: &str, at: usize, len: usize, size: usize) -> Result<()> {
    match at.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(ipc(format!(
            "{what}: bytes {at}..{} outside its {size} bytes",
            at.saturating_add(len)
        ))),
    }
}

// ---- Process-local memory (the CPU) ---------------------------------------------------------

type HostMem = Mutex<Vec<u8>>;

fn host_regions() -> &'static Mutex<HashMap<Handle, Weak<HostMem>>> {
    static R: OnceLock<Mutex<HashMap<Handle, Weak<HostMem>>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

fn lock<T>(m: &Mutex<T>) -> Result<std::sync::MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| ipc("a lock was poisoned by a panicking thread"))
}

/// Runs `f` on the bytes of the contiguous CPU tensor `t`.
fn with_cpu_bytes<R>(t: &Tensor, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
    let (s, l) = t.storage_and_layout();
    let Storage::Cpu(c) = &*s else {
        return Err(ipc("a CPU region takes CPU tensors"));
    };
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| ipc("the tensor must be contiguous"))?;
    fn bytes<T>(v: &[T]) -> &[u8] {
        // SAFETY: the element types below are plain numbers without padding; the view
        // covers exactly `v`'s bytes and borrows `v`.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
    }
    Ok(match c {
        CpuStorage::BF16(v) => f(bytes(&v[a..b])),
        CpuStorage::F16(v) => f(bytes(&v[a..b])),
        CpuStorage::F32(v) => f(bytes(&v[a..b])),
        CpuStorage::F64(v) => f(bytes(&v[a..b])),
        CpuStorage::U32(v) => f(bytes(&v[a..b])),
        CpuStorage::U8(v) => f(bytes(&v[a..b])),
        CpuStorage::I64(v) => f(bytes(&v[a..b])),
        _ => return Err(ipc(format!("{:?} tensors are not supported", t.dtype()))),
    })
}

fn tensor_from_bytes(bytes: &[u8], dtype: DType, shape: Shape) -> Result<Tensor> {
    fn words<const N: usize>(b: &[u8]) -> impl Iterator<Item = [u8; N]> + '_ {
        b.chunks_exact(N).map(|c| c.try_into().unwrap_or([0; N]))
    }
    let cpu = &Device::Cpu;
    Ok(match dtype {
        DType::BF16 => {
            let v: Vec<half::bf16> = words::<2>(bytes)
                .map(|w| half::bf16::from_bits(u16::from_le_bytes(w)))
                .collect();
            Tensor::from_vec(v, shape, cpu)?
        }
        DType::F16 => {
            let v: Vec<half::f16> = words::<2>(bytes)
                .map(|w| half::f16::from_bits(u16::from_le_bytes(w)))
                .collect();
            Tensor::from_vec(v, shape, cpu)?
        }
        DType::F32 => Tensor::from_vec(
            words::<4>(bytes)
                .map(f32::from_le_bytes)
                .collect::<Vec<_>>(),
            shape,
            cpu,
        )?,
        DType::F64 => Tensor::from_vec(
            words::<8>(bytes)
                .map(f64::from_le_bytes)
                .collect::<Vec<_>>(),
            shape,
            cpu,
        )?,
        d => return Err(ipc(format!("{d:?} parameters are not supported"))),
    })
}

/// The device address of the first byte of the contiguous GPU tensor `t`. It stays valid
/// while `t` (which holds its storage) lives; `not_gpu` is the error for a CPU tensor.
#[cfg(feature = "cuda")]
fn cuda_addr(t: &Tensor, not_gpu: &str) -> Result<u64> {
    let (s, l) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*s else {
        return Err(ipc(not_gpu));
    };
    if !l.is_contiguous() {
        return Err(ipc("the tensor must be contiguous"));
    }
    let (p, es) = crate::kernels::cuda_ipc::storage_ptr(cs);
    Ok(p + (l.start_offset() * es) as u64)
}

// ---- Region, Mapped, Dest -------------------------------------------------------------------

enum RegionMem {
    Host(Arc<HostMem>),
    #[cfg(feature = "cuda")]
    Cuda(crate::kernels::cuda_ipc::Export, candle_core::CudaDevice),
}

/// Memory of this process that another process opens by [`Region::handle`].
pub struct Region {
    mem: RegionMem,
    bytes: usize,
    handle: Handle,
}

impl Region {
    /// `bytes` of memory on `device`, exported. On the CPU the handle is random and opens in
    /// this process only.
    pub fn new(device: &Device, bytes: usize) -> Result<Region> {
        match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => {
                let (e, handle) = crate::kernels::cuda_ipc::Export::new(d, bytes)?;
                Ok(Region {
                    mem: RegionMem::Cuda(e, d.clone()),
                    bytes,
                    handle,
                })
            }
            Device::Cpu => {
                let mem = Arc::new(Mutex::new(vec![0u8; bytes]));
                let mut handle = [0u8; HANDLE_BYTES];
                rand::fill(&mut handle[..]);
                let mut regions = lock(host_regions())?;
                regions.retain(|_, w| w.strong_count() > 0);
                regions.insert(handle, Arc::downgrade(&mem));
                Ok(Region {
                    mem: RegionMem::Host(mem),
                    bytes,
                    handle,
                })
            }
            #[allow(unreachable_patterns)]
            d => Err(ipc(format!(
                "cannot export memory of {d:?}: CUDA IPC needs a build with the `cuda` feature"
            ))),
        }
    }

    pub fn handle(&self) -> Handle {
        self.handle
    }

    pub fn len(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Copies bytes `from..from + len` of the contiguous tensor `src` to `at..at + len` of
    /// the region (enqueued on a GPU; [`Region::flush`] waits).
    pub fn write(&self, at: usize, src: &Tensor, from: usize, len: usize) -> Result<()> {
        check_range("region write", at, len, self.bytes)?;
        let src_bytes = src.elem_count() * src.dtype().size_in_bytes();
        check_range("source tensor", from, len, src_bytes)?;
        match &self.mem {
            RegionMem::Host(m) => {
                let mut m = lock(m)?;
                with_cpu_bytes(src, |b| {
                    m[at..at + len].copy_from_slice(&b[from..from + len])
                })
            }
            #[cfg(feature = "cuda")]
            RegionMem::Cuda(e, d) => {
                let p = cuda_addr(src, "a GPU region takes GPU tensors")? + from as u64;
                Ok(crate::kernels::cuda_ipc::copy(
                    d,
                    e.ptr() + at as u64,
                    p,
                    len,
                )?)
            }
        }
    }

    /// Waits until the writes enqueued so far are in memory.
    pub fn flush(&self) -> Result<()> {
        match &self.mem {
            RegionMem::Host(_) => Ok(()),
            #[cfg(feature = "cuda")]
            RegionMem::Cuda(_, d) => Ok(crate::kernels::cuda_ipc::sync(d)?),
        }
    }
}

enum MappedMem {
    Host(Arc<HostMem>),
    #[cfg(feature = "cuda")]
    Cuda(crate::kernels::cuda_ipc::Import, candle_core::CudaDevice),
}

/// Another process's [`Region`], opened in this one.
pub struct Mapped {
    mem: MappedMem,
    bytes: usize,
}

impl Mapped {
    /// Opens the region of `bytes` behind `handle` for reads into tensors on `device`.
    pub fn open(device: &Device, handle: &Handle, bytes: usize) -> Result<Mapped> {
        match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => {
                let mem = crate::kernels::cuda_ipc::Import::open(d, handle)?;
                // Every read is checked against `bytes`, so `bytes` must be true.
                let have = mem.bytes()?;
                if have < bytes {
                    return Err(ipc(format!(
                        "the region holds {have} bytes, {bytes} were announced"
                    )));
                }
                Ok(Mapped {
                    mem: MappedMem::Cuda(mem, d.clone()),
                    bytes,
                })
            }
            Device::Cpu => {
                let mem = lock(host_regions())?
                    .get(handle)
                    .and_then(Weak::upgrade)
                    .ok_or_else(|| {
                        ipc("no region of this process has that handle (a CPU region opens in its own process only)")
                    })?;
                let have = lock(&mem)?.len();
                if have < bytes {
                    return Err(ipc(format!(
                        "the region holds {have} bytes, {bytes} were announced"
                    )));
                }
                Ok(Mapped {
                    mem: MappedMem::Host(mem),
                    bytes,
                })
            }
            #[allow(unreachable_patterns)]
            d => Err(ipc(format!(
                "cannot open memory for {d:?}: CUDA IPC needs a build with the `cuda` feature"
            ))),
        }
    }

    pub fn len(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Copies `at..at + len` of the mapping to bytes `to..to + len` of `dst` (enqueued on a
    /// GPU; [`Mapped::flush`] waits).
    pub fn read(&self, at: usize, dst: &mut Dest, to: usize, len: usize) -> Result<()> {
        check_range("mapped read", at, len, self.bytes)?;
        check_range("destination tensor", to, len, dst.bytes)?;
        match (&self.mem, &mut dst.mem) {
            (MappedMem::Host(m), DestMem::Host(d)) => {
                d[to..to + len].copy_from_slice(&lock(m)?[at..at + len]);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            (MappedMem::Cuda(i, dev), DestMem::Cuda(s)) => {
                let (p, _) = crate::kernels::cuda_ipc::storage_ptr(s);
                Ok(crate::kernels::cuda_ipc::copy(
                    dev,
                    p + to as u64,
                    i.ptr() + at as u64,
                    len,
                )?)
            }
            #[allow(unreachable_patterns)]
            _ => Err(ipc(
                "the mapping and the destination are on different devices",
            )),
        }
    }

    /// Copies `at..at + len` of the mapping over bytes `to..to + len` of the contiguous GPU
    /// tensor `dst`, in place: every tensor sharing `dst`'s storage (a model's parameter and
    /// its `named_tensors` view) sees the new bytes once the copy ran. The copy is ordered on
    /// candle's stream like a kernel writing its output; [`Mapped::flush`] waits. CPU tensors
    /// are refused (their memory is not written behind Rust's borrows): use a [`Dest`].
    pub fn read_over(&self, at: usize, dst: &Tensor, to: usize, len: usize) -> Result<()> {
        check_range("mapped read", at, len, self.bytes)?;
        check_range(
            "destination tensor",
            to,
            len,
            dst.elem_count() * dst.dtype().size_in_bytes(),
        )?;
        match &self.mem {
            #[cfg(feature = "cuda")]
            MappedMem::Cuda(i, dev) => {
                let p = cuda_addr(dst, "a GPU mapping writes GPU tensors only")? + to as u64;
                Ok(crate::kernels::cuda_ipc::copy(
                    dev,
                    p,
                    i.ptr() + at as u64,
                    len,
                )?)
            }
            MappedMem::Host(_) => Err(ipc(
                "in-place reads are for GPU tensors; read a CPU tensor into a Dest",
            )),
        }
    }

    /// Waits until the reads enqueued so far are done.
    pub fn flush(&self) -> Result<()> {
        match &self.mem {
            MappedMem::Host(_) => Ok(()),
            #[cfg(feature = "cuda")]
            MappedMem::Cuda(_, d) => Ok(crate::kernels::cuda_ipc::sync(d)?),
        }
    }
}

enum DestMem {
    Host(Vec<u8>),
    #[cfg(feature = "cuda")]
    Cuda(candle_core::CudaStorage),
}

/// A tensor of a given dtype and shape being filled from a [`Mapped`] region.
pub struct Dest {
    mem: DestMem,
    dtype: DType,
    shape: Shape,
    bytes: usize,
}

impl Dest {
    /// A zeroed `dtype` tensor of `shape` on `device`.
    pub fn new(device: &Device, dtype: DType, shape: impl Into<Shape>) -> Result<Dest> {
        let shape = shape.into();
        let bytes = shape.elem_count() * dtype.size_in_bytes();
        let mem = match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => DestMem::Cuda(crate::kernels::cuda_ipc::zeros(
                d,
                dtype,
                shape.elem_count(),
            )?),
            Device::Cpu => DestMem::Host(vec![0; bytes]),
            #[allow(unreachable_patterns)]
            d => return Err(ipc(format!("no hand-over to {d:?}"))),
        };
        Ok(Dest {
            mem,
            dtype,
            shape,
            bytes,
        })
    }

    pub fn len(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The filled tensor (after the mapping's [`Mapped::flush`] on a GPU).
    pub fn finish(self) -> Result<Tensor> {
        match self.mem {
            DestMem::Host(b) => tensor_from_bytes(&b, self.dtype, self.shape),
            #[cfg(feature = "cuda")]
            DestMem::Cuda(s) => Ok(Tensor::from_storage(
                Storage::Cuda(s),
                self.shape,
                candle_core::op::BackpropOp::none(),
                false,
            )),
        }
    }
}

// ---- The content hash -----------------------------------------------------------------------

fn mix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x7feb_352d);
    h ^= h >> 15;
    h = h.wrapping_mul(0x846c_a68b);
    h ^= h >> 16;
    h
}

fn term(u: u32, i: u64) -> u64 {
    let (lo, hi) = (i as u32, (i >> 32) as u32);
    let a = mix32(u ^ lo.wrapping_mul(0x9E37_79B1) ^ hi.wrapping_mul(0x85EB_CA77));
    let b = mix32(a ^ 0x5bd1_e995 ^ hi.wrapping_add(0x27d4_eb2f));
    (u64::from(a) << 32) | u64::from(b)
}

/// The hash of `bytes` (an even count) read as little-endian 16-bit units numbered from
/// `base`: the wrapping sum over units `u_i` of a mix of `(u_i, base + i)`. Sums of ranges
/// with their unit offsets add up to the hash of the whole, so both sides of a sync can
/// hash in pieces of any split.
pub fn hash_bytes(bytes: &[u8], base: u64) -> u64 {
    bytes.chunks_exact(2).enumerate().fold(0u64, |acc, (i, w)| {
        acc.wrapping_add(term(
            u32::from(u16::from_le_bytes([w[0], w[1]])),
            base.wrapping_add(i as u64),
        ))
    })
}

/// [`hash_bytes`] of the contiguous tensor `t`'s bytes, computed on its device.
pub fn hash(t: &Tensor, base: u64) -> Result<u64> {
    let mut h = Hasher::default();
    h.add(t, base)?;
    h.finish()
}

/// A sum of [`hash`]es: on a GPU the kernels add into one device word, read back once by
/// [`Hasher::finish`], so hashing many tensors waits for the GPU once.
#[derive(Default)]
pub struct Hasher {
    host: u64,
    #[cfg(feature = "cuda")]
    cuda: Option<crate::kernels::cuda_ipc::HashAcc>,
}

impl Hasher {
    /// Adds [`hash`]`(t, base)`.
    pub fn add(&mut self, t: &Tensor, base: u64) -> Result<()> {
        let len = t.elem_count() * t.dtype().size_in_bytes();
        if !len.is_multiple_of(2) {
            return Err(ipc(format!(
                "cannot hash {len} bytes of {:?}: the hash reads 16-bit units",
                t.dtype()
            )));
        }
        match t.device() {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => {
                let p = cuda_addr(t, "a CUDA tensor without CUDA storage")?;
                if self.cuda.is_none() {
                    self.cuda = Some(crate::kernels::cuda_ipc::HashAcc::new(d)?);
                }
                if let Some(acc) = self.cuda.as_mut() {
                    acc.add(p, len, base)?;
                }
                Ok(())
            }
            Device::Cpu => {
                let h = with_cpu_bytes(t, |b| hash_bytes(b, base))?;
                self.host = self.host.wrapping_add(h);
                Ok(())
            }
            #[allow(unreachable_patterns)]
            d => Err(ipc(format!("cannot hash a tensor on {d:?}"))),
        }
    }

    /// The sum of everything added.
    pub fn finish(&self) -> Result<u64> {
        #[cfg(feature = "cuda")]
        if let Some(acc) = &self.cuda {
            return Ok(self.host.wrapping_add(acc.finish()?));
        }
        Ok(self.host)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_is_additive_over_pieces_and_sees_positions_and_bits() {
        let bytes: Vec<u8> = (0..1000u32).map(|i| (i * 37 % 251) as u8).collect();
        let whole = hash_bytes(&bytes, 7);
        for cut in [0, 2, 100, 998, 1000] {
            let (a, b) = bytes.split_at(cut);
            let sum = hash_bytes(a, 7).wrapping_add(hash_bytes(b, 7 + cut as u64 / 2));
            assert_eq!(sum, whole, "split at {cut}");
        }
        let mut flipped = bytes.clone();
        flipped[501] ^= 0x10;
        assert_ne!(hash_bytes(&flipped, 7), whole, "one flipped bit");
        let mut swapped = bytes.clone();
        swapped.swap(10, 12);
        swapped.swap(11, 13);
        assert_ne!(hash_bytes(&swapped, 7), whole, "two units swapped");
        assert_ne!(hash_bytes(&bytes, 8), whole, "another base");
    }

    #[test]
    fn cpu_region_round_trips_tensors_and_refuses_bad_ranges() {
        let dev = Device::Cpu;
        let t = Tensor::arange(0f32, 10.0, &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let r = Region::new(&dev, 24).unwrap();
        // The tensor's 20 bytes in two pieces, at an offset.
        r.write(4, &t, 0, 8).unwrap();
        r.write(12, &t, 8, 12).unwrap();
        r.flush().unwrap();
        let m = Mapped::open(&dev, &r.handle(), 24).unwrap();
        let mut d = Dest::new(&dev, DType::BF16, (2, 5)).unwrap();
        m.read(4, &mut d, 0, 20).unwrap();
        m.flush().unwrap();
        let back = d.finish().unwrap();
        assert_eq!(
            back.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap(),
            t.to_vec1::<half::bf16>().unwrap()
        );
        assert_eq!(hash(&back, 3).unwrap(), hash(&t, 3).unwrap());
        let e = r.write(20, &t, 0, 8).unwrap_err().to_string();
        assert!(e.contains("outside its 24 bytes"), "{e}");
        let e = Mapped::open(&dev, &[9; HANDLE_BYTES], 8)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("no region of this process has that handle"),
            "{e}"
        );
        let e = Mapped::open(&dev, &r.handle(), 25)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("24 bytes, 25 were announced"), "{e}");
        drop(m);
        drop(r);
    }
}
