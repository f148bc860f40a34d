//! One shared-memory segment's layout and the mappings both sides make of it.
//!
//! A segment is a memory file (memfd) of one header page followed by the data area. The
//! header holds a magic, the segment's random id and the lease word, the one word both
//! processes write:
//!
//! - `FREE` (0): the sender may write the data area;
//! - `WRITING`: the sender is filling it;
//! - `written(g)`: batch generation `g` is in the data area, no reader has claimed it yet;
//! - `claimed(g, pid)`: reader `pid` holds views of generation `g` (the sender must not
//!   touch the data area until the reader sets `FREE` again, or has died).
//!
//! Only compare-and-swap moves the word between states, so a reader that comes late (the
//! sender already took the batch back) fails its claim instead of reading other bytes.

use std::sync::atomic::{AtomicU64, Ordering};

pub(super) const PAGE: usize = 4096;
pub(super) const MAGIC: u64 = u64::from_le_bytes(*b"RLHFSBT1");
pub(super) const ID_BYTES: usize = 16;
/// Seals every segment carries: its size never changes after creation.
pub(super) const SIZE_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

pub(super) const FREE: u64 = 0;
/// No `claimed` value: that would need pid `u32::MAX`.
pub(super) const WRITING: u64 = u64::MAX;

pub(super) fn written(generation: u32) -> u64 {
    u64::from(generation) << 32
}

pub(super) fn claimed(generation: u32, pid: u32) -> u64 {
    written(generation) | u64::from(pid)
}

/// The pid that claimed a lease word, if one did.
pub(super) fn claimant(lease: u64) -> Option<u32> {
    let pid = lease as u32;
    (lease != WRITING && pid != 0).then_some(pid)
}

/// The header page's fields. Every field is atomic: two processes read and write it.
#[repr(C)]
pub(super) struct Header {
    pub magic: AtomicU64,
    pub id: [AtomicU64; ID_BYTES / 8],
    pub lease: AtomicU64,
}

impl Header {
    pub fn id(&self) -> [u8; ID_BYTES] {
        let mut out = [0u8; ID_BYTES];
        for (w, c) in self.id.iter().zip(out.chunks_exact_mut(8)) {
            c.copy_from_slice(&w.load(Ordering::Acquire).to_le_bytes());
        }
        out
    }

    pub fn set_id(&self, id: &[u8; ID_BYTES]) {
        for (w, c) in self.id.iter().zip(id.chunks_exact(8)) {
            let mut b = [0u8; 8];
            b.copy_from_slice(c);
            w.store(u64::from_le_bytes(b), Ordering::Release);
        }
    }

    /// Moves the lease from `from` to `to`; whether it was `from`.
    pub fn swap_lease(&self, from: u64, to: u64) -> bool {
        self.lease
            .compare_exchange(from, to, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
}

/// An `mmap` of part of a segment file; unmapped on drop.
pub(super) struct Map {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a `Map` is a plain address range; the data area is only written by the sender
// while no reader holds a lease on it (the lease protocol above), and the header is only
// accessed through atomics.
unsafe impl Send for Map {}
// SAFETY: as above.
unsafe impl Sync for Map {}

impl Map {
    /// Maps `len` bytes of `fd` from `offset` (a multiple of the page size), shared, every
    /// page mapped in now.
    pub fn new(fd: i32, offset: usize, len: usize, writable: bool) -> std::io::Result<Self> {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh mapping of an open descriptor, checked for failure below; the
        // caller guarantees the file is at least `offset + len` bytes long.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len.max(1),
                prot,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd,
                offset as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }

    /// The header at the start of a mapping that begins with the header page.
    pub fn header(&self) -> &Header {
        debug_assert!(self.len >= std::mem::size_of::<Header>());
        // SAFETY: the mapping is page-aligned and at least a page long when it starts with
        // the header page; every field is an atomic, valid for any bit pattern.
        unsafe { &*(self.ptr as *const Header) }
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` mapped bytes from `ptr`, alive until drop. Their content changes
        // only when no lease is held (see the module's protocol).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The mapping to write, from `offset` on.
    ///
    /// # Safety
    /// The mapping must be writable, and the caller must hold the segment's lease in
    /// `WRITING` (no reader looks at these bytes meanwhile).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, offset: usize) -> &mut [u8] {
        // SAFETY: the caller's contract above; the range lies inside the mapping.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(offset), self.len - offset) }
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what mmap returned; no reference into it outlives `self`.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len.max(1));
        }
    }
}
