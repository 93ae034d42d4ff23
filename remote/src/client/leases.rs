//! Leased memory: pieces of a registered buffer (an [`Arena`]) that callers hold, write and
//! read in place. A store WRITEs straight from a caller's lease
//! ([`RemoteClient::store_leased`]) and a load READs straight into new leases
//! ([`RemoteClient::retrieve_leased`]): no copy through the client's staging buffer. The
//! Python package's remote handler hands leases out as its `alloc` buffers and the views of
//! what it retrieves.
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
//! constructor is not built (nothing here can test it).

use std::collections::BTreeMap;

use super::*;

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
struct Extents {
    free: BTreeMap<usize, usize>,
    free_bytes: usize,
    leases: u64,
    store_refused: u64,
    load_refused: u64,
}

impl Extents {
    fn new(len: usize) -> Self {
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
struct Shared {
    /// The mapping (host memory); `None` once leaked.
    map: Option<MmapMut>,
    addr: u64,
    len: usize,
    mem: Mem,
    dev: u64,
    reserve: usize,
    agent: Arc<Agent>,
    extents: Mutex<Extents>,
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
    shared: Arc<Shared>,
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
    arena: Arc<Shared>,
    off: usize,
    len: usize,
    /// The piece's length (`len` rounded up to [`ARENA_ALIGN`]; 0 for an empty lease).
    span: usize,
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
    fn desc(&self, len: usize) -> Desc {
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

impl RemoteClient {
    /// Maps `bytes` of host memory (rounded up to [`ARENA_ALIGN`]) and registers it with this
    /// client's agent, to lease out; stores leave `load_reserve` bytes of it free for loads.
    pub fn arena(&self, bytes: usize, load_reserve: usize) -> Result<Arena> {
        let len = bytes
            .checked_next_multiple_of(ARENA_ALIGN)
            .filter(|&n| n > 0)
            .ok_or_else(|| Error::InvalidArgument(format!("an arena of {bytes} bytes")))?;
        let map = MmapMut::map_anon(len).map_err(|source| Error::Staging { bytes: len, source })?;
        let addr = map.as_ptr() as u64;
        self.agent
            .register(Mem::Dram, &[Desc::host(addr, len as u64)])
            .map_err(nixl_err("registering a lease arena"))?;
        Ok(Arena {
            shared: Arc::new(Shared {
                map: Some(map),
                addr,
                len,
                mem: Mem::Dram,
                dev: 0,
                reserve: load_reserve.min(len),
                agent: self.agent.clone(),
                extents: Mutex::new(Extents::new(len)),
            }),
        })
    }

    /// Stores `(key, lease, len)` items: each entry is the lease's first `len` bytes, written
    /// into the pool straight from the lease (one WRITE list per chunk, as
    /// [`batch_store`](Self::batch_store)). One outcome per item, in order; an item that is
    /// empty, longer than its lease, or leased from another client's arena fails alone
    /// ([`Error::InvalidArgument`]); a failure of the pool fails the call (chunks before it
    /// may be stored). The leases stay the caller's.
    pub fn store_leased(
        &self,
        ns: &str,
        items: &[(&str, &Lease, usize)],
    ) -> Result<Vec<Result<Stored>>> {
        let mut out: Vec<Option<Result<Stored>>> = Vec::with_capacity(items.len());
        let mut valid = Vec::with_capacity(items.len());
        let mut mem = None;
        for (i, &(key, lease, len)) in items.iter().enumerate() {
            let bad = if len == 0 {
                Some(format!("{key}: an empty value is not stored remotely"))
            } else if len > lease.len {
                Some(format!(
                    "{key}: {len} bytes asked of a lease of {}",
                    lease.len
                ))
            } else if !Arc::ptr_eq(&lease.arena.agent, &self.agent) {
                Some(format!("{key}: the lease is of another client's arena"))
            } else if mem.is_some_and(|m| m != lease.arena.mem) {
                Some(format!("{key}: leases of one call are of one memory kind"))
            } else {
                None
            };
            match bad {
                Some(m) => out.push(Some(Err(Error::InvalidArgument(m)))),
                None => {
                    mem = Some(lease.arena.mem);
                    out.push(None);
                    valid.push((i, key, lease, len));
                }
            }
        }
        let keys: Vec<&str> = valid.iter().map(|v| v.1).collect();
        let mut start = 0;
        while start < valid.len() {
            let (end, part) = self.run(|inner| {
                let end = plan_keys(ns, &keys, start, max_items(inner));
                let part = self.store_leased_chunk(inner, ns, &valid[start..end])?;
                Ok((end, part))
            })?;
            for (&(i, ..), r) in valid[start..end].iter().zip(part) {
                out[i] = Some(r);
            }
            start = end;
        }
        Ok(out
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(Error::Protocol("no outcome".into()))))
            .collect())
    }

    /// Loads entries into new leases of `arena` (for loads: the whole arena), in order:
    /// `None` for a key that is missing, for an entry no free piece of the arena fits (counted
    /// in [`ArenaStats::load_refused`]), and while the pool is left alone.
    pub fn retrieve_leased(
        &self,
        ns: &str,
        keys: &[&str],
        arena: &Arena,
    ) -> Result<Vec<Option<Lease>>> {
        if !Arc::ptr_eq(&arena.shared.agent, &self.agent) {
            return Err(Error::InvalidArgument(
                "the arena is registered with another client's agent".into(),
            ));
        }
        let mut out: Vec<Option<Lease>> = Vec::with_capacity(keys.len());
        let mut start = 0;
        while start < keys.len() {
            let got = self.run(|inner| {
                let end = plan_keys(ns, keys, start, max_items(inner));
                let part = self.read_leased_chunk(inner, ns, &keys[start..end], arena)?;
                Ok((end, part))
            });
            match got {
                Ok((end, part)) => {
                    out.extend(part);
                    start = end;
                }
                Err(e) if e.is_unavailable() => break,
                Err(e) => return Err(e),
            }
        }
        out.resize_with(keys.len(), || None);
        Ok(out)
    }

    /// Stores one chunk of leased items (within the item limits).
    fn store_leased_chunk(
        &self,
        inner: &mut Inner,
        ns: &str,
        items: &[(usize, &str, &Lease, usize)],
    ) -> Result<Vec<Result<Stored>>> {
        if !inner.made.contains(ns) {
            let op = Op::Mkdir {
                ns: ns.into(),
                mode: 0o755,
            };
            match self.call(inner, op)? {
                Reply::Done => {
                    inner.made.insert(ns.to_owned());
                }
                other => return Err(unexpected("mkdir", &other)),
            }
        }
        let keys = items.iter().map(|it| it.1.to_owned()).collect();
        let present = match self.call(
            inner,
            Op::Exists {
                ns: ns.into(),
                keys,
            },
        )? {
            Reply::Exists(v) if v.len() == items.len() => v,
            Reply::Exists(v) => return Err(count_mismatch("exists", items.len(), v.len())),
            other => return Err(unexpected("exists", &other)),
        };
        let mut out: Vec<Result<Stored>> =
            items.iter().map(|_| Ok(Stored::AlreadyPresent)).collect();
        let todo: Vec<usize> = (0..items.len()).filter(|&i| !present[i]).collect();
        if todo.is_empty() {
            return Ok(out);
        }
        let sizes: Vec<u64> = todo.iter().map(|&i| items[i].3 as u64).collect();
        let pages = match self.call(
            inner,
            Op::Reserve {
                ns: ns.into(),
                sizes: sizes.clone(),
            },
        )? {
            Reply::Reserved(p) => p,
            other => return Err(unexpected("reserve", &other)),
        };
        let tickets: Vec<u64> = pages.iter().map(|p| p.ticket).collect();
        if let Err(e) = self.check_pages(inner, &pages, &sizes, usize::MAX) {
            self.give_back(inner, Op::Abandon { tickets });
            return Err(e);
        }
        let local: Vec<Desc> = todo.iter().map(|&i| items[i].2.desc(items[i].3)).collect();
        let remote: Vec<Desc> = pages
            .iter()
            .zip(&sizes)
            .map(|(p, &len)| Desc::host(p.addr, len))
            .collect();
        let mem = items[todo[0]].2.arena.mem;
        // The source stays the caller's: a WRITE that outlives its timeout reads bytes that
        // land only in quarantined pages, whatever the caller does with them meanwhile.
        let mut keep = Vec::new();
        let written = self.transfer_on(
            inner,
            maru_nixl::Op::Write,
            mem,
            &local,
            &remote,
            tickets.clone(),
            Keep::Leases(&mut keep),
        );
        let names: Vec<(String, u64)> = todo
            .iter()
            .map(|&i| (items[i].1.to_owned(), items[i].3 as u64))
            .collect();
        self.finish_store(inner, ns, written, tickets, &todo, &pages, names, &mut out)?;
        Ok(out)
    }

    /// Loads one chunk of keys into new leases of `arena`.
    fn read_leased_chunk(
        &self,
        inner: &mut Inner,
        ns: &str,
        keys: &[&str],
        arena: &Arena,
    ) -> Result<Vec<Option<Lease>>> {
        let op = Op::Lookup {
            ns: ns.into(),
            keys: keys.iter().map(|k| (*k).to_owned()).collect(),
        };
        let pages = match self.call(inner, op)? {
            Reply::Found(v) if v.len() == keys.len() => v,
            Reply::Found(v) => return Err(count_mismatch("lookup", keys.len(), v.len())),
            other => return Err(unexpected("lookup", &other)),
        };
        let tickets: Vec<u64> = pages.iter().flatten().map(|p| p.ticket).collect();
        let read = self.read_into_leases(inner, &pages, arena);
        if !tickets.is_empty() && inner.conn.is_some() {
            // The bytes are read (or given up): the protections can end.
            self.give_back(inner, Op::Release { tickets });
        }
        read
    }

    fn read_into_leases(
        &self,
        inner: &mut Inner,
        pages: &[Option<Page>],
        arena: &Arena,
    ) -> Result<Vec<Option<Lease>>> {
        let regions = inner
            .conn
            .as_ref()
            .map(|c| c.regions.as_slice())
            .unwrap_or_default();
        if let Some(p) = pages
            .iter()
            .flatten()
            .find(|p| !registered(regions, p.addr, p.len))
        {
            return Err(Error::Protocol(format!(
                "entry {:#x}+{} lies outside marud's registered memory",
                p.addr, p.len
            )));
        }
        let mut out: Vec<Option<Lease>> = Vec::with_capacity(pages.len());
        // The leases read into, and the item each is for.
        let (mut reading, mut items) = (Vec::new(), Vec::new());
        let (mut local, mut remote) = (Vec::new(), Vec::new());
        for (i, p) in pages.iter().enumerate() {
            out.push(None);
            let Some(p) = p else { continue };
            let Ok(len) = usize::try_from(p.len) else {
                continue;
            };
            let Some(lease) = arena.lease(len, Purpose::Load) else {
                continue;
            };
            if len == 0 {
                out[i] = Some(lease);
                continue;
            }
            local.push(lease.desc(len));
            remote.push(Desc::host(p.addr, p.len));
            reading.push(lease);
            items.push(i);
        }
        if reading.is_empty() {
            return Ok(out);
        }
        self.transfer_on(
            inner,
            maru_nixl::Op::Read,
            arena.shared.mem,
            &local,
            &remote,
            Vec::new(),
            Keep::Leases(&mut reading),
        )
        .map_err(nixl_err("reading from the pool"))?;
        for (i, lease) in items.into_iter().zip(reading) {
            out[i] = Some(lease);
        }
        Ok(out)
    }
}

/// What a transfer that times out keeps from reuse until NIXL says it is over.
pub(super) enum Keep<'a> {
    /// The client's staging buffer.
    Staging,
    /// These leases (taken from the vector): a READ's targets. A WRITE from leases passes
    /// none (its source is the caller's, and what it reads lands only in quarantined pages).
    Leases(&'a mut Vec<Lease>),
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
