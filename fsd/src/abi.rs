//! The kernel's FUSE structures, as `include/uapi/linux/fuse.h` lays them out (protocol 7.4x,
//! Linux 6.18), for the io_uring transport ([`crate::ring`]), which reads and writes them
//! itself. Each is a `#[repr(C)]` mirror whose size is checked against the kernel's at compile
//! time; [`Plain`] reads one from (and writes one into) a byte buffer, with a length check and
//! no alignment requirement. Native byte order, as the kernel uses.
//!
//! fuser has the same definitions but keeps them private.

/// A kernel structure that is plain bytes.
///
/// # Safety
///
/// Implementors are `#[repr(C)]`, made of integers and arrays of integers only, without
/// implicit padding (the kernel's layouts name their padding): every byte pattern is a valid
/// value, and every byte of a value is initialized.
pub unsafe trait Plain: Copy {
    /// The value at the start of `bytes`; None when `bytes` is too short.
    fn read_from(bytes: &[u8]) -> Option<Self> {
        if bytes.len() < size_of::<Self>() {
            return None;
        }
        // SAFETY: `bytes` holds at least size_of::<Self>() bytes; any bytes are a valid Self
        // (trait contract); read_unaligned has no alignment requirement.
        Some(unsafe { bytes.as_ptr().cast::<Self>().read_unaligned() })
    }

    /// The value's bytes.
    fn as_bytes(&self) -> &[u8] {
        // SAFETY: `self` is size_of::<Self>() initialized bytes (no padding: trait contract),
        // borrowed for the slice's lifetime.
        unsafe { std::slice::from_raw_parts((self as *const Self).cast::<u8>(), size_of::<Self>()) }
    }

    /// Writes the value at the start of `out`; returns its size, or None when `out` is too
    /// short.
    fn write_to(&self, out: &mut [u8]) -> Option<usize> {
        let b = self.as_bytes();
        out.get_mut(..b.len())?.copy_from_slice(b);
        Some(b.len())
    }
}

/// Implements [`Plain`] for kernel structures and checks each one's size against the kernel's.
macro_rules! plain {
    ($($t:ty = $size:expr;)*) => {
        $(
            const _: () = assert!(size_of::<$t>() == $size);
            // SAFETY: a #[repr(C)] struct of integers whose size is the sum of its fields'
            // (checked above against the kernel's size, padding fields included).
            unsafe impl Plain for $t {}
        )*
    };
}

// Opcodes (`enum fuse_opcode`).
pub const FUSE_LOOKUP: u32 = 1;
pub const FUSE_GETATTR: u32 = 3;
pub const FUSE_SETATTR: u32 = 4;
pub const FUSE_READLINK: u32 = 5;
pub const FUSE_SYMLINK: u32 = 6;
pub const FUSE_MKNOD: u32 = 8;
pub const FUSE_MKDIR: u32 = 9;
pub const FUSE_UNLINK: u32 = 10;
pub const FUSE_RMDIR: u32 = 11;
pub const FUSE_RENAME: u32 = 12;
pub const FUSE_LINK: u32 = 13;
pub const FUSE_OPEN: u32 = 14;
pub const FUSE_READ: u32 = 15;
pub const FUSE_WRITE: u32 = 16;
pub const FUSE_STATFS: u32 = 17;
pub const FUSE_RELEASE: u32 = 18;
pub const FUSE_FSYNC: u32 = 20;
pub const FUSE_SETXATTR: u32 = 21;
pub const FUSE_GETXATTR: u32 = 22;
pub const FUSE_LISTXATTR: u32 = 23;
pub const FUSE_REMOVEXATTR: u32 = 24;
pub const FUSE_FLUSH: u32 = 25;
pub const FUSE_OPENDIR: u32 = 27;
pub const FUSE_READDIR: u32 = 28;
pub const FUSE_RELEASEDIR: u32 = 29;
pub const FUSE_FSYNCDIR: u32 = 30;
pub const FUSE_ACCESS: u32 = 34;
pub const FUSE_CREATE: u32 = 35;
pub const FUSE_DESTROY: u32 = 38;
pub const FUSE_FALLOCATE: u32 = 43;
pub const FUSE_RENAME2: u32 = 45;

// `fuse_setattr_in.valid` bits.
pub const FATTR_MODE: u32 = 1 << 0;
pub const FATTR_UID: u32 = 1 << 1;
pub const FATTR_GID: u32 = 1 << 2;
pub const FATTR_SIZE: u32 = 1 << 3;

/// `fuse_write_in.write_flags`: the write comes from the page cache (a mapping written back),
/// so its pid, uid and gid are not the writer's, and its fh is any writable handle of the
/// inode.
pub const FUSE_WRITE_CACHE: u32 = 1 << 0;

/// `struct fuse_attr`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FuseAttr {
    pub ino: u64,
    pub size: u64,
    pub blocks: u64,
    pub atime: u64,
    pub mtime: u64,
    pub ctime: u64,
    pub atimensec: u32,
    pub mtimensec: u32,
    pub ctimensec: u32,
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    pub blksize: u32,
    pub flags: u32,
}

/// `struct fuse_entry_out`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EntryOut {
    pub nodeid: u64,
    pub generation: u64,
    pub entry_valid: u64,
    pub attr_valid: u64,
    pub entry_valid_nsec: u32,
    pub attr_valid_nsec: u32,
    pub attr: FuseAttr,
}

/// `struct fuse_attr_out`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttrOut {
    pub attr_valid: u64,
    pub attr_valid_nsec: u32,
    pub dummy: u32,
    pub attr: FuseAttr,
}

/// `struct fuse_open_out`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpenOut {
    pub fh: u64,
    pub open_flags: u32,
    pub backing_id: i32,
}

/// `struct fuse_setattr_in`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SetattrIn {
    pub valid: u32,
    pub padding: u32,
    pub fh: u64,
    pub size: u64,
    pub lock_owner: u64,
    pub atime: u64,
    pub mtime: u64,
    pub ctime: u64,
    pub atimensec: u32,
    pub mtimensec: u32,
    pub ctimensec: u32,
    pub mode: u32,
    pub unused4: u32,
    pub uid: u32,
    pub gid: u32,
    pub unused5: u32,
}

/// `struct fuse_mkdir_in`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MkdirIn {
    pub mode: u32,
    pub umask: u32,
}

/// `struct fuse_rename_in` (RENAME).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RenameIn {
    pub newdir: u64,
}

/// `struct fuse_rename2_in` (RENAME2).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rename2In {
    pub newdir: u64,
    pub flags: u32,
    pub padding: u32,
}

/// `struct fuse_open_in` (OPEN, OPENDIR).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpenIn {
    pub flags: u32,
    pub open_flags: u32,
}

/// `struct fuse_create_in`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CreateIn {
    pub flags: u32,
    pub mode: u32,
    pub umask: u32,
    pub open_flags: u32,
}

/// `struct fuse_release_in` (RELEASE, RELEASEDIR).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReleaseIn {
    pub fh: u64,
    pub flags: u32,
    pub release_flags: u32,
    pub lock_owner: u64,
}

/// `struct fuse_flush_in`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlushIn {
    pub fh: u64,
    pub unused: u32,
    pub padding: u32,
    pub lock_owner: u64,
}

/// `struct fuse_read_in` (READ, READDIR).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadIn {
    pub fh: u64,
    pub offset: u64,
    pub size: u32,
    pub read_flags: u32,
    pub lock_owner: u64,
    pub flags: u32,
    pub padding: u32,
}

/// `struct fuse_write_in`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteIn {
    pub fh: u64,
    pub offset: u64,
    pub size: u32,
    pub write_flags: u32,
    pub lock_owner: u64,
    pub flags: u32,
    pub padding: u32,
}

/// `struct fuse_write_out`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteOut {
    pub size: u32,
    pub padding: u32,
}

/// `struct fuse_getxattr_in` (GETXATTR, LISTXATTR).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GetxattrIn {
    pub size: u32,
    pub padding: u32,
}

/// `struct fuse_getxattr_out`: the size of a value, when asked for it (size 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GetxattrOut {
    pub size: u32,
    pub padding: u32,
}

/// `struct fuse_setxattr_in`. Without `FUSE_SETXATTR_EXT` (not negotiated) the kernel sends
/// only its first 8 bytes (`FUSE_COMPAT_SETXATTR_IN_SIZE`); over io_uring it lands in the
/// zero-filled 128-byte op header either way.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SetxattrIn {
    pub size: u32,
    pub flags: u32,
    pub setxattr_flags: u32,
    pub padding: u32,
}

/// `struct fuse_fallocate_in`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FallocateIn {
    pub fh: u64,
    pub offset: u64,
    pub length: u64,
    pub mode: u32,
    pub padding: u32,
}

/// `struct fuse_kstatfs`, alone in `struct fuse_statfs_out`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatfsOut {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
    pub padding: u32,
    pub spare: [u32; 6],
}

/// `struct fuse_dirent` without its name: the name follows, then zeros up to a multiple of
/// 8 bytes ([`dirent_size`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Dirent {
    pub ino: u64,
    /// Offset of the next entry (what the next READDIR passes back).
    pub off: u64,
    pub namelen: u32,
    /// `DT_*`.
    pub typ: u32,
}

/// Bytes a `fuse_dirent` with a name of `namelen` bytes takes (`FUSE_DIRENT_SIZE`).
pub const fn dirent_size(namelen: usize) -> usize {
    (size_of::<Dirent>() + namelen).next_multiple_of(8)
}

/// `struct fuse_in_header`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InHeader {
    pub len: u32,
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
    /// Length of the extensions after the arguments, in 8-byte units. None is negotiated at
    /// INIT, so none follows.
    pub total_extlen: u16,
    pub padding: u16,
}

/// `struct fuse_out_header`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OutHeader {
    pub len: u32,
    /// 0 or a negated errno.
    pub error: i32,
    pub unique: u64,
}

/// `FUSE_URING_IN_OUT_HEADER_SZ`, `FUSE_URING_OP_IN_OUT_SZ`.
pub const URING_IN_OUT_HEADER_SZ: usize = 128;
pub const URING_OP_IN_OUT_SZ: usize = 128;

/// `struct fuse_uring_ent_in_out`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UringEntInOut {
    pub flags: u64,
    /// The id to commit the reply with.
    pub commit_id: u64,
    /// Bytes used in the payload buffer: the request's arguments after the op header, or the
    /// reply's.
    pub payload_sz: u32,
    pub padding: u32,
    pub reserved: u64,
}

/// `struct fuse_uring_req_header`: the first buffer of a ring entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UringReqHeader {
    /// A [`InHeader`] (request) or [`OutHeader`] (reply), zero-padded.
    pub in_out: [u8; URING_IN_OUT_HEADER_SZ],
    /// The op's own header (the request's first argument, `in_args[0]`), zero-padded.
    pub op_in: [u8; URING_OP_IN_OUT_SZ],
    pub ring_ent_in_out: UringEntInOut,
}

impl Default for UringReqHeader {
    fn default() -> Self {
        UringReqHeader {
            in_out: [0; URING_IN_OUT_HEADER_SZ],
            op_in: [0; URING_OP_IN_OUT_SZ],
            ring_ent_in_out: UringEntInOut::default(),
        }
    }
}

/// `enum fuse_uring_cmd`.
pub const FUSE_IO_URING_CMD_REGISTER: u32 = 1;
pub const FUSE_IO_URING_CMD_COMMIT_AND_FETCH: u32 = 2;

/// `FUSE_URING_IOV_SEGS`: a ring entry registers two buffers, a [`UringReqHeader`] and the
/// payload; REGISTER's SQE passes their iovecs with `len` this count.
pub const URING_IOV_SEGS: u32 = 2;

/// `struct fuse_uring_cmd_req`, in the command area of a URING_CMD SQE.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UringCmdReq {
    pub flags: u64,
    /// The request a COMMIT_AND_FETCH answers (its `unique`).
    pub commit_id: u64,
    /// The queue (CPU) the command is for.
    pub qid: u16,
    pub padding: [u8; 6],
}

/// The head of `struct io_uring_sqe` (include/uapi/linux/io_uring.h), through `user_data`.
/// The io-uring crate's URING_CMD builder has no setter for `len`, which REGISTER needs
/// ([`URING_IOV_SEGS`]); [`Sqe128`] lets the ring set it by name.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SqeHead {
    pub opcode: u8,
    pub flags: u8,
    pub ioprio: u16,
    pub fd: i32,
    /// `off`, or `cmd_op` and padding for URING_CMD.
    pub off: u64,
    pub addr: u64,
    /// Buffer size, or number of iovecs.
    pub len: u32,
    /// `rw_flags`, or `uring_cmd_flags`.
    pub op_flags: u32,
    pub user_data: u64,
}

/// A 128-byte SQE (`IORING_SETUP_SQE128`): [`SqeHead`], then the rest of `io_uring_sqe`
/// and the 80-byte command area, untouched.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sqe128 {
    pub head: SqeHead,
    pub rest: [u8; 128 - size_of::<SqeHead>()],
}

plain! {
    FuseAttr = 88;
    EntryOut = 128;
    AttrOut = 104;
    OpenOut = 16;
    SetattrIn = 88;
    MkdirIn = 8;
    RenameIn = 8;
    Rename2In = 16;
    OpenIn = 8;
    CreateIn = 16;
    ReleaseIn = 24;
    FlushIn = 24;
    ReadIn = 40;
    WriteIn = 40;
    WriteOut = 8;
    GetxattrIn = 8;
    GetxattrOut = 8;
    SetxattrIn = 16;
    FallocateIn = 32;
    StatfsOut = 80;
    Dirent = 24;
    InHeader = 40;
    OutHeader = 16;
    UringEntInOut = 32;
    UringReqHeader = 288;
    UringCmdReq = 24;
    SqeHead = 40;
    Sqe128 = 128;
}

// Where the kernel reads `len` (and `addr`) of an SQE.
const _: () = assert!(std::mem::offset_of!(SqeHead, addr) == 16);
const _: () = assert!(std::mem::offset_of!(SqeHead, len) == 24);
// The op headers the ring reads all fit in `op_in`.
const _: () = assert!(size_of::<SetattrIn>() <= URING_OP_IN_OUT_SZ);
const _: () = assert!(size_of::<InHeader>() <= URING_IN_OUT_HEADER_SZ);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_need_enough_bytes_but_no_alignment() {
        let mut buf = [0u8; 41];
        let h = InHeader {
            len: 40,
            opcode: FUSE_OPEN,
            unique: 9,
            nodeid: 7,
            uid: 1,
            gid: 2,
            pid: 3,
            total_extlen: 0,
            padding: 0,
        };
        assert_eq!(h.write_to(&mut buf[1..]), Some(40));
        assert_eq!(InHeader::read_from(&buf[1..]), Some(h));
        assert_eq!(InHeader::read_from(&buf[2..]), None);
        assert_eq!(h.write_to(&mut buf[2..]), None);
    }

    #[test]
    fn field_offsets_match_the_kernel() {
        use std::mem::offset_of;
        assert_eq!(offset_of!(SetattrIn, size), 16);
        assert_eq!(offset_of!(SetattrIn, mode), 68);
        assert_eq!(offset_of!(SetattrIn, uid), 76);
        assert_eq!(offset_of!(SetattrIn, gid), 80);
        assert_eq!(offset_of!(EntryOut, attr), 40);
        assert_eq!(offset_of!(AttrOut, attr), 16);
        assert_eq!(offset_of!(FuseAttr, mode), 60);
        assert_eq!(offset_of!(UringReqHeader, op_in), 128);
        assert_eq!(offset_of!(UringReqHeader, ring_ent_in_out), 256);
        assert_eq!(offset_of!(UringEntInOut, payload_sz), 16);
        assert_eq!(offset_of!(UringCmdReq, qid), 16);
        assert_eq!(offset_of!(FallocateIn, mode), 24);
        assert_eq!(offset_of!(Rename2In, flags), 8);
    }

    #[test]
    fn dirents_are_padded_to_8_bytes() {
        assert_eq!(dirent_size(0), 24);
        assert_eq!(dirent_size(1), 32);
        assert_eq!(dirent_size(8), 32);
        assert_eq!(dirent_size(9), 40);
    }
}
