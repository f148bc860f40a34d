//! Freed memory back to the operating system. A trainer frees large buffers in bursts (the
//! load's staging copies, every step's gradients and activations); glibc's allocator keeps
//! freed heap memory for reuse, so the process's resident size — what an operator, a
//! container limit and `rlhf-head check`'s estimate compare — would carry every burst's
//! leftovers into the next phase. After a load and after an update the role hands them back.

/// Returns the allocator's free heap memory to the system (glibc; elsewhere a no-op).
pub fn release_freed() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks and shrinks the allocator's own free lists; it takes
    // the allocator's locks like any malloc call and touches no memory that is in use.
    unsafe {
        libc::malloc_trim(0);
    }
}
