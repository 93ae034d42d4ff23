//! What the filesystem needs from the store.

use std::fs::File;
use std::sync::Arc;
use std::time::SystemTime;

use maru::Result;

/// Inode number of the mount's root.
pub const ROOT_INO: u64 = 1;

/// Who is asking (from the FUSE request or `SO_PEERCRED`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Supplementary groups, looked up at most once, when first needed (see
    /// [`Caller::in_group`]): most requests never need them.
    groups: std::sync::OnceLock<Vec<u32>>,
    /// Process id (of the thread, for FUSE requests).
    pub pid: i32,
    /// Thread group of `pid`, looked up at most once (see [`Caller::tgid`]).
    pub tgid: std::sync::OnceLock<i32>,
}

/// Reads a `/proc` file of a process that may be blocked on us: a FUSE request from a task
/// in the middle of `execve` (closing its close-on-exec descriptors) holds locks that some
/// `/proc/<pid>` files wait for, and the task waits for our reply. So the read runs on a
/// reader thread and is given up after 50 ms; a reader stuck that way is retired (it
/// finishes once we have replied) and a new one takes its place.
///
/// One reader per CPU, pinned to it: the caller (a FUSE queue thread pinned to the same CPU)
/// hands it the path and sleeps, so the reader runs at once on that CPU instead of waking
/// another, possibly halted, one. Spawning a thread per read cost 40-60 µs here.
pub fn read_proc_bounded(path: String) -> Option<String> {
    type Job = (String, std::sync::mpsc::SyncSender<Option<String>>);
    /// The idle reader of a CPU. A caller takes it out while it reads, so that no other
    /// read ever waits behind one that got stuck.
    type Slot = parking_lot::Mutex<Option<std::sync::mpsc::Sender<Job>>>;
    static READERS: std::sync::OnceLock<Vec<Slot>> = std::sync::OnceLock::new();
    let readers = READERS.get_or_init(|| {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        (0..n.max(1))
            .map(|_| parking_lot::Mutex::new(None))
            .collect()
    });
    let cpu = nix::sched::sched_getcpu().unwrap_or(0) % readers.len();
    let slot = &readers[cpu];
    let idle = slot.lock().take();
    let tx = match idle {
        Some(tx) => tx,
        None => {
            let (tx, rx) = std::sync::mpsc::channel::<Job>();
            std::thread::Builder::new()
                .name(format!("maru-procfs{cpu}"))
                .spawn(move || {
                    pin_thread(cpu);
                    for (path, reply) in rx {
                        // The asker may have given up (timed out): nobody wants the answer.
                        let _ = reply.send(std::fs::read_to_string(path).ok());
                    }
                })
                .ok()?;
            tx
        }
    };
    let (reply, result) = std::sync::mpsc::sync_channel(1);
    tx.send((path, reply)).ok()?;
    // On a timeout the reader is dropped, not put back: it ends after its stuck read.
    let v = result
        .recv_timeout(std::time::Duration::from_millis(50))
        .ok()?;
    let mut g = slot.lock();
    if g.is_none() {
        *g = Some(tx);
    }
    v
}

/// Pins the calling thread to `cpu` (best effort: a failure is logged and the thread runs
/// unpinned, which only costs speed).
pub fn pin_thread(cpu: usize) {
    let mut set = nix::sched::CpuSet::new();
    let r = set
        .set(cpu)
        .and_then(|()| nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set));
    if let Err(e) = r {
        tracing::debug!(cpu, "pinning a thread: {e}");
    }
}

/// The supplementary groups listed in the text of a `/proc/<pid>/status` file.
pub fn parse_groups(status: &str) -> Vec<u32> {
    status
        .lines()
        .find(|l| l.starts_with("Groups:"))
        .map(|l| {
            l["Groups:".len()..]
                .split_whitespace()
                .filter_map(|g| g.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The thread group (process) id of thread `pid`.
pub fn tgid_of(pid: i32) -> i32 {
    read_proc_bounded(format!("/proc/{pid}/status"))
        .and_then(|s| parse_tgid(&s))
        .unwrap_or(pid)
}

/// The thread group in the text of a `/proc/<pid>/status` file.
pub fn parse_tgid(status: &str) -> Option<i32> {
    status
        .lines()
        .find(|l| l.starts_with("Tgid:"))
        .and_then(|l| l["Tgid:".len()..].trim().parse().ok())
}

/// True if task `pid` is exiting because a signal killed it (its descriptors are being
/// closed by the kernel, not by the program): `PF_EXITING` and `PF_SIGNALED` in its flags
/// (`/proc/<pid>/stat`), which the kernel sets before it closes a dying task's files.
pub fn killed_by_signal(pid: i32) -> bool {
    const PF_EXITING: u64 = 0x4;
    const PF_SIGNALED: u64 = 0x400;
    let Some(stat) = read_proc_bounded(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // Fields after the command name (which may contain spaces): field 3 is the state.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return false;
    };
    let flags: u64 = rest
        .split_whitespace()
        .nth(9 - 3)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    flags & PF_EXITING != 0 && flags & PF_SIGNALED != 0
}

impl Caller {
    /// A caller whose supplementary groups are read from `/proc/<pid>/status` if and when a
    /// permission check needs them.
    pub fn new(uid: u32, gid: u32, pid: i32) -> Self {
        Caller {
            uid,
            gid,
            groups: std::sync::OnceLock::new(),
            pid,
            tgid: std::sync::OnceLock::new(),
        }
    }

    /// A caller with these supplementary groups.
    pub fn with_group_list(uid: u32, gid: u32, pid: i32, groups: Vec<u32>) -> Self {
        let c = Caller::new(uid, gid, pid);
        let _ = c.groups.set(groups);
        c
    }

    /// The caller with its supplementary groups (and thread group) from one read of
    /// `/proc/<pid>/status` now; root needs no groups.
    pub fn with_groups(uid: u32, gid: u32, pid: i32) -> Self {
        let c = Caller::new(uid, gid, pid);
        c.groups();
        c
    }

    /// Root.
    pub fn root() -> Self {
        Caller::with_group_list(0, 0, 0, Vec::new())
    }

    /// The caller's thread group (process), looked up once.
    pub fn tgid(&self) -> i32 {
        *self.tgid.get_or_init(|| tgid_of(self.pid))
    }

    /// The caller's supplementary groups (read once; none for root, or when unreadable).
    pub fn groups(&self) -> &[u32] {
        self.groups.get_or_init(|| {
            if self.uid == 0 || self.pid <= 0 {
                return Vec::new();
            }
            match read_proc_bounded(format!("/proc/{}/status", self.pid)) {
                Some(s) => {
                    if let Some(t) = parse_tgid(&s) {
                        let _ = self.tgid.set(t);
                    }
                    parse_groups(&s)
                }
                None => Vec::new(),
            }
        })
    }

    /// True if the caller is in group `gid` (its primary group, else a supplementary one).
    pub fn in_group(&self, gid: u32) -> bool {
        self.gid == gid || self.groups().contains(&gid)
    }
}

/// Kind of a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A namespace.
    Dir,
    /// An entry.
    File,
}

/// Attributes of a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attr {
    /// Inode number.
    pub ino: u64,
    /// Kind.
    pub kind: Kind,
    /// Size in bytes.
    pub size: u64,
    /// Permission bits.
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Modification time.
    pub mtime: SystemTime,
    /// Sealed (immutable) entry; false for a file being written and for directories.
    pub sealed: bool,
}

/// A directory listing item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    /// Inode number.
    pub ino: u64,
    /// Name.
    pub name: String,
    /// Kind.
    pub kind: Kind,
}

/// How an opened file is served.
#[derive(Debug, Clone)]
pub enum OpenedFile {
    /// A sealed entry, by the kernel, passing through to this backing file (memfs pools):
    /// read and mmap never reach the daemon.
    Passthrough(Arc<File>),
    /// A sealed entry, by the daemon, copying (raw pools). Immutable: the kernel may cache it.
    Copy,
    /// An entry being written: every `read` and `write` goes to the daemon
    /// (`FOPEN_DIRECT_IO`), so the store sees each write's outcome and never publishes an entry
    /// one of whose writes failed. With a file (memfs pools), mappings pass through to it
    /// (`FOPEN_DIRECT_IO | FOPEN_PASSTHROUGH`: the kernel sends read and write to the daemon
    /// and maps the backing file): a writer filling its entry through a mapping writes the
    /// pool's pages, and a page the pool cannot give it is a `SIGBUS` that kills it, which
    /// abandons the entry. Without one (raw pools), mappings are allowed
    /// (`FUSE_DIRECT_IO_ALLOW_MMAP`) and written back through the daemon.
    Writing(Option<Arc<File>>),
}

/// `user.maru.*` attributes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Xattr {
    /// Name without the `user.maru.` prefix.
    pub name: &'static str,
    /// Value.
    pub value: String,
}

/// The store, as the filesystem sees it. Names are single components.
pub trait Backend: Send + Sync + 'static {
    /// Looks up `name` in directory `parent`. Entries being written are visible only to
    /// the process that creates them.
    fn lookup(&self, c: &Caller, parent: u64, name: &str) -> Result<Attr>;
    /// Attributes of a node (including a file being written, for its writer).
    fn getattr(&self, ino: u64) -> Result<Attr>;
    /// Lists a directory.
    fn readdir(&self, c: &Caller, ino: u64) -> Result<Vec<DirEntry>>;
    /// Creates a namespace.
    fn mkdir(&self, c: &Caller, parent: u64, name: &str, mode: u32) -> Result<Attr>;
    /// Removes an empty namespace.
    fn rmdir(&self, c: &Caller, parent: u64, name: &str) -> Result<()>;
    /// Creates an entry in the WRITING state.
    fn create(&self, c: &Caller, parent: u64, name: &str, mode: u32) -> Result<(Attr, OpenedFile)>;
    /// Opens a node: sealed entries read-only; a WRITING entry only by its creating process.
    fn open(&self, c: &Caller, ino: u64, write: bool) -> Result<OpenedFile>;
    /// Opens read-only a sealed entry whose backing file the filesystem still holds: the
    /// checks and bookkeeping of [`Backend::open`] (it exists, it was used) without opening
    /// its file.
    fn reopen(&self, c: &Caller, ino: u64) -> Result<()> {
        self.open(c, ino, false).map(drop)
    }
    /// A read handle of `ino` that [`Backend::open`] served as [`OpenedFile::Copy`] was
    /// released: what that open took (a lease on the entry) goes. Other handles' releases are
    /// not told.
    fn close(&self, _ino: u64) {}
    /// A writable descriptor of an entry being written was closed (`close(2)`, the FLUSH
    /// request; every close of every descriptor sends one). The store checks that the entry
    /// can be published as it stands (none of its writes failed, its name is free, it fits the
    /// namespace's quota and the pool) and reserves what it checked, so that the publication
    /// at release cannot fail for those reasons; lookups by other processes may then wait for
    /// it. An error is `close`'s return value, and the entry will never be published.
    /// `abandoned` when the closing process is dying of a signal: the entry is then dropped.
    fn commit(&self, c: &Caller, ino: u64, abandoned: bool) -> Result<()>;
    /// Reserves pool space for `[offset, offset + len)` of the entry being written `ino`
    /// (`fallocate` mode 0), growing it if that range ends past its size.
    fn fallocate(&self, ino: u64, offset: u64, len: u64) -> Result<()>;
    /// Called when the last writable handle of a WRITING entry is released: publishes it
    /// (when its last commit succeeded and nothing failed since).
    fn seal(&self, ino: u64) -> Result<()>;
    /// Drops a WRITING entry that will never be sealed.
    fn abort(&self, ino: u64);
    /// Sets the size of a WRITING entry.
    fn truncate(&self, ino: u64, size: u64) -> Result<Attr>;
    /// Changes mode/owner of a namespace (entries: mode only, by their owner).
    fn chmod_chown(
        &self,
        c: &Caller,
        ino: u64,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
    ) -> Result<Attr>;
    /// Reads bytes of an entry served by the daemon ([`OpenedFile::Copy`] or
    /// [`OpenedFile::Writing`]).
    fn read(&self, ino: u64, offset: u64, len: u32) -> Result<Vec<u8>>;
    /// Writes bytes of a WRITING entry: all of them or an error (never a short count). A
    /// failed write marks the entry failed: it will not be published.
    fn write(&self, ino: u64, offset: u64, data: &[u8]) -> Result<u32>;
    /// Deletes an entry.
    fn unlink(&self, c: &Caller, parent: u64, name: &str) -> Result<()>;
    /// Renames an entry (publishing a finished WRITING one). Names are write-once: a rename
    /// onto a name taken fails (`EEXIST`), with or without RENAME_NOREPLACE; the filesystem
    /// refuses RENAME_EXCHANGE and RENAME_WHITEOUT before asking.
    fn rename(
        &self,
        c: &Caller,
        parent: u64,
        name: &str,
        newparent: u64,
        newname: &str,
    ) -> Result<()>;
    /// (total bytes, free bytes, entries) of all pools.
    fn statfs(&self) -> (u64, u64, u64);
    /// The `user.maru.*` attributes of a node.
    fn xattrs(&self, ino: u64) -> Result<Vec<Xattr>>;
    /// Sets `user.maru.pinned`.
    fn set_pinned(&self, c: &Caller, ino: u64, pinned: bool) -> Result<()>;
    /// Whether what the request just served changed is durable: an error when a record it
    /// wrote could not be synced (taken once; asked before and after each request that
    /// changes the store, which then fails with it).
    fn settled(&self) -> Result<()> {
        Ok(())
    }
    /// Counts one FUSE upcall (metrics).
    fn count_upcall(&self, _op: Upcall) {}
}

/// The FUSE requests marud counts (`maructl status`: `fuse_<name>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Upcall {
    Lookup,
    Getattr,
    Setattr,
    Mkdir,
    Unlink,
    Rmdir,
    Rename,
    Open,
    Read,
    Write,
    Flush,
    Release,
    Readdir,
    Statfs,
    Create,
    Getxattr,
    Setxattr,
    Listxattr,
    Removexattr,
    Fallocate,
    Opendir,
}

impl Upcall {
    /// Every upcall, in discriminant order (`ALL[op as usize] == op`).
    pub const ALL: [Upcall; 21] = [
        Upcall::Lookup,
        Upcall::Getattr,
        Upcall::Setattr,
        Upcall::Mkdir,
        Upcall::Unlink,
        Upcall::Rmdir,
        Upcall::Rename,
        Upcall::Open,
        Upcall::Read,
        Upcall::Write,
        Upcall::Flush,
        Upcall::Release,
        Upcall::Readdir,
        Upcall::Statfs,
        Upcall::Create,
        Upcall::Getxattr,
        Upcall::Setxattr,
        Upcall::Listxattr,
        Upcall::Removexattr,
        Upcall::Fallocate,
        Upcall::Opendir,
    ];

    /// The request's name, lower case (as in `fuse_lowlevel_ops`).
    pub fn name(self) -> &'static str {
        match self {
            Upcall::Lookup => "lookup",
            Upcall::Getattr => "getattr",
            Upcall::Setattr => "setattr",
            Upcall::Mkdir => "mkdir",
            Upcall::Unlink => "unlink",
            Upcall::Rmdir => "rmdir",
            Upcall::Rename => "rename",
            Upcall::Open => "open",
            Upcall::Read => "read",
            Upcall::Write => "write",
            Upcall::Flush => "flush",
            Upcall::Release => "release",
            Upcall::Readdir => "readdir",
            Upcall::Statfs => "statfs",
            Upcall::Create => "create",
            Upcall::Getxattr => "getxattr",
            Upcall::Setxattr => "setxattr",
            Upcall::Listxattr => "listxattr",
            Upcall::Removexattr => "removexattr",
            Upcall::Fallocate => "fallocate",
            Upcall::Opendir => "opendir",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Upcall;

    #[test]
    fn upcalls_are_listed_in_discriminant_order_with_distinct_names() {
        for (i, op) in Upcall::ALL.iter().enumerate() {
            assert_eq!(*op as usize, i, "{op:?}");
        }
        let mut names: Vec<_> = Upcall::ALL.iter().map(|o| o.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Upcall::ALL.len());
    }
}
