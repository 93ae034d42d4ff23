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
    /// Supplementary groups.
    pub groups: Vec<u32>,
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
    // SAFETY: no preconditions.
    let cpu = usize::try_from(unsafe { libc::sched_getcpu() }).unwrap_or(0) % readers.len();
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

/// Pins the calling thread to `cpu` (best effort).
pub fn pin_thread(cpu: usize) {
    if cpu >= libc::CPU_SETSIZE as usize {
        return;
    }
    // SAFETY: a zeroed cpu_set_t is a valid empty set; `cpu` is below CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            tracing::debug!(cpu, "pinning a thread: {}", std::io::Error::last_os_error());
        }
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
    /// A caller with no supplementary groups.
    pub fn new(uid: u32, gid: u32, pid: i32) -> Self {
        Caller {
            uid,
            gid,
            groups: Vec::new(),
            pid,
            tgid: std::sync::OnceLock::new(),
        }
    }

    /// The caller with its supplementary groups (and thread group) from one read of
    /// `/proc/<pid>/status`; root needs no groups.
    pub fn with_groups(uid: u32, gid: u32, pid: i32) -> Self {
        let mut c = Caller::new(uid, gid, pid);
        if uid != 0
            && let Some(s) = read_proc_bounded(format!("/proc/{pid}/status"))
        {
            c.groups = parse_groups(&s);
            if let Some(t) = parse_tgid(&s) {
                let _ = c.tgid.set(t);
            }
        }
        c
    }

    /// Root.
    pub fn root() -> Self {
        Caller::new(0, 0, 0)
    }

    /// The caller's thread group (process), looked up once.
    pub fn tgid(&self) -> i32 {
        *self.tgid.get_or_init(|| tgid_of(self.pid))
    }

    /// True if the caller is in group `gid`.
    pub fn in_group(&self, gid: u32) -> bool {
        self.gid == gid || self.groups.contains(&gid)
    }

    /// Whether `mode` (owned by uid/gid) grants `want` (a mask of 4=r, 2=w, 1=x).
    pub fn may(&self, uid: u32, gid: u32, mode: u32, want: u32) -> bool {
        if self.uid == 0 {
            return true;
        }
        let bits = if self.uid == uid {
            (mode >> 6) & 7
        } else if self.in_group(gid) {
            (mode >> 3) & 7
        } else {
            mode & 7
        };
        bits & want == want
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
    /// By the kernel, passing through to this backing file (memfs pools).
    Passthrough(Arc<File>),
    /// By the daemon, copying (raw pools).
    Copy,
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
    /// A read handle of `ino` was released.
    fn close(&self, _ino: u64) {}
    /// A writable descriptor of an entry being written was closed (`close(2)`): its
    /// publication is imminent; lookups by other processes may wait for it. `abandoned` when
    /// the closing process is dying of a signal: the entry must then never be published.
    fn closing(&self, _ino: u64, _abandoned: bool) {}
    /// A writer is about to allocate `bytes` more of the entry being written `ino` (fallocate):
    /// make room for them if the store can (eviction). Best effort.
    fn make_room(&self, _ino: u64, _bytes: u64) {}
    /// Called when the last writable handle of a WRITING entry is closed: publishes it.
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
    /// Reads bytes of an entry served by copying.
    fn read(&self, ino: u64, offset: u64, len: u32) -> Result<Vec<u8>>;
    /// Writes bytes of a WRITING entry served by copying.
    fn write(&self, ino: u64, offset: u64, data: &[u8]) -> Result<u32>;
    /// Deletes an entry.
    fn unlink(&self, c: &Caller, parent: u64, name: &str) -> Result<()>;
    /// Renames an entry (publishing a finished WRITING one); `noreplace` as RENAME_NOREPLACE.
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
