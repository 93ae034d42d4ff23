//! The filesystem server, whichever way its requests travel: the one [`Request`] type both
//! transports decode into, the one [`Server::dispatch`] that serves them (counting each upcall
//! and entering its span), the one [`Reply`] type they encode. Also the state the transports
//! share: the passthrough backing ids ([`Backings`]) and what INIT agreed on.
//!
//! [`crate::fuse`] turns fuser's callbacks into requests and replies with fuser's reply
//! objects; [`crate::ring`] decodes requests from io_uring entries and encodes replies into
//! them ([`crate::codec`], in the kernel's structures of [`crate::abi`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use fuser::{BackingId, Errno, FopenFlags};
use parking_lot::MappedMutexGuard;

use crate::backend::{Attr, Backend, Caller, DirEntry, Kind, OpenedFile, Upcall};
pub use crate::backings::{BackingRef, Backings, Registrar};
use crate::fs::Fs;

/// Bytes of the payload buffer of each io_uring entry: the largest request (WRITE) or reply
/// (READ) the connection allows; INIT bounds max_write and max_pages to it when it asks for
/// io_uring.
pub const RING_PAYLOAD: usize = 1 << 20;

/// Block size reported by stat and statfs.
pub const BLKSIZE: u32 = 4096;

/// What INIT agreed on, shared by the transports.
#[derive(Default)]
pub(crate) struct Transport {
    /// Memfs entries are opened with FUSE passthrough.
    pub(crate) passthrough: AtomicBool,
    /// Ask the kernel for FUSE over io_uring at INIT (set once the rings exist).
    pub(crate) want_uring: AtomicBool,
    /// INIT is done.
    pub(crate) init_done: AtomicBool,
    /// The kernel agreed to io_uring.
    pub(crate) uring: AtomicBool,
}

/// The mounted filesystem ([`crate::fuse::FuseFs`]). Cheap handles to one shared state
/// ([`Server::share`]): fuser's session owns one, the io_uring queue threads another.
pub struct Server<B: Backend> {
    fs: Arc<Fs<B>>,
    backings: Arc<Backings>,
    transport: Arc<Transport>,
}

/// Who sent a request (the kernel's request header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ids {
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
}

impl Ids {
    /// The caller; `groups`: with its supplementary groups (permission checks).
    fn caller(self, groups: bool) -> Caller {
        if groups {
            Caller::with_groups(self.uid, self.gid, self.pid as i32)
        } else {
            Caller::new(self.uid, self.gid, self.pid as i32)
        }
    }
}

/// One decoded FUSE request. Names are the kernel's bytes (checked to be UTF-8 when served).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request<'a> {
    Lookup {
        parent: u64,
        name: &'a [u8],
    },
    Getattr {
        ino: u64,
    },
    /// The attributes whose `FATTR_*` bit is set; others are None.
    Setattr {
        ino: u64,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
    },
    Mkdir {
        parent: u64,
        name: &'a [u8],
        mode: u32,
        umask: u32,
    },
    Unlink {
        parent: u64,
        name: &'a [u8],
    },
    Rmdir {
        parent: u64,
        name: &'a [u8],
    },
    /// RENAME (flags 0) or RENAME2 (`RENAME_*` flags).
    Rename {
        parent: u64,
        name: &'a [u8],
        newparent: u64,
        newname: &'a [u8],
        flags: u32,
    },
    /// `open(2)` flags.
    Open {
        ino: u64,
        flags: i32,
    },
    Create {
        parent: u64,
        name: &'a [u8],
        mode: u32,
        umask: u32,
        flags: i32,
    },
    Read {
        fh: u64,
        offset: u64,
        size: u32,
    },
    /// `write_flags` has `FUSE_WRITE_CACHE` for a page of a mapping written back: `fh` is then
    /// any writable handle of the inode.
    Write {
        fh: u64,
        offset: u64,
        data: &'a [u8],
        write_flags: u32,
    },
    Flush {
        fh: u64,
    },
    Release {
        fh: u64,
    },
    Opendir {
        ino: u64,
    },
    /// `size`: the most bytes of `fuse_dirent`s the reply may hold (fuser's reply buffer
    /// bounds its own).
    Readdir {
        ino: u64,
        offset: u64,
        size: u32,
    },
    Statfs,
    Setxattr {
        ino: u64,
        name: &'a [u8],
        value: &'a [u8],
    },
    /// `size`: the caller's buffer, 0 to ask for the value's size.
    Getxattr {
        ino: u64,
        name: &'a [u8],
        size: u32,
    },
    Listxattr {
        ino: u64,
        size: u32,
    },
    Removexattr {
        ino: u64,
        name: &'a [u8],
    },
    Fallocate {
        fh: u64,
        offset: u64,
        len: u64,
        mode: i32,
    },
    /// FSYNC, FSYNCDIR: nothing is buffered.
    Fsync,
    /// ACCESS: with `default_permissions` the kernel checks modes itself.
    Access,
    /// RELEASEDIR: directory handles hold nothing.
    Releasedir,
    /// DESTROY.
    Destroy,
    /// SYMLINK, LINK, MKNOD: only namespaces and entries exist (EPERM).
    Link,
    /// READLINK: there are no links (EINVAL).
    Readlink,
    /// Any other opcode (ENOSYS).
    Unknown {
        opcode: u32,
    },
}

impl Request<'_> {
    /// The upcall counted for the request, if it is counted.
    pub fn upcall(&self) -> Option<Upcall> {
        Some(match self {
            Request::Lookup { .. } => Upcall::Lookup,
            Request::Getattr { .. } => Upcall::Getattr,
            Request::Setattr { .. } => Upcall::Setattr,
            Request::Mkdir { .. } => Upcall::Mkdir,
            Request::Unlink { .. } => Upcall::Unlink,
            Request::Rmdir { .. } => Upcall::Rmdir,
            Request::Rename { .. } => Upcall::Rename,
            Request::Open { .. } => Upcall::Open,
            Request::Create { .. } => Upcall::Create,
            Request::Read { .. } => Upcall::Read,
            Request::Write { .. } => Upcall::Write,
            Request::Flush { .. } => Upcall::Flush,
            Request::Release { .. } => Upcall::Release,
            Request::Opendir { .. } => Upcall::Opendir,
            Request::Readdir { .. } => Upcall::Readdir,
            Request::Statfs => Upcall::Statfs,
            Request::Setxattr { .. } => Upcall::Setxattr,
            Request::Getxattr { .. } => Upcall::Getxattr,
            Request::Listxattr { .. } => Upcall::Listxattr,
            Request::Removexattr { .. } => Upcall::Removexattr,
            Request::Fallocate { .. } => Upcall::Fallocate,
            Request::Fsync
            | Request::Access
            | Request::Releasedir
            | Request::Destroy
            | Request::Link
            | Request::Readlink
            | Request::Unknown { .. } => return None,
        })
    }
}

/// What an open or a create hands back to the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Opened {
    /// File handle.
    pub fh: u64,
    /// `FOPEN_*` flags, without `FOPEN_PASSTHROUGH`.
    pub flags: FopenFlags,
    /// With passthrough (read, write and mmap served from the inode's backing file): its
    /// backing id, registered the way the request's [`Registrar`] registers.
    pub backing: Option<BackingRef>,
}

/// A directory listing from an offset on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listing {
    /// The whole directory, `.` and `..` first.
    pub entries: Vec<DirEntry>,
    /// The offset asked for: entries before it were already listed.
    pub from: u64,
    /// The most bytes of `fuse_dirent`s to reply.
    pub size: u32,
}

impl Listing {
    /// The entries to list, each with the offset of the next one (what a later READDIR passes
    /// back to continue after it).
    pub fn iter(&self) -> impl Iterator<Item = (u64, &DirEntry)> {
        let from = usize::try_from(self.from).unwrap_or(usize::MAX);
        self.entries
            .iter()
            .enumerate()
            .skip(from)
            .map(|(i, e)| (i as u64 + 1, e))
    }
}

/// `statfs` counts in [`BLKSIZE`] blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Statfs {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
}

/// The answer to `getxattr`/`listxattr` with a buffer of `size` bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum XattrAnswer {
    /// The caller asked for the size (`size == 0`).
    Size(u32),
    /// The value, which fits.
    Data(Vec<u8>),
}

/// The reply to a [`Request`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// LOOKUP, MKDIR.
    Entry {
        attr: Attr,
        attr_ttl: Duration,
        entry_ttl: Duration,
    },
    /// GETATTR, SETATTR.
    Attr {
        attr: Attr,
        ttl: Duration,
    },
    /// OPEN, OPENDIR.
    Open(Opened),
    /// CREATE (both TTLs zero: the entry is being written).
    Created {
        attr: Attr,
        opened: Opened,
    },
    /// READ, or GETXATTR/LISTXATTR's value.
    Data(Vec<u8>),
    /// WRITE: all the bytes (never a short count).
    Written(u32),
    Statfs(Statfs),
    Xattr(XattrAnswer),
    Dir(Listing),
    /// Success without data.
    Empty,
    Err(Errno),
}

/// The errno of `e` at the FUSE boundary, logged at the level its kind deserves.
pub(crate) fn errno(e: &maru::Error) -> Errno {
    match e.errno() {
        libc::ENOENT | libc::EEXIST | libc::ENOTEMPTY | libc::ENODATA => {
            tracing::debug!("{e}")
        }
        libc::EIO => tracing::warn!("{e}"),
        _ => tracing::debug!("{e}"),
    }
    Errno::from_i32(e.errno())
}

fn name_str(name: &[u8]) -> Result<&str, Errno> {
    std::str::from_utf8(name).map_err(|_| Errno::EINVAL)
}

/// The reply to a request whose answer is success or an error.
fn empty(r: maru::Result<()>) -> Reply {
    match r {
        Ok(()) => Reply::Empty,
        Err(e) => Reply::Err(errno(&e)),
    }
}

/// `FOPEN_*` flags of a handle: a read-only one needs no FLUSH; an entry being written is
/// served without the page cache, so that every write reaches the store.
fn open_flags(write: bool, opened: &OpenedFile) -> FopenFlags {
    let mut flags = if write {
        FopenFlags::empty()
    } else {
        FopenFlags::FOPEN_NOFLUSH
    };
    if matches!(opened, OpenedFile::Writing(_)) {
        flags |= FopenFlags::FOPEN_DIRECT_IO;
    }
    flags
}

/// `Result<T, Errno>`'s error as a [`Reply`]: `let x = or_reply!(expr);`.
macro_rules! or_reply {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(e) => return Reply::Err(e),
        }
    };
}

/// What a passthrough handle takes its backing id for ([`Server::attach`]).
#[derive(Clone, Copy)]
enum Attach {
    /// A sealed entry read: the id is kept for the next open after the last close, unless a
    /// forget came since [`Backings::epoch`] `since` (taken before the store's open).
    Keep { since: u64 },
    /// Any other open: the id goes with its last handle.
    Open,
    /// A create: as `Open`, and a failure abandons the entry ([`Fs::abandon`]).
    Created,
}

impl<B: Backend> Server<B> {
    /// Wraps the filesystem logic.
    pub fn new(fs: Fs<B>) -> Self {
        Server {
            fs: Arc::new(fs),
            backings: Arc::new(Backings::default()),
            transport: Arc::new(Transport::default()),
        }
    }

    /// Another handle to the same filesystem.
    pub fn share(&self) -> Self {
        Server {
            fs: self.fs.clone(),
            backings: self.backings.clone(),
            transport: self.transport.clone(),
        }
    }

    /// The backing-id table, for the store's invalidations.
    pub fn backings(&self) -> Arc<Backings> {
        self.backings.clone()
    }

    /// Whether the kernel agreed, at INIT, to send requests over io_uring.
    pub fn uses_uring(&self) -> bool {
        self.transport.uring.load(Ordering::Acquire)
    }

    /// The filesystem logic.
    pub fn fs(&self) -> &Fs<B> {
        &self.fs
    }

    /// What INIT agreed on.
    pub(crate) fn transport(&self) -> &Transport {
        &self.transport
    }

    /// The fuser-registered backing id of `ino`, for the reply to an open or create served
    /// by fuser ([`BackingRef::Fuser`]).
    pub(crate) fn fuser_backing(&self, ino: u64) -> Option<MappedMutexGuard<'_, BackingId>> {
        self.backings.fuser_id(ino)
    }

    /// Serves one request from `ids`; `reg` registers passthrough backing files (OPEN and
    /// CREATE). Counts the upcall and enters its span (`fuse{op, pid}`, at debug level).
    /// A request that changes the store fails, whatever it did, when the backend says that
    /// what it changed is not durable ([`Backend::settled`]).
    pub fn dispatch(&self, req: &Request<'_>, ids: Ids, reg: Registrar<'_>) -> Reply {
        let _span = req.upcall().map(|op| {
            self.fs.backend().count_upcall(op);
            tracing::debug_span!("fuse", op = op.name(), pid = ids.pid).entered()
        });
        let changes = matches!(
            req,
            Request::Mkdir { .. }
                | Request::Unlink { .. }
                | Request::Rmdir { .. }
                | Request::Rename { .. }
                | Request::Flush { .. }
                | Request::Setxattr { .. }
                | Request::Removexattr { .. }
        );
        if !changes {
            return self.serve(req, ids, reg);
        }
        let b = self.fs.backend();
        let _ = b.settled(); // nothing of an earlier request's
        match self.serve(req, ids, reg) {
            Reply::Err(e) => Reply::Err(e),
            r => match b.settled() {
                Ok(()) => r,
                Err(e) => Reply::Err(errno(&e)),
            },
        }
    }

    fn serve(&self, req: &Request<'_>, ids: Ids, reg: Registrar<'_>) -> Reply {
        let f = &*self.fs;
        match *req {
            Request::Lookup { parent, name } => {
                let name = or_reply!(name_str(name));
                self.entry(f.lookup(&ids.caller(false), parent, name))
            }
            Request::Getattr { ino } => self.attr(f.getattr(ino)),
            Request::Setattr {
                ino,
                mode,
                uid,
                gid,
                size,
            } => self.attr(f.setattr(&ids.caller(true), ino, mode, uid, gid, size)),
            Request::Mkdir {
                parent,
                name,
                mode,
                umask,
            } => {
                let name = or_reply!(name_str(name));
                self.entry(f.mkdir(&ids.caller(true), parent, name, mode & !umask))
            }
            Request::Unlink { parent, name } => {
                let name = or_reply!(name_str(name));
                empty(f.unlink(&ids.caller(true), parent, name))
            }
            Request::Rmdir { parent, name } => {
                let name = or_reply!(name_str(name));
                empty(f.rmdir(&ids.caller(true), parent, name))
            }
            Request::Rename {
                parent,
                name,
                newparent,
                newname,
                flags,
            } => {
                if flags & (libc::RENAME_EXCHANGE | libc::RENAME_WHITEOUT) != 0 {
                    return Reply::Err(Errno::EINVAL);
                }
                let name = or_reply!(name_str(name));
                let newname = or_reply!(name_str(newname));
                empty(f.rename(&ids.caller(true), parent, name, newparent, newname))
            }
            Request::Open { ino, flags } => self.open(&ids.caller(false), ino, flags, &reg),
            Request::Create {
                parent,
                name,
                mode,
                umask,
                flags: _,
            } => {
                let name = or_reply!(name_str(name));
                let mode = mode & !umask & 0o7777;
                self.create(&ids.caller(true), parent, name, mode, &reg)
            }
            Request::Read { fh, offset, size } => match f.read(fh, offset, size) {
                Ok(d) => Reply::Data(d),
                Err(e) => Reply::Err(errno(&e)),
            },
            Request::Write {
                fh, offset, data, ..
            } => match f.write(fh, offset, data) {
                Ok(n) => Reply::Written(n),
                Err(e) => Reply::Err(errno(&e)),
            },
            Request::Flush { fh } => empty(f.flush(&ids.caller(false), fh)),
            Request::Release { fh } => {
                self.release(fh);
                Reply::Empty
            }
            Request::Opendir { ino } => match f.getattr(ino) {
                Ok(a) if a.kind == Kind::Dir => Reply::Open(Opened {
                    fh: 0,
                    flags: FopenFlags::empty(),
                    backing: None,
                }),
                Ok(_) => Reply::Err(Errno::ENOTDIR),
                Err(e) => Reply::Err(errno(&e)),
            },
            Request::Readdir { ino, offset, size } => match f.readdir(&ids.caller(true), ino) {
                Ok(entries) => Reply::Dir(Listing {
                    entries,
                    from: offset,
                    size,
                }),
                Err(e) => Reply::Err(errno(&e)),
            },
            Request::Statfs => Reply::Statfs(self.statfs()),
            Request::Setxattr { ino, name, value } => {
                let name = or_reply!(name_str(name));
                empty(f.setxattr(&ids.caller(true), ino, name, value))
            }
            Request::Getxattr { ino, name, size } => {
                let name = or_reply!(name_str(name));
                xattr_answer(size, f.getxattr(ino, name))
            }
            Request::Listxattr { ino, size } => xattr_answer(size, f.listxattr(ino)),
            Request::Removexattr { ino, name } => {
                let name = or_reply!(name_str(name));
                empty(f.setxattr(&ids.caller(true), ino, name, b"0"))
            }
            Request::Fallocate {
                fh,
                offset,
                len,
                mode,
            } => empty(f.fallocate(fh, offset, len, mode)),
            Request::Fsync | Request::Access | Request::Releasedir | Request::Destroy => {
                Reply::Empty
            }
            Request::Link => Reply::Err(Errno::EPERM),
            Request::Readlink => Reply::Err(Errno::EINVAL),
            Request::Unknown { .. } => Reply::Err(Errno::ENOSYS),
        }
    }

    fn entry(&self, r: maru::Result<Attr>) -> Reply {
        match r {
            Ok(attr) => {
                let (attr_ttl, entry_ttl) = Fs::<B>::ttls(&attr);
                Reply::Entry {
                    attr,
                    attr_ttl,
                    entry_ttl,
                }
            }
            Err(e) => Reply::Err(errno(&e)),
        }
    }

    fn attr(&self, r: maru::Result<Attr>) -> Reply {
        match r {
            Ok(attr) => Reply::Attr {
                ttl: Fs::<B>::ttls(&attr).0,
                attr,
            },
            Err(e) => Reply::Err(errno(&e)),
        }
    }

    /// Opens `ino` for `flags` (`open(2)` flags); with passthrough, the inode's backing id is
    /// reused or registered with `reg`.
    fn open(&self, c: &Caller, ino: u64, flags: i32, reg: &Registrar<'_>) -> Reply {
        let write = (flags & libc::O_ACCMODE) != libc::O_RDONLY;
        let trunc = flags & libc::O_TRUNC != 0;
        // A sealed entry whose backing is still registered (the common open of a hot key):
        // its file and backing id are at hand, only the store's checks and bookkeeping remain
        // (no path walk in the pool, one look at the backings).
        if !write
            && let Some(raw) = reg.raw()
            && let Some((file, backing)) = self.backings.reuse_kept(ino, raw)
        {
            return match self.fs.reopen(c, ino, file) {
                Ok(fh) => Reply::Open(Opened {
                    fh,
                    flags: FopenFlags::FOPEN_NOFLUSH,
                    backing: Some(backing),
                }),
                Err(e) => {
                    // Gone (or refused): the backing is not kept for it.
                    self.backings.put(ino, false);
                    Reply::Err(errno(&e))
                }
            };
        }
        let since = self.backings.epoch();
        let (fh, opened) = match self.fs.open(c, ino, write, trunc) {
            Ok(o) => o,
            Err(e) => return Reply::Err(errno(&e)),
        };
        // Only a sealed entry's backing is kept for the next open.
        let how = if !write && matches!(opened, OpenedFile::Passthrough(_)) {
            Attach::Keep { since }
        } else {
            Attach::Open
        };
        let backing = or_reply!(self.attach(ino, fh, &opened, reg, how));
        Reply::Open(Opened {
            fh,
            flags: open_flags(write, &opened),
            backing,
        })
    }

    /// Creates `name` in `parent` and opens it for writing (see [`Self::open`]).
    fn create(&self, c: &Caller, parent: u64, name: &str, mode: u32, reg: &Registrar<'_>) -> Reply {
        let (attr, fh, opened) = match self.fs.create(c, parent, name, mode) {
            Ok(v) => v,
            Err(e) => return Reply::Err(errno(&e)),
        };
        let backing = or_reply!(self.attach(attr.ino, fh, &opened, reg, Attach::Created));
        Reply::Created {
            opened: Opened {
                fh,
                flags: open_flags(true, &opened),
                backing,
            },
            attr,
        }
    }

    /// For a passthrough handle `fh` of `ino`, takes (or registers) the inode's backing id.
    /// On failure the handle is released (abandoned if a create made it: see
    /// [`Fs::abandon`]).
    fn attach(
        &self,
        ino: u64,
        fh: u64,
        opened: &OpenedFile,
        reg: &Registrar<'_>,
        how: Attach,
    ) -> Result<Option<BackingRef>, Errno> {
        let (OpenedFile::Passthrough(file) | OpenedFile::Writing(Some(file))) = opened else {
            return Ok(None);
        };
        if !self.transport.passthrough.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let (keep, since) = match how {
            Attach::Keep { since } => (true, since),
            Attach::Open | Attach::Created => (false, 0),
        };
        match self.backings.attach(ino, file, reg, keep, since) {
            Ok(b) => Ok(Some(b)),
            Err(e) => {
                // The handle never took a backing: release it without putting one back.
                if matches!(how, Attach::Created) {
                    self.fs.abandon(fh);
                } else {
                    self.fs.release(fh);
                }
                Err(e)
            }
        }
    }

    /// A handle is gone: releases it and puts its backing id back.
    pub(crate) fn release(&self, fh: u64) {
        self.put_back(self.fs.release(fh));
    }

    /// The handle of an open or create whose reply the kernel never got: released, its
    /// backing id put back; a created entry is abandoned ([`Fs::abandon`]).
    pub(crate) fn withdraw(&self, fh: u64, created: bool) {
        if created {
            self.put_back(self.fs.abandon(fh));
        } else {
            self.release(fh);
        }
    }

    /// Puts back the backing id of handle `h`, gone.
    fn put_back(&self, h: Option<crate::fs::Handle>) {
        if let Some(h) = h
            && matches!(
                h.opened,
                OpenedFile::Passthrough(_) | OpenedFile::Writing(Some(_))
            )
        {
            self.backings.put(h.ino, !h.writable);
        }
    }

    /// Blocks, free, available, files, free files (names are not a limited resource); names
    /// are at most 255 bytes.
    fn statfs(&self) -> Statfs {
        let (total, free, files) = self.fs.statfs();
        let bs = u64::from(BLKSIZE);
        Statfs {
            blocks: total / bs,
            bfree: free / bs,
            bavail: free / bs,
            files,
            ffree: u64::MAX / 2,
            bsize: BLKSIZE,
            namelen: 255,
            frsize: BLKSIZE,
        }
    }
}

/// [`XattrAnswer`] for a value lookup `r`: ERANGE when it does not fit in `size`.
fn xattr_answer(size: u32, r: maru::Result<Vec<u8>>) -> Reply {
    match r {
        Ok(v) if size == 0 => Reply::Xattr(XattrAnswer::Size(v.len() as u32)),
        Ok(v) if v.len() <= size as usize => Reply::Xattr(XattrAnswer::Data(v)),
        Ok(_) => Reply::Err(Errno::ERANGE),
        Err(e) => Reply::Err(errno(&e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rec;
    use std::fs::File;

    const ROOT: Ids = Ids {
        uid: 0,
        gid: 0,
        pid: 1,
    };

    fn server(opened: OpenedFile) -> Server<Rec> {
        let s = Server::new(Fs::new(Rec::serving(opened)));
        s.transport().passthrough.store(true, Ordering::Relaxed);
        s
    }

    /// `open("k", O_CREAT | O_WRONLY, 0644)` in the root, umask 022.
    const CREATE_K: Request<'static> = Request::Create {
        parent: 1,
        name: b"k",
        mode: 0o644,
        umask: 0o022,
        flags: libc::O_WRONLY,
    };

    fn tmpfile() -> Arc<File> {
        Arc::new(tempfile::tempfile().unwrap())
    }

    #[test]
    fn entries_being_written_are_served_direct_without_passthrough() {
        let s = server(OpenedFile::Writing(None));
        let open = Request::Open {
            ino: 7,
            flags: libc::O_RDWR,
        };
        let Reply::Open(o) = s.dispatch(&open, ROOT, Registrar::None) else {
            panic!("open failed");
        };
        assert_eq!(o.flags, FopenFlags::FOPEN_DIRECT_IO);
        assert_eq!(o.backing, None);
        // A read-only handle of it: direct too, and no FLUSH.
        let ro = Request::Open {
            ino: 7,
            flags: libc::O_RDONLY,
        };
        let Reply::Open(o) = s.dispatch(&ro, ROOT, Registrar::None) else {
            panic!("open failed");
        };
        assert_eq!(
            o.flags,
            FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_NOFLUSH
        );
        let create = CREATE_K;
        let Reply::Created { attr, opened } = s.dispatch(&create, ROOT, Registrar::None) else {
            panic!("create failed");
        };
        assert_eq!(attr.ino, 7);
        assert_eq!(opened.flags, FopenFlags::FOPEN_DIRECT_IO);
        assert_eq!(opened.backing, None);
        assert_eq!(s.fs().backend().created_mode(), Some(0o644 & !0o022));
    }

    #[test]
    fn copied_entries_are_cached() {
        let s = server(OpenedFile::Copy);
        let ro = Request::Open {
            ino: 7,
            flags: libc::O_RDONLY,
        };
        let Reply::Open(o) = s.dispatch(&ro, ROOT, Registrar::None) else {
            panic!("open failed");
        };
        assert_eq!(o.flags, FopenFlags::FOPEN_NOFLUSH);
        assert_eq!(o.backing, None);
    }

    #[test]
    fn a_failed_registration_releases_the_handle() {
        let s = server(OpenedFile::Passthrough(tmpfile()));
        let refuse = |_: &File| -> std::io::Result<BackingId> {
            Err(std::io::Error::from_raw_os_error(libc::EPERM))
        };
        let ro = Request::Open {
            ino: 7,
            flags: libc::O_RDONLY,
        };
        assert_eq!(
            s.dispatch(&ro, ROOT, Registrar::Fuser(&refuse)),
            Reply::Err(Errno::EPERM)
        );
        assert_eq!(s.fs().open_handles(), 0);
        // Without a way to register, a passthrough open fails the same way.
        assert_eq!(
            s.dispatch(&ro, ROOT, Registrar::None),
            Reply::Err(Errno::EIO)
        );
        assert_eq!(s.fs().open_handles(), 0);
        // Without passthrough (INIT did not agree), the entry is served by the daemon.
        s.transport().passthrough.store(false, Ordering::Relaxed);
        let Reply::Open(o) = s.dispatch(&ro, ROOT, Registrar::None) else {
            panic!("open failed");
        };
        assert_eq!(o.backing, None);
    }

    #[test]
    fn a_create_whose_registration_fails_publishes_nothing() {
        let s = server(OpenedFile::Writing(Some(tmpfile())));
        let refuse = |_: &File| -> std::io::Result<BackingId> {
            Err(std::io::Error::from_raw_os_error(libc::EPERM))
        };
        let create = CREATE_K;
        assert_eq!(
            s.dispatch(&create, ROOT, Registrar::Fuser(&refuse)),
            Reply::Err(Errno::EPERM)
        );
        assert_eq!(s.fs().open_handles(), 0);
        assert_eq!(s.fs().backend().seals(), 0, "an empty entry published");
        assert!(
            s.fs()
                .backend()
                .calls()
                .contains(&crate::testing::Call::Abort { ino: 7 })
        );
    }

    #[test]
    fn requests_are_counted_once() {
        let s = server(OpenedFile::Writing(None));
        s.dispatch(&Request::Getattr { ino: 1 }, ROOT, Registrar::None);
        s.dispatch(&Request::Statfs, ROOT, Registrar::None);
        s.dispatch(&Request::Access, ROOT, Registrar::None);
        assert_eq!(
            s.fs().backend().upcalls(),
            vec![Upcall::Getattr, Upcall::Statfs]
        );
    }

    #[test]
    fn rename_refuses_exchange_and_whiteout() {
        let s = server(OpenedFile::Writing(None));
        let mut r = Request::Rename {
            parent: 1,
            name: b"a",
            newparent: 1,
            newname: b"b",
            flags: libc::RENAME_EXCHANGE,
        };
        assert_eq!(
            s.dispatch(&r, ROOT, Registrar::None),
            Reply::Err(Errno::EINVAL)
        );
        if let Request::Rename { flags, .. } = &mut r {
            *flags = libc::RENAME_NOREPLACE;
        }
        assert_eq!(s.dispatch(&r, ROOT, Registrar::None), Reply::Empty);
        let bad = Request::Unlink {
            parent: 1,
            name: b"\xff",
        };
        assert_eq!(
            s.dispatch(&bad, ROOT, Registrar::None),
            Reply::Err(Errno::EINVAL)
        );
    }

    #[test]
    fn xattr_sizes_and_listings() {
        let s = server(OpenedFile::Writing(None));
        let get = |size| Request::Getxattr {
            ino: 2,
            name: b"user.maru.state",
            size,
        };
        assert_eq!(
            s.dispatch(&get(0), ROOT, Registrar::None),
            Reply::Xattr(XattrAnswer::Size(7))
        );
        assert_eq!(
            s.dispatch(&get(3), ROOT, Registrar::None),
            Reply::Err(Errno::ERANGE)
        );
        assert_eq!(
            s.dispatch(&get(7), ROOT, Registrar::None),
            Reply::Xattr(XattrAnswer::Data(b"writing".to_vec()))
        );
        let dir = Request::Readdir {
            ino: 1,
            offset: 1,
            size: 4096,
        };
        let Reply::Dir(l) = s.dispatch(&dir, ROOT, Registrar::None) else {
            panic!("readdir failed");
        };
        let names: Vec<_> = l.iter().map(|(off, e)| (off, e.name.as_str())).collect();
        assert_eq!(names, vec![(2, "..")]);
    }
}
