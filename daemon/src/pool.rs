//! Pools: where entry bytes live.
//!
//! - `memfs:DIR[,size=N][,huge=within_size|always|never][,numa=N][,acl=on|off][,pack=N]
//!   [,name=X]`: the daemon mounts its own tmpfs at DIR (or reuses the one a previous run left).
//!   Each entry is a file: nameless in `DIR/w` while being written, `DIR/n/<ns>/<key>` once
//!   sealed. The tree itself is the metadata: it survives a crash of the daemon and is
//!   rescanned at start. `acl=off` puts no POSIX ACL on the tree (as on a tmpfs without them):
//!   only root clients then open entries' files themselves, and marud sees every other
//!   client's first retrieve. Small entries (at most `pack=`, 64 KiB by default) of a client
//!   that says its namespace are packed into files of `DIR/p` instead
//!   (`crate::store::pools::packs`).
//! - `devdax:/dev/daxX.Y[,name=X][,coherent=false]` and `file:PATH,size=N[,name=X]
//!   [,coherent=false]`: a device (or a regular file standing in for one) with a 32-byte header
//!   at offset 0 and 2 MiB-aligned regions after the first 2 MiB; metadata in a write-ahead log
//!   in the state directory. `coherent=false` is for a device that other hosts share without
//!   hardware cache coherence (see `coherence`).

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use maru::Error;
use maru::format;
use maru::proto::PoolKind;
use maru::size::parse_size;

use crate::acl::{self, Acl};

/// Region granularity and alignment of raw pools.
pub const REGION_ALIGN: u64 = 2 << 20;
pub use maru::format::ENTRY_ALIGN;

/// Transparent huge page policy of a memfs pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Huge {
    /// 2 MiB pages for files of at least 2 MiB (the default).
    WithinSize,
    /// 2 MiB pages always (a small file takes a whole huge page).
    Always,
    /// 4 KiB pages only.
    Never,
}

impl Huge {
    fn as_str(self) -> &'static str {
        match self {
            Huge::WithinSize => "within_size",
            Huge::Always => "always",
            Huge::Never => "never",
        }
    }
}

/// The largest entry a memfs pool packs with others, unless its spec says (`pack=`).
pub const DEFAULT_PACK: u64 = 64 << 10;

/// A parsed `--pool` spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSpec {
    /// Kind.
    pub kind: PoolKind,
    /// Directory, device or file.
    pub path: PathBuf,
    /// Capacity (memfs: tmpfs size; file: file size; devdax: from sysfs when absent).
    pub size: Option<u64>,
    /// memfs page policy.
    pub huge: Huge,
    /// memfs NUMA node to bind to.
    pub numa: Option<u32>,
    /// memfs: whether namespace directories mirror their namespaces' access through POSIX
    /// ACLs, so that clients other than root open entries' files themselves (`acl=off`: no).
    pub acl: bool,
    /// memfs: entries of at most this many bytes, allocated by a client that says in which
    /// namespace it will publish them, are packed into files shared with that namespace's
    /// other small entries (`pack=0`: none).
    pub pack: u64,
    /// Name (defaults to the path).
    pub name: String,
    /// Raw pools: whether the device is hardware-coherent across the hosts sharing it (true
    /// unless the spec says `coherent=false`; then entries' cache lines are written back
    /// before publication and invalidated before another host's first read).
    pub coherent: bool,
}

impl PoolSpec {
    /// Parses `kind:path[,opt=value...]`.
    pub fn parse(s: &str) -> Result<Self, Error> {
        let bad = |m: String| Error::InvalidArgument(format!("pool spec `{s}`: {m}"));
        let (kind, rest) = s
            .split_once(':')
            .ok_or_else(|| bad("expected memfs:DIR, devdax:PATH or file:PATH".into()))?;
        let kind = match kind {
            "memfs" => PoolKind::Memfs,
            "devdax" => PoolKind::Devdax,
            "file" => PoolKind::File,
            k => return Err(bad(format!("unknown pool kind `{k}`"))),
        };
        let mut parts = rest.split(',');
        let path = PathBuf::from(parts.next().unwrap_or(""));
        if path.as_os_str().is_empty() || !path.is_absolute() {
            return Err(bad("the path must be absolute".into()));
        }
        let mut spec = PoolSpec {
            kind,
            name: path.display().to_string(),
            path,
            size: None,
            huge: Huge::WithinSize,
            numa: None,
            acl: true,
            pack: DEFAULT_PACK,
            coherent: true,
        };
        for opt in parts {
            let (k, v) = opt
                .split_once('=')
                .ok_or_else(|| bad(format!("option `{opt}` is not key=value")))?;
            match (k, kind) {
                ("size", _) => spec.size = Some(parse_size(v).map_err(|e| bad(e.to_string()))?),
                ("name", _) => spec.name = v.to_owned(),
                ("huge", PoolKind::Memfs) => {
                    spec.huge = match v {
                        "within_size" => Huge::WithinSize,
                        "always" => Huge::Always,
                        "never" => Huge::Never,
                        _ => {
                            return Err(bad(format!(
                                "huge must be within_size|always|never, not `{v}`"
                            )));
                        }
                    }
                }
                ("coherent", PoolKind::File | PoolKind::Devdax) => {
                    spec.coherent = match v {
                        "true" => true,
                        "false" if crate::coherence::SUPPORTED => false,
                        "false" => {
                            return Err(bad(
                                "coherent=false: no cache maintenance on this CPU".into()
                            ));
                        }
                        _ => return Err(bad(format!("coherent must be true|false, not `{v}`"))),
                    }
                }
                ("acl", PoolKind::Memfs) => {
                    spec.acl = match v {
                        "on" => true,
                        "off" => false,
                        _ => return Err(bad(format!("acl must be on|off, not `{v}`"))),
                    }
                }
                ("pack", PoolKind::Memfs) => {
                    let max = parse_size(v).map_err(|e| bad(e.to_string()))?;
                    if max > maru::index::PACK_BYTES {
                        return Err(bad(format!(
                            "pack must be at most {}",
                            maru::size::format_size(maru::index::PACK_BYTES)
                        )));
                    }
                    spec.pack = max;
                }
                ("numa", PoolKind::Memfs) => {
                    spec.numa = Some(v.parse().map_err(|_| bad(format!("bad numa node `{v}`")))?)
                }
                _ => return Err(bad(format!("unknown option `{k}` for this kind"))),
            }
        }
        if kind == PoolKind::File && spec.size.is_none() && !spec.path.exists() {
            return Err(bad("a new file: pool needs size=".into()));
        }
        if let Some(sz) = spec.size
            && kind.is_raw()
            && sz < 2 * REGION_ALIGN
        {
            return Err(bad("a raw pool needs at least 4 MiB".into()));
        }
        Ok(spec)
    }
}

fn cpath(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// Finds the filesystem type mounted exactly at `dir`, if any (last mount wins).
pub fn mounted_fstype(dir: &Path) -> Option<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let want = dir.to_str()?;
    let mut found = None;
    for line in info.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        let Some(sep) = f.iter().position(|x| *x == "-") else {
            continue;
        };
        if f.get(4).map(|m| unescape_mount(m)) == Some(want.to_owned()) {
            found = f.get(sep + 1).map(|s| s.to_string());
        }
    }
    found
}

fn unescape_mount(s: &str) -> String {
    s.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

/// Half of the machine's RAM: the default size of the embedded memfs pool.
pub fn default_memfs_size() -> u64 {
    let mem = maru::host::meminfo("MemTotal").unwrap_or(1 << 20);
    (mem * 1024 / 2) & !(REGION_ALIGN - 1)
}

/// A memfs pool.
pub struct MemfsPool {
    /// The tmpfs mount point.
    pub root: PathBuf,
    /// Capacity (tmpfs size).
    pub capacity: u64,
    /// Whether this daemon mounted it (vs reused one left by an earlier run).
    pub mounted_here: bool,
    /// `w`: where files being written are created, nameless (`O_TMPFILE`) until published.
    writing_dir: File,
    /// Namespace directories known to exist in this pool, open (publication links into them).
    ns_dirs: parking_lot::Mutex<std::collections::HashMap<String, std::sync::Arc<File>>>,
    /// The bits the process's umask takes off the files created in `w` (0 where its default
    /// ACL stands in for the umask).
    umask: u32,
    /// Whether the tmpfs takes POSIX access ACLs, by which namespace directories mirror their
    /// namespaces' access ([`MemfsPool::set_ns_access`]).
    pub acls: bool,
    /// The crash-injection seam (tests): decides whether each metadata step reaches the tmpfs.
    gate: parking_lot::RwLock<Option<MetaGate>>,
}

/// A metadata step of a memfs pool: what changes which entries the tmpfs tree holds (and so
/// what a restarted daemon recovers). Data writes into entries are not steps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetaStep {
    /// A namespace directory is created.
    Mkdir {
        /// Namespace.
        ns: String,
    },
    /// Writing file `id` becomes entry `ns/key` (rename).
    Publish {
        /// Allocation id.
        id: u64,
        /// Namespace.
        ns: String,
        /// Key.
        key: String,
    },
    /// A sealed entry moves.
    Rename {
        /// From.
        ns: String,
        /// From.
        key: String,
        /// To.
        nns: String,
        /// To.
        nkey: String,
    },
    /// A sealed entry's file is removed.
    Delete {
        /// Namespace.
        ns: String,
        /// Key.
        key: String,
    },
    /// A writing file is given up (nameless: the tmpfs frees it with its last reference).
    Abort {
        /// Allocation id.
        id: u64,
    },
    /// A record is appended to the log of the pool's packs (packed entries).
    Packed(maru::format::Record),
    /// The pin xattr is set or removed.
    Pin {
        /// Namespace.
        ns: String,
        /// Key.
        key: String,
        /// New state.
        pinned: bool,
    },
}

/// Decides whether a metadata step reaches the pool; a gate that answers `false` from some
/// step on simulates a daemon that died right before it (the daemon goes on believing every
/// step succeeded, as a crashed one would have).
pub type MetaGate = std::sync::Arc<dyn Fn(&MetaStep) -> bool + Send + Sync>;

impl std::fmt::Debug for MemfsPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemfsPool")
            .field("root", &self.root)
            .field("capacity", &self.capacity)
            .field("mounted_here", &self.mounted_here)
            .finish_non_exhaustive()
    }
}

/// A sealed entry found on a memfs pool at start.
#[derive(Debug)]
pub struct FoundEntry {
    /// Namespace path.
    pub ns: String,
    /// Key.
    pub key: String,
    /// Size in bytes.
    pub size: u64,
    /// Pinned (from the `user.maru.pinned` xattr).
    pub pinned: bool,
    /// Modification time (seconds).
    pub mtime: i64,
}

/// Name of the pin xattr on memfs backing files.
pub const PIN_XATTR: &str = "user.maru.pinned";

impl MemfsPool {
    /// Mounts (or reuses) the tmpfs of `spec`.
    pub fn open(spec: &PoolSpec) -> anyhow::Result<Self> {
        use anyhow::Context;
        let root = spec.path.clone();
        if let Some(parent) = root.parent()
            && !parent.exists()
        {
            // Parents (such as /run/maru, which also holds the socket) stay traversable
            // despite the daemon's umask.
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o755))?;
        }
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&root)
            .with_context(|| format!("creating {}", root.display()))?;
        let size = spec.size.unwrap_or_else(default_memfs_size);
        let mut opts = format!("size={size},huge={},mode=0700", spec.huge.as_str());
        if let Some(n) = spec.numa {
            opts.push_str(&format!(",mpol=bind:{n}"));
        }
        let mounted_here = match mounted_fstype(&root).as_deref() {
            Some("tmpfs") => {
                tracing::info!(dir = %root.display(), "reusing the tmpfs left by an earlier run");
                if spec.size.is_some() {
                    mount_tmpfs(&root, &opts, true).context("resizing the reused tmpfs")?;
                }
                false
            }
            Some(other) => anyhow::bail!(
                "{} is already a {other} mount; a memfs pool needs its own tmpfs",
                root.display()
            ),
            None => {
                mount_tmpfs(&root, &opts, false)
                    .with_context(|| format!("mounting a tmpfs on {}", root.display()))?;
                true
            }
        };
        for d in ["w", "n"] {
            let p = root.join(d);
            if !p.exists() {
                std::fs::DirBuilder::new().mode(0o700).create(&p)?;
            }
        }
        let capacity = statvfs(&root)?.0;
        let writing_dir = open_dir(&root.join("w"))?;
        // The tree's own directory keeps root's 0700, here written as an ACL: a kernel without
        // tmpfs ACLs refuses it, and namespace directories then stay closed to all but root.
        let tree = open_dir(&root.join("n"))?;
        let acls = if !spec.acl {
            tracing::info!(dir = %root.display(), "acl=off: only root clients open entries themselves");
            false
        } else {
            match ROOT_ONLY.apply(&tree) {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(dir = %root.display(), "no POSIX ACLs on this tmpfs ({e}): only root clients open entries themselves");
                    false
                }
            }
        };
        if !acls {
            // What an earlier run with ACLs left (the namespaces' are removed at recovery).
            acl::remove_access(&tree)?;
            acl::remove_default(&writing_dir)?;
        }
        // Files created in `w` take the mode asked for, not the daemon's umask (0077): no
        // `fchmod` per file. Without ACLs, each file whose mode the umask cuts is given it.
        let umask = if acls && ANY.apply_default(&writing_dir).is_ok() {
            0
        } else {
            process_umask()
        };
        Ok(MemfsPool {
            root,
            capacity,
            mounted_here,
            writing_dir,
            ns_dirs: parking_lot::Mutex::new(std::collections::HashMap::new()),
            umask,
            acls,
            gate: parking_lot::RwLock::new(None),
        })
    }

    /// Installs the crash-injection seam (tests).
    pub fn set_gate(&self, gate: Option<MetaGate>) {
        *self.gate.write() = gate;
    }

    /// Whether the metadata step `step` makes reaches the pool (always, without a gate: the
    /// step is then never built).
    pub fn pass(&self, step: impl FnOnce() -> MetaStep) -> bool {
        self.gate.read().as_ref().is_none_or(|g| g(&step()))
    }

    /// Path of a sealed entry.
    pub fn entry_path(&self, ns: &str, key: &str) -> PathBuf {
        self.root.join("n").join(ns).join(key)
    }

    /// Creates a writing file of `size` bytes (space reserved with fallocate), with the
    /// permission bits it will have once sealed (the descriptor returned stays writable). The
    /// file has no name until [`MemfsPool::publish`] links it: one given up, or left by a
    /// crash, is freed by the tmpfs with its last descriptor or mapping, with nothing to clean.
    pub fn create_writing(&self, size: u64, mode: u32) -> Result<File, Error> {
        use nix::fcntl::OFlag;
        let fd = nix::fcntl::openat(
            &self.writing_dir,
            ".",
            OFlag::O_TMPFILE | OFlag::O_RDWR | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::from_bits_truncate(mode),
        )
        .map_err(|e| Error::Io(e.into()))?;
        let f = File::from(fd);
        // The file takes exactly `mode`, whatever the process's umask took off (its mode is
        // the entry's, read back at the next start, and the kernel decides from it when
        // clients open entries' files themselves: Store::index_fd).
        if mode & self.umask != 0 {
            nix::sys::stat::fchmod(&f, nix::sys::stat::Mode::from_bits_truncate(mode))
                .map_err(|e| Error::Io(e.into()))?;
        }
        if size > 0
            && let Err(e) = fallocate(&f, size)
        {
            return Err(if e == nix::errno::Errno::ENOSPC {
                Error::NoSpace(format!("memfs pool {} is full", self.root.display()))
            } else {
                Error::Io(e.into())
            });
        }
        Ok(f)
    }

    /// Makes sure the namespace directory exists in this pool; returns it, open (None when
    /// the crash-injection seam stopped its creation).
    pub fn ensure_ns(&self, ns: &str) -> io::Result<Option<std::sync::Arc<File>>> {
        if let Some(d) = self.ns_dir(ns)? {
            return Ok(Some(d));
        }
        if !self.pass(|| MetaStep::Mkdir { ns: ns.to_owned() }) {
            return Ok(None);
        }
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(self.root.join("n").join(ns))?;
        self.ns_dir(ns)
    }

    /// The open directory of namespace `ns`, if it has one in this pool: looked for, never
    /// made (no metadata step).
    pub fn ns_dir(&self, ns: &str) -> io::Result<Option<std::sync::Arc<File>>> {
        if let Some(d) = self.ns_dirs.lock().get(ns) {
            return Ok(Some(d.clone()));
        }
        let d = match open_dir(&self.root.join("n").join(ns)) {
            Ok(d) => std::sync::Arc::new(d),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        self.ns_dirs.lock().insert(ns.to_owned(), d.clone());
        Ok(Some(d))
    }

    /// Gives namespace `ns`'s directory, if it has one here, the namespace's access for search
    /// and read, never write: owned by root (so no one else may change it), group `gid`, with
    /// an access ACL that grants user `uid` the mode's owner bits, the group its group bits and
    /// everyone else its other bits. The kernel then decides an `openat` of an entry through the
    /// directory as the access policy decides a read in `ns` (search on it, read on the entry,
    /// whose file has the entry's owner and mode), for a client given the directory because it
    /// could list `ns` (see `Store::index_fd`). A change of group passes through a closed ACL,
    /// so that no one gains access in between. Without ACLs, the directory is root's 0700 with
    /// no ACL (one an earlier run with ACLs gave it is removed).
    ///
    /// A failure closes the directory to all but root (the mode's 0700 masks every ACL entry)
    /// before it is returned, so that it never grants more than the namespace.
    pub fn set_ns_access(&self, ns: &str, uid: u32, gid: u32, mode: u32) -> io::Result<()> {
        // The root namespace's directory is the tree's own, root's alone.
        if ns.is_empty() {
            return Ok(());
        }
        let Some(dir) = self.ns_dir(ns)? else {
            return Ok(());
        };
        if !self.acls {
            return root_only(&dir);
        }
        let set = || -> io::Result<()> {
            use std::os::unix::fs::MetadataExt;
            if dir.metadata()?.gid() != gid {
                ROOT_ONLY.apply(&dir)?;
                nix::unistd::fchown(
                    &*dir,
                    Some(nix::unistd::Uid::from_raw(0)),
                    Some(nix::unistd::Gid::from_raw(gid)),
                )?;
            }
            ns_acl(uid, mode).apply(&dir)
        };
        set().inspect_err(|_| {
            let _ = nix::sys::stat::fchmod(&*dir, nix::sys::stat::Mode::from_bits_truncate(0o700));
        })
    }

    /// Removes an (empty) namespace directory from this pool.
    pub fn remove_ns(&self, ns: &str) {
        self.ns_dirs.lock().remove(ns);
        // The store removes only empty namespaces; a directory left behind (its removal
        // failed) is an empty namespace again at the next start.
        if let Err(e) = std::fs::remove_dir(self.root.join("n").join(ns)) {
            tracing::warn!(ns, "removing a namespace directory: {e}");
        }
    }

    /// Publishes writing file `file` (allocation `id`) as `ns/key`: links it into its
    /// namespace's directory; fails if the name is taken.
    pub fn publish(&self, id: u64, file: &File, ns: &str, key: &str) -> Result<(), Error> {
        let dir = self.ensure_ns(ns)?;
        let step = || MetaStep::Publish {
            id,
            ns: ns.to_owned(),
            key: key.to_owned(),
        };
        let Some(dir) = dir.filter(|_| self.pass(step)) else {
            return Ok(());
        };
        link_nameless(file, &dir, key).map_err(|e| {
            if e.raw_os_error() == Some(libc::EEXIST) {
                Error::Exists(format!("{ns}/{key}"))
            } else {
                Error::Io(e)
            }
        })
    }

    /// Renames a sealed entry.
    pub fn rename(&self, ns: &str, key: &str, nns: &str, nkey: &str) -> Result<(), Error> {
        self.ensure_ns(nns)?;
        let step = || MetaStep::Rename {
            ns: ns.to_owned(),
            key: key.to_owned(),
            nns: nns.to_owned(),
            nkey: nkey.to_owned(),
        };
        if !self.pass(step) {
            return Ok(());
        }
        rename_noreplace(&self.entry_path(ns, key), &self.entry_path(nns, nkey))?;
        Ok(())
    }

    /// Opens a sealed entry read-only.
    pub fn open_entry(&self, ns: &str, key: &str) -> io::Result<File> {
        // Relative to the namespace's directory when it is open (one name to resolve, not
        // the whole path of the pool's root).
        let dir = self.ns_dirs.lock().get(ns).cloned();
        let Some(dir) = dir else {
            return OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(self.entry_path(ns, key));
        };
        use nix::fcntl::OFlag;
        let fd = nix::fcntl::openat(
            &*dir,
            key,
            OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW,
            nix::sys::stat::Mode::empty(),
        )?;
        Ok(File::from(fd))
    }

    /// Removes a sealed entry's file. Mappings of it stay valid until unmapped.
    pub fn delete(&self, ns: &str, key: &str) -> io::Result<()> {
        let step = || MetaStep::Delete {
            ns: ns.to_owned(),
            key: key.to_owned(),
        };
        if !self.pass(step) {
            return Ok(());
        }
        std::fs::remove_file(self.entry_path(ns, key))
    }

    /// Removes a writing file.
    pub fn abort(&self, id: u64) {
        // Nameless: nothing to remove; the tmpfs frees it with its last reference.
        self.pass(|| MetaStep::Abort { id });
    }

    /// Records the pin state on the backing file.
    pub fn set_pinned(&self, ns: &str, key: &str, pinned: bool) -> io::Result<()> {
        let step = || MetaStep::Pin {
            ns: ns.to_owned(),
            key: key.to_owned(),
            pinned,
        };
        if !self.pass(step) {
            return Ok(());
        }
        set_pin_xattr(&self.entry_path(ns, key), pinned)
    }

    /// (capacity, free) bytes from statvfs.
    pub fn space(&self) -> io::Result<(u64, u64)> {
        statvfs(&self.root)
    }

    /// Deletes leftover writing files (named ones, from versions before writing files were
    /// nameless) and lists sealed entries and namespace dirs.
    pub fn scan(&self) -> io::Result<(Vec<String>, Vec<FoundEntry>)> {
        for e in std::fs::read_dir(self.root.join("w"))? {
            let e = e?;
            tracing::info!(file = %e.path().display(), "discarding an entry left unsealed by a crash");
            // Not recovered either way; the next start tries again.
            if let Err(err) = std::fs::remove_file(e.path()) {
                tracing::warn!(file = %e.path().display(), "{err}");
            }
        }
        let mut dirs = Vec::new();
        let mut found = Vec::new();
        walk(&self.root.join("n"), "", &mut dirs, &mut found)?;
        Ok((dirs, found))
    }

    /// Unmounts the tmpfs (dropping every entry).
    pub fn unmount(&self) {
        // At exit: a failure leaves the tmpfs (and its entries) for the next run to reuse.
        if let Err(e) = nix::mount::umount2(&self.root, nix::mount::MntFlags::MNT_DETACH) {
            tracing::warn!(dir = %self.root.display(), "cannot unmount the pool: {e}");
        }
    }
}

fn walk(
    dir: &Path,
    prefix: &str,
    dirs: &mut Vec<String>,
    found: &mut Vec<FoundEntry>,
) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let Some(name) = e.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        let rel = if prefix.is_empty() {
            name.clone()
        } else {
            format!("{prefix}/{name}")
        };
        let md = e.metadata()?;
        if md.is_dir() {
            dirs.push(rel.clone());
            walk(&e.path(), &rel, dirs, found)?;
        } else if md.is_file() && !prefix.is_empty() {
            found.push(FoundEntry {
                ns: prefix.to_owned(),
                key: name,
                size: md.len(),
                pinned: has_xattr(&e.path(), PIN_XATTR),
                mtime: md.mtime(),
            });
        }
    }
    Ok(())
}

// The raw system calls of the pools. nix has no xattr calls (setxattr, removexattr,
// getxattr): those stay libc.

/// Sets (`user.maru.pinned=1`) or removes the pin xattr of `p`; removing an absent one is fine.
fn set_pin_xattr(p: &Path, pinned: bool) -> io::Result<()> {
    let p = cpath(p)?;
    let name = CString::new(PIN_XATTR).expect("no NUL");
    // SAFETY: valid C strings and buffer for the duration of the calls.
    let r = unsafe {
        if pinned {
            libc::setxattr(p.as_ptr(), name.as_ptr(), b"1".as_ptr().cast(), 1, 0)
        } else {
            libc::removexattr(p.as_ptr(), name.as_ptr())
        }
    };
    if r != 0 {
        let e = io::Error::last_os_error();
        if pinned || e.raw_os_error() != Some(libc::ENODATA) {
            return Err(e);
        }
    }
    Ok(())
}

/// Whether `p` has the xattr `name`; an error reading it counts as absent.
fn has_xattr(p: &Path, name: &str) -> bool {
    let (Ok(p), Ok(n)) = (cpath(p), CString::new(name)) else {
        return false;
    };
    // SAFETY: valid C strings; a NULL buffer of size 0 asks only for the size.
    unsafe { libc::getxattr(p.as_ptr(), n.as_ptr(), std::ptr::null_mut(), 0) >= 0 }
}

/// The access ACL of the directory of a namespace owned by `uid` with `mode` (see
/// [`MemfsPool::set_ns_access`]): root all, `uid` the owner bits, the owning group the group
/// bits, others the other bits, each without write.
fn ns_acl(uid: u32, mode: u32) -> Acl {
    let no_write = |bits: u32| bits & (acl::READ | acl::SEARCH);
    Acl {
        owner: 7,
        user: (uid != 0).then(|| (uid, no_write(mode >> 6))),
        group: no_write(mode >> 3),
        other: no_write(mode),
    }
}

/// Root's alone (mode 0700).
const ROOT_ONLY: Acl = Acl {
    owner: 7,
    user: None,
    group: 0,
    other: 0,
};

/// Everyone's (0777): as a default ACL, it leaves new files the mode they are created with.
const ANY: Acl = Acl {
    owner: 7,
    user: None,
    group: 7,
    other: 7,
};

/// Makes directory `dir` root's 0700 with no access ACL, unless it is so already.
fn root_only(dir: &File) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let md = dir.metadata()?;
    if (md.uid(), md.gid(), md.mode() & 0o7777) == (0, 0, 0o700) {
        // Whatever ACL is left grants nothing: the mode's group bits, its mask, are 0.
        return Ok(());
    }
    nix::sys::stat::fchmod(dir, nix::sys::stat::Mode::from_bits_truncate(0o700))?;
    acl::remove_access(dir)?;
    nix::unistd::fchown(
        dir,
        Some(nix::unistd::Uid::from_raw(0)),
        Some(nix::unistd::Gid::from_raw(0)),
    )?;
    Ok(())
}

/// The process's umask, read without changing it (`Umask:` in /proc/self/status); the
/// strictest, 0o777, where it cannot be read (every file is then given its mode).
fn process_umask() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let l = s.lines().find(|l| l.starts_with("Umask:"))?;
            u32::from_str_radix(l.split_whitespace().nth(1)?, 8).ok()
        })
        .unwrap_or(0o777)
}

/// Reserves the first `size` bytes of `f`.
fn fallocate(f: &File, size: u64) -> nix::Result<()> {
    let len = libc::off_t::try_from(size).map_err(|_| nix::errno::Errno::EFBIG)?;
    nix::fcntl::fallocate(f, nix::fcntl::FallocateFlags::empty(), 0, len)
}

fn mount_tmpfs(dir: &Path, opts: &str, remount: bool) -> io::Result<()> {
    use nix::mount::MsFlags;
    let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    if remount {
        flags |= MsFlags::MS_REMOUNT;
    }
    nix::mount::mount(Some("maru"), dir, Some("tmpfs"), flags, Some(opts))?;
    Ok(())
}

/// Opens directory `p` (for `*at` calls relative to it).
fn open_dir(p: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(p)
}

/// Gives nameless (`O_TMPFILE`) file `file` the name `name` in `dir`; fails with `EEXIST` if
/// the name is taken. `AT_EMPTY_PATH` needs `CAP_DAC_READ_SEARCH`; without it, the file is
/// linked through its `/proc/self/fd` path.
fn link_nameless(file: &File, dir: &File, name: &str) -> io::Result<()> {
    use nix::fcntl::AtFlags;
    use nix::unistd::linkat;
    match linkat(file, "", dir, name, AtFlags::AT_EMPTY_PATH) {
        Err(nix::errno::Errno::ENOENT | nix::errno::Errno::EPERM) => {
            use std::os::fd::AsRawFd;
            let proc = format!("/proc/self/fd/{}", file.as_raw_fd());
            linkat(
                nix::fcntl::AT_FDCWD,
                proc.as_str(),
                dir,
                name,
                AtFlags::AT_SYMLINK_FOLLOW,
            )?;
            Ok(())
        }
        r => Ok(r?),
    }
}

fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    use nix::fcntl::{AT_FDCWD, RenameFlags, renameat2};
    renameat2(AT_FDCWD, from, AT_FDCWD, to, RenameFlags::RENAME_NOREPLACE)?;
    Ok(())
}

/// (total, free) bytes of the filesystem holding `p`.
pub fn statvfs(p: &Path) -> io::Result<(u64, u64)> {
    let s = nix::sys::statvfs::statvfs(p)?;
    let frsize = s.fragment_size();
    Ok((s.blocks() * frsize, s.blocks_available() * frsize))
}

/// Opens a raw pool's device or file read-write (and locks it); returns it with its capacity.
/// A header of a format version this build does not know fails the open, naming the device.
/// Opens a raw pool's device and locks it: exclusively, or `shared` with the other hosts of a
/// cluster (whose device must carry a header already: no host writes one under the others).
pub fn open_raw(spec: &PoolSpec, shared: bool) -> anyhow::Result<(File, u64)> {
    use anyhow::Context;
    let lock = |f: &File| -> anyhow::Result<()> {
        let ok = if shared {
            format::lock_device_shared(f)?
        } else {
            format::lock_device(f)?
        };
        if !ok {
            anyhow::bail!("{} is in use by another marud", spec.path.display());
        }
        if shared && format::read_header(f)?.is_none() {
            anyhow::bail!(
                "{} has no maru header: in cluster mode the hosts share an initialized device \
                 (`maructl device init {}` once, on one host)",
                spec.path.display(),
                spec.path.display()
            );
        }
        Ok(())
    };
    let (f, size) = match spec.kind {
        PoolKind::File => {
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .custom_flags(libc::O_CLOEXEC)
                .open(&spec.path)
                .with_context(|| format!("opening {}", spec.path.display()))?;
            lock(&f)?;
            let cur = f.metadata()?.len();
            let size = spec.size.unwrap_or(cur);
            if cur < size {
                f.set_len(size)?;
            }
            (f, size)
        }
        PoolKind::Devdax => {
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(&spec.path)
                .with_context(|| format!("opening {}", spec.path.display()))?;
            lock(&f)?;
            let size = match spec.size {
                Some(s) => s,
                None => devdax_size(&spec.path)?,
            };
            (f, size)
        }
        PoolKind::Memfs => unreachable!("not a raw pool"),
    };
    // Before anything is written to the device: a header another format version wrote is
    // refused, never replaced.
    format::read_header(&f)
        .with_context(|| format!("pool `{}` on {}", spec.name, spec.path.display()))?;
    Ok((f, size & !(REGION_ALIGN - 1)))
}

fn devdax_size(p: &Path) -> anyhow::Result<u64> {
    let name = p
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| anyhow::anyhow!("bad device path"))?;
    let s = std::fs::read_to_string(format!("/sys/bus/dax/devices/{name}/size"))
        .map_err(|e| anyhow::anyhow!("reading the size of {name} from sysfs: {e}"))?;
    Ok(s.trim().parse()?)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::*;

    #[test]
    fn specs() {
        let s = PoolSpec::parse("memfs:/run/maru/pool0,size=4G,huge=always,numa=1").unwrap();
        assert_eq!(s.kind, PoolKind::Memfs);
        assert_eq!(s.size, Some(4 << 30));
        assert_eq!(s.huge, Huge::Always);
        assert_eq!(s.numa, Some(1));
        assert!(s.acl);
        assert!(!PoolSpec::parse("memfs:/x,acl=off").unwrap().acl);
        assert!(PoolSpec::parse("memfs:/x,acl=no").is_err());
        assert!(PoolSpec::parse("devdax:/dev/dax0.0,acl=off").is_err());
        assert_eq!(s.pack, DEFAULT_PACK);
        assert_eq!(PoolSpec::parse("memfs:/x,pack=0").unwrap().pack, 0);
        assert_eq!(PoolSpec::parse("memfs:/x,pack=1M").unwrap().pack, 1 << 20);
        assert!(
            PoolSpec::parse("memfs:/x,pack=3M").is_err(),
            "larger than a pack"
        );
        assert!(PoolSpec::parse("file:/x.img,size=8M,pack=4K").is_err());
        let f = PoolSpec::parse("file:/tmp/x.img,size=512M,name=emu").unwrap();
        assert_eq!(f.kind, PoolKind::File);
        assert_eq!(f.name, "emu");
        assert!(f.coherent);
        let n = PoolSpec::parse("devdax:/dev/dax0.0,coherent=false").unwrap();
        assert!(!n.coherent);
        assert!(PoolSpec::parse("devdax:/dev/dax0.0,coherent=maybe").is_err());
        assert!(PoolSpec::parse("memfs:/x,coherent=false").is_err());
        assert!(PoolSpec::parse("memfs:rel").is_err());
        assert!(PoolSpec::parse("nvme:/x").is_err());
        assert!(PoolSpec::parse("file:/nonexistent-maru-x").is_err());
        assert!(PoolSpec::parse("file:/x,size=1M").is_err());
        assert!(PoolSpec::parse("devdax:/dev/dax0.0,huge=always").is_err());
        assert!(PoolSpec::parse("memfs:/x,size=12Q").is_err());
    }

    #[test]
    fn open_raw_refuses_an_unknown_format_version() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev.img");
        let spec = PoolSpec::parse(&format!("file:{},size=4M,name=p", path.display())).unwrap();
        let (f, cap) = open_raw(&spec, false).unwrap();
        assert_eq!(cap, 4 << 20);
        let mut b = format::DevHeader::fresh().encode();
        b[8..12].copy_from_slice(&7u32.to_le_bytes());
        f.write_all_at(&b, 0).unwrap();
        drop(f);
        let e = format!("{:#}", open_raw(&spec, false).unwrap_err());
        assert_eq!(
            e,
            format!(
                "pool `p` on {}: pool format version 7 is not supported (this build supports \
                 version 1)",
                path.display()
            )
        );
    }
}
