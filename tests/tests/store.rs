//! The store engine and libmaru against a real marud (issue: store engine).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use maru::Error;
use maru_tests::{Daemon, Opts, pattern, probe};

fn no_mount(pools: &[&str]) -> Opts {
    Opts {
        pools: pools.iter().map(|s| s.to_string()).collect(),
        mount: false,
        extra: vec![],
    }
}

const MEMFS: &str = "memfs:{dir}/pool,size=128M";
const FILE: &str = "file:{dir}/dev.img,size=64M,name=emu";

fn roundtrip(d: &Daemon) {
    let h = d.handler();
    h.mkdir("m", 0o755).unwrap();
    for (i, size) in [1usize, 4096, 5000, 3 << 20].into_iter().enumerate() {
        let data = pattern(i as u64, size);
        h.put(&format!("m/k{i}"), &data).unwrap();
        assert!(h.exists(&format!("m/k{i}")).unwrap());
        let m = h.retrieve(&format!("m/k{i}")).unwrap().unwrap();
        assert_eq!(m.as_slice(), &data[..]);
    }
    assert!(!h.exists("m/none").unwrap());
    assert!(h.retrieve("m/none").unwrap().is_none());
    // Write-once: first writer wins.
    let err = h.put("m/k0", b"other").unwrap_err();
    assert!(matches!(err, Error::Exists(_)), "{err}");
    assert_eq!(
        h.retrieve("m/k0").unwrap().unwrap().as_slice(),
        &pattern(0, 1)[..]
    );
    // Delete while mapped: the mapping stays valid.
    let held = h.retrieve("m/k3").unwrap().unwrap();
    h.delete("m/k3").unwrap();
    assert!(!h.exists("m/k3").unwrap());
    assert_eq!(held.as_slice(), &pattern(3, 3 << 20)[..]);
    assert!(matches!(h.delete("m/k3").unwrap_err(), Error::NotFound(_)));
    // Batch forms.
    let paths = ["m/k0", "m/k1", "m/none"];
    assert_eq!(h.batch_exists(&paths).unwrap(), vec![true, true, false]);
    let got = h.batch_retrieve(&paths).unwrap();
    assert!(got[0].is_some() && got[1].is_some() && got[2].is_none());
    let r = h.batch_pin(&paths, true).unwrap();
    assert!(r[0].is_ok() && r[1].is_ok() && r[2].is_err());
    assert!(h.is_pinned("m/k1").unwrap());
    h.unpin("m/k1").unwrap();
    assert!(!h.is_pinned("m/k1").unwrap());
    // Async stores complete on flush.
    for i in 0..50u64 {
        let mut a = h.alloc(4096).unwrap();
        a.as_mut_slice().copy_from_slice(&pattern(100 + i, 4096));
        h.store_async(&format!("m/a{i}"), a).unwrap();
    }
    let mut dup = h.alloc(4096).unwrap();
    dup.as_mut_slice().fill(9);
    h.store_async("m/a0", dup).unwrap();
    let errs = h.flush().unwrap();
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(matches!(errs[0].1, Error::Exists(_)));
    for i in 0..50u64 {
        let m = h.retrieve(&format!("m/a{i}")).unwrap().unwrap();
        assert_eq!(m.as_slice(), &pattern(100 + i, 4096)[..]);
    }
    // Stats account every published entry.
    let st = h.stats().unwrap();
    let pool = &st.pools[0];
    assert_eq!(pool.entries, 3 + 50);
    assert_eq!(
        pool.writing_bytes,
        st.clients.iter().map(|c| c.allocated).sum::<u64>()
    );
}

#[test]
fn roundtrip_memfs() {
    maru_tests::require_root!();
    let d = Daemon::start(no_mount(&[MEMFS]));
    roundtrip(&d);
}

#[test]
fn roundtrip_file_pool() {
    let d = Daemon::start(no_mount(&[FILE]));
    roundtrip(&d);
}

#[test]
fn bad_names_are_refused() {
    maru_tests::require_root!();
    let d = Daemon::start(no_mount(&[MEMFS]));
    let h = d.handler();
    h.mkdir("n", 0o755).unwrap();
    let long = format!("n/{}", "x".repeat(256));
    assert!(matches!(
        h.put(&long, b"x").unwrap_err(),
        Error::NameTooLong(_)
    ));
    for bad in ["n/.", "n/..", "nokey", "n/a\0b", "/k", "n//k"] {
        assert!(h.put(bad, b"x").is_err(), "{bad:?} accepted");
    }
    assert!(h.mkdir("..", 0o755).is_err());
    assert!(matches!(
        h.put("missing/k", b"x").unwrap_err(),
        Error::NotFound(_)
    ));
    assert!(matches!(h.alloc(0).unwrap_err(), Error::InvalidArgument(_)));
    assert!(matches!(h.alloc(1 << 40).unwrap_err(), Error::NoSpace(_)));
}

/// `alloc_many`: allocations of any size in one exchange, published together; all or none.
/// Publishes `handles` under `paths` in one batch; each must succeed.
fn publish_all(h: &maru::Handler, paths: &[String], handles: &mut [maru::AllocHandle]) {
    let mut items: Vec<(&str, &mut maru::AllocHandle)> = paths
        .iter()
        .map(String::as_str)
        .zip(handles.iter_mut())
        .collect();
    assert!(
        h.publish_many(&mut items)
            .unwrap()
            .iter()
            .all(Result::is_ok)
    );
}

fn alloc_many(d: &Daemon) {
    let h = d.handler();
    h.mkdir("b", 0o755).unwrap();
    // More than the pool holds: refused, and nothing of it stays allocated. (Done first, on
    // an empty pool: after the entries below were stored and retrieved, the same refusal took
    // over a minute in this test; not investigated yet.)
    assert!(matches!(
        h.alloc_many(8 << 20, 64).unwrap_err(),
        Error::NoSpace(_)
    ));
    assert_eq!(h.stats().unwrap().pools[0].writing_bytes, 0);
    let size = (3 << 20) + 5; // above the sizes `alloc` asks for in batches
    let mut got = h.alloc_many(size, 5).unwrap();
    assert_eq!(got.len(), 5);
    for (i, a) in got.iter_mut().enumerate() {
        a.as_mut_slice()
            .copy_from_slice(&pattern(200 + i as u64, size as usize));
    }
    let paths: Vec<String> = (0..5).map(|i| format!("b/k{i}")).collect();
    publish_all(&h, &paths, &mut got);
    for (i, p) in paths.iter().enumerate() {
        let m = h.retrieve(p).unwrap().unwrap();
        assert_eq!(m.as_slice(), &pattern(200 + i as u64, size as usize)[..]);
    }
    assert!(h.alloc_many(size, 0).unwrap().is_empty());
    assert!(matches!(
        h.alloc_many(0, 2).unwrap_err(),
        Error::InvalidArgument(_)
    ));
}

#[test]
fn alloc_many_memfs() {
    maru_tests::require_root!();
    alloc_many(&Daemon::start(no_mount(&[MEMFS])));
}

#[test]
fn alloc_many_file_pool() {
    alloc_many(&Daemon::start(no_mount(&[FILE])));
}

/// Process A stores, process B retrieves: B maps the very pages A wrote.
fn two_process_pfn(pool: &str) {
    let d = Daemon::start(no_mount(&[pool]));
    d.handler().mkdir("pfn", 0o755).unwrap();
    let sock = d.socket.to_string_lossy().into_owned();
    let size = (4 << 20).to_string();
    let a = probe(&["store", &sock, "pfn/k", &size, "7"]);
    let b = probe(&["retrieve", &sock, "pfn/k", "7"]);
    assert_eq!(a.trim(), b.trim(), "writer and reader frames differ");
    assert!(!a.trim().starts_with("0 "), "PFNs are zero: not root?");
}

#[test]
fn two_processes_share_frames_memfs() {
    maru_tests::require_root!();
    two_process_pfn(MEMFS);
}

#[test]
fn two_processes_share_frames_file_pool() {
    maru_tests::require_root!();
    two_process_pfn(FILE);
}

/// A memfs entry's file has the entry's mode whatever marud's umask (0077) takes off the files
/// it creates: a restart reads modes back from the files, and the kernel decides from it when
/// clients open entries' files themselves.
#[test]
fn a_memfs_entry_file_has_the_entry_mode() {
    use std::os::unix::fs::PermissionsExt;
    maru_tests::require_root!();
    let d = Daemon::start(Opts::default());
    let h = d.handler();
    h.mkdir("m", 0o755).unwrap();
    h.put("m/k", b"mode").unwrap();
    std::fs::write(d.path("m/w"), b"by path").unwrap();
    std::fs::set_permissions(d.published("m/w"), std::fs::Permissions::from_mode(0o640)).unwrap();
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode(&d.path("m/k")), 0o644, "as stored");
    assert_eq!(mode(&d.pool_dir().join("n/m/k")), 0o644, "its file");
    assert_eq!(
        mode(&d.pool_dir().join("n/m/w")),
        0o640,
        "a file written through the mount"
    );
}

fn recovery(pools: &[&str]) {
    let mut d = Daemon::start(no_mount(pools));
    let h = d.handler();
    h.mkdir("r", 0o750).unwrap();
    h.mkdir("r/sub", 0o700).unwrap();
    let n = 40u64;
    for i in 0..n {
        let size = 1000 + (i as usize) * 7919;
        h.put(&format!("r/k{i}"), &pattern(i, size)).unwrap();
    }
    h.put("r/sub/deep", &pattern(99, 10)).unwrap();
    h.pin("r/k3").unwrap();
    h.delete("r/k5").unwrap();
    // Allocations in flight when the daemon dies must not come back nor leak.
    let mut w = h.alloc(1 << 20).unwrap();
    w.as_mut_slice().fill(0xee);
    let before = h.stats().unwrap();
    drop(h);
    d.kill9();
    std::mem::forget(w);
    d.restart();
    let h = d.handler();
    for i in 0..n {
        let p = format!("r/k{i}");
        if i == 5 {
            assert!(!h.exists(&p).unwrap());
            continue;
        }
        let size = 1000 + (i as usize) * 7919;
        let m = h
            .retrieve(&p)
            .unwrap()
            .unwrap_or_else(|| panic!("{p} lost"));
        assert_eq!(m.as_slice(), &pattern(i, size)[..], "{p} changed");
    }
    assert_eq!(
        h.retrieve("r/sub/deep").unwrap().unwrap().as_slice(),
        &pattern(99, 10)[..]
    );
    assert!(h.is_pinned("r/k3").unwrap());
    assert!(!h.is_pinned("r/k4").unwrap());
    let after = h.stats().unwrap();
    for (b, a) in before.pools.iter().zip(&after.pools) {
        assert_eq!(a.entries, b.entries);
        assert_eq!(a.sealed_bytes, b.sealed_bytes);
        assert_eq!(a.writing_bytes, 0, "a WRITING allocation survived");
    }
    let ns: Vec<_> = after
        .namespaces
        .iter()
        .map(|n| (n.ns.clone(), n.mode))
        .collect();
    assert!(
        ns.contains(&("r".into(), 0o750)) && ns.contains(&("r/sub".into(), 0o700)),
        "{ns:?}"
    );
    // No leaked space: used space is what the surviving entries explain.
    for p in &after.pools {
        let slack = if p.kind.is_raw() { 2 << 20 } else { 64 << 10 };
        assert!(
            p.used <= p.sealed_bytes + slack * p.entries.max(1),
            "pool {} uses {} for {} sealed bytes",
            p.name,
            p.used,
            p.sealed_bytes
        );
    }
    // Deleting everything returns all the space.
    let keys: Vec<String> = (0..n)
        .filter(|i| *i != 5)
        .map(|i| format!("r/k{i}"))
        .collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    h.unpin("r/k3").unwrap();
    assert!(h.batch_delete(&refs).unwrap().iter().all(Result::is_ok));
    h.delete("r/sub/deep").unwrap();
    // This client's cached mappings hold leases on raw extents until dropped.
    h.trim();
    let empty = h.stats().unwrap();
    for p in &empty.pools {
        assert_eq!(p.entries, 0);
        assert_eq!(p.sealed_bytes, 0);
        if p.kind.is_raw() {
            assert_eq!(p.used, 0, "raw pool leaked {} bytes", p.used);
        }
    }
}

#[test]
fn kill9_recovery_memfs() {
    maru_tests::require_root!();
    recovery(&[MEMFS]);
}

#[test]
fn kill9_recovery_file_pool() {
    recovery(&[FILE]);
}

#[test]
fn kill9_recovery_two_pools() {
    maru_tests::require_root!();
    recovery(&["memfs:{dir}/pool,size=4M", FILE]);
}

#[test]
fn client_crash_is_reclaimed() {
    maru_tests::require_root!();
    for pool in [MEMFS, FILE] {
        let d = Daemon::start(no_mount(&[pool]));
        let h = d.handler();
        h.mkdir("c", 0o777).unwrap();
        h.put("c/held", &pattern(1, 8192)).unwrap();
        let mut child = std::process::Command::new(maru_tests::bin("maru-probe"))
            .args(["hold", &d.socket.to_string_lossy(), "3000000", "c/held"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = [0u8; 8];
        child
            .stdout
            .as_mut()
            .unwrap()
            .read_exact(&mut line)
            .unwrap();
        let st = h.stats().unwrap();
        assert!(st.pools[0].writing_bytes >= 3_000_000, "{st:?}");
        assert!(st.clients.iter().any(|c| c.leases > 0 || pool == MEMFS));
        child.kill().unwrap();
        child.wait().unwrap();
        let t = std::time::Instant::now();
        loop {
            let st = h.stats().unwrap();
            let mine: u64 = st.clients.iter().map(|c| c.allocated).sum();
            if st.clients.len() == 2 && st.pools[0].writing_bytes == mine {
                // The reclaimed allocation is gone and the held entry is intact.
                assert_eq!(
                    h.retrieve("c/held").unwrap().unwrap().as_slice(),
                    &pattern(1, 8192)[..]
                );
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "not reclaimed: {st:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Waits until the daemon serves `n` client connections.
fn wait_for_clients(h: &maru::Handler, n: usize) {
    let t = std::time::Instant::now();
    while h.stats().unwrap().clients.len() != n {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "still not {n} clients"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn holds_of_two_connections_are_counted_apart() {
    maru_tests::require_root!();
    let d = Daemon::start(no_mount(&[MEMFS]));
    let (h1, h2) = (d.handler(), d.handler());
    h1.mkdir("h", 0o755).unwrap();
    h1.mkdir("g", 0o755).unwrap();
    for p in ["h/k", "h/other", "g/k"] {
        h1.put(p, p.as_bytes()).unwrap();
    }
    // One request per namespace, one outcome per path.
    let before = h1.stats().unwrap().ops.get("hold").copied().unwrap_or(0);
    let r = h1
        .batch_hold(&["h/k", "g/k", "h/none", "h/k"], true)
        .unwrap();
    assert!(r[0].is_ok() && r[1].is_ok() && r[3].is_ok(), "{r:?}");
    assert!(matches!(r[2], Err(Error::NotFound(_))), "{r:?}");
    assert_eq!(h1.stats().unwrap().ops["hold"], before + 2);
    h2.hold("h/k").unwrap();
    assert!(h2.stat("h/k").unwrap().unwrap().held);
    assert!(matches!(h2.unhold("g/k"), Err(Error::NotFound(_))));
    // h1 goes away with its three holds; h2's still protects the entry.
    let clients = h2.stats().unwrap().clients.len();
    drop(h1);
    wait_for_clients(&h2, clients - 1);
    let (_, _, entries) = h2.list("h").unwrap();
    assert_eq!(entries.iter().find(|e| e.key == "k").unwrap().holds, 1);
    h2.evict(u64::MAX).unwrap();
    assert!(!h2.exists("h/other").unwrap() && !h2.exists("g/k").unwrap());
    assert_eq!(h2.retrieve("h/k").unwrap().unwrap().as_slice(), b"h/k");
    // Both gone: nothing holds it, eviction takes it.
    let h3 = d.handler();
    drop(h2);
    wait_for_clients(&h3, clients - 1);
    assert!(!h3.stat("h/k").unwrap().unwrap().held);
    h3.evict(u64::MAX).unwrap();
    assert!(!h3.exists("h/k").unwrap());
}

fn frame(body: &[u8]) -> Vec<u8> {
    let mut v = (body.len() as u32).to_le_bytes().to_vec();
    v.extend_from_slice(body);
    v
}

fn read_reply(s: &mut UnixStream) -> Option<serde_json::Value> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).ok()?;
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut body).ok()?;
    Some(serde_json::from_slice(&body).expect("daemon replies are JSON"))
}

#[test]
fn malformed_frames_get_errors_and_change_nothing() {
    maru_tests::require_root!();
    let d = Daemon::start(no_mount(&[MEMFS]));
    let h = d.handler();
    h.mkdir("f", 0o755).unwrap();
    h.put("f/keep", b"kept").unwrap();
    let connect = || {
        let s = UnixStream::connect(&d.socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s
    };
    // A request before hello: error, then close.
    let mut s = connect();
    s.write_all(&frame(br#"{"id":1,"op":"stats"}"#)).unwrap();
    let r = read_reply(&mut s).unwrap();
    assert_eq!(r["err"]["kind"], "protocol", "{r}");
    assert!(read_reply(&mut s).is_none(), "connection should be closed");
    // Garbage after hello: error reply, connection keeps working.
    let mut s = connect();
    s.write_all(&frame(
        br#"{"id":1,"op":"hello","args":{"version":3,"client":"t"}}"#,
    ))
    .unwrap();
    assert!(read_reply(&mut s).unwrap().get("ok").is_some());
    for bad in [
        &b"not json"[..],
        br#"{"id":2,"op":"no_such_op"}"#,
        br#"{"id":3,"op":"delete","args":{"ns":"f"}}"#,
        br#"{"id":4,"op":"publish","args":{"alloc":999999,"ns":"f","key":"x"}}"#,
        br#"{"id":5,"op":"hello","args":{"version":3,"client":"again"}}"#,
        br#"{"id":6,"op":"alloc","args":{"size":0,"count":1}}"#,
        br#"{"id":7,"op":"exists","args":{"ns":"../etc","keys":["x"]}}"#,
    ] {
        s.write_all(&frame(bad)).unwrap();
        let r = read_reply(&mut s).unwrap();
        assert!(
            r.get("err").is_some(),
            "{} accepted: {r}",
            String::from_utf8_lossy(bad)
        );
    }
    s.write_all(&frame(
        br#"{"id":8,"op":"exists","args":{"ns":"f","keys":["keep"]}}"#,
    ))
    .unwrap();
    assert_eq!(read_reply(&mut s).unwrap()["ok"]["found"][0], true);
    // Oversized frame: error and close.
    let mut s2 = connect();
    s2.write_all(&u32::MAX.to_le_bytes()).unwrap();
    let r = read_reply(&mut s2).unwrap();
    assert_eq!(r["err"]["kind"], "protocol");
    assert!(read_reply(&mut s2).is_none());
    // Half a frame, then hang up.
    let mut s3 = connect();
    s3.write_all(&100u32.to_le_bytes()).unwrap();
    s3.write_all(b"{\"id\":").unwrap();
    drop(s3);
    // The daemon still serves, with the same state.
    let h2 = d.handler();
    assert_eq!(h2.retrieve("f/keep").unwrap().unwrap().as_slice(), b"kept");
    assert_eq!(h2.stats().unwrap().pools[0].entries, 1);
}

fn fill_pool(eviction: &str) {
    let d = Daemon::start(Opts {
        pools: vec!["memfs:{dir}/pool,size=32M".into()],
        mount: false,
        extra: vec!["--eviction".into(), eviction.into()],
    });
    let h = d.handler();
    h.mkdir("e", 0o755).unwrap();
    let mb = 1 << 20;
    h.put("e/pinned", &pattern(0, mb)).unwrap();
    h.pin("e/pinned").unwrap();
    let mut stored = 0;
    let mut last_err = None;
    for i in 1..=64u64 {
        match h.put(&format!("e/k{i}"), &pattern(i, mb)) {
            Ok(()) => stored += 1,
            Err(e) => {
                last_err = Some(e);
                break;
            }
        }
    }
    let st = h.stats().unwrap();
    if eviction == "lru" {
        assert_eq!(stored, 64, "stores failed with eviction on: {last_err:?}");
        assert!(st.pools[0].evictions > 30, "{st:?}");
        assert!(h.exists("e/k64").unwrap());
        assert!(
            !h.exists("e/k1").unwrap(),
            "the oldest entry should be evicted"
        );
    } else {
        assert!(stored < 40, "pool of 32M accepted {stored} MiB");
        assert!(matches!(last_err, Some(Error::NoSpace(_))), "{last_err:?}");
        assert_eq!(st.pools[0].evictions, 0);
        assert!(h.exists("e/k1").unwrap());
    }
    // Pinned entries survive eviction.
    assert_eq!(
        h.retrieve("e/pinned").unwrap().unwrap().as_slice(),
        &pattern(0, mb)[..]
    );
}

#[test]
fn full_pool_with_eviction() {
    maru_tests::require_root!();
    fill_pool("lru");
}

#[test]
fn full_pool_without_eviction() {
    maru_tests::require_root!();
    fill_pool("off");
}

/// Eviction takes the least recently *used* entries, not the oldest stored: a retrieval
/// (through libmaru, or an open through the mount) counts as a use.
#[test]
fn eviction_spares_recently_retrieved_entries() {
    maru_tests::require_root!();
    let d = Daemon::start(Opts {
        pools: vec!["memfs:{dir}/pool,size=64M".into()],
        mount: true,
        extra: vec!["--eviction".into(), "lru".into()],
    });
    let h = d.handler();
    h.mkdir("u", 0o755).unwrap();
    let mb = 1 << 20;
    for i in 0..8u64 {
        h.put(&format!("u/k{i}"), &pattern(i, mb)).unwrap();
    }
    // Used after storing, oldest first in storing order: k0 by libmaru, k1 through the mount,
    // k0 again (it is now the most recently used).
    drop(h.retrieve("u/k0").unwrap().unwrap());
    drop(std::fs::File::open(d.path("u/k1")).unwrap());
    drop(h.retrieve("u/k0").unwrap().unwrap());
    // Make room for 5 MiB more than is free: the least recently used entries go first,
    // k2, k3, ... in storing order, and neither k1 nor k0.
    let p = &h.stats().unwrap().pools[0];
    let (n, _) = h.evict(p.capacity - p.used + 5 * mb as u64).unwrap();
    assert!((2..=6).contains(&n), "evicted {n}");
    let left: Vec<u64> = (0..8u64)
        .filter(|i| h.exists(&format!("u/k{i}")).unwrap())
        .collect();
    let want: Vec<u64> = (0..8u64).filter(|i| *i < 2 || *i >= 2 + n).collect();
    assert_eq!(left, want, "{n} evicted");
}

#[test]
fn full_raw_pool_evicts() {
    let d = Daemon::start(Opts {
        pools: vec!["file:{dir}/dev.img,size=16M".into()],
        mount: false,
        extra: vec![],
    });
    let h = d.handler();
    h.mkdir("e", 0o755).unwrap();
    for i in 0..40u64 {
        h.put(&format!("e/k{i}"), &pattern(i, 1 << 20)).unwrap();
    }
    assert!(h.exists("e/k39").unwrap());
    assert!(h.stats().unwrap().pools[0].evictions > 0);
    // A leased entry is not reused while mapped, even when deleted.
    let m = h.retrieve("e/k39").unwrap().unwrap();
    h.delete("e/k39").unwrap();
    for i in 40..80u64 {
        h.put(&format!("e/k{i}"), &pattern(i, 1 << 20)).unwrap();
    }
    assert_eq!(m.as_slice(), &pattern(39, 1 << 20)[..]);
}

#[test]
fn namespace_quotas_bound_stores_through_socket_and_mount() {
    maru_tests::require_root!();
    let mut d = Daemon::start(Opts::default());
    let h = d.handler();
    h.mkdir("q", 0o777).unwrap();
    h.mkdir("q/sub", 0o777).unwrap();
    h.set_quota("q", Some(1 << 20)).unwrap();
    // 768 KiB fits, then 512 KiB more (in a namespace under it) does not: EDQUOT, and the
    // allocation is not leaked.
    h.put("q/a", &pattern(1, 768 << 10)).unwrap();
    let e = h.put("q/sub/b", &pattern(2, 512 << 10)).unwrap_err();
    assert!(matches!(e, maru::Error::Quota(_)), "{e}");
    assert_eq!(e.errno(), libc::EDQUOT);
    assert!(!h.exists("q/sub/b").unwrap());
    h.put("q/sub/c", &pattern(3, 200 << 10)).unwrap();
    // Through the mount: the namespace is not full yet, so a create works; a write that takes
    // it over is refused at close (the entry is not published).
    std::fs::write(d.path("q/sub/m"), pattern(4, 10 << 10)).unwrap();
    assert_eq!(
        std::fs::read(d.path("q/sub/m")).unwrap(),
        pattern(4, 10 << 10)
    );
    let _ = std::fs::write(d.path("q/over"), pattern(5, 512 << 10));
    assert!(
        !d.path("q/over").exists(),
        "an entry over the quota was published"
    );
    // At the quota exactly, even a create fails with EDQUOT.
    h.set_quota("q", Some((768 << 10) + (200 << 10) + (10 << 10)))
        .unwrap();
    let e = std::fs::File::create(d.path("q/full")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EDQUOT), "{e}");
    // Deleting frees quota; the quota shows in listings and survives a restart.
    h.delete("q/a").unwrap();
    h.put("q/sub/b", &pattern(2, 512 << 10)).unwrap();
    let (info, _, _) = h.list("q").unwrap();
    assert_eq!(info.unwrap().quota, Some(978 << 10));
    drop(h);
    d.stop();
    d.restart();
    let h = d.handler();
    let (info, _, _) = h.list("q").unwrap();
    assert_eq!(
        info.unwrap().quota,
        Some(978 << 10),
        "the quota survives a restart"
    );
    // (This harness's daemon drops its tmpfs pool when it stops, so the namespace is empty.)
    let e = h.put("q/again", &pattern(6, 990 << 10)).unwrap_err();
    assert!(matches!(e, maru::Error::Quota(_)), "after restart: {e}");
    // Clearing lifts the bound (only root may: security::another_user_cannot_touch_...).
    h.set_quota("q", None).unwrap();
    h.put("q/again", &pattern(6, 990 << 10)).unwrap();
}

/// A namespace removed and made again under the same name is a new namespace to a client
/// that read the old one's index: it finds the new entries (the old index is retired).
#[test]
fn a_namespace_made_again_is_seen_by_clients_of_the_old_one() {
    maru_tests::require_root!();
    let d = Daemon::start(no_mount(&[MEMFS]));
    let (writer, reader) = (d.handler(), d.handler());
    writer.mkdir("again", 0o755).unwrap();
    writer.put("again/old", b"old").unwrap();
    assert!(reader.exists("again/old").unwrap());
    writer.delete("again/old").unwrap();
    writer.rmdir("again").unwrap();
    writer.mkdir("again", 0o755).unwrap();
    writer.put("again/new", b"new").unwrap();
    assert!(reader.exists("again/new").unwrap());
    assert!(!reader.exists("again/old").unwrap());
    assert_eq!(
        reader.retrieve("again/new").unwrap().unwrap().as_slice(),
        b"new"
    );
}

/// What a root client opened itself reaches marud even when the client asks nothing else: at
/// its next retrieve once the report is 100 ms old.
#[test]
fn a_report_of_entries_opened_by_a_client_goes_without_another_request() {
    maru_tests::require_root!();
    let d = Daemon::start(no_mount(&[MEMFS]));
    let (writer, reader) = (d.handler(), d.handler());
    writer.mkdir("seen", 0o755).unwrap();
    writer.put("seen/k", b"bytes").unwrap();
    let accessed = || {
        let s = writer.stats().unwrap();
        s.ops.get("accessed").copied().unwrap_or(0)
    };
    assert_eq!(
        reader.retrieve("seen/k").unwrap().unwrap().as_slice(),
        b"bytes"
    );
    std::thread::sleep(Duration::from_millis(150));
    assert_eq!(accessed(), 0, "reported before it was due");
    // A repeated retrieve (answered from the handler's own mappings) carries the report.
    assert_eq!(
        reader.retrieve("seen/k").unwrap().unwrap().as_slice(),
        b"bytes"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while accessed() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no report reached marud"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(writer.stats().unwrap().bytes["retrieved"], 5);
}

/// A batch retrieve that marud fails part way (one entry's file went from its memfs pool
/// behind marud's back) answers the error, reads every reply (the connection stays in step:
/// the next call works) and gives back every lease taken for it (the raw pool's entries,
/// deleted, leave the pool empty).
#[test]
fn a_batch_retrieve_failing_part_way_keeps_the_connection_and_leaks_no_lease() {
    maru_tests::require_root!();
    let d = Daemon::start(no_mount(&["memfs:{dir}/pool,size=64M,name=mem", FILE]));
    let in_pool = |pool: &str| {
        maru::Handler::connect(maru::Config {
            pool: Some(pool.into()),
            ..d.client_config()
        })
        .unwrap()
    };
    let (raw, mem) = (in_pool("emu"), in_pool("mem"));
    raw.mkdir("f", 0o755).unwrap();
    let keys: Vec<String> = (0..48).map(|i| format!("f/k{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        let h = if i == 20 { &mem } else { &raw };
        h.put(k, &pattern(i as u64, 8192)).unwrap();
    }
    std::fs::remove_file(d.pool_dir().join("n/f/k20")).unwrap();

    let h = d.handler();
    let paths: Vec<&str> = keys.iter().map(String::as_str).collect();
    assert!(h.batch_retrieve(&paths).is_err(), "k20's file is gone");
    let m = h.retrieve("f/k40").unwrap().expect("k40 is there");
    assert_eq!(
        m.as_slice(),
        &pattern(40, 8192)[..],
        "the connection in step"
    );
    drop(m);
    for (i, k) in keys.iter().enumerate() {
        if i != 20 {
            raw.delete(k).unwrap();
        }
    }
    // The storing clients' regions go with them. The retrieve drops the mappings cached of
    // the entries deleted; the next call carries the leases given back.
    drop((raw, mem));
    assert!(h.retrieve("f/k0").unwrap().is_none());
    let used = || {
        let st = h.stats().unwrap();
        st.pools.iter().find(|p| p.name == "emu").unwrap().used
    };
    // marud closes the storing clients' sessions when it sees them go.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while used() != 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        used(),
        0,
        "leases of the failed retrieve kept deleted entries"
    );
}

/// A handler whose keys are all in its cache and in the shared index stops answering from
/// them once marud is gone: after `kill -9` and a restart, the raw pool's extents the dead
/// marud's leases protected may be carved again, and what the old index says is no one's word.
#[test]
fn a_dead_marud_s_index_is_not_trusted() {
    let mut d = Daemon::start(no_mount(&[FILE]));
    let h = d.handler();
    h.mkdir("d", 0o755).unwrap();
    h.put("d/k", &pattern(1, 5000)).unwrap();
    let m = h.retrieve("d/k").unwrap().expect("stored");
    assert!(h.retrieve("d/k").unwrap().is_some(), "from the cache");
    assert!(h.exists("d/k").unwrap(), "from the index");
    d.kill9();
    d.restart();
    // The liveness of marud is looked at every 2 ms at most.
    std::thread::sleep(Duration::from_millis(10));
    assert!(matches!(h.retrieve("d/k"), Err(Error::Disconnected)));
    assert!(matches!(h.exists("d/k"), Err(Error::Disconnected)));
    assert!(matches!(h.exists("d/other"), Err(Error::Disconnected)));
    drop(m);
    let h = d.handler();
    let m = h.retrieve("d/k").unwrap().expect("recovered");
    assert_eq!(m.as_slice(), &pattern(1, 5000)[..]);
}

/// A namespace whose listing is larger than a frame (4 MiB): listed whole, a page at a time
/// (before, the one reply was refused: "frame of 10121363 bytes exceeds the limit"). Its
/// batches of 4,096 publications with long names also filled both sides' socket buffers
/// before they were sent a window at a time (the call timed out after 30 s).
#[test]
fn a_listing_larger_than_a_frame_comes_whole() {
    let d = Daemon::start(no_mount(&["file:{dir}/dev.img,size=256M,name=emu"]));
    let h = d.handler();
    h.mkdir("big", 0o755).unwrap();
    // Children between the entries, across the pages, and after them all.
    let children = ["big/k00100-a", "big/k16000-a", "big/k32767-z", "big/sub"];
    for c in children {
        h.mkdir(c, 0o755).unwrap();
    }
    let pad = "x".repeat(200);
    let mut names: Vec<String> = Vec::new();
    for round in 0..8 {
        let mut got = h.alloc_many(1, maru::proto::MAX_BATCH).unwrap();
        let batch: Vec<String> = (0..got.len())
            .map(|i| format!("k{:05}-{pad}", round * maru::proto::MAX_BATCH + i))
            .collect();
        let paths: Vec<String> = batch.iter().map(|n| format!("big/{n}")).collect();
        publish_all(&h, &paths, &mut got);
        names.extend(batch);
    }
    let (me, listed_children, entries) = h.list("big").unwrap();
    assert_eq!(me.map(|m| m.entries), Some(names.len() as u64));
    assert_eq!(
        listed_children
            .iter()
            .map(|c| c.ns.as_str())
            .collect::<Vec<_>>(),
        children
    );
    let listed: Vec<&str> = entries.iter().map(|e| e.key.as_str()).collect();
    assert_eq!(listed, names, "every name once, in order");
}

/// A call that timed out (marud stopped) closes its connection: the later calls fail as
/// disconnected rather than read the late answer as theirs (before: "reply to request 3
/// while waiting for 4", for good), or go through the lane ahead of what the socket still
/// holds, or hand out a spare allocation marud freed with the session.
#[test]
fn a_call_that_timed_out_leaves_no_connection_out_of_step() {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let d = Daemon::start(no_mount(&[MEMFS]));
    let connect = || {
        maru::Handler::connect(maru::Config {
            timeout: Duration::from_millis(500),
            ..d.client_config()
        })
        .unwrap()
    };
    let pid = Pid::from_raw(d.pid() as i32);
    fn timed_out<T>(r: &maru::Result<T>) -> bool {
        matches!(r, Err(Error::Os { errno, .. }) if *errno == libc::ETIMEDOUT)
    }
    // Stops marud, and waits until every thread of it is stopped (a thread spinning on the
    // lane would answer first otherwise).
    let stop = |pid: Pid| {
        kill(pid, Signal::SIGSTOP).unwrap();
        let all_stopped = || {
            std::fs::read_dir(format!("/proc/{pid}/task"))
                .unwrap()
                .flatten()
                .all(|t| {
                    let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
                    // The state follows the command's closing parenthesis.
                    stat.rsplit_once(") ")
                        .is_some_and(|(_, rest)| rest.starts_with('T'))
                })
        };
        while !all_stopped() {
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    // A call in the lane (or on the socket) that times out.
    let h = connect();
    h.mkdir("t", 0o755).unwrap();
    for _ in 0..2 {
        drop(h.alloc(4096).unwrap()); // the second asks for a batch: spares kept
    }
    stop(pid);
    let r = h.stats();
    kill(pid, Signal::SIGCONT).unwrap();
    assert!(timed_out(&r), "{r:?}");
    std::thread::sleep(Duration::from_millis(200)); // the late answer is there by now
    for _ in 0..2 {
        let r = h.stats();
        assert!(matches!(r, Err(Error::Disconnected)), "{r:?}");
    }
    let r = h.alloc(4096);
    assert!(matches!(r, Err(Error::Disconnected)), "{:?}", r.map(|_| ()));
    // A batch on the socket that times out: no later call goes through the lane.
    let h = connect();
    let mut a = h.alloc(4096).unwrap();
    stop(pid);
    let r = h.publish_many(&mut [("t/k", &mut a)]);
    kill(pid, Signal::SIGCONT).unwrap();
    assert!(timed_out(&r), "{r:?}");
    std::thread::sleep(Duration::from_millis(200));
    let r = h.stats();
    assert!(matches!(r, Err(Error::Disconnected)), "{r:?}");
    // A new connection is served.
    d.handler().stats().unwrap();
}

/// marud serves at most `--max-connections` connections at once: one more is told so (busy,
/// naming the flag) and closed, and counted; one that sends nothing is closed without an
/// answer; once a connection closes, a new one is served.
#[test]
fn a_connection_over_the_cap_is_told_busy_and_closed() {
    let mut opts = no_mount(&[MEMFS]);
    opts.extra = vec!["--max-connections".into(), "2".into()];
    let d = Daemon::start(opts);
    let a = d.handler();
    let b = d.handler();
    let Err(e) = maru::Handler::connect(d.client_config()) else {
        panic!("a third connection was served");
    };
    assert!(
        matches!(e, Error::Busy(_)) && e.to_string().contains("--max-connections"),
        "{e}"
    );
    // A client over the cap that sends nothing is closed (not held for good).
    let mut silent = UnixStream::connect(&d.socket).expect("connect");
    silent
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    assert_eq!(
        silent.read(&mut [0u8; 1]).expect("closed, not timed out"),
        0
    );
    // Once one goes, a new connection is served.
    drop(b);
    let t = std::time::Instant::now();
    let c = loop {
        match maru::Handler::connect(d.client_config()) {
            Ok(c) => break c,
            Err(Error::Busy(_)) if t.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("{e}"),
        }
    };
    // Counted: the refused one and the silent one, at least.
    assert!(c.stats().expect("stats").ops["connections_refused"] >= 2);
    assert!(a.stats().is_ok());
}
