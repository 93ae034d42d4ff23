//! Small memfs entries packed into shared files (`p/` of the pool): what a client that says
//! where it publishes gets, what every other door sees of a packed entry, how an entry leaves
//! its pack, and what a restart recovers.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use maru_tests::{Daemon, Opts, pattern, probe, xattr};

/// A handler that says it publishes in namespace `ns` (so small allocations are packed), with
/// that namespace made (0755) if it is not yet.
fn packing(d: &Daemon, ns: &str) -> maru::Handler {
    let h = maru::Handler::connect(maru::Config {
        namespace: Some(ns.into()),
        ..d.client_config()
    })
    .unwrap();
    match h.mkdir(ns, 0o755) {
        Ok(()) | Err(maru::Error::Exists(_)) => h,
        Err(e) => panic!("mkdir {ns}: {e}"),
    }
}

fn text(p: &Path, name: &str) -> String {
    String::from_utf8(xattr(p, name).unwrap()).unwrap()
}

/// The pack files of the first pool.
fn packs(d: &Daemon) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d.pool_dir().join("p"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.parse::<u32>().is_ok())
        .collect();
    v.sort();
    v
}

#[test]
fn small_entries_share_a_pack_and_every_door_reads_them() {
    maru_tests::require_root!();
    let d = Daemon::start(Opts::default());
    let h = packing(&d, "kv");
    for i in 0..40u64 {
        h.put(&format!("kv/k{i}"), &pattern(i, 4096 + i as usize))
            .unwrap();
    }
    // 64 KiB is packed; one byte more is a file of its own.
    h.put("kv/edge", &pattern(100, 64 << 10)).unwrap();
    h.put("kv/big", &pattern(101, (64 << 10) + 1)).unwrap();
    let pack_dir = d.pool_dir().join("p");
    let loc = text(&d.path("kv/k7"), "user.maru.location");
    assert!(
        Path::new(&loc).starts_with(&pack_dir),
        "a small entry is in a pack: {loc}"
    );
    assert_eq!(text(&d.path("kv/k7"), "user.maru.access"), "copy");
    assert_eq!(
        text(&d.path("kv/k0"), "user.maru.location"),
        loc,
        "one pack"
    );
    let off: u64 = text(&d.path("kv/k1"), "user.maru.offset").parse().unwrap();
    assert_eq!(off % 4096, 0);
    assert!(off > 0, "the second entry is further in");
    assert!(Path::new(&text(&d.path("kv/edge"), "user.maru.location")).starts_with(&pack_dir));
    assert_eq!(
        text(&d.path("kv/big"), "user.maru.location"),
        d.pool_dir().join("n/kv/big").display().to_string()
    );
    // The pack file is root's directory's, with the entries' owner and mode.
    let md = std::fs::metadata(&loc).unwrap();
    assert_eq!(md.permissions().mode() & 0o7777, 0o644);
    assert_eq!(
        std::fs::metadata(&pack_dir).unwrap().permissions().mode() & 0o777,
        0o700
    );

    // Through the mount (by copy), through another handler (a slice of the pack), and from
    // another process.
    for i in [0u64, 7, 39] {
        let want = pattern(i, 4096 + i as usize);
        assert_eq!(std::fs::read(d.path(&format!("kv/k{i}"))).unwrap(), want);
        let m = d.handler().retrieve(&format!("kv/k{i}")).unwrap().unwrap();
        assert_eq!(m.as_slice(), &want[..]);
    }
    let fresh = d.handler();
    let keys: Vec<String> = (0..40).map(|i| format!("kv/k{i}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let got = fresh.batch_retrieve(&refs).unwrap();
    for (i, m) in got.iter().enumerate() {
        assert_eq!(
            m.as_ref().unwrap().as_slice(),
            &pattern(i as u64, 4096 + i)[..]
        );
    }
    // Entries of one pack are slices of one mapping.
    let (a, b) = (got[0].as_ref().unwrap(), got[1].as_ref().unwrap());
    let gap = b.as_ptr() as i64 - a.as_ptr() as i64;
    assert_eq!(
        gap as u64, off,
        "k1 lies `offset` bytes after k0 in one mapping"
    );
    // A mapping through the mount reads the same bytes.
    let sock = d.socket.to_string_lossy().into_owned();
    let out = probe(&["mapfile", d.path("kv/k5").to_str().unwrap(), "5"]);
    assert!(out.starts_with(&format!("{} ", 4096 + 5)), "{out}");
    let out = probe(&["retrieve", &sock, "kv/k9", "9"]);
    assert!(!out.trim().is_empty());
}

/// Mappings of this daemon's packs in this process (`/proc/self/maps` lines).
fn pack_mappings(d: &Daemon) -> usize {
    let dir = d.pool_dir().join("p").display().to_string() + "/";
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .nth(5)
                .is_some_and(|p| p.starts_with(&dir))
        })
        .count()
}

/// A writer maps a pack once for all the allocations carved from it; each allocation's
/// bytes are its own, and a publication that keeps the handle leaves it a private copy.
#[test]
fn a_packs_allocations_are_slices_of_one_mapping() {
    maru_tests::require_root!();
    let d = Daemon::start(Opts::default());
    let h = packing(&d, "kv");
    let mut hs: Vec<maru::AllocHandle> = (0..32).map(|_| h.alloc(4096).unwrap()).collect();
    for (i, a) in hs.iter_mut().enumerate() {
        a.as_mut_slice().copy_from_slice(&pattern(i as u64, 4096));
    }
    assert_eq!(packs(&d).len(), 1, "one pack");
    assert_eq!(pack_mappings(&d), 1, "one mapping for 32 allocations");

    let mut kept = hs.pop().unwrap();
    h.publish("kv/kept", &mut kept, None).unwrap();
    assert!(kept.is_done());
    assert_eq!(kept.as_slice(), &pattern(31, 4096)[..]);
    kept.as_mut_slice()[..4].copy_from_slice(b"late");
    assert_eq!(
        kept.as_slice()[..4],
        *b"late",
        "the private copy takes writes"
    );
    // Published elsewhere than the pack's namespace, or freed: marud frees its pages in the
    // pack, and the handle's private copy still reads what was written.
    h.mkdir("other", 0o755).unwrap();
    let mut moved = hs.pop().unwrap();
    h.publish("other/moved", &mut moved, None).unwrap();
    assert_eq!(moved.as_slice(), &pattern(30, 4096)[..]);
    let mut freed = hs.pop().unwrap();
    h.free_in_place(&mut freed).unwrap();
    assert_eq!(freed.as_slice(), &pattern(29, 4096)[..]);
    for (i, a) in hs.into_iter().enumerate() {
        h.store(&format!("kv/k{i}"), a).unwrap();
    }
    let r = d.handler();
    assert_eq!(
        r.retrieve("kv/kept").unwrap().unwrap().as_slice(),
        &pattern(31, 4096)[..],
        "writes after the publication never reach the pool"
    );
    assert_eq!(
        r.retrieve("other/moved").unwrap().unwrap().as_slice(),
        &pattern(30, 4096)[..]
    );
    for i in 0..29u64 {
        let m = r.retrieve(&format!("kv/k{i}")).unwrap().unwrap();
        assert_eq!(m.as_slice(), &pattern(i, 4096)[..], "entry {i}");
    }
}

/// A reader maps the pack's own pages: the frames it sees are the writer's.
#[test]
fn a_packed_entry_is_the_packs_own_pages() {
    maru_tests::require_root!();
    let d = Daemon::start(Opts::default());
    d.handler().mkdir("pfn", 0o755).unwrap();
    let sock = d.socket.to_string_lossy().into_owned();
    let a = probe(&["store", &sock, "pfn/k", "16384", "3"]);
    assert!(
        Path::new(&text(&d.path("pfn/k"), "user.maru.location"))
            .starts_with(d.pool_dir().join("p")),
        "the probe's store is packed"
    );
    let b = probe(&["retrieve", &sock, "pfn/k", "3"]);
    assert_eq!(a.trim(), b.trim(), "writer and reader frames differ");
    assert!(!a.trim().starts_with("0 "), "PFNs are zero: not root?");
}

#[test]
fn an_entry_leaves_its_pack_when_its_readers_would_change() {
    maru_tests::require_root!();
    let d = Daemon::start(Opts::default());
    let h = packing(&d, "a");
    h.mkdir("b", 0o755).unwrap();
    let pack_dir = d.pool_dir().join("p");
    let in_pack =
        |rel: &str| Path::new(&text(&d.path(rel), "user.maru.location")).starts_with(&pack_dir);
    for k in ["x", "y", "z", "w"] {
        h.put(&format!("a/{k}"), &pattern(k.len() as u64, 5000))
            .unwrap();
    }
    // Published elsewhere than the handler said: a file of its own.
    h.put("b/other", &pattern(9, 3000)).unwrap();
    assert!(!in_pack("b/other"));
    assert_eq!(
        std::fs::read(d.pool_dir().join("n/b/other")).unwrap(),
        pattern(9, 3000)
    );
    let pack = text(&d.path("a/x"), "user.maru.location");
    let at: u64 = text(&d.path("a/x"), "user.maru.offset").parse().unwrap();
    let in_pack_at = |off: u64| {
        use std::os::unix::fs::FileExt;
        let mut b = vec![0u8; 5000];
        std::fs::File::open(&pack)
            .unwrap()
            .read_exact_at(&mut b, off)
            .unwrap();
        b
    };
    assert_eq!(in_pack_at(at), pattern(1, 5000));
    let z_at: u64 = text(&d.path("a/z"), "user.maru.offset").parse().unwrap();
    // Renamed within its namespace: it stays.
    std::fs::rename(d.path("a/y"), d.path("a/y2")).unwrap();
    assert!(in_pack("a/y2"));
    // A reader that has a/x mapped from its pack (its handler caches the mapping).
    let early = d.handler();
    let before = early.retrieve("a/x").unwrap().expect("a/x");
    assert_eq!(before.as_slice(), &pattern(1, 5000)[..]);
    drop(before);
    // Renamed into another namespace, or given another mode: its own file.
    std::fs::rename(d.path("a/z"), d.path("b/z")).unwrap();
    assert!(!in_pack("b/z"));
    std::fs::set_permissions(d.path("a/x"), std::fs::Permissions::from_mode(0o600)).unwrap();
    assert!(!in_pack("a/x"));
    let file = d.pool_dir().join("n/a/x");
    assert_eq!(
        std::fs::metadata(&file).unwrap().permissions().mode() & 0o7777,
        0o600
    );
    assert!(in_pack("a/w"), "the others stay");
    let want = pattern(1, 5000);
    assert_eq!(std::fs::read(&file).unwrap(), want);
    // What left the pack is not readable there any more: the pack's readers need not be the
    // entry's now.
    assert!(
        in_pack_at(at).iter().all(|b| *b == 0),
        "a/x left bytes behind"
    );
    assert!(
        in_pack_at(z_at).iter().all(|b| *b == 0),
        "a/z left bytes behind"
    );
    let fresh = d.handler();
    for (k, seed) in [("a/x", 1u64), ("a/y2", 1), ("b/z", 1), ("a/w", 1)] {
        let m = fresh.retrieve(k).unwrap().unwrap_or_else(|| panic!("{k}"));
        assert_eq!(m.as_slice(), &pattern(seed, 5000)[..], "{k}");
    }
    // The index says where each one is now: the handler that stored them reads them too,
    // and the one that had a/x mapped from the pack reads it from its file, not the zeros
    // its piece of the pack holds now (same generation, another place).
    assert_eq!(h.retrieve("b/z").unwrap().unwrap().as_slice(), &want[..]);
    assert_eq!(
        early.retrieve("a/x").unwrap().unwrap().as_slice(),
        &want[..]
    );
}

#[test]
fn a_pack_goes_when_its_last_entry_and_writer_did() {
    maru_tests::require_root!();
    let d = Daemon::start(Opts {
        mount: false,
        ..Opts::default()
    });
    let h = packing(&d, "g");
    for i in 0..8 {
        h.put(&format!("g/k{i}"), &pattern(i, 8192)).unwrap();
    }
    let reader = d.handler();
    let kept = reader.retrieve("g/k3").unwrap().unwrap();
    assert_eq!(packs(&d).len(), 1);
    let keys: Vec<String> = (0..8).map(|i| format!("g/k{i}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    assert!(h.batch_delete(&refs).unwrap().iter().all(Result::is_ok));
    assert_eq!(packs(&d).len(), 1, "its writer may still carve from it");
    drop(h);
    let t = std::time::Instant::now();
    while !packs(&d).is_empty() {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "the empty pack stays: {:?}",
            packs(&d)
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // Removed under a reader's mapping: the bytes stay until it lets go.
    assert_eq!(kept.as_slice(), &pattern(3, 8192)[..]);
}

#[test]
fn packed_entries_survive_kill9() {
    maru_tests::require_root!();
    let mut d = Daemon::start(Opts::default());
    let h = packing(&d, "r");
    for i in 0..30u64 {
        h.put(&format!("r/k{i}"), &pattern(i, 1000 + 997 * i as usize))
            .unwrap();
    }
    h.pin("r/k2").unwrap();
    h.delete("r/k4").unwrap();
    std::fs::rename(d.path("r/k6"), d.path("r/six")).unwrap();
    // Pinned in its pack, then out of it (another mode): pinned in its own file too.
    h.pin("r/k3").unwrap();
    std::fs::set_permissions(d.path("r/k3"), std::fs::Permissions::from_mode(0o600)).unwrap();
    // A whole pack of deleted entries, and an allocation in flight: neither comes back.
    let g = packing(&d, "r");
    g.put("r/gone", &pattern(77, 100)).unwrap();
    g.delete("r/gone").unwrap();
    let mut w = h.alloc(4096).unwrap();
    w.as_mut_slice().fill(0xee);
    let before = packs(&d);
    assert_eq!(before.len(), 2, "{before:?}");
    d.kill9();
    std::mem::forget(w);
    drop((h, g));
    d.restart();
    let h = d.handler();
    for i in 0..30u64 {
        let p = match i {
            4 => {
                assert!(!h.exists("r/k4").unwrap());
                continue;
            }
            6 => "r/six".to_string(),
            _ => format!("r/k{i}"),
        };
        let m = h
            .retrieve(&p)
            .unwrap()
            .unwrap_or_else(|| panic!("{p} lost"));
        assert_eq!(
            m.as_slice(),
            &pattern(i, 1000 + 997 * i as usize)[..],
            "{p}"
        );
    }
    assert!(!h.exists("r/k6").unwrap());
    assert!(!h.exists("r/gone").unwrap());
    assert!(h.is_pinned("r/k2").unwrap());
    assert!(
        h.is_pinned("r/k3").unwrap(),
        "the pin left the pack with the entry"
    );
    assert_eq!(packs(&d), before[..1], "the empty pack is removed");
    // New stores go to a new pack, never over the recovered one.
    let h2 = packing(&d, "r");
    h2.put("r/new", &pattern(5, 4096)).unwrap();
    assert_eq!(packs(&d).len(), 2);
    assert_eq!(
        h.retrieve("r/k1").unwrap().unwrap().as_slice(),
        &pattern(1, 1997)[..]
    );
}

/// The pack that holds packed entry `path`.
fn pack_of(h: &maru::Handler, path: &str) -> u32 {
    let s = h.stat(path).unwrap().unwrap_or_else(|| panic!("no {path}"));
    maru::index::packed(s.offset)
        .unwrap_or_else(|| panic!("{path} is not packed"))
        .0
}

/// For each pack of `packed` (the pack of `e/k{i}` at `i`): its entries, and how many of
/// them are left.
fn left_by_pack(h: &maru::Handler, packed: &[u32]) -> std::collections::BTreeMap<u32, (u64, u64)> {
    let mut by_pack = std::collections::BTreeMap::<u32, (u64, u64)>::new();
    for (i, p) in packed.iter().enumerate() {
        let n = by_pack.entry(*p).or_default();
        n.0 += 1;
        n.1 += u64::from(h.exists(&format!("e/k{i}")).unwrap());
    }
    by_pack
}

/// A marud of one 32 MiB memfs pool that evicts (16 packs of 2 MiB), without a mount.
fn full_of_packs() -> Daemon {
    Daemon::start(Opts {
        pools: vec!["memfs:{dir}/pool,size=32M".into()],
        mount: false,
        extra: vec!["--eviction".into(), "lru".into()],
    })
}

/// A full pool of packed entries makes room by evicting the least recently used packs whole
/// (a pack's memory comes back only with its last entry), and storing goes on. A handler's
/// puts fill its packs in order (it takes its spare allocations oldest first), so the oldest
/// pack is all published and goes first.
#[test]
fn a_full_pool_of_packed_entries_evicts_whole_packs() {
    maru_tests::require_root!();
    let d = full_of_packs();
    let h = packing(&d, "e");
    let n = 3000u64; // 32 KiB each: 94 MiB, three times the pool; 64 to a pack
    let mut packed = Vec::with_capacity(n as usize);
    for i in 0..n {
        let k = format!("e/k{i}");
        h.put(&k, &pattern(i, 32 << 10))
            .unwrap_or_else(|e| panic!("store {i}: {e}"));
        packed.push(pack_of(&h, &k));
    }
    assert!(
        packed.windows(2).all(|w| w[0] <= w[1]),
        "puts fill packs in order"
    );
    let st = h.stats().unwrap();
    let p = &st.pools[0];
    assert!(p.evictions > 1500, "{p:?}");
    assert_eq!(p.evictions % 64, 0, "whole packs of 64 entries go: {p:?}");
    assert!(p.used <= p.capacity, "{p:?}");
    assert!(!h.exists("e/k0").unwrap(), "the oldest pack is evicted");
    for (pack, (all, left)) in left_by_pack(&h, &packed) {
        assert!(
            left == 0 || left == all,
            "pack {pack} evicted in part: {left} of its {all} entries left"
        );
    }
    for i in n - 100..n {
        let m = h.retrieve(&format!("e/k{i}")).unwrap().expect("recent");
        assert_eq!(m.as_slice(), &pattern(i, 32 << 10)[..]);
    }
    // What is left fits in the packs that hold it (2 MiB each), with one being filled.
    let live = p.sealed_bytes.div_ceil(2 << 20);
    assert!(
        packs(&d).len() as u64 <= live + 2,
        "{} packs for {} live bytes",
        packs(&d).len(),
        p.sealed_bytes
    );
}

/// A pack's memory comes back only once nothing lives in it: with one entry of each of the
/// oldest packs held (as a connector holds the chunks it found until it loads them), a full
/// pool evicts whole the packs nothing keeps, and keeps the held packs' other entries
/// (evicting them would free nothing).
#[test]
fn a_full_pool_evicts_the_packs_it_can_empty() {
    maru_tests::require_root!();
    let d = full_of_packs();
    let h = packing(&d, "e");
    let size = 32usize << 10; // 64 to a pack
    let per_pack = (2u64 << 20) / size as u64;
    let put = |i: u64| {
        h.put(&format!("e/k{i}"), &pattern(i, size))
            .unwrap_or_else(|e| panic!("store {i}: {e}"))
    };
    // 13 packs of the pool's 16, filled in order; the first entry of each of the 11 oldest
    // held (the packs are found by the entries' locations, not by their numbers).
    let (filled, held) = (13 * per_pack, 11);
    let mut packed = Vec::with_capacity(filled as usize);
    for i in 0..filled {
        put(i);
        packed.push(pack_of(&h, &format!("e/k{i}")));
    }
    assert!(packed.windows(2).all(|w| w[0] <= w[1]), "{packed:?}");
    let mut order = packed.clone();
    order.dedup();
    assert_eq!(order.len(), 13, "a pack at a time: {order:?}");
    let kept = &order[..held];
    for p in kept {
        let first = packed.iter().position(|q| q == p).expect("an entry");
        h.hold(&format!("e/k{first}")).unwrap();
    }
    assert_eq!(h.stats().unwrap().pools[0].evictions, 0, "it all fits");
    // Ten packs more: the packs nothing holds turn over, the oldest first.
    let n = filled + 10 * per_pack;
    for i in filled..n {
        put(i);
    }
    let st = h.stats().unwrap();
    let p = &st.pools[0];
    assert!(p.evictions > 0 && p.used <= p.capacity, "{p:?}");
    assert_eq!(p.evictions % per_pack, 0, "whole packs go: {p:?}");
    for (pack, (all, left)) in left_by_pack(&h, &packed) {
        if kept.contains(&pack) {
            assert_eq!(
                left, all,
                "pack {pack} is held: evicting its entries frees nothing ({p:?})"
            );
        } else {
            assert_eq!(
                left, 0,
                "pack {pack}, held by nothing, is older than what was stored after ({p:?})"
            );
        }
    }
    for i in n - 100..n {
        let m = h.retrieve(&format!("e/k{i}")).unwrap().expect("recent");
        assert_eq!(m.as_slice(), &pattern(i, size)[..]);
    }
}

#[test]
fn with_pack_0_every_entry_is_a_file_of_its_own() {
    maru_tests::require_root!();
    let d = Daemon::start(Opts {
        pools: vec!["memfs:{dir}/pool,size=64M,pack=0".into()],
        ..Opts::default()
    });
    let h = packing(&d, "o");
    h.put("o/k", &pattern(1, 4096)).unwrap();
    assert_eq!(
        text(&d.path("o/k"), "user.maru.location"),
        d.pool_dir().join("n/o/k").display().to_string()
    );
    assert_eq!(text(&d.path("o/k"), "user.maru.access"), "passthrough");
    assert!(packs(&d).is_empty());
}

/// A pack holds two descriptors; the kernel doubles a process's descriptor table as it fills,
/// and each doubling in a process with threads waits for an RCU grace period (10–19 ms,
/// under the store's lock). marud gives its table 64 Ki slots at start (or its limit).
#[test]
fn marud_sizes_its_descriptor_table_at_start() {
    maru_tests::require_root!();
    let d = Daemon::start(Opts::default());
    let proc = Path::new("/proc").join(d.pid().to_string());
    let field = |file: &str, name: &str| -> String {
        std::fs::read_to_string(proc.join(file))
            .unwrap()
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{name} in {file}"))
            .to_owned()
    };
    let fd_size: u64 = field("status", "FDSize:")
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let limit: u64 = field("limits", "Max open files")
        .split_whitespace()
        .nth(3)
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        fd_size >= limit.min(65_536),
        "a table of {fd_size} descriptors (limit {limit})"
    );
}
