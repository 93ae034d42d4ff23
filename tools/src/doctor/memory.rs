//! The memory the pools use: huge pages for memfs pools, NUMA nodes (CPU-less ones are CXL
//! memory in system-RAM mode), DAX devices and the configured raw pools' headers.

use std::io::ErrorKind;
use std::path::Path;

use maru::format::{self, HeaderError};
use maru::host;
use maru::size::format_size;

use super::target::{Check, LIMIT, Status, Target, bounded};

/// The selected value of a sysfs choice such as `always within_size [never] deny`.
fn selected(choices: &str) -> Option<&str> {
    let (_, rest) = choices.split_once('[')?;
    Some(rest.split_once(']')?.0)
}

/// Huge pages for memfs pools: each is a tmpfs mounted with `huge=` (transparent huge pages
/// of shared memory), which `shmem_enabled` can deny. hugetlbfs pages are not used by maru;
/// a large reservation of them is memory the pools cannot have.
pub(super) fn huge_pages(t: &Target) -> Check {
    const NAME: &str = "huge-pages";
    const THP: &str = "/sys/kernel/mm/transparent_hugepage";
    let kib = |f| host::meminfo(f).unwrap_or(0);
    let reserved = kib("HugePages_Total") * kib("Hugepagesize") * 1024;
    let hugetlb = format!(
        "hugetlb: {} of {} {} pages free (maru does not use them)",
        kib("HugePages_Free"),
        kib("HugePages_Total"),
        format_size(kib("Hugepagesize") * 1024)
    );
    if t.memfs().next().is_none() {
        return Check::ok(
            NAME,
            format!("no memfs pool (raw pools map the device as it is); {hugetlb}"),
        );
    }
    let read = |f: &str| std::fs::read_to_string(Path::new(THP).join(f)).ok();
    let shmem = read("shmem_enabled");
    let page = read("hpage_pmd_size")
        .and_then(|s| s.trim().parse().ok())
        .map_or("2 MiB".into(), format_size);
    match shmem.as_deref().and_then(selected) {
        None => Check::warn(
            NAME,
            "no transparent huge pages: memfs pools use 4 KiB pages (more TLB misses)",
            "run a kernel built with CONFIG_TRANSPARENT_HUGEPAGE=y",
        ),
        Some("deny") => Check::warn(
            NAME,
            "shmem_enabled is `deny`: every tmpfs, the memfs pools' too, uses 4 KiB pages",
            format!("echo within_size > {THP}/shmem_enabled"),
        ),
        _ if reserved > kib("MemTotal") * 1024 / 4 => Check::warn(
            NAME,
            format!(
                "{} of RAM is reserved for hugetlb, which memfs pools cannot use",
                format_size(reserved)
            ),
            "sysctl -w vm.nr_hugepages=0 (unless another program uses them)",
        ),
        Some(s) => {
            let huge: Vec<&str> = t.memfs().map(|p| p.huge.as_str()).collect();
            Check::ok(
                NAME,
                format!(
                    "memfs pools take {page} pages (huge={}; shmem_enabled [{s}] leaves that to each tmpfs); {hugetlb}",
                    huge.join(",")
                ),
            )
        }
    }
}

/// One NUMA node: its CPUs and its memory (kB).
fn node_line(n: u32, cpulist: &str, meminfo: &str) -> (Check, u64) {
    let cpus: u32 = host::parse_cpu_list(cpulist)
        .unwrap_or_default()
        .iter()
        .map(|(a, b)| b - a + 1)
        .sum();
    let kib = host::meminfo_field(meminfo, "MemTotal").unwrap_or(0);
    let mem = format_size(kib * 1024);
    let detail = if cpus == 0 && kib > 0 {
        format!(
            "{mem} of memory, no CPUs: CXL memory in system-RAM mode, usually; a memfs pool binds to it with numa={n}"
        )
    } else {
        format!("{cpus} CPUs ({}), {mem} of memory", cpulist.trim())
    };
    (Check::ok(&format!("numa/node{n}"), detail), kib)
}

/// NUMA nodes, CPU-less ones (CXL memory in system-RAM mode) pointed out, and each memfs
/// pool's `numa=` checked to name a node with memory (marud cannot mount it otherwise).
pub(super) fn numa(t: &Target) -> Vec<Check> {
    let dir = Path::new("/sys/devices/system/node");
    let mut ids: Vec<u32> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("node")?.parse().ok())
        .collect();
    ids.sort_unstable();
    let mut out = Vec::new();
    let mut with_memory = Vec::new();
    for n in &ids {
        let read = |f: &str| {
            std::fs::read_to_string(dir.join(format!("node{n}")).join(f)).unwrap_or_default()
        };
        let (line, kib) = node_line(*n, &read("cpulist"), &read("meminfo"));
        out.push(line);
        if kib > 0 {
            with_memory.push(n.to_string());
        }
    }
    if ids.is_empty() {
        out.push(Check::skip(
            "numa",
            "no /sys/devices/system/node: one memory node",
        ));
    }
    for p in t.memfs().filter(|p| {
        p.numa
            .is_some_and(|n| !with_memory.contains(&n.to_string()))
    }) {
        out.push(Check::fail(
            "numa",
            format!(
                "pool {} binds to NUMA node {}, which has no memory here: marud cannot mount it",
                p.path.display(),
                p.numa.unwrap_or_default()
            ),
            format!(
                "set numa= of that pool to a node with memory ({})",
                with_memory.join(", ")
            ),
        ));
    }
    out
}

/// What the first bytes of a raw pool's device or file hold.
enum Header {
    /// A header of this build's format: its description.
    Pool(String),
    /// No maru header.
    Blank,
    /// Not readable here, or of a format this build does not know: the line to print.
    Problem(Check),
}

/// Reads the header of the device or file at `path` with [`format::read_header`] (as
/// `maructl device show` does), under [`bounded`]; a problem is reported as line `name`.
fn header(path: &Path, name: &str) -> Header {
    const FIX: &str = "check the device (dmesg; daxctl list -D)";
    let p = path.to_owned();
    let r = bounded(LIMIT, move || {
        std::fs::File::open(&p).map(|f| format::read_header(&f))
    });
    let (status, what, fix) = match r {
        Some(Ok(Ok(Some(h)))) => {
            let uuid = h.uuid_string();
            return Header::Pool(format!("a maru pool (format {}, uuid {uuid})", h.version()));
        }
        Some(Ok(Ok(None))) => return Header::Blank,
        None => (
            Status::Warn,
            "does not answer a read of its header".into(),
            FIX,
        ),
        Some(Err(e)) if e.kind() == ErrorKind::PermissionDenied => {
            (Status::Skip, "only root reads its header".into(), "")
        }
        Some(Err(e)) => (Status::Warn, format!("does not open: {e}"), FIX),
        Some(Ok(Err(e @ HeaderError::UnknownVersion { .. }))) => (
            Status::Warn,
            format!("a maru pool, but {e}"),
            "use the marud and maructl that formatted it (`maructl device init --force` orphans its entries)",
        ),
        Some(Ok(Err(e))) => {
            let cause = std::error::Error::source(&e).map_or(String::new(), |c| format!(": {c}"));
            (Status::Warn, format!("{e}{cause}"), FIX)
        }
    };
    let fix = (!fix.is_empty()).then(|| fix.to_owned());
    Header::Problem(Check::new(
        name,
        status,
        format!("{}: {what}", path.display()),
        fix,
    ))
}

/// DAX devices (`/sys/bus/dax/devices`): devdax ones with or without a maru header, those
/// in system-RAM mode (driver `kmem`: they are NUMA nodes then); and the configured raw
/// pools, whose device must exist and, in cluster mode, carry a header already.
pub(super) fn dax(t: &Target) -> Vec<Check> {
    let sys = Path::new("/sys/bus/dax/devices");
    let mut names: Vec<String> = std::fs::read_dir(sys)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort();
    let mut out = Vec::new();
    for name in &names {
        let d = sys.join(name);
        let read = |f: &str| {
            std::fs::read_to_string(d.join(f))
                .map(|s| s.trim().to_owned())
                .unwrap_or_default()
        };
        let size = format_size(read("size").parse().unwrap_or(0));
        let driver = std::fs::read_link(d.join("driver"))
            .ok()
            .and_then(|l| l.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_default();
        let dev = Path::new("/dev").join(name);
        let line = format!("dax/{name}");
        out.push(if driver == "kmem" {
            let node = read("target_node");
            let how = format!("memfs pools bind to it with numa={node}");
            Check::ok(
                &line,
                format!("{size} in system-RAM mode: NUMA node {node} ({how})"),
            )
        } else if !dev.exists() {
            Check::ok(&line, format!("{size}, no /dev/{name} (driver `{driver}`)"))
        } else {
            match header(&dev, &line) {
                Header::Pool(h) => Check::ok(&line, format!("{size} devdax, {h}")),
                Header::Blank => {
                    let init = format!("maructl device init {}", dev.display());
                    Check::ok(
                        &line,
                        format!("{size} devdax, no maru header (`{init}` makes it a pool)"),
                    )
                }
                Header::Problem(c) => c,
            }
        });
    }
    let raw = t
        .pools
        .iter()
        .filter(|p| p.kind == "devdax" || p.kind == "file");
    for p in raw {
        let file = p.path.file_name().unwrap_or_default().to_string_lossy();
        let line = format!("pool/{file}");
        let path = p.path.display();
        out.push(match header(&p.path, &line) {
            _ if !p.path.exists() && p.kind == "devdax" => Check::fail(
                &line,
                format!("{path}: configured, but there is no such device"),
                "daxctl list -D shows the devices; daxctl reconfigure-device --mode=devdax daxX.Y",
            ),
            _ if !p.path.exists() && !t.cluster.is_empty() => Check::fail(
                &line,
                format!(
                    "{path}: no such file; in cluster mode the hosts share one initialized pool"
                ),
                format!(
                    "truncate -s SIZE {0} && maructl device init {0} (once, on one host)",
                    p.path.display()
                ),
            ),
            _ if !p.path.exists() => Check::ok(
                &line,
                format!("{path}: not there yet; marud creates the file"),
            ),
            Header::Blank if !t.cluster.is_empty() => Check::fail(
                &line,
                format!("{path}: no maru header; in cluster mode marud refuses the device"),
                format!(
                    "maructl device init {} (once, on one host)",
                    p.path.display()
                ),
            ),
            Header::Blank => Check::ok(
                &line,
                format!("{path}: no maru header yet; marud writes one when it opens it"),
            ),
            Header::Pool(h) => Check::ok(&line, format!("{path}: {h}")),
            Header::Problem(c) => c,
        });
    }
    if out.is_empty() {
        out.push(Check::skip("dax", "no DAX devices, no raw pool configured"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numa_nodes() {
        let (c, kib) = node_line(1, "\n", "Node 1 MemTotal:  33554432 kB\n");
        assert_eq!(kib, 33554432);
        assert!(
            c.detail.contains("no CPUs") && c.detail.contains("numa=1"),
            "{}",
            c.detail
        );
        let (c, _) = node_line(0, "0-3,8\n", "Node 0 MemTotal:  1024 kB\n");
        assert_eq!(c.detail, "5 CPUs (0-3,8), 1.0 MiB of memory");
    }

    #[test]
    fn sysfs_choices() {
        assert_eq!(
            selected("always within_size [never] deny force\n"),
            Some("never")
        );
        assert_eq!(selected("never"), None);
    }

    #[test]
    fn raw_pool_headers() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("dev.img");
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(1 << 20).unwrap();
        assert!(matches!(header(&p, "x"), Header::Blank));
        let h = format::init_header(&f).unwrap();
        assert!(matches!(header(&p, "x"), Header::Pool(d) if d.contains(&h.uuid_string())));
        f.set_len(8).unwrap();
        assert!(matches!(header(&p, "x"), Header::Problem(c) if c.status == Status::Warn));
        let config = |cluster: &str| {
            let pool = dir.path().join("none");
            let text = format!("pools = [\"file:{}\"]\n{cluster}", pool.display());
            crate::doctor::Target::new(toml::from_str(&text).unwrap(), None)
        };
        let alone = dax(&config("")).pop().unwrap();
        assert_eq!(alone.status, Status::Ok);
        assert!(
            alone
                .detail
                .ends_with("not there yet; marud creates the file")
        );
        let cluster = dax(&config("cluster = \"http://e\"\nnode = \"a\"\n"))
            .pop()
            .unwrap();
        assert_eq!(cluster.status, Status::Fail, "{}", cluster.detail);
    }
}
