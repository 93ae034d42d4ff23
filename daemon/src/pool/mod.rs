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
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use maru::Error;
use maru::format;
use maru::proto::PoolKind;
use maru::size::parse_size;

pub mod memfs;

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

/// The filesystem mounted exactly at `dir`, if any (the last mounted there).
pub fn mount_entry(dir: &Path) -> Option<MountEntry> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let want = dir.to_str()?;
    let mut found = None;
    for line in info.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        let Some(sep) = f.iter().position(|x| *x == "-") else {
            continue;
        };
        if f.get(4).map(|m| unescape_mount(m)) != Some(want.to_owned()) {
            continue;
        }
        let dev = f.get(2).and_then(|d| {
            let (a, b) = d.split_once(':')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        });
        if let (Some(fstype), Some(dev)) = (f.get(sep + 1), dev) {
            found = Some(MountEntry {
                fstype: fstype.to_string(),
                dev,
            });
        }
    }
    found
}

/// A line of the mount table: the filesystem's type and its device number (major, minor).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    /// `tmpfs`, `fuse.maru`, …
    pub fstype: String,
    /// The superblock's device number.
    pub dev: (u32, u32),
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
