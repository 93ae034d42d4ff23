//! A memfs pool: each entry its own file of a memory filesystem (nameless in `w/` while
//! written, `n/<ns>/<key>` once sealed; the tree is the metadata), or, when small and its
//! client said where it would publish it, a piece of a pack shared with its namespace's other
//! small entries ([`super::packs`]).

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::sync::Arc;

use maru::format::Record;
use maru::proto::PoolKind;
use maru::{Error, Result};
use nix::sys::stat::{Mode, fchmod};
use nix::unistd::{Gid, Uid, fchown};

use super::super::ids::{Place, SessionId};
use super::super::policy::Perm;
#[cfg(feature = "seams")]
use super::Seams;
use super::packs::Packs;
use super::{Backing, Found, Loc, Pool, Prepare, Reader, Requester, Usage};
use crate::pool::PoolSpec;
use crate::pool::memfs::{
    MemfsPool, MetaStep, WritingDir, finish_owning, left_pack, mark_left, mark_owning, pin_file,
    unmark_left, unmark_owning,
};

/// The mode of the file of a client's allocation: that of the entries clients store.
const GRANT_MODE: u32 = 0o644;
/// The mode of the file of an entry created through the mount, until it is published.
const CREATE_MODE: u32 = 0o600;

/// A grant of a file of its own: the file made in `w`, `size` bytes reserved.
fn file_grant(writing: &WritingDir, size: u64) -> Result<Backing> {
    let f = writing.create(size, GRANT_MODE)?;
    Ok(Backing::File {
        file: Arc::new(f),
        span: size,
        mode: GRANT_MODE,
    })
}

/// A memfs pool's grants of files of their own, made without the store's lock; those that a
/// pack takes are the pool's (they are quick: the pack reserves ahead).
struct FileGrants {
    writing: Arc<WritingDir>,
    /// The largest allocation a pack takes.
    pack_max: u64,
}

impl Prepare for FileGrants {
    fn prepares(&self, size: u64, who: &Requester<'_>) -> bool {
        !(who.session.is_some() && who.ns.is_some() && size <= self.pack_max)
    }

    fn prepare(&self, size: u64) -> Result<Backing> {
        crate::store::assert_unlocked("a memfs allocation's fallocate");
        file_grant(&self.writing, size)
    }
}

/// A memfs pool.
pub struct Memfs {
    fs: MemfsPool,
    packs: Packs,
}

fn errno(e: nix::Error) -> Error {
    Error::Io(std::io::Error::from(e))
}

impl Memfs {
    /// Mounts (or reuses) the pool's tmpfs; the log of its packs is in `state_dir`, named
    /// after the pool's directory (`sync`: each record made durable).
    pub fn open(spec: &PoolSpec, state_dir: &Path, sync: bool) -> anyhow::Result<Memfs> {
        let fs = MemfsPool::open(spec)?;
        let log = state_dir.join(format!(
            "packs-{:016x}.wal",
            maru::index::hash_key(spec.path.as_os_str().as_encoded_bytes())
        ));
        let packs = Packs::open(&fs.root.join("p"), &log, spec.pack, sync)?;
        Ok(Memfs { fs, packs })
    }

    /// Gives file `file` (created by the daemon, as root) the entry's size, owner and mode and
    /// links it as `e`; returns where it is: a file of its own, by its inode number.
    fn publish_file(&mut self, id: u64, backing: &mut Backing, e: &Loc<'_>) -> Result<Place> {
        let Backing::File { file, span, mode } = backing else {
            return Err(Error::Protocol("a memfs allocation without a file".into()));
        };
        if *span != e.size {
            file.set_len(e.size)?;
            *span = e.size;
        }
        if e.uid != 0 || e.gid != 0 {
            fchown(
                &**file,
                Some(Uid::from_raw(e.uid)),
                Some(Gid::from_raw(e.gid)),
            )
            .map_err(errno)?;
        }
        if *mode != e.mode {
            fchmod(&**file, Mode::from_bits_truncate(e.mode)).map_err(errno)?;
            *mode = e.mode;
        }
        // An entry pinned in its pack keeps its pin in its own file (the pack log said it).
        if e.pinned {
            pin_file(file)?;
        }
        self.fs.publish(id, file, e.ns, e.key)?;
        // Its file's inode number, by which a client that opens the file itself
        // (Store::index_fd) tells it is this entry's.
        Ok(Place::File(file.metadata()?.ino()))
    }

    /// Copies the `e.size` bytes at `offset` of pack `pack` into a file of their own,
    /// published as `e` (of id `id`); returns where it is and the file's backing. `sealed`:
    /// they are an entry the pack log holds (it leaves its pack), not an allocation.
    fn own_file(
        &mut self,
        id: u64,
        (pack, offset): (u32, u64),
        e: &Loc<'_>,
        sealed: bool,
    ) -> Result<(Place, Backing)> {
        let mut bytes = vec![0u8; e.size as usize];
        self.packs.reader_at(pack, offset)?.read(0, &mut bytes)?;
        let f = self.fs.create_writing(e.size, e.mode)?;
        f.write_all_at(&bytes, 0)?;
        // Until the pack log lets the entry go, a recovery finds it twice (under another name
        // after a rename): the file says which copy in the pack it replaces.
        if let Some(ino) = self.packs.ino(pack).filter(|_| sealed) {
            mark_left(&f, ino, offset)?;
        }
        let mut b = Backing::File {
            file: Arc::new(f),
            span: e.size,
            mode: e.mode,
        };
        Ok((self.publish_file(id, &mut b, e)?, b))
    }

    /// Appends `r` to the pack log (unless the crash-injection seam stops it: then the daemon
    /// goes on as if it had, as a crashed one would have).
    fn log(&mut self, r: Record) -> Result<()> {
        if !self.fs.pass(|| MetaStep::Packed(r.clone())) {
            return Ok(());
        }
        self.packs.log(&r)
    }

    /// Moves packed entry `e` (its new name, owner and mode already in `e`, at `offset` of
    /// pack `pack`) out of its pack into a file of its own; returns where it is now. Its
    /// bytes leave the pack: the pack's readers may not be the entry's any more (a mapping
    /// taken before reads zeros).
    fn unpack(&mut self, (pack, offset): (u32, u64), e: &Loc<'_>) -> Result<Place> {
        let (place, file) = self.own_file(0, (pack, offset), e, true)?;
        let at = Place::Packed { pack, offset }.wire();
        if !self.fs.pass(|| MetaStep::Packed(Record::Del { off: at })) {
            // The crash-injection seam stopped here: nothing after it happens on disk (a
            // crashed daemon punches nothing either).
            return Ok(place);
        }
        if let Err(err) = self.packs.log(&Record::Del { off: at }) {
            // Still packed as far as anyone knows: the copy goes.
            if let Err(e2) = self.fs.delete(e.ns, e.key) {
                tracing::warn!(ns = %e.ns, key = %e.key, "removing a copy out of a pack: {e2}");
            }
            return Err(err);
        }
        if let Backing::File { file, .. } = &file
            && let Err(e2) = unmark_left(file)
        {
            tracing::warn!(ns = %e.ns, key = %e.key, "an entry out of its pack keeps its mark: {e2}");
        }
        self.packs.punch(pack, offset, e.asize);
        self.packs.release(pack);
        Ok(place)
    }
}

impl Pool for Memfs {
    fn kind(&self) -> PoolKind {
        PoolKind::Memfs
    }

    fn capacity(&self) -> u64 {
        self.fs.capacity
    }

    fn free_space(&self) -> u64 {
        self.fs.space().map(|x| x.1).unwrap_or(0)
    }

    fn passthrough(&self) -> bool {
        true
    }

    fn leases(&self) -> bool {
        false
    }

    fn passes_through(&self, e: &Loc<'_>) -> bool {
        e.place.packed().is_none()
    }

    fn preparer(&self) -> Option<Arc<dyn Prepare>> {
        Some(Arc::new(FileGrants {
            writing: self.fs.writing(),
            pack_max: self.packs.max(),
        }))
    }

    fn grant(&mut self, _id: u64, size: u64, who: &Requester<'_>) -> Result<Backing> {
        if let (Some(s), Some(ns)) = (who.session, who.ns)
            && self.packs.takes(size)
        {
            let g = self.packs.grant(s, ns, who.perm, size)?;
            return Ok(Backing::Packed {
                pack: g.pack,
                offset: g.offset,
                len: g.len,
                file: g.file,
            });
        }
        file_grant(&self.fs.writing(), size)
    }

    fn create(&mut self, _id: u64) -> Result<Backing> {
        let f = self.fs.create_writing(0, CREATE_MODE)?;
        Ok(Backing::File {
            file: Arc::new(f),
            span: 0,
            mode: CREATE_MODE,
        })
    }

    fn abort(&mut self, id: u64, backing: &Backing) {
        match backing {
            Backing::Packed {
                pack, offset, len, ..
            } => {
                self.packs.punch(*pack, *offset, *len);
                self.packs.release(*pack);
            }
            _ => self.fs.abort(id),
        }
    }

    fn commit(
        &mut self,
        _id: u64,
        backing: &mut Backing,
        size: u64,
    ) -> Result<Option<super::buffer::CopyIn>> {
        // The bytes are in the pool already (every write succeeded or failed there); the file,
        // grown ahead of its writer, takes its size.
        if let Backing::File { file, span, .. } = backing
            && *span != size
        {
            file.set_len(size)?;
            *span = size;
        }
        Ok(None)
    }

    fn publish(&mut self, id: u64, backing: &mut Backing, e: &Loc<'_>) -> Result<Place> {
        let Backing::Packed {
            pack, offset, len, ..
        } = *backing
        else {
            return self.publish_file(id, backing, e);
        };
        if self.packs.fits(pack, e) {
            let at = Place::Packed { pack, offset };
            self.log(Packs::seal_record(at.wire(), e))?;
            return Ok(at);
        }
        // Published elsewhere than its allocation said: its pack is not for this entry's
        // readers; the bytes go to a file of their own.
        let (place, file) = self.own_file(id, (pack, offset), e, false)?;
        self.packs.punch(pack, offset, len);
        self.packs.release(pack);
        *backing = file;
        Ok(place)
    }

    fn delete(&mut self, e: &Loc<'_>, leased: bool) -> bool {
        if let Some((pack, _)) = e.place.packed() {
            if let Err(err) = self.log(Record::Del {
                off: e.place.wire(),
            }) {
                tracing::warn!(ns = %e.ns, key = %e.key, "logging a packed entry's removal: {err}");
            }
            // Its bytes are read by copy through the mount while an open file leases it.
            if leased {
                return false;
            }
            self.packs.release(pack);
            return true;
        }
        // Mappings of the file stay valid until unmapped: the tmpfs frees it then.
        if let Err(err) = self.fs.delete(e.ns, e.key) {
            tracing::warn!(ns = %e.ns, key = %e.key, "removing backing file: {err}");
        }
        true
    }

    fn free_extent(&mut self, place: Place) {
        if let Some((pack, _)) = place.packed() {
            self.packs.release(pack);
        }
    }

    fn pack(&self, pack: u32) -> Option<Usage> {
        self.packs.usage(pack)
    }

    fn rename(&mut self, e: &Loc<'_>, ns: &str, key: &str) -> Result<Option<Place>> {
        let Some((pack, offset)) = e.place.packed() else {
            self.fs.rename(e.ns, e.key, ns, key)?;
            return Ok(None);
        };
        let to = Loc { ns, key, ..*e };
        if self.packs.fits(pack, &to) {
            self.log(Record::Rename {
                off: e.place.wire(),
                ns: ns.to_owned(),
                key: key.to_owned(),
            })?;
            return Ok(None);
        }
        self.unpack((pack, offset), &to).map(Some)
    }

    fn set_pinned(&mut self, e: &Loc<'_>, pinned: bool) -> Result<()> {
        if e.place.packed().is_some() {
            return self.log(Record::Pin {
                off: e.place.wire(),
                pin: pinned,
            });
        }
        Ok(self.fs.set_pinned(e.ns, e.key, pinned)?)
    }

    fn set_owner_mode(&mut self, e: &Loc<'_>) -> Result<Option<Place>> {
        if let Some((pack, offset)) = e.place.packed() {
            if self.packs.fits(pack, e) {
                return Ok(None);
            }
            return self.unpack((pack, offset), e).map(Some);
        }
        let f = self.fs.open_entry(e.ns, e.key)?;
        let md = f.metadata()?;
        // Clients open entries' files themselves (Store::index_fd), with the kernel deciding
        // from the file's owner and mode: a new owner or group is given to a closed file, so
        // that no one reads it in between under the old mode and the new owner.
        let mode = Mode::from_bits_truncate(e.mode);
        if md.uid() == e.uid && md.gid() == e.gid {
            fchmod(&f, mode).map_err(errno)?;
            return Ok(None);
        }
        // Three steps, whose target is written on the file first: a restart after a crash
        // between them finishes the change (`recover`), and a failed step undoes the others
        // (the store keeps the old owner and mode then).
        mark_owning(&f, e.uid, e.gid, e.mode)?;
        let changed = fchmod(&f, Mode::empty())
            .and_then(|()| fchown(&f, Some(Uid::from_raw(e.uid)), Some(Gid::from_raw(e.gid))))
            .and_then(|()| fchmod(&f, mode));
        if let Err(err) = changed {
            let back = fchown(
                &f,
                Some(Uid::from_raw(md.uid())),
                Some(Gid::from_raw(md.gid())),
            )
            .and_then(|()| fchmod(&f, Mode::from_bits_truncate(md.mode())));
            match back {
                Ok(()) => drop(unmark_owning(&f)),
                // Left marked: a restart gives the entry the owner the client asked for.
                Err(b) => tracing::error!(ns = e.ns, key = e.key, "undoing a change of owner: {b}"),
            }
            return Err(errno(err));
        }
        if let Err(err) = unmark_owning(&f) {
            // Done all the same; a restart would only do it again.
            tracing::warn!(
                ns = e.ns,
                key = e.key,
                "a change of owner left its mark: {err}"
            );
        }
        Ok(None)
    }

    fn retrieve_fd(&self, e: &Loc<'_>, first: bool) -> Result<Option<File>> {
        if let Some((pack, _)) = e.place.packed() {
            return Ok(if first {
                Some(self.packs.reader(pack)?)
            } else {
                None
            });
        }
        Ok(Some(self.fs.open_entry(e.ns, e.key)?))
    }

    fn open_entry(&self, e: &Loc<'_>) -> Result<File> {
        if e.place.packed().is_some() {
            return Err(Error::Unsupported(
                "a packed entry has no file of its own".into(),
            ));
        }
        Ok(self.fs.open_entry(e.ns, e.key)?)
    }

    fn reader(&self, e: &Loc<'_>) -> Result<Reader> {
        if let Some((pack, offset)) = e.place.packed() {
            return self.packs.reader_at(pack, offset);
        }
        Ok(Reader {
            file: Arc::new(self.fs.open_entry(e.ns, e.key)?),
            base: 0,
        })
    }

    fn device_fd(&self, _write: bool) -> Result<File> {
        Err(Error::InvalidArgument("not a raw pool".into()))
    }

    fn location(&self, e: &Loc<'_>) -> String {
        if let Some((pack, _)) = e.place.packed() {
            return self.packs.location(pack);
        }
        self.fs.entry_path(e.ns, e.key).display().to_string()
    }

    fn ensure_ns(&mut self, ns: &str) -> Result<()> {
        self.fs.ensure_ns(ns)?;
        Ok(())
    }

    fn ns_dir(&self, ns: &str) -> Result<Option<File>> {
        match self.fs.ns_dir(ns)? {
            Some(d) => Ok(Some(d.try_clone()?)),
            None => Ok(None),
        }
    }

    fn pack_dir(&self) -> Result<Option<File>> {
        Ok(Some(self.packs.dir()?))
    }

    fn set_ns_access(&mut self, ns: &str, perm: &Perm) -> Result<()> {
        Ok(self.fs.set_ns_access(ns, perm.uid, perm.gid, perm.mode)?)
    }

    fn mirrors_access(&self) -> bool {
        self.fs.acls
    }

    fn remove_ns(&mut self, ns: &str) {
        self.fs.remove_ns(ns);
    }

    fn recover(&mut self) -> Result<(Vec<String>, Vec<Found>)> {
        let (dirs, found) = self.fs.scan()?;
        let mut out = Vec::with_capacity(found.len());
        let mut left = std::collections::HashSet::new();
        for f in found {
            let path = self.fs.entry_path(&f.ns, &f.key);
            if let Err(e) = finish_owning(&path) {
                tracing::error!(file = %path.display(), "finishing a change of owner a crash cut: {e}");
            }
            let md = std::fs::metadata(&path)?;
            left.extend(left_pack(&path));
            let at = Place::File(md.ino());
            out.push(Found::of(f.ns, f.key, at, f.size, f.pinned, &md));
        }
        // After the files: a crash while an entry left its pack leaves it in both. The file
        // is the one kept: its pack's copy is not recovered (the file names it, whatever the
        // file's name; under the same name, the name taken would refuse it anyway), and its
        // bytes there are freed (`Packs::recovered`).
        let mut inos: std::collections::HashMap<u32, Option<u64>> = Default::default();
        for f in self.packs.recover()? {
            if let Some((pack, offset)) = f.place.packed() {
                let ino = *inos.entry(pack).or_insert_with(|| self.packs.ino(pack));
                if ino.is_some_and(|ino| left.contains(&(ino, offset))) {
                    tracing::info!(pack, offset, ns = %f.ns, key = %f.key, "an entry that left its pack");
                    continue;
                }
            }
            out.push(f);
        }
        Ok((dirs, out))
    }

    fn recovered(&mut self, kept: &[Loc<'_>]) -> Result<()> {
        self.packs.recovered(kept)
    }

    fn detach(&mut self, session: SessionId) {
        self.packs.detach(session);
    }

    fn slack(&self, _session: SessionId) -> u64 {
        0
    }

    fn sync(&mut self) {}

    fn take_unsynced(&mut self) -> Option<crate::wal::Unsynced> {
        // The packs' bytes are memory, gone with the host: a pack's room is reused at once.
        self.packs.take_unsynced()
    }

    fn unmount(&self) {
        if self.fs.mounted_here {
            self.fs.unmount();
        }
    }

    fn check(&self) -> std::result::Result<(), String> {
        self.packs.check()
    }

    #[cfg(feature = "seams")]
    fn seams(&mut self) -> Seams<'_> {
        Seams::Memfs(&self.fs)
    }
}
