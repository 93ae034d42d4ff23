//! The kernel's FUSE: `/dev/fuse`, passthrough and FUSE over io_uring, read the way
//! maru-fsd reads them ([`maru::host`]).

use std::io::ErrorKind;

use maru::host;

use super::target::{Check, Target, is_root};

/// `/dev/fuse` and the two FUSE features the mount uses when the kernel has them.
pub(super) fn fuse(t: &Target) -> Vec<Check> {
    const NAME: &str = "fuse";
    if t.mount.is_none() {
        return vec![Check::skip(
            NAME,
            "no mount configured (no_mount = true): marud needs no FUSE",
        )];
    }
    let dev = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(host::FUSE_DEVICE)
    {
        Ok(_) => Check::ok(NAME, format!("{} opens", host::FUSE_DEVICE)),
        Err(e) if e.kind() == ErrorKind::NotFound => {
            return vec![Check::fail(
                NAME,
                "no /dev/fuse: marud cannot mount the filesystem",
                "modprobe fuse (at boot: echo fuse > /etc/modules-load.d/fuse.conf), or no_mount = true",
            )];
        }
        Err(e) if e.kind() == ErrorKind::PermissionDenied && !is_root() => Check::ok(
            NAME,
            "/dev/fuse is there (only root opens it; marud runs as root)",
        ),
        Err(e) => Check::fail(
            NAME,
            format!("/dev/fuse does not open: {e}"),
            "modprobe fuse, and check the device: crw-rw-rw- root root 10, 229",
        ),
    };
    let release = host::kernel_release().unwrap_or_default();
    vec![dev, passthrough(t, &release), uring(t, &release)]
}

/// FUSE passthrough: a memfs entry's mapping through the mount is the pool's own pages.
/// The mount learns it at INIT (maru-fsd); before that, the kernel's build configuration
/// says, where it is installed, else its version.
fn passthrough(t: &Target, release: &str) -> Check {
    const NAME: &str = "fuse-passthrough";
    const FIX: &str = "run Linux 6.9+ built with CONFIG_FUSE_PASSTHROUGH=y";
    if t.memfs().next().is_none() {
        return Check::skip(
            NAME,
            "no memfs pool: raw pools are served by copying either way",
        );
    }
    let has = host::kernel_config(release, "CONFIG_FUSE_PASSTHROUGH")
        .or_else(|| host::parse_release(release).map(|v| v >= host::PASSTHROUGH_SINCE));
    match has {
        Some(true) => Check::ok(
            NAME,
            format!("kernel {release} has it: memfs entries map the pool's pages"),
        ),
        Some(false) => Check::warn(
            NAME,
            format!(
                "kernel {release} lacks it: memfs entries are read by copying through marud (slower)"
            ),
            FIX,
        ),
        None => Check::warn(
            NAME,
            format!("cannot tell from kernel release `{release}`"),
            FIX,
        ),
    }
}

/// FUSE over io_uring (`fuse_uring`): one request queue per CPU.
fn uring(t: &Target, release: &str) -> Check {
    const NAME: &str = "fuse-io-uring";
    let mode = t.file.fuse_uring.as_deref().unwrap_or("auto");
    if mode == "off" {
        return Check::skip(NAME, "fuse_uring = \"off\": requests go through /dev/fuse");
    }
    let disabled = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .is_ok_and(|v| v.trim() == "2");
    let (detail, remedy) = match host::fuse_uring_param() {
        Ok(Some(_)) if disabled => (
            "io_uring is disabled (kernel.io_uring_disabled = 2)".to_owned(),
            "sysctl -w kernel.io_uring_disabled=0".to_owned(),
        ),
        Ok(Some(on)) => {
            let how = if on {
                "on"
            } else {
                "available (marud turns fuse.enable_uring on when it mounts)"
            };
            return Check::ok(NAME, format!("{how}: one request queue per CPU"));
        }
        Ok(None) => (
            format!("kernel {release} has none"),
            "run Linux 6.14+ built with CONFIG_FUSE_IO_URING=y".to_owned(),
        ),
        Err(e) => (
            format!("cannot read {}: {e}", host::FUSE_URING_PARAM),
            "run doctor as root".to_owned(),
        ),
    };
    if mode == "on" {
        Check::fail(
            NAME,
            format!("{detail}, and fuse_uring = \"on\" makes marud refuse to start"),
            format!("{remedy}, or fuse_uring = \"auto\""),
        )
    } else {
        Check::warn(
            NAME,
            format!("{detail}: requests go through /dev/fuse (slower)"),
            remedy,
        )
    }
}
