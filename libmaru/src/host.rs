//! What this host's kernel offers maru, read from `/proc` and `/sys`: shared by the FUSE
//! server (`maru-fsd`, which acts on it), marud and `maructl doctor` (which report it), so
//! that each reads the same files the same way.
//!
//! Every function here only reads small kernel files: none blocks, none needs privileges.

use std::io;
use std::path::Path;

/// The FUSE device every mount is served through.
pub const FUSE_DEVICE: &str = "/dev/fuse";

/// The module parameter that lets FUSE servers ask for FUSE over io_uring. It exists only in
/// kernels built with `CONFIG_FUSE_IO_URING` (Linux 6.14+).
pub const FUSE_URING_PARAM: &str = "/sys/module/fuse/parameters/enable_uring";

/// The first kernel (major, minor) with FUSE passthrough (`CONFIG_FUSE_PASSTHROUGH`), which
/// makes the mapping of a memfs entry through the mount the pool's own pages.
pub const PASSTHROUGH_SINCE: (u32, u32) = (6, 9);

/// The first kernel (major, minor) with FUSE over io_uring (`CONFIG_FUSE_IO_URING`).
pub const URING_SINCE: (u32, u32) = (6, 14);

/// The state of [`FUSE_URING_PARAM`]: `Ok(None)` when the kernel has no FUSE over io_uring
/// (no such parameter), else whether servers may use it now.
pub fn fuse_uring_param() -> io::Result<Option<bool>> {
    match std::fs::read_to_string(FUSE_URING_PARAM) {
        Ok(v) => Ok(Some(matches!(v.trim(), "Y" | "1"))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// The running kernel's release (`uname -r`), such as `6.14.2-arch1-1`.
pub fn kernel_release() -> io::Result<String> {
    Ok(std::fs::read_to_string("/proc/sys/kernel/osrelease")?
        .trim()
        .to_owned())
}

/// The (major, minor) of a kernel release such as `6.14.2-arch1-1` or `5.15.0`.
pub fn parse_release(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(['.', '-', '+']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Whether the build configuration of kernel `release` (`/boot/config-<release>`, as distros
/// install it) sets `option` (such as `CONFIG_FUSE_PASSTHROUGH`) to `y` or `m`; `None` when
/// that file cannot be read. A readable configuration that does not name it: `Some(false)`.
pub fn kernel_config(release: &str, option: &str) -> Option<bool> {
    let text =
        std::fs::read_to_string(Path::new("/boot").join(format!("config-{release}"))).ok()?;
    Some(config_sets(&text, option))
}

/// Whether a kernel `.config` text sets `option` to `y` or `m`.
pub fn config_sets(text: &str, option: &str) -> bool {
    text.lines().any(|l| {
        l.strip_prefix(option)
            .and_then(|rest| rest.strip_prefix('='))
            .is_some_and(|v| v == "y" || v == "m")
    })
}

/// The CPUs of a kernel CPU list such as `0-3,8-11` (`/sys/devices/system/cpu/possible`, a
/// NUMA node's `cpulist`), as inclusive ranges; the empty list (a node without CPUs) is
/// `Some(vec![])`. `None` when the text is not a CPU list.
pub fn parse_cpu_list(s: &str) -> Option<Vec<(u32, u32)>> {
    let s = s.trim();
    if s.is_empty() {
        return Some(Vec::new());
    }
    s.split(',')
        .map(|part| {
            let (a, b) = part.split_once('-').unwrap_or((part, part));
            let (a, b) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
            (a <= b).then_some((a, b))
        })
        .collect()
}

/// The value of field `name` of a meminfo text: `/proc/meminfo` (`MemTotal:  16 kB`) or a
/// NUMA node's `meminfo` (`Node 1 MemTotal:  16 kB`). In kB for sizes, a count for
/// `HugePages_*`; `None` when the field is absent.
pub fn meminfo_field(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut words = l.split_whitespace();
        words.find(|w| w.strip_suffix(':') == Some(name))?;
        words.next()?.parse().ok()
    })
}

/// Field `name` of `/proc/meminfo` (see [`meminfo_field`]).
pub fn meminfo(name: &str) -> Option<u64> {
    meminfo_field(&std::fs::read_to_string("/proc/meminfo").ok()?, name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases() {
        assert_eq!(parse_release("6.14.2-arch1-1"), Some((6, 14)));
        assert_eq!(parse_release("5.15.0"), Some((5, 15)));
        assert_eq!(parse_release("6.9-rc1"), Some((6, 9)));
        assert_eq!(parse_release("6.18.44-fc-v1045"), Some((6, 18)));
        assert_eq!(parse_release("linux"), None);
        assert!(parse_release("6.8.0").unwrap() < PASSTHROUGH_SINCE);
    }

    #[test]
    fn kernel_configs() {
        let c = "# CONFIG_FUSE_IO_URING is not set\nCONFIG_FUSE_PASSTHROUGH=y\nCONFIG_FUSE_FS=m\n";
        assert!(config_sets(c, "CONFIG_FUSE_PASSTHROUGH"));
        assert!(config_sets(c, "CONFIG_FUSE_FS"));
        assert!(!config_sets(c, "CONFIG_FUSE_IO_URING"));
        assert!(!config_sets(c, "CONFIG_FUSE"));
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0"), Some(vec![(0, 0)]));
        assert_eq!(parse_cpu_list("0-3,8-11\n"), Some(vec![(0, 3), (8, 11)]));
        assert_eq!(parse_cpu_list("\n"), Some(vec![]));
        assert_eq!(parse_cpu_list("x"), None);
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("0-"), None);
    }

    #[test]
    fn meminfo_fields() {
        let proc =
            "MemTotal:       16316412 kB\nHugePages_Total:       4\nHugepagesize:       2048 kB\n";
        assert_eq!(meminfo_field(proc, "MemTotal"), Some(16316412));
        assert_eq!(meminfo_field(proc, "HugePages_Total"), Some(4));
        assert_eq!(meminfo_field(proc, "Hugepagesize"), Some(2048));
        assert_eq!(meminfo_field(proc, "HugePages_Free"), None);
        let node = "Node 1 MemTotal:       33554432 kB\nNode 1 MemFree:        33000000 kB\n";
        assert_eq!(meminfo_field(node, "MemTotal"), Some(33554432));
        assert_eq!(meminfo_field(node, "MemFree"), Some(33000000));
        assert_eq!(meminfo_field("MemTotal: lots\n", "MemTotal"), None);
    }
}
