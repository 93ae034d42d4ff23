//! A raw pool: a device (or a regular file standing in for one) behind a 32-byte header,
//! carved first-fit into 2 MiB-aligned regions; a client's allocations are packed into its
//! open region at 4 KiB alignment. Metadata is a write-ahead log in the state directory.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::Arc;

use maru::proto::{Coherence, PoolKind};
use maru::{Error, Result};

use super::super::authority::{Authority, fenced_error};
use super::super::ids::{Place, SessionId};
#[cfg(feature = "seams")]
use super::Seams;
use super::buffer::{Buffered, CopyIn};
use super::{Backing, Found, Loc, Pool, Reader, Requester};
use crate::alloc::{ExtentAlloc, align_up};
use crate::coherence::WriteBack;
use crate::pool::{self, ENTRY_ALIGN, PoolSpec, REGION_ALIGN};
use crate::wal::{self, Durability, FileSink, Wal};
use maru::format::{self, Record};

#[derive(Debug, Clone)]
struct Region {
    len: u64,
    /// The session packing its allocations into it.
    owner: Option<SessionId>,
    /// Next free byte (relative) for the owner's bump allocation.
    bump: u64,
    /// Live entries and allocations inside.
    live: u32,
}

/// A 2 MiB unit holding entries of other hosts.
#[derive(Debug, Clone, Copy)]
struct RemoteUnit {
    /// How many.
    entries: u32,
    /// Whether it is reserved in `extents` for them (false while it lies in a region of this
    /// host's, which it lost to that host: reserved when that region is freed here).
    reserved: bool,
}

/// A raw pool.
pub struct Raw {
    kind: PoolKind,
    name: String,
    path: PathBuf,
    /// Bytes of the device used for the header and regions.
    size: u64,
    /// The daemon's own descriptor; it holds the device lock (`maructl device` checks it).
    file: Arc<File>,
    /// Read-write descriptor handed to writers: a separate open file description, so that
    /// clients' mappings never keep the daemon's lock alive after it exits.
    rw: File,
    /// Read-only descriptor (retrievals, reads through the mount).
    ro: Arc<File>,
    log_path: PathBuf,
    wal_sync: bool,
    wal: Option<Wal>,
    /// Extents removed whose removal's record is not yet synced (`--wal-sync`), oldest
    /// first: freed once it is, never before (carved again and written, an extent whose
    /// removal a crash of the host lost would come back with another entry's bytes).
    unsynced_frees: std::collections::VecDeque<(crate::wal::Unsynced, u64)>,
    /// Extents removed while leased whose removal's record was not yet synced then
    /// (`--wal-sync`): freed at their last lease's end once it is.
    unsynced_dels: HashMap<u64, crate::wal::Unsynced>,
    /// Extents of entries removed whose removal the log could not take: the entry comes back
    /// at the next start, so its extent is not carved again in this run.
    unrecorded: std::collections::HashSet<u64>,
    extents: ExtentAlloc,
    regions: BTreeMap<u64, Region>,
    /// Each client session's open region.
    open: HashMap<SessionId, u64>,
    /// Who may carve which region (the pool's UUID names it there).
    authority: Arc<dyn Authority>,
    uuid: String,
    /// 2 MiB units holding entries other hosts published (cluster mode): never carved here.
    remote_units: BTreeMap<u64, RemoteUnit>,
    /// Units another host claimed when this one tried to carve them: reserved in `extents`
    /// until the pool looks full, then tried again.
    foreign: Vec<(u64, u64)>,
    /// Regions carved whose claim at the authority the store has yet to make, without its
    /// lock ([`Pool::unclaimed`]), by the allocation they were carved for: nothing else is
    /// packed into one meanwhile.
    unclaimed: HashMap<u64, u64>,
    /// Without hardware coherence across hosts (`coherent=false`): the daemon's read-only
    /// mapping of the whole device, through which it writes back and invalidates entries'
    /// cache lines (without the store's lock), and what it did so far.
    noncoherent: Option<Arc<WriteBack>>,
}

fn reopen(f: &File, write: bool) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .open(format!("/proc/self/fd/{}", f.as_raw_fd()))
}

impl Raw {
    /// Opens (and locks) the device of `spec`, writing a header if it has none.
    pub fn open(
        spec: &PoolSpec,
        state_dir: &std::path::Path,
        wal_sync: bool,
        authority: Arc<dyn Authority>,
    ) -> anyhow::Result<Raw> {
        let (file, size) = pool::open_raw(spec, authority.shared())?;
        let header = match format::read_header(&file)? {
            Some(h) => h,
            None => {
                let h = format::init_header(&file)?;
                tracing::info!(pool = %spec.name, uuid = %h.uuid_string(), "initialized the device header");
                h
            }
        };
        let ro = Arc::new(reopen(&file, false)?);
        let rw = reopen(&file, true)?;
        let noncoherent = if spec.coherent {
            None
        } else {
            // SAFETY: a shared read-only mapping of the device; the daemon only flushes cache
            // lines through it (never reads a byte another host may be writing).
            let m = unsafe { memmap2::MmapOptions::new().len(size as usize).map(&ro)? };
            Some(Arc::new(WriteBack::new(m)))
        };
        let log_path = state_dir.join(format!("pool-{}.wal", header.uuid_string()));
        Ok(Raw {
            kind: spec.kind,
            name: spec.name.clone(),
            path: spec.path.clone(),
            size,
            file: Arc::new(file),
            rw,
            ro,
            log_path,
            wal_sync,
            wal: None,
            unsynced_frees: Default::default(),
            unsynced_dels: HashMap::new(),
            unrecorded: Default::default(),
            extents: ExtentAlloc::new(REGION_ALIGN, size),
            regions: BTreeMap::new(),
            open: HashMap::new(),
            authority,
            uuid: header.uuid_string(),
            remote_units: BTreeMap::new(),
            foreign: Vec::new(),
            unclaimed: HashMap::new(),
            noncoherent,
        })
    }

    fn log(&mut self, rec: &Record) -> Result<()> {
        match self.wal.as_mut() {
            Some(w) => Ok(w.append(rec)?),
            None => Ok(()),
        }
    }

    /// Frees the empty region at `roff` (its extent, and its claim at the authority, if it
    /// was made).
    fn free_region(&mut self, roff: u64) {
        if let Some(r) = self.regions.remove(&roff) {
            self.open.retain(|_, o| *o != roff);
            self.give_units(roff, r.len, false);
            if self.unclaimed.remove(&roff).is_none() {
                self.authority.release_region(&self.uuid, roff);
            }
        }
    }

    /// The 2 MiB units of `[roff, roff + len)`, a region of this host's no more, go back to
    /// `extents`, or (`foreign`: another host claimed them first) are set aside until the
    /// pool looks full.
    fn give_units(&mut self, roff: u64, len: u64, foreign: bool) {
        let mut u = roff;
        while u < roff + len {
            match self.remote_units.get_mut(&u) {
                // Other hosts' entries live there (a region this host lost): it stays set
                // aside for them.
                Some(ru) => ru.reserved = true,
                None if foreign => match self.foreign.last_mut() {
                    Some((o, l)) if *o + *l == u => *l += REGION_ALIGN,
                    _ => self.foreign.push((u, REGION_ALIGN)),
                },
                None => self.extents.free(u, REGION_ALIGN),
            }
            u += REGION_ALIGN;
        }
    }

    /// Frees the extent at `offset` once `removal` (its removal's record, if not yet synced)
    /// is.
    fn release_after(&mut self, offset: u64, removal: Option<crate::wal::Unsynced>) {
        match removal.filter(|u| !u.synced()) {
            Some(u) => self.unsynced_frees.push_back((u, offset)),
            None => self.release(offset),
        }
    }

    /// Frees the extents whose removal's record is synced by now.
    fn release_synced(&mut self) {
        while let Some((u, offset)) = self.unsynced_frees.front()
            && u.synced()
        {
            let offset = *offset;
            self.unsynced_frees.pop_front();
            self.release(offset);
        }
    }

    /// One entry or allocation inside a region went away: frees its extent at `offset` now
    /// (nothing in the log names it, or its removal's record is synced).
    fn release(&mut self, offset: u64) {
        let Some((&roff, r)) = self.regions.range_mut(..=offset).next_back() else {
            return;
        };
        r.live = r.live.saturating_sub(1);
        if r.live == 0 {
            // Its owner's open region stays for its next allocations, but only on a pool of
            // this host's alone: shared with other hosts, an empty region kept by an idle
            // session (the mount's writers never leave) is room none of them can use.
            if r.owner.is_some()
                && !self.authority.shared()
                && !self.unclaimed.contains_key(&roff)
                && !self.authority.lost(&self.uuid, roff)
            {
                r.bump = 0;
            } else {
                self.free_region(roff);
            }
        }
    }

    /// Whether `offset` lies in a region of this host's that it lost to another host.
    fn in_lost_region(&self, offset: u64) -> bool {
        self.regions
            .range(..=offset)
            .next_back()
            .is_some_and(|(&o, r)| offset < o + r.len && self.authority.lost(&self.uuid, o))
    }

    /// Packs `size` bytes for allocation `id` into `session`'s open region, or carves a new
    /// region (claimed by the store after: [`Pool::unclaimed`]).
    fn place(&mut self, size: u64, session: Option<SessionId>, id: u64) -> Result<u64> {
        if self.authority.fenced() {
            return Err(fenced_error());
        }
        let asize = align_up(size.max(1), ENTRY_ALIGN);
        if let Some(s) = session
            && let Some(&roff) = self.open.get(&s)
            && self.authority.lost(&self.uuid, roff)
        {
            // Another host holds it now: nothing more goes there.
            self.open.remove(&s);
            self.detach_region(roff);
        }
        if let Some(s) = session
            && let Some(&roff) = self.open.get(&s)
            && !self.unclaimed.contains_key(&roff)
            && let Some(r) = self.regions.get_mut(&roff)
            && r.bump + asize <= r.len
        {
            let off = roff + r.bump;
            r.bump += asize;
            r.live += 1;
            return Ok(off);
        }
        let rlen = align_up(asize, REGION_ALIGN);
        let roff = self.carve(rlen)?;
        self.regions.insert(
            roff,
            Region {
                len: rlen,
                owner: session,
                bump: asize,
                live: 1,
            },
        );
        self.unclaimed.insert(roff, id);
        if let Some(s) = session
            && let Some(old) = self.open.insert(s, roff)
        {
            self.detach_region(old);
        }
        Ok(roff)
    }

    /// Carves a region of `rlen` bytes, to be claimed at the authority. Ranges other hosts
    /// claimed first were set aside ([`Pool::claimed`]); once the pool looks full, they are
    /// tried again (their holders may have let go).
    fn carve(&mut self, rlen: u64) -> Result<u64> {
        if let Some(roff) = self.extents.alloc(rlen, REGION_ALIGN) {
            return Ok(roff);
        }
        for (o, l) in std::mem::take(&mut self.foreign) {
            self.extents.free(o, l);
        }
        self.extents
            .alloc(rlen, REGION_ALIGN)
            .ok_or_else(|| Error::NoSpace(format!("pool {} is full", self.name)))
    }

    /// The owner leaves a region: it is freed once empty.
    fn detach_region(&mut self, roff: u64) {
        if let Some(r) = self.regions.get_mut(&roff) {
            r.owner = None;
            r.bump = r.len;
            if r.live == 0 {
                self.free_region(roff);
            }
        }
    }

    fn seal_record(e: &Loc<'_>, offset: u64) -> Record {
        Record::Seal {
            ns: e.ns.to_owned(),
            key: e.key.to_owned(),
            off: offset,
            size: e.size,
            asize: e.asize,
            pin: e.pinned,
            uid: e.uid,
            gid: e.gid,
        }
    }
}

/// Where entry `e` of a raw pool is: an extent of the device.
fn extent(e: &Loc<'_>) -> u64 {
    e.place.extent().expect("a raw pool's entries are extents")
}

/// The session whose open region packs the entries written through the mount, as a client's
/// allocations are packed into its own (so a 4 KiB file takes 4 KiB, not a region).
const MOUNT_WRITERS: SessionId = SessionId::MOUNT;

impl Pool for Raw {
    fn uuid(&self) -> Option<&str> {
        Some(&self.uuid)
    }

    fn adopt_remote(&mut self, offset: u64, len: u64) -> Result<()> {
        let (s, end) = (
            offset / REGION_ALIGN * REGION_ALIGN,
            align_up(offset + len, REGION_ALIGN),
        );
        if offset < REGION_ALIGN || end > self.size {
            return Err(Error::InvalidArgument(format!(
                "{offset:#x}+{len:#x} is outside pool {}",
                self.name
            )));
        }
        let mut u = s;
        while u < end {
            if let Some(ru) = self.remote_units.get_mut(&u) {
                ru.entries += 1;
                u += REGION_ALIGN;
                continue;
            }
            // Set aside as another host's; a unit set aside already (claimed by it when this
            // host tried) moves from `foreign` to here.
            let reserved = if let Some(i) =
                self.foreign.iter().position(|&(o, l)| o <= u && u < o + l)
            {
                let (o, l) = self.foreign.swap_remove(i);
                for (a, b) in [(o, u - o), (u + REGION_ALIGN, o + l - u - REGION_ALIGN)] {
                    if b > 0 {
                        self.foreign.push((a, b));
                    }
                }
                true
            } else if self.extents.reserve(u, REGION_ALIGN) {
                true
            } else {
                // In a region of this host's: one it lost while cut off (set aside when freed
                // here), one whose claim is on its way (which finds the entry, and is given
                // back), or the claims were broken.
                let known = self.regions.range(..=u).next_back().is_some_and(|(&o, _)| {
                    self.authority.lost(&self.uuid, o) || self.unclaimed.contains_key(&o)
                });
                if !known {
                    tracing::warn!(pool = %self.name, unit = u, "another host's entry in a unit this host holds");
                }
                false
            };
            self.remote_units.insert(
                u,
                RemoteUnit {
                    entries: 1,
                    reserved,
                },
            );
            u += REGION_ALIGN;
        }
        Ok(())
    }

    fn coherence(&self) -> Option<Coherence> {
        self.noncoherent.as_ref().map(|w| Coherence {
            flushed: w.flushed(),
            invalidated: w.invalidated(),
        })
    }

    fn write_back(&self) -> Option<Arc<WriteBack>> {
        self.noncoherent.clone()
    }

    fn drop_remote(&mut self, offset: u64, len: u64) {
        let (s, end) = (
            offset / REGION_ALIGN * REGION_ALIGN,
            align_up(offset + len, REGION_ALIGN),
        );
        let mut u = s;
        while u < end {
            if let Some(ru) = self.remote_units.get_mut(&u) {
                ru.entries -= 1;
                if ru.entries == 0 {
                    let ru = self.remote_units.remove(&u).expect("present");
                    if ru.reserved {
                        self.extents.free(u, REGION_ALIGN);
                    }
                }
            }
            u += REGION_ALIGN;
        }
    }

    fn kind(&self) -> PoolKind {
        self.kind
    }

    fn capacity(&self) -> u64 {
        self.size - REGION_ALIGN
    }

    fn mapped_len(&self) -> u64 {
        self.size
    }

    fn free_space(&self) -> u64 {
        self.extents.free_bytes()
    }

    fn passthrough(&self) -> bool {
        false
    }

    fn leases(&self) -> bool {
        true
    }

    fn grant(&mut self, id: u64, size: u64, who: &Requester<'_>) -> Result<Backing> {
        Ok(Backing::Extent {
            offset: self.place(size, who.session, id)?,
        })
    }

    fn unclaimed(&self, id: u64) -> Option<(u64, u64)> {
        let (&roff, _) = self.unclaimed.iter().find(|&(_, &a)| a == id)?;
        Some((roff, self.regions[&roff].len))
    }

    fn claimed(&mut self, offset: u64, outcome: &Result<()>) {
        if self.unclaimed.remove(&offset).is_none() || outcome.is_ok() {
            return;
        }
        // Refused: the region goes, with the allocation it was carved for (the store drops
        // that one); what another host claimed first is set aside.
        let Some(r) = self.regions.remove(&offset) else {
            return;
        };
        self.open.retain(|_, o| *o != offset);
        let foreign = matches!(outcome, Err(Error::Busy(_))) && self.authority.shared();
        self.give_units(offset, r.len, foreign);
    }

    fn create(&mut self, _id: u64) -> Result<Backing> {
        Ok(Backing::Buffer {
            buf: Buffered::shared(),
            placed: None,
        })
    }

    fn abort(&mut self, _id: u64, backing: &Backing) {
        match backing {
            Backing::Extent { offset }
            | Backing::Buffer {
                placed: Some((offset, _)),
                ..
            } => self.release(*offset),
            _ => {}
        }
    }

    fn commit(&mut self, id: u64, backing: &mut Backing, size: u64) -> Result<Option<CopyIn>> {
        let Backing::Buffer { buf, placed } = backing else {
            return Ok(None);
        };
        let asize = align_up(size.max(1), ENTRY_ALIGN);
        // A place in a region this host lost since (cut off, another host took it) is not
        // this writer's any more: its bytes go elsewhere (copied there, they overwrote what
        // that host stored).
        let lost = placed.is_some_and(|(o, _)| self.in_lost_region(o));
        if lost || !placed.is_some_and(|(_, held)| held >= asize) {
            let offset = self.place(size, Some(MOUNT_WRITERS), id)?;
            if let Some((old, _)) = placed.replace((offset, asize)) {
                self.release(old);
            }
        }
        let (offset, _) = placed.expect("placed above");
        // Never waits for the buffer's lock here (its holders take the store's while they hold
        // it): one held for writing is a copy or a write under way, after which the copy is
        // due anyway (or finds its bytes there and does nothing); readers share it.
        if buf.try_read().is_some_and(|b| b.copied_to(offset, size)) {
            return Ok(None);
        }
        Ok(Some(CopyIn::new(
            buf.clone(),
            self.file.clone(),
            offset,
            size,
            self.authority.clone(),
        )))
    }

    fn publish(&mut self, _id: u64, backing: &mut Backing, e: &Loc<'_>) -> Result<Place> {
        let offset = match backing {
            Backing::Extent { offset } => *offset,
            Backing::Buffer {
                buf,
                placed: Some((o, _)),
            } if buf.try_read().is_some_and(|b| b.copied_to(*o, e.size)) => *o,
            Backing::Buffer { .. } => {
                return Err(Error::Busy(format!(
                    "{}/{}: its bytes are not yet in the pool",
                    e.ns, e.key
                )));
            }
            Backing::File { .. } | Backing::Packed { .. } => {
                return Err(Error::Protocol("a raw allocation with a file".into()));
            }
        };
        // Without coherence across hosts the writer's lines were written back before the
        // entry's publication was asked for (`Pool::write_back`).
        self.log(&Self::seal_record(e, offset))?;
        Ok(Place::Extent(offset))
    }

    fn delete(&mut self, e: &Loc<'_>, leased: bool) -> bool {
        if let Err(err) = self.log(&Record::Del { off: extent(e) }) {
            // Its seal stays the log's last word on it: reused now, its extent would come
            // back at the next start as this entry, over another's bytes.
            tracing::error!(
                ns = %e.ns,
                key = %e.key,
                "pool log: {err}: the removal is not recorded; its extent stays taken until \
                 marud restarts, and the entry comes back then"
            );
            self.unrecorded.insert(extent(e));
            return false;
        }
        let removal = self.wal.as_ref().and_then(Wal::unsynced);
        if leased {
            if let Some(u) = removal {
                self.unsynced_dels.insert(extent(e), u);
            }
            return false;
        }
        self.release_after(extent(e), removal);
        true
    }

    fn free_extent(&mut self, place: Place) {
        if let Some(offset) = place.extent() {
            if self.unrecorded.contains(&offset) {
                return;
            }
            let removal = self.unsynced_dels.remove(&offset);
            self.release_after(offset, removal);
        }
    }

    fn rename(&mut self, e: &Loc<'_>, ns: &str, key: &str) -> Result<Option<Place>> {
        self.log(&Record::Rename {
            off: extent(e),
            ns: ns.to_owned(),
            key: key.to_owned(),
        })?;
        Ok(None)
    }

    fn set_pinned(&mut self, e: &Loc<'_>, pinned: bool) -> Result<()> {
        self.log(&Record::Pin {
            off: extent(e),
            pin: pinned,
        })
    }

    fn set_owner_mode(&mut self, _e: &Loc<'_>) -> Result<Option<Place>> {
        // The log keeps the owner of each entry as sealed; a change of mode lives in memory.
        Ok(None)
    }

    fn retrieve_fd(&self, _e: &Loc<'_>, first: bool) -> Result<Option<File>> {
        Ok(if first {
            Some(self.ro.try_clone()?)
        } else {
            None
        })
    }

    fn open_entry(&self, _e: &Loc<'_>) -> Result<File> {
        Err(Error::Unsupported(
            "raw pool entries have no file of their own".into(),
        ))
    }

    fn reader(&self, e: &Loc<'_>) -> Result<Reader> {
        Ok(Reader {
            file: self.ro.clone(),
            base: extent(e),
        })
    }

    fn device_fd(&self, write: bool) -> Result<File> {
        Ok(if write {
            self.rw.try_clone()?
        } else {
            self.ro.try_clone()?
        })
    }

    fn location(&self, e: &Loc<'_>) -> String {
        format!("{}@{:#x}", self.path.display(), extent(e))
    }

    fn ensure_ns(&mut self, _ns: &str) -> Result<()> {
        Ok(())
    }

    fn remove_ns(&mut self, _ns: &str) {}

    fn recover(&mut self) -> Result<(Vec<String>, Vec<Found>)> {
        let live = format::replay(wal::read_log(&self.log_path)?);
        let mut found = Vec::new();
        for (_, rec) in live {
            let Record::Seal {
                ns,
                key,
                off,
                size,
                asize,
                pin,
                uid,
                gid,
            } = rec
            else {
                continue;
            };
            if off < REGION_ALIGN || off + asize > self.size {
                tracing::warn!(off, "log entry outside the pool; dropped");
                continue;
            }
            found.push(Found {
                ns,
                key,
                place: Place::Extent(off),
                size,
                pinned: pin,
                uid,
                gid,
                mode: 0o644,
                mtime: std::time::SystemTime::now(),
            });
        }
        Ok((Vec::new(), found))
    }

    fn recovered(&mut self, kept: &[Loc<'_>]) -> Result<()> {
        // Regions: maximal runs of 2 MiB units covered by the entries kept.
        let mut units: BTreeMap<u64, u32> = BTreeMap::new();
        for e in kept {
            let s = extent(e) / REGION_ALIGN * REGION_ALIGN;
            let end = align_up(extent(e) + e.asize, REGION_ALIGN);
            let mut u = s;
            while u < end {
                units.entry(u).or_insert(0);
                u += REGION_ALIGN;
            }
            *units.get_mut(&s).expect("inserted") += 1;
        }
        let mut runs: Vec<(u64, u64, u32)> = Vec::new();
        for (u, n) in units {
            match runs.last_mut() {
                Some((s, l, c)) if *s + *l == u => {
                    *l += REGION_ALIGN;
                    *c += n;
                }
                _ => runs.push((u, REGION_ALIGN, n)),
            }
        }
        self.extents = ExtentAlloc::new(REGION_ALIGN, self.size);
        self.regions.clear();
        for (s, l, c) in runs {
            self.extents.reserve(s, l);
            self.authority.claim_again(&self.uuid, s, l)?;
            self.regions.insert(
                s,
                Region {
                    len: l,
                    owner: None,
                    bump: l,
                    live: c,
                },
            );
        }
        let recs: Vec<Record> = kept
            .iter()
            .map(|e| Self::seal_record(e, extent(e)))
            .collect();
        let sink = FileSink::open(
            &self.log_path,
            if self.wal_sync {
                Durability::EachRecord
            } else {
                Durability::Checkpoints
            },
        )?;
        let mut w = Wal::new(Box::new(sink));
        w.checkpoint(&recs)?;
        self.wal = Some(w);
        Ok(())
    }

    fn detach(&mut self, session: SessionId) {
        if let Some(roff) = self.open.remove(&session) {
            self.detach_region(roff);
        }
    }

    fn slack(&self, session: SessionId) -> u64 {
        self.open
            .get(&session)
            .and_then(|o| self.regions.get(o))
            .map_or(0, |r| r.len - r.bump.min(r.len))
    }

    fn sync(&mut self) {
        if let Some(w) = self.wal.as_mut()
            && let Err(e) = w.sync()
        {
            tracing::error!(pool = %self.name, "syncing the pool log: {e}");
        }
        self.release_synced();
    }

    fn take_unsynced(&mut self) -> Option<crate::wal::Unsynced> {
        self.release_synced();
        self.wal.as_mut().and_then(Wal::take_unsynced)
    }

    fn unmount(&self) {}

    fn check(&self) -> std::result::Result<(), String> {
        let held: Vec<(u64, u64)> = self
            .regions
            .iter()
            .filter(|(o, _)| !self.unclaimed.contains_key(o))
            .map(|(o, r)| (*o, r.len))
            .collect();
        if held != self.authority.regions(&self.uuid) {
            return Err(format!(
                "pool {}: regions {held:?}, the authority's claims {:?}",
                self.name,
                self.authority.regions(&self.uuid)
            ));
        }
        let regions: u64 = self.regions.values().map(|r| r.len).sum();
        // Set aside: units other hosts claimed first, and units of other hosts' entries.
        let aside: u64 = self.foreign.iter().map(|(_, l)| l).sum::<u64>()
            + REGION_ALIGN * self.remote_units.values().filter(|u| u.reserved).count() as u64;
        if regions + aside + self.extents.free_bytes() != self.capacity() {
            return Err(format!(
                "pool {}: regions {} + set aside {} + free {} != capacity {}",
                self.name,
                regions,
                aside,
                self.extents.free_bytes(),
                self.capacity()
            ));
        }
        Ok(())
    }

    #[cfg(feature = "seams")]
    fn seams(&mut self) -> Seams<'_> {
        Seams::Raw(&mut self.wal)
    }
}
