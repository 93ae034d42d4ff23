//! Filesystem logic over a [`Backend`]: open handles, sealing on the last
//! close of a writable handle, cache lifetimes. No fuser types here.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use maru::{Error, Result};
use parking_lot::Mutex;

use crate::backend::{Attr, Backend, Caller, DirEntry, Kind, OpenedFile, Xattr};

/// Kernel cache lifetime of immutable things (sealed entries, their names, namespace names).
/// Deletion, eviction and renames made behind the kernel's back are invalidated explicitly.
pub const LONG_TTL: Duration = Duration::from_secs(3600);
/// Lifetime of namespace attributes (their mtime and size change as entries come and go).
pub const DIR_ATTR_TTL: Duration = Duration::from_secs(1);

/// One open file handle.
#[derive(Debug, Clone)]
pub struct Handle {
    /// The node.
    pub ino: u64,
    /// Opened for writing.
    pub writable: bool,
    /// How it is served.
    pub opened: OpenedFile,
    /// The process that opened it.
    pub tgid: i32,
}

/// The filesystem.
pub struct Fs<B: Backend> {
    backend: B,
    handles: Mutex<HashMap<u64, Handle>>,
    /// Open writable handles per WRITING inode.
    writers: Mutex<HashMap<u64, u32>>,
    next_fh: AtomicU64,
}

impl<B: Backend> Fs<B> {
    /// Wraps a backend.
    pub fn new(backend: B) -> Self {
        Fs {
            backend,
            handles: Mutex::new(HashMap::new()),
            writers: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
        }
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// (attribute TTL, entry TTL) for a node.
    pub fn ttls(attr: &Attr) -> (Duration, Duration) {
        match (attr.kind, attr.sealed) {
            (Kind::Dir, _) => (DIR_ATTR_TTL, LONG_TTL),
            (Kind::File, true) => (LONG_TTL, LONG_TTL),
            // Being written: always ask, so other processes never see it early.
            (Kind::File, false) => (Duration::ZERO, Duration::ZERO),
        }
    }

    /// Looks a name up.
    pub fn lookup(&self, c: &Caller, parent: u64, name: &str) -> Result<Attr> {
        check_name(name)?;
        self.backend.lookup(c, parent, name)
    }

    /// Attributes.
    pub fn getattr(&self, ino: u64) -> Result<Attr> {
        self.backend.getattr(ino)
    }

    /// Lists a directory (`.` and `..` included).
    pub fn readdir(&self, c: &Caller, ino: u64) -> Result<Vec<DirEntry>> {
        let mut v = vec![
            DirEntry {
                ino,
                name: ".".into(),
                kind: Kind::Dir,
            },
            DirEntry {
                ino,
                name: "..".into(),
                kind: Kind::Dir,
            },
        ];
        v.extend(self.backend.readdir(c, ino)?);
        Ok(v)
    }

    /// Creates a namespace.
    pub fn mkdir(&self, c: &Caller, parent: u64, name: &str, mode: u32) -> Result<Attr> {
        check_name(name)?;
        self.backend.mkdir(c, parent, name, mode)
    }

    /// Removes an empty namespace.
    pub fn rmdir(&self, c: &Caller, parent: u64, name: &str) -> Result<()> {
        check_name(name)?;
        self.backend.rmdir(c, parent, name)
    }

    fn new_handle(&self, h: Handle) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        if h.writable {
            *self.writers.lock().entry(h.ino).or_insert(0) += 1;
        }
        self.handles.lock().insert(fh, h);
        fh
    }

    /// Creates an entry being written; returns its attributes and a writable handle.
    pub fn create(
        &self,
        c: &Caller,
        parent: u64,
        name: &str,
        mode: u32,
    ) -> Result<(Attr, u64, OpenedFile)> {
        check_name(name)?;
        let (attr, opened) = self.backend.create(c, parent, name, mode)?;
        let fh = self.new_handle(Handle {
            ino: attr.ino,
            writable: true,
            opened: opened.clone(),
            tgid: c.tgid(),
        });
        Ok((attr, fh, opened))
    }

    /// Opens a node.
    pub fn open(
        &self,
        c: &Caller,
        ino: u64,
        write: bool,
        truncate: bool,
    ) -> Result<(u64, OpenedFile)> {
        let opened = self.backend.open(c, ino, write)?;
        if write && truncate {
            self.backend.truncate(ino, 0)?;
        }
        let fh = self.new_handle(Handle {
            ino,
            writable: write,
            opened: opened.clone(),
            tgid: if write { c.tgid() } else { 0 },
        });
        Ok((fh, opened))
    }

    /// Opens read-only a sealed entry whose backing `file` the caller already holds: the
    /// backend's checks and bookkeeping of [`Fs::open`] without opening the file again.
    pub fn reopen(&self, c: &Caller, ino: u64, file: Arc<std::fs::File>) -> Result<u64> {
        self.backend.reopen(c, ino)?;
        Ok(self.new_handle(Handle {
            ino,
            writable: false,
            opened: OpenedFile::Passthrough(file),
            tgid: 0,
        }))
    }

    /// Number of open handles.
    #[cfg(test)]
    pub(crate) fn open_handles(&self) -> usize {
        self.handles.lock().len()
    }

    /// The handle `fh`.
    pub fn handle(&self, fh: u64) -> Result<Handle> {
        self.handles
            .lock()
            .get(&fh)
            .cloned()
            .ok_or_else(|| Error::from_errno(libc::EBADF))
    }

    /// `close(2)` of a descriptor (FLUSH; every close of every descriptor sends one). The
    /// kernel releases the handle (and the entry is published) asynchronously after the last
    /// descriptor and mapping of it are gone; closing a writable descriptor commits the entry
    /// as it stands ([`Backend::commit`]): the store checks now that it can be published, so
    /// that what can fail at publication fails here, as `close`'s return value.
    ///
    /// A writer killed by a signal closes its descriptors without meaning to: what it wrote is
    /// then abandoned, never published.
    pub fn flush(&self, c: &Caller, fh: u64) -> Result<()> {
        let h = self.handle(fh)?;
        if !h.writable {
            return Ok(());
        }
        let abandoned = crate::backend::killed_by_signal(c.pid);
        self.backend.commit(c, h.ino, abandoned)
    }

    fn drop_writer(&self, ino: u64) -> bool {
        let mut w = self.writers.lock();
        match w.get_mut(&ino) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            Some(_) => {
                w.remove(&ino);
                true
            }
            None => false,
        }
    }

    /// The kernel dropped handle `fh` (no descriptor nor mapping refers to it any more): the
    /// last writable handle of an entry being written publishes it. Returns the handle.
    pub fn release(&self, fh: u64) -> Option<Handle> {
        let h = self.handles.lock().remove(&fh)?;
        // Only a copied read's open leased the entry: another read handle's release (a
        // writer's read-back, a passthrough) must not end that lease.
        if !h.writable && matches!(h.opened, OpenedFile::Copy) {
            self.backend.close(h.ino);
        }
        if h.writable
            && self.drop_writer(h.ino)
            && let Err(e) = self.backend.seal(h.ino)
        {
            tracing::warn!(ino = h.ino, "sealing at release: {e}");
        }
        Some(h)
    }

    /// A handle of a create whose reply the kernel never got (the caller's open failed):
    /// released, and the entry it created dropped unpublished when no other handle writes it
    /// (names are write-once: a published empty entry would refuse every retry). Returns
    /// the handle.
    pub fn abandon(&self, fh: u64) -> Option<Handle> {
        let h = self.handles.lock().remove(&fh)?;
        if h.writable && self.drop_writer(h.ino) {
            self.backend.abort(h.ino);
        }
        Some(h)
    }

    /// Reads through the daemon (entries served by copying, entries being written).
    pub fn read(&self, fh: u64, offset: u64, size: u32) -> Result<Vec<u8>> {
        let h = self.handle(fh)?;
        self.backend.read(h.ino, offset, size)
    }

    /// Writes through the daemon: a `write(2)` on a writable handle, or pages of a mapping
    /// written back (the kernel then names any writable handle of the inode). All of `data`
    /// or an error, never a short count (the store's contract; a short count from it is
    /// reported as EIO).
    pub fn write(&self, fh: u64, offset: u64, data: &[u8]) -> Result<u32> {
        let h = self.handle(fh)?;
        if !h.writable {
            return Err(Error::from_errno(libc::EBADF));
        }
        let n = self.backend.write(h.ino, offset, data)?;
        if n as usize != data.len() {
            tracing::warn!(
                ino = h.ino,
                n,
                len = data.len(),
                "short write from the store"
            );
            return Err(Error::from_errno(libc::EIO));
        }
        Ok(n)
    }

    /// `setattr`: size (entries being written) and mode/owner.
    pub fn setattr(
        &self,
        c: &Caller,
        ino: u64,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
    ) -> Result<Attr> {
        let mut attr = None;
        if let Some(s) = size {
            attr = Some(self.backend.truncate(ino, s)?);
        }
        if mode.is_some() || uid.is_some() || gid.is_some() {
            attr = Some(self.backend.chmod_chown(c, ino, mode, uid, gid)?);
        }
        match attr {
            Some(a) => Ok(a),
            None => self.backend.getattr(ino),
        }
    }

    /// `fallocate` mode 0 on a writable handle: the store reserves pool space for the range
    /// of the entry being written, growing it if the range ends past its size
    /// ([`Backend::fallocate`]). Other modes (punching holes, keeping the size) are not
    /// supported.
    pub fn fallocate(&self, fh: u64, offset: u64, len: u64, mode: i32) -> Result<()> {
        let h = self.handle(fh)?;
        if !h.writable {
            return Err(Error::from_errno(libc::EBADF));
        }
        if mode != 0 {
            return Err(Error::Unsupported("fallocate modes other than 0".into()));
        }
        if offset.checked_add(len).is_none() {
            return Err(Error::InvalidArgument("range overflows".into()));
        }
        self.backend.fallocate(h.ino, offset, len)
    }

    /// Deletes an entry.
    pub fn unlink(&self, c: &Caller, parent: u64, name: &str) -> Result<()> {
        check_name(name)?;
        self.backend.unlink(c, parent, name)
    }

    /// Renames an entry.
    pub fn rename(
        &self,
        c: &Caller,
        parent: u64,
        name: &str,
        newparent: u64,
        newname: &str,
    ) -> Result<()> {
        check_name(name)?;
        check_name(newname)?;
        self.backend.rename(c, parent, name, newparent, newname)
    }

    /// (total, free, entries).
    pub fn statfs(&self) -> (u64, u64, u64) {
        self.backend.statfs()
    }

    /// `getxattr` of a `user.maru.*` name.
    pub fn getxattr(&self, ino: u64, name: &str) -> Result<Vec<u8>> {
        let short = name
            .strip_prefix("user.maru.")
            .ok_or_else(|| Error::from_errno(libc::ENODATA))?;
        self.backend
            .xattrs(ino)?
            .into_iter()
            .find(|x| x.name == short)
            .map(|x| x.value.into_bytes())
            .ok_or_else(|| Error::from_errno(libc::ENODATA))
    }

    /// `listxattr`: NUL-separated names.
    pub fn listxattr(&self, ino: u64) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        for Xattr { name, .. } in self.backend.xattrs(ino)? {
            out.extend_from_slice(b"user.maru.");
            out.extend_from_slice(name.as_bytes());
            out.push(0);
        }
        Ok(out)
    }

    /// `setxattr`: only `user.maru.pinned` (0 or 1) is writable.
    pub fn setxattr(&self, c: &Caller, ino: u64, name: &str, value: &[u8]) -> Result<()> {
        if name != "user.maru.pinned" {
            return Err(if name.starts_with("user.maru.") {
                Error::PermissionDenied(format!("{name} is read-only"))
            } else {
                Error::Unsupported(format!("xattr {name}"))
            });
        }
        let pinned = match value {
            b"1" | b"true" | b"1\n" => true,
            b"0" | b"false" | b"0\n" | b"" => false,
            _ => {
                return Err(Error::InvalidArgument(
                    "user.maru.pinned takes 0 or 1".into(),
                ));
            }
        };
        self.backend.set_pinned(c, ino, pinned)
    }
}

fn check_name(name: &str) -> Result<()> {
    maru::name::check_component(name.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Call, Rec};

    #[test]
    fn seals_once_at_last_writable_close() {
        let fs = Fs::new(Rec::default());
        let c = Caller::root();
        let (a, fh1, _) = fs.create(&c, 1, "k", 0o644).unwrap();
        let (fh2, _) = fs.open(&c, a.ino, true, false).unwrap();
        let (fh3, _) = fs.open(&c, a.ino, false, false).unwrap();
        fs.flush(&c, fh3).unwrap();
        fs.flush(&c, fh1).unwrap();
        assert_eq!(fs.backend().seals(), 0);
        fs.release(fh1);
        fs.flush(&c, fh2).unwrap();
        assert_eq!(fs.backend().seals(), 0);
        fs.release(fh2);
        assert_eq!(fs.backend().seals(), 1);
        fs.release(fh3);
        assert_eq!(fs.backend().seals(), 1);
    }

    #[test]
    fn release_seals() {
        let fs = Fs::new(Rec::default());
        let (_, fh, _) = fs.create(&Caller::root(), 1, "k", 0o644).unwrap();
        fs.release(fh);
        assert_eq!(fs.backend().seals(), 1);
        assert!(fs.read(fh, 0, 1).is_err());
    }

    #[test]
    fn flush_of_a_writable_handle_returns_the_commit() {
        let fs = Fs::new(Rec::default());
        let c = Caller::new(1000, 1000, std::process::id() as i32);
        let (a, w, _) = fs.create(&c, 1, "k", 0o644).unwrap();
        let (r, _) = fs.open(&c, a.ino, false, false).unwrap();
        fs.flush(&c, w).unwrap();
        fs.backend().fail_commits(libc::ENOSPC);
        assert_eq!(fs.flush(&c, w).unwrap_err().errno(), libc::ENOSPC);
        // A read-only handle commits nothing.
        fs.flush(&c, r).unwrap();
        let commits: Vec<_> = fs
            .backend()
            .calls()
            .into_iter()
            .filter(|x| matches!(x, Call::Commit { .. }))
            .collect();
        // The test process is alive: nothing abandoned.
        let commit = Call::Commit {
            ino: a.ino,
            abandoned: false,
        };
        assert_eq!(commits, vec![commit.clone(), commit]);
        assert_eq!(fs.flush(&c, 999).unwrap_err().errno(), libc::EBADF);
    }

    #[test]
    fn fallocate_goes_to_the_store() {
        let fs = Fs::new(Rec::serving(OpenedFile::Writing(None)));
        let c = Caller::root();
        let (a, w, _) = fs.create(&c, 1, "k", 0o644).unwrap();
        let (r, _) = fs.open(&c, a.ino, false, false).unwrap();
        fs.fallocate(w, 4096, 1 << 20, 0).unwrap();
        assert!(fs.backend().calls().contains(&Call::Fallocate {
            ino: a.ino,
            offset: 4096,
            len: 1 << 20,
        }));
        let keep_size = libc::FALLOC_FL_KEEP_SIZE;
        assert_eq!(
            fs.fallocate(w, 0, 1, keep_size).unwrap_err().errno(),
            libc::EOPNOTSUPP
        );
        assert_eq!(fs.fallocate(r, 0, 1, 0).unwrap_err().errno(), libc::EBADF);
        assert_eq!(
            fs.fallocate(w, u64::MAX, 2, 0).unwrap_err().errno(),
            libc::EINVAL
        );
    }

    #[test]
    fn writes_are_whole_or_fail() {
        let fs = Fs::new(Rec::serving(OpenedFile::Writing(None)));
        let c = Caller::root();
        let (a, w, _) = fs.create(&c, 1, "k", 0o644).unwrap();
        let (r, _) = fs.open(&c, a.ino, false, false).unwrap();
        assert_eq!(fs.write(w, 0, b"abc").unwrap(), 3);
        assert_eq!(fs.write(r, 0, b"abc").unwrap_err().errno(), libc::EBADF);
        fs.backend().short_writes();
        assert_eq!(fs.write(w, 0, b"abc").unwrap_err().errno(), libc::EIO);
    }

    #[test]
    fn names_and_xattrs() {
        let fs = Fs::new(Rec::default());
        let long = "x".repeat(256);
        assert_eq!(
            fs.lookup(&Caller::root(), 1, &long).unwrap_err().errno(),
            libc::ENAMETOOLONG
        );
        assert_eq!(fs.getxattr(2, "user.maru.state").unwrap(), b"writing");
        assert_eq!(
            fs.getxattr(2, "user.other").unwrap_err().errno(),
            libc::ENODATA
        );
        assert_eq!(fs.listxattr(2).unwrap(), b"user.maru.state\0");
        assert!(
            fs.setxattr(&Caller::root(), 2, "user.maru.state", b"x")
                .is_err()
        );
        assert!(
            fs.setxattr(&Caller::root(), 2, "user.maru.pinned", b"2")
                .is_err()
        );
        fs.setxattr(&Caller::root(), 2, "user.maru.pinned", b"1")
            .unwrap();
    }
}
