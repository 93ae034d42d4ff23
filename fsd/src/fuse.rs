//! The fuser adapter: each of fuser's callbacks becomes one [`Request`], served by
//! [`Server::dispatch`]; its [`Reply`] goes back through fuser's reply object. Passthrough
//! backing ids of requests fuser serves are registered through that reply object.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::Ordering;
use std::time::SystemTime;

use fuser::{
    AccessFlags, Errno, FileAttr, FileHandle, FileType, Filesystem, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr,
    TimeOrNow, WriteFlags,
};

use crate::backend::{Attr, Backend, Kind};
use crate::server::{
    BLKSIZE, BackingRef, Ids, Opened, RING_PAYLOAD, Registrar, Reply, Request, Server, XattrAnswer,
};

pub use crate::server::Backings;

/// The mounted filesystem, as fuser's session and the io_uring queues serve it.
pub type FuseFs<B> = Server<B>;

fn ids(req: &fuser::Request) -> Ids {
    Ids {
        uid: req.uid(),
        gid: req.gid(),
        pid: req.pid(),
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

/// The error of a reply that is not the kind the request expects: an error reply, or (a bug)
/// another kind, EIO.
fn error_of(r: Reply) -> Errno {
    match r {
        Reply::Err(e) => e,
        other => {
            tracing::error!("unexpected reply {other:?}");
            Errno::EIO
        }
    }
}

fn reply_entry(reply: ReplyEntry, r: Reply) {
    match r {
        Reply::Entry {
            attr,
            attr_ttl,
            entry_ttl,
        } => reply.entry_with_ttls(&attr_ttl, &entry_ttl, &file_attr(&attr), Generation(0)),
        r => reply.error(error_of(r)),
    }
}

fn reply_attr(reply: ReplyAttr, r: Reply) {
    match r {
        Reply::Attr { attr, ttl } => reply.attr(&ttl, &file_attr(&attr)),
        r => reply.error(error_of(r)),
    }
}

fn reply_empty(reply: ReplyEmpty, r: Reply) {
    match r {
        Reply::Empty => reply.ok(),
        r => reply.error(error_of(r)),
    }
}

fn reply_xattr(reply: ReplyXattr, r: Reply) {
    match r {
        Reply::Xattr(XattrAnswer::Size(n)) => reply.size(n),
        Reply::Xattr(XattrAnswer::Data(v)) => reply.data(&v),
        r => reply.error(error_of(r)),
    }
}

impl<B: Backend> Server<B> {
    /// The fuser-registered backing id to reply with for the passthrough handle `o` of `ino`.
    /// The handle's backing was registered through fuser ([`Registrar::Fuser`]); should it
    /// not be, the handle is withdrawn (a create's entry abandoned): EIO.
    fn fuser_id(
        &self,
        ino: u64,
        o: &Opened,
        created: bool,
    ) -> Result<parking_lot::MappedMutexGuard<'_, fuser::BackingId>, Errno> {
        let id = match o.backing {
            Some(BackingRef::Fuser) => self.fuser_backing(ino),
            _ => None,
        };
        id.ok_or_else(|| {
            tracing::error!(ino, "no fuser backing id for a passthrough handle");
            self.withdraw(o.fh, created);
            Errno::EIO
        })
    }
}

impl<B: Backend> Filesystem for Server<B> {
    fn init(&mut self, _req: &fuser::Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let t = self.transport();
        match config.add_capabilities(InitFlags::FUSE_PASSTHROUGH) {
            Ok(()) => {
                // Refused only above the kernel's limit (2): 1 always fits.
                let _ = config.set_max_stack_depth(1);
                t.passthrough.store(true, Ordering::Relaxed);
                tracing::info!("FUSE passthrough enabled: mmap of memfs entries is zero-copy");
            }
            Err(_) => tracing::warn!(
                "the kernel lacks FUSE passthrough; memfs entries are served by copying"
            ),
        }
        // Optional speed-ups below: a kernel without them serves the mount the same way.
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS);
        // Entries never carry set-user-ID/set-group-ID bits nor file capabilities (the store
        // masks them), so there is never anything to kill on a write, truncate or chown:
        // saying so spares the kernel's GETXATTR of `security.capability` before every
        // `write(2)` (it then checks once per inode and attribute refresh).
        let _ = config.add_capabilities(InitFlags::FUSE_HANDLE_KILLPRIV_V2);
        // Entries being written are served without the page cache (FOPEN_DIRECT_IO) so that
        // the store sees every write. memfs ones pass their mappings through to the pool;
        // a raw-pool one may still be mapped, the kernel then writing its dirty pages back
        // through WRITE requests (Linux 6.6+).
        if config
            .add_capabilities(InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP)
            .is_err()
        {
            tracing::warn!(
                "the kernel cannot map entries being written (FUSE_DIRECT_IO_ALLOW_MMAP)"
            );
        }
        if t.want_uring.load(Ordering::Acquire) {
            // Every ring entry's payload buffer must hold the largest request or reply:
            // max(max_write, max_pages pages), so both are bounded to RING_PAYLOAD.
            // Refused only above fuser's own maximum (16 MiB), far above 1 MiB.
            let _ = config.set_max_write(RING_PAYLOAD as u32);
            if let Err(nearest) = config.set_max_readahead(RING_PAYLOAD as u32) {
                let _ = config.set_max_readahead(nearest);
            }
            match config.add_capabilities(InitFlags::FUSE_OVER_IO_URING) {
                Ok(()) => {
                    t.uring.store(true, Ordering::Release);
                    tracing::info!("FUSE over io_uring: one request queue per CPU");
                }
                Err(_) => tracing::info!(
                    "the kernel does not offer FUSE over io_uring; requests go through /dev/fuse"
                ),
            }
        }
        t.init_done.store(true, Ordering::Release);
        Ok(())
    }

    fn lookup(&self, req: &fuser::Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let r = Request::Lookup {
            parent: parent.0,
            name: name.as_bytes(),
        };
        reply_entry(reply, self.dispatch(&r, ids(req), Registrar::None));
    }

    fn getattr(
        &self,
        req: &fuser::Request,
        ino: INodeNo,
        _fh: Option<FileHandle>,
        reply: ReplyAttr,
    ) {
        let r = Request::Getattr { ino: ino.0 };
        reply_attr(reply, self.dispatch(&r, ids(req), Registrar::None));
    }

    fn setattr(
        &self,
        req: &fuser::Request,
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
        let r = Request::Setattr {
            ino: ino.0,
            mode,
            uid,
            gid,
            size,
        };
        reply_attr(reply, self.dispatch(&r, ids(req), Registrar::None));
    }

    fn mkdir(
        &self,
        req: &fuser::Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let r = Request::Mkdir {
            parent: parent.0,
            name: name.as_bytes(),
            mode,
            umask,
        };
        reply_entry(reply, self.dispatch(&r, ids(req), Registrar::None));
    }

    fn unlink(&self, req: &fuser::Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let r = Request::Unlink {
            parent: parent.0,
            name: name.as_bytes(),
        };
        reply_empty(reply, self.dispatch(&r, ids(req), Registrar::None));
    }

    fn rmdir(&self, req: &fuser::Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let r = Request::Rmdir {
            parent: parent.0,
            name: name.as_bytes(),
        };
        reply_empty(reply, self.dispatch(&r, ids(req), Registrar::None));
    }

    fn symlink(
        &self,
        req: &fuser::Request,
        _parent: INodeNo,
        _link: &OsStr,
        _target: &std::path::Path,
        reply: ReplyEntry,
    ) {
        reply_entry(
            reply,
            self.dispatch(&Request::Link, ids(req), Registrar::None),
        );
    }

    fn link(
        &self,
        req: &fuser::Request,
        _ino: INodeNo,
        _newparent: INodeNo,
        _newname: &OsStr,
        reply: ReplyEntry,
    ) {
        reply_entry(
            reply,
            self.dispatch(&Request::Link, ids(req), Registrar::None),
        );
    }

    fn mknod(
        &self,
        req: &fuser::Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        reply_entry(
            reply,
            self.dispatch(&Request::Link, ids(req), Registrar::None),
        );
    }

    fn rename(
        &self,
        req: &fuser::Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let r = Request::Rename {
            parent: parent.0,
            name: name.as_bytes(),
            newparent: newparent.0,
            newname: newname.as_bytes(),
            flags: flags.bits(),
        };
        reply_empty(reply, self.dispatch(&r, ids(req), Registrar::None));
    }

    fn open(&self, req: &fuser::Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let r = Request::Open {
            ino: ino.0,
            flags: flags.0,
        };
        let register = |file: &std::fs::File| reply.open_backing(file);
        match self.dispatch(&r, ids(req), Registrar::Fuser(&register)) {
            Reply::Open(o) if o.backing.is_none() => reply.opened(FileHandle(o.fh), o.flags),
            Reply::Open(o) => match self.fuser_id(ino.0, &o, false) {
                Ok(id) => reply.opened_passthrough(FileHandle(o.fh), o.flags, &id),
                Err(e) => reply.error(e),
            },
            r => reply.error(error_of(r)),
        }
    }

    fn read(
        &self,
        req: &fuser::Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let r = Request::Read {
            fh: fh.0,
            offset,
            size,
        };
        match self.dispatch(&r, ids(req), Registrar::None) {
            Reply::Data(d) => reply.data(&d),
            r => reply.error(error_of(r)),
        }
    }

    fn write(
        &self,
        req: &fuser::Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let r = Request::Write {
            fh: fh.0,
            offset,
            data,
            write_flags: write_flags.bits(),
        };
        match self.dispatch(&r, ids(req), Registrar::None) {
            Reply::Written(n) => reply.written(n),
            r => reply.error(error_of(r)),
        }
    }

    fn flush(
        &self,
        req: &fuser::Request,
        _ino: INodeNo,
        fh: FileHandle,
        _lock: LockOwner,
        reply: ReplyEmpty,
    ) {
        let r = Request::Flush { fh: fh.0 };
        reply_empty(reply, self.dispatch(&r, ids(req), Registrar::None));
    }

    fn release(
        &self,
        req: &fuser::Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let r = Request::Release { fh: fh.0 };
        reply_empty(reply, self.dispatch(&r, ids(req), Registrar::None));
    }

    fn fsync(
        &self,
        req: &fuser::Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        reply_empty(
            reply,
            self.dispatch(&Request::Fsync, ids(req), Registrar::None),
        );
    }

    fn opendir(&self, req: &fuser::Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let r = Request::Opendir { ino: ino.0 };
        match self.dispatch(&r, ids(req), Registrar::None) {
            Reply::Open(o) => reply.opened(FileHandle(o.fh), o.flags),
            r => reply.error(error_of(r)),
        }
    }

    fn readdir(
        &self,
        req: &fuser::Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        // fuser's reply buffer is as large as the kernel asked for, and says when it is full.
        let r = Request::Readdir {
            ino: ino.0,
            offset,
            size: u32::MAX,
        };
        match self.dispatch(&r, ids(req), Registrar::None) {
            Reply::Dir(list) => {
                for (next, e) in list.iter() {
                    let kind = match e.kind {
                        Kind::Dir => FileType::Directory,
                        Kind::File => FileType::RegularFile,
                    };
                    if reply.add(INodeNo(e.ino), next, kind, &e.name) {
                        break;
                    }
                }
                reply.ok();
            }
            r => reply.error(error_of(r)),
        }
    }

    fn statfs(&self, req: &fuser::Request, _ino: INodeNo, reply: ReplyStatfs) {
        match self.dispatch(&Request::Statfs, ids(req), Registrar::None) {
            Reply::Statfs(s) => reply.statfs(
                s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen, s.frsize,
            ),
            r => reply.error(error_of(r)),
        }
    }

    fn setxattr(
        &self,
        req: &fuser::Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        _flags: i32,
        _pos: u32,
        reply: ReplyEmpty,
    ) {
        let r = Request::Setxattr {
            ino: ino.0,
            name: name.as_bytes(),
            value,
        };
        reply_empty(reply, self.dispatch(&r, ids(req), Registrar::None));
    }

    fn getxattr(
        &self,
        req: &fuser::Request,
        ino: INodeNo,
        name: &OsStr,
        size: u32,
        reply: ReplyXattr,
    ) {
        let r = Request::Getxattr {
            ino: ino.0,
            name: name.as_bytes(),
            size,
        };
        reply_xattr(reply, self.dispatch(&r, ids(req), Registrar::None));
    }

    fn listxattr(&self, req: &fuser::Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let r = Request::Listxattr { ino: ino.0, size };
        reply_xattr(reply, self.dispatch(&r, ids(req), Registrar::None));
    }

    fn removexattr(&self, req: &fuser::Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let r = Request::Removexattr {
            ino: ino.0,
            name: name.as_bytes(),
        };
        reply_empty(reply, self.dispatch(&r, ids(req), Registrar::None));
    }

    fn access(&self, req: &fuser::Request, _ino: INodeNo, _mask: AccessFlags, reply: ReplyEmpty) {
        reply_empty(
            reply,
            self.dispatch(&Request::Access, ids(req), Registrar::None),
        );
    }

    fn create(
        &self,
        req: &fuser::Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let r = Request::Create {
            parent: parent.0,
            name: name.as_bytes(),
            mode,
            umask,
            flags,
        };
        let register = |file: &std::fs::File| reply.open_backing(file);
        let (attr, o) = match self.dispatch(&r, ids(req), Registrar::Fuser(&register)) {
            Reply::Created { attr, opened } => (attr, opened),
            r => return reply.error(error_of(r)),
        };
        // Being written: the kernel asks again each time (zero TTL).
        let ttl = std::time::Duration::ZERO;
        let fa = file_attr(&attr);
        let (fh, flags) = (FileHandle(o.fh), o.flags);
        if o.backing.is_none() {
            return reply.created(&ttl, &fa, Generation(0), fh, flags);
        }
        match self.fuser_id(attr.ino, &o, true) {
            Ok(id) => reply.created_passthrough(&ttl, &fa, Generation(0), fh, flags, &id),
            Err(e) => reply.error(e),
        }
    }

    fn fallocate(
        &self,
        req: &fuser::Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let r = Request::Fallocate {
            fh: fh.0,
            offset,
            len: length,
            mode,
        };
        reply_empty(reply, self.dispatch(&r, ids(req), Registrar::None));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::Fs;
    use crate::ring::Rings;
    use crate::testing::Rec;

    fn serves<F: Filesystem>(_: &F) {}

    #[test]
    fn the_mount_api_holds() {
        // As the daemon mounts: a FuseFs for fuser's session, a handle for the rings, the
        // backings for the store's invalidations.
        let fs = FuseFs::new(Fs::new(Rec::default()));
        let backings: std::sync::Arc<Backings> = fs.backings();
        backings.forget(7);
        let handle = fs.share();
        assert!(!handle.uses_uring());
        serves(&fs);
        let _prepare: fn(&FuseFs<Rec>) -> std::io::Result<Rings> = Rings::prepare;
        let _start: fn(
            Rings,
            &FuseFs<Rec>,
            std::os::fd::OwnedFd,
        ) -> std::io::Result<Option<Rings>> = Rings::start;
        let _join: fn(Rings) = Rings::join;
    }
}
