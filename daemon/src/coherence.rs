//! Cache maintenance for pools that are not hardware-coherent across hosts (`coherent=false`
//! in a raw pool's spec): a host's CPU caches may hold lines of the device that another host
//! has since written, and a host's writes may sit in its caches where no other host sees
//! them. So a writer writes an entry's lines back before it is published, and a reader drops
//! its stale copies of another host's entry before its first read. Lines are tagged by
//! physical address: doing it through the daemon's own mapping of the device covers every
//! process of the host that maps the same pages.

/// The cache line size this code steps by (x86-64 and Arm servers: 64 bytes).
const LINE: usize = 64;

/// Whether this CPU architecture has the instructions (x86-64: `clflush`; AArch64:
/// `dc civac`).
pub const SUPPORTED: bool = cfg!(any(target_arch = "x86_64", target_arch = "aarch64"));

/// Writes back and invalidates every cache line of `bytes`, then waits until that is done.
/// On a range nobody dirtied it only invalidates: the same call serves the writer's flush and
/// the reader's invalidation.
pub fn flush(bytes: &[u8]) {
    let start = bytes.as_ptr() as usize & !(LINE - 1);
    let end = bytes.as_ptr() as usize + bytes.len();
    let mut p = start;
    while p < end {
        flush_line(p as *const u8);
        p += LINE;
    }
    fence();
}

#[cfg(target_arch = "x86_64")]
fn flush_line(p: *const u8) {
    // SAFETY: `p` lies in (or in the line of) a live mapping the caller borrowed; clflush
    // only needs the address to be readable.
    unsafe { core::arch::x86_64::_mm_clflush(p) }
}

#[cfg(target_arch = "x86_64")]
fn fence() {
    // SAFETY: a fence has no memory operands.
    unsafe { core::arch::x86_64::_mm_mfence() }
}

#[cfg(target_arch = "aarch64")]
fn flush_line(p: *const u8) {
    // SAFETY: as above: clean and invalidate by virtual address to the point of coherency.
    unsafe { core::arch::asm!("dc civac, {0}", in(reg) p, options(nostack, preserves_flags)) }
}

#[cfg(target_arch = "aarch64")]
fn fence() {
    // SAFETY: a barrier has no operands.
    unsafe { core::arch::asm!("dsb ish", options(nostack, preserves_flags)) }
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn flush_line(_p: *const u8) {}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn fence() {}

/// A raw pool's device, mapped read-only, for a writer's lines to be written back before its
/// entry is published: held apart from the pool, so that the write-back runs without the
/// store's lock (an entry of a GiB is 16 million lines).
pub struct WriteBack {
    map: memmap2::Mmap,
    /// Bytes written back so far.
    flushed: std::sync::atomic::AtomicU64,
    /// Bytes readers invalidated so far.
    invalidated: std::sync::atomic::AtomicU64,
}

impl WriteBack {
    pub fn new(map: memmap2::Mmap) -> Self {
        Self {
            map,
            flushed: std::sync::atomic::AtomicU64::new(0),
            invalidated: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Writes back (and invalidates) the lines of `[offset, offset + len)` of the device (the
    /// part of it inside the device); returns the bytes.
    pub fn flush(&self, offset: u64, len: u64) -> u64 {
        let done = self.drop_lines(offset, len);
        self.flushed
            .fetch_add(done, std::sync::atomic::Ordering::Relaxed);
        done
    }

    /// Drops this host's cached lines of `[offset, offset + len)` before a reader's first read
    /// of another host's entry (by the writer's instructions, counted apart); returns the
    /// bytes. Run without the store's lock.
    pub fn invalidate(&self, offset: u64, len: u64) -> u64 {
        let done = self.drop_lines(offset, len);
        self.invalidated
            .fetch_add(done, std::sync::atomic::Ordering::Relaxed);
        done
    }

    /// Writes back and drops the lines of `[offset, offset + len)` (the part inside the
    /// device); returns the bytes.
    fn drop_lines(&self, offset: u64, len: u64) -> u64 {
        let n = self.map.len() as u64;
        let (s, e) = (
            offset.min(n) as usize,
            offset.saturating_add(len).min(n) as usize,
        );
        flush(&self.map[s..e]);
        (e - s) as u64
    }

    /// Bytes written back so far.
    pub fn flushed(&self) -> u64 {
        self.flushed.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Bytes readers invalidated so far.
    pub fn invalidated(&self) -> u64 {
        self.invalidated.load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flushing_keeps_the_bytes_whatever_the_alignment() {
        let mut v: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let want = v.clone();
        flush(&v[3..9_001]);
        flush(&v[..0]);
        assert_eq!(v, want);
        v[5_000] = 1;
        flush(&v);
        assert_eq!(v[5_000], 1);
    }
}
