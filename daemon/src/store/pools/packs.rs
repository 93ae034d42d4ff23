//! Small entries of a memfs pool, packed into shared files.
//!
//! An entry of its own file costs a file (created, linked, and a descriptor and a mapping for
//! each reader); small entries are most of that cost. A client that says in which namespace
//! its allocations will be published gets the small ones carved from a *pack*: a file of
//! [`PACK_BYTES`] under `p/` (root's, 0700) holding only entries of that namespace, that
//! session's owner, group and mode, so that whoever is given the pack's descriptor (after the
//! policy allowed one of its entries) may read every entry in it anyway. A reader maps a pack
//! once and takes its entries from that mapping.
//!
//! Offsets in a pack are never handed out twice: a removed entry's bytes stay under its
//! readers' mappings, so no lease is needed, and the pack's file goes when its last entry and
//! allocation did (the tmpfs frees it when the last mapping goes). What is packed where is
//! kept in a log in the state directory, as a raw pool's (records as a raw pool's, the offset
//! being the entry's [`maru::index::pack_location`]): pool memory stays for entries, and a full
//! pool still takes the records of the evictions that make room in it. A pack's file has its
//! class's owner, group and mode.
//!
//! An entry leaves its pack for a file of its own when its class would change: published in
//! another namespace than its allocation said, renamed into another namespace, or given
//! another owner, group or mode.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use maru::format::Record;
use maru::index::packed;
use maru::{Error, Result};
use nix::sys::stat::{Mode, fchmod};
use nix::unistd::{Gid, Uid, fchown};

use super::super::ids::{Place, SessionId};
use super::super::policy::Perm;
use super::{Found, Loc, Reader, Usage};
use crate::pool::ENTRY_ALIGN;
use crate::wal::{Durability, FileSink, Wal};

pub use maru::index::PACK_BYTES;

/// The first pack id a location cannot hold (`maru::index::pack_location`: 31 bits).
const LAST_PACK: u32 = 1 << 31;
/// Bytes a pack reserves at a time ahead of its allocations (one `fallocate` for many).
const RESERVE_STEP: u64 = 256 << 10;

/// Who may read a pack's entries: the namespace, and the entries' owner, group and mode.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Class {
    ns: String,
    uid: u32,
    gid: u32,
    mode: u32,
}

/// One pack file.
struct Pack {
    /// Open read-write (grants).
    rw: Arc<File>,
    /// Open read-only (retrievals).
    ro: Arc<File>,
    class: Class,
    /// Bytes handed out (allocations are carved at the end, never twice).
    end: u64,
    /// Bytes reserved in the tmpfs (`fallocate`), ahead of `end` while the pack is open.
    reserved: u64,
    /// Sealed entries and allocations in it.
    live: u32,
    /// Still takes allocations (the open pack of a session).
    open: bool,
}

/// The packs of one memfs pool.
pub struct Packs {
    dir: PathBuf,
    log: PathBuf,
    /// The largest entry packed (0: none).
    max: u64,
    wal: Wal,
    packs: HashMap<u32, Pack>,
    /// Each session's open pack per class.
    open: HashMap<(SessionId, Class), u32>,
    next: u32,
}

/// An allocation carved from a pack.
pub struct PackGrant {
    /// The pack.
    pub pack: u32,
    /// Where in it.
    pub offset: u64,
    /// Bytes reserved there (whole pages).
    pub len: u64,
    /// The pack, open read-write.
    pub file: Arc<File>,
}

fn errno(e: nix::Error) -> Error {
    Error::Io(std::io::Error::from(e))
}

impl Packs {
    /// Opens (creating) the pack directory `dir` of a pool, whose log is `log`; entries up
    /// to `max` bytes are packed; `sync` makes each record durable (`--wal-sync`; otherwise
    /// nothing is synced: the packs are memory, gone with the host).
    pub fn open(dir: &Path, log: &Path, max: u64, sync: bool) -> std::io::Result<Packs> {
        use std::os::unix::fs::DirBuilderExt;
        if !dir.exists() {
            std::fs::DirBuilder::new().mode(0o700).create(dir)?;
        }
        let durability = if sync {
            Durability::EachRecord
        } else {
            Durability::Process
        };
        let wal = Wal::new(Box::new(FileSink::open(log, durability)?));
        Ok(Packs {
            dir: dir.to_owned(),
            log: log.to_owned(),
            max: max.min(PACK_BYTES),
            wal,
            packs: HashMap::new(),
            open: HashMap::new(),
            next: 1,
        })
    }

    /// What was appended to the log and is not yet synced (`--wal-sync`).
    pub fn take_unsynced(&mut self) -> Option<crate::wal::Unsynced> {
        self.wal.take_unsynced()
    }

    /// The packs' directory, open (for root clients, which open packs themselves).
    pub fn dir(&self) -> Result<File> {
        Ok(OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
            .open(&self.dir)?)
    }

    /// Whether an allocation of `size` bytes is packed: small enough, and while pack ids
    /// remain (a location holds 31 bits of one; past them, small entries get files of their
    /// own until the next start numbers packs again from the ones left).
    pub fn takes(&self, size: u64) -> bool {
        size <= self.max && self.next < LAST_PACK
    }

    /// The largest allocation a pack takes.
    pub fn max(&self) -> u64 {
        self.max
    }

    /// The inode number of pack `pack`'s file (a pack of another run with the same id is
    /// another file).
    pub fn ino(&self, pack: u32) -> Option<u64> {
        std::fs::metadata(self.path(pack)).ok().map(|m| m.ino())
    }

    fn path(&self, pack: u32) -> PathBuf {
        self.dir.join(pack.to_string())
    }

    /// Carves `size` bytes from `session`'s open pack for entries of `ns` with `perm`
    /// (a new pack when it has no room).
    pub fn grant(
        &mut self,
        session: SessionId,
        ns: &str,
        perm: &Perm,
        size: u64,
    ) -> Result<PackGrant> {
        let class = Class {
            ns: ns.to_owned(),
            uid: perm.uid,
            gid: perm.gid,
            mode: perm.mode,
        };
        let need = size.max(1).div_ceil(ENTRY_ALIGN) * ENTRY_ALIGN;
        let key = (session, class);
        let fits = |p: &Pack| p.end + need <= PACK_BYTES;
        let id = match self.open.get(&key) {
            Some(id) if fits(&self.packs[id]) => *id,
            _ => {
                if let Some(old) = self.open.remove(&key) {
                    self.close(old);
                }
                let id = self.create(&key.1)?;
                self.open.insert(key, id);
                id
            }
        };
        let p = self.packs.get_mut(&id).expect("open packs exist");
        let offset = p.end;
        if offset + need > p.reserved {
            // Reserves the bytes (and grows the file over them), some ahead: a full tmpfs
            // fails here, not under the client's first write.
            let ahead = (p.reserved + RESERVE_STEP).min(PACK_BYTES);
            let reserve = |to: u64| {
                nix::fcntl::fallocate(
                    &*p.rw,
                    nix::fcntl::FallocateFlags::empty(),
                    p.reserved as i64,
                    (to - p.reserved) as i64,
                )
            };
            let (to, just) = ((offset + need).max(ahead), offset + need);
            let r = match reserve(to) {
                Ok(()) => Ok(to),
                // Not that much room: what this allocation needs, if that fits.
                Err(nix::errno::Errno::ENOSPC) if to > just => reserve(just).map(|()| just),
                Err(e) => Err(e),
            };
            match r {
                Ok(to) => p.reserved = to,
                Err(nix::errno::Errno::ENOSPC) => {
                    return Err(Error::NoSpace(format!(
                        "memfs pool {} is full",
                        self.dir.display()
                    )));
                }
                Err(e) => return Err(errno(e)),
            }
        }
        p.end += need;
        p.live += 1;
        Ok(PackGrant {
            pack: id,
            offset,
            len: need,
            file: p.rw.clone(),
        })
    }

    fn create(&mut self, class: &Class) -> Result<u32> {
        if self.next >= LAST_PACK {
            return Err(Error::NoSpace("no pack id left in this run".into()));
        }
        let id = self.next;
        self.next += 1;
        let path = self.path(id);
        let rw = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)?;
        let made = fchown(
            &rw,
            Some(Uid::from_raw(class.uid)),
            Some(Gid::from_raw(class.gid)),
        )
        .and_then(|()| fchmod(&rw, Mode::from_bits_truncate(class.mode)));
        let ro = made.map_err(errno).and_then(|()| {
            Ok(OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(&path)?)
        });
        let ro = match ro {
            Ok(f) => f,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
        };
        self.packs.insert(
            id,
            Pack {
                rw: Arc::new(rw),
                ro: Arc::new(ro),
                class: class.clone(),
                end: 0,
                reserved: 0,
                live: 0,
                open: true,
            },
        );
        Ok(id)
    }

    /// Takes no more allocations into `pack` (what it reserved ahead is given back); removes
    /// it if nothing lives in it.
    fn close(&mut self, pack: u32) {
        if let Some(p) = self.packs.get_mut(&pack) {
            p.open = false;
            let (end, reserved) = (p.end, p.reserved);
            if reserved > end {
                self.punch(pack, end, reserved - end);
            }
        }
        self.settle(pack);
    }

    fn settle(&mut self, pack: u32) {
        if self
            .packs
            .get(&pack)
            .is_some_and(|p| p.live == 0 && !p.open)
        {
            self.packs.remove(&pack);
            if let Err(e) = std::fs::remove_file(self.path(pack)) {
                tracing::warn!(pack, "removing an empty pack: {e}");
            }
        }
    }

    /// Frees the pages of `[offset, offset + len)` of `pack`, whose bytes left it (or were
    /// never published): whoever may map the pack no longer reads them there; a mapping of
    /// them reads zeros.
    pub fn punch(&self, pack: u32, offset: u64, len: u64) {
        let Some(p) = self.packs.get(&pack) else {
            return;
        };
        let len = len.div_ceil(ENTRY_ALIGN) * ENTRY_ALIGN;
        if let Err(e) = nix::fcntl::fallocate(
            &*p.rw,
            nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
                | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
            offset as i64,
            len as i64,
        ) {
            tracing::warn!(pack, offset, "freeing bytes that left a pack: {e}");
        }
    }

    /// What holds pack `pack`'s memory ([`Usage`]); None when there is no such pack.
    pub fn usage(&self, pack: u32) -> Option<Usage> {
        self.packs.get(&pack).map(|p| Usage {
            live: p.live,
            open: p.open,
            bytes: p.end,
        })
    }

    /// One entry or allocation of `pack` is gone.
    pub fn release(&mut self, pack: u32) {
        if let Some(p) = self.packs.get_mut(&pack) {
            p.live = p.live.saturating_sub(1);
        }
        self.settle(pack);
    }

    /// A session ended: its open packs take no more allocations.
    pub fn detach(&mut self, session: SessionId) {
        let ended: Vec<(SessionId, Class)> = self
            .open
            .keys()
            .filter(|(s, _)| *s == session)
            .cloned()
            .collect();
        for k in ended {
            if let Some(id) = self.open.remove(&k) {
                self.close(id);
            }
        }
    }

    /// Whether an entry packed in `pack` may stay there as `e` (same namespace, owner, group
    /// and mode as the pack's).
    pub fn fits(&self, pack: u32, e: &Loc<'_>) -> bool {
        self.packs.get(&pack).is_some_and(|p| {
            let c = &p.class;
            (c.ns.as_str(), c.uid, c.gid, c.mode) == (e.ns, e.uid, e.gid, e.mode)
        })
    }

    /// The record of entry `e` sealed at packed location `at`.
    pub fn seal_record(at: u64, e: &Loc<'_>) -> Record {
        Record::Seal {
            ns: e.ns.to_owned(),
            key: e.key.to_owned(),
            off: at,
            size: e.size,
            asize: e.asize,
            pin: e.pinned,
            uid: e.uid,
            gid: e.gid,
        }
    }

    /// Records a change of the packed entries.
    pub fn log(&mut self, r: &Record) -> Result<()> {
        Ok(self.wal.append(r)?)
    }

    /// Reads the bytes of a packed entry at `base` of pack `pack`.
    pub fn reader_at(&self, pack: u32, base: u64) -> Result<Reader> {
        let p = self
            .packs
            .get(&pack)
            .ok_or_else(|| Error::NotFound(format!("pack {pack}")))?;
        Ok(Reader {
            file: p.ro.clone(),
            base,
        })
    }

    /// The read-only descriptor of pack `pack`.
    pub fn reader(&self, pack: u32) -> Result<File> {
        let p = self
            .packs
            .get(&pack)
            .ok_or_else(|| Error::NotFound(format!("pack {pack}")))?;
        Ok(p.ro.try_clone()?)
    }

    /// The path of pack `pack`.
    pub fn location(&self, pack: u32) -> String {
        self.path(pack).display().to_string()
    }

    /// The packed entries the log holds (an entry whose pack's file is gone is dropped).
    pub fn recover(&mut self) -> Result<Vec<Found>> {
        let live = maru::format::replay(crate::wal::read_log(&self.log)?);
        let mut files: HashMap<u32, Option<std::fs::Metadata>> = HashMap::new();
        let mut out = Vec::new();
        for r in live.into_values() {
            let Record::Seal {
                ns,
                key,
                off,
                size,
                pin,
                ..
            } = r
            else {
                continue;
            };
            let Some((pack, offset)) = packed(off) else {
                continue;
            };
            let md = files
                .entry(pack)
                .or_insert_with(|| std::fs::metadata(self.path(pack)).ok());
            let Some(md) = md else {
                tracing::warn!(%ns, %key, pack, "not recovered: its pack is gone");
                continue;
            };
            let at = Place::Packed { pack, offset };
            out.push(Found::of(ns, key, at, size, pin, md));
        }
        Ok(out)
    }

    /// After recovery: opens the packs of the entries kept (taking no new allocations),
    /// removes every other pack, and rewrites the log as the kept entries.
    pub fn recovered(&mut self, kept: &[Loc<'_>]) -> Result<()> {
        let mut live: HashMap<u32, u32> = HashMap::new();
        for e in kept {
            if let Some((pack, _)) = e.place.packed() {
                *live.entry(pack).or_default() += 1;
            }
        }
        for d in std::fs::read_dir(&self.dir)? {
            let d = d?;
            let Some(id) = d.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            self.next = self.next.max(id + 1);
            let Some(&n) = live.get(&id) else {
                tracing::info!(pack = id, "removing a pack with no entry left");
                std::fs::remove_file(d.path())?;
                continue;
            };
            let rw = OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(d.path())?;
            let ro = OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(d.path())?;
            let md = rw.metadata()?;
            let ns = kept
                .iter()
                .find(|e| e.place.packed().is_some_and(|(p, _)| p == id))
                .map(|e| e.ns.to_owned())
                .unwrap_or_default();
            self.packs.insert(
                id,
                Pack {
                    end: md.len(),
                    reserved: md.len(),
                    rw: Arc::new(rw),
                    ro: Arc::new(ro),
                    class: Class {
                        ns,
                        uid: md.uid(),
                        gid: md.gid(),
                        mode: md.mode() & 0o7777,
                    },
                    live: n,
                    open: false,
                },
            );
            self.punch_between(id, kept, md.len());
        }
        self.checkpoint(kept);
        Ok(())
    }

    /// Frees the bytes of pack `id` (of `len` bytes) that no kept entry holds: those of
    /// entries removed, allocations in flight, and copies of entries that left the pack
    /// (another mode, another namespace) whose punch a crash came before. The pack's readers
    /// need not be theirs.
    fn punch_between(&self, id: u32, kept: &[Loc<'_>], len: u64) {
        let mut held: Vec<(u64, u64)> = kept
            .iter()
            .filter_map(|e| match e.place.packed() {
                Some((p, off)) if p == id => Some((off, e.asize.max(e.size))),
                _ => None,
            })
            .collect();
        held.sort_unstable();
        let mut at: u64 = 0;
        for (off, n) in held.into_iter().chain(std::iter::once((len, 0))) {
            // Whole aligned pieces only (a punch is rounded up to one): pieces start aligned.
            let from = at.div_ceil(ENTRY_ALIGN) * ENTRY_ALIGN;
            if off > from {
                self.punch(id, from, off - from);
            }
            at = at.max(off + n);
        }
    }

    /// Rewrites the log as the packed entries among `live` (at recovery).
    fn checkpoint(&mut self, live: &[Loc<'_>]) {
        let recs: Vec<Record> = live
            .iter()
            .filter(|e| e.place.packed().is_some())
            .map(|e| Self::seal_record(e.place.wire(), e))
            .collect();
        if let Err(e) = self.wal.checkpoint(&recs) {
            tracing::warn!(dir = %self.dir.display(), "rewriting the pack log: {e}");
        }
    }

    /// Checks the packs' own accounting: what each hands out fits it and was reserved, and no
    /// pack with nothing left to take or hold is kept.
    pub fn check(&self) -> std::result::Result<(), String> {
        for (id, p) in &self.packs {
            if p.end > p.reserved || p.reserved > PACK_BYTES {
                return Err(format!(
                    "pack {id} hands out {} bytes of {} reserved",
                    p.end, p.reserved
                ));
            }
            if p.live == 0 && !p.open {
                return Err(format!("pack {id} is empty and closed but kept"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_pack_is_made_past_the_ids_a_location_holds() {
        let dir = tempfile::tempdir().unwrap();
        let mut packs = Packs::open(
            &dir.path().join("p"),
            &dir.path().join("packs.wal"),
            64 << 10,
            false,
        )
        .unwrap();
        assert!(packs.takes(4096));
        packs.next = LAST_PACK - 1;
        let perm = Perm {
            uid: 0,
            gid: 0,
            mode: 0o644,
        };
        let g = packs.grant(SessionId::MOUNT, "ns", &perm, 4096).unwrap();
        assert_eq!(g.pack, LAST_PACK - 1);
        let at = Place::Packed {
            pack: g.pack,
            offset: g.offset,
        };
        assert_eq!(packed(at.wire()), Some((g.pack, g.offset)), "its location");
        assert!(!packs.takes(4096), "no id left for another pack");
    }

    #[test]
    fn recovery_frees_the_bytes_of_a_pack_no_kept_entry_holds() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let open = || {
            Packs::open(
                &dir.path().join("p"),
                &dir.path().join("packs.wal"),
                64 << 10,
                false,
            )
            .unwrap()
        };
        let mut packs = open();
        let perm = Perm {
            uid: 0,
            gid: 0,
            mode: 0o644,
        };
        let grants: Vec<PackGrant> = (0..3)
            .map(|_| packs.grant(SessionId::MOUNT, "ns", &perm, 5000).unwrap())
            .collect();
        for (i, g) in grants.iter().enumerate() {
            g.file.write_all_at(&[i as u8 + 1; 5000], g.offset).unwrap();
        }
        drop(packs);
        // Only the middle one is kept (the others: removed, or copied out before a crash).
        let g = &grants[1];
        let kept = [Loc {
            ns: "ns",
            key: "k",
            place: Place::Packed {
                pack: g.pack,
                offset: g.offset,
            },
            size: 5000,
            asize: g.len,
            pinned: false,
            uid: 0,
            gid: 0,
            mode: 0o644,
        }];
        let mut packs = open();
        packs.recovered(&kept).unwrap();
        let mut b = vec![0u8; 5000];
        for (i, g) in grants.iter().enumerate() {
            g.file.read_exact_at(&mut b, g.offset).unwrap();
            let want = if i == 1 { i as u8 + 1 } else { 0 };
            assert!(b.iter().all(|x| *x == want), "piece {i}");
        }
    }
}
