//! The fuser adapter: translates kernel requests to [`crate::fs::Fs`] and replies.
//! Passthrough backing ids live here (one per inode, shared by its handles).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use fuser::{
    AccessFlags, BackingId, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags,
    Generation, INodeNo, InitFlags, KernelConfig, LockOwner, OpenFlags, RenameFlags, ReplyAttr,
    ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs,
    ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use maru::Error;
use parking_lot::Mutex;

use crate::backend::{Attr, Backend, Caller, Kind, OpenedFile, Upcall};
use crate::fs::Fs;

/// Most idle backing ids kept for fast reopening of sealed entries.
const IDLE_BACKINGS: usize = 1024;

/// A passthrough backing id registered with the kernel: through fuser's channel (requests
/// served by fuser) or through our own descriptor of the connection (requests served over
/// io_uring, see [`crate::ring`]). Dropping it unregisters it.
pub(crate) enum Backing {
    /// Registered by fuser.
    Fuser(BackingId),
    /// Registered with `FUSE_DEV_IOC_BACKING_OPEN` on `dev`.
    Raw { id: u32, dev: Arc<OwnedFd> },
}

/// `FUSE_DEV_IOC_BACKING_CLOSE`: `_IOW(229, 2, uint32_t)`.
const FUSE_DEV_IOC_BACKING_CLOSE: libc::c_ulong = 0x4004_e502;

impl Drop for Backing {
    fn drop(&mut self) {
        if let Backing::Raw { id, dev } = self {
            // SAFETY: the ioctl reads one u32 that lives for the call.
            let r = unsafe {
                libc::ioctl(
                    dev.as_raw_fd(),
                    FUSE_DEV_IOC_BACKING_CLOSE,
                    id as *const u32,
                )
            };
            if r != 0 {
                tracing::debug!(
                    "closing backing id {id}: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    }
}

/// An inode's registered backing.
struct Registered {
    backing: Backing,
    /// Open handles using it.
    open: u32,
    /// Reusable after the last close (a sealed entry).
    keep: bool,
    /// The backing file, so that reopening a sealed entry opens nothing in the pool.
    file: Arc<std::fs::File>,
}

/// Passthrough backing ids by inode.
#[derive(Default)]
pub struct Backings {
    map: Mutex<HashMap<u64, Registered>>,
}

impl Backings {
    /// Forgets an inode's idle backing id (its entry was deleted, evicted or renamed), so the
    /// kernel drops its reference to the backing file.
    pub fn forget(&self, ino: u64) {
        let mut m = self.map.lock();
        if m.get(&ino).is_some_and(|r| r.open == 0) {
            m.remove(&ino);
        } else if let Some(r) = m.get_mut(&ino) {
            r.keep = false;
        }
    }
}

/// Block size reported by stat.
pub(crate) const BLKSIZE: u32 = 4096;

/// How the connection's requests travel, as negotiated at INIT.
#[derive(Default)]
pub(crate) struct Transport {
    /// Ask the kernel for FUSE over io_uring at INIT (set once the rings exist).
    pub(crate) want_uring: AtomicBool,
    /// INIT is done.
    pub(crate) init_done: AtomicBool,
    /// The kernel agreed to io_uring.
    pub(crate) uring: AtomicBool,
}

/// The mounted filesystem. Cheap handles to one shared state ([`FuseFs::share`]): fuser's
/// session owns one, the io_uring queue threads another.
pub struct FuseFs<B: Backend> {
    pub(crate) fs: Arc<Fs<B>>,
    pub(crate) backing: Arc<Backings>,
    pub(crate) passthrough: Arc<AtomicBool>,
    pub(crate) transport: Arc<Transport>,
}

impl<B: Backend> FuseFs<B> {
    /// The backing-id table, for the store's invalidations.
    pub fn backings(&self) -> Arc<Backings> {
        self.backing.clone()
    }

    /// Wraps the filesystem logic.
    pub fn new(fs: Fs<B>) -> Self {
        FuseFs {
            fs: Arc::new(fs),
            backing: Arc::new(Backings::default()),
            passthrough: Arc::new(AtomicBool::new(false)),
            transport: Arc::new(Transport::default()),
        }
    }

    /// Whether the kernel agreed, at INIT, to send requests over io_uring.
    pub fn uses_uring(&self) -> bool {
        self.transport.uring.load(Ordering::Acquire)
    }

    /// Another handle to the same filesystem.
    pub fn share(&self) -> Self {
        FuseFs {
            fs: self.fs.clone(),
            backing: self.backing.clone(),
            passthrough: self.passthrough.clone(),
            transport: self.transport.clone(),
        }
    }
}

pub(crate) fn errno(e: &Error) -> Errno {
    match e.errno() {
        libc::ENOENT | libc::EEXIST | libc::ENOTEMPTY | libc::ENODATA => {
            tracing::debug!("{e}")
        }
        libc::EIO => tracing::warn!("{e}"),
        _ => tracing::debug!("{e}"),
    }
    Errno::from_i32(e.errno())
}

fn caller(req: &Request, groups: bool) -> Caller {
    caller_of(req.uid(), req.gid(), req.pid(), groups)
}

/// The caller of a request; `groups`: look its supplementary groups up (permission checks).
pub(crate) fn caller_of(uid: u32, gid: u32, pid: u32, groups: bool) -> Caller {
    if groups {
        Caller::with_groups(uid, gid, pid as i32)
    } else {
        Caller::new(uid, gid, pid as i32)
    }
}

fn file_attr(a: &Attr) -> FileAttr {
    let (kind, nlink) = match a.kind {
        Kind::Dir => (FileType::Directory, 2),
        Kind::File => (FileType::RegularFile, 1),
    };
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.size.div_ceil(512),
        atime: a.mtime,
        mtime: a.mtime,
        ctime: a.mtime,
        crtime: a.mtime,
        kind,
        perm: (a.mode & 0o7777) as u16,
        nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: 0,
        blksize: BLKSIZE,
        flags: 0,
    }
}

/// What an open or a create hands back to the kernel.
pub(crate) struct Opened {
    /// File handle.
    pub(crate) fh: u64,
    /// `FOPEN_*` flags.
    pub(crate) flags: FopenFlags,
    /// Serve read, write and mmap from the inode's backing file (passthrough).
    pub(crate) passthrough: bool,
    /// The backing id registered over the ring's descriptor, when the open already found it
    /// (a kept entry), so that the reply needs no second look at the backings.
    pub(crate) raw_id: Option<u32>,
}

pub(crate) fn name_str(name: &OsStr) -> Result<&str, Errno> {
    name.to_str().ok_or(Errno::EINVAL)
}

impl<B: Backend> FuseFs<B> {
    /// Counts one upcall and enters its span (`fuse{op, pid}`, at debug level).
    fn enter(&self, op: Upcall, req: &Request) -> tracing::span::EnteredSpan {
        self.enter_pid(op, req.pid())
    }

    /// [`Self::enter`] for a request seen by pid.
    pub(crate) fn enter_pid(&self, op: Upcall, pid: u32) -> tracing::span::EnteredSpan {
        self.fs.backend().count_upcall(op);
        tracing::debug_span!("fuse", op = op.name(), pid).entered()
    }

    /// Opens `ino` for `flags` (`open(2)` flags); with passthrough, the inode's backing id is
    /// registered (or reused) with `register`.
    pub(crate) fn open_common(
        &self,
        c: &Caller,
        ino: u64,
        flags: i32,
        register: impl FnOnce(&std::fs::File) -> std::io::Result<Backing>,
    ) -> Result<Opened, Errno> {
        let write = (flags & libc::O_ACCMODE) != libc::O_RDONLY;
        let trunc = flags & libc::O_TRUNC != 0;
        // A sealed entry whose backing is still registered (the common open of a hot key):
        // its file and backing id are at hand, only the store's checks and bookkeeping remain
        // (no path walk in the pool, one look at the backings).
        if !write && let Some((file, raw_id)) = self.reuse_kept(ino) {
            return match self.fs.reopen(c, ino, file) {
                Ok(fh) => Ok(Opened {
                    fh,
                    flags: FopenFlags::FOPEN_NOFLUSH,
                    passthrough: true,
                    raw_id,
                }),
                Err(e) => {
                    self.put_backing(ino, true);
                    Err(errno(&e))
                }
            };
        }
        let (fh, opened) = self.fs.open(c, ino, write, trunc).map_err(|e| errno(&e))?;
        let fl = if write {
            FopenFlags::empty()
        } else {
            FopenFlags::FOPEN_NOFLUSH
        };
        let passthrough = self.attach_backing(ino, fh, &opened, register)?;
        if passthrough && !write {
            self.keep_backing(ino);
        }
        Ok(Opened {
            fh,
            flags: fl,
            passthrough,
            raw_id: None,
        })
    }

    /// Creates `name` in `parent` and opens it for writing (see [`Self::open_common`]).
    pub(crate) fn create_common(
        &self,
        c: &Caller,
        parent: u64,
        name: &str,
        mode: u32,
        register: impl FnOnce(&std::fs::File) -> std::io::Result<Backing>,
    ) -> Result<(Attr, Opened), Errno> {
        let (a, fh, opened) = self
            .fs
            .create(c, parent, name, mode)
            .map_err(|e| errno(&e))?;
        let passthrough = self.attach_backing(a.ino, fh, &opened, register)?;
        Ok((
            a,
            Opened {
                fh,
                flags: FopenFlags::empty(),
                passthrough,
                raw_id: None,
            },
        ))
    }

    /// For a passthrough handle `fh` of `ino`, takes (or registers with `register`) the
    /// inode's backing id; returns whether the handle is passthrough. On failure the handle
    /// is released.
    fn attach_backing(
        &self,
        ino: u64,
        fh: u64,
        opened: &OpenedFile,
        register: impl FnOnce(&std::fs::File) -> std::io::Result<Backing>,
    ) -> Result<bool, Errno> {
        match opened {
            OpenedFile::Passthrough(f) if self.passthrough.load(Ordering::Relaxed) => {
                if let Err(e) = self.with_backing(ino, f, register) {
                    self.fs.release(fh);
                    return Err(Errno::from(e));
                }
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// The fuser-registered backing of `ino`, for the reply to an open or create served by
    /// fuser. Without one (it cannot happen while fuser serves the opens), releases `fh`:
    /// EIO.
    fn fuser_backing(
        &self,
        ino: u64,
        fh: u64,
    ) -> Result<parking_lot::MappedMutexGuard<'_, BackingId>, Errno> {
        let m = self.backing.map.lock();
        let found = parking_lot::MutexGuard::try_map(m, |m| match m.get_mut(&ino) {
            Some(Registered {
                backing: Backing::Fuser(id),
                ..
            }) => Some(id),
            _ => None,
        });
        found.map_err(|m| {
            drop(m);
            self.release_common(ino, fh);
            Errno::EIO
        })
    }

    /// One more use of the kept backing of `ino` (a sealed entry opened before, see
    /// [`Self::put_backing`]): its file and, when registered over a ring's descriptor, its
    /// backing id; or None.
    fn reuse_kept(&self, ino: u64) -> Option<(Arc<std::fs::File>, Option<u32>)> {
        let mut m = self.backing.map.lock();
        let r = m.get_mut(&ino).filter(|r| r.keep)?;
        r.open += 1;
        let raw = match &r.backing {
            Backing::Raw { id, .. } => Some(*id),
            Backing::Fuser(_) => None,
        };
        Some((r.file.clone(), raw))
    }

    /// `statfs` counts in [`BLKSIZE`] blocks: blocks, free, available, files, free files
    /// (names are not a limited resource). Names are at most 255 bytes.
    pub(crate) fn statfs_counts(&self) -> [u64; 5] {
        let (total, free, files) = self.fs.statfs();
        let bs = u64::from(BLKSIZE);
        [total / bs, free / bs, free / bs, files, u64::MAX / 2]
    }

    /// Runs `f` with the backing registered for `ino` (after an open or create).
    pub(crate) fn backing_of<R>(&self, ino: u64, f: impl FnOnce(&Backing) -> R) -> Option<R> {
        self.backing.map.lock().get(&ino).map(|r| f(&r.backing))
    }

    /// A handle is gone: releases it and puts its backing id back.
    pub(crate) fn release_common(&self, ino: u64, fh: u64) {
        if let Some(h) = self.fs.release(fh)
            && matches!(h.opened, OpenedFile::Passthrough(_))
        {
            self.put_backing(ino, !h.writable);
        }
    }

    fn reply_entry(&self, reply: ReplyEntry, r: maru::Result<Attr>) {
        match r {
            Ok(a) => {
                let (attr_ttl, entry_ttl) = Fs::<B>::ttls(&a);
                reply.entry_with_ttls(&attr_ttl, &entry_ttl, &file_attr(&a), Generation(0));
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn reply_attr(&self, reply: ReplyAttr, r: maru::Result<Attr>) {
        match r {
            Ok(a) => reply.attr(&Fs::<B>::ttls(&a).0, &file_attr(&a)),
            Err(e) => reply.error(errno(&e)),
        }
    }

    /// Takes (or registers with `open`) the inode's backing id for one more handle.
    fn with_backing(
        &self,
        ino: u64,
        file: &Arc<std::fs::File>,
        open: impl FnOnce(&std::fs::File) -> std::io::Result<Backing>,
    ) -> std::io::Result<()> {
        let mut m = self.backing.map.lock();
        if let Some(r) = m.get_mut(&ino) {
            r.open += 1;
            return Ok(());
        }
        let id = open(file)?;
        m.insert(
            ino,
            Registered {
                backing: id,
                open: 1,
                keep: false,
                file: file.clone(),
            },
        );
        Ok(())
    }

    /// A handle is gone. Backing ids of sealed entries stay registered (idle) so that the
    /// next open of the same entry skips re-registering; entries being written drop theirs.
    fn put_backing(&self, ino: u64, keep: bool) {
        let mut m = self.backing.map.lock();
        if let Some(r) = m.get_mut(&ino) {
            r.open -= 1;
            if r.open == 0 {
                if keep && r.keep {
                    if m.len() > IDLE_BACKINGS {
                        m.retain(|_, r| r.open > 0);
                    }
                } else {
                    m.remove(&ino);
                }
            }
        }
    }

    /// Marks an inode's backing id reusable (a sealed entry opened read-only).
    fn keep_backing(&self, ino: u64) {
        if let Some(r) = self.backing.map.lock().get_mut(&ino) {
            r.keep = true;
        }
    }
}

impl<B: Backend> Filesystem for FuseFs<B> {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        match config.add_capabilities(InitFlags::FUSE_PASSTHROUGH) {
            Ok(()) => {
                let _ = config.set_max_stack_depth(1);
                self.passthrough.store(true, Ordering::Relaxed);
                tracing::info!("FUSE passthrough enabled: mmap of memfs entries is zero-copy");
            }
            Err(_) => tracing::warn!(
                "the kernel lacks FUSE passthrough; memfs entries are served by copying"
            ),
        }
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS);
        // Entries never carry set-user-ID/set-group-ID bits nor file capabilities (the store
        // masks them), so there is never anything to kill on a write, truncate or chown:
        // saying so spares the kernel's GETXATTR of `security.capability` before every
        // `write(2)` (it then checks once per inode and attribute refresh).
        let _ = config.add_capabilities(InitFlags::FUSE_HANDLE_KILLPRIV_V2);
        if self.transport.want_uring.load(Ordering::Acquire) {
            // Every ring entry's payload buffer must hold the largest request or reply:
            // max(max_write, max_pages pages), so both are bounded to RING_PAYLOAD.
            let _ = config.set_max_write(crate::ring::RING_PAYLOAD as u32);
            if let Err(nearest) = config.set_max_readahead(crate::ring::RING_PAYLOAD as u32) {
                let _ = config.set_max_readahead(nearest);
            }
            match config.add_capabilities(InitFlags::FUSE_OVER_IO_URING) {
                Ok(()) => {
                    self.transport.uring.store(true, Ordering::Release);
                    tracing::info!("FUSE over io_uring: one request queue per CPU");
                }
                Err(_) => tracing::info!(
                    "the kernel does not offer FUSE over io_uring; requests go through /dev/fuse"
                ),
            }
        }
        self.transport.init_done.store(true, Ordering::Release);
        Ok(())
    }

    fn lookup(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let _span = self.enter(Upcall::Lookup, req);
        let name = match name_str(name) {
            Ok(n) => n,
            Err(e) => return reply.error(e),
        };
        self.reply_entry(reply, self.fs.lookup(&caller(req, false), parent.0, name));
    }

    fn getattr(&self, req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let _span = self.enter(Upcall::Getattr, req);
        self.reply_attr(reply, self.fs.getattr(ino.0));
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let _span = self.enter(Upcall::Setattr, req);
        let c = caller(req, true);
        self.reply_attr(reply, self.fs.setattr(&c, ino.0, mode, uid, gid, size));
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let _span = self.enter(Upcall::Mkdir, req);
        let name = match name_str(name) {
            Ok(n) => n,
            Err(e) => return reply.error(e),
        };
        let c = caller(req, true);
        self.reply_entry(reply, self.fs.mkdir(&c, parent.0, name, mode & !umask));
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _span = self.enter(Upcall::Unlink, req);
        let name = match name_str(name) {
            Ok(n) => n,
            Err(e) => return reply.error(e),
        };
        match self.fs.unlink(&caller(req, true), parent.0, name) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _span = self.enter(Upcall::Rmdir, req);
        let name = match name_str(name) {
            Ok(n) => n,
            Err(e) => return reply.error(e),
        };
        match self.fs.rmdir(&caller(req, true), parent.0, name) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn symlink(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _link: &OsStr,
        _target: &std::path::Path,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EPERM);
    }

    fn link(&self, _req: &Request, _ino: INodeNo, _np: INodeNo, _nn: &OsStr, reply: ReplyEntry) {
        reply.error(Errno::EPERM);
    }

    fn mknod(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EPERM);
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let _span = self.enter(Upcall::Rename, req);
        if flags.contains(RenameFlags::RENAME_EXCHANGE)
            || flags.contains(RenameFlags::RENAME_WHITEOUT)
        {
            return reply.error(Errno::EINVAL);
        }
        let (name, newname) = match (name_str(name), name_str(newname)) {
            (Ok(a), Ok(b)) => (a, b),
            _ => return reply.error(Errno::EINVAL),
        };
        match self
            .fs
            .rename(&caller(req, true), parent.0, name, newparent.0, newname)
        {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let _span = self.enter(Upcall::Open, req);
        let c = caller(req, false);
        let register = |file: &std::fs::File| reply.open_backing(file).map(Backing::Fuser);
        match self.open_common(&c, ino.0, flags.0, register) {
            Ok(o) if o.passthrough => match self.fuser_backing(ino.0, o.fh) {
                Ok(id) => reply.opened_passthrough(FileHandle(o.fh), o.flags, &id),
                Err(e) => reply.error(e),
            },
            Ok(o) => reply.opened(FileHandle(o.fh), o.flags),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let _span = self.enter(Upcall::Read, req);
        match self.fs.read(fh.0, offset, size) {
            Ok(d) => reply.data(&d),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn write(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _wf: WriteFlags,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let _span = self.enter(Upcall::Write, req);
        match self.fs.write(fh.0, offset, data) {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn flush(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _lock: LockOwner,
        reply: ReplyEmpty,
    ) {
        let _span = self.enter(Upcall::Flush, req);
        match self.fs.flush(&caller(req, false), fh.0) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn release(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let _span = self.enter(Upcall::Release, req);
        self.release_common(ino.0, fh.0);
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn opendir(&self, req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let _span = self.enter(Upcall::Opendir, req);
        match self.fs.getattr(ino.0) {
            Ok(a) if a.kind == Kind::Dir => reply.opened(FileHandle(0), FopenFlags::empty()),
            Ok(_) => reply.error(Errno::ENOTDIR),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn readdir(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let _span = self.enter(Upcall::Readdir, req);
        match self.fs.readdir(&caller(req, true), ino.0) {
            Ok(list) => {
                for (i, e) in list.iter().enumerate().skip(offset as usize) {
                    let kind = match e.kind {
                        Kind::Dir => FileType::Directory,
                        Kind::File => FileType::RegularFile,
                    };
                    if reply.add(INodeNo(e.ino), (i + 1) as u64, kind, &e.name) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn statfs(&self, req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let _span = self.enter(Upcall::Statfs, req);
        let [blocks, bfree, bavail, files, ffree] = self.statfs_counts();
        reply.statfs(blocks, bfree, bavail, files, ffree, BLKSIZE, 255, BLKSIZE);
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        _flags: i32,
        _pos: u32,
        reply: ReplyEmpty,
    ) {
        let _span = self.enter(Upcall::Setxattr, req);
        let name = match name_str(name) {
            Ok(n) => n,
            Err(e) => return reply.error(e),
        };
        match self.fs.setxattr(&caller(req, true), ino.0, name, value) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn getxattr(&self, req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let _span = self.enter(Upcall::Getxattr, req);
        let name = match name_str(name) {
            Ok(n) => n,
            Err(e) => return reply.error(e),
        };
        xattr_reply(reply, size, self.fs.getxattr(ino.0, name));
    }

    fn listxattr(&self, req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let _span = self.enter(Upcall::Listxattr, req);
        xattr_reply(reply, size, self.fs.listxattr(ino.0));
    }

    fn removexattr(&self, req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _span = self.enter(Upcall::Removexattr, req);
        let name = match name_str(name) {
            Ok(n) => n,
            Err(e) => return reply.error(e),
        };
        match self.fs.setxattr(&caller(req, true), ino.0, name, b"0") {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: AccessFlags, reply: ReplyEmpty) {
        // default_permissions: the kernel checks modes itself.
        reply.ok();
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let _span = self.enter(Upcall::Create, req);
        let name = match name_str(name) {
            Ok(n) => n,
            Err(e) => return reply.error(e),
        };
        let c = caller(req, true);
        let register = |file: &std::fs::File| reply.open_backing(file).map(Backing::Fuser);
        match self.create_common(&c, parent.0, name, mode & !umask & 0o7777, register) {
            Ok((a, o)) => {
                let ttl = Duration::ZERO;
                let fa = file_attr(&a);
                if !o.passthrough {
                    return reply.created(&ttl, &fa, Generation(0), FileHandle(o.fh), o.flags);
                }
                match self.fuser_backing(a.ino, o.fh) {
                    Ok(id) => reply.created_passthrough(
                        &ttl,
                        &fa,
                        Generation(0),
                        FileHandle(o.fh),
                        o.flags,
                        &id,
                    ),
                    Err(e) => reply.error(e),
                }
            }
            Err(e) => reply.error(e),
        }
    }

    fn fallocate(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let _span = self.enter(Upcall::Fallocate, req);
        match self.fs.fallocate(fh.0, offset, length, mode) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }
}

fn xattr_reply(reply: ReplyXattr, size: u32, r: maru::Result<Vec<u8>>) {
    match xattr_answer(size, r) {
        Ok(XattrAnswer::Size(n)) => reply.size(n),
        Ok(XattrAnswer::Data(v)) => reply.data(&v),
        Err(e) => reply.error(e),
    }
}

/// The answer to `getxattr`/`listxattr` with a buffer of `size` bytes.
pub(crate) enum XattrAnswer {
    /// The caller asked for the size (`size == 0`).
    Size(u32),
    /// The value, which fits.
    Data(Vec<u8>),
}

/// [`XattrAnswer`] for a value lookup `r`: ERANGE when it does not fit in `size`.
pub(crate) fn xattr_answer(size: u32, r: maru::Result<Vec<u8>>) -> Result<XattrAnswer, Errno> {
    match r {
        Ok(v) if size == 0 => Ok(XattrAnswer::Size(v.len() as u32)),
        Ok(v) if v.len() <= size as usize => Ok(XattrAnswer::Data(v)),
        Ok(_) => Err(Errno::ERANGE),
        Err(e) => Err(errno(&e)),
    }
}
