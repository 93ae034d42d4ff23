//! FUSE requests and replies in the kernel's structures ([`crate::abi`]), as the io_uring
//! transport ([`crate::ring`]) finds and leaves them in a ring entry: [`decode`] turns an
//! entry's request into a [`Request`], [`encode`] a [`Reply`] into the entry's payload.
//! No I/O: a fuzz target or a test can call them on any bytes.

use std::time::Duration;

use fuser::{Errno, FopenFlags};

use crate::abi::{self, Plain};
use crate::backend::{Attr, Kind};
use crate::server::{BLKSIZE, BackingRef, Listing, Opened, Reply, Request, XattrAnswer};

/// The op header (the request's first argument, in the entry's 128-byte `op_in` area).
fn arg<T: Plain>(op: &[u8]) -> Result<T, Errno> {
    T::read_from(op).ok_or(Errno::EINVAL)
}

/// The `k`-th NUL-terminated string of the payload, without its NUL.
fn name(payload: &[u8], k: usize) -> Result<&[u8], Errno> {
    let mut rest = payload;
    for _ in 0..k {
        let end = rest.iter().position(|&b| b == 0).ok_or(Errno::EINVAL)?;
        rest = &rest[end + 1..];
    }
    let end = rest.iter().position(|&b| b == 0).ok_or(Errno::EINVAL)?;
    Ok(&rest[..end])
}

/// The request of a ring entry: its header `h`, op header `op` and payload (the other input
/// arguments, back to back).
pub fn decode<'a>(h: &abi::InHeader, op: &[u8], payload: &'a [u8]) -> Result<Request<'a>, Errno> {
    let ino = h.nodeid;
    Ok(match h.opcode {
        abi::FUSE_LOOKUP => Request::Lookup {
            parent: ino,
            name: name(payload, 0)?,
        },
        abi::FUSE_GETATTR => Request::Getattr { ino },
        abi::FUSE_SETATTR => {
            let a: abi::SetattrIn = arg(op)?;
            let set = |bit: u32| a.valid & bit != 0;
            Request::Setattr {
                ino,
                mode: set(abi::FATTR_MODE).then_some(a.mode),
                uid: set(abi::FATTR_UID).then_some(a.uid),
                gid: set(abi::FATTR_GID).then_some(a.gid),
                size: set(abi::FATTR_SIZE).then_some(a.size),
            }
        }
        abi::FUSE_MKDIR => {
            let a: abi::MkdirIn = arg(op)?;
            Request::Mkdir {
                parent: ino,
                name: name(payload, 0)?,
                mode: a.mode,
                umask: a.umask,
            }
        }
        abi::FUSE_UNLINK => Request::Unlink {
            parent: ino,
            name: name(payload, 0)?,
        },
        abi::FUSE_RMDIR => Request::Rmdir {
            parent: ino,
            name: name(payload, 0)?,
        },
        abi::FUSE_RENAME | abi::FUSE_RENAME2 => {
            let (newparent, flags) = if h.opcode == abi::FUSE_RENAME2 {
                let a: abi::Rename2In = arg(op)?;
                (a.newdir, a.flags)
            } else {
                (arg::<abi::RenameIn>(op)?.newdir, 0)
            };
            Request::Rename {
                parent: ino,
                name: name(payload, 0)?,
                newparent,
                newname: name(payload, 1)?,
                flags,
            }
        }
        abi::FUSE_SYMLINK | abi::FUSE_LINK | abi::FUSE_MKNOD => Request::Link,
        abi::FUSE_READLINK => Request::Readlink,
        abi::FUSE_OPEN => Request::Open {
            ino,
            flags: arg::<abi::OpenIn>(op)?.flags as i32,
        },
        abi::FUSE_CREATE => {
            let a: abi::CreateIn = arg(op)?;
            Request::Create {
                parent: ino,
                name: name(payload, 0)?,
                mode: a.mode,
                umask: a.umask,
                flags: a.flags as i32,
            }
        }
        abi::FUSE_READ => {
            let a: abi::ReadIn = arg(op)?;
            Request::Read {
                fh: a.fh,
                offset: a.offset,
                size: a.size,
            }
        }
        abi::FUSE_WRITE => {
            let a: abi::WriteIn = arg(op)?;
            Request::Write {
                fh: a.fh,
                offset: a.offset,
                data: payload.get(..a.size as usize).ok_or(Errno::EINVAL)?,
                write_flags: a.write_flags,
            }
        }
        abi::FUSE_STATFS => Request::Statfs,
        abi::FUSE_RELEASE => Request::Release {
            fh: arg::<abi::ReleaseIn>(op)?.fh,
        },
        abi::FUSE_FLUSH => Request::Flush {
            fh: arg::<abi::FlushIn>(op)?.fh,
        },
        abi::FUSE_FSYNC | abi::FUSE_FSYNCDIR => Request::Fsync,
        abi::FUSE_RELEASEDIR => Request::Releasedir,
        abi::FUSE_ACCESS => Request::Access,
        abi::FUSE_DESTROY => Request::Destroy,
        abi::FUSE_OPENDIR => Request::Opendir { ino },
        abi::FUSE_READDIR => {
            let a: abi::ReadIn = arg(op)?;
            Request::Readdir {
                ino,
                offset: a.offset,
                size: a.size,
            }
        }
        abi::FUSE_SETXATTR => {
            let size = arg::<abi::SetxattrIn>(op)?.size as usize;
            let n = name(payload, 0)?;
            let value = payload
                .get(n.len() + 1..)
                .and_then(|v| v.get(..size))
                .ok_or(Errno::EINVAL)?;
            Request::Setxattr {
                ino,
                name: n,
                value,
            }
        }
        abi::FUSE_GETXATTR => Request::Getxattr {
            ino,
            name: name(payload, 0)?,
            size: arg::<abi::GetxattrIn>(op)?.size,
        },
        abi::FUSE_LISTXATTR => Request::Listxattr {
            ino,
            size: arg::<abi::GetxattrIn>(op)?.size,
        },
        abi::FUSE_REMOVEXATTR => Request::Removexattr {
            ino,
            name: name(payload, 0)?,
        },
        abi::FUSE_FALLOCATE => {
            let a: abi::FallocateIn = arg(op)?;
            Request::Fallocate {
                fh: a.fh,
                offset: a.offset,
                len: a.length,
                mode: a.mode as i32,
            }
        }
        opcode => Request::Unknown { opcode },
    })
}

/// `struct fuse_attr` of `a`.
fn fuse_attr(a: &Attr) -> abi::FuseAttr {
    let (secs, nsecs) = match a.mtime.duration_since(std::time::UNIX_EPOCH) {
        Ok(d) => (d.as_secs(), d.subsec_nanos()),
        Err(_) => (0, 0),
    };
    let (kind, nlink) = match a.kind {
        Kind::Dir => (libc::S_IFDIR, 2),
        Kind::File => (libc::S_IFREG, 1),
    };
    abi::FuseAttr {
        ino: a.ino,
        size: a.size,
        blocks: a.size.div_ceil(512),
        atime: secs,
        mtime: secs,
        ctime: secs,
        atimensec: nsecs,
        mtimensec: nsecs,
        ctimensec: nsecs,
        mode: kind | (a.mode & 0o7777),
        nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: 0,
        blksize: BLKSIZE,
        flags: 0,
    }
}

fn entry_out(a: &Attr, attr_ttl: Duration, entry_ttl: Duration) -> abi::EntryOut {
    abi::EntryOut {
        nodeid: a.ino,
        generation: 0,
        entry_valid: entry_ttl.as_secs(),
        attr_valid: attr_ttl.as_secs(),
        entry_valid_nsec: entry_ttl.subsec_nanos(),
        attr_valid_nsec: attr_ttl.subsec_nanos(),
        attr: fuse_attr(a),
    }
}

fn attr_out(a: &Attr, ttl: Duration) -> abi::AttrOut {
    abi::AttrOut {
        attr_valid: ttl.as_secs(),
        attr_valid_nsec: ttl.subsec_nanos(),
        dummy: 0,
        attr: fuse_attr(a),
    }
}

/// `struct fuse_open_out`. Backing ids of handles the ring opened are registered over its
/// descriptor ([`Registrar::Raw`]), so a fuser-registered one cannot occur (EIO).
fn open_out(o: &Opened) -> Result<abi::OpenOut, Errno> {
    let (flags, backing_id) = match o.backing {
        None => (o.flags, 0),
        Some(BackingRef::Raw(id)) => (o.flags | FopenFlags::FOPEN_PASSTHROUGH, id as i32),
        Some(BackingRef::Fuser) => {
            tracing::error!(
                fh = o.fh,
                "a fuser backing id for a handle opened over io_uring"
            );
            return Err(Errno::EIO);
        }
    };
    Ok(abi::OpenOut {
        fh: o.fh,
        open_flags: flags.bits(),
        backing_id,
    })
}

/// `fuse_dirent`s of `l` into `out`, as many as fit in `l.size` bytes; returns their size.
fn dirents(l: &Listing, out: &mut [u8]) -> usize {
    let limit = (l.size as usize).min(out.len());
    let mut n = 0;
    for (next, e) in l.iter() {
        let name = e.name.as_bytes();
        let rec = abi::dirent_size(name.len());
        if n + rec > limit {
            break;
        }
        let d = abi::Dirent {
            ino: e.ino,
            off: next,
            namelen: name.len() as u32,
            typ: u32::from(match e.kind {
                Kind::Dir => libc::DT_DIR,
                Kind::File => libc::DT_REG,
            }),
        };
        let buf = &mut out[n..n + rec];
        let Some(head) = d.write_to(buf) else { break };
        buf[head..head + name.len()].copy_from_slice(name);
        buf[head + name.len()..].fill(0);
        n += rec;
    }
    n
}

/// Writes `bytes` at the start of `out`.
fn put(out: &mut [u8], bytes: &[u8]) -> Option<usize> {
    out.get_mut(..bytes.len())?.copy_from_slice(bytes);
    Some(bytes.len())
}

/// Encodes `reply` into the payload buffer `out`; returns the bytes used, or the errno to
/// reply with.
pub fn encode(reply: &Reply, out: &mut [u8]) -> Result<usize, Errno> {
    let n = match reply {
        Reply::Entry {
            attr,
            attr_ttl,
            entry_ttl,
        } => entry_out(attr, *attr_ttl, *entry_ttl).write_to(out),
        Reply::Attr { attr, ttl } => attr_out(attr, *ttl).write_to(out),
        Reply::Open(o) => open_out(o)?.write_to(out),
        Reply::Created { attr, opened } => {
            let open = open_out(opened)?;
            let entry = entry_out(attr, Duration::ZERO, Duration::ZERO);
            entry
                .write_to(out)
                .and_then(|n| Some(n + open.write_to(out.get_mut(n..)?)?))
        }
        Reply::Data(d) | Reply::Xattr(XattrAnswer::Data(d)) => put(out, d),
        Reply::Written(n) => abi::WriteOut {
            size: *n,
            padding: 0,
        }
        .write_to(out),
        Reply::Statfs(s) => abi::StatfsOut {
            blocks: s.blocks,
            bfree: s.bfree,
            bavail: s.bavail,
            files: s.files,
            ffree: s.ffree,
            bsize: s.bsize,
            namelen: s.namelen,
            frsize: s.frsize,
            padding: 0,
            spare: [0; 6],
        }
        .write_to(out),
        Reply::Xattr(XattrAnswer::Size(n)) => abi::GetxattrOut {
            size: *n,
            padding: 0,
        }
        .write_to(out),
        Reply::Dir(l) => Some(dirents(l, out)),
        Reply::Empty => Some(0),
        Reply::Err(e) => return Err(*e),
    };
    n.ok_or_else(|| {
        tracing::warn!("a reply larger than the ring's payload buffer");
        Errno::EIO
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::attr;

    fn header(opcode: u32, nodeid: u64) -> abi::InHeader {
        abi::InHeader {
            opcode,
            unique: 42,
            nodeid,
            ..Default::default()
        }
    }

    /// A zero-filled op area holding `arg`.
    fn op_area(arg: &impl Plain) -> [u8; abi::URING_OP_IN_OUT_SZ] {
        let mut op = [0; abi::URING_OP_IN_OUT_SZ];
        arg.write_to(&mut op).unwrap();
        op
    }

    #[test]
    fn setattr_decodes_the_valid_fields_only() {
        let mut a = abi::SetattrIn {
            valid: abi::FATTR_MODE | abi::FATTR_UID | abi::FATTR_GID | abi::FATTR_SIZE,
            size: 1 << 40,
            mode: 0o100600,
            uid: 3,
            gid: 4,
            ..Default::default()
        };
        let h = header(abi::FUSE_SETATTR, 9);
        let want = Request::Setattr {
            ino: 9,
            mode: Some(0o100600),
            uid: Some(3),
            gid: Some(4),
            size: Some(1 << 40),
        };
        assert_eq!(decode(&h, &op_area(&a), &[]), Ok(want));
        a.valid = abi::FATTR_MODE;
        let want = Request::Setattr {
            ino: 9,
            mode: Some(0o100600),
            uid: None,
            gid: None,
            size: None,
        };
        assert_eq!(decode(&h, &op_area(&a), &[]), Ok(want));
    }

    #[test]
    fn writes_and_names_decode_within_the_payload() {
        // A page of a mapping written back: FUSE_WRITE_CACHE, any writable handle.
        let w = abi::WriteIn {
            fh: 5,
            offset: 4096,
            size: 3,
            write_flags: abi::FUSE_WRITE_CACHE,
            ..Default::default()
        };
        let h = header(abi::FUSE_WRITE, 7);
        let want = Request::Write {
            fh: 5,
            offset: 4096,
            data: b"abc",
            write_flags: abi::FUSE_WRITE_CACHE,
        };
        assert_eq!(decode(&h, &op_area(&w), b"abcdef"), Ok(want));
        assert_eq!(decode(&h, &op_area(&w), b"ab"), Err(Errno::EINVAL));

        let r = abi::Rename2In {
            newdir: 3,
            flags: libc::RENAME_NOREPLACE,
            padding: 0,
        };
        let h = header(abi::FUSE_RENAME2, 2);
        let want = Request::Rename {
            parent: 2,
            name: b"a",
            newparent: 3,
            newname: b"bc",
            flags: libc::RENAME_NOREPLACE,
        };
        assert_eq!(decode(&h, &op_area(&r), b"a\0bc\0"), Ok(want));
        assert_eq!(decode(&h, &op_area(&r), b"a\0bc"), Err(Errno::EINVAL));

        let x = abi::SetxattrIn {
            size: 1,
            ..Default::default()
        };
        let h = header(abi::FUSE_SETXATTR, 7);
        let want = Request::Setxattr {
            ino: 7,
            name: b"user.maru.pinned",
            value: b"1",
        };
        let payload = b"user.maru.pinned\x001";
        assert_eq!(decode(&h, &op_area(&x), payload), Ok(want));
        assert_eq!(
            decode(&h, &op_area(&x), b"user.maru.pinned\0"),
            Err(Errno::EINVAL)
        );
        let h = header(99, 1);
        assert_eq!(
            decode(&h, &[0; 128], &[]),
            Ok(Request::Unknown { opcode: 99 })
        );
    }

    #[test]
    fn entry_and_attr_replies_match_the_kernel() {
        let mut a = attr(7, true);
        a.size = 4097;
        a.mode = 0o640;
        a.uid = 1;
        a.gid = 2;
        a.mtime = std::time::UNIX_EPOCH + Duration::new(5, 6);
        let mut out = [0xffu8; 256];
        let reply = Reply::Entry {
            attr: a.clone(),
            attr_ttl: Duration::from_millis(1500),
            entry_ttl: Duration::from_secs(3600),
        };
        assert_eq!(encode(&reply, &mut out), Ok(128));
        let e = abi::EntryOut::read_from(&out).unwrap();
        assert_eq!(e.nodeid, 7);
        assert_eq!(e.generation, 0);
        assert_eq!((e.entry_valid, e.entry_valid_nsec), (3600, 0));
        assert_eq!((e.attr_valid, e.attr_valid_nsec), (1, 500_000_000));
        let fa = e.attr;
        assert_eq!((fa.ino, fa.size, fa.blocks), (7, 4097, 9));
        assert_eq!((fa.atime, fa.mtime, fa.ctime), (5, 5, 5));
        assert_eq!((fa.atimensec, fa.mtimensec, fa.ctimensec), (6, 6, 6));
        assert_eq!(fa.mode, libc::S_IFREG | 0o640);
        assert_eq!((fa.nlink, fa.uid, fa.gid, fa.rdev), (1, 1, 2, 0));
        assert_eq!((fa.blksize, fa.flags), (BLKSIZE, 0));

        let reply = Reply::Attr {
            attr: attr(1, false),
            ttl: Duration::from_secs(1),
        };
        assert_eq!(encode(&reply, &mut out), Ok(104));
        let o = abi::AttrOut::read_from(&out).unwrap();
        assert_eq!((o.attr_valid, o.attr_valid_nsec, o.dummy), (1, 0, 0));
        assert_eq!(o.attr.mode, libc::S_IFDIR | 0o644);
        assert_eq!(o.attr.nlink, 2);
        // Too small a buffer: EIO, not a truncated reply.
        assert_eq!(encode(&reply, &mut out[..100]), Err(Errno::EIO));
    }

    #[test]
    fn open_replies_name_their_backing() {
        let mut out = [0u8; 256];
        let opened = Opened {
            fh: 3,
            flags: FopenFlags::FOPEN_NOFLUSH,
            backing: Some(BackingRef::Raw(12)),
        };
        let reply = Reply::Created {
            attr: attr(7, false),
            opened,
        };
        assert_eq!(encode(&reply, &mut out), Ok(144));
        let o = abi::OpenOut::read_from(&out[128..]).unwrap();
        let flags = FopenFlags::FOPEN_NOFLUSH | FopenFlags::FOPEN_PASSTHROUGH;
        assert_eq!((o.fh, o.open_flags, o.backing_id), (3, flags.bits(), 12));
        let direct = Opened {
            fh: 4,
            flags: FopenFlags::FOPEN_DIRECT_IO,
            backing: None,
        };
        assert_eq!(encode(&Reply::Open(direct), &mut out), Ok(16));
        let o = abi::OpenOut::read_from(&out).unwrap();
        let direct_io = FopenFlags::FOPEN_DIRECT_IO.bits();
        assert_eq!((o.fh, o.open_flags, o.backing_id), (4, direct_io, 0));
        let fuser = Opened {
            backing: Some(BackingRef::Fuser),
            ..direct
        };
        assert_eq!(encode(&Reply::Open(fuser), &mut out), Err(Errno::EIO));
    }

    #[test]
    fn dirents_are_padded_and_bounded() {
        let entry = |ino, name: &str| crate::backend::DirEntry {
            ino,
            name: name.into(),
            kind: Kind::File,
        };
        let entries = vec![entry(1, "."), entry(8, "abcdefghi"), entry(9, "z")];
        let mut out = [0xffu8; 256];
        let l = Listing {
            entries: entries.clone(),
            from: 1,
            size: 4096,
        };
        assert_eq!(encode(&Reply::Dir(l), &mut out), Ok(40 + 32));
        let d = abi::Dirent::read_from(&out).unwrap();
        assert_eq!((d.ino, d.off, d.namelen), (8, 2, 9));
        assert_eq!(d.typ, u32::from(libc::DT_REG));
        assert_eq!(&out[24..33], b"abcdefghi");
        assert_eq!(&out[33..40], &[0; 7]);
        let d = abi::Dirent::read_from(&out[40..]).unwrap();
        assert_eq!((d.ino, d.off, d.namelen), (9, 3, 1));
        assert_eq!(&out[64..72], b"z\0\0\0\0\0\0\0");
        // Only whole entries within the size asked for.
        let l = Listing {
            entries,
            from: 1,
            size: 71,
        };
        assert_eq!(encode(&Reply::Dir(l), &mut out), Ok(40));
    }
}
