//! In-process tests of the store (no root, no mount): its two doors — the control socket's
//! verbs and the filesystem's `Backend` — over `file:` pools, against an in-memory model.

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use maru::Error;
use maru_daemon::pool::PoolSpec;
use maru_daemon::store::fsview::StoreFs;
use maru_daemon::store::{Eviction, SessionId, Store, StoreConfig};
use maru_daemon::wal::LogSink;
use maru_fsd::backend::ROOT_INO;
use maru_fsd::{Backend, Caller};
use proptest::prelude::*;

struct Fixture {
    store: Arc<Store>,
    _dir: tempfile::TempDir,
}

/// Unmounts the tmpfs of a store's memfs pools when dropped (also when a check panics).
struct Unmount(Arc<Store>);

impl Drop for Unmount {
    fn drop(&mut self) {
        self.0.unmount_pools();
    }
}

impl Fixture {
    fn new(size_mib: u64, eviction: Eviction, max_copy_entry: u64) -> Self {
        Self::with_log(size_mib, eviction, max_copy_entry, false)
    }

    /// [`Fixture::new`], the pool's log synced at each record if `wal_sync`.
    fn with_log(size_mib: u64, eviction: Eviction, max_copy_entry: u64, wal_sync: bool) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let store = Self::open(dir.path(), size_mib, eviction, max_copy_entry, wal_sync);
        Fixture { store, _dir: dir }
    }

    fn open(
        dir: &std::path::Path,
        size_mib: u64,
        eviction: Eviction,
        max_copy_entry: u64,
        wal_sync: bool,
    ) -> Arc<Store> {
        let cfg = StoreConfig {
            eviction,
            state_dir: dir.join("state"),
            wal_sync,
            max_copy_entry,
        };
        let spec = PoolSpec::parse(&format!(
            "file:{}/dev.img,size={size_mib}M,name=emu",
            dir.display()
        ))
        .unwrap();
        Store::open(cfg, &[spec]).unwrap()
    }

    /// A raw pool of 16 MiB, eviction off, whose log's appends fail while the switch
    /// returned is on (a full disk).
    fn with_failing_appends() -> (Self, Arc<std::sync::atomic::AtomicBool>) {
        let dir = tempfile::tempdir().unwrap();
        let store = Self::open(dir.path(), 16, Eviction::Off, 1 << 20, false);
        let [_, appends] = Faulty::install(
            &store,
            dir.path(),
            maru_daemon::wal::Durability::Checkpoints,
        );
        (Fixture { store, _dir: dir }, appends)
    }

    /// A store of the pools `specs` (`{dir}`: the fixture's directory), eviction off.
    fn with_pools(specs: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let cfg = StoreConfig {
            eviction: Eviction::Off,
            state_dir: dir.path().join("state"),
            wal_sync: false,
            max_copy_entry: 1 << 20,
        };
        let specs: Vec<PoolSpec> = specs
            .iter()
            .map(|s| {
                PoolSpec::parse(&s.replace("{dir}", &dir.path().display().to_string())).unwrap()
            })
            .collect();
        let store = Store::open(cfg, &specs).unwrap();
        Fixture { store, _dir: dir }
    }

    fn fs(&self) -> StoreFs {
        StoreFs(self.store.clone())
    }

    /// Stores `data` as `ns/key` over the socket, as `c`.
    fn put(&self, c: &Caller, ns: &str, key: &str, data: &[u8]) -> maru::Result<()> {
        let s = self.store.open_session("t", c.clone());
        let r = (|| {
            let (g, _) = self
                .store
                .alloc(s, data.len() as u64, 1, None, None)?
                .pop()
                .unwrap();
            let dev = self.store.raw_pool_fd(g.pool, true)?;
            dev.write_all_at(data, g.offset)?;
            self.store.publish(s, g.alloc, ns, key, None).map(drop)
        })();
        self.store.close_session(s);
        r
    }

    /// The bytes of `ns/key` over the socket (None when absent).
    fn get(&self, ns: &str, key: &str) -> Option<Vec<u8>> {
        let s = self.store.open_session("t", Caller::root());
        let it = self
            .store
            .retrieve(s, ns, &[key.to_owned()], |_| false)
            .unwrap()
            .pop()
            .unwrap();
        let out = it.map(|(loc, _)| {
            let dev = self.store.raw_pool_fd(loc.pool, false).unwrap();
            let mut b = vec![0; loc.size as usize];
            dev.read_exact_at(&mut b, loc.offset).unwrap();
            b
        });
        self.store.close_session(s);
        out
    }

    fn ino(&self, c: &Caller, path: &str) -> u64 {
        let mut ino = ROOT_INO;
        for part in path.split('/') {
            ino = self.fs().lookup(c, ino, part).unwrap().ino;
        }
        ino
    }

    /// Writes `data` through the mount's door as a writer would: create, writes in 1 MiB
    /// pieces, close (commit), release (seal). Returns the first error and where it came.
    fn write_through_mount(&self, c: &Caller, ns: &str, key: &str, data: &[u8]) -> Written {
        let fs = self.fs();
        let parent = self.ino(c, ns);
        let ino = match fs.create(c, parent, key, 0o644) {
            Ok((a, _)) => a.ino,
            Err(e) => return Written::Create(e),
        };
        let mut out = Written::Ok;
        for (i, chunk) in data.chunks(1 << 20).enumerate() {
            if let Err(e) = fs.write(ino, (i << 20) as u64, chunk) {
                out = Written::Write(e);
                break;
            }
        }
        if let Err(e) = fs.commit(c, ino, false)
            && matches!(out, Written::Ok)
        {
            out = Written::Close(e);
        }
        let _ = fs.seal(ino);
        out
    }
}

#[derive(Debug)]
enum Written {
    Ok,
    Create(Error),
    Write(Error),
    Close(Error),
}

impl Written {
    fn errno(&self) -> Option<i32> {
        match self {
            Written::Ok => None,
            Written::Create(e) | Written::Write(e) | Written::Close(e) => Some(e.errno()),
        }
    }
}

fn me(uid: u32, gid: u32) -> Caller {
    Caller::new(uid, gid, std::process::id() as i32)
}

#[test]
fn a_failed_write_is_never_published_whatever_the_writer_does_next() {
    // EIO from the device, EFBIG past the largest entry: the writer learns it from `write`,
    // again from `close`, and the entry is not published however the writer ends.
    let f = Fixture::new(64, Eviction::Off, 4 << 20);
    let root = me(0, 0);
    f.store.mkdir(&root, "ns", 0o755).unwrap();
    let fs = f.fs();
    let parent = f.ino(&root, "ns");
    let failing = Arc::new(std::sync::Mutex::new(None::<u64>));
    let fl = failing.clone();
    f.store.set_data_fault(Some(Box::new(move |ino| {
        (*fl.lock().unwrap() == Some(ino)).then_some(libc::EIO)
    })));
    for ending in ["close", "exit", "killed"] {
        let key = format!("eio-{ending}");
        let (a, _) = fs.create(&root, parent, &key, 0o644).unwrap();
        fs.write(a.ino, 0, &[1; 4096]).unwrap();
        *failing.lock().unwrap() = Some(a.ino);
        assert_eq!(
            fs.write(a.ino, 4096, &[2; 4096]).unwrap_err().errno(),
            libc::EIO
        );
        *failing.lock().unwrap() = None;
        // Later writes fail too: the entry is failed.
        assert_eq!(
            fs.write(a.ino, 8192, &[3; 10]).unwrap_err().errno(),
            libc::EIO
        );
        match ending {
            // close(2) reports the failure again; exit closes the descriptors the same way.
            "close" | "exit" => {
                assert_eq!(
                    fs.commit(&root, a.ino, false).unwrap_err().errno(),
                    libc::EIO
                )
            }
            _ => fs.commit(&root, a.ino, true).unwrap(),
        }
        fs.seal(a.ino).unwrap();
        assert_eq!(f.get("ns", &key), None, "{ending}");
        assert!(fs.lookup(&root, parent, &key).is_err());
    }
    let big = vec![7u8; 5 << 20];
    let w = f.write_through_mount(&root, "ns", "too-big", &big);
    assert!(matches!(w, Written::Write(_)), "{w:?}");
    assert_eq!(w.errno(), Some(libc::EFBIG));
    assert_eq!(f.get("ns", "too-big"), None);
    // Nothing leaked; the pool is whole.
    assert_eq!(f.store.pools()[0].used, 0);
    f.store.check_invariants().unwrap();
}

#[test]
fn a_refused_publication_is_reported_by_close() {
    let f = Fixture::new(64, Eviction::Off, 16 << 20);
    let root = me(0, 0);
    f.store.mkdir(&root, "q", 0o755).unwrap();
    f.store.set_quota(&root, "q", Some(10 << 20)).unwrap();
    // Quota: four 4 MiB entries in 10 MiB; each writer learns at close (or write).
    let mut published = Vec::new();
    for i in 0..4 {
        let key = format!("k{i}");
        let w = f.write_through_mount(&root, "q", &key, &vec![i as u8; 4 << 20]);
        match w.errno() {
            None => published.push(key.clone()),
            Some(e) => assert_eq!(e, libc::EDQUOT, "{key}: {w:?}"),
        }
        assert_eq!(f.get("q", &key).is_some(), w.errno().is_none(), "{key}");
    }
    assert_eq!(published, ["k0", "k1"]);
    // A name taken meanwhile over the socket: the writer's close says EEXIST.
    f.store.mkdir(&root, "n", 0o755).unwrap();
    let fs = f.fs();
    let parent = f.ino(&root, "n");
    let (a, _) = fs.create(&root, parent, "k", 0o644).unwrap();
    fs.write(a.ino, 0, b"through the mount").unwrap();
    f.put(&root, "n", "k", b"over the socket").unwrap();
    assert_eq!(
        fs.commit(&root, a.ino, false).unwrap_err().errno(),
        libc::EEXIST
    );
    fs.seal(a.ino).unwrap();
    assert_eq!(f.get("n", "k").unwrap(), b"over the socket");
    // Once a close committed a name, the socket cannot take it.
    let (b, _) = fs.create(&root, parent, "j", 0o644).unwrap();
    fs.write(b.ino, 0, b"first").unwrap();
    fs.commit(&root, b.ino, false).unwrap();
    assert!(matches!(
        f.put(&root, "n", "j", b"second"),
        Err(Error::Exists(_))
    ));
    fs.seal(b.ino).unwrap();
    assert_eq!(f.get("n", "j").unwrap(), b"first");
    // A name another writer is still writing cannot be created again.
    let (c, _) = fs.create(&root, parent, "w", 0o644).unwrap();
    assert!(matches!(
        fs.create(&root, parent, "w", 0o644),
        Err(Error::Exists(_))
    ));
    fs.commit(&root, c.ino, false).unwrap();
    fs.seal(c.ino).unwrap();
    // No room in the pool: the close of a raw-pool entry reports ENOSPC.
    let w = f.write_through_mount(&root, "n", "huge", &vec![1; 15 << 20]);
    assert!(w.errno().is_none(), "{w:?}");
    let mut last = None;
    for i in 0..8 {
        let w = f.write_through_mount(&root, "n", &format!("fill{i}"), &vec![1; 15 << 20]);
        if let Some(e) = w.errno() {
            assert!(matches!(w, Written::Close(_)), "{w:?}");
            last = Some(e);
            assert!(f.get("n", &format!("fill{i}")).is_none());
            break;
        }
    }
    assert_eq!(last, Some(libc::ENOSPC));
    f.store.check_invariants().unwrap();
}

#[test]
fn a_rename_changes_both_namespaces() {
    let f = Fixture::new(16, Eviction::Off, 1 << 20);
    let root = me(0, 0);
    f.store.mkdir(&root, "a", 0o755).unwrap();
    f.store.mkdir(&root, "b", 0o755).unwrap();
    f.put(&root, "a", "k", b"moved").unwrap();
    let fs = f.fs();
    let (a, b) = (f.ino(&root, "a"), f.ino(&root, "b"));
    let before = (fs.getattr(a).unwrap(), fs.getattr(b).unwrap());
    std::thread::sleep(std::time::Duration::from_millis(5));
    fs.rename(&root, a, "k", b, "k2").unwrap();
    let after = (fs.getattr(a).unwrap(), fs.getattr(b).unwrap());
    assert!(
        after.0.mtime > before.0.mtime,
        "the source namespace's mtime"
    );
    assert!(
        after.1.mtime > before.1.mtime,
        "the target namespace's mtime"
    );
    assert_eq!((after.0.size, after.1.size), (0, 1));
    assert_eq!(f.get("b", "k2").unwrap(), b"moved");
    assert_eq!(f.get("a", "k"), None);
    f.store.check_invariants().unwrap();
}

// ----- one access policy, both doors -----

const OWNER: u32 = 61001;
const MEMBER: u32 = 61002;
const OTHER: u32 = 61003;

fn caller(uid: u32) -> Caller {
    let groups = if uid == MEMBER { vec![OWNER] } else { vec![] };
    Caller::with_group_list(uid, uid, std::process::id() as i32, groups)
}

/// What POSIX says (the kernel's rules for `default_permissions`), written out plainly.
fn posix(c: &Caller, mode: u32, owner: u32, op: &str, target_owner: u32) -> bool {
    if c.uid == 0 {
        return true;
    }
    let bits = |m: u32, uid: u32, gid: u32| {
        if c.uid == uid {
            (m >> 6) & 7
        } else if c.in_group(gid) {
            (m >> 3) & 7
        } else {
            m & 7
        }
    };
    let ns = bits(mode, OWNER, OWNER);
    let entry = bits(0o644, target_owner, target_owner);
    let sticky_ok = mode & 0o1000 == 0 || c.uid == target_owner || c.uid == owner;
    match op {
        "lookup" => ns & 1 != 0,
        "list" => ns & 4 != 0,
        "read" => ns & 1 != 0 && entry & 4 != 0,
        "create" => ns & 3 == 3,
        "delete-own" | "delete-owners" => ns & 3 == 3 && sticky_ok,
        "pin-own" | "pin-owners" => ns & 1 != 0 && entry & 2 != 0,
        _ => unreachable!(),
    }
}

fn allowed(r: maru::Result<()>) -> bool {
    match r {
        Ok(()) => true,
        Err(e) if matches!(e.errno(), libc::EACCES | libc::EPERM) => false,
        Err(e) => panic!("neither allowed nor denied: {e}"),
    }
}

#[test]
fn both_doors_apply_one_access_policy() {
    let ops = [
        "lookup",
        "list",
        "read",
        "pin-own",
        "pin-owners",
        "create",
        "delete-owners",
        "delete-own",
    ];
    for mode in [0o1777, 0o755, 0o750, 0o700, 0o770, 0o711] {
        for uid in [OWNER, MEMBER, OTHER, 0] {
            let c = caller(uid);
            let f = Fixture::new(16, Eviction::Off, 1 << 20);
            let owner = caller(OWNER);
            f.store.mkdir(&owner, "ns", 0o777).unwrap();
            // Each door's fixtures: the caller's own entries and the owner's.
            for door in ["socket", "mount"] {
                for who in [&c, &owner] {
                    let key = format!("{door}-{}", who.uid);
                    if f.get("ns", &key).is_none() {
                        f.put(who, "ns", &key, b"x").unwrap();
                    }
                }
            }
            let nsino = f.ino(&owner, "ns");
            let fs = f.fs();
            fs.chmod_chown(&owner, nsino, Some(mode), None, None)
                .unwrap();
            for op in ops {
                let target = if op.ends_with("owners") { OWNER } else { uid };
                if target == uid && op.ends_with("owners") {
                    continue; // the namespace's owner: the same as its own
                }
                let expected = posix(&c, mode, OWNER, op, target);
                let key = |door: &str| format!("{door}-{target}");
                let socket = {
                    let s = f.store.open_session("p", c.clone());
                    let r = match op {
                        "lookup" => f.store.exists(&c, "ns", &[key("socket")]).map(drop),
                        "list" => f.store.list(&c, "ns", None, usize::MAX).map(drop),
                        "read" => f
                            .store
                            .retrieve(s, "ns", &[key("socket")], |_| false)
                            .map(drop),
                        "create" => f.put(&c, "ns", &format!("new-{uid}"), b"y"),
                        "delete-own" | "delete-owners" => f
                            .store
                            .delete(&c, "ns", &[key("socket")])
                            .and_then(|mut v| v.pop().unwrap()),
                        _ => f
                            .store
                            .pin(&c, "ns", &[key("socket")], true)
                            .and_then(|mut v| v.pop().unwrap()),
                    };
                    f.store.close_session(s);
                    allowed(r)
                };
                let mount = {
                    let entry = || f.ino(&caller(0), &format!("ns/{}", key("mount")));
                    let r = match op {
                        "lookup" => fs.lookup(&c, nsino, &key("mount")).map(drop),
                        "list" => fs.readdir(&c, nsino).map(drop),
                        "read" => fs.open(&c, entry(), false).map(drop),
                        "create" => {
                            fs.create(&c, nsino, &format!("m-new-{uid}"), 0o644)
                                .map(|(a, _)| {
                                    fs.abort(a.ino);
                                })
                        }
                        "delete-own" | "delete-owners" => fs.unlink(&c, nsino, &key("mount")),
                        _ => fs.set_pinned(&c, entry(), true),
                    };
                    allowed(r)
                };
                let at = format!("mode {mode:o}, uid {uid}, {op}");
                assert_eq!(socket, mount, "{at}: the doors disagree");
                assert_eq!(socket, expected, "{at}: not what POSIX says");
            }
        }
    }
}

// ----- reference model -----

#[derive(Debug, Clone)]
enum Op {
    Mkdir(u8),
    PutSocket(u8, u8, u16),
    PutMount(u8, u8, u16),
    DeleteSocket(u8, u8),
    Unlink(u8, u8),
    Rename(u8, u8, u8, u8),
    Pin(u8, u8, bool),
    Get(u8, u8),
}

fn op() -> impl Strategy<Value = Op> {
    let ns = 0u8..3;
    let key = 0u8..6;
    prop_oneof![
        ns.clone().prop_map(Op::Mkdir),
        (ns.clone(), key.clone(), 1u16..9000).prop_map(|(n, k, l)| Op::PutSocket(n, k, l)),
        (ns.clone(), key.clone(), 0u16..9000).prop_map(|(n, k, l)| Op::PutMount(n, k, l)),
        (ns.clone(), key.clone()).prop_map(|(n, k)| Op::DeleteSocket(n, k)),
        (ns.clone(), key.clone()).prop_map(|(n, k)| Op::Unlink(n, k)),
        (ns.clone(), key.clone(), ns.clone(), key.clone())
            .prop_map(|(a, b, c, d)| Op::Rename(a, b, c, d)),
        (ns.clone(), key.clone(), any::<bool>()).prop_map(|(n, k, p)| Op::Pin(n, k, p)),
        (ns, key).prop_map(|(n, k)| Op::Get(n, k)),
    ]
}

fn bytes(seed: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u64 * 31 + seed) as u8).collect()
}

/// Random sequences of namespace creation, stores and deletes through both doors, renames,
/// pins and reads agree with a map of names to bytes; the store's invariants hold after each
/// step.
#[test]
fn both_doors_agree_with_a_model() {
    agree_with_a_model(false);
}

/// [`both_doors_agree_with_a_model`] with each record of the pool's log synced (after the
/// store's lock; a removed extent is freed once its record is).
#[test]
fn both_doors_agree_with_a_model_with_the_log_synced_at_each_record() {
    agree_with_a_model(true);
}

fn agree_with_a_model(wal_sync: bool) {
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 24,
        ..ProptestConfig::default()
    });
    let ops = proptest::collection::vec(op(), 1..60);
    if let Err(e) = runner.run(&ops, |ops| run_model(&ops, wal_sync)) {
        panic!("{e}");
    }
}

fn run_model(ops: &[Op], wal_sync: bool) -> Result<(), TestCaseError> {
    {
        let f = Fixture::with_log(64, Eviction::Off, 1 << 20, wal_sync);
        let root = me(0, 0);
        let fs = f.fs();
        let mut model: BTreeMap<(String, String), Vec<u8>> = BTreeMap::new();
        let mut nss: Vec<String> = Vec::new();
        let name = |n: u8| format!("ns{n}");
        let k = |k: u8| format!("k{k}");
        for (i, o) in ops.iter().enumerate() {
            match o {
                Op::Mkdir(n) => {
                    let r = f.store.mkdir(&root, &name(*n), 0o755);
                    prop_assert_eq!(r.is_ok(), !nss.contains(&name(*n)));
                    if r.is_ok() {
                        nss.push(name(*n));
                    }
                }
                Op::PutSocket(n, key, len) | Op::PutMount(n, key, len) => {
                    let data = bytes(i as u64, *len as usize);
                    let exists = nss.contains(&name(*n));
                    let taken = model.contains_key(&(name(*n), k(*key)));
                    let ok = if matches!(o, Op::PutSocket(..)) {
                        if !exists {
                            continue;
                        }
                        f.put(&root, &name(*n), &k(*key), &data).is_ok()
                    } else {
                        if !exists {
                            continue;
                        }
                        matches!(
                            f.write_through_mount(&root, &name(*n), &k(*key), &data),
                            Written::Ok
                        )
                    };
                    prop_assert_eq!(ok, !taken, "{:?}", o);
                    if ok {
                        model.insert((name(*n), k(*key)), data);
                    }
                }
                Op::DeleteSocket(n, key) => {
                    if !nss.contains(&name(*n)) {
                        continue;
                    }
                    let r = f
                        .store
                        .delete(&root, &name(*n), &[k(*key)])
                        .unwrap()
                        .pop()
                        .unwrap();
                    prop_assert_eq!(r.is_ok(), model.remove(&(name(*n), k(*key))).is_some());
                }
                Op::Unlink(n, key) => {
                    if !nss.contains(&name(*n)) {
                        continue;
                    }
                    let r = fs.unlink(&root, f.ino(&root, &name(*n)), &k(*key));
                    prop_assert_eq!(r.is_ok(), model.remove(&(name(*n), k(*key))).is_some());
                }
                Op::Rename(a, ka, b, kb) => {
                    if !nss.contains(&name(*a)) || !nss.contains(&name(*b)) {
                        continue;
                    }
                    let r = fs.rename(
                        &root,
                        f.ino(&root, &name(*a)),
                        &k(*ka),
                        f.ino(&root, &name(*b)),
                        &k(*kb),
                    );
                    let from = (name(*a), k(*ka));
                    let to = (name(*b), k(*kb));
                    let expect =
                        model.contains_key(&from) && (from == to || !model.contains_key(&to));
                    prop_assert_eq!(r.is_ok(), expect, "{:?}: {:?}", o, r);
                    if expect && from != to {
                        let v = model.remove(&from).unwrap();
                        model.insert(to, v);
                    }
                }
                Op::Pin(n, key, p) => {
                    if !nss.contains(&name(*n)) {
                        continue;
                    }
                    let r = f
                        .store
                        .pin(&root, &name(*n), &[k(*key)], *p)
                        .unwrap()
                        .pop()
                        .unwrap();
                    prop_assert_eq!(r.is_ok(), model.contains_key(&(name(*n), k(*key))));
                }
                Op::Get(n, key) => {
                    if !nss.contains(&name(*n)) {
                        continue;
                    }
                    prop_assert_eq!(
                        f.get(&name(*n), &k(*key)),
                        model.get(&(name(*n), k(*key))).cloned()
                    );
                }
            }
            if let Err(e) = f.store.check_invariants() {
                prop_assert!(false, "after {:?}: {}", o, e);
            }
        }
        for ((n, key), v) in &model {
            prop_assert_eq!(f.get(n, key), Some(v.clone()));
        }
        // Started again on its pool and log, the store has what the model has.
        drop(fs);
        let Fixture { store, _dir } = f;
        drop(store);
        let store = Fixture::open(_dir.path(), 64, Eviction::Off, 1 << 20, wal_sync);
        let f = Fixture { store, _dir };
        for ((n, key), v) in &model {
            prop_assert_eq!(f.get(n, key), Some(v.clone()));
        }
        // Emptied, it uses nothing: every removed extent was freed.
        let all: BTreeMap<&String, Vec<String>> =
            model.keys().fold(BTreeMap::new(), |mut m, (n, k)| {
                m.entry(n).or_insert_with(Vec::new).push(k.clone());
                m
            });
        for (n, keys) in all {
            for r in f.store.delete(&root, n, &keys).unwrap() {
                prop_assert!(r.is_ok());
            }
        }
        prop_assert_eq!(f.store.pools()[0].used, 0);
    }
    Ok(())
}

// ----- holds: counted pins of client sessions -----

/// A store with eviction on and namespace `h` holding entries `a` and `b`.
fn held_fixture() -> Fixture {
    let f = Fixture::new(16, Eviction::Lru, 1 << 20);
    let root = me(0, 0);
    f.store.mkdir(&root, "h", 0o755).unwrap();
    for k in ["a", "b"] {
        f.put(&root, "h", k, k.as_bytes()).unwrap();
    }
    f
}

/// Takes (`hold`) or gives back one hold of session `s` per key of `h`.
fn hold(f: &Fixture, s: SessionId, keys: &[&str], hold: bool) -> Vec<maru::Result<()>> {
    let keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
    let r = f.store.hold(s, "h", &keys, hold).unwrap();
    f.store.check_invariants().unwrap();
    r
}

/// Holds on `h/key` and whether it is pinned, as the listing says (None when absent).
fn hold_state(f: &Fixture, key: &str) -> Option<(u32, bool)> {
    let (_, _, entries, _) = f.store.list(&me(0, 0), "h", None, usize::MAX).unwrap();
    entries
        .iter()
        .find(|e| e.key == key)
        .map(|e| (e.holds, e.pinned))
}

/// Evicts every entry eviction may take; returns how many it took.
fn evict_all(f: &Fixture) -> u64 {
    let n = f.store.evict(&me(0, 0), u64::MAX).unwrap().0;
    f.store.check_invariants().unwrap();
    n
}

#[test]
fn two_sessions_hold_one_entry_and_one_giving_back_keeps_it_held() {
    let f = held_fixture();
    let (s1, s2) = (
        f.store.open_session("one", me(0, 0)),
        f.store.open_session("two", me(0, 0)),
    );
    assert!(hold(&f, s1, &["a"], true)[0].is_ok());
    assert!(hold(&f, s1, &["a"], true)[0].is_ok());
    assert!(hold(&f, s2, &["a"], true)[0].is_ok());
    assert_eq!(hold_state(&f, "a"), Some((3, false)));
    // Counted: s1's two holds need two releases, and neither touches s2's.
    assert!(hold(&f, s1, &["a"], false)[0].is_ok());
    assert!(hold(&f, s1, &["a"], false)[0].is_ok());
    assert_eq!(hold_state(&f, "a"), Some((1, false)));
    assert_eq!(evict_all(&f), 1, "only the unheld entry goes");
    assert_eq!(f.get("h", "a").unwrap(), b"a");
    assert_eq!(f.get("h", "b"), None);
    assert!(hold(&f, s2, &["a"], false)[0].is_ok());
    assert_eq!(evict_all(&f), 1);
    assert_eq!(f.get("h", "a"), None);
    f.store.close_session(s1);
    f.store.close_session(s2);
}

#[test]
fn holds_go_with_their_session() {
    let f = held_fixture();
    let root = me(0, 0);
    let (s1, s2) = (
        f.store.open_session("one", root.clone()),
        f.store.open_session("two", root.clone()),
    );
    hold(&f, s1, &["a", "a", "b"], true);
    hold(&f, s2, &["a"], true);
    // A held entry can still be deleted; its holds go with it.
    assert!(f.store.delete(&root, "h", &["b".into()]).unwrap()[0].is_ok());
    f.store.check_invariants().unwrap();
    // The connection of s1 closes (or its process dies).
    f.store.close_session(s1);
    f.store.check_invariants().unwrap();
    assert_eq!(hold_state(&f, "a"), Some((1, false)));
    assert_eq!(evict_all(&f), 0);
    f.store.close_session(s2);
    f.store.check_invariants().unwrap();
    assert_eq!(hold_state(&f, "a"), Some((0, false)));
    assert_eq!(evict_all(&f), 1);
    assert_eq!(f.get("h", "a"), None);
}

#[test]
fn giving_back_a_hold_not_taken_fails_for_that_key_only() {
    let f = held_fixture();
    let (s1, s2) = (
        f.store.open_session("one", me(0, 0)),
        f.store.open_session("two", me(0, 0)),
    );
    hold(&f, s1, &["a"], true);
    hold(&f, s2, &["b"], true);
    // s2 holds b, not a; `none` does not exist.
    let r = hold(&f, s2, &["a", "b", "none"], false);
    assert!(
        matches!(&r[0], Err(Error::NotFound(m)) if m.contains("not held")),
        "{r:?}"
    );
    assert!(r[1].is_ok(), "{r:?}");
    assert!(matches!(r[2], Err(Error::NotFound(_))), "{r:?}");
    assert_eq!(hold_state(&f, "a"), Some((1, false)), "s1's hold is intact");
    assert_eq!(hold_state(&f, "b"), Some((0, false)));
    let r = hold(&f, s1, &["a", "a"], false);
    assert!(
        r[0].is_ok() && matches!(r[1], Err(Error::NotFound(_))),
        "{r:?}"
    );
    f.store.close_session(s1);
    f.store.close_session(s2);
}

#[test]
fn a_hold_needs_what_a_retrieval_needs() {
    let f = Fixture::new(16, Eviction::Lru, 1 << 20);
    let owner = caller(OWNER);
    f.store.mkdir(&owner, "h", 0o750).unwrap();
    f.put(&owner, "h", "a", b"a").unwrap();
    let member = f.store.open_session("member", caller(MEMBER));
    let other = f.store.open_session("other", caller(OTHER));
    assert!(hold(&f, member, &["a"], true)[0].is_ok());
    let r = f.store.hold(other, "h", &["a".into()], true).unwrap();
    assert!(matches!(r[0], Err(Error::PermissionDenied(_))), "{r:?}");
    assert_eq!(hold_state(&f, "a"), Some((1, false)));
    f.store.close_session(member);
    f.store.close_session(other);
    f.store.check_invariants().unwrap();
}

#[test]
fn a_held_entry_survives_eviction() {
    let f = held_fixture();
    let s = f.store.open_session("one", me(0, 0));
    hold(&f, s, &["a"], true);
    assert_eq!(evict_all(&f), 1);
    // Stores that fill the 16 MiB pool many times over evict around it.
    let mib = vec![7u8; 1 << 20];
    for i in 0..48 {
        f.put(&me(0, 0), "h", &format!("k{i}"), &mib).unwrap();
    }
    f.store.check_invariants().unwrap();
    assert_eq!(f.get("h", "k0"), None, "the pool was filled over and over");
    assert_eq!(f.get("h", "a").unwrap(), b"a");
    assert_eq!(hold_state(&f, "a"), Some((1, false)));
    f.store.close_session(s);
}

#[test]
fn the_pin_and_holds_are_independent() {
    let f = held_fixture();
    let root = me(0, 0);
    let pin = |p: bool| {
        assert!(f.store.pin(&root, "h", &["a".into()], p).unwrap()[0].is_ok());
        f.store.check_invariants().unwrap();
    };
    let s = f.store.open_session("one", root.clone());
    pin(true);
    hold(&f, s, &["a"], true);
    assert_eq!(hold_state(&f, "a"), Some((1, true)));
    // Unpinning leaves the hold.
    pin(false);
    assert_eq!(hold_state(&f, "a"), Some((1, false)));
    assert_eq!(evict_all(&f), 1);
    // Giving the hold back leaves the pin.
    pin(true);
    hold(&f, s, &["a"], false);
    assert_eq!(hold_state(&f, "a"), Some((0, true)));
    assert_eq!(evict_all(&f), 0);
    // A pin does not stand for a hold, nor the end of a session for an unpin.
    assert!(hold(&f, s, &["a"], false)[0].is_err());
    f.store.close_session(s);
    assert_eq!(hold_state(&f, "a"), Some((0, true)));
    assert_eq!(evict_all(&f), 0);
    pin(false);
    assert_eq!(evict_all(&f), 1);
}

#[test]
fn the_copy_into_a_raw_pool_at_close_keeps_no_other_client_waiting_and_a_failed_one_leaves_nothing()
{
    use std::sync::mpsc;
    use std::time::Duration;
    const WAIT: Duration = Duration::from_secs(20);
    let f = Fixture::new(256, Eviction::Off, 64 << 20);
    let root = me(0, 0);
    f.store.mkdir(&root, "ns", 0o755).unwrap();
    let fs = f.fs();
    let parent = f.ino(&root, "ns");
    let data: Vec<u8> = (0..32u32 << 20).map(|i| (i % 251) as u8).collect();
    let (a, _) = fs.create(&root, parent, "big", 0o644).unwrap();
    for (i, chunk) in data.chunks(1 << 20).enumerate() {
        fs.write(a.ino, (i << 20) as u64, chunk).unwrap();
    }
    // Once the writes are done the seam is asked by the copy into the pool only: it holds
    // the copy until the test lets it go, or fails it.
    let hold_copies = || {
        let (held_tx, held_rx) = mpsc::channel();
        let (go_tx, go_rx) = mpsc::channel::<Option<i32>>();
        let go_rx = std::sync::Mutex::new(go_rx);
        let held_tx = std::sync::Mutex::new(held_tx);
        f.store.set_data_fault(Some(Box::new(move |ino| {
            held_tx.lock().unwrap().send(ino).unwrap();
            go_rx.lock().unwrap().recv().unwrap()
        })));
        (held_rx, go_tx)
    };
    let (held_rx, go_tx) = hold_copies();
    std::thread::scope(|s| {
        let closing = s.spawn(|| fs.commit(&root, a.ino, false));
        let held = held_rx
            .recv_timeout(WAIT)
            .expect("the close copies the bytes into the pool, asking the seam");
        assert_eq!(held, a.ino);
        // While the copy is held, another client stores, retrieves and lists.
        let (done_tx, done_rx) = mpsc::channel();
        let fr = &f;
        s.spawn(move || {
            let other = me(0, 0);
            let r = fr.put(&other, "ns", "small", b"small bytes").map(|()| {
                let got = fr.get("ns", "small");
                let listed = fr
                    .store
                    .list(&other, "ns", None, usize::MAX)
                    .map(|l| l.2.len());
                (got, listed.ok())
            });
            done_tx.send(r).unwrap();
        });
        let served = done_rx
            .recv_timeout(WAIT)
            .expect("another client's store waited for the copy")
            .unwrap();
        assert_eq!(served, (Some(b"small bytes".to_vec()), Some(1)));
        go_tx.send(None).unwrap();
        closing.join().unwrap().unwrap();
    });
    fs.seal(a.ino).unwrap();
    assert!(f.get("ns", "big") == Some(data), "the bytes published");

    // A copy that fails fails the close; nothing of the entry stays.
    let used = f.store.pools()[0].used;
    f.store.set_data_fault(None);
    let (b, _) = fs.create(&root, parent, "failed", 0o644).unwrap();
    fs.write(b.ino, 0, &[5; 3 << 20]).unwrap();
    let (held_rx, go_tx) = hold_copies();
    std::thread::scope(|s| {
        let closing = s.spawn(|| fs.commit(&root, b.ino, false));
        assert_eq!(held_rx.recv_timeout(WAIT).unwrap(), b.ino);
        go_tx.send(Some(libc::EIO)).unwrap();
        assert_eq!(closing.join().unwrap().unwrap_err().errno(), libc::EIO);
    });
    fs.seal(b.ino).unwrap();
    f.store.set_data_fault(None);
    assert_eq!(f.get("ns", "failed"), None);
    assert!(fs.lookup(&root, parent, "failed").is_err());
    // Its extent is free again: the mount's open region takes the next entry there.
    let after = f.store.pools()[0].used;
    assert!(after > used, "the mount's writers have their region");
    let again = vec![6u8; 3 << 20];
    assert_eq!(
        f.write_through_mount(&root, "ns", "again", &again).errno(),
        None
    );
    assert_eq!(f.store.pools()[0].used, after);
    assert!(f.get("ns", "again") == Some(again));
    f.store.check_invariants().unwrap();
}

/// With the pool's log synced at each record, an entry deleted while a client maps it is
/// freed when the last lease ends (its removal's record synced by then), and nothing is left
/// used.
#[test]
fn with_the_log_synced_a_removed_extent_leased_meanwhile_comes_back_at_its_last_lease() {
    let f = Fixture::with_log(16, Eviction::Off, 1 << 20, true);
    let root = me(0, 0);
    f.store.mkdir(&root, "ns", 0o755).unwrap();
    f.put(&root, "ns", "k", &[1u8; 5000]).unwrap();
    let s = f.store.open_session("t", root.clone());
    let got = f
        .store
        .retrieve(s, "ns", &["k".to_owned()], |_| false)
        .unwrap();
    assert!(got[0].is_some(), "retrieved, leased");
    let r = f.store.delete(&root, "ns", &["k".to_owned()]).unwrap();
    assert!(r[0].is_ok());
    assert!(f.store.pools()[0].used > 0, "leased: not freed yet");
    f.store.close_session(s);
    assert_eq!(f.store.pools()[0].used, 0);
    f.store.check_invariants().unwrap();
}

/// With the pool's log synced at each record, a full pool with eviction makes room for each
/// new entry as it does without: the extents an eviction removed are free for the grant it
/// made room for once their records are synced, so no store fails and no more is evicted
/// than without the sync.
#[test]
fn with_the_log_synced_eviction_makes_room_as_without() {
    let live = |wal_sync: bool| {
        let f = Fixture::with_log(16, Eviction::Lru, 1 << 20, wal_sync);
        let root = me(0, 0);
        f.store.mkdir(&root, "ns", 0o755).unwrap();
        for i in 0..48 {
            let r = f.put(&root, "ns", &format!("k{i}"), &[i as u8; 1 << 20]);
            assert!(r.is_ok(), "wal_sync {wal_sync}: store {i}: {r:?}");
        }
        f.store.check_invariants().unwrap();
        f.store.pools()[0].entries
    };
    let (without, with) = (live(false), live(true));
    // Each store's own session carves a region of 2 MiB for its entry of 1 MiB.
    assert!(without >= 5, "{without} entries of 1 MiB left in 16 MiB");
    assert_eq!(
        with, without,
        "entries left with the log synced, and without"
    );
}

/// A sink of a pool's log that fails, while armed: its syncs (`--wal-sync`), from the
/// first append on, as a failed `fdatasync` does; or its appends, as a full disk does.
struct Faulty {
    inner: maru_daemon::wal::FileSink,
    syncs: Arc<std::sync::atomic::AtomicBool>,
    appends: Arc<std::sync::atomic::AtomicBool>,
}

impl Faulty {
    /// Puts a faulty sink on the log of the raw pool of the fixture in `dir`; the switches
    /// that arm its syncs' and its appends' failures.
    fn install(
        store: &Store,
        dir: &std::path::Path,
        durability: maru_daemon::wal::Durability,
    ) -> [Arc<std::sync::atomic::AtomicBool>; 2] {
        let uuid = maru::format::read_header(&std::fs::File::open(dir.join("dev.img")).unwrap())
            .unwrap()
            .unwrap()
            .uuid_string();
        let log = dir.join("state").join(format!("pool-{uuid}.wal"));
        let switches = [(); 2].map(|()| Arc::new(std::sync::atomic::AtomicBool::new(false)));
        store.set_log_sink(
            0,
            Box::new(Faulty {
                inner: maru_daemon::wal::FileSink::open(&log, durability).unwrap(),
                syncs: switches[0].clone(),
                appends: switches[1].clone(),
            }),
        );
        switches
    }
}

impl LogSink for Faulty {
    fn append(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        if self.appends.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(std::io::Error::other("injected ENOSPC"));
        }
        self.inner.append(bytes)?;
        if self.syncs.load(std::sync::atomic::Ordering::SeqCst) {
            self.inner.fail_syncs("injected EIO");
        }
        Ok(())
    }
    fn sync(&mut self) -> std::io::Result<()> {
        self.inner.sync()
    }
    fn replace(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.inner.replace(bytes)
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn file(&self) -> (&std::path::Path, maru_daemon::wal::Durability) {
        self.inner.file()
    }
    fn swap(&mut self, tmp: &std::path::Path, upto: u64) -> std::io::Result<()> {
        self.inner.swap(tmp, upto)
    }
    fn unsynced(&self) -> Option<maru_daemon::wal::Unsynced> {
        self.inner.unsynced()
    }
}

/// With the pool's log synced at each record, a store whose record could not be synced is
/// reported to the thread that served it (its server answers with the failure, not with
/// success), and the pool takes no more writes; a verb before the failure reports none.
#[test]
fn with_the_log_synced_a_failed_sync_is_the_verbs_answer() {
    use maru_daemon::store::take_sync_failure;
    let dir = tempfile::tempdir().unwrap();
    let store = Fixture::open(dir.path(), 16, Eviction::Off, 1 << 20, true);
    let [armed, _] = Faulty::install(&store, dir.path(), maru_daemon::wal::Durability::EachRecord);
    let f = Fixture { store, _dir: dir };
    let root = me(0, 0);
    f.store.mkdir(&root, "ns", 0o755).unwrap();
    f.put(&root, "ns", "before", b"synced").unwrap();
    assert!(take_sync_failure().is_none(), "nothing failed yet");
    armed.store(true, std::sync::atomic::Ordering::SeqCst);
    // The publication's record is appended, its sync fails: the verb's thread is told.
    let _ = f.put(&root, "ns", "after", b"not durable");
    let e = take_sync_failure().expect("the failed sync is the verb's answer");
    assert!(e.to_string().contains("injected EIO"), "{e}");
    assert!(take_sync_failure().is_none(), "taken once");
    // The pool takes no more writes.
    assert!(f.put(&root, "ns", "later", b"refused").is_err());
}

/// A removal the pool's log cannot take (a full disk under the state directory): the entry
/// goes for now, but its seal stays the log's last word on it, so its extent is not carved
/// again in this run, and at the next start the entry comes back whole, beside the entries
/// stored since.
#[test]
fn a_removal_the_log_cannot_take_keeps_its_extent_and_the_entry_comes_back_whole() {
    let (f, appends) = Fixture::with_failing_appends();
    let root = me(0, 0);
    f.store.mkdir(&root, "ns", 0o755).unwrap();
    f.put(&root, "ns", "kept", &[1u8; 5000]).unwrap();
    appends.store(true, std::sync::atomic::Ordering::SeqCst);
    let _ = f.store.delete(&root, "ns", &["kept".to_owned()]);
    appends.store(false, std::sync::atomic::Ordering::SeqCst);
    for i in 0..4 {
        f.put(&root, "ns", &format!("new{i}"), &[2u8; 5000])
            .unwrap();
    }
    f.store.check_invariants().unwrap();
    let Fixture { store, _dir } = f;
    drop(store);
    let f = Fixture {
        store: Fixture::open(_dir.path(), 16, Eviction::Off, 1 << 20, false),
        _dir,
    };
    assert_eq!(f.get("ns", "kept"), Some(vec![1u8; 5000]), "back, whole");
    for i in 0..4 {
        assert_eq!(f.get("ns", &format!("new{i}")), Some(vec![2u8; 5000]));
    }
    f.store.check_invariants().unwrap();
}

/// A retrieve of several keys that fails at one of them changes nothing for the others: the
/// entry of a raw pool before the failing one is not leased (deleted, its extent is free at
/// once), and the next retrieve carries the pool's descriptor the failed one never sent.
#[test]
fn a_retrieve_that_fails_part_way_leases_nothing() {
    let f = Fixture::with_pools(&[
        "file:{dir}/dev.img,size=16M,name=emu",
        "memfs:{dir}/mem,size=64M,name=mem",
    ]);
    let store = f.store.clone();
    let _unmount = Unmount(store.clone());
    let root = me(0, 0);
    store.mkdir(&root, "ns", 0o755).unwrap();
    f.put(&root, "ns", "a", &[1u8; 5000]).unwrap();
    // `b`, an entry with a file of its own in the memfs pool, whose file then goes.
    let w = store.open_session("w", root.clone());
    let (g, file) = store
        .alloc(w, 4 << 20, 1, Some("mem"), None)
        .unwrap()
        .pop()
        .unwrap();
    file.expect("a memfs allocation comes with its file")
        .write_all_at(&[2u8; 4 << 20], 0)
        .unwrap();
    store.publish(w, g.alloc, "ns", "b", None).unwrap();
    store.close_session(w);
    let path = walkdir(&f._dir.path().join("mem"), "b").expect("b's file in the pool");
    std::fs::remove_file(path).unwrap();

    let s = store.open_session("t", root.clone());
    let keys = ["a".to_owned(), "b".to_owned()];
    assert!(store.retrieve(s, "ns", &keys, |_| false).is_err());
    let got = store.retrieve(s, "ns", &keys[..1], |_| false).unwrap();
    let (_, fd) = got[0].as_ref().expect("a is there");
    assert!(
        fd.is_some(),
        "the raw pool's descriptor goes with the next retrieve"
    );
    store.release(s, &[got[0].as_ref().unwrap().0.generation]);
    assert!(store.delete(&root, "ns", &keys[..1]).unwrap()[0].is_ok());
    assert_eq!(
        store.pools()[0].used,
        0,
        "a leased by the failed retrieve: its extent is not free"
    );
    store.close_session(s);
    store.check_invariants().unwrap();
}

/// The path of the file named `name` somewhere under `dir`.
fn walkdir(dir: &std::path::Path, name: &str) -> Option<std::path::PathBuf> {
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let p = e.path();
        if p.is_dir() {
            if let Some(found) = walkdir(&p, name) {
                return Some(found);
            }
        } else if e.file_name() == name {
            return Some(p);
        }
    }
    None
}

/// A raw pool's entry written through the mount is published at its release even while its
/// writer reads it back through a read-only handle (the reads hold the entry's buffer: a
/// close that succeeded must still find its entry published).
#[test]
fn a_raw_entry_read_back_while_released_is_published() {
    let f = Fixture::new(64, Eviction::Off, 16 << 20);
    let root = me(0, 0);
    f.store.mkdir(&root, "ns", 0o755).unwrap();
    let fs = f.fs();
    let parent = f.ino(&root, "ns");
    let data = vec![0x5au8; 4 << 20];
    for i in 0..40 {
        let key = format!("k{i}");
        let ino = fs.create(&root, parent, &key, 0o644).unwrap().0.ino;
        for (j, chunk) in data.chunks(1 << 20).enumerate() {
            fs.write(ino, (j << 20) as u64, chunk).unwrap();
        }
        fs.commit(&root, ino, false).unwrap();
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = fs.read(ino, 0, 4 << 20);
                }
            });
            std::thread::sleep(std::time::Duration::from_millis(2));
            let sealed = fs.seal(ino);
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            assert!(sealed.is_ok(), "{key}: {sealed:?}");
        });
        assert_eq!(f.get("ns", &key).as_deref(), Some(&data[..]), "{key}");
        assert!(f.store.delete(&root, "ns", &[key]).unwrap()[0].is_ok());
    }
    f.store.check_invariants().unwrap();
}

/// On a memfs pool, a close of another descriptor of an entry being written (a commit) while
/// a write is on its way cuts none of that write's bytes: the entry published holds every
/// byte written.
#[test]
fn a_commit_during_a_write_cuts_none_of_its_bytes() {
    let f = Fixture::with_pools(&["memfs:{dir}/mem,size=256M"]);
    let _unmount = Unmount(f.store.clone());
    let root = me(0, 0);
    f.store.mkdir(&root, "ns", 0o755).unwrap();
    let fs = f.fs();
    let parent = f.ino(&root, "ns");
    let piece = 256 << 10;
    let data: Vec<u8> = (0..16 << 20).map(|i: u32| (i % 251) as u8 + 1).collect();
    for round in 0..4 {
        let key = format!("k{round}");
        let ino = fs.create(&root, parent, &key, 0o644).unwrap().0.ino;
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = fs.commit(&root, ino, false);
                }
            });
            for (j, chunk) in data.chunks(piece).enumerate() {
                fs.write(ino, (j * piece) as u64, chunk).unwrap();
            }
            done.store(true, std::sync::atomic::Ordering::Relaxed);
        });
        fs.commit(&root, ino, false).unwrap();
        fs.seal(ino).unwrap();
        let s = f.store.open_session("r", root.clone());
        let (loc, file) = f
            .store
            .retrieve(s, "ns", std::slice::from_ref(&key), |_| false)
            .unwrap()
            .pop()
            .unwrap()
            .expect("published");
        let mut got = vec![0u8; loc.size as usize];
        file.expect("its file").read_exact_at(&mut got, 0).unwrap();
        f.store.close_session(s);
        let first_bad = got.iter().zip(&data).position(|(a, b)| a != b);
        assert!(
            got.len() == data.len() && first_bad.is_none(),
            "{key}: {} bytes, first difference at {first_bad:?}",
            got.len()
        );
        assert!(f.store.delete(&root, "ns", &[key]).unwrap()[0].is_ok());
    }
}

/// A reader of a raw pool's entry through the mount (its bytes copied by the daemon, under a
/// lease) keeps valid bytes until it closes, though the entry is deleted meanwhile and
/// another read handle of it (its writer's read-back) is released first.
#[test]
fn a_mount_reader_s_lease_is_its_own() {
    let f = Fixture::new(16, Eviction::Off, 1 << 20);
    let root = me(0, 0);
    f.store.mkdir(&root, "ns", 0o755).unwrap();
    let fs = maru_fsd::fs::Fs::new(f.fs());
    let parent = f.ino(&root, "ns");
    let (attr, w, _) = fs.create(&root, parent, "k", 0o644).unwrap();
    fs.write(w, 0, &[7u8; 8192]).unwrap();
    // The writer's read-back handle, then its close and release: published.
    let (back, _) = fs.open(&root, attr.ino, false, false).unwrap();
    fs.flush(&root, w).unwrap();
    fs.release(w);
    // Another reader: its bytes are copied under a lease.
    let (r, opened) = fs.open(&root, attr.ino, false, false).unwrap();
    assert!(matches!(opened, maru_fsd::OpenedFile::Copy));
    fs.release(back);
    fs.unlink(&root, parent, "k").unwrap();
    assert_eq!(fs.read(r, 0, 8192).unwrap(), vec![7u8; 8192]);
    fs.release(r);
    f.store.check_invariants().unwrap();
}

/// A rename of a sealed entry whose pool cannot take it (its log refuses the record) leaves
/// the entry under its old name, held there at the authority (the store's invariants hold,
/// and the old name is not taken by another store).
#[test]
fn a_rename_the_pool_refuses_keeps_the_old_name_at_the_authority() {
    let (f, appends) = Fixture::with_failing_appends();
    let root = me(0, 0);
    for ns in ["a", "b"] {
        f.store.mkdir(&root, ns, 0o755).unwrap();
    }
    f.put(&root, "a", "k", &[3u8; 5000]).unwrap();
    let fs = f.fs();
    let (a, b) = (f.ino(&root, "a"), f.ino(&root, "b"));
    appends.store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(fs.rename(&root, a, "k", b, "k").is_err());
    appends.store(false, std::sync::atomic::Ordering::SeqCst);
    f.store.check_invariants().unwrap();
    assert_eq!(f.get("a", "k"), Some(vec![3u8; 5000]));
    assert!(
        f.put(&root, "a", "k", &[4u8; 10]).is_err(),
        "the name is taken"
    );
    assert_eq!(f.get("b", "k"), None);
}

/// A namespace's quota holds for a batch of publications (each counts the ones sealed before
/// it) and for a rename into it.
#[test]
fn a_quota_holds_for_a_batch_and_for_a_rename_into_it() {
    use maru_daemon::store::publishing::Publish;
    let f = Fixture::new(16, Eviction::Off, 1 << 20);
    let root = me(0, 0);
    for ns in ["q", "r"] {
        f.store.mkdir(&root, ns, 0o755).unwrap();
    }
    f.store.set_quota(&root, "q", Some(8192)).unwrap();
    let s = f.store.open_session("t", root.clone());
    let grants = f.store.alloc(s, 8192, 3, None, None).unwrap();
    let keys = ["a", "b", "c"];
    let items: Vec<Publish<'_>> = grants
        .iter()
        .zip(keys)
        .map(|((g, _), key)| Publish {
            id: g.alloc,
            ns: "q",
            key,
            len: None,
        })
        .collect();
    let out = f.store.publish_many(s, &items);
    assert_eq!(out.iter().filter(|r| r.is_ok()).count(), 1, "{out:?}");
    assert!(
        out.iter().any(|r| matches!(r, Err(Error::Quota(_)))),
        "{out:?}"
    );
    f.store.close_session(s);
    // A rename into the full namespace: refused, the entry where it was.
    f.put(&root, "r", "big", &[1u8; 4096]).unwrap();
    let fs = f.fs();
    let (q, r) = (f.ino(&root, "q"), f.ino(&root, "r"));
    let moved = fs.rename(&root, r, "big", q, "big");
    assert!(matches!(moved, Err(Error::Quota(_))), "{moved:?}");
    assert_eq!(f.get("r", "big"), Some(vec![1u8; 4096]));
    f.store.check_invariants().unwrap();
}

/// With the pool's log synced at each record, a failed sync fails the publications of a
/// batch store over the socket (marud gathers them into one exchange with the store), as it
/// fails a single verb's: none is answered as stored.
#[test]
fn with_the_log_synced_a_failed_sync_fails_a_batch_over_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let store = Fixture::open(dir.path(), 16, Eviction::Off, 1 << 20, true);
    let [armed, _] = Faulty::install(&store, dir.path(), maru_daemon::wal::Durability::EachRecord);
    store.mkdir(&me(0, 0), "ns", 0o755).unwrap();
    let socket = dir.path().join("marud.sock");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let listener = {
        let _in = rt.enter();
        tokio::net::UnixListener::bind(&socket).unwrap()
    };
    rt.spawn(maru_daemon::server::serve(store.clone(), listener, 4096));
    let h = maru::Handler::connect(maru::Config {
        socket: socket.clone(),
        ..Default::default()
    })
    .unwrap();
    let items = |prefix: &str| -> Vec<(String, maru::AllocHandle)> {
        (0..3)
            .map(|i| {
                let mut a = h.alloc(4096).unwrap();
                a.as_mut_slice().fill(i as u8);
                (format!("ns/{prefix}{i}"), a)
            })
            .collect()
    };
    let before = items("synced");
    assert!(h.batch_store(before).unwrap().iter().all(Result::is_ok));
    let after = items("lost");
    armed.store(true, std::sync::atomic::Ordering::SeqCst);
    let out = h.batch_store(after);
    let stored = out
        .as_ref()
        .map_or(0, |v| v.iter().filter(|r| r.is_ok()).count());
    assert_eq!(
        stored, 0,
        "answered as stored with their records unsynced: {out:?}"
    );
    drop(h);
    drop(rt);
}
