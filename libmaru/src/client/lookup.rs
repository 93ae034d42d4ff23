//! Lookups and retrievals: the shared index of each namespace, and the mappings a handler
//! keeps of what it retrieved.

use std::fs::File;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::index::{PACK_BYTES, SlotView, Stuck, Table, hash_key, packed};
use crate::mapping::{MapInner, Mapping};
use crate::proto::{Body, Located, MAX_FDS_PER_FRAME, Op, PoolKind};

use super::page_size;
use super::state::{Cached, Inner, NsIndex, unexpected};

/// Keys per request when a batch's misses are asked in pieces.
const PIPELINE_PIECE: usize = 16;

/// The pieces of a retrieve sent before the first one's reply is read.
const PIECES_IN_FLIGHT: usize = 8;

/// Entries of at least this many bytes get their page tables built when retrieved
/// (smaller ones take about as long to fault in when first read, and often are read in part).
const POPULATE_MIN: usize = 64 * 1024;

/// Builds the page tables of `bytes` now (`MADV_POPULATE_READ`), so reading them takes no
/// faults; a kernel or device that refuses leaves them to be faulted in as read.
fn populate(bytes: &[u8]) {
    let page = page_size();
    let addr = bytes.as_ptr() as usize;
    let base = addr / page * page;
    let len = addr + bytes.len() - base;
    // SAFETY: advice on pages of a live mapping of ours; it changes no contents.
    unsafe {
        libc::madvise(base as *mut libc::c_void, len, libc::MADV_POPULATE_READ);
    }
}

/// What the shared index says of a key.
pub(super) enum Lookup {
    Found(SlotView),
    Absent,
    /// Only marud knows: a publication through the mount is on its way, the table was
    /// replaced during the lookup, or there is no index to read.
    AskDaemon,
}

impl Inner {
    /// The shared index of `ns`; `None` when marud refuses it (it reveals every name: it
    /// takes the right to list the namespace, while a lookup only takes the right to search it).
    pub(super) fn index(&mut self, ns: &str) -> Result<Option<&NsIndex>> {
        self.check_alive()?;
        if self.unlisted.contains(ns) {
            return Ok(None);
        }
        let stale = match self.indexes.get(ns) {
            None => true,
            Some(ix) => ix.table().is_none_or(|t| t.retired()),
        };
        if stale {
            let (body, mut fds) = match self.call(Op::Index { ns: ns.to_owned() }) {
                Ok(r) => r,
                Err(Error::PermissionDenied(_)) => {
                    self.indexes.remove(ns);
                    self.unlisted.insert(ns.to_owned());
                    return Ok(None);
                }
                Err(e) => return Err(e),
            };
            let Body::Index { dirs, packs, .. } = body else {
                return Err(unexpected(&body));
            };
            if fds.len() != 1 + dirs.len() + packs.len() {
                return Err(Error::Protocol(
                    "index reply with the wrong descriptors".into(),
                ));
            }
            let packs: Vec<(u32, OwnedFd)> =
                packs.into_iter().zip(fds.drain(1 + dirs.len()..)).collect();
            let dirs: Vec<(u32, OwnedFd)> = dirs.into_iter().zip(fds.drain(1..)).collect();
            let f = File::from(fds.pop().expect("one fd"));
            // SAFETY: a read-only shared mapping of the daemon's index memfd; accessed only
            // through atomics by crate::index.
            let map = unsafe { memmap2::Mmap::map(&f)? };
            let ix = NsIndex {
                map,
                removals_seen: 0,
                dirs,
                packs,
            };
            if ix.table().is_none() {
                return Err(Error::Protocol("malformed index table".into()));
            }
            self.indexes.insert(ns.to_owned(), ix);
        }
        Ok(self.indexes.get(ns))
    }

    /// Looks `key` up in the shared index of `ns`, in one table. marud counts a publication
    /// through the mount as pending from the writer's close until the index shows the entry,
    /// so the count is read *before* the lookup: if it was 0 then, every entry whose close
    /// returned before is in the table. A miss is an absent key only if it was 0 and the table
    /// was not replaced meanwhile (its replacement may hold the key).
    pub(super) fn lookup(&mut self, ns: &str, key: &str) -> Result<Lookup> {
        let Some(t) = self.index(ns)?.and_then(|ix| ix.readable()) else {
            return Ok(Lookup::AskDaemon);
        };
        let pending = t.pending();
        Ok(match t.lookup(key.as_bytes()) {
            Ok(Some(v)) => Lookup::Found(v),
            Ok(None) => on_miss(&t, pending),
            Err(Stuck) => Lookup::AskDaemon,
        })
    }

    /// The index's slot of `key`, if the index has it now.
    pub(super) fn found(&mut self, ns: &str, key: &str) -> Result<Option<SlotView>> {
        Ok(match self.lookup(ns, key)? {
            Lookup::Found(v) => Some(v),
            _ => None,
        })
    }

    /// True if `ns` is a long key's segment namespace (see [`crate::key`]) that does not
    /// exist: it holds no key, which is an answer, not an error.
    fn segment_missing(&mut self, ns: &str) -> Result<bool> {
        if !ns.ends_with(crate::key::CONTINUED) {
            return Ok(false);
        }
        match self.index(ns) {
            Ok(_) => Ok(false),
            Err(Error::NotFound(_)) => Ok(true),
            Err(e) => Err(e),
        }
    }

    pub(super) fn exists(&mut self, ns: &str, key: &str) -> Result<bool> {
        if self.segment_missing(ns)? {
            return Ok(false);
        }
        match self.lookup(ns, key)? {
            Lookup::Found(_) => return Ok(true),
            Lookup::Absent => return Ok(false),
            Lookup::AskDaemon => {}
        }
        match self.call(Op::Exists {
            ns: ns.to_owned(),
            keys: vec![key.to_owned()],
        })? {
            (Body::Exists { found }, _) => Ok(found.first().copied().unwrap_or(false)),
            (other, _) => Err(unexpected(&other)),
        }
    }

    pub(super) fn retrieve_many(
        &mut self,
        ns: &str,
        keys: &[&str],
    ) -> Result<Vec<Option<Mapping>>> {
        if self.segment_missing(ns)? {
            return Ok(vec![None; keys.len()]);
        }
        self.sweep_cache(ns);
        let mut out: Vec<Option<Mapping>> = vec![None; keys.len()];
        let mut miss: Vec<usize> = Vec::new();
        let mut sliced: Vec<(usize, Mapping)> = Vec::new();
        self.index(ns)?;
        match self.indexes.get(ns).and_then(|ix| ix.readable()) {
            // No index to read (or none to trust): marud answers every key.
            None => miss.extend(0..keys.len()),
            Some(t) => {
                // The pending count is read before the lookups (see `lookup`); the slots of
                // all the keys are asked for first, so that their cache misses overlap.
                let pending = t.pending();
                let hashes: Vec<u64> = keys.iter().map(|k| hash_key(k.as_bytes())).collect();
                for &h in &hashes {
                    t.prefetch(h);
                }
                for (i, (k, &h)) in keys.iter().zip(&hashes).enumerate() {
                    let v = match t.lookup_hashed(k.as_bytes(), h) {
                        Ok(Some(v)) => v,
                        Ok(None) => {
                            if let Lookup::AskDaemon = on_miss(&t, pending) {
                                miss.push(i);
                            }
                            continue;
                        }
                        Err(Stuck) => {
                            miss.push(i);
                            continue;
                        }
                    };
                    match self.cache.get(&cache_key(ns, k)) {
                        // The same entry where it was mapped: one moved out of its pack (a
                        // change of its readers) keeps its generation, not its place.
                        Some(c) if c.matches(&v) && c.is(ns, k) => {
                            out[i] = Some(c.map.clone());
                        }
                        // A packed entry of a pack this client maps: a slice of it (marud
                        // gave the pack for another of its entries, and a pack holds only
                        // entries with one decision for every reader).
                        _ => match self.pack_slice(&v) {
                            Some(m) => sliced.push((i, m)),
                            None => miss.push(i),
                        },
                    }
                }
                // First-time memfs entries in a directory marud gave: opened here.
                if let Some(ix) = self.indexes.get(ns).filter(|ix| !ix.dirs.is_empty()) {
                    let mut opened = Vec::new();
                    miss.retain(|&i| {
                        let Some(v) = t
                            .lookup_hashed(keys[i].as_bytes(), hashes[i])
                            .ok()
                            .flatten()
                            .filter(|v| packed(v.offset).is_none())
                        else {
                            return true;
                        };
                        let Some((_, dir)) = ix.dirs.iter().find(|(p, _)| *p == v.pool) else {
                            return true;
                        };
                        match open_own(dir, keys[i], &v, self.cfg.populate) {
                            Some(m) => {
                                opened.push((i, m));
                                false
                            }
                            None => true,
                        }
                    });
                    for (i, m) in opened {
                        self.note_accessed(m.generation());
                        self.cache_insert(ns, keys[i], &m);
                        out[i] = Some(m);
                    }
                }
            }
        }
        self.open_packs(ns, keys, &mut miss, &mut sliced);
        for (i, m) in sliced {
            self.note_accessed(m.generation());
            self.cache_insert(ns, keys[i], &m);
            out[i] = Some(m);
        }
        self.report_if_due()?;
        // Asked in pieces, a few in flight: marud answers each as soon as it is handled, so
        // this thread maps one piece while marud looks up the next.
        let piece = if miss.len() > 2 * PIPELINE_PIECE {
            PIPELINE_PIECE
        } else {
            MAX_FDS_PER_FRAME
        };
        if !miss.is_empty() {
            self.flush_releases()?;
        }
        // A few pieces in flight at once (more would fill the socket both ways with long
        // keys, each side blocked writing). Every reply is read, even after one failed, so
        // that the connection stays in step and each lease marud gave is given back (by the
        // mappings made, when they are dropped with `out`; by hand for the entries not
        // mapped); no piece is sent after a failure.
        let mut pieces = miss.chunks(piece);
        let mut sent = std::collections::VecDeque::new();
        let mut failed = None;
        loop {
            while sent.len() < PIECES_IN_FLIGHT && failed.is_none() {
                let Some(chunk) = pieces.next() else { break };
                let op = Op::Retrieve {
                    ns: ns.to_owned(),
                    keys: chunk.iter().map(|&i| keys[i].to_owned()).collect(),
                };
                sent.push_back((self.send(op, &[])?, chunk));
            }
            let Some((id, chunk)) = sent.pop_front() else {
                break;
            };
            // A reply that cannot be read leaves the connection out of step: closed.
            let reply = self.wait_retrieved(id).map_err(|e| self.out_of_step(e))?;
            let (items, fds) = match reply {
                Ok(r) => r,
                Err(e) => {
                    failed.get_or_insert(e);
                    continue;
                }
            };
            if items.len() != chunk.len() {
                let e = Error::Protocol("retrieve reply of the wrong length".into());
                return Err(self.out_of_step(e));
            }
            let mut fds = fds.into_iter();
            for (&i, item) in chunk.iter().zip(items) {
                let Some(loc) = item else { continue };
                let fd = if loc.fd { fds.next() } else { None };
                if failed.is_some() {
                    self.give_back(&loc);
                    continue;
                }
                match self.map_located(&loc, fd) {
                    Ok(m) => {
                        self.cache_insert(ns, keys[i], &m);
                        out[i] = Some(m);
                    }
                    Err(e) => {
                        self.give_back(&loc);
                        failed.get_or_insert(e);
                    }
                }
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// Gives back the lease marud took for `loc`, an entry retrieved and not mapped (only a
    /// raw pool's entries are leased; a generation not leased is ignored by marud).
    fn give_back(&mut self, loc: &Located) {
        if packed(loc.offset).is_none() && self.pool_kind(loc.pool).ok() != Some(PoolKind::Memfs) {
            self.releases.lock().push(loc.generation);
        }
    }

    pub(super) fn map_located(&mut self, loc: &Located, fd: Option<OwnedFd>) -> Result<Mapping> {
        if let Some((pack, _)) = packed(loc.offset) {
            if let Some(fd) = fd.filter(|_| !self.pack_views.contains_key(&(loc.pool, pack))) {
                let map = map_pack_file(&File::from(fd))?;
                self.pack_views.insert((loc.pool, pack), Arc::new(map));
            }
            let slot = SlotView {
                generation: loc.generation,
                size: loc.size,
                pool: loc.pool,
                flags: 0,
                offset: loc.offset,
            };
            return self
                .pack_slice(&slot)
                .ok_or_else(|| Error::Protocol("a packed entry without its pack".into()));
        }
        if self.pool_kind(loc.pool)? == PoolKind::Memfs {
            let f = File::from(fd.ok_or_else(|| Error::Protocol("memfs entry without fd".into()))?);
            return map_entry_file(&f, loc.size, loc.generation, loc.pool, self.cfg.populate);
        }
        if let Some(fd) = fd {
            self.pool_ro.insert(loc.pool, Arc::new(File::from(fd)));
        }
        let map = self
            .pool_view(loc.pool)?
            .ok_or_else(|| Error::Protocol("no descriptor for the pool".into()))?;
        let (start, len) = (loc.offset as usize, loc.size as usize);
        if start.checked_add(len).is_none_or(|end| end > map.len()) {
            return Err(Error::Protocol("entry beyond the end of its pool".into()));
        }
        if self.cfg.populate && len >= POPULATE_MIN {
            populate(&map[start..start + len]);
        }
        Ok(Mapping {
            inner: Arc::new(MapInner {
                map,
                start,
                len,
                generation: loc.generation,
                pool: loc.pool,
                offset: loc.offset,
                release: Some(self.releases.clone()),
            }),
        })
    }

    /// Maps the packs of the packed entries among `keys[miss]` that this client does not map
    /// yet, from the packs' directories marud gave it (root), and moves those entries from
    /// `miss` to `sliced`: no round trip for them.
    fn open_packs(
        &mut self,
        ns: &str,
        keys: &[&str],
        miss: &mut Vec<usize>,
        sliced: &mut Vec<(usize, Mapping)>,
    ) {
        let Some(ix) = self.indexes.get(ns).filter(|ix| !ix.packs.is_empty()) else {
            return;
        };
        let Some(t) = ix.readable() else { return };
        let slots: Vec<(usize, SlotView)> = miss
            .iter()
            .filter_map(|&i| Some((i, t.lookup(keys[i].as_bytes()).ok()??)))
            .filter(|(_, v)| packed(v.offset).is_some())
            .collect();
        let mut opened: Vec<((u32, u32), memmap2::Mmap)> = Vec::new();
        for (_, v) in &slots {
            let Some((pack, _)) = packed(v.offset) else {
                continue;
            };
            let k = (v.pool, pack);
            if self.pack_views.contains_key(&k) || opened.iter().any(|(o, _)| *o == k) {
                continue;
            }
            if let Some((_, dir)) = ix.packs.iter().find(|(p, _)| *p == v.pool)
                && let Some(m) = map_pack(dir, pack)
            {
                opened.push((k, m));
            }
        }
        for (k, m) in opened {
            self.pack_views.insert(k, Arc::new(m));
        }
        let before = sliced.len();
        for (i, v) in slots {
            if let Some(m) = self.pack_slice(&v) {
                sliced.push((i, m));
            }
        }
        let served: Vec<usize> = sliced[before..].iter().map(|(i, _)| *i).collect();
        miss.retain(|i| !served.contains(i));
    }

    /// Packed entry `v` as a slice of its pack's mapping, if this client maps that pack.
    fn pack_slice(&self, v: &SlotView) -> Option<Mapping> {
        let (pack, offset) = packed(v.offset)?;
        let map = self.pack_views.get(&(v.pool, pack))?;
        let (start, len) = (offset as usize, v.size as usize);
        if start.checked_add(len).is_none_or(|end| end > map.len()) {
            return None;
        }
        if self.cfg.populate && len >= POPULATE_MIN {
            populate(&map[start..start + len]);
        }
        Some(Mapping {
            inner: Arc::new(MapInner {
                map: map.clone(),
                start,
                len,
                generation: v.generation,
                pool: v.pool,
                offset: v.offset,
                release: None,
            }),
        })
    }

    /// The read-only mapping of all of raw pool `pool`, made once, if this client holds
    /// its descriptor (it gets it with its first allocation or retrieval there).
    pub(super) fn pool_view(&mut self, pool: u32) -> Result<Option<Arc<memmap2::Mmap>>> {
        if let Some(m) = self.pool_views.get(&pool) {
            return Ok(Some(m.clone()));
        }
        let Some(f) = self.pool_ro.get(&pool).or_else(|| self.pool_rw.get(&pool)) else {
            return Ok(None);
        };
        let len = self
            .pools
            .iter()
            .find(|p| p.id == pool)
            .map_or(0, |p| p.mapped_len) as usize;
        if len == 0 {
            return Ok(None);
        }
        // SAFETY: a read-only shared view of the pool. Entries are read through it only
        // while this client holds a lease on their extent (MapInner::release), and marud
        // never writes an extent someone holds; the rest of the view races with the pool's
        // reuse of freed extents, as the original design's region views did.
        let map = Arc::new(unsafe { memmap2::MmapOptions::new().len(len).map(&**f)? });
        self.pool_views.insert(pool, map.clone());
        Ok(Some(map))
    }

    /// A read-only mapping of all of raw pool `pool` (see [`pool_view`](Self::pool_view)).
    pub(super) fn map_pool(&mut self, pool: u32) -> Result<Option<Mapping>> {
        let Some(map) = self.pool_view(pool)? else {
            return Ok(None);
        };
        let len = map.len();
        Ok(Some(Mapping {
            inner: Arc::new(MapInner {
                map,
                start: 0,
                len,
                generation: 0,
                pool,
                offset: 0,
                release: None,
            }),
        }))
    }

    pub(super) fn cache_insert(&mut self, ns: &str, key: &str, m: &Mapping) {
        if self.cfg.cache_entries == 0 || m.len() as u64 > self.cfg.cache_bytes {
            return;
        }
        let c = Cached {
            generation: m.generation(),
            map: m.clone(),
            ns: ns.into(),
            key: key.into(),
        };
        if let Some(old) = self.cache.put(cache_key(ns, key), c) {
            self.cache_bytes -= old.map.len() as u64;
        }
        self.cache_bytes += m.len() as u64;
        while self.cache.len() > self.cfg.cache_entries || self.cache_bytes > self.cfg.cache_bytes {
            let (_, c) = self.cache.pop_lru().expect("non-empty");
            self.cache_bytes -= c.map.len() as u64;
        }
    }

    /// Drops cached mappings of entries removed since the last look, so this client
    /// does not keep deleted or evicted entries' memory alive.
    pub(super) fn sweep_cache(&mut self, ns: &str) {
        let Some(ix) = self.indexes.get(ns) else {
            return;
        };
        let Some(t) = ix.table() else { return };
        let removals = t.removals();
        if removals == ix.removals_seen {
            return;
        }
        let stale: Vec<u64> = self
            .cache
            .iter()
            .filter(|(_, c)| {
                &*c.ns == ns && !matches!(t.lookup(c.key.as_bytes()), Ok(Some(v)) if c.matches(&v))
            })
            .map(|(k, _)| *k)
            .collect();
        for k in stale {
            if let Some(c) = self.cache.pop(&k) {
                self.cache_bytes -= c.map.len() as u64;
            }
        }
        // Packs no retrieved entry uses any more: a pack whose entries are all gone is freed
        // by the tmpfs only when no one maps it.
        self.pack_views.retain(|_, m| Arc::strong_count(m) > 1);
        if let Some(ix) = self.indexes.get_mut(ns) {
            ix.removals_seen = removals;
        }
    }
}

/// Maps the file of memfs entry `generation` (`size` bytes, in pool `pool`).
fn map_entry_file(
    f: &File,
    size: u64,
    generation: u64,
    pool: u32,
    populate: bool,
) -> Result<Mapping> {
    let mut o = memmap2::MmapOptions::new();
    o.len(size.max(1) as usize);
    if populate && size as usize >= POPULATE_MIN {
        o.populate();
    }
    // SAFETY: a read-only shared mapping of a sealed entry's file; sealed entries are never
    // written again (see Mapping::as_slice).
    let map = unsafe { o.map(f)? };
    Ok(Mapping {
        inner: Arc::new(MapInner {
            map: Arc::new(map),
            start: 0,
            len: size as usize,
            generation,
            pool,
            offset: 0,
            release: None,
        }),
    })
}

/// Opens and maps the file of the memfs entry `key` that slot `v` describes, in its
/// namespace's directory `dir`; `None` when that fails or the file there is not the slot's
/// entry (another one took the name since the lookup: its inode, the slot's offset, differs),
/// and marud is asked instead. No lease is needed: the file of a removed entry stays intact
/// under its mappings.
fn open_own(dir: &OwnedFd, key: &str, v: &SlotView, populate: bool) -> Option<Mapping> {
    use std::os::unix::fs::MetadataExt;
    let fd = nix::fcntl::openat(
        dir,
        key,
        nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_CLOEXEC | nix::fcntl::OFlag::O_NOFOLLOW,
        nix::sys::stat::Mode::empty(),
    )
    .ok()?;
    let f = File::from(fd);
    let md = f.metadata().ok()?;
    if md.ino() != v.offset || md.len() != v.size {
        return None;
    }
    map_entry_file(&f, v.size, v.generation, v.pool, populate).ok()
}

/// Maps pack `pack` (all of it, read-only), opened in the packs' directory `dir`; `None` when
/// that fails (marud is asked instead). Pack ids are never reused while marud runs, and the
/// index a client reads is that run's.
fn map_pack(dir: &OwnedFd, pack: u32) -> Option<memmap2::Mmap> {
    let fd = nix::fcntl::openat(
        dir,
        pack.to_string().as_str(),
        nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_CLOEXEC | nix::fcntl::OFlag::O_NOFOLLOW,
        nix::sys::stat::Mode::empty(),
    )
    .ok()?;
    map_pack_file(&File::from(fd)).ok()
}

/// A read-only mapping of all of a pack.
fn map_pack_file(f: &File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: a read-only shared mapping of a pack; sealed entries in it are never written,
    // and no offset in it is handed out twice (see Mapping::as_slice).
    unsafe { memmap2::MmapOptions::new().len(PACK_BYTES as usize).map(f) }
}

/// What a miss in table `t` means, `pending` having been read before the lookup: the key is
/// absent, unless a publication through the mount was on its way or the table was replaced.
fn on_miss(t: &Table<'_>, pending: u64) -> Lookup {
    if pending > 0 || t.retired() {
        Lookup::AskDaemon
    } else {
        Lookup::Absent
    }
}

/// The mapping cache's key for `ns/key`: a hash of the path, so that a probe allocates nothing. Two
/// names with one hash share a place in the cache; the cached item says whose it is.
pub(super) fn cache_key(ns: &str, key: &str) -> u64 {
    let mut h = hash_key(ns.as_bytes());
    for b in std::iter::once(&b'/').chain(key.as_bytes()) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // Spread the bits: the cache's table takes its buckets from some and its tags from others.
    h ^= h >> 29;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^ (h >> 32)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    #[test]
    fn an_entry_is_opened_only_when_its_file_is_the_slots() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("k"), b"0123456789").unwrap();
        std::os::unix::fs::symlink("k", dir.path().join("link")).unwrap();
        let ino = std::fs::metadata(dir.path().join("k")).unwrap().ino();
        let d = OwnedFd::from(File::open(dir.path()).unwrap());
        let slot = SlotView {
            generation: 7,
            size: 10,
            pool: 0,
            flags: 0,
            offset: ino,
        };
        let m = open_own(&d, "k", &slot, true).expect("the slot's file");
        assert_eq!(m.as_slice(), b"0123456789");
        assert_eq!(m.generation(), 7);
        let other = |f: fn(&mut SlotView)| {
            let mut s = slot;
            f(&mut s);
            s
        };
        assert!(
            open_own(&d, "k", &other(|s| s.offset += 1), true).is_none(),
            "another file"
        );
        assert!(
            open_own(&d, "k", &other(|s| s.size = 9), true).is_none(),
            "another size"
        );
        assert!(open_own(&d, "gone", &slot, true).is_none(), "no such name");
        assert!(
            open_own(&d, "link", &slot, true).is_none(),
            "a symbolic link"
        );
    }
}
