//! Pools: where entry bytes live.
//!
//! - `memfs:DIR[,size=N][,huge=within_size|always|never][,numa=N][,name=X]`: the daemon mounts
//!   its own tmpfs at DIR (or reuses the one a previous run left). Each entry is a file:
//!   `DIR/w/<id>` while being written, `DIR/n/<ns>/<key>` once sealed. The tree itself is the
//!   metadata: it survives a crash of the daemon and is rescanned at start.
//! - `devdax:/dev/daxX.Y[,name=X]` and `file:PATH,size=N[,name=X]`: a device (or a regular file
//!   standing in for one) with a 32-byte header at offset 0 and 2 MiB-aligned regions after the
//!   first 2 MiB; metadata in a write-ahead log in the state directory.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use maru::Error;
use maru::proto::PoolKind;
use maru::size::parse_size;

/// Region granularity and alignment of raw pools.
pub const REGION_ALIGN: u64 = 2 << 20;
/// Alignment of entries inside regions (one page, so each can be mapped alone).
pub const ENTRY_ALIGN: u64 = 4096;
/// Magic of the raw pool header.
pub const DEV_MAGIC: [u8; 8] = *b"MARUDEV\0";
/// Version of the raw pool format.
pub const DEV_VERSION: u32 = 1;
/// Size of the header.
pub const DEV_HEADER_LEN: usize = 32;

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
    /// Name (defaults to the path).
    pub name: String,
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
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .unwrap_or(1 << 20);
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
    /// Namespace directories known to exist in this pool.
    ns_dirs: parking_lot::Mutex<std::collections::HashSet<String>>,
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
    /// A writing file is removed.
    Abort {
        /// Allocation id.
        id: u64,
    },
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
        Ok(MemfsPool {
            root,
            capacity,
            mounted_here,
            ns_dirs: parking_lot::Mutex::new(std::collections::HashSet::new()),
            gate: parking_lot::RwLock::new(None),
        })
    }

    /// Installs the crash-injection seam (tests).
    pub fn set_gate(&self, gate: Option<MetaGate>) {
        *self.gate.write() = gate;
    }

    /// Whether `step` reaches the pool (always, without a gate).
    fn pass(&self, step: MetaStep) -> bool {
        self.gate.read().as_ref().is_none_or(|g| g(&step))
    }

    /// Path of a writing file.
    pub fn writing_path(&self, id: u64) -> PathBuf {
        self.root.join("w").join(id.to_string())
    }

    /// Path of a sealed entry.
    pub fn entry_path(&self, ns: &str, key: &str) -> PathBuf {
        self.root.join("n").join(ns).join(key)
    }

    /// Creates a writing file of `size` bytes (space reserved with fallocate), with the
    /// permission bits it will have once sealed (the descriptor returned stays writable).
    pub fn create_writing(&self, id: u64, size: u64, mode: u32) -> Result<File, Error> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(mode)
            .custom_flags(libc::O_CLOEXEC)
            .open(self.writing_path(id))?;
        if size > 0 {
            // SAFETY: plain syscall on an fd we own.
            let r = unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, size as libc::off_t) };
            if r != 0 {
                let e = io::Error::last_os_error();
                let _ = std::fs::remove_file(self.writing_path(id));
                return Err(if e.raw_os_error() == Some(libc::ENOSPC) {
                    Error::NoSpace(format!("memfs pool {} is full", self.root.display()))
                } else {
                    Error::Io(e)
                });
            }
        }
        Ok(f)
    }

    /// Makes sure the namespace directory exists in this pool.
    pub fn ensure_ns(&self, ns: &str) -> io::Result<()> {
        if self.ns_dirs.lock().contains(ns) {
            return Ok(());
        }
        let p = self.root.join("n").join(ns);
        if !p.is_dir() {
            if !self.pass(MetaStep::Mkdir { ns: ns.to_owned() }) {
                return Ok(());
            }
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&p)?;
        }
        self.ns_dirs.lock().insert(ns.to_owned());
        Ok(())
    }

    /// Removes an (empty) namespace directory from this pool.
    pub fn remove_ns(&self, ns: &str) {
        self.ns_dirs.lock().remove(ns);
        let _ = std::fs::remove_dir(self.root.join("n").join(ns));
    }

    /// Publishes writing file `id` as `ns/key`; fails if the name is taken.
    pub fn publish(&self, id: u64, ns: &str, key: &str) -> Result<(), Error> {
        self.ensure_ns(ns)?;
        let step = MetaStep::Publish {
            id,
            ns: ns.to_owned(),
            key: key.to_owned(),
        };
        if !self.pass(step) {
            return Ok(());
        }
        rename_noreplace(&self.writing_path(id), &self.entry_path(ns, key)).map_err(|e| {
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
        let step = MetaStep::Rename {
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
        OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(self.entry_path(ns, key))
    }

    /// Opens a writing file again (for the mount's writable handles).
    pub fn open_writing(&self, id: u64) -> io::Result<File> {
        OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(self.writing_path(id))
    }

    /// Removes a sealed entry's file. Mappings of it stay valid until unmapped.
    pub fn delete(&self, ns: &str, key: &str) -> io::Result<()> {
        let step = MetaStep::Delete {
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
        if !self.pass(MetaStep::Abort { id }) {
            return;
        }
        let _ = std::fs::remove_file(self.writing_path(id));
    }

    /// Records the pin state on the backing file.
    pub fn set_pinned(&self, ns: &str, key: &str, pinned: bool) -> io::Result<()> {
        let step = MetaStep::Pin {
            ns: ns.to_owned(),
            key: key.to_owned(),
            pinned,
        };
        if !self.pass(step) {
            return Ok(());
        }
        let p = cpath(&self.entry_path(ns, key))?;
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

    /// (capacity, free) bytes from statvfs.
    pub fn space(&self) -> io::Result<(u64, u64)> {
        statvfs(&self.root)
    }

    /// Deletes leftover writing files and lists sealed entries and namespace dirs.
    pub fn scan(&self) -> io::Result<(Vec<String>, Vec<FoundEntry>)> {
        for e in std::fs::read_dir(self.root.join("w"))? {
            let e = e?;
            tracing::info!(file = %e.path().display(), "discarding an entry left unsealed by a crash");
            let _ = std::fs::remove_file(e.path());
        }
        let mut dirs = Vec::new();
        let mut found = Vec::new();
        walk(&self.root.join("n"), "", &mut dirs, &mut found)?;
        Ok((dirs, found))
    }

    /// Unmounts the tmpfs (dropping every entry).
    pub fn unmount(&self) {
        if let Ok(c) = cpath(&self.root) {
            // SAFETY: valid C string.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
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

fn has_xattr(p: &Path, name: &str) -> bool {
    let (Ok(p), Ok(n)) = (cpath(p), CString::new(name)) else {
        return false;
    };
    // SAFETY: valid C strings; a NULL buffer of size 0 asks only for the size.
    unsafe { libc::getxattr(p.as_ptr(), n.as_ptr(), std::ptr::null_mut(), 0) >= 0 }
}

fn mount_tmpfs(dir: &Path, opts: &str, remount: bool) -> io::Result<()> {
    let src = CString::new("maru").expect("no NUL");
    let fstype = CString::new("tmpfs").expect("no NUL");
    let target = cpath(dir)?;
    let data = CString::new(opts).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let mut flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    if remount {
        flags |= libc::MS_REMOUNT;
    }
    // SAFETY: valid C strings for the duration of the call.
    let r = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            flags,
            data.as_ptr().cast(),
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    let (f, t) = (cpath(from)?, cpath(to)?);
    // SAFETY: valid C strings for the duration of the call.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            f.as_ptr(),
            libc::AT_FDCWD,
            t.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// (total, free) bytes of the filesystem holding `p`.
pub fn statvfs(p: &Path) -> io::Result<(u64, u64)> {
    let c = cpath(p)?;
    // SAFETY: zeroed statvfs is a valid out-parameter.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid C string and out-pointer.
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((s.f_blocks * s.f_frsize, s.f_bavail * s.f_frsize))
}

/// The 32-byte header at offset 0 of a raw pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevHeader {
    /// Format version.
    pub version: u32,
    /// Identity of the pool (names its log in the state directory).
    pub uuid: [u8; 16],
}

impl DevHeader {
    /// Encodes: magic[8] | version u32 LE | uuid[16] | reserved u32 (0).
    pub fn encode(&self) -> [u8; DEV_HEADER_LEN] {
        let mut b = [0u8; DEV_HEADER_LEN];
        b[..8].copy_from_slice(&DEV_MAGIC);
        b[8..12].copy_from_slice(&self.version.to_le_bytes());
        b[12..28].copy_from_slice(&self.uuid);
        b
    }

    /// Decodes; `None` when the magic is absent.
    pub fn decode(b: &[u8; DEV_HEADER_LEN]) -> Option<Self> {
        if b[..8] != DEV_MAGIC {
            return None;
        }
        Some(DevHeader {
            version: u32::from_le_bytes(b[8..12].try_into().expect("4")),
            uuid: b[12..28].try_into().expect("16"),
        })
    }

    /// The UUID as text.
    pub fn uuid_string(&self) -> String {
        uuid::Uuid::from_bytes(self.uuid).to_string()
    }
}

/// Reads the header of a raw pool device or file.
pub fn read_header(f: &File) -> io::Result<Option<DevHeader>> {
    let mut b = [0u8; DEV_HEADER_LEN];
    f.read_exact_at(&mut b, 0)?;
    Ok(DevHeader::decode(&b))
}

/// Writes a new header with a fresh UUID.
pub fn init_header(f: &File) -> io::Result<DevHeader> {
    let h = DevHeader {
        version: DEV_VERSION,
        uuid: *uuid::Uuid::new_v4().as_bytes(),
    };
    f.write_all_at(&h.encode(), 0)?;
    f.sync_data()?;
    Ok(h)
}

/// Zeroes the header.
pub fn clear_header(f: &File) -> io::Result<()> {
    f.write_all_at(&[0u8; DEV_HEADER_LEN], 0)?;
    f.sync_data()
}

/// Takes the exclusive lock a running marud holds on each raw pool device or file.
/// Returns false if another process holds it.
pub fn lock_device(f: &File) -> io::Result<bool> {
    // SAFETY: plain syscall on a descriptor we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

/// Opens a raw pool's device or file read-write (and locks it); returns it with its capacity.
pub fn open_raw(spec: &PoolSpec) -> anyhow::Result<(File, u64)> {
    use anyhow::Context;
    match spec.kind {
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
            if !lock_device(&f)? {
                anyhow::bail!("{} is in use by another marud", spec.path.display());
            }
            let cur = f.metadata()?.len();
            let size = spec.size.unwrap_or(cur);
            if cur < size {
                f.set_len(size)?;
            }
            Ok((f, size & !(REGION_ALIGN - 1)))
        }
        PoolKind::Devdax => {
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(&spec.path)
                .with_context(|| format!("opening {}", spec.path.display()))?;
            if !lock_device(&f)? {
                anyhow::bail!("{} is in use by another marud", spec.path.display());
            }
            let size = match spec.size {
                Some(s) => s,
                None => devdax_size(&spec.path)?,
            };
            Ok((f, size & !(REGION_ALIGN - 1)))
        }
        PoolKind::Memfs => unreachable!("not a raw pool"),
    }
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
    use super::*;

    #[test]
    fn specs() {
        let s = PoolSpec::parse("memfs:/run/maru/pool0,size=4G,huge=always,numa=1").unwrap();
        assert_eq!(s.kind, PoolKind::Memfs);
        assert_eq!(s.size, Some(4 << 30));
        assert_eq!(s.huge, Huge::Always);
        assert_eq!(s.numa, Some(1));
        let f = PoolSpec::parse("file:/tmp/x.img,size=512M,name=emu").unwrap();
        assert_eq!(f.kind, PoolKind::File);
        assert_eq!(f.name, "emu");
        assert!(PoolSpec::parse("memfs:rel").is_err());
        assert!(PoolSpec::parse("nvme:/x").is_err());
        assert!(PoolSpec::parse("file:/nonexistent-maru-x").is_err());
        assert!(PoolSpec::parse("file:/x,size=1M").is_err());
        assert!(PoolSpec::parse("devdax:/dev/dax0.0,huge=always").is_err());
        assert!(PoolSpec::parse("memfs:/x,size=12Q").is_err());
    }

    #[test]
    fn header_roundtrip() {
        let h = DevHeader {
            version: 1,
            uuid: [7; 16],
        };
        let b = h.encode();
        assert_eq!(&b[..8], b"MARUDEV\0");
        assert_eq!(DevHeader::decode(&b), Some(h));
        assert_eq!(DevHeader::decode(&[0; 32]), None);
    }
}
