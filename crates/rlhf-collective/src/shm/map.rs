//! The memory mapping under a shared-memory communicator: an anonymous memory file (memfd)
//! made by rank 0, or the same file opened by another rank through /proc.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

use super::Header;

/// A shared, read-write mapping of a whole file; unmapped on drop. The file stays open as
/// long as the mapping, so the segment's address stays valid for ranks still joining.
pub(super) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    _file: File,
}

// SAFETY: the mapping is owned by this value and freed once, in `Drop`; every access to it
// that other processes may race with goes through atomics (the header) or is ordered by
// them (slot bytes are written before the release store of their sequence number and read
// after its acquire load), so moving the owner to another thread is sound.
unsafe impl Send for Mapping {}

impl Mapping {
    /// A new zero-filled segment of `len` bytes; returns it and its file descriptor number.
    pub(super) fn create(len: usize) -> io::Result<(Self, i32)> {
        // SAFETY: the name is a NUL-terminated C string literal; the flags are valid.
        let fd = unsafe { libc::memfd_create(c"rlhf-collective".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        file.set_len(len as u64)?;
        Ok((Self::map(file, len)?, fd))
    }

    /// Opens an existing segment through `path` (a /proc/PID/fd/FD link); it must be at
    /// least `min_len` bytes.
    pub(super) fn open(path: &str, min_len: usize) -> io::Result<Self> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let len = file.metadata()?.len() as usize;
        if len < min_len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{len} bytes, too small for a segment header"),
            ));
        }
        Self::map(file, len)
    }

    fn map(file: File, len: usize) -> io::Result<Self> {
        // SAFETY: a fresh shared mapping of `len` bytes of an open file that is at least
        // that long; the kernel picks the address. The result is checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave null"))?;
        Ok(Self {
            ptr,
            len,
            _file: file,
        })
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The segment's header.
    pub(super) fn header(&self) -> &Header {
        // SAFETY: every mapping is at least `DATA_OFFSET` ≥ size_of::<Header>() bytes (checked
        // at open, sized at create), page-aligned (so aligned for Header), and lives as long
        // as the returned borrow. Header holds atomics only, which other processes may
        // change at any time without that being undefined behaviour; all-zero bytes (a fresh
        // memfd) are valid atomics.
        unsafe { &*self.ptr.as_ptr().cast::<Header>() }
    }

    /// The first byte of slot `i` of `slot_bytes`.
    pub(super) fn slot(&self, i: usize, slot_bytes: usize) -> *mut u8 {
        let end = i
            .checked_mul(slot_bytes)
            .and_then(|o| o.checked_add(super::DATA_OFFSET))
            .and_then(|at| Some((at, at.checked_add(slot_bytes)?)));
        // Checked when the segment was created or joined (its length is DATA_OFFSET plus
        // SLOTS slots); a failure here is a bug of this crate, not input.
        let at = match end {
            Some((at, end)) if end <= self.len => at,
            _ => panic!("slot {i} of {slot_bytes} bytes is outside the segment"),
        };
        // SAFETY: `at + slot_bytes <= len`, so the offset stays inside the mapping.
        unsafe { self.ptr.as_ptr().add(at) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned; nothing borrows the mapping
        // past the owner's life.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}
