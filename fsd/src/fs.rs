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

    /// The handle `fh`.
    pub fn handle(&self, fh: u64) -> Result<Handle> {
        self.handles
            .lock()
            .get(&fh)
            .cloned()
            .ok_or_else(|| Error::from_errno(libc::EBADF))
    }

    /// `close(2)` of a descriptor. The kernel releases the handle (and the entry is
    /// published) asynchronously after the last descriptor and mapping of it are gone; a
    /// close of a writable descriptor tells the store that publication is near, so that
    /// other processes looking the name up wait for it instead of missing it.
    ///
    /// A writer killed by a signal closes its descriptors without meaning to: what it wrote is
    /// then abandoned, never published.
    pub fn flush(&self, c: &Caller, fh: u64) -> Result<()> {
        let h = self.handle(fh)?;
        if h.writable {
            let abandoned = crate::backend::killed_by_signal(c.pid);
            self.backend.closing(h.ino, abandoned);
        }
        Ok(())
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
        if !h.writable {
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

    /// Reads through the daemon (copy-served entries).
    pub fn read(&self, fh: u64, offset: u64, size: u32) -> Result<Vec<u8>> {
        let h = self.handle(fh)?;
        self.backend.read(h.ino, offset, size)
    }

    /// Writes through the daemon (copy-served entries).
    pub fn write(&self, fh: u64, offset: u64, data: &[u8]) -> Result<u32> {
        let h = self.handle(fh)?;
        if !h.writable {
            return Err(Error::from_errno(libc::EBADF));
        }
        self.backend.write(h.ino, offset, data)
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

    /// `fallocate`: grows an entry being written.
    pub fn fallocate(&self, fh: u64, offset: u64, len: u64, mode: i32) -> Result<()> {
        let h = self.handle(fh)?;
        if !h.writable {
            return Err(Error::from_errno(libc::EBADF));
        }
        if mode != 0 {
            return Err(Error::Unsupported("fallocate modes other than 0".into()));
        }
        let a = self.backend.getattr(h.ino)?;
        let end = offset
            .checked_add(len)
            .ok_or_else(|| Error::InvalidArgument("range overflows".into()))?;
        if end > a.size {
            match &h.opened {
                OpenedFile::Passthrough(f) => {
                    self.backend.make_room(h.ino, end - a.size);
                    use std::os::fd::AsRawFd;
                    // SAFETY: plain syscall on a descriptor the handle owns.
                    let r = unsafe { libc::fallocate(f.as_raw_fd(), 0, offset as i64, len as i64) };
                    if r != 0 {
                        return Err(Error::Io(std::io::Error::last_os_error()));
                    }
                }
                OpenedFile::Copy => {
                    self.backend.truncate(h.ino, end)?;
                }
            }
        }
        Ok(())
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
    use std::sync::atomic::AtomicU32;
    use std::time::SystemTime;

    /// A backend that records seals; enough to test handle bookkeeping.
    #[derive(Default)]
    struct Rec {
        seals: AtomicU32,
    }

    fn attr(ino: u64, sealed: bool) -> Attr {
        Attr {
            ino,
            kind: Kind::File,
            size: 0,
            mode: 0o644,
            uid: 0,
            gid: 0,
            mtime: SystemTime::UNIX_EPOCH,
            sealed,
        }
    }

    impl Backend for Rec {
        fn lookup(&self, _: &Caller, _: u64, _: &str) -> Result<Attr> {
            Err(Error::NotFound("x".into()))
        }
        fn getattr(&self, ino: u64) -> Result<Attr> {
            Ok(attr(ino, false))
        }
        fn readdir(&self, _: &Caller, _: u64) -> Result<Vec<DirEntry>> {
            Ok(vec![])
        }
        fn mkdir(&self, _: &Caller, _: u64, _: &str, _: u32) -> Result<Attr> {
            unreachable!()
        }
        fn rmdir(&self, _: &Caller, _: u64, _: &str) -> Result<()> {
            unreachable!()
        }
        fn create(&self, _: &Caller, _: u64, _: &str, _: u32) -> Result<(Attr, OpenedFile)> {
            Ok((attr(7, false), OpenedFile::Copy))
        }
        fn open(&self, _: &Caller, _: u64, _: bool) -> Result<OpenedFile> {
            Ok(OpenedFile::Copy)
        }
        fn seal(&self, _: u64) -> Result<()> {
            self.seals.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        fn abort(&self, _: u64) {}
        fn truncate(&self, ino: u64, _: u64) -> Result<Attr> {
            Ok(attr(ino, false))
        }
        fn chmod_chown(
            &self,
            _: &Caller,
            ino: u64,
            _: Option<u32>,
            _: Option<u32>,
            _: Option<u32>,
        ) -> Result<Attr> {
            Ok(attr(ino, false))
        }
        fn read(&self, _: u64, _: u64, _: u32) -> Result<Vec<u8>> {
            Ok(vec![])
        }
        fn write(&self, _: u64, _: u64, d: &[u8]) -> Result<u32> {
            Ok(d.len() as u32)
        }
        fn unlink(&self, _: &Caller, _: u64, _: &str) -> Result<()> {
            Ok(())
        }
        fn rename(&self, _: &Caller, _: u64, _: &str, _: u64, _: &str) -> Result<()> {
            Ok(())
        }
        fn statfs(&self) -> (u64, u64, u64) {
            (0, 0, 0)
        }
        fn xattrs(&self, _: u64) -> Result<Vec<Xattr>> {
            Ok(vec![Xattr {
                name: "state",
                value: "writing".into(),
            }])
        }
        fn set_pinned(&self, _: &Caller, _: u64, _: bool) -> Result<()> {
            Ok(())
        }
    }

    #[test]
    fn seals_once_at_last_writable_close() {
        let fs = Fs::new(Rec::default());
        let c = Caller::root();
        let (a, fh1, _) = fs.create(&c, 1, "k", 0o644).unwrap();
        let (fh2, _) = fs.open(&c, a.ino, true, false).unwrap();
        let (fh3, _) = fs.open(&c, a.ino, false, false).unwrap();
        fs.flush(&c, fh3).unwrap();
        fs.flush(&c, fh1).unwrap();
        assert_eq!(fs.backend().seals.load(Ordering::SeqCst), 0);
        fs.release(fh1);
        fs.flush(&c, fh2).unwrap();
        assert_eq!(fs.backend().seals.load(Ordering::SeqCst), 0);
        fs.release(fh2);
        assert_eq!(fs.backend().seals.load(Ordering::SeqCst), 1);
        fs.release(fh3);
        assert_eq!(fs.backend().seals.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn release_seals() {
        let fs = Fs::new(Rec::default());
        let (_, fh, _) = fs.create(&Caller::root(), 1, "k", 0o644).unwrap();
        fs.release(fh);
        assert_eq!(fs.backend().seals.load(Ordering::SeqCst), 1);
        assert!(fs.read(fh, 0, 1).is_err());
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
