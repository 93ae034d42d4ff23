//! Leased memory: pieces of a registered buffer (an [`Arena`]) that callers hold, write and
//! read in place. A store WRITEs straight from a caller's lease
//! ([`crate::RemoteClient::store_leased`]) and a load READs straight into new leases
//! ([`crate::RemoteClient::retrieve_leased`]): no copy through the client's staging buffer.
//! The Python package's remote handler hands leases out as its `alloc` buffers and the views
//! of what it retrieves.
//!
//! - An arena is carved first-fit in [`ARENA_ALIGN`] pieces; a lease gives its piece back when
//!   dropped.
//! - Stores leave the *load reserve* free ([`Purpose`]): a store lease that would take it is
//!   refused, so a caller that holds many unstored allocations makes stores, not loads, give
//!   way (the original design's `remote_load_reserve`).
//! - A READ into leases that times out keeps them (the NIC may still write into them) until
//!   NIXL says it ended, as the staging buffer is kept.
//!
//! The arena is host memory, registered as DRAM. Its memory kind and device travel with it
//! into every descriptor ([`Arena::mem`]), so an arena of GPU memory (registered as VRAM, for
//! GPUDirect RDMA into the GPU) needs only a constructor over memory CUDA allocated; that
//! constructor is not built (nothing here can test it). The verbs that use leases are the
//! client's (`client/leases.rs`).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::report::chain;
use maru_nixl::{Agent, Desc, Mem};
use memmap2::MmapMut;

/// Leases start at multiples of this (a page): two leases never share a page, and a lease's
/// page index names it in its arena.
pub const ARENA_ALIGN: usize = 4096;

/// What a lease is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// Bytes a caller writes, then stores: refused where it would take the load reserve.
    Store,
    /// Bytes a load reads into: any free piece.
    Load,
}

/// An arena's use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ArenaStats {
    /// Bytes in the arena.
    pub capacity: u64,
    /// Bytes no lease holds.
    pub free: u64,
    /// Bytes stores leave free for loads.
    pub load_reserve: u64,
    /// Leases held (those a timed-out READ keeps included).
    pub leases: u64,
    /// Store leases refused (no room outside the load reserve).
    pub store_refused: u64,
    /// Entries a load found and could not take: no free piece large enough (answered as
    /// misses).
    pub load_refused: u64,
}

/// The free pieces of an arena: offset -> length, multiples of [`ARENA_ALIGN`], never
/// adjacent (freed pieces merge with their neighbours).
#[derive(Debug, Default)]
pub(crate) struct Extents {
    pub(crate) free: BTreeMap<usize, usize>,
    pub(crate) free_bytes: usize,
    pub(crate) leases: u64,
    pub(crate) store_refused: u64,
    pub(crate) load_refused: u64,
}

impl Extents {
    pub(crate) fn new(len: usize) -> Self {
        let mut free = BTreeMap::new();
        if len > 0 {
            free.insert(0, len);
        }
        Extents {
            free,
            free_bytes: len,
            ..Default::default()
        }
    }

    /// The first free piece of `span` bytes.
    fn take(&mut self, span: usize) -> Option<usize> {
        let (&off, &len) = self.free.iter().find(|&(_, &len)| len >= span)?;
        self.free.remove(&off);
        if len > span {
            self.free.insert(off + span, len - span);
        }
        self.free_bytes -= span;
        self.leases += 1;
        Some(off)
    }

    /// Gives `[off, off + span)` back, merged with the free pieces around it.
    fn give(&mut self, off: usize, span: usize) {
        let (mut start, mut len) = (off, span);
        if let Some(next) = self.free.remove(&(off + span)) {
            len += next;
        }
        if let Some((&prev, &plen)) = self.free.range(..off).next_back()
            && prev + plen == off
        {
            self.free.remove(&prev);
            start = prev;
            len += plen;
        }
        self.free.insert(start, len);
        self.free_bytes += span;
        self.leases -= 1;
    }
}

/// An arena's memory and bookkeeping, shared by the arena's handles and its leases.
pub(crate) struct Shared {
    /// The mapping (host memory); `None` once leaked.
    pub(crate) map: Option<MmapMut>,
    pub(crate) addr: u64,
    pub(crate) len: usize,
    pub(crate) mem: Mem,
    pub(crate) dev: u64,
    pub(crate) reserve: usize,
    pub(crate) agent: Arc<Agent>,
    pub(crate) extents: Mutex<Extents>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        let Some(map) = self.map.take() else { return };
        let desc = Desc {
            addr: self.addr,
            len: self.len as u64,
            dev: self.dev,
        };
        match self.agent.deregister(self.mem, &[desc]) {
            Ok(()) => drop(map),
            Err(e) => {
                tracing::warn!(
                    bytes = self.len,
                    "a lease arena could not be deregistered from NIXL; it stays mapped: {}",
                    chain(&e)
                );
                std::mem::forget(map);
            }
        }
    }
}

/// Memory registered with a client's NIXL agent, leased out in pieces. Cloning gives another
/// handle to the same arena; it is unmapped when the last handle and lease are gone.
#[derive(Clone)]
pub struct Arena {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("addr", &format_args!("{:#x}", self.shared.addr))
            .field("len", &self.shared.len)
            .field("mem", &self.shared.mem)
            .finish_non_exhaustive()
    }
}

impl Arena {
    /// A lease of `len` bytes for `purpose`, or `None` when no free piece fits (for a store:
    /// none outside the load reserve). A lease of 0 bytes takes no piece.
    pub fn lease(&self, len: usize, purpose: Purpose) -> Option<Lease> {
        let sh = &self.shared;
        if len == 0 {
            return Some(Lease {
                arena: sh.clone(),
                off: 0,
                len: 0,
                span: 0,
            });
        }
        let span = len.checked_next_multiple_of(ARENA_ALIGN)?;
        let mut ex = lock(&sh.extents);
        let off = match purpose {
            Purpose::Store if ex.free_bytes < span.saturating_add(sh.reserve) => None,
            _ => ex.take(span),
        };
        let Some(off) = off else {
            match purpose {
                Purpose::Store => ex.store_refused += 1,
                Purpose::Load => ex.load_refused += 1,
            }
            return None;
        };
        drop(ex);
        Some(Lease {
            arena: sh.clone(),
            off,
            len,
            span,
        })
    }

    /// Its use now.
    pub fn stats(&self) -> ArenaStats {
        let sh = &self.shared;
        let ex = lock(&sh.extents);
        ArenaStats {
            capacity: sh.len as u64,
            free: ex.free_bytes as u64,
            load_reserve: sh.reserve as u64,
            leases: ex.leases,
            store_refused: ex.store_refused,
            load_refused: ex.load_refused,
        }
    }

    /// The memory's kind (host memory now; see the module's documentation).
    pub fn mem(&self) -> Mem {
        self.shared.mem
    }

    /// Its first byte's address.
    pub fn addr(&self) -> u64 {
        self.shared.addr
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.shared.len
    }

    /// Whether it has no bytes (never: arenas are made with some).
    pub fn is_empty(&self) -> bool {
        self.shared.len == 0
    }

    /// Whether `lease` is a lease of this arena.
    pub fn holds(&self, lease: &Lease) -> bool {
        Arc::ptr_eq(&self.shared, &lease.arena)
    }
}

/// A piece of an [`Arena`]: its holder's to write and read until dropped, when the piece
/// goes back. Not `Clone`: one holder (share it in an `Arc`).
pub struct Lease {
    pub(crate) arena: Arc<Shared>,
    pub(crate) off: usize,
    pub(crate) len: usize,
    /// The piece's length (`len` rounded up to [`ARENA_ALIGN`]; 0 for an empty lease).
    pub(crate) span: usize,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("offset", &self.off)
            .field("len", &self.len)
            .finish()
    }
}

impl Lease {
    /// Its length in bytes (as asked, or the entry's).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its offset in its arena (a multiple of [`ARENA_ALIGN`]).
    pub fn offset(&self) -> usize {
        self.off
    }

    /// Its first byte's address.
    pub fn addr(&self) -> u64 {
        self.arena.addr + self.off as u64
    }

    /// Its first byte, for callers that hand the memory out themselves (the Python package
    /// exports it through the buffer protocol). Valid while the lease lives.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.addr() as usize as *mut u8
    }

    /// Its bytes, to write.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: `[off, off + len)` lies in the arena's mapping, which the `Arc` keeps; no
        // other lease covers it (the extents hand each piece out once), a `Lease` is not
        // `Clone`, and `&mut self` is this lease's only access: the bytes are ours alone.
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), self.len) }
    }

    /// Copies its first `dst.len()` bytes (at most its length) into `dst`. The copy is made
    /// through a raw pointer: holders may have handed the memory out (to Python) and have it
    /// written meanwhile, as they may.
    pub fn copy_to(&self, dst: &mut [u8]) {
        let n = dst.len().min(self.len);
        if n == 0 {
            return;
        }
        // SAFETY: `[off, off + n)` lies in the mapping the `Arc` keeps; `dst` is a distinct
        // buffer of at least `n` bytes.
        unsafe { std::ptr::copy_nonoverlapping(self.as_mut_ptr(), dst.as_mut_ptr(), n) };
    }

    /// The NIXL descriptor of its first `len` bytes.
    pub(crate) fn desc(&self, len: usize) -> Desc {
        Desc {
            addr: self.addr(),
            len: len as u64,
            dev: self.arena.dev,
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.span > 0 {
            lock(&self.arena.extents).give(self.off, self.span);
        }
    }
}

/// What a transfer that times out keeps from reuse until NIXL says it is over.
pub(crate) enum Keep<'a> {
    /// The client's staging buffer.
    Staging,
    /// These leases (taken from the vector): a READ's targets.
    Leases(&'a mut Vec<Lease>),
    /// The arenas a WRITE from leases reads: mapped and registered while it may still read
    /// them, whatever the caller does with its leases and handles meanwhile (what it reads
    /// lands only in quarantined pages).
    Sources(Vec<Arc<Shared>>),
}

/// A mutex's guard, also after a panic of a holder (the data is counters and free lists, whole
/// at every step).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| {
        m.clear_poison();
        p.into_inner()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_are_taken_first_fit_and_merge_when_given_back() {
        let a = ARENA_ALIGN;
        let mut ex = Extents::new(8 * a);
        let x = ex.take(2 * a).unwrap();
        let y = ex.take(a).unwrap();
        let z = ex.take(3 * a).unwrap();
        assert_eq!((x, y, z), (0, 2 * a, 3 * a));
        assert_eq!((ex.free_bytes, ex.leases), (2 * a, 3));
        assert!(ex.take(3 * a).is_none());
        // Freed pieces merge with both neighbours: one piece again in the end.
        ex.give(y, a);
        assert_eq!(ex.free.len(), 2);
        ex.give(x, 2 * a);
        assert_eq!(ex.free.iter().next(), Some((&0, &(3 * a))));
        assert_eq!(ex.take(3 * a), Some(0));
        ex.give(0, 3 * a);
        ex.give(z, 3 * a);
        assert_eq!(ex.free.into_iter().collect::<Vec<_>>(), vec![(0, 8 * a)]);
        assert_eq!(ex.free_bytes, 8 * a);
        assert_eq!(ex.leases, 0);
    }

    #[test]
    fn a_piece_fits_the_first_hole_large_enough() {
        let a = ARENA_ALIGN;
        let mut ex = Extents::new(10 * a);
        let p: Vec<usize> = (0..5).map(|_| ex.take(2 * a).unwrap()).collect();
        ex.give(p[1], 2 * a);
        ex.give(p[3], 2 * a);
        assert_eq!(ex.take(a), Some(p[1]));
        assert_eq!(ex.take(2 * a), Some(p[3]));
        assert_eq!(ex.take(a), Some(p[1] + a));
        assert_eq!(ex.take(a), None);
    }
}
