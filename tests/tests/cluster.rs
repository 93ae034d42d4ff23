//! Cluster mode end to end: two marud processes (hosts `a` and `b`), each with its own socket,
//! mount and state, sharing one `file:` pool (the stand-in for a CXL device), with their
//! metadata in a private etcd (`maru_cluster::testing`).

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use maru::Error;
use maru_cluster::testing::{Etcd, Net};
use maru_tests::{Daemon, Opts, bin, pattern, pfns, require_root, xattr};

const POOL_SIZE: u64 = 256 << 20;

struct Cluster {
    a: Daemon,
    b: Daemon,
    pool: PathBuf,
    etcd: Etcd,
    _dir: tempfile::TempDir,
}

/// The lease TTL the hosts run with.
const TTL: Duration = Duration::from_secs(3);

fn host(etcd: &Etcd, pool: &Path, node: &str) -> Daemon {
    host_in(etcd, pool, node, None)
}

/// A host in network namespace `netns` (None: the test's).
fn host_in(etcd: &Etcd, pool: &Path, node: &str, netns: Option<&str>) -> Daemon {
    host_with(etcd, pool, node, netns, "")
}

/// A host whose pool spec ends with `options` (`,opt=value...`).
fn host_with(etcd: &Etcd, pool: &Path, node: &str, netns: Option<&str>, options: &str) -> Daemon {
    // Full means full: the fill tests count what fits.
    host_flags(etcd, pool, node, netns, options, &["--eviction", "off"])
}

/// [`host_with`], with marud's `flags` after the cluster's.
fn host_flags(
    etcd: &Etcd,
    pool: &Path,
    node: &str,
    netns: Option<&str>,
    options: &str,
    flags: &[&str],
) -> Daemon {
    let mut extra = vec![
        "--cluster".into(),
        etcd.endpoints().join(","),
        "--node".into(),
        node.into(),
        "--cluster-ttl".into(),
        TTL.as_secs().to_string(),
    ];
    extra.extend(flags.iter().map(|f| f.to_string()));
    Daemon::start_in(
        Opts {
            pools: vec![format!("file:{},size={POOL_SIZE}{options}", pool.display())],
            mount: true,
            extra,
        },
        netns,
    )
}

/// A pool file with its header written (`maructl device init`), as a shared device is.
fn pool_file(dir: &Path) -> PathBuf {
    let pool = dir.join("cxl.img");
    std::fs::File::create(&pool)
        .and_then(|f| f.set_len(POOL_SIZE))
        .expect("pool file");
    let out = std::process::Command::new(bin("maructl"))
        .args(["device", "init"])
        .arg(&pool)
        .output()
        .expect("maructl");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    pool
}

/// Two hosts on one initialized pool file, or None (skip) without etcd outside CI.
fn cluster() -> Option<Cluster> {
    let etcd = Etcd::start()?;
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = pool_file(dir.path());
    let a = host(&etcd, &pool, "a");
    let b = host(&etcd, &pool, "b");
    Some(Cluster {
        a,
        b,
        pool,
        etcd,
        _dir: dir,
    })
}

fn store(h: &maru::Handler, path: &str, bytes: &[u8]) -> maru::Result<()> {
    let mut a = h.alloc(bytes.len() as u64)?;
    a.as_mut_slice().copy_from_slice(bytes);
    h.store(path, a)
}

/// Waits until `cond` holds (at most 10 s); returns how long it took.
fn eventually(what: &str, cond: impl FnMut() -> bool) -> Duration {
    eventually_within(what, Duration::from_secs(10), cond)
}

/// Waits until `cond` holds (at most `limit`); returns how long it took.
fn eventually_within(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
    t.elapsed()
}

fn location(d: &Daemon, rel: &str) -> (String, u64) {
    let v = xattr(&d.path(rel), "user.maru.location").expect("user.maru.location");
    let v = String::from_utf8(v).expect("utf-8");
    let (path, off) = v.rsplit_once('@').expect("PATH@OFFSET");
    (
        path.to_owned(),
        u64::from_str_radix(off.trim_start_matches("0x"), 16).expect("hex offset"),
    )
}

/// Asserts that no two of `spans` (offset, length, name) share a byte of the pool.
fn assert_apart(mut spans: Vec<(u64, u64, String)>) {
    spans.sort();
    for w in spans.windows(2) {
        assert!(
            w[0].0 + w[0].1 <= w[1].0,
            "{} at {:#x} and {} at {:#x} overlap",
            w[0].2,
            w[0].0,
            w[1].2,
            w[1].0
        );
    }
}

#[test]
fn an_entry_stored_on_one_host_is_served_by_the_other_from_the_same_pages() {
    require_root!();
    let Some(c) = cluster() else { return };
    let (ha, hb) = (c.a.handler(), c.b.handler());
    ha.mkdir("llama", 0o755).expect("mkdir");
    let bytes = pattern(7, 4 << 20);
    store(&ha, "llama/chunk-0", &bytes).expect("store on a");
    // (Until then b has no namespace `llama`: exists says so with an error.)
    let lag = eventually("b sees a's entry", || {
        hb.exists("llama/chunk-0").unwrap_or(false)
    });
    eprintln!("visible on b {lag:?} after a's store returned");
    let on_b = hb
        .retrieve("llama/chunk-0")
        .expect("retrieve")
        .expect("found");
    assert!(on_b.as_slice() == bytes.as_slice(), "b reads other bytes");
    let on_a = ha
        .retrieve("llama/chunk-0")
        .expect("retrieve")
        .expect("found");
    // Zero copy on both hosts: the same physical pages, the pool file's.
    let (pa, pb) = (
        pfns(on_a.as_ptr(), on_a.len()),
        pfns(on_b.as_ptr(), on_b.len()),
    );
    assert!(
        pa.iter().all(|&p| p != 0) && pa == pb,
        "the hosts map different pages"
    );
    let (file, off) = location(&c.b, "llama/chunk-0");
    assert_eq!(Path::new(&file), c.pool);
    assert_eq!(location(&c.a, "llama/chunk-0"), (file.clone(), off));
    let mut head = vec![0u8; 4096];
    std::fs::File::open(&c.pool)
        .and_then(|f| f.read_exact_at(&mut head, off))
        .expect("read the pool file");
    assert_eq!(head, bytes[..4096]);
    // The other door on b: the mount lists and reads it.
    let names: Vec<String> = std::fs::read_dir(c.b.path("llama"))
        .expect("ls")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["chunk-0"]);
    assert!(std::fs::read(c.b.path("llama/chunk-0")).expect("read") == bytes);
    // maructl status on b shows the cluster: both hosts, b's claims none, a's one region.
    let status = |json: bool| {
        let mut cmd = std::process::Command::new(bin("maructl"));
        cmd.arg("--socket").arg(&c.b.socket);
        if json {
            cmd.arg("--json");
        }
        let out = cmd.arg("status").output().expect("maructl");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).expect("utf-8")
    };
    eventually("the hosts show", || {
        let j: serde_json::Value = serde_json::from_str(&status(true)).expect("json");
        let cl = &j["cluster"];
        let hosts: Vec<&str> = cl["hosts"]
            .as_array()
            .map(|h| h.iter().filter_map(|x| x["node"].as_str()).collect())
            .unwrap_or_default();
        cl["node"] == "b"
            && cl["live"] == true
            && cl["entries_elsewhere"] == 1
            && cl["entries_here"] == 0
            && hosts == ["a", "b"]
            && cl["hosts"][0]["claimed"].as_u64().unwrap_or(0) >= 4 << 20
            && cl["hosts"][0]["entries"] == 1
            && cl["hosts"][1]["entries"] == 0
    });
    let text = status(false);
    assert!(text.contains("cluster: node b (live)"), "{text}");
    assert!(text.contains("1 by other hosts"), "{text}");
}

#[test]
fn two_hosts_storing_one_key_at_once_agree_on_one_winner() {
    require_root!();
    let Some(c) = cluster() else { return };
    let (ha, hb) = (c.a.handler(), c.b.handler());
    // b learns of the namespace with its first entry.
    ha.mkdir("race", 0o777).expect("mkdir");
    store(&ha, "race/seed", b"x").expect("store on a");
    eventually("b has the namespace", || {
        hb.exists("race/seed").unwrap_or(false)
    });
    let n = 24;
    let (ra, rb) = std::thread::scope(|s| {
        let ta = s.spawn(|| {
            (0..n)
                .map(|i| store(&ha, &format!("race/k{i}"), &pattern(1, 65536)))
                .collect::<Vec<_>>()
        });
        let tb = s.spawn(|| {
            (0..n)
                .map(|i| store(&hb, &format!("race/k{i}"), &pattern(2, 65536)))
                .collect::<Vec<_>>()
        });
        (ta.join().expect("a"), tb.join().expect("b"))
    });
    for i in 0..n {
        let key = format!("race/k{i}");
        let winner = match (&ra[i], &rb[i]) {
            (Ok(()), Err(Error::Exists(_))) => pattern(1, 65536),
            (Err(Error::Exists(_)), Ok(())) => pattern(2, 65536),
            other => panic!("{key}: not exactly one winner: {other:?}"),
        };
        for h in [&ha, &hb] {
            eventually("both hosts serve the winner", || {
                h.retrieve(&key)
                    .ok()
                    .flatten()
                    .is_some_and(|m| m.as_slice() == winner.as_slice())
            });
        }
    }
}

/// A batch store of `names` on `h`, each entry's bytes `pattern(seed + i)`: one outcome each.
fn batch(h: &maru::Handler, names: &[String], seed: u64) -> Vec<maru::Result<()>> {
    let items = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let mut a = h.alloc(8192).expect("alloc");
            a.as_mut_slice()
                .copy_from_slice(&pattern(seed + i as u64, 8192));
            (n.clone(), a)
        })
        .collect();
    h.batch_store(items).expect("batch store")
}

#[test]
fn batches_of_stores_and_deletes_on_two_hosts_at_once_keep_every_name_write_once() {
    require_root!();
    let Some(c) = cluster() else { return };
    let (ha, hb) = (c.a.handler(), c.b.handler());
    ha.mkdir("grp", 0o777).expect("mkdir");
    store(&ha, "grp/seed", b"x").expect("store on a");
    eventually("b has the namespace", || {
        hb.exists("grp/seed").unwrap_or(false)
    });
    // 150 names each (more than one etcd transaction), 100 of them in both batches, stored
    // at once: group-committed on both hosts, each shared name has exactly one winner.
    let names_a: Vec<String> = (0..150).map(|i| format!("grp/k{i}")).collect();
    let names_b: Vec<String> = (50..200).map(|i| format!("grp/k{i}")).collect();
    let (ra, rb) = std::thread::scope(|s| {
        let ta = s.spawn(|| batch(&ha, &names_a, 0));
        let tb = s.spawn(|| batch(&hb, &names_b, 1000));
        (ta.join().expect("a"), tb.join().expect("b"))
    });
    for i in 0..200u64 {
        let name = format!("grp/k{i}");
        let (a, b) = (
            (i < 150).then(|| &ra[i as usize]),
            (i >= 50).then(|| &rb[i as usize - 50]),
        );
        let want = match (a, b) {
            (Some(Ok(())), None) | (Some(Ok(())), Some(Err(Error::Exists(_)))) => pattern(i, 8192),
            (None, Some(Ok(()))) | (Some(Err(Error::Exists(_))), Some(Ok(()))) => {
                pattern(1000 + i - 50, 8192)
            }
            other => panic!("{name}: not exactly one winner: {other:?}"),
        };
        for h in [&ha, &hb] {
            eventually("both hosts serve the winner", || {
                h.retrieve(&name)
                    .ok()
                    .flatten()
                    .is_some_and(|m| m.as_slice() == want.as_slice())
            });
        }
    }
    // Both hosts delete every name at once, in batches: each entry goes once.
    let all: Vec<String> = (0..200).map(|i| format!("grp/k{i}")).collect();
    let refs: Vec<&str> = all.iter().map(String::as_str).collect();
    let (da, db) = std::thread::scope(|s| {
        let ta = s.spawn(|| ha.batch_delete(&refs).expect("batch delete on a"));
        let tb = s.spawn(|| hb.batch_delete(&refs).expect("batch delete on b"));
        (ta.join().expect("a"), tb.join().expect("b"))
    });
    for (i, (a, b)) in da.iter().zip(&db).enumerate() {
        match (a, b) {
            (Ok(()), Err(Error::NotFound(_))) | (Err(Error::NotFound(_)), Ok(())) => {}
            other => panic!("grp/k{i}: not deleted exactly once: {other:?}"),
        }
    }
    for h in [&ha, &hb] {
        eventually("every name is gone on both hosts", || {
            h.batch_exists(&refs).is_ok_and(|e| e.iter().all(|x| !x))
        });
    }
    // And free again, on either host.
    let again = batch(&hb, &all[..10], 5000);
    assert!(again.iter().all(Result::is_ok), "{again:?}");
}

#[test]
fn a_delete_on_one_host_removes_the_entry_everywhere_and_regions_stay_apart() {
    require_root!();
    let Some(c) = cluster() else { return };
    let (ha, hb) = (c.a.handler(), c.b.handler());
    ha.mkdir("ns", 0o777).expect("mkdir");
    for i in 0..20 {
        store(&ha, &format!("ns/a{i}"), &pattern(i, 300 << 10)).expect("store on a");
    }
    eventually("b sees a's entries", || {
        hb.exists("ns/a19").unwrap_or(false)
    });
    for i in 0..20 {
        store(&hb, &format!("ns/b{i}"), &pattern(100 + i, 300 << 10)).expect("store on b");
    }
    eventually("a sees b's entries", || {
        ha.exists("ns/b19").unwrap_or(false)
    });
    // No two entries overlap in the shared pool (each host carves only regions it claimed).
    let spans: Vec<(u64, u64, String)> = (0..20)
        .flat_map(|i| [format!("ns/a{i}"), format!("ns/b{i}")])
        .map(|k| {
            let (_, off) = location(&c.a, &k);
            (off, 300 << 10, k)
        })
        .collect();
    assert_apart(spans);
    // b deletes one of a's entries and one of its own: both go on both hosts.
    hb.delete("ns/a3").expect("delete on b");
    hb.delete("ns/b4").expect("delete on b");
    eventually("a forgets them", || {
        !ha.exists("ns/a3").unwrap_or(true) && !ha.exists("ns/b4").unwrap_or(true)
    });
    assert!(!hb.exists("ns/a3").expect("exists") && !hb.exists("ns/b4").expect("exists"));
    assert!(!c.a.path("ns/a3").exists() && !c.b.path("ns/b4").exists());
    // The name is free again, for either host.
    store(&hb, "ns/a3", b"again").expect("store again");
    eventually("a sees the new entry", || {
        ha.retrieve("ns/a3")
            .ok()
            .flatten()
            .is_some_and(|m| m.as_slice() == b"again")
    });
}

#[test]
fn a_host_killed_mid_store_loses_its_unsealed_work_and_rejoins_seeing_everything() {
    require_root!();
    let Some(mut c) = cluster() else { return };
    let hb = c.b.handler();
    let sealed: Vec<Vec<u8>> = (0..5).map(|i| pattern(i, 1 << 20)).collect();
    {
        let ha = c.a.handler();
        ha.mkdir("ns", 0o777).expect("mkdir");
        for (i, b) in sealed.iter().enumerate() {
            store(&ha, &format!("ns/a{i}"), b).expect("store on a");
        }
        eventually("b sees a's entries", || hb.exists("ns/a4").unwrap_or(false));
        // Unsealed work: three 20 MiB allocations, written, never stored.
        let mut pending: Vec<_> = (0..3).map(|_| ha.alloc(20 << 20).expect("alloc")).collect();
        for p in &mut pending {
            p.as_mut_slice().fill(0xee);
        }
        c.a.kill9();
        std::mem::forget(pending); // a is gone: nothing to give back through it
    }
    // Once a's lease has run out, b may use every byte but a's sealed entries' units.
    std::thread::sleep(TTL + Duration::from_secs(2));
    // b lists a as gone, with the entries it left.
    eventually("b shows a gone", || {
        let c = hb.stats().expect("stats").cluster.expect("cluster");
        c.hosts
            .iter()
            .any(|h| h.node == "a" && h.gone && h.entries == 5)
            && c.hosts.iter().all(|h| h.node != "a" || h.gone)
    });
    let mut filled = 0u64;
    let chunk = 8u64 << 20;
    loop {
        match store(
            &hb,
            &format!("ns/fill{filled}"),
            &pattern(50 + filled, chunk as usize),
        ) {
            Ok(()) => filled += 1,
            Err(Error::NoSpace(_)) => break,
            Err(e) => panic!("filling the pool from b: {e}"),
        }
    }
    // 254 MiB of regions; a's five 1 MiB entries sit in at most 3 units (6 MiB); b's 8 MiB
    // entries leave at most 8 MiB unused. a's 60 MiB of unsealed work came back to the pool.
    let room = POOL_SIZE - (2 << 20) - (6 << 20) - chunk;
    assert!(
        filled * chunk >= room,
        "b stored {filled} x 8 MiB: a's unsealed work was not reclaimed"
    );
    for (i, b) in sealed.iter().enumerate() {
        let m = hb
            .retrieve(&format!("ns/a{i}"))
            .expect("retrieve")
            .expect("a's entry");
        assert!(m.as_slice() == b.as_slice(), "a's sealed entry changed");
    }
    // While a is down, b deletes one of a's entries.
    hb.delete("ns/a0").expect("delete on b");
    // a comes back: it recovers what it sealed, less what b deleted, and sees what b stored
    // meanwhile, from its first request on (it serves once it has read every entry).
    c.a.restart();
    let ha = c.a.handler();
    assert!(
        !ha.exists("ns/a0").expect("exists"),
        "a serves an entry b deleted while a was down"
    );
    assert!(ha.retrieve("ns/a0").expect("retrieve").is_none());
    for (i, b) in sealed.iter().enumerate().skip(1) {
        let m = ha
            .retrieve(&format!("ns/a{i}"))
            .expect("retrieve")
            .expect("a's own entry");
        assert!(m.as_slice() == b.as_slice());
    }
    let last = format!("ns/fill{}", filled - 1);
    assert!(
        ha.exists(&last).expect("exists"),
        "a does not serve b's entries yet"
    );
    let m = ha.retrieve(&last).expect("retrieve").expect("b's entry");
    assert!(m.as_slice() == pattern(50 + filled - 1, chunk as usize).as_slice());
}

#[test]
fn while_etcd_is_down_the_hosts_serve_reads_and_writes_resume_after() {
    require_root!();
    let Some(mut c) = cluster() else { return };
    let (ha, hb) = (c.a.handler(), c.b.handler());
    ha.mkdir("ns", 0o777).expect("mkdir");
    store(&ha, "ns/before", &pattern(1, 1 << 20)).expect("store");
    eventually("b sees it", || hb.exists("ns/before").unwrap_or(false));
    c.etcd.kill();
    // Reads need no etcd: the index and the pool are local.
    let t = Instant::now();
    let m = hb.retrieve("ns/before").expect("retrieve").expect("found");
    assert!(m.as_slice() == pattern(1, 1 << 20).as_slice());
    assert!(hb.exists("ns/before").expect("exists"));
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "a read waited for etcd"
    );
    drop(m);
    // A write cannot be published without etcd: it fails, and nothing of it stays. Nor can
    // a delete be recorded: it fails, and the entry stays.
    assert!(store(&ha, "ns/during", &pattern(2, 1 << 20)).is_err());
    assert!(ha.delete("ns/before").is_err());
    // Once a host's lease may have run out (its TTL less a third since the last renewal),
    // another host may carve what this one maps (a host cut off from etcd looks the same):
    // its reads of the shared pool are misses, its allocations refused.
    eventually("b fences the shared pool off", || {
        hb.retrieve("ns/before").expect("retrieve").is_none()
    });
    assert!(!hb.exists("ns/before").expect("exists"));
    assert!(matches!(hb.alloc(4096), Err(Error::Busy(_))));
    c.etcd.restart();
    // A host whose lease ran out meanwhile rejoins once the old one has expired, which etcd
    // restored with its whole TTL when it restarted.
    eventually_within(
        "a publishes again",
        Duration::from_secs(10) + 2 * TTL,
        || store(&ha, "ns/after", &pattern(3, 1 << 20)).is_ok(),
    );
    eventually("b sees the new entry", || {
        hb.exists("ns/after").unwrap_or(false)
    });
    assert!(!ha.exists("ns/during").expect("exists") && !hb.exists("ns/during").expect("exists"));
    assert!(ha.exists("ns/before").expect("exists") && hb.exists("ns/before").expect("exists"));
}

#[test]
fn an_entry_another_host_maps_keeps_its_bytes_after_a_delete_until_that_host_lets_go() {
    require_root!();
    let Some(c) = cluster() else { return };
    let (ha, hb) = (c.a.handler(), c.b.handler());
    let (bytes, mapped) = stored_on_a_mapped_on_b(&ha, &hb, 7);
    // a deletes it while a client of b maps it: the name goes everywhere at once...
    ha.delete("ns/kv").expect("delete on a");
    eventually("b forgets it", || !hb.exists("ns/kv").unwrap_or(true));
    // ...but the extent is kept: a fills the pool around it, b's bytes stay.
    let filled = fill(&ha, "ns/fill");
    let room = POOL_SIZE - (2 << 20) - (16 << 20) - (8 << 20);
    assert!(filled * (8 << 20) >= room, "a stored {filled} x 8 MiB");
    assert!(
        mapped.as_slice() == bytes.as_slice(),
        "another host's mapping was overwritten after a delete"
    );
    // b lets go (its client drops its cache of mappings, and sends the releases with its
    // next request): a gets the 16 MiB back.
    drop(mapped);
    hb.trim();
    hb.stats().expect("stats");
    eventually("a stores into the extent b let go of", || {
        store(&ha, "ns/after0", &pattern(8, 8 << 20)).is_ok()
    });
    store(&ha, "ns/after1", &pattern(9, 8 << 20)).expect("the whole extent came back");
}

/// Stores 16 MiB of pattern `seed` as `ns/kv` on host a and has a client of host b map it:
/// the bytes and b's mapping.
fn stored_on_a_mapped_on_b(
    ha: &maru::Handler,
    hb: &maru::Handler,
    seed: u64,
) -> (Vec<u8>, maru::Mapping) {
    ha.mkdir("ns", 0o777).expect("mkdir");
    let bytes = pattern(seed, 16 << 20);
    store(ha, "ns/kv", &bytes).expect("store on a");
    eventually("b sees it", || hb.exists("ns/kv").unwrap_or(false));
    let mapped = hb.retrieve("ns/kv").expect("retrieve").expect("found");
    (bytes, mapped)
}

/// Host `pid` stopped (SIGSTOP) until dropped (SIGCONT), panics included.
struct Stopped(nix::unistd::Pid);

impl Stopped {
    fn new(d: &Daemon) -> Stopped {
        let pid = nix::unistd::Pid::from_raw(d.pid() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).expect("SIGSTOP");
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(self.0, nix::sys::signal::Signal::SIGCONT);
    }
}

#[test]
fn a_removed_extent_is_not_carved_again_until_every_host_has_seen_the_removal() {
    require_root!();
    let Some(c) = cluster() else { return };
    let (ha, hb) = (c.a.handler(), c.b.handler());
    // b hands its client a's entry with nothing recorded in etcd...
    let (bytes, mapped) = stored_on_a_mapped_on_b(&ha, &hb, 11);
    // ...and stops (well within its lease): it can neither learn of a removal nor
    // acknowledge one.
    let stopped = Stopped::new(&c.b);
    let t = Instant::now();
    ha.delete("ns/kv").expect("delete on a");
    assert!(!ha.exists("ns/kv").expect("exists"));
    // a cannot carve the extent again: b has not acknowledged the removal.
    let filled = fill(&ha, "ns/fill");
    let room = POOL_SIZE - (2 << 20) - (16 << 20);
    assert!(
        filled * (8 << 20) <= room,
        "a stored {filled} x 8 MiB: the removed extent was carved again"
    );
    assert!(
        mapped.as_slice() == bytes.as_slice(),
        "another host's mapping was overwritten before it saw the removal"
    );
    assert!(
        t.elapsed() < TTL,
        "took {:?}, past b's lease: the test proves nothing",
        t.elapsed()
    );
    // b resumes: it applies the removal while its client maps the extent, so it holds it
    // before it acknowledges: still not a's to carve.
    drop(stopped);
    eventually("b forgets it", || !hb.exists("ns/kv").unwrap_or(true));
    std::thread::sleep(Duration::from_millis(300));
    assert!(matches!(
        store(&ha, "ns/early", &pattern(12, 8 << 20)),
        Err(Error::NoSpace(_))
    ));
    assert!(mapped.as_slice() == bytes.as_slice());
    // b lets go: a gets the 16 MiB back.
    drop(mapped);
    hb.trim();
    hb.stats().expect("stats");
    eventually("a stores into the extent b let go of", || {
        store(&ha, "ns/after0", &pattern(13, 8 << 20)).is_ok()
    });
    store(&ha, "ns/after1", &pattern(14, 8 << 20)).expect("the whole extent came back");
}

#[test]
fn on_a_pool_without_coherence_writers_write_back_and_readers_invalidate_once() {
    require_root!();
    let Some(etcd) = Etcd::start() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = pool_file(dir.path());
    let a = host_with(&etcd, &pool, "a", None, ",coherent=false");
    let b = host_with(&etcd, &pool, "b", None, ",coherent=false");
    let (ha, hb) = (a.handler(), b.handler());
    let coherence = |h: &maru::Handler| {
        h.stats().expect("stats").pools[0]
            .coherence
            .expect("a pool without coherence reports its cache maintenance")
    };
    ha.mkdir("ns", 0o777).expect("mkdir");
    let bytes = pattern(3, (3 << 20) + 100);
    store(&ha, "ns/kv", &bytes).expect("store on a");
    let on_a = coherence(&ha);
    assert_eq!(
        on_a.flushed,
        bytes.len() as u64,
        "a wrote back its entry's lines"
    );
    assert_eq!(on_a.invalidated, 0);
    eventually("b sees it", || hb.exists("ns/kv").unwrap_or(false));
    assert_eq!(coherence(&hb).invalidated, 0, "nothing read on b yet");
    let m = hb.retrieve("ns/kv").expect("retrieve").expect("found");
    assert!(m.as_slice() == bytes.as_slice());
    assert_eq!(coherence(&hb).invalidated, bytes.len() as u64);
    // Once per entry: the entry cannot change, and the lines b caches now are its bytes.
    drop(m);
    hb.trim();
    let m = hb.retrieve("ns/kv").expect("retrieve").expect("found");
    assert!(m.as_slice() == bytes.as_slice());
    assert!(std::fs::read(b.path("ns/kv")).expect("read through b's mount") == bytes);
    assert_eq!(coherence(&hb).invalidated, bytes.len() as u64);
    assert_eq!(coherence(&hb).flushed, 0);
    drop((m, ha, hb));
    drop((a, b));
}

#[test]
fn a_pin_on_one_host_keeps_the_publisher_from_evicting_the_entry() {
    require_root!();
    let Some(c) = cluster() else { return };
    let (ha, hb) = (c.a.handler(), c.b.handler());
    ha.mkdir("ns", 0o777).expect("mkdir");
    for i in 0..3 {
        store(&ha, &format!("ns/k{i}"), &pattern(i, 1 << 20)).expect("store on a");
    }
    eventually("b sees a's entries", || hb.exists("ns/k2").unwrap_or(false));
    hb.pin("ns/k1").expect("pin on b");
    assert!(hb.is_pinned("ns/k1").expect("is_pinned"));
    eventually("a learns of b's pin", || {
        ha.is_pinned("ns/k1").unwrap_or(false)
    });
    // a evicts all it can: not what b pinned.
    ha.evict(POOL_SIZE).expect("evict");
    eventually("a's evictions reach b", || {
        !hb.exists("ns/k0").unwrap_or(true)
    });
    for h in [&ha, &hb] {
        assert!(!h.exists("ns/k0").expect("exists") && !h.exists("ns/k2").expect("exists"));
        let m = h
            .retrieve("ns/k1")
            .expect("retrieve")
            .expect("the pinned entry");
        assert!(m.as_slice() == pattern(1, 1 << 20).as_slice());
    }
    // Unpinned on b, a may evict it.
    hb.unpin("ns/k1").expect("unpin on b");
    eventually("a learns of the unpin", || {
        !ha.is_pinned("ns/k1").unwrap_or(true)
    });
    ha.trim();
    hb.trim();
    ha.evict(POOL_SIZE).expect("evict");
    eventually("gone on b too", || !hb.exists("ns/k1").unwrap_or(true));
}

#[test]
fn a_client_pin_on_one_host_keeps_the_publisher_from_evicting_until_it_goes() {
    require_root!();
    let Some(mut c) = cluster() else { return };
    let (ha, hb) = (c.a.handler(), c.b.handler());
    ha.mkdir("ns", 0o777).expect("mkdir");
    for i in 0..4 {
        store(&ha, &format!("ns/k{i}"), &pattern(20 + i, 1 << 20)).expect("store on a");
    }
    eventually("b sees a's entries", || hb.exists("ns/k3").unwrap_or(false));
    let held_on_a = |k: &str| ha.stat(k).ok().flatten().is_some_and(|i| i.held);
    // Two clients of b hold k1 (the original API's pin counts), a third holds k2.
    let (b1, b2, b3) = (c.b.handler(), c.b.handler(), c.b.handler());
    b1.hold("ns/k1").expect("hold");
    b2.hold("ns/k1").expect("hold");
    b3.hold("ns/k2").expect("hold");
    eventually("a learns of b's holds", || {
        held_on_a("ns/k1") && held_on_a("ns/k2")
    });
    // a evicts all it can: not what clients of b hold.
    ha.evict(POOL_SIZE).expect("evict");
    eventually("a's evictions reach b", || {
        !hb.exists("ns/k0").unwrap_or(true)
    });
    for k in ["ns/k1", "ns/k2"] {
        assert!(ha.exists(k).expect("exists") && hb.exists(k).expect("exists"));
    }
    assert!(!ha.exists("ns/k3").expect("exists"));
    // One of k1's two clients lets go: still held. The other goes away (its connection
    // closes): a may evict k1.
    b1.unhold("ns/k1").expect("unhold");
    std::thread::sleep(Duration::from_millis(300));
    assert!(held_on_a("ns/k1"));
    drop(b2);
    eventually("a learns k1 is no longer held", || !held_on_a("ns/k1"));
    ha.trim();
    hb.trim();
    ha.evict(POOL_SIZE).expect("evict");
    assert!(!ha.exists("ns/k1").expect("exists") && ha.exists("ns/k2").expect("exists"));
    // b dies: its clients' holds go with its lease.
    drop(hb);
    c.b.kill9();
    eventually("a learns b's holds are gone", || !held_on_a("ns/k2"));
    ha.evict(POOL_SIZE).expect("evict");
    assert!(!ha.exists("ns/k2").expect("exists"));
    drop(b3);
}

#[test]
fn reads_on_another_host_keep_an_entry_young_where_it_is_evicted() {
    require_root!();
    let Some(c) = cluster() else { return };
    let (ha, hb) = (c.a.handler(), c.b.handler());
    ha.mkdir("ns", 0o777).expect("mkdir");
    // Four entries of a region each, k0 the oldest.
    for i in 0..4 {
        store(&ha, &format!("ns/k{i}"), &pattern(i, 2 << 20)).expect("store on a");
    }
    eventually("b sees a's entries", || hb.exists("ns/k3").unwrap_or(false));
    // b keeps using k0; a hears of it (reports go every second).
    eventually("a hears of b's uses", || {
        hb.trim();
        hb.retrieve("ns/k0").expect("retrieve").expect("found");
        ha.stats()
            .expect("stats")
            .cluster
            .is_some_and(|c| c.uses_reported > 0)
    });
    hb.trim();
    hb.stats().expect("stats"); // b's client lets go of its mappings
    // a evicts two entries' worth: the least recently used in the cluster, k1 and k2.
    let p = &ha.stats().expect("stats").pools[0];
    let free = p.capacity - p.used;
    let (n, _) = ha.evict(free + (4 << 20)).expect("evict");
    assert_eq!(n, 2, "evicted {n}");
    let left: Vec<bool> = (0..4)
        .map(|i| ha.exists(&format!("ns/k{i}")).expect("exists"))
        .collect();
    assert_eq!(
        left,
        [true, false, false, true],
        "k0 was used on b: it is not the oldest"
    );
}

/// How long the orphans test's host `b` waits before it may evict the entries of a host gone.
const ORPHANS_AFTER: Duration = Duration::from_secs(10);

#[test]
fn the_entries_of_a_host_gone_for_good_are_evicted_by_the_others_once_it_is_gone_long_enough() {
    require_root!();
    let Some(etcd) = Etcd::start() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = pool_file(dir.path());
    let mut a = host(&etcd, &pool, "a");
    let after = ORPHANS_AFTER.as_secs().to_string();
    let b = host_flags(
        &etcd,
        &pool,
        "b",
        None,
        "",
        &["--eviction", "lru", "--cluster-orphans-after", &after],
    );
    let hb = b.handler();
    // a fills half the pool: sixteen 8 MiB entries, a0 the oldest.
    let chunk = 8usize << 20;
    let a_entry = |i: u64| pattern(300 + i, chunk);
    {
        let ha = a.handler();
        ha.mkdir("ns", 0o777).expect("mkdir");
        for i in 0..16 {
            store(&ha, &format!("ns/a{i}"), &a_entry(i)).expect("store on a");
        }
    }
    eventually("b sees a's entries", || {
        hb.exists("ns/a15").unwrap_or(false)
    });
    // b uses a0 and a1 (the youngest of a's on b now), and pins a2.
    for k in ["ns/a0", "ns/a1"] {
        let m = hb.retrieve(k).expect("retrieve").expect("a's entry");
        assert!(m.as_slice() == a_entry(u64::from(k == "ns/a1")).as_slice());
    }
    hb.pin("ns/a2").expect("pin on b");
    hb.trim();
    hb.stats().expect("stats"); // b's client lets go of its mappings
    // a dies and does not come back.
    a.kill9();
    let a_on_b = || {
        let c = hb.stats().expect("stats").cluster.expect("cluster");
        c.hosts.into_iter().find(|h| h.node == "a")
    };
    eventually_within("b shows a gone", TTL * 4, || {
        a_on_b().is_some_and(|h| h.gone && h.entries == 16)
    });
    // Gone, not yet for long enough: only its publisher evicts an entry.
    let (n, _) = hb.evict(POOL_SIZE).expect("evict");
    assert_eq!(n, 0, "b evicted entries of a host gone a moment ago");
    assert!(!a_on_b().expect("a").orphaned);
    eventually_within("b shows a orphaned", ORPHANS_AFTER * 2, || {
        a_on_b().is_some_and(|h| h.orphaned)
    });
    // b stores twenty 8 MiB entries: more than the half a left free. Each store that finds
    // the pool full evicts a's entries, least recently used on b first.
    let b_entry = |i: u64| pattern(400 + i, chunk);
    for i in 0..20 {
        store(&hb, &format!("ns/b{i}"), &b_entry(i))
            .unwrap_or_else(|e| panic!("store ns/b{i} on b: {e}"));
    }
    let here: Vec<bool> = (0..16)
        .map(|i| hb.exists(&format!("ns/a{i}")).expect("exists"))
        .collect();
    // 254 MiB of regions, a's 128 MiB: fifteen of b's fit, the last five took the place of
    // five of a's, and an eviction makes room for one entry more than it needs (headroom).
    let evicted = here.iter().filter(|h| !**h).count();
    assert!(
        (5..=7).contains(&evicted),
        "b evicted {evicted} of a's entries to store five more than fit: {here:?}"
    );
    assert!(
        here[..3].iter().all(|h| *h),
        "a0 and a1 (used on b) and a2 (pinned) stay: {here:?}"
    );
    let first_kept = 3 + here[3..].iter().position(|h| *h).unwrap_or(13);
    assert!(
        here[first_kept..].iter().all(|h| *h),
        "a's entries went least recently used first: {here:?}"
    );
    for i in 0..20 {
        let m = hb
            .retrieve(&format!("ns/b{i}"))
            .expect("retrieve")
            .expect("b's entry");
        assert!(m.as_slice() == b_entry(i).as_slice(), "ns/b{i} changed");
    }
    for i in (0..16).filter(|i| here[*i as usize]) {
        let m = hb
            .retrieve(&format!("ns/a{i}"))
            .expect("retrieve")
            .expect("a's entry left");
        assert!(m.as_slice() == a_entry(i).as_slice(), "ns/a{i} changed");
    }
    let c = hb.stats().expect("stats").cluster.expect("cluster");
    let a_left = c.hosts.iter().find(|h| h.node == "a").expect("a");
    assert_eq!(a_left.entries as usize, 16 - evicted);
    // a comes back after all: what b evicted is gone there too, the rest is a's again, and no
    // two entries share a byte of the pool.
    a.restart();
    let ha = a.handler();
    for i in 0..16 {
        let k = format!("ns/a{i}");
        let m = ha.retrieve(&k).expect("retrieve");
        assert_eq!(m.is_some(), here[i as usize], "{k} on a after its return");
        if let Some(m) = m {
            assert!(m.as_slice() == a_entry(i as u64).as_slice(), "{k} changed");
        }
    }
    let spans: Vec<(u64, u64, String)> = (0..16)
        .map(|i| format!("ns/a{i}"))
        .filter(|k| ha.exists(k).unwrap_or(false))
        .chain((0..20).map(|i| format!("ns/b{i}")))
        .map(|k| (location(&a, &k).1, chunk as u64, k))
        .collect();
    assert_apart(spans);
    drop((ha, hb));
}

#[test]
fn a_quota_set_on_one_host_holds_on_every_host_over_every_hosts_entries() {
    require_root!();
    let Some(c) = cluster() else { return };
    let (ha, hb) = (c.a.handler(), c.b.handler());
    ha.mkdir("team", 0o777).expect("mkdir");
    ha.set_quota("team", Some(3 << 20)).expect("quota on a");
    // b has no namespace of that name yet: the quota makes it.
    let quota_on_b = || {
        hb.list("team")
            .ok()
            .and_then(|(me, _, _)| me)
            .and_then(|n| n.quota)
    };
    eventually("b learns of the quota", || quota_on_b() == Some(3 << 20));
    store(&ha, "team/k0", &pattern(0, 2 << 20)).expect("store on a");
    eventually("b sees a's entry", || hb.exists("team/k0").unwrap_or(false));
    // a's 2 MiB count on b: 2 more would exceed 3 MiB there, half a MiB does not.
    match store(&hb, "team/k1", &pattern(1, 2 << 20)) {
        Err(Error::Quota(_)) => {}
        other => panic!("b stored past the cluster's quota: {other:?}"),
    }
    store(&hb, "team/k1", &pattern(1, 512 << 10)).expect("store on b within the quota");
    // Cleared on b, for a too.
    hb.set_quota("team", None).expect("clear on b");
    eventually("a learns the quota is gone", || {
        ha.list("team")
            .ok()
            .and_then(|(me, _, _)| me)
            .is_some_and(|n| n.quota.is_none())
    });
    store(&ha, "team/k2", &pattern(2, 2 << 20)).expect("store on a without a quota");
}

#[test]
fn two_hosts_writing_one_name_through_their_mounts_one_close_fails() {
    use std::io::Write;
    use std::os::fd::IntoRawFd;
    require_root!();
    let Some(c) = cluster() else { return };
    let (ha, hb) = (c.a.handler(), c.b.handler());
    ha.mkdir("ns", 0o777).expect("mkdir on a");
    hb.mkdir("ns", 0o777).expect("mkdir on b");
    let close = |f: std::fs::File| {
        // SAFETY: the descriptor was just taken out of its File.
        let r = unsafe { libc::close(f.into_raw_fd()) };
        (r == 0)
            .then_some(())
            .ok_or_else(std::io::Error::last_os_error)
    };
    for round in 0..5 {
        let name = format!("ns/same{round}");
        let mut fa = std::fs::File::create(c.a.path(&name)).expect("create on a");
        let mut fb = std::fs::File::create(c.b.path(&name)).expect("create on b");
        fa.write_all(b"from a").expect("write");
        fb.write_all(b"from b").expect("write");
        // Whoever closes first has the name for every host; the other's close says so.
        let (first, second, winner) = if round % 2 == 0 {
            (fa, fb, b"from a")
        } else {
            (fb, fa, b"from b")
        };
        close(first).expect("the first close");
        let e = close(second).expect_err("both writers' closes succeeded");
        assert_eq!(e.raw_os_error(), Some(libc::EEXIST), "{e}");
        for h in [&ha, &hb] {
            eventually("the winner's bytes everywhere", || {
                h.retrieve(&name)
                    .ok()
                    .flatten()
                    .is_some_and(|m| m.as_slice() == winner)
            });
        }
    }
}

#[test]
fn the_mounts_closes_renames_unlinks_and_evictions_waiting_for_etcd_keep_no_other_client_waiting() {
    use std::io::Write;
    use std::os::fd::IntoRawFd;
    require_root!();
    let Some(c) = cluster() else { return };
    let ha = c.a.handler();
    ha.mkdir("ns", 0o777).expect("mkdir");
    store(&ha, "ns/before", b"stored before").expect("store");
    let mut f = std::fs::File::create(c.a.path("ns/slow")).expect("create");
    f.write_all(b"written through the mount").expect("write");
    // The close reserves the name for every host: it waits for etcd's answer.
    let fd = f.into_raw_fd();
    // SAFETY: the descriptor was just taken out of its File.
    let closed = alone_waiting_for_etcd(&c, move || unsafe { libc::close(fd) });
    assert_eq!(closed, 0, "the close failed");
    eventually("the entry published", || {
        ha.retrieve("ns/slow")
            .ok()
            .flatten()
            .is_some_and(|m| m.as_slice() == b"written through the mount")
    });
    // A rename publishes the new name and removes the old one for every host.
    let (from, to) = (c.a.path("ns/slow"), c.a.path("ns/moved"));
    alone_waiting_for_etcd(&c, move || std::fs::rename(from, to)).expect("rename");
    let hb = c.b.handler();
    for h in [&ha, &hb] {
        eventually("the entry under its new name only", || {
            h.retrieve("ns/moved")
                .ok()
                .flatten()
                .is_some_and(|m| m.as_slice() == b"written through the mount")
                && !h.exists("ns/slow").unwrap_or(true)
        });
    }
    // An unlink records the removal for every host.
    let path = c.a.path("ns/before");
    alone_waiting_for_etcd(&c, move || std::fs::remove_file(path)).expect("unlink");
    assert!(!ha.exists("ns/before").expect("exists"));
    // So does an eviction, and it waits for the other hosts' acknowledgements likewise (of
    // an entry no client maps: the ones read above are still mapped).
    store(&c.a.handler(), "ns/old", b"least recently used").expect("store");
    let cfg = c.a.client_config();
    let (n, _) = alone_waiting_for_etcd(&c, move || {
        maru::Handler::connect(cfg)
            .and_then(|h| h.evict(POOL_SIZE))
            .expect("evict")
    });
    assert_eq!(n, 1, "one entry to evict");
    for h in [&ha, &hb] {
        eventually("the evicted entry gone", || {
            !h.exists("ns/old").unwrap_or(true)
        });
    }
}

/// Runs `op`, which asks etcd, with etcd stopped: it must still be waiting 100 ms later,
/// and meanwhile another client's listing on the same host is answered (the store's lock is
/// not held across etcd's answer). Then etcd goes on; returns what `op` returned.
fn alone_waiting_for_etcd<T: Send + 'static>(
    c: &Cluster,
    op: impl FnOnce() -> T + Send + 'static,
) -> T {
    c.etcd.pause(true);
    let waiting = std::thread::spawn(op);
    std::thread::sleep(Duration::from_millis(100));
    let (tx, rx) = std::sync::mpsc::channel();
    let cfg = c.a.client_config();
    std::thread::spawn(move || {
        let h = maru::Handler::connect(cfg).expect("connect");
        let _ = tx.send(h.list("ns").map(|(_, _, entries)| entries.len()));
    });
    let listed = rx.recv_timeout(Duration::from_secs(5));
    let still = !waiting.is_finished();
    c.etcd.pause(false);
    assert!(
        listed.is_ok(),
        "a listing waited (the store's lock held across etcd's answer)"
    );
    assert!(still, "the operation did not wait for etcd: nothing shown");
    waiting.join().expect("the operation")
}

/// `tools/maru-cluster-sim`, as the walkthrough in doc/CLUSTER.md runs it.
struct Sim {
    dir: tempfile::TempDir,
    name: String,
}

impl Sim {
    fn run(&self, args: &[&str]) -> std::process::Output {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/maru-cluster-sim");
        std::process::Command::new("bash")
            .arg(script)
            .args(args)
            .env("MARU_SIM_DIR", self.dir.path().join("sim"))
            .env("MARU_SIM_NAME", &self.name)
            .env("MARUD", bin("marud"))
            .env("MARUCTL", bin("maructl"))
            .output()
            .expect("maru-cluster-sim")
    }

    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "maru-cluster-sim {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).expect("utf-8")
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        self.run(&["stop"]);
    }
}

#[test]
fn the_simulation_script_runs_three_hosts_and_leaves_nothing_behind() {
    require_root!();
    // Without etcd the tests skip (outside CI); probe as the other cluster tests do.
    let Some(probe) = Etcd::start() else { return };
    drop(probe);
    let sim = Sim {
        dir: tempfile::tempdir_in("/dev/shm").expect("tempdir"),
        name: format!("msim{}", std::process::id() % 100_000),
    };
    let status = sim.ok(&["start", "--hosts", "3", "--size", "256M"]);
    for h in ["a", "b", "c"] {
        assert!(status.contains(&format!("host {h}: pid")), "{status}");
    }
    let ctl = bin("maructl");
    let ctl = ctl.to_str().expect("utf-8 path");
    let kv = sim.dir.path().join("kv.bin");
    std::fs::write(&kv, pattern(5, 3 << 20)).expect("write");
    let kv = kv.to_str().expect("utf-8 path");
    sim.ok(&["exec", "a", ctl, "mkdir", "llama"]);
    sim.ok(&["exec", "a", ctl, "put", "llama/chunk-0", kv]);
    // b by its socket, c through its own /maru (its mount namespace's): the same bytes.
    eventually("b sees a's entry", || {
        sim.run(&["exec", "b", ctl, "stat", "llama/chunk-0"])
            .status
            .success()
    });
    let got = sim.dir.path().join("got.bin");
    let got_s = got.to_str().expect("utf-8 path");
    sim.ok(&["exec", "b", ctl, "get", "llama/chunk-0", got_s]);
    assert!(std::fs::read(&got).expect("read") == pattern(5, 3 << 20));
    eventually("c sees a's entry", || {
        sim.run(&["exec", "c", "cmp", "/maru/llama/chunk-0", kv])
            .status
            .success()
    });
    // Each host's /maru is its own: the test's mount namespace has none of them.
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    assert!(
        !mounts
            .lines()
            .any(|l| l.contains(sim.dir.path().to_str().unwrap()))
    );
    let status = sim.ok(&["status"]);
    assert!(
        status.contains("claims") && status.contains("host c"),
        "{status}"
    );
    sim.ok(&["stop"]);
    let netns = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip");
    assert!(
        !String::from_utf8_lossy(&netns.stdout).contains(&sim.name),
        "namespaces left behind"
    );
    assert!(!sim.dir.path().join("sim").exists(), "state left behind");
}

/// Fills the pool from `h` with 8 MiB entries until it is full; returns how many fit.
fn fill(h: &maru::Handler, prefix: &str) -> u64 {
    let mut n = 0u64;
    loop {
        match store(h, &format!("{prefix}{n}"), &pattern(900 + n, 8 << 20)) {
            Ok(()) => n += 1,
            Err(Error::NoSpace(_)) => return n,
            Err(e) => panic!("filling the pool: {e}"),
        }
    }
}

/// Two hosts, each in a network namespace of its own (its link can be cut), etcd in the hub
/// namespace; dropped in that order.
struct Apart {
    a: Daemon,
    b: Daemon,
    _dir: tempfile::TempDir,
    _etcd: Etcd,
    net: Net,
}

/// [`Apart`], or None (skip) without network namespaces or etcd outside CI.
fn apart() -> Option<Apart> {
    let net = Net::new(2)?;
    let etcd = Etcd::start_at(Some(&net.hub), &net.hub_ip(), 2379, 2380)?;
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = pool_file(dir.path());
    let a = host_in(&etcd, &pool, "a", Some(&net.hosts[0]));
    let b = host_in(&etcd, &pool, "b", Some(&net.hosts[1]));
    Some(Apart {
        a,
        b,
        _dir: dir,
        _etcd: etcd,
        net,
    })
}

#[test]
fn a_host_cut_off_serves_nothing_of_the_pool_and_after_the_link_returns_serves_what_changed() {
    require_root!();
    let Some(c) = apart() else { return };
    let (a, b, net) = (&c.a, &c.b, &c.net);
    let (ha, hb) = (a.handler(), b.handler());
    ha.mkdir("ns", 0o777).expect("mkdir");
    store(&ha, "ns/x", &pattern(1, 1 << 20)).expect("store on a");
    eventually("b sees a's", || hb.exists("ns/x").unwrap_or(false));
    store(&hb, "ns/y", &pattern(2, 1 << 20)).expect("store on b");
    eventually("a sees b's", || ha.exists("ns/y").unwrap_or(false));
    net.link(0, false);
    // Within two thirds of the TTL a no longer trusts its view: b may carve what a maps once
    // a's lease is gone. Nothing of the pool is granted or served there, own or not.
    let fenced = eventually("a fences the shared pool off", || {
        ha.retrieve("ns/y").expect("retrieve").is_none()
    });
    assert!(fenced <= TTL, "fenced off after {fenced:?}");
    assert!(ha.retrieve("ns/x").expect("retrieve").is_none());
    assert!(!ha.exists("ns/x").expect("exists"));
    assert!(matches!(ha.alloc(4096), Err(Error::Busy(_))));
    let (_, _, listed) = ha.list("ns").expect("list");
    assert!(listed.is_empty(), "a lists {listed:?} while fenced off");
    // Meanwhile b replaces both entries: a hears of none of it.
    std::thread::sleep(TTL);
    for (k, v) in [("ns/x", 3), ("ns/y", 4)] {
        hb.delete(k).expect("delete on b");
        store(&hb, k, &pattern(v, 1 << 20)).expect("store on b");
    }
    net.link(0, true);
    // a rejoins, reads every entry afresh, and serves b's, not the ones it knew.
    eventually("a serves b's new entries", || {
        [("ns/x", 3), ("ns/y", 4)].iter().all(|(k, v)| {
            ha.retrieve(k)
                .ok()
                .flatten()
                .is_some_and(|m| m.as_slice() == pattern(*v, 1 << 20).as_slice())
        })
    });
    let view = |d: &Daemon| -> Vec<(String, u64)> {
        ["ns/x", "ns/y"].iter().map(|k| location(d, k)).collect()
    };
    assert_eq!(view(a), view(b), "the hosts place the entries apart");
    store(&ha, "ns/z", &pattern(5, 1 << 20)).expect("a stores again");
}

#[test]
fn a_host_restarted_then_cut_off_drops_what_it_recovered_and_others_removed_meanwhile() {
    require_root!();
    let Some(mut c) = apart() else { return };
    let hb = c.b.handler();
    {
        let ha = c.a.handler();
        ha.mkdir("ns", 0o777).expect("mkdir");
        store(&ha, "ns/x", &pattern(1, 1 << 20)).expect("store on a");
    }
    eventually("b sees a's", || hb.exists("ns/x").unwrap_or(false));
    // a restarts: it recovers x from its own log and finds its own record in etcd.
    c.a.stop();
    c.a.restart();
    let ha = c.a.handler();
    let read = |h: &maru::Handler, v: u64| {
        h.retrieve("ns/x")
            .ok()
            .flatten()
            .is_some_and(|m| m.as_slice() == pattern(v, 1 << 20).as_slice())
    };
    eventually("a serves x again", || read(&ha, 1));
    c.net.link(0, false);
    eventually("a fences the shared pool off", || {
        ha.retrieve("ns/x").expect("retrieve").is_none()
    });
    // a's lease runs out; b replaces x meanwhile (placing another entry first, where x was:
    // a's region is b's now), and a hears of none of it.
    std::thread::sleep(TTL);
    hb.delete("ns/x").expect("delete on b");
    store(&hb, "ns/pad", &pattern(2, 1 << 20)).expect("store on b");
    store(&hb, "ns/x", &pattern(3, 1 << 20)).expect("store on b");
    c.net.link(0, true);
    // a rejoins and reads every entry afresh: the x it recovered went, b's is served.
    eventually("a serves b's x, not the one it recovered", || read(&ha, 3));
    assert_eq!(location(&c.a, "ns/x"), location(&c.b, "ns/x"));
}

#[test]
fn a_host_cut_off_stops_writing_and_after_the_link_returns_nothing_is_owned_twice() {
    require_root!();
    let Some(c) = apart() else { return };
    let (a, b, net) = (&c.a, &c.b, &c.net);
    let (ha, hb) = (a.handler(), b.handler());
    ha.mkdir("ns", 0o777).expect("mkdir");
    let sealed: Vec<Vec<u8>> = (0..5).map(|i| pattern(i, 1 << 20)).collect();
    for (i, bytes) in sealed.iter().enumerate() {
        store(&ha, &format!("ns/a{i}"), bytes).expect("store on a");
    }
    eventually("b sees a's entries", || hb.exists("ns/a4").unwrap_or(false));
    // Work a has not sealed: 40 MiB in a region of its own.
    let mut pending = ha.alloc(40 << 20).expect("alloc");
    pending.as_mut_slice().fill(0xee);

    net.link(0, false);
    // Cut off, a publishes nothing.
    assert!(
        store(&ha, "ns/while-cut", b"no").is_err(),
        "a published while cut off"
    );
    // Once a's lease has run out, b uses every byte but the units of a's sealed entries.
    std::thread::sleep(TTL + Duration::from_secs(2));
    // Meanwhile a, its lease possibly gone, grants nothing of the shared pool and serves
    // none of its entries (b may have carved their extents again after a delete a never
    // heard of).
    assert!(matches!(ha.alloc(4096), Err(Error::Busy(_))));
    assert!(ha.retrieve("ns/a0").expect("retrieve").is_none());
    assert!(!ha.exists("ns/a0").expect("exists"));
    let filler = b.handler();
    let filled = fill(&filler, "ns/fill");
    let room = POOL_SIZE - (2 << 20) - (6 << 20) - (8 << 20);
    assert!(
        filled * (8 << 20) >= room,
        "b stored {filled} x 8 MiB: a's claims outlived its lease"
    );

    net.link(0, true);
    // a rejoins by itself; with room in the pool again it stores, but what it wrote into a
    // region b has taken is not published. (b frees the last entry it stored, outside the
    // region a lost, which a holds locally as long as its client holds the allocation; the
    // filling client goes, and its open region with it.)
    filler
        .delete(&format!("ns/fill{}", filled - 1))
        .expect("delete");
    drop(filler);
    eventually("a publishes again", || {
        store(&ha, "ns/after", b"yes").is_ok()
    });
    match ha.store("ns/pending", pending) {
        Err(Error::Busy(_)) => {}
        other => panic!("a published into a region b owns: {other:?}"),
    }
    eventually("b sees a's new entry", || {
        hb.exists("ns/after").unwrap_or(false)
    });
    // Nothing sealed was lost, on either host.
    let last = format!("ns/fill{}", filled - 2);
    eventually("a sees b's entries", || ha.exists(&last).unwrap_or(false));
    for h in [&ha, &hb] {
        for (i, bytes) in sealed.iter().enumerate() {
            let m = h
                .retrieve(&format!("ns/a{i}"))
                .expect("retrieve")
                .expect("a's entry");
            assert!(m.as_slice() == bytes.as_slice(), "a sealed entry changed");
        }
        let m = h.retrieve(&last).expect("retrieve").expect("b's entry");
        assert!(m.as_slice() == pattern(900 + filled - 2, 8 << 20).as_slice());
    }
    assert!(
        !hb.exists("ns/while-cut").expect("exists") && !hb.exists("ns/pending").expect("exists")
    );
    // No two entries share a byte of the pool.
    let spans: Vec<(u64, u64, String)> = std::fs::read_dir(b.path("ns"))
        .expect("ls")
        .map(|e| {
            let name = e.expect("entry").file_name().to_string_lossy().into_owned();
            let (_, off) = location(b, &format!("ns/{name}"));
            let len = std::fs::metadata(b.path(&format!("ns/{name}")))
                .expect("stat")
                .len();
            (off, len, name)
        })
        .collect();
    assert_apart(spans);
}
