//! A memfs pool: each entry its own file of a memory filesystem (nameless in `w/` while
//! written, `n/<ns>/<key>` once sealed); the tree is the metadata.

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::Arc;

use maru::proto::PoolKind;
use maru::{Error, Result};
use nix::sys::stat::{Mode, fchmod};
use nix::unistd::{Gid, Uid, fchown};

use super::super::policy::Perm;
use super::{Backing, Found, Loc, Pool, Seams};
use crate::pool::MemfsPool;

/// The mode of the file of a client's allocation: that of the entries clients store.
const GRANT_MODE: u32 = 0o644;
/// The mode of the file of an entry created through the mount, until it is published.
const CREATE_MODE: u32 = 0o600;

/// A memfs pool.
pub struct Memfs(pub MemfsPool);

fn errno(e: nix::Error) -> Error {
    Error::Io(std::io::Error::from(e))
}

impl Pool for Memfs {
    fn kind(&self) -> PoolKind {
        PoolKind::Memfs
    }

    fn capacity(&self) -> u64 {
        self.0.capacity
    }

    fn free_space(&self) -> u64 {
        self.0.space().map(|x| x.1).unwrap_or(0)
    }

    fn passthrough(&self) -> bool {
        true
    }

    fn leases(&self) -> bool {
        false
    }

    fn grant(&mut self, _id: u64, size: u64, _session: Option<u64>) -> Result<Backing> {
        let f = self.0.create_writing(size, GRANT_MODE)?;
        Ok(Backing::File {
            file: Arc::new(f),
            span: size,
            mode: GRANT_MODE,
        })
    }

    fn create(&mut self, _id: u64) -> Result<Backing> {
        let f = self.0.create_writing(0, CREATE_MODE)?;
        Ok(Backing::File {
            file: Arc::new(f),
            span: 0,
            mode: CREATE_MODE,
        })
    }

    fn abort(&mut self, id: u64, _backing: &Backing) {
        self.0.abort(id);
    }

    fn commit(&mut self, _id: u64, backing: &mut Backing, size: u64) -> Result<()> {
        // The bytes are in the pool already (every write succeeded or failed there); the file,
        // grown ahead of its writer, takes its size.
        if let Backing::File { file, span, .. } = backing
            && *span != size
        {
            file.set_len(size)?;
            *span = size;
        }
        Ok(())
    }

    fn publish(&mut self, id: u64, backing: &mut Backing, e: &Loc<'_>) -> Result<u64> {
        let Backing::File { file, span, mode } = backing else {
            return Err(Error::Protocol("a memfs allocation without a file".into()));
        };
        if *span != e.size {
            file.set_len(e.size)?;
            *span = e.size;
        }
        // The file was created by the daemon (root): give it the entry's owner and mode.
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
        self.0.publish(id, file, e.ns, e.key)?;
        // The entry's "offset": its file's inode number, by which a client that opens the file
        // itself (Store::index_fd) tells it is this entry's.
        Ok(file.metadata()?.ino())
    }

    fn delete(&mut self, e: &Loc<'_>, _leased: bool) -> bool {
        // Mappings of the file stay valid until unmapped: the tmpfs frees it then.
        if let Err(err) = self.0.delete(e.ns, e.key) {
            tracing::warn!(ns = %e.ns, key = %e.key, "removing backing file: {err}");
        }
        true
    }

    fn free_extent(&mut self, _offset: u64) {}

    fn rename(&mut self, e: &Loc<'_>, ns: &str, key: &str) -> Result<()> {
        self.0.rename(e.ns, e.key, ns, key)
    }

    fn set_pinned(&mut self, e: &Loc<'_>, pinned: bool) -> Result<()> {
        Ok(self.0.set_pinned(e.ns, e.key, pinned)?)
    }

    fn set_owner_mode(&mut self, e: &Loc<'_>) -> Result<()> {
        let f = self.0.open_entry(e.ns, e.key)?;
        let md = f.metadata()?;
        // Clients open entries' files themselves (Store::index_fd), with the kernel deciding
        // from the file's owner and mode: a new owner or group is given to a closed file, so
        // that no one reads it in between under the old mode and the new owner.
        if md.uid() != e.uid || md.gid() != e.gid {
            fchmod(&f, Mode::empty()).map_err(errno)?;
            fchown(&f, Some(Uid::from_raw(e.uid)), Some(Gid::from_raw(e.gid))).map_err(errno)?;
        }
        fchmod(&f, Mode::from_bits_truncate(e.mode)).map_err(errno)?;
        Ok(())
    }

    fn retrieve_fd(&self, e: &Loc<'_>, _first: bool) -> Result<Option<File>> {
        Ok(Some(self.0.open_entry(e.ns, e.key)?))
    }

    fn open_entry(&self, e: &Loc<'_>) -> Result<File> {
        Ok(self.0.open_entry(e.ns, e.key)?)
    }

    fn read(&self, e: &Loc<'_>, offset: u64, buf: &mut [u8]) -> Result<()> {
        Ok(self.0.open_entry(e.ns, e.key)?.read_exact_at(buf, offset)?)
    }

    fn device_fd(&self, _write: bool) -> Result<File> {
        Err(Error::InvalidArgument("not a raw pool".into()))
    }

    fn location(&self, e: &Loc<'_>) -> String {
        self.0.entry_path(e.ns, e.key).display().to_string()
    }

    fn ensure_ns(&mut self, ns: &str) -> Result<()> {
        self.0.ensure_ns(ns)?;
        Ok(())
    }

    fn ns_dir(&self, ns: &str) -> Result<Option<File>> {
        match self.0.ns_dir(ns)? {
            Some(d) => Ok(Some(d.try_clone()?)),
            None => Ok(None),
        }
    }

    fn set_ns_access(&mut self, ns: &str, perm: &Perm) -> Result<()> {
        Ok(self.0.set_ns_access(ns, perm.uid, perm.gid, perm.mode)?)
    }

    fn mirrors_access(&self) -> bool {
        self.0.acls
    }

    fn remove_ns(&mut self, ns: &str) {
        self.0.remove_ns(ns);
    }

    fn recover(&mut self) -> Result<(Vec<String>, Vec<Found>)> {
        let (dirs, found) = self.0.scan()?;
        let mut out = Vec::with_capacity(found.len());
        for f in found {
            let md = std::fs::metadata(self.0.entry_path(&f.ns, &f.key))?;
            out.push(Found {
                ns: f.ns,
                key: f.key,
                offset: md.ino(),
                size: f.size,
                pinned: f.pinned,
                uid: md.uid(),
                gid: md.gid(),
                mode: md.mode() & 0o7777,
                mtime: md
                    .modified()
                    .unwrap_or_else(|_| std::time::SystemTime::now()),
            });
        }
        Ok((dirs, out))
    }

    fn recovered(&mut self, _kept: &[Loc<'_>]) -> Result<()> {
        Ok(())
    }

    fn checkpoint_due(&self) -> bool {
        false
    }

    fn checkpoint(&mut self, _live: &[Loc<'_>]) {}

    fn detach(&mut self, _session: u64) {}

    fn slack(&self, _session: u64) -> u64 {
        0
    }

    fn sync(&mut self) {}

    fn unmount(&self) {
        if self.0.mounted_here {
            self.0.unmount();
        }
    }

    fn check(&self) -> std::result::Result<(), String> {
        Ok(())
    }

    fn seams(&mut self) -> Seams<'_> {
        Seams::Memfs(&self.0)
    }
}
