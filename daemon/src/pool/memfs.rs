//! A memfs pool's tmpfs: its tree (`n/<ns>/<key>`, the metadata), the nameless files being
//! written (`w`), pins as extended attributes and namespaces' access as POSIX ACLs.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use maru::Error;

use super::{PoolSpec, cpath, default_memfs_size, mount_entry, statvfs};
use crate::acl::{self, Acl};

/// A memfs pool.
pub struct MemfsPool {
    /// The tmpfs mount point.
    pub root: PathBuf,
    /// Capacity (tmpfs size).
    pub capacity: u64,
    /// Whether this daemon mounted it (vs reused one left by an earlier run).
    pub mounted_here: bool,
    /// `w`: where files being written are created, nameless (`O_TMPFILE`) until published.
    writing: std::sync::Arc<WritingDir>,
    /// Namespace directories known to exist in this pool, open (publication links into them).
    ns_dirs: parking_lot::Mutex<std::collections::HashMap<String, std::sync::Arc<File>>>,
    /// Whether the tmpfs takes POSIX access ACLs, by which namespace directories mirror their
    /// namespaces' access ([`MemfsPool::set_ns_access`]).
    pub acls: bool,
    /// The crash-injection seam (tests, feature `seams`): decides whether each metadata step
    /// reaches the tmpfs.
    #[cfg(feature = "seams")]
    gate: parking_lot::RwLock<Option<MetaGate>>,
}

/// A memfs pool's `w`, where files being written are created: any thread may create one
/// without the store's lock (the `fallocate` of a large file takes as long as zeroing its
/// pages, and nothing but the file, nameless until published, is touched).
pub struct WritingDir {
    dir: File,
    /// The bits the process's umask takes off the files created here (0 where the
    /// directory's default ACL stands in for the umask).
    umask: u32,
    /// The pool's tmpfs, for messages.
    root: PathBuf,
}

impl WritingDir {
    /// Creates a writing file of `size` bytes (space reserved with fallocate), with the
    /// permission bits it will have once sealed (the descriptor returned stays writable). The
    /// file has no name until [`MemfsPool::publish`] links it: one given up, or left by a
    /// crash, is freed by the tmpfs with its last descriptor or mapping, with nothing to clean.
    /// `NoSpace` when the tmpfs has no room.
    pub fn create(&self, size: u64, mode: u32) -> Result<File, Error> {
        use nix::fcntl::OFlag;
        let fd = nix::fcntl::openat(
            &self.dir,
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
#[cfg(feature = "seams")]
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
        let mounted_here = match mount_entry(&root).map(|m| m.fstype).as_deref() {
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
            writing: std::sync::Arc::new(WritingDir {
                dir: writing_dir,
                umask,
                root: root.clone(),
            }),
            root,
            capacity,
            mounted_here,
            ns_dirs: parking_lot::Mutex::new(std::collections::HashMap::new()),
            acls,
            #[cfg(feature = "seams")]
            gate: parking_lot::RwLock::new(None),
        })
    }

    /// Installs the crash-injection seam (tests).
    #[cfg(feature = "seams")]
    pub fn set_gate(&self, gate: Option<MetaGate>) {
        *self.gate.write() = gate;
    }

    /// Whether the metadata step `step` makes reaches the pool (always, without a gate: the
    /// step is then never built).
    #[cfg(feature = "seams")]
    pub fn pass(&self, step: impl FnOnce() -> MetaStep) -> bool {
        self.gate.read().as_ref().is_none_or(|g| g(&step()))
    }

    /// Whether the metadata step `step` makes reaches the pool: always (the crash-injection
    /// seam is built with feature `seams` only).
    #[cfg(not(feature = "seams"))]
    pub fn pass(&self, _step: impl FnOnce() -> MetaStep) -> bool {
        true
    }

    /// Path of a sealed entry.
    pub fn entry_path(&self, ns: &str, key: &str) -> PathBuf {
        self.root.join("n").join(ns).join(key)
    }

    /// Creates a writing file of `size` bytes: [`WritingDir::create`].
    pub fn create_writing(&self, size: u64, mode: u32) -> Result<File, Error> {
        self.writing.create(size, mode)
    }

    /// Where this pool's files being written are created, for use without the pool.
    pub fn writing(&self) -> std::sync::Arc<WritingDir> {
        self.writing.clone()
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

/// Pins the entry file `f` (`user.maru.pinned=1`) before it is linked under its name, so
/// that it is never found unpinned (an entry that leaves its pack pinned).
pub fn pin_file(f: &File) -> io::Result<()> {
    set_xattr_of(f, PIN_XATTR, b"1")
}

/// Sets xattr `name` of the open file `f` to `value`.
fn set_xattr_of(f: &File, name: &str, value: &[u8]) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let name = CString::new(name).expect("no NUL");
    // SAFETY: a live descriptor, a valid C string and a buffer of `value.len()` bytes.
    let r = unsafe {
        libc::fsetxattr(
            f.as_raw_fd(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The xattr of a file copied out of a pack, while the pack log may still hold the entry
/// there: the pack file's inode number and the offset, as `INO:OFFSET`.
const LEFT_XATTR: &str = "user.maru.left";

/// Marks file `f` (not linked yet) as the copy of the entry at `offset` of the pack file
/// whose inode number is `pack_ino` ([`left_pack`] reads it back at recovery).
pub fn mark_left(f: &File, pack_ino: u64, offset: u64) -> io::Result<()> {
    set_xattr_of(f, LEFT_XATTR, format!("{pack_ino}:{offset}").as_bytes())
}

/// Takes the mark of [`mark_left`] off `f` (the pack log has let the entry go).
pub fn unmark_left(f: &File) -> io::Result<()> {
    remove_xattr_of(f, LEFT_XATTR)
}

/// The xattr of an entry's file whose owner is being changed: the owner, group and mode it
/// is given, as `UID:GID:MODE` (octal). The change is three steps (mode 0, owner, mode): a
/// crash between them left the entry at mode 0 for good; a restart finishes it now
/// ([`finish_owning`]).
const OWNING_XATTR: &str = "user.maru.owning";

/// Marks entry file `f` as being given owner `uid`, group `gid` and `mode`.
pub fn mark_owning(f: &File, uid: u32, gid: u32, mode: u32) -> io::Result<()> {
    set_xattr_of(f, OWNING_XATTR, format!("{uid}:{gid}:{mode:o}").as_bytes())
}

/// Takes the mark of [`mark_owning`] off `f` (the change is done, or undone).
pub fn unmark_owning(f: &File) -> io::Result<()> {
    remove_xattr_of(f, OWNING_XATTR)
}

/// Finishes a change of owner a crash cut ([`mark_owning`]) on the entry file at `p`: gives
/// it the owner, group and mode its mark says, and takes the mark off. Nothing to do
/// without a mark.
pub fn finish_owning(p: &Path) -> io::Result<()> {
    let Some(text) = xattr_text(p, OWNING_XATTR) else {
        return Ok(());
    };
    let mut parts = text.split(':');
    let mut field = |radix| {
        parts
            .next()
            .and_then(|v| u32::from_str_radix(v, radix).ok())
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{}: {OWNING_XATTR} is {text:?}", p.display()),
                )
            })
    };
    let (uid, gid, mode) = (field(10)?, field(10)?, field(8)?);
    let f = File::open(p)?;
    nix::unistd::fchown(
        &f,
        Some(nix::unistd::Uid::from_raw(uid)),
        Some(nix::unistd::Gid::from_raw(gid)),
    )?;
    nix::sys::stat::fchmod(&f, nix::sys::stat::Mode::from_bits_truncate(mode))?;
    tracing::info!(file = %p.display(), uid, gid, mode = format!("{mode:o}"), "finished a change of owner a crash cut");
    unmark_owning(&f)
}

/// Removes xattr `name` of the open file `f`; removing an absent one is fine.
fn remove_xattr_of(f: &File, name: &str) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let name = CString::new(name).expect("no NUL");
    // SAFETY: a live descriptor and a valid C string.
    if unsafe { libc::fremovexattr(f.as_raw_fd(), name.as_ptr()) } != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ENODATA) {
            return Err(e);
        }
    }
    Ok(())
}

/// The mark of [`mark_left`] on the file at `p`: the pack file's inode number and the offset.
pub fn left_pack(p: &Path) -> Option<(u64, u64)> {
    let text = xattr_text(p, LEFT_XATTR)?;
    let (ino, off) = text.split_once(':')?;
    Some((ino.parse().ok()?, off.parse().ok()?))
}

/// The short text xattr `name` of the file at `p` (up to 64 bytes); None if absent.
fn xattr_text(p: &Path, name: &str) -> Option<String> {
    let (p, n) = (cpath(p).ok()?, CString::new(name).ok()?);
    let mut buf = [0u8; 64];
    // SAFETY: valid C strings and a buffer of 64 bytes.
    let len = unsafe { libc::getxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    let text = std::str::from_utf8(buf.get(..usize::try_from(len).ok()?)?).ok()?;
    Some(text.to_owned())
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
