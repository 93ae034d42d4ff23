//! The store engine: namespaces, entries, allocations, sessions, eviction and
//! persistence over a set of pools. One lock guards the metadata; the bytes
//! live in the pools and move without the daemon (clients map them).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use maru::index::{FLAG_PINNED, SlotView};
use maru::name::{check_component, split_ns};
use maru::proto::{ClientInfo, Grant, Located, NsInfo, PoolInfo, PoolKind, Stats};
use maru::{Error, Result};
use maru_fsd::Upcall;
use maru_fsd::backend::ROOT_INO;
use maru_fsd::{Attr, Caller, DirEntry, Kind, OpenedFile, Xattr};
use parking_lot::Mutex;

use crate::alloc::{ExtentAlloc, align_up};
use crate::nsindex::NsIndex;
use crate::pool::{self, ENTRY_ALIGN, MemfsPool, PoolSpec, REGION_ALIGN};
use crate::wal::{self, FileSink, LogSink, Record, Wal};

/// What to do when a pool is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Eviction {
    /// Evict least recently used sealed, unpinned entries.
    Lru,
    /// Fail with ENOSPC.
    Off,
}

/// Store settings.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Eviction policy.
    pub eviction: Eviction,
    /// Where namespaces and raw pool logs are kept.
    pub state_dir: PathBuf,
    /// fsync the raw pool log after each record (power-loss safety; slower).
    pub wal_sync: bool,
    /// Largest entry written through the mount into a raw pool (buffered by the daemon).
    pub max_copy_entry: u64,
}

/// Per key of a retrieve: where the entry is and the descriptor to send (if any).
pub type Retrieved = Vec<Option<(Located, Option<File>)>>;

/// Hook for the mount: names the kernel must forget (from any thread, asynchronously).
pub type InvalidateFn = Box<dyn Fn(Invalidation) + Send + Sync>;

/// A name removed behind the kernel's back.
#[derive(Debug, Clone)]
pub struct Invalidation {
    /// Parent directory inode.
    pub parent: u64,
    /// Name in it.
    pub name: String,
    /// The removed node.
    pub ino: u64,
    /// The kernel removed the name itself (unlink through the mount): only the node's
    /// passthrough backing is to be dropped, the name needs no invalidation.
    pub by_kernel: bool,
}

/// A pool, fixed for the daemon's life.
pub struct Pool {
    /// Index in the store's list.
    pub id: u32,
    /// Name.
    pub name: String,
    /// Kind.
    pub kind: PoolKind,
    /// Path.
    pub path: PathBuf,
    /// Bytes usable for entries.
    pub capacity: u64,
    /// The implementation.
    pub imp: PoolImpl,
}

/// Kind-specific part of a pool.
pub enum PoolImpl {
    /// A memfs directory.
    Memfs(MemfsPool),
    /// A raw device or file.
    Raw(RawPool),
}

/// A raw pool's device.
pub struct RawPool {
    /// The daemon's own descriptor; it holds the device lock (`maructl device` checks it).
    pub file: File,
    /// Read-write descriptor handed to writers: a separate open file description, so that
    /// clients' mappings never keep the daemon's lock alive after it exits.
    pub rw: File,
    /// Read-only descriptor (retrievals).
    pub ro: File,
    /// Header.
    pub header: pool::DevHeader,
}

#[derive(Debug, Clone)]
struct Region {
    len: u64,
    owner: Option<u64>,
    /// Next free byte (relative) for the owner's bump allocation.
    bump: u64,
    /// Live entries and allocations inside.
    live: u32,
}

#[derive(Default)]
struct PoolState {
    extents: Option<ExtentAlloc>,
    regions: BTreeMap<u64, Region>,
    wal: Option<Wal>,
    sealed_bytes: u64,
    entries: u64,
    writing_bytes: u64,
    evictions: u64,
}

#[derive(Debug, Clone)]
struct Entry {
    ino: u64,
    ns: String,
    key: String,
    pool: u32,
    offset: u64,
    size: u64,
    asize: u64,
    pinned: bool,
    /// Last use (the store's clock).
    tick: u64,
    /// The key this entry is filed under in `State::lru`: its `tick` when last filed. A use
    /// only moves `tick`; eviction re-files entries whose key fell behind (see
    /// [`State::settle_lru`]), so the hot path of a retrieval never reorders the tree.
    lru_key: u64,
    slot: usize,
    owner: Option<u64>,
    leases: u32,
    uid: u32,
    gid: u32,
    mode: u32,
    mtime: SystemTime,
}

struct Alloc {
    pool: u32,
    offset: u64,
    size: u64,
    session: Option<u64>,
    /// memfs: the writing file.
    file: Option<Arc<File>>,
    /// raw, written through the mount: bytes buffered until sealed.
    buf: Option<Vec<u8>>,
    /// Through the mount: where it will be published.
    target: Option<(String, String)>,
    uid: u32,
    gid: u32,
    mode: u32,
    mtime: SystemTime,
    /// Bytes counted in the pool's `writing_bytes`.
    acct: u64,
    /// Through the mount: the creating process (the only one that sees it before sealing).
    tgid: i32,
    /// Through the mount: a writable descriptor was closed; publication is imminent.
    closing: bool,
}

struct Namespace {
    ino: u64,
    uid: u32,
    gid: u32,
    mode: u32,
    entries: HashMap<String, u64>,
    children: HashMap<String, u64>,
    writing: HashMap<String, u64>,
    index: NsIndex,
    bytes: u64,
    mtime: SystemTime,
    /// Entries written through the mount whose writer closed them (publication imminent).
    pending: u64,
    /// Most bytes of sealed entries in it and the namespaces under it.
    quota: Option<u64>,
}

#[derive(Default)]
struct Session {
    name: String,
    caller: Option<Caller>,
    allocs: HashSet<u64>,
    leases: HashMap<u64, u32>,
    /// (pool, region offset) of the open region per raw pool.
    regions: HashMap<u32, u64>,
    used: u64,
}

struct State {
    next_ino: u64,
    tick: u64,
    ns: HashMap<String, Namespace>,
    ns_by_ino: HashMap<u64, String>,
    entries: HashMap<u64, Entry>,
    zombies: HashMap<u64, Entry>,
    allocs: HashMap<u64, Alloc>,
    lru: BTreeMap<u64, u64>,
    sessions: HashMap<u64, Session>,
    next_session: u64,
    pools: Vec<PoolState>,
    ops: BTreeMap<String, u64>,
    /// Attributes of recently removed entries (for handles still open on them).
    gone: HashMap<u64, Attr>,
    /// Leases held by handles of the mount (raw pools).
    fuse_leases: HashMap<u64, u32>,
    /// Bytes by kind (stored, retrieved, deleted, evicted).
    bytes: BTreeMap<String, u64>,
    /// Latency histograms and sums (µs) of control operations.
    latency: BTreeMap<String, (Vec<u64>, u64)>,
}

/// Session of the mount's own allocations (never closed).
pub const MOUNT_SESSION: u64 = 0;

/// The store.
pub struct Store {
    cfg: StoreConfig,
    pools: Vec<Pool>,
    st: Mutex<State>,
    invalidate: Mutex<Option<Arc<InvalidateFn>>>,
    started: std::time::Instant,
    /// Signalled when an entry written through the mount is sealed or dropped.
    sealed: parking_lot::Condvar,
    /// Upcalls of the mount by operation: apart from `st`, which they need not wait for.
    fuse_ops: [std::sync::atomic::AtomicU64; Upcall::ALL.len()],
}

#[derive(serde::Serialize, serde::Deserialize)]
struct NsRecord {
    ns: String,
    uid: u32,
    gid: u32,
    mode: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    quota: Option<u64>,
}

/// Bytes of sealed entries in `ns` and the namespaces under it.
fn subtree_bytes(st: &State, ns: &str) -> u64 {
    let prefix = format!("{ns}/");
    st.ns
        .iter()
        .filter(|(k, _)| *k == ns || k.starts_with(&prefix))
        .map(|(_, n)| n.bytes)
        .sum()
}

/// Fails with [`Error::Quota`] if `add` more bytes in `ns` would exceed the quota of `ns` or of
/// a namespace above it.
fn check_quota(st: &State, ns: &str, add: u64) -> Result<()> {
    let mut at = Some(ns);
    while let Some(a) = at {
        if let Some(q) = st.ns.get(a).and_then(|n| n.quota) {
            let used = subtree_bytes(st, a);
            if used.saturating_add(add) > q {
                return Err(Error::Quota(format!(
                    "`{a}` holds {} of its {} quota; {} more do not fit",
                    maru::size::format_size(used),
                    maru::size::format_size(q),
                    maru::size::format_size(add)
                )));
            }
        }
        at = a.rfind('/').map(|i| &a[..i]);
    }
    Ok(())
}

fn now() -> SystemTime {
    SystemTime::now()
}

fn ns_parent(ns: &str) -> (&str, &str) {
    match ns.rsplit_once('/') {
        Some((p, n)) => (p, n),
        None => ("", ns),
    }
}

fn join(ns: &str, name: &str) -> String {
    if ns.is_empty() {
        name.to_owned()
    } else {
        format!("{ns}/{name}")
    }
}

/// A namespace's permission check.
fn check(c: &Caller, n: &Namespace, want: u32, what: &str) -> Result<()> {
    if c.may(n.uid, n.gid, n.mode, want) {
        Ok(())
    } else {
        Err(Error::PermissionDenied(what.to_owned()))
    }
}

impl Store {
    /// Opens every pool, recovers their entries and the namespaces.
    pub fn open(cfg: StoreConfig, specs: &[PoolSpec]) -> anyhow::Result<Arc<Self>> {
        use anyhow::Context;
        std::fs::create_dir_all(&cfg.state_dir)
            .with_context(|| format!("creating state dir {}", cfg.state_dir.display()))?;
        let mut pools = Vec::new();
        let mut names = HashSet::new();
        for (i, spec) in specs.iter().enumerate() {
            if !names.insert(spec.name.clone()) {
                anyhow::bail!("two pools are named `{}`", spec.name);
            }
            let (imp, capacity) = match spec.kind {
                PoolKind::Memfs => {
                    let m = MemfsPool::open(spec)?;
                    let cap = m.capacity;
                    (PoolImpl::Memfs(m), cap)
                }
                _ => {
                    let (file, cap) = pool::open_raw(spec)?;
                    let header = match pool::read_header(&file)? {
                        Some(h) => h,
                        None => {
                            let h = pool::init_header(&file)?;
                            tracing::info!(pool = %spec.name, uuid = %h.uuid_string(), "initialized the device header");
                            h
                        }
                    };
                    let ro = std::fs::OpenOptions::new()
                        .read(true)
                        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))?;
                    let rw = std::fs::OpenOptions::new()
                        .read(true)
                        .write(true)
                        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))?;
                    (
                        PoolImpl::Raw(RawPool {
                            file,
                            rw,
                            ro,
                            header,
                        }),
                        cap,
                    )
                }
            };
            pools.push(Pool {
                id: i as u32,
                name: spec.name.clone(),
                kind: spec.kind,
                path: spec.path.clone(),
                capacity,
                imp,
            });
        }
        let root = Namespace {
            ino: ROOT_INO,
            uid: 0,
            gid: 0,
            mode: 0o1777,
            entries: HashMap::new(),
            children: HashMap::new(),
            writing: HashMap::new(),
            index: NsIndex::new(16)?,
            bytes: 0,
            mtime: now(),
            pending: 0,
            quota: None,
        };
        let mut st = State {
            next_ino: ROOT_INO + 1,
            tick: 0,
            ns: HashMap::from([(String::new(), root)]),
            ns_by_ino: HashMap::from([(ROOT_INO, String::new())]),
            entries: HashMap::new(),
            zombies: HashMap::new(),
            allocs: HashMap::new(),
            lru: BTreeMap::new(),
            sessions: HashMap::new(),
            next_session: 1,
            pools: pools.iter().map(|_| PoolState::default()).collect(),
            ops: BTreeMap::new(),
            gone: HashMap::new(),
            fuse_leases: HashMap::new(),
            bytes: BTreeMap::new(),
            latency: BTreeMap::new(),
        };
        st.sessions.insert(
            MOUNT_SESSION,
            Session {
                name: "mount".into(),
                caller: Some(Caller::root()),
                ..Default::default()
            },
        );
        let store = Store {
            cfg,
            pools,
            st: Mutex::new(State {
                next_ino: 0,
                tick: 0,
                ns: HashMap::new(),
                ns_by_ino: HashMap::new(),
                entries: HashMap::new(),
                zombies: HashMap::new(),
                allocs: HashMap::new(),
                lru: BTreeMap::new(),
                sessions: HashMap::new(),
                next_session: 0,
                pools: Vec::new(),
                ops: BTreeMap::new(),
                gone: HashMap::new(),
                fuse_leases: HashMap::new(),
                bytes: BTreeMap::new(),
                latency: BTreeMap::new(),
            }),
            invalidate: Mutex::new(None),
            started: std::time::Instant::now(),
            sealed: parking_lot::Condvar::new(),
            fuse_ops: std::array::from_fn(|_| std::sync::atomic::AtomicU64::new(0)),
        };
        store.recover(&mut st)?;
        *store.st.lock() = st;
        Ok(Arc::new(store))
    }

    fn ns_file(&self) -> PathBuf {
        self.cfg.state_dir.join("namespaces.json")
    }

    fn wal_path(&self, p: &RawPool) -> PathBuf {
        self.cfg
            .state_dir
            .join(format!("pool-{}.wal", p.header.uuid_string()))
    }

    fn recover(&self, st: &mut State) -> anyhow::Result<()> {
        // Namespaces first.
        let mut records: Vec<NsRecord> = match std::fs::read(self.ns_file()) {
            Ok(b) => serde_json::from_slice(&b).unwrap_or_else(|e| {
                tracing::warn!("ignoring unreadable namespaces.json: {e}");
                Vec::new()
            }),
            Err(_) => Vec::new(),
        };
        records.sort_by_key(|r| r.ns.matches('/').count());
        for r in records {
            if split_ns(&r.ns).is_ok() {
                self.ns_insert(st, &r.ns, r.uid, r.gid, r.mode)?;
                if let Some(n) = st.ns.get_mut(&r.ns) {
                    n.quota = r.quota;
                }
            }
        }
        for p in &self.pools {
            match &p.imp {
                PoolImpl::Memfs(m) => {
                    let (dirs, found) = m.scan()?;
                    for d in dirs {
                        self.ensure_ns_path(st, &d)?;
                    }
                    for f in found {
                        if check_component(f.key.as_bytes()).is_err() {
                            continue;
                        }
                        self.ensure_ns_path(st, &f.ns)?;
                        if st.ns[&f.ns].entries.contains_key(&f.key) {
                            tracing::warn!(ns = %f.ns, key = %f.key, "duplicate key across pools; keeping the first");
                            continue;
                        }
                        use std::os::unix::fs::MetadataExt;
                        let md = std::fs::metadata(m.entry_path(&f.ns, &f.key))?;
                        let ino = st.alloc_ino();
                        let e = Entry {
                            ino,
                            ns: f.ns.clone(),
                            key: f.key.clone(),
                            pool: p.id,
                            offset: 0,
                            size: f.size,
                            asize: align_up(f.size.max(1), ENTRY_ALIGN),
                            pinned: f.pinned,
                            tick: 0,
                            lru_key: 0,
                            slot: 0,
                            owner: None,
                            leases: 0,
                            uid: md.uid(),
                            gid: md.gid(),
                            mode: md.mode() & 0o555,
                            mtime: md.modified().unwrap_or_else(|_| now()),
                        };
                        self.insert_entry(st, e);
                    }
                }
                PoolImpl::Raw(r) => {
                    let path = self.wal_path(r);
                    let live = wal::replay(wal::read_log(&path)?);
                    let ps = &mut st.pools[p.id as usize];
                    ps.extents = Some(ExtentAlloc::new(REGION_ALIGN, p.capacity));
                    let mut entries = Vec::new();
                    for (_, rec) in live {
                        let Record::Seal {
                            ns,
                            key,
                            off,
                            size,
                            asize,
                            pin,
                            uid,
                            gid,
                        } = rec
                        else {
                            continue;
                        };
                        if off < REGION_ALIGN || off + asize > p.capacity {
                            tracing::warn!(off, "log entry outside the pool; dropped");
                            continue;
                        }
                        entries.push((ns, key, off, size, asize, pin, uid, gid));
                    }
                    // Regions: maximal runs of 2 MiB units covered by entries.
                    let mut units: BTreeMap<u64, u32> = BTreeMap::new();
                    for e in &entries {
                        let s = e.2 / REGION_ALIGN * REGION_ALIGN;
                        let end = align_up(e.2 + e.4, REGION_ALIGN);
                        let mut u = s;
                        while u < end {
                            units.entry(u).or_insert(0);
                            u += REGION_ALIGN;
                        }
                        *units.get_mut(&s).expect("inserted") += 1;
                    }
                    let mut runs: Vec<(u64, u64, u32)> = Vec::new();
                    for (u, n) in units {
                        match runs.last_mut() {
                            Some((s, l, c)) if *s + *l == u => {
                                *l += REGION_ALIGN;
                                *c += n;
                            }
                            _ => runs.push((u, REGION_ALIGN, n)),
                        }
                    }
                    for (s, l, c) in runs {
                        let ps = &mut st.pools[p.id as usize];
                        ps.extents.as_mut().expect("set").reserve(s, l);
                        ps.regions.insert(
                            s,
                            Region {
                                len: l,
                                owner: None,
                                bump: l,
                                live: c,
                            },
                        );
                    }
                    let mut ok = Vec::new();
                    for (ns, key, off, size, asize, pin, uid, gid) in entries {
                        if split_ns(&ns).is_err() || check_component(key.as_bytes()).is_err() {
                            continue;
                        }
                        self.ensure_ns_path(st, &ns)?;
                        if st.ns[&ns].entries.contains_key(&key) {
                            continue;
                        }
                        let ino = st.alloc_ino();
                        ok.push(Record::Seal {
                            ns: ns.clone(),
                            key: key.clone(),
                            off,
                            size,
                            asize,
                            pin,
                            uid,
                            gid,
                        });
                        self.insert_entry(
                            st,
                            Entry {
                                ino,
                                ns,
                                key,
                                pool: p.id,
                                offset: off,
                                size,
                                asize,
                                pinned: pin,
                                tick: 0,
                                lru_key: 0,
                                slot: 0,
                                owner: None,
                                leases: 0,
                                uid,
                                gid,
                                mode: 0o444,
                                mtime: now(),
                            },
                        );
                    }
                    // Region live counts must match the entries actually restored.
                    let ps = &mut st.pools[p.id as usize];
                    for r in ps.regions.values_mut() {
                        r.live = 0;
                    }
                    for e in st.entries.values().filter(|e| e.pool == p.id) {
                        if let Some((_, r)) = ps.regions.range_mut(..=e.offset).next_back() {
                            r.live += 1;
                        }
                    }
                    let empty: Vec<u64> = ps
                        .regions
                        .iter()
                        .filter(|(_, r)| r.live == 0)
                        .map(|(o, _)| *o)
                        .collect();
                    for o in empty {
                        let r = ps.regions.remove(&o).expect("present");
                        ps.extents.as_mut().expect("set").free(o, r.len);
                    }
                    let sink = FileSink::open(&path, self.cfg.wal_sync)?;
                    let mut w = Wal::new(Box::new(sink));
                    w.checkpoint(&ok)?;
                    st.pools[p.id as usize].wal = Some(w);
                }
            }
        }
        self.save_namespaces(st);
        let n = st.entries.len();
        tracing::info!(entries = n, namespaces = st.ns.len() - 1, "store recovered");
        Ok(())
    }

    /// Replaces the log sink of raw pool `pool` (crash-injection tests).
    pub fn set_log_sink(&self, pool: u32, sink: Box<dyn LogSink>) {
        self.st.lock().pools[pool as usize].wal = Some(Wal::new(sink));
    }

    /// Installs the crash-injection seam of a memfs pool's metadata steps (tests).
    pub fn set_memfs_gate(&self, pool: u32, gate: Option<crate::pool::MetaGate>) {
        if let PoolImpl::Memfs(m) = &self.pools[pool as usize].imp {
            m.set_gate(gate);
        }
    }

    /// Registers the mount's invalidation hook.
    pub fn set_invalidate(&self, f: Option<InvalidateFn>) {
        *self.invalidate.lock() = f.map(Arc::new);
    }

    fn notify(&self, inv: Vec<Invalidation>) {
        if inv.is_empty() {
            return;
        }
        let f = self.invalidate.lock().clone();
        if let Some(f) = f {
            for i in inv {
                f(i);
            }
        }
    }

    fn ns_insert(&self, st: &mut State, ns: &str, uid: u32, gid: u32, mode: u32) -> Result<u64> {
        let (parent, name) = ns_parent(ns);
        if !st.ns.contains_key(parent) {
            return Err(Error::NotFound(format!("namespace `{parent}`")));
        }
        let ino = st.alloc_ino();
        st.ns.insert(
            ns.to_owned(),
            Namespace {
                ino,
                uid,
                gid,
                mode: mode & 0o7777,
                entries: HashMap::new(),
                children: HashMap::new(),
                writing: HashMap::new(),
                index: NsIndex::new(0)?,
                bytes: 0,
                mtime: now(),
                pending: 0,
                quota: None,
            },
        );
        st.ns_by_ino.insert(ino, ns.to_owned());
        let p = st.ns.get_mut(parent).expect("checked");
        p.children.insert(name.to_owned(), ino);
        p.mtime = now();
        Ok(ino)
    }

    fn ensure_ns_path(&self, st: &mut State, ns: &str) -> Result<()> {
        let mut cur = String::new();
        for part in ns.split('/') {
            cur = join(&cur, part);
            if !st.ns.contains_key(&cur) {
                self.ns_insert(st, &cur, 0, 0, 0o755)?;
            }
        }
        Ok(())
    }

    fn save_namespaces(&self, st: &State) {
        let mut recs: Vec<NsRecord> = st
            .ns
            .iter()
            .filter(|(k, _)| !k.is_empty())
            .map(|(k, n)| NsRecord {
                ns: k.clone(),
                uid: n.uid,
                gid: n.gid,
                mode: n.mode,
                quota: n.quota,
            })
            .collect();
        recs.sort_by(|a, b| a.ns.cmp(&b.ns));
        let path = self.ns_file();
        let tmp = path.with_extension("json.tmp");
        let r = (|| -> io::Result<()> {
            std::fs::write(&tmp, serde_json::to_vec_pretty(&recs)?)?;
            std::fs::rename(&tmp, &path)
        })();
        if let Err(e) = r {
            tracing::error!("saving namespaces: {e}");
        }
    }

    fn insert_entry(&self, st: &mut State, mut e: Entry) {
        st.tick += 1;
        e.tick = st.tick;
        e.lru_key = e.tick;
        let view = slot_view(&e);
        let n = st.ns.get_mut(&e.ns).expect("namespace exists");
        if n.index.needs_rebuild() {
            for (ino, slot) in Self::rebuild_index(n, &st.entries) {
                st.entries.get_mut(&ino).expect("indexed").slot = slot;
            }
        }
        let n = st.ns.get_mut(&e.ns).expect("namespace exists");
        e.slot = n
            .index
            .insert(&e.key, view)
            .expect("index has room after rebuild");
        n.entries.insert(e.key.clone(), e.ino);
        n.bytes += e.size;
        n.mtime = now();
        let ps = &mut st.pools[e.pool as usize];
        ps.sealed_bytes += e.asize;
        ps.entries += 1;
        st.lru.insert(e.tick, e.ino);
        st.entries.insert(e.ino, e);
    }

    /// Rebuilds a namespace's index into a fresh, larger table. Returns the new slot of
    /// every entry of the namespace.
    fn rebuild_index(n: &mut Namespace, entries: &HashMap<u64, Entry>) -> Vec<(u64, usize)> {
        let want = (n.entries.len() + 1) * 4;
        let mut ix = match NsIndex::new(want) {
            Ok(ix) => ix,
            Err(e) => {
                tracing::error!("cannot grow a namespace index: {e}");
                return Vec::new();
            }
        };
        let mut slots = Vec::new();
        for ino in n.entries.values() {
            let e = &entries[ino];
            let s = ix
                .insert(&e.key, slot_view(e))
                .expect("fresh table has room");
            slots.push((e.ino, s));
        }
        ix.set_pending(n.pending);
        n.index.retire();
        n.index = ix;
        slots
    }

    /// Removes a sealed entry from the namespace and index; frees its space unless leased.
    fn remove_entry(&self, st: &mut State, ino: u64, evicted: bool) -> Option<Invalidation> {
        let e = st.entries.remove(&ino)?;
        st.lru.remove(&e.lru_key);
        if st.gone.len() > 4096 {
            st.gone.clear();
        }
        st.gone.insert(ino, entry_attr(&e));
        let n = st.ns.get_mut(&e.ns).expect("namespace exists");
        n.entries.remove(&e.key);
        n.index.remove(e.slot);
        n.bytes -= e.size;
        n.mtime = now();
        let parent = n.ino;
        if let Some(s) = e.owner.and_then(|o| st.sessions.get_mut(&o)) {
            s.used = s.used.saturating_sub(e.size);
        }
        *st.bytes
            .entry(if evicted { "evicted" } else { "deleted" }.into())
            .or_insert(0) += e.size;
        let ps = &mut st.pools[e.pool as usize];
        ps.sealed_bytes -= e.asize;
        ps.entries -= 1;
        if evicted {
            ps.evictions += 1;
        }
        let pool = &self.pools[e.pool as usize];
        match &pool.imp {
            PoolImpl::Memfs(m) => {
                if let Err(err) = m.delete(&e.ns, &e.key) {
                    tracing::warn!(ns = %e.ns, key = %e.key, "removing backing file: {err}");
                }
            }
            PoolImpl::Raw(_) => {
                if let Some(w) = ps.wal.as_mut()
                    && let Err(err) = w.append(&Record::Del { off: e.offset })
                {
                    tracing::error!("pool log: {err}");
                }
                if e.leases == 0 {
                    Self::release_extent(ps, e.offset);
                } else {
                    st.zombies.insert(e.ino, e.clone());
                }
            }
        }
        Some(Invalidation {
            parent,
            name: e.key,
            ino,
            by_kernel: false,
        })
    }

    /// One entry or allocation inside a raw region went away.
    fn release_extent(ps: &mut PoolState, offset: u64) {
        let Some((&roff, r)) = ps.regions.range_mut(..=offset).next_back() else {
            return;
        };
        r.live = r.live.saturating_sub(1);
        if r.live == 0 {
            if r.owner.is_some() {
                r.bump = 0;
            } else {
                let len = r.len;
                ps.regions.remove(&roff);
                if let Some(x) = ps.extents.as_mut() {
                    x.free(roff, len);
                }
            }
        }
    }

    fn pool_by_name(&self, name: &str) -> Result<u32> {
        self.pools
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.id)
            .ok_or_else(|| Error::InvalidArgument(format!("no pool named `{name}`")))
    }

    /// Pools in placement order: the requested one, or all in command-line order.
    fn placement(&self, hint: Option<u32>) -> Vec<u32> {
        match hint {
            Some(p) => vec![p],
            None => self.pools.iter().map(|p| p.id).collect(),
        }
    }

    fn free_space(&self, st: &State, pool: u32) -> u64 {
        let p = &self.pools[pool as usize];
        match &p.imp {
            PoolImpl::Memfs(m) => m.space().map(|x| x.1).unwrap_or(0),
            PoolImpl::Raw(_) => st.pools[pool as usize]
                .extents
                .as_ref()
                .map(|x| x.free_bytes())
                .unwrap_or(0),
        }
    }

    /// Evicts LRU entries of `pool` (any pool when `None`) until `want` bytes were freed.
    fn evict_lru(
        &self,
        st: &mut State,
        pool: Option<u32>,
        want: u64,
    ) -> (u64, u64, Vec<Invalidation>) {
        let mut freed = 0;
        let mut count = 0;
        let mut inv = Vec::new();
        st.settle_lru();
        let candidates: Vec<u64> = st
            .lru
            .values()
            .copied()
            .filter(|ino| {
                let e = &st.entries[ino];
                !e.pinned && e.leases == 0 && pool.is_none_or(|p| p == e.pool)
            })
            .collect();
        for ino in candidates {
            if freed >= want {
                break;
            }
            let asize = st.entries[&ino].asize;
            if let Some(i) = self.remove_entry(st, ino, true) {
                freed += asize;
                count += 1;
                inv.push(i);
            }
        }
        (count, freed, inv)
    }

    /// Free space kept in a memfs pool for writers through the mount when eviction is on:
    /// a sixteenth of the pool, at least 64 MiB, at most a quarter of the pool.
    fn mount_headroom(&self, pool: u32) -> u64 {
        let cap = self.pools[pool as usize].capacity;
        (cap / 16).max(64 << 20).min(cap / 4)
    }

    /// Evicts least-recently-used entries of `pool` until its free space is at least
    /// [`Store::mount_headroom`] (with eviction on; nothing otherwise).
    fn keep_headroom(&self, st: &mut State, pool: u32, inv: &mut Vec<Invalidation>) {
        self.ensure_free(st, pool, self.mount_headroom(pool), inv);
    }

    /// Evicts least-recently-used entries of `pool` until `want` bytes are free (with eviction
    /// on; nothing otherwise).
    fn ensure_free(&self, st: &mut State, pool: u32, want: u64, inv: &mut Vec<Invalidation>) {
        if self.cfg.eviction != Eviction::Lru {
            return;
        }
        let want = want.min(self.pools[pool as usize].capacity);
        for _round in 0..32 {
            let free = self.free_space(st, pool);
            if free >= want {
                return;
            }
            let (n, _, i) = self.evict_lru(st, Some(pool), want - free + ENTRY_ALIGN);
            inv.extend(i);
            if n == 0 {
                return;
            }
        }
    }

    /// Reserves `size` bytes in a pool, evicting if allowed.
    fn place(
        &self,
        st: &mut State,
        session: Option<u64>,
        id: u64,
        size: u64,
        hint: Option<u32>,
        inv: &mut Vec<Invalidation>,
    ) -> Result<(u32, u64, Option<File>)> {
        let order = self.placement(hint);
        if order.is_empty() {
            return Err(Error::NoSpace("no pool can hold entries".into()));
        }
        if let Some(p) = order
            .iter()
            .find(|p| size <= self.pools[**p as usize].capacity)
            .copied()
        {
            // First pass: no eviction.
            for &p in &order {
                if let Ok(r) = self.try_place(st, session, id, p, size) {
                    return Ok(r);
                }
            }
            if self.cfg.eviction == Eviction::Lru {
                // Evict what is missing plus some headroom: memory of evicted entries that a
                // client still maps is freed only when it unmaps, so a round may free less than
                // it evicted; keep going while there is something to evict.
                let headroom = (self.pools[p as usize].capacity / 64).max(size);
                for _round in 0..32 {
                    let free = self.free_space(st, p);
                    let deficit = size.saturating_sub(free).max(ENTRY_ALIGN) + headroom;
                    let (n, _, i) = self.evict_lru(st, Some(p), deficit);
                    inv.extend(i);
                    match self.try_place(st, session, id, p, size) {
                        Ok(r) => return Ok(r),
                        Err(Error::NoSpace(_)) if n > 0 => continue,
                        Err(e) => return Err(e),
                    }
                }
            }
        }
        Err(Error::NoSpace(format!(
            "no pool has {} free{}",
            maru::size::format_size(size),
            if self.cfg.eviction == Eviction::Off {
                " (eviction is off)"
            } else {
                ""
            }
        )))
    }

    fn try_place(
        &self,
        st: &mut State,
        session: Option<u64>,
        id: u64,
        p: u32,
        size: u64,
    ) -> Result<(u32, u64, Option<File>)> {
        let pool = &self.pools[p as usize];
        match &pool.imp {
            PoolImpl::Memfs(m) => {
                let f = m.create_writing(id, size, 0o444)?;
                Ok((p, 0, Some(f)))
            }
            PoolImpl::Raw(_) => {
                let asize = align_up(size, ENTRY_ALIGN);
                let ps = &mut st.pools[p as usize];
                // The session's open region first.
                if let Some(s) = session
                    && let Some(&roff) = st.sessions.get(&s).and_then(|x| x.regions.get(&p))
                    && let Some(r) = ps.regions.get_mut(&roff)
                    && r.bump + asize <= r.len
                {
                    let off = roff + r.bump;
                    r.bump += asize;
                    r.live += 1;
                    return Ok((p, off, None));
                }
                let rlen = align_up(asize, REGION_ALIGN);
                let roff = ps
                    .extents
                    .as_mut()
                    .and_then(|x| x.alloc(rlen, REGION_ALIGN))
                    .ok_or_else(|| Error::NoSpace(format!("pool {} is full", pool.name)))?;
                ps.regions.insert(
                    roff,
                    Region {
                        len: rlen,
                        owner: session,
                        bump: asize,
                        live: 1,
                    },
                );
                if let Some(s) = session.and_then(|s| st.sessions.get_mut(&s)) {
                    let old = s.regions.insert(p, roff);
                    if let Some(o) = old {
                        Self::detach_region(&mut st.pools[p as usize], o);
                    }
                }
                Ok((p, roff, None))
            }
        }
    }

    /// The owner leaves a region: it is freed once empty.
    fn detach_region(ps: &mut PoolState, roff: u64) {
        if let Some(r) = ps.regions.get_mut(&roff) {
            r.owner = None;
            r.bump = r.len;
            if r.live == 0 {
                let len = r.len;
                ps.regions.remove(&roff);
                if let Some(x) = ps.extents.as_mut() {
                    x.free(roff, len);
                }
            }
        }
    }

    // ----- sessions -----

    /// Registers a client connection.
    pub fn open_session(&self, name: &str, caller: Caller) -> u64 {
        let mut st = self.st.lock();
        let id = st.next_session.max(MOUNT_SESSION + 1);
        st.next_session = id + 1;
        st.sessions.insert(
            id,
            Session {
                name: name.to_owned(),
                caller: Some(caller),
                ..Default::default()
            },
        );
        id
    }

    /// A client went away: abort its allocations, drop its leases and regions.
    pub fn close_session(&self, id: u64) {
        if id == MOUNT_SESSION {
            return;
        }
        let mut st = self.st.lock();
        let Some(s) = st.sessions.remove(&id) else {
            return;
        };
        for a in s.allocs {
            self.drop_alloc(&mut st, a);
        }
        for (ino, n) in s.leases {
            Self::unlease(&mut st, ino, n);
        }
        for (p, roff) in s.regions {
            Self::detach_region(&mut st.pools[p as usize], roff);
        }
        for e in st.entries.values_mut() {
            if e.owner == Some(id) {
                e.owner = None;
            }
        }
    }

    fn unlease(st: &mut State, ino: u64, n: u32) {
        if let Some(e) = st.entries.get_mut(&ino) {
            e.leases = e.leases.saturating_sub(n);
        } else if let Some(z) = st.zombies.get_mut(&ino) {
            z.leases = z.leases.saturating_sub(n);
            if z.leases == 0 {
                let z = st.zombies.remove(&ino).expect("present");
                Self::release_extent(&mut st.pools[z.pool as usize], z.offset);
            }
        }
    }

    fn drop_alloc(&self, st: &mut State, id: u64) {
        let Some(a) = st.allocs.remove(&id) else {
            return;
        };
        if a.closing {
            adjust_pending(st, &a.target, -1);
        }
        let ps = &mut st.pools[a.pool as usize];
        ps.writing_bytes -= a.acct;
        match &self.pools[a.pool as usize].imp {
            PoolImpl::Memfs(m) => m.abort(id),
            PoolImpl::Raw(_) => {
                if a.buf.is_none() {
                    Self::release_extent(ps, a.offset);
                }
            }
        }
        if let Some((ns, key)) = a.target
            && let Some(n) = st.ns.get_mut(&ns)
            && n.writing.get(&key) == Some(&id)
        {
            n.writing.remove(&key);
        }
    }

    /// Counts one FUSE upcall.
    pub fn count_upcall(&self, op: Upcall) {
        self.fuse_ops[op as usize].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Records the latency of one control operation.
    pub fn record_latency(&self, op: &str, d: std::time::Duration) {
        let us = d.as_micros().min(u128::from(u64::MAX)) as u64;
        let b = maru::proto::LATENCY_BUCKETS_US.partition_point(|&ub| ub < us);
        let mut st = self.st.lock();
        let h = st
            .latency
            .entry(op.to_owned())
            .or_insert_with(|| (vec![0; maru::proto::LATENCY_BUCKETS_US.len() + 1], 0));
        h.0[b] += 1;
        h.1 += us;
    }

    /// Counts an operation (shown in stats and metrics).
    pub fn count(&self, op: &str) {
        let mut st = self.st.lock();
        *st.ops.entry(op.to_owned()).or_insert(0) += 1;
    }

    fn session_caller(st: &State, session: u64) -> Result<Caller> {
        st.sessions
            .get(&session)
            .and_then(|s| s.caller.clone())
            .ok_or_else(|| Error::Protocol("no such session".into()))
    }

    // ----- control verbs -----

    /// Creates a namespace.
    /// Sets or clears a namespace's quota (root only). Entries already stored stay; stores
    /// that would go over it fail with [`Error::Quota`].
    pub fn set_quota(&self, c: &Caller, ns: &str, bytes: Option<u64>) -> Result<()> {
        split_ns(ns)?;
        if c.uid != 0 {
            return Err(Error::PermissionDenied(
                "only root sets namespace quotas".into(),
            ));
        }
        let mut st = self.st.lock();
        st.ns
            .get_mut(ns)
            .ok_or_else(|| Error::NotFound(format!("namespace `{ns}`")))?
            .quota = bytes;
        self.save_namespaces(&st);
        Ok(())
    }

    pub fn mkdir(&self, c: &Caller, ns: &str, mode: u32) -> Result<u64> {
        split_ns(ns)?;
        let mut st = self.st.lock();
        if st.ns.contains_key(ns) {
            return Err(Error::Exists(format!("namespace `{ns}`")));
        }
        let (parent, name) = ns_parent(ns);
        let p = st
            .ns
            .get(parent)
            .ok_or_else(|| Error::NotFound(format!("namespace `{parent}`")))?;
        check(c, p, 3, &format!("create `{ns}`"))?;
        if p.entries.contains_key(name) {
            return Err(Error::Exists(format!("`{ns}` is an entry")));
        }
        let ino = self.ns_insert(&mut st, ns, c.uid, c.gid, mode)?;
        for p in &self.pools {
            if let PoolImpl::Memfs(m) = &p.imp {
                m.ensure_ns(ns)?;
            }
        }
        self.save_namespaces(&st);
        Ok(ino)
    }

    /// Removes an empty namespace.
    pub fn rmdir(&self, c: &Caller, ns: &str) -> Result<()> {
        split_ns(ns)?;
        let mut st = self.st.lock();
        let n = ns_ref(&st, ns)?;
        if !n.entries.is_empty() || !n.children.is_empty() || !n.writing.is_empty() {
            return Err(Error::NotEmpty(format!("namespace `{ns}`")));
        }
        let (nuid, nino) = (n.uid, n.ino);
        let (parent, name) = ns_parent(ns);
        let p = &st.ns[parent];
        check(c, p, 3, &format!("remove `{ns}`"))?;
        if p.mode & 0o1000 != 0 && c.uid != 0 && c.uid != nuid && c.uid != p.uid {
            return Err(Error::PermissionDenied(format!("remove `{ns}` (sticky)")));
        }
        st.ns.remove(ns);
        st.ns_by_ino.remove(&nino);
        let p = st.ns.get_mut(parent).expect("parent");
        p.children.remove(name);
        p.mtime = now();
        for p in &self.pools {
            if let PoolImpl::Memfs(m) = &p.imp {
                m.remove_ns(ns);
            }
        }
        self.save_namespaces(&st);
        Ok(())
    }

    /// Grants `count` allocations of `size` bytes to a session. memfs grants carry the file.
    pub fn alloc(
        &self,
        session: u64,
        size: u64,
        count: u32,
        pool: Option<&str>,
    ) -> Result<Vec<(Grant, Option<Arc<File>>)>> {
        if size == 0 {
            return Err(Error::InvalidArgument("size must be > 0".into()));
        }
        if count == 0 || count as usize > maru::proto::MAX_FDS_PER_FRAME {
            return Err(Error::InvalidArgument(format!(
                "count must be 1..={}",
                maru::proto::MAX_FDS_PER_FRAME
            )));
        }
        let hint = pool.map(|p| self.pool_by_name(p)).transpose()?;
        if let Some(h) = hint
            && size > self.pools[h as usize].capacity
        {
            return Err(Error::NoSpace(format!(
                "{size} bytes exceed the pool's capacity"
            )));
        }
        if self.pools.iter().all(|p| size > p.capacity) {
            return Err(Error::NoSpace(format!(
                "{} exceeds every pool's capacity",
                maru::size::format_size(size)
            )));
        }
        let mut inv = Vec::new();
        let mut st = self.st.lock();
        let caller = Self::session_caller(&st, session)?;
        let mut out = Vec::with_capacity(count as usize);
        let mut err = None;
        for _ in 0..count {
            let id = st.alloc_ino();
            match self.place(&mut st, Some(session), id, size, hint, &mut inv) {
                Ok((p, offset, file)) => {
                    let file = file.map(Arc::new);
                    let acct = align_up(size, ENTRY_ALIGN);
                    st.pools[p as usize].writing_bytes += acct;
                    st.allocs.insert(
                        id,
                        Alloc {
                            pool: p,
                            offset,
                            size,
                            session: Some(session),
                            file: file.clone(),
                            buf: None,
                            target: None,
                            uid: caller.uid,
                            gid: caller.gid,
                            mode: 0o444,
                            mtime: now(),
                            acct,
                            tgid: 0,
                            closing: false,
                        },
                    );
                    st.sessions
                        .get_mut(&session)
                        .expect("checked")
                        .allocs
                        .insert(id);
                    out.push((
                        Grant {
                            alloc: id,
                            pool: p,
                            offset,
                            size,
                            fd: file.is_some(),
                        },
                        file,
                    ));
                }
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        drop(st);
        self.notify(inv);
        match (out.is_empty(), err) {
            (true, Some(e)) => Err(e),
            _ => Ok(out),
        }
    }

    /// Gives allocations back.
    pub fn free(&self, session: u64, ids: &[u64]) -> Result<()> {
        let mut st = self.st.lock();
        for id in ids {
            let owned = st
                .allocs
                .get(id)
                .is_some_and(|a| a.session == Some(session));
            if !owned {
                return Err(Error::InvalidArgument(format!(
                    "allocation {id} is not yours"
                )));
            }
            st.sessions
                .get_mut(&session)
                .expect("live")
                .allocs
                .remove(id);
            self.drop_alloc(&mut st, *id);
        }
        Ok(())
    }

    /// Seals allocation `id` as `ns/key`. First writer wins.
    pub fn publish(
        &self,
        session: u64,
        id: u64,
        ns: &str,
        key: &str,
        len: Option<u64>,
    ) -> Result<u64> {
        split_ns(ns)?;
        check_component(key.as_bytes())?;
        let mut st = self.st.lock();
        let caller = Self::session_caller(&st, session)?;
        if st
            .allocs
            .get(&id)
            .is_none_or(|a| a.session != Some(session))
        {
            return Err(Error::InvalidArgument(format!(
                "allocation {id} is not yours (already published or freed?)"
            )));
        }
        let r = self.publish_locked(&mut st, &caller, id, ns, key, len);
        if r.is_err() {
            // The loser's allocation is freed (write-once: first writer wins).
            if let Some(s) = st.sessions.get_mut(&session) {
                s.allocs.remove(&id);
            }
            self.drop_alloc(&mut st, id);
        } else {
            let size = st.entries.get(&id).map(|e| e.size).unwrap_or(0);
            if let Some(s) = st.sessions.get_mut(&session) {
                s.allocs.remove(&id);
                s.used += size;
            }
        }
        r
    }

    fn publish_locked(
        &self,
        st: &mut State,
        c: &Caller,
        id: u64,
        ns: &str,
        key: &str,
        len: Option<u64>,
    ) -> Result<u64> {
        let n = ns_ref(st, ns)?;
        check(c, n, 2, &format!("store into `{ns}`"))?;
        if n.entries.contains_key(key) {
            return Err(Error::Exists(format!("{ns}/{key}")));
        }
        if n.children.contains_key(key) {
            return Err(Error::Exists(format!("{ns}/{key} is a namespace")));
        }
        let a = st.allocs.get(&id).expect("checked by caller");
        let size = match len {
            Some(l) if l > a.size => {
                return Err(Error::InvalidArgument(format!(
                    "length {l} exceeds the allocation of {}",
                    a.size
                )));
            }
            Some(l) => l,
            None => a.size,
        };
        check_quota(st, ns, size)?;
        let a = st.allocs.get(&id).expect("checked by caller");
        let (pool, offset) = (a.pool, a.offset);
        let asize = align_up(a.size.max(1), ENTRY_ALIGN);
        let (uid, gid, mode) = (a.uid, a.gid, a.mode & 0o555);
        match &self.pools[pool as usize].imp {
            PoolImpl::Memfs(m) => {
                let f = a.file.clone().expect("memfs allocation has a file");
                if size < a.size {
                    f.set_len(size)?;
                }
                // The file was created by root with mode 0444 (socket allocations); fix what differs.
                // SAFETY: plain syscalls on a descriptor we own.
                unsafe {
                    if uid != 0 || gid != 0 {
                        libc::fchown(f.as_raw_fd(), uid, gid);
                    }
                    if a.target.is_some() || mode != 0o444 {
                        libc::fchmod(f.as_raw_fd(), mode);
                    }
                }
                m.publish(id, ns, key)?;
            }
            PoolImpl::Raw(r) => {
                if let Some(buf) = a.buf.as_ref() {
                    // Written through the mount: copy into the pool now.
                    r.file.write_all_at(buf, offset)?;
                }
                let w = st.pools[pool as usize]
                    .wal
                    .as_mut()
                    .expect("raw pool has a log");
                w.append(&Record::Seal {
                    ns: ns.to_owned(),
                    key: key.to_owned(),
                    off: offset,
                    size,
                    asize,
                    pin: false,
                    uid,
                    gid,
                })?;
            }
        }
        let a = st.allocs.remove(&id).expect("present");
        st.pools[pool as usize].writing_bytes -= a.acct;
        if let Some((tns, tkey)) = &a.target
            && let Some(n) = st.ns.get_mut(tns)
            && n.writing.get(tkey) == Some(&id)
        {
            n.writing.remove(tkey);
        }
        self.insert_entry(
            st,
            Entry {
                ino: id,
                ns: ns.to_owned(),
                key: key.to_owned(),
                pool,
                offset,
                size,
                asize,
                pinned: false,
                tick: 0,
                lru_key: 0,
                slot: 0,
                owner: a.session,
                leases: 0,
                uid,
                gid,
                mode,
                mtime: now(),
            },
        );
        // Only now that the index shows the entry may lock-free readers stop asking marud.
        if a.closing {
            adjust_pending(st, &a.target, -1);
        }
        *st.bytes.entry("stored".into()).or_insert(0) += size;
        self.maybe_checkpoint(st, pool);
        Ok(id)
    }

    fn maybe_checkpoint(&self, st: &mut State, pool: u32) {
        let live = st.pools[pool as usize].entries;
        let Some(w) = st.pools[pool as usize].wal.as_ref() else {
            return;
        };
        if w.since_checkpoint < 10_000 + 4 * live {
            return;
        }
        let recs = self.live_records(st, pool);
        if let Some(w) = st.pools[pool as usize].wal.as_mut()
            && let Err(e) = w.checkpoint(&recs)
        {
            tracing::error!("pool log checkpoint: {e}");
        }
    }

    fn live_records(&self, st: &State, pool: u32) -> Vec<Record> {
        let mut v: Vec<Record> = st
            .entries
            .values()
            .filter(|e| e.pool == pool)
            .map(|e| Record::Seal {
                ns: e.ns.clone(),
                key: e.key.clone(),
                off: e.offset,
                size: e.size,
                asize: e.asize,
                pin: e.pinned,
                uid: e.uid,
                gid: e.gid,
            })
            .collect();
        v.sort_by_key(|r| match r {
            Record::Seal { off, .. } => *off,
            _ => 0,
        });
        v
    }

    fn locate(&self, e: &Entry, with_fd: bool) -> Located {
        Located {
            key: e.key.clone(),
            generation: e.ino,
            pool: e.pool,
            offset: e.offset,
            size: e.size,
            pinned: e.pinned,
            fd: with_fd,
        }
    }

    /// Looks entries up for a session; memfs items carry the entry's file, raw items take a lease.
    /// `pool_fd_sent(pool)` says whether the session already holds the pool's read-only descriptor.
    pub fn retrieve(
        &self,
        session: u64,
        ns: &str,
        keys: &[String],
        mut pool_fd_sent: impl FnMut(u32) -> bool,
    ) -> Result<Retrieved> {
        split_ns(ns)?;
        let mut st = self.st.lock();
        let c = Self::session_caller(&st, session)?;
        self.wait_imminent(&mut st, ns, keys);
        let n = ns_ref(&st, ns)?;
        check(&c, n, 4, &format!("read `{ns}`"))?;
        let inos: Vec<Option<u64>> = keys.iter().map(|k| n.entries.get(k).copied()).collect();
        let mut out = Vec::with_capacity(keys.len());
        for ino in inos {
            let Some(ino) = ino else {
                out.push(None);
                continue;
            };
            st.touch(ino);
            let e = st.entries.get(&ino).expect("indexed").clone();
            *st.bytes.entry("retrieved".into()).or_insert(0) += e.size;
            match &self.pools[e.pool as usize].imp {
                PoolImpl::Memfs(m) => {
                    let f = m.open_entry(&e.ns, &e.key)?;
                    out.push(Some((self.locate(&e, true), Some(f))));
                }
                PoolImpl::Raw(r) => {
                    st.entries.get_mut(&ino).expect("present").leases += 1;
                    *st.sessions
                        .get_mut(&session)
                        .expect("live")
                        .leases
                        .entry(ino)
                        .or_insert(0) += 1;
                    let f = if pool_fd_sent(e.pool) {
                        None
                    } else {
                        Some(r.ro.try_clone()?)
                    };
                    out.push(Some((self.locate(&e, f.is_some()), f)));
                }
            }
        }
        Ok(out)
    }

    /// The session's pool descriptor for writing into raw pool grants.
    pub fn raw_pool_fd(&self, pool: u32, write: bool) -> Result<File> {
        match &self.pools[pool as usize].imp {
            PoolImpl::Raw(r) => Ok(if write {
                r.rw.try_clone()?
            } else {
                r.ro.try_clone()?
            }),
            PoolImpl::Memfs(_) => Err(Error::InvalidArgument("not a raw pool".into())),
        }
    }

    /// Drops leases.
    pub fn release(&self, session: u64, gens: &[u64]) {
        let mut st = self.st.lock();
        for g in gens {
            let held = st
                .sessions
                .get_mut(&session)
                .and_then(|s| {
                    let n = s.leases.get_mut(g)?;
                    *n -= 1;
                    let z = *n == 0;
                    if z {
                        s.leases.remove(g);
                    }
                    Some(())
                })
                .is_some();
            if held {
                Self::unlease(&mut st, *g, 1);
            }
        }
    }

    /// Which keys exist.
    pub fn exists(&self, c: &Caller, ns: &str, keys: &[String]) -> Result<Vec<bool>> {
        split_ns(ns)?;
        let mut st = self.st.lock();
        self.wait_imminent(&mut st, ns, keys);
        let n = ns_ref(&st, ns)?;
        check(c, n, 4, &format!("read `{ns}`"))?;
        Ok(keys.iter().map(|k| n.entries.contains_key(k)).collect())
    }

    /// Waits (at most a second) while any of `keys` is about to be published through the mount.
    fn wait_imminent(
        &self,
        st: &mut parking_lot::MutexGuard<'_, State>,
        ns: &str,
        keys: &[String],
    ) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        while keys.iter().any(|k| publication_imminent(st, ns, k)) {
            if self.sealed.wait_until(st, deadline).timed_out() {
                break;
            }
        }
    }

    /// Deletes entries; one outcome per key.
    pub fn delete(&self, c: &Caller, ns: &str, keys: &[String]) -> Result<Vec<Result<()>>> {
        split_ns(ns)?;
        let mut inv = Vec::new();
        let mut st = self.st.lock();
        let n = ns_ref(&st, ns)?;
        check(c, n, 3, &format!("delete in `{ns}`"))?;
        let mut out = Vec::new();
        for k in keys {
            let ino = st.ns[ns].entries.get(k).copied();
            match ino {
                Some(ino) => {
                    if let Some(i) = self.remove_entry(&mut st, ino, false) {
                        inv.push(i);
                    }
                    out.push(Ok(()));
                }
                None => out.push(Err(Error::NotFound(format!("{ns}/{k}")))),
            }
        }
        drop(st);
        self.notify(inv);
        Ok(out)
    }

    fn set_pin_locked(&self, st: &mut State, ino: u64, pinned: bool) -> Result<()> {
        let e = st
            .entries
            .get_mut(&ino)
            .ok_or_else(|| Error::NotFound("entry".into()))?;
        if e.pinned == pinned {
            return Ok(());
        }
        e.pinned = pinned;
        let (pool, ns, key, slot, off) = (e.pool, e.ns.clone(), e.key.clone(), e.slot, e.offset);
        match &self.pools[pool as usize].imp {
            PoolImpl::Memfs(m) => m.set_pinned(&ns, &key, pinned)?,
            PoolImpl::Raw(_) => {
                if let Some(w) = st.pools[pool as usize].wal.as_mut() {
                    w.append(&Record::Pin { off, pin: pinned })?;
                }
            }
        }
        st.ns
            .get_mut(&ns)
            .expect("exists")
            .index
            .set_flags(slot, if pinned { FLAG_PINNED } else { 0 });
        Ok(())
    }

    /// Pins or unpins entries.
    pub fn pin(
        &self,
        c: &Caller,
        ns: &str,
        keys: &[String],
        pinned: bool,
    ) -> Result<Vec<Result<()>>> {
        split_ns(ns)?;
        let mut st = self.st.lock();
        let n = ns_ref(&st, ns)?;
        check(c, n, 2, &format!("pin in `{ns}`"))?;
        let inos: Vec<Option<u64>> = keys.iter().map(|k| n.entries.get(k).copied()).collect();
        let mut out = Vec::new();
        for (k, ino) in keys.iter().zip(inos) {
            out.push(match ino {
                Some(ino) => self.set_pin_locked(&mut st, ino, pinned),
                None => Err(Error::NotFound(format!("{ns}/{k}"))),
            });
        }
        Ok(out)
    }

    /// A read-only descriptor of a namespace's index.
    pub fn index_fd(&self, c: &Caller, ns: &str) -> Result<(File, u64)> {
        split_ns(ns)?;
        let st = self.st.lock();
        let n = ns_ref(&st, ns)?;
        check(c, n, 4, &format!("read `{ns}`"))?;
        Ok((n.index.ro_fd()?, n.index.nslots() as u64))
    }

    fn ns_info(path: &str, n: &Namespace) -> NsInfo {
        NsInfo {
            ns: path.to_owned(),
            uid: n.uid,
            gid: n.gid,
            mode: n.mode,
            entries: n.entries.len() as u64,
            bytes: n.bytes,
            quota: n.quota,
        }
    }

    /// Lists a namespace.
    pub fn list(
        &self,
        c: &Caller,
        ns: &str,
    ) -> Result<(Option<NsInfo>, Vec<NsInfo>, Vec<Located>)> {
        if !ns.is_empty() {
            split_ns(ns)?;
        }
        let st = self.st.lock();
        let n = ns_ref(&st, ns)?;
        check(c, n, 4, &format!("list `{ns}`"))?;
        let mut children: Vec<NsInfo> = n
            .children
            .keys()
            .map(|name| {
                let p = join(ns, name);
                Self::ns_info(&p, &st.ns[&p])
            })
            .collect();
        children.sort_by(|a, b| a.ns.cmp(&b.ns));
        let mut entries: Vec<Located> = n
            .entries
            .values()
            .map(|ino| self.locate(&st.entries[ino], false))
            .collect();
        entries.sort_by(|a, b| a.key.cmp(&b.key));
        let me = (!ns.is_empty()).then(|| Self::ns_info(ns, n));
        Ok((me, children, entries))
    }

    fn pool_infos(&self, st: &State) -> Vec<PoolInfo> {
        self.pools
            .iter()
            .map(|p| {
                let ps = &st.pools[p.id as usize];
                let used = match &p.imp {
                    PoolImpl::Memfs(m) => m.space().map(|(t, f)| t - f).unwrap_or(0),
                    PoolImpl::Raw(_) => {
                        p.capacity
                            - REGION_ALIGN
                            - ps.extents.as_ref().map(|x| x.free_bytes()).unwrap_or(0)
                    }
                };
                PoolInfo {
                    id: p.id,
                    name: p.name.clone(),
                    kind: p.kind,
                    path: p.path.display().to_string(),
                    capacity: match p.kind {
                        PoolKind::Memfs => p.capacity,
                        _ => p.capacity - REGION_ALIGN,
                    },
                    used,
                    sealed_bytes: ps.sealed_bytes,
                    entries: ps.entries,
                    writing_bytes: ps.writing_bytes,
                    huge_bytes: if p.kind == PoolKind::Memfs {
                        shmem_huge_bytes().min(used)
                    } else {
                        0
                    },
                    evictions: ps.evictions,
                }
            })
            .collect()
    }

    /// Pool descriptions.
    pub fn pools(&self) -> Vec<PoolInfo> {
        let st = self.st.lock();
        self.pool_infos(&st)
    }

    /// Store-wide statistics.
    pub fn stats(&self) -> Stats {
        let st = self.st.lock();
        let mut namespaces: Vec<NsInfo> = st
            .ns
            .iter()
            .filter(|(k, _)| !k.is_empty())
            .map(|(k, n)| Self::ns_info(k, n))
            .collect();
        namespaces.sort_by(|a, b| a.ns.cmp(&b.ns));
        let mut clients: Vec<ClientInfo> = st
            .sessions
            .iter()
            .map(|(id, s)| {
                let allocated: u64 = s
                    .allocs
                    .iter()
                    .filter_map(|a| st.allocs.get(a))
                    .map(|a| a.acct)
                    .sum();
                let region_bytes: u64 = s
                    .regions
                    .iter()
                    .filter_map(|(p, o)| st.pools[*p as usize].regions.get(o))
                    .map(|r| r.len - r.bump.min(r.len))
                    .sum();
                let c = s.caller.clone().unwrap_or_else(Caller::root);
                ClientInfo {
                    session: *id,
                    name: s.name.clone(),
                    pid: c.pid,
                    uid: c.uid,
                    allocated,
                    used: s.used,
                    slack: region_bytes,
                    leases: s.leases.values().map(|n| u64::from(*n)).sum(),
                }
            })
            .collect();
        clients.sort_by_key(|c| c.session);
        Stats {
            pools: self.pool_infos(&st),
            namespaces,
            clients,
            ops: {
                let mut ops = st.ops.clone();
                for (op, n) in Upcall::ALL.iter().zip(&self.fuse_ops) {
                    let n = n.load(std::sync::atomic::Ordering::Relaxed);
                    if n > 0 {
                        ops.insert(format!("fuse_{}", op.name()), n);
                    }
                }
                ops
            },
            eviction: match self.cfg.eviction {
                Eviction::Lru => "lru".into(),
                Eviction::Off => "off".into(),
            },
            bytes: st.bytes.clone(),
            latency_us: st
                .latency
                .iter()
                .map(|(k, v)| (k.clone(), v.0.clone()))
                .collect(),
            latency_sum_us: st.latency.iter().map(|(k, v)| (k.clone(), v.1)).collect(),
            uptime_s: self.started.elapsed().as_secs_f64(),
        }
    }

    /// Evicts LRU entries until `bytes` are free in every pool (or nothing is left to evict).
    pub fn evict(&self, bytes: u64) -> (u64, u64) {
        let mut st = self.st.lock();
        let mut total = (0, 0);
        let mut inv = Vec::new();
        for p in 0..self.pools.len() as u32 {
            let free = self.free_space(&st, p);
            if free < bytes {
                let (n, b, i) = self.evict_lru(&mut st, Some(p), bytes - free);
                total.0 += n;
                total.1 += b;
                inv.extend(i);
            }
        }
        drop(st);
        self.notify(inv);
        total
    }

    /// Checks every invariant the tests rely on; returns a description of the first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let st = self.st.lock();
        for (i, p) in self.pools.iter().enumerate() {
            let ps = &st.pools[i];
            let sealed: u64 = st
                .entries
                .values()
                .filter(|e| e.pool == p.id)
                .map(|e| e.asize)
                .sum();
            if sealed != ps.sealed_bytes {
                return Err(format!(
                    "pool {}: sealed bytes {} != {}",
                    p.name, ps.sealed_bytes, sealed
                ));
            }
            if let Some(x) = &ps.extents {
                let regions: u64 = ps.regions.values().map(|r| r.len).sum();
                if regions + x.free_bytes() != p.capacity - REGION_ALIGN {
                    return Err(format!(
                        "pool {}: regions {} + free {} != capacity",
                        p.name,
                        regions,
                        x.free_bytes()
                    ));
                }
            }
        }
        for (k, n) in &st.ns {
            for (key, ino) in &n.entries {
                let e = st
                    .entries
                    .get(ino)
                    .ok_or_else(|| format!("{k}/{key}: dangling"))?;
                match n.index.lookup(key) {
                    Some(v) if v.generation == e.ino => {}
                    other => return Err(format!("{k}/{key}: index says {other:?}")),
                }
            }
        }
        // Every entry is filed once in the LRU tree, under a key no later than its last use.
        if st.lru.len() != st.entries.len() {
            return Err(format!(
                "lru files {} entries, the store has {}",
                st.lru.len(),
                st.entries.len()
            ));
        }
        for (ino, e) in &st.entries {
            if st.lru.get(&e.lru_key) != Some(ino) || e.tick < e.lru_key {
                return Err(format!(
                    "inode {ino}: filed under {} in lru ({:?}), last used at {}",
                    e.lru_key,
                    st.lru.get(&e.lru_key),
                    e.tick
                ));
            }
        }
        Ok(())
    }

    /// Unmounts the memfs pools this daemon mounted (clean shutdown with `--unmount-pools`).
    pub fn unmount_pools(&self) {
        for p in &self.pools {
            if let PoolImpl::Memfs(m) = &p.imp
                && m.mounted_here
            {
                m.unmount();
            }
        }
    }

    /// Syncs raw pool logs.
    pub fn sync(&self) {
        let mut st = self.st.lock();
        for ps in &mut st.pools {
            if let Some(w) = ps.wal.as_mut() {
                let _ = w.sync();
            }
        }
    }

    /// The pools.
    pub fn pool_list(&self) -> &[Pool] {
        &self.pools
    }
}

/// The namespace `ns`, or a not-found error naming it.
fn ns_ref<'a>(st: &'a State, ns: &str) -> Result<&'a Namespace> {
    st.ns
        .get(ns)
        .ok_or_else(|| Error::NotFound(format!("namespace `{ns}`")))
}

/// Adds `delta` to the imminent publications of `target`'s namespace (and its index).
fn adjust_pending(st: &mut State, target: &Option<(String, String)>, delta: i64) {
    if let Some((ns, _)) = target
        && let Some(n) = st.ns.get_mut(ns)
    {
        n.pending = n.pending.saturating_add_signed(delta);
        n.index.set_pending(n.pending);
    }
}

/// True if `ns/key` is being written through the mount and its writer has closed it.
fn publication_imminent(st: &State, ns: &str, key: &str) -> bool {
    st.ns
        .get(ns)
        .and_then(|n| n.writing.get(key))
        .and_then(|id| st.allocs.get(id))
        .is_some_and(|a| a.closing)
}

fn entry_attr(e: &Entry) -> Attr {
    Attr {
        ino: e.ino,
        kind: Kind::File,
        size: e.size,
        mode: e.mode,
        uid: e.uid,
        gid: e.gid,
        mtime: e.mtime,
        sealed: true,
    }
}

fn ns_attr(n: &Namespace) -> Attr {
    Attr {
        ino: n.ino,
        kind: Kind::Dir,
        size: (n.entries.len() + n.children.len()) as u64,
        mode: n.mode,
        uid: n.uid,
        gid: n.gid,
        mtime: n.mtime,
        sealed: false,
    }
}

fn slot_view(e: &Entry) -> SlotView {
    SlotView {
        generation: e.ino,
        size: e.size,
        pool: e.pool,
        flags: if e.pinned { FLAG_PINNED } else { 0 },
        offset: e.offset,
    }
}

impl State {
    /// Marks entry `ino` as the most recently used (its place in `lru` is settled when
    /// eviction next needs the order); false when there is no such entry.
    fn touch(&mut self, ino: u64) -> bool {
        self.tick += 1;
        let tick = self.tick;
        match self.entries.get_mut(&ino) {
            Some(e) => {
                e.tick = tick;
                true
            }
            None => false,
        }
    }

    /// Re-files in `lru` every entry used since it was filed, so that the tree's order is
    /// the order of last use again (before eviction walks it).
    fn settle_lru(&mut self) {
        let stale: Vec<(u64, u64)> = self
            .lru
            .iter()
            .filter(|(k, ino)| self.entries.get(ino).is_some_and(|e| e.tick != **k))
            .map(|(k, ino)| (*k, *ino))
            .collect();
        for (k, ino) in stale {
            self.lru.remove(&k);
            if let Some(e) = self.entries.get_mut(&ino) {
                e.lru_key = e.tick;
                self.lru.insert(e.tick, ino);
            }
        }
    }

    fn alloc_ino(&mut self) -> u64 {
        let i = self.next_ino;
        self.next_ino += 1;
        i
    }
}

// ----- the mount's view: inode-based operations -----

impl Store {
    fn ns_path_of(st: &State, ino: u64) -> Result<String> {
        st.ns_by_ino
            .get(&ino)
            .cloned()
            .ok_or_else(|| Error::NotFound(format!("inode {ino}")))
    }

    fn alloc_attr(&self, id: u64, a: &Alloc) -> Attr {
        let size = match (&a.file, &a.buf) {
            (Some(f), _) => f.metadata().map(|m| m.len()).unwrap_or(0),
            (None, Some(b)) => b.len() as u64,
            (None, None) => a.size,
        };
        Attr {
            ino: id,
            kind: Kind::File,
            size,
            mode: a.mode,
            uid: a.uid,
            gid: a.gid,
            mtime: a.mtime,
            sealed: false,
        }
    }

    /// Looks `name` up in namespace `parent`. Entries being written are visible only to
    /// the process writing them.
    pub fn fs_lookup(&self, c: &Caller, parent: u64, name: &str) -> Result<Attr> {
        let mut st = self.st.lock();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        let mut tgid = None;
        loop {
            let p = Self::ns_path_of(&st, parent)?;
            let n = &st.ns[&p];
            if let Some(ino) = n.entries.get(name) {
                return Ok(entry_attr(&st.entries[ino]));
            }
            if n.children.contains_key(name) {
                return Ok(ns_attr(&st.ns[&join(&p, name)]));
            }
            let Some(a) = n
                .writing
                .get(name)
                .and_then(|id| st.allocs.get(id).map(|a| (id, a)))
            else {
                return Err(Error::NotFound(join(&p, name)));
            };
            let me = *tgid.get_or_insert_with(|| c.tgid());
            if a.1.tgid == me {
                return Ok(self.alloc_attr(*a.0, a.1));
            }
            // Its writer closed it: the kernel's release (which publishes it) is on its way.
            if !a.1.closing || self.sealed.wait_until(&mut st, deadline).timed_out() {
                return Err(Error::NotFound(join(&p, name)));
            }
        }
    }

    /// Attributes of any node.
    pub fn fs_getattr(&self, ino: u64) -> Result<Attr> {
        let st = self.st.lock();
        if let Some(e) = st.entries.get(&ino) {
            return Ok(entry_attr(e));
        }
        if let Some(p) = st.ns_by_ino.get(&ino) {
            return Ok(ns_attr(&st.ns[p]));
        }
        if let Some(a) = st.allocs.get(&ino) {
            return Ok(self.alloc_attr(ino, a));
        }
        if let Some(z) = st.zombies.get(&ino) {
            return Ok(entry_attr(z));
        }
        st.gone
            .get(&ino)
            .cloned()
            .ok_or_else(|| Error::NotFound(format!("inode {ino}")))
    }

    /// Lists a namespace.
    pub fn fs_readdir(&self, c: &Caller, ino: u64) -> Result<Vec<DirEntry>> {
        let st = self.st.lock();
        let p = Self::ns_path_of(&st, ino)?;
        let n = &st.ns[&p];
        check(c, n, 4, &format!("list `{p}`"))?;
        let mut v: Vec<DirEntry> = n
            .children
            .iter()
            .map(|(name, ino)| DirEntry {
                ino: *ino,
                name: name.clone(),
                kind: Kind::Dir,
            })
            .chain(n.entries.iter().map(|(name, ino)| DirEntry {
                ino: *ino,
                name: name.clone(),
                kind: Kind::File,
            }))
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(v)
    }

    /// mkdir through the mount.
    pub fn fs_mkdir(&self, c: &Caller, parent: u64, name: &str, mode: u32) -> Result<Attr> {
        let p = Self::ns_path_of(&self.st.lock(), parent)?;
        let ino = self.mkdir(c, &join(&p, name), mode)?;
        self.fs_getattr(ino)
    }

    /// rmdir through the mount.
    pub fn fs_rmdir(&self, c: &Caller, parent: u64, name: &str) -> Result<()> {
        let p = Self::ns_path_of(&self.st.lock(), parent)?;
        let full = join(&p, name);
        {
            let st = self.st.lock();
            if st.ns[&p].entries.contains_key(name) {
                return Err(Error::from_errno(libc::ENOTDIR));
            }
        }
        self.rmdir(c, &full)
    }

    /// Creates an entry being written (`open(O_CREAT)` of a new name).
    pub fn fs_create(
        &self,
        c: &Caller,
        parent: u64,
        name: &str,
        mode: u32,
    ) -> Result<(Attr, OpenedFile)> {
        let mut st = self.st.lock();
        let p = Self::ns_path_of(&st, parent)?;
        if p.is_empty() {
            return Err(Error::PermissionDenied(
                "entries live in namespaces: create a directory first".into(),
            ));
        }
        let n = &st.ns[&p];
        check(c, n, 3, &format!("create in `{p}`"))?;
        if n.entries.contains_key(name) || n.children.contains_key(name) {
            return Err(Error::Exists(join(&p, name)));
        }
        // A namespace already at its quota takes no new entry (the size of one written through
        // the mount is known only at close, where it is checked again).
        check_quota(&st, &p, 1)?;
        let id = st.alloc_ino();
        let memfs = self.pools.iter().find(|p| p.kind == PoolKind::Memfs);
        let mut inv = Vec::new();
        let (pool, file, buf) = match memfs {
            Some(mp) => {
                let PoolImpl::Memfs(m) = &mp.imp else {
                    unreachable!("memfs pool")
                };
                // Writes through passthrough go straight to the pool's tmpfs, where the daemon
                // cannot evict for them: make room before the writer starts.
                self.keep_headroom(&mut st, mp.id, &mut inv);
                (mp.id, Some(Arc::new(m.create_writing(id, 0, 0o600)?)), None)
            }
            None => {
                let rp = self
                    .pools
                    .first()
                    .ok_or_else(|| Error::NoSpace("no pools".into()))?;
                (rp.id, None, Some(Vec::new()))
            }
        };
        let a = Alloc {
            pool,
            offset: 0,
            size: 0,
            session: None,
            file: file.clone(),
            buf,
            target: Some((p.clone(), name.to_owned())),
            uid: c.uid,
            gid: c.gid,
            mode: mode & ENTRY_MODES,
            mtime: now(),
            acct: 0,
            tgid: c.tgid(),
            closing: false,
        };
        let attr = self.alloc_attr(id, &a);
        st.allocs.insert(id, a);
        st.ns
            .get_mut(&p)
            .expect("exists")
            .writing
            .insert(name.to_owned(), id);
        drop(st);
        self.notify(inv);
        Ok((
            attr,
            match file {
                Some(f) => OpenedFile::Passthrough(f),
                None => OpenedFile::Copy,
            },
        ))
    }

    /// Opens a node through the mount.
    pub fn fs_open(&self, c: &Caller, ino: u64, write: bool) -> Result<OpenedFile> {
        let mut st = self.st.lock();
        if st.entries.contains_key(&ino) {
            if write {
                return Err(Error::ReadOnly("sealed entries are immutable".into()));
            }
            st.touch(ino);
            let st = &mut *st;
            let e = st.entries.get_mut(&ino).expect("present");
            return match &self.pools[e.pool as usize].imp {
                PoolImpl::Memfs(m) => Ok(OpenedFile::Passthrough(Arc::new(
                    m.open_entry(&e.ns, &e.key)?,
                ))),
                PoolImpl::Raw(_) => {
                    e.leases += 1;
                    *st.fuse_leases.entry(ino).or_insert(0) += 1;
                    Ok(OpenedFile::Copy)
                }
            };
        }
        if let Some(a) = st.allocs.get(&ino) {
            if a.target.is_none() || a.tgid != c.tgid() {
                return Err(Error::NotFound(format!("inode {ino} is being written")));
            }
            return Ok(match &a.file {
                Some(f) => OpenedFile::Passthrough(f.clone()),
                None => OpenedFile::Copy,
            });
        }
        if st.ns_by_ino.contains_key(&ino) {
            return Err(Error::from_errno(libc::EISDIR));
        }
        Err(Error::NotFound(format!("inode {ino}")))
    }

    /// Opens again a sealed entry whose backing file the mount holds (see `fs_open`): it
    /// must still exist; the open counts as a use for eviction.
    pub fn fs_reopen(&self, ino: u64) -> Result<()> {
        if self.st.lock().touch(ino) {
            Ok(())
        } else {
            Err(Error::NotFound(format!("inode {ino}")))
        }
    }

    /// A handle of the mount was released (drops its lease on raw entries).
    pub fn fs_close(&self, ino: u64) {
        let mut st = self.st.lock();
        let held = match st.fuse_leases.get_mut(&ino) {
            Some(n) => {
                *n -= 1;
                if *n == 0 {
                    st.fuse_leases.remove(&ino);
                }
                true
            }
            None => false,
        };
        if held {
            Self::unlease(&mut st, ino, 1);
        }
    }

    /// A writable descriptor of an entry being written through the mount was closed.
    pub fn fs_closing(&self, ino: u64, abandoned: bool) {
        let mut st = self.st.lock();
        let Some(a) = st.allocs.get_mut(&ino) else {
            return;
        };
        if abandoned {
            // Its writer was killed mid-store: forget the name; the release drops the bytes.
            tracing::info!(ino, target = ?a.target, "writer killed by a signal: entry abandoned");
            let (closing, old) = (a.closing, a.target.take());
            a.closing = false;
            if let Some((ns, key)) = &old
                && let Some(n) = st.ns.get_mut(ns)
                && n.writing.get(key) == Some(&ino)
            {
                n.writing.remove(key);
            }
            if closing {
                adjust_pending(&mut st, &old, -1);
            }
            drop(st);
            self.sealed.notify_all();
            return;
        }
        if a.closing || a.target.is_none() {
            return;
        }
        a.closing = true;
        let target = a.target.clone();
        adjust_pending(&mut st, &target, 1);
    }

    /// Publishes an entry written through the mount.
    pub fn fs_seal(&self, ino: u64) -> Result<()> {
        let r = self.fs_seal_inner(ino);
        self.sealed.notify_all();
        r
    }

    fn fs_seal_inner(&self, ino: u64) -> Result<()> {
        let mut inv = Vec::new();
        let mut st = self.st.lock();
        let Some(a) = st.allocs.get(&ino) else {
            return Ok(());
        };
        let Some((ns, key)) = a.target.clone() else {
            // Unlinked or abandoned while being written: nothing to publish.
            self.drop_alloc(&mut st, ino);
            return Ok(());
        };
        let caller = Caller::new(a.uid, a.gid, 0);
        let cur = self.alloc_attr(ino, a).size;
        let pool = a.pool;
        tracing::debug!(ino, ns = %ns, key = %key, size = cur, "sealing an entry written through the mount");
        let r = (|| {
            if self.pools[pool as usize].kind.is_raw() {
                if cur > self.cfg.max_copy_entry {
                    return Err(Error::NoSpace(
                        "entry too large for a raw pool through the mount".into(),
                    ));
                }
                let (p, off, _) = self.place(
                    &mut st,
                    Some(MOUNT_SESSION),
                    ino,
                    cur.max(1),
                    Some(pool),
                    &mut inv,
                )?;
                let acct = align_up(cur.max(1), ENTRY_ALIGN);
                st.pools[p as usize].writing_bytes += acct;
                let a = st.allocs.get_mut(&ino).expect("present");
                a.offset = off;
                a.size = cur;
                a.acct = acct;
                a.session = Some(MOUNT_SESSION);
            } else {
                st.allocs.get_mut(&ino).expect("present").size = cur;
            }
            self.publish_locked(&mut st, &caller, ino, &ns, &key, None)
        })();
        if let Err(e) = r {
            self.drop_alloc(&mut st, ino);
            drop(st);
            self.notify(inv);
            return Err(e);
        }
        drop(st);
        self.notify(inv);
        Ok(())
    }

    /// Drops an entry being written.
    pub fn fs_abort(&self, ino: u64) {
        let mut st = self.st.lock();
        self.drop_alloc(&mut st, ino);
    }

    /// Makes room in a memfs pool for `bytes` more of the entry being written `ino` (a
    /// writer's fallocate), keeping the mount's headroom on top (with eviction on).
    pub fn fs_make_room(&self, ino: u64, bytes: u64) {
        let mut st = self.st.lock();
        let Some(a) = st.allocs.get(&ino) else {
            return;
        };
        if a.file.is_none() {
            return;
        }
        let pool = a.pool;
        let mut inv = Vec::new();
        let want = bytes.saturating_add(self.mount_headroom(pool));
        self.ensure_free(&mut st, pool, want, &mut inv);
        drop(st);
        self.notify(inv);
    }

    /// Sets the size of an entry being written.
    pub fn fs_truncate(&self, ino: u64, size: u64) -> Result<Attr> {
        let mut st = self.st.lock();
        if let Some(e) = st.entries.get(&ino) {
            if e.size == size {
                return Ok(entry_attr(e));
            }
            return Err(Error::ReadOnly("sealed entries are immutable".into()));
        }
        let max = self.cfg.max_copy_entry;
        let a = st
            .allocs
            .get(&ino)
            .ok_or_else(|| Error::NotFound(format!("inode {ino}")))?;
        if let Some(f) = &a.file {
            // A writer that sizes its entry is about to fill it (often through a mapping, where
            // a full tmpfs means SIGBUS): make room for the growth first.
            let (f, pool) = (f.clone(), a.pool);
            let grow = size.saturating_sub(f.metadata()?.len());
            if grow > 0 {
                let mut inv = Vec::new();
                let want = grow.saturating_add(self.mount_headroom(pool));
                self.ensure_free(&mut st, pool, want, &mut inv);
                // Invalidations go to their own thread: queueing them here does not block.
                self.notify(inv);
            }
            f.set_len(size)?;
        }
        let a = st.allocs.get_mut(&ino).expect("present");
        if let Some(b) = a.buf.as_mut() {
            if size > max {
                return Err(Error::from_errno(libc::EFBIG));
            }
            b.resize(size as usize, 0);
        }
        a.mtime = now();
        let a = &st.allocs[&ino];
        Ok(self.alloc_attr(ino, a))
    }

    /// chmod/chown through the mount.
    pub fn fs_chmod_chown(
        &self,
        c: &Caller,
        ino: u64,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
    ) -> Result<Attr> {
        let mut st = self.st.lock();
        if uid.is_some_and(|u| c.uid != 0 && Some(u) != Some(c.uid))
            || gid.is_some_and(|g| c.uid != 0 && !c.in_group(g))
        {
            return Err(Error::from_errno(libc::EPERM));
        }
        if let Some(p) = st.ns_by_ino.get(&ino).cloned() {
            let n = st.ns.get_mut(&p).expect("exists");
            if c.uid != 0 && c.uid != n.uid {
                return Err(Error::from_errno(libc::EPERM));
            }
            set_owner_mode(
                (&mut n.mode, &mut n.uid, &mut n.gid),
                (mode, uid, gid),
                0o7777,
            );
            n.mtime = now();
            let a = ns_attr(n);
            self.save_namespaces(&st);
            return Ok(a);
        }
        if let Some(a) = st.allocs.get_mut(&ino) {
            if c.uid != 0 && c.uid != a.uid {
                return Err(Error::from_errno(libc::EPERM));
            }
            set_owner_mode(
                (&mut a.mode, &mut a.uid, &mut a.gid),
                (mode, uid, gid),
                ENTRY_MODES,
            );
            let a = &st.allocs[&ino];
            return Ok(self.alloc_attr(ino, a));
        }
        let e = st
            .entries
            .get_mut(&ino)
            .ok_or_else(|| Error::NotFound(format!("inode {ino}")))?;
        if c.uid != 0 && c.uid != e.uid {
            return Err(Error::from_errno(libc::EPERM));
        }
        // Sealed entries never become writable.
        set_owner_mode(
            (&mut e.mode, &mut e.uid, &mut e.gid),
            (mode, uid, gid),
            ENTRY_MODES & !0o222,
        );
        let e = e.clone();
        if let PoolImpl::Memfs(m) = &self.pools[e.pool as usize].imp {
            let path = m.entry_path(&e.ns, &e.key);
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(e.mode));
            let _ = std::os::unix::fs::chown(&path, Some(e.uid), Some(e.gid));
        }
        Ok(entry_attr(&e))
    }

    /// Reads an entry through the daemon (raw pools, or when passthrough is unavailable).
    pub fn fs_read(&self, ino: u64, offset: u64, len: u32) -> Result<Vec<u8>> {
        let st = self.st.lock();
        let e = st.entries.get(&ino).or_else(|| st.zombies.get(&ino));
        if let Some(e) = e {
            if offset >= e.size {
                return Ok(Vec::new());
            }
            let n = (u64::from(len)).min(e.size - offset) as usize;
            let mut buf = vec![0u8; n];
            match &self.pools[e.pool as usize].imp {
                PoolImpl::Raw(r) => r.file.read_exact_at(&mut buf, e.offset + offset)?,
                PoolImpl::Memfs(m) => m
                    .open_entry(&e.ns, &e.key)?
                    .read_exact_at(&mut buf, offset)?,
            }
            return Ok(buf);
        }
        let a = st
            .allocs
            .get(&ino)
            .ok_or_else(|| Error::NotFound(format!("inode {ino}")))?;
        match (&a.file, &a.buf) {
            (Some(f), _) => {
                let mut buf = vec![0u8; len as usize];
                let n = f.read_at(&mut buf, offset)?;
                buf.truncate(n);
                Ok(buf)
            }
            (None, Some(b)) => {
                let s = (offset as usize).min(b.len());
                let e = (s + len as usize).min(b.len());
                Ok(b[s..e].to_vec())
            }
            _ => Ok(Vec::new()),
        }
    }

    /// Writes into an entry being written through the daemon.
    pub fn fs_write(&self, ino: u64, offset: u64, data: &[u8]) -> Result<u32> {
        let mut st = self.st.lock();
        let max = self.cfg.max_copy_entry;
        let a = st
            .allocs
            .get_mut(&ino)
            .ok_or_else(|| Error::ReadOnly("not an entry being written".into()))?;
        a.mtime = now();
        if let Some(f) = &a.file {
            f.write_all_at(data, offset)?;
        } else if let Some(b) = a.buf.as_mut() {
            let end = offset as usize + data.len();
            if end as u64 > max {
                return Err(Error::from_errno(libc::EFBIG));
            }
            if b.len() < end {
                b.resize(end, 0);
            }
            b[offset as usize..end].copy_from_slice(data);
        }
        Ok(data.len() as u32)
    }

    /// Deletes an entry through the mount.
    pub fn fs_unlink(&self, c: &Caller, parent: u64, name: &str) -> Result<()> {
        let mut st = self.st.lock();
        let p = Self::ns_path_of(&st, parent)?;
        let n = &st.ns[&p];
        if n.children.contains_key(name) {
            return Err(Error::from_errno(libc::EISDIR));
        }
        let ino = match n.entries.get(name) {
            Some(i) => *i,
            None => {
                // A name still being written by this caller: drop it when its writer closes.
                if let Some(id) = n.writing.get(name).copied()
                    && st
                        .allocs
                        .get(&id)
                        .is_some_and(|a| c.uid == 0 || a.uid == c.uid)
                {
                    st.ns.get_mut(&p).expect("exists").writing.remove(name);
                    if let Some(a) = st.allocs.get_mut(&id) {
                        let (closing, old) = (a.closing, a.target.take());
                        a.closing = false;
                        if closing {
                            adjust_pending(&mut st, &old, -1);
                        }
                    }
                    return Ok(());
                }
                return Err(Error::NotFound(join(&p, name)));
            }
        };
        check(c, n, 3, &format!("delete in `{p}`"))?;
        let e = &st.entries[&ino];
        if n.mode & 0o1000 != 0 && c.uid != 0 && c.uid != e.uid && c.uid != n.uid {
            return Err(Error::from_errno(libc::EPERM));
        }
        let inv = self.remove_entry(&mut st, ino, false);
        drop(st);
        // The kernel drops the name; the backing file is freed once the mount lets go of it.
        self.notify(
            inv.map(|i| Invalidation {
                by_kernel: true,
                ..i
            })
            .into_iter()
            .collect(),
        );
        Ok(())
    }

    /// Renames through the mount: moves a sealed entry (never over an existing name: entries
    /// are write-once), or retargets an entry being written. Namespaces answer EXDEV so that
    /// `mv` falls back to copying.
    pub fn fs_rename(
        &self,
        c: &Caller,
        parent: u64,
        name: &str,
        newparent: u64,
        newname: &str,
    ) -> Result<()> {
        let mut st = self.st.lock();
        let p = Self::ns_path_of(&st, parent)?;
        let np = Self::ns_path_of(&st, newparent)?;
        if st.ns[&p].children.contains_key(name) {
            return Err(Error::from_errno(libc::EXDEV));
        }
        if np.is_empty() {
            return Err(Error::PermissionDenied("entries live in namespaces".into()));
        }
        check(c, &st.ns[&p], 3, &format!("rename in `{p}`"))?;
        check(c, &st.ns[&np], 3, &format!("rename into `{np}`"))?;
        let target = &st.ns[&np];
        if target.entries.contains_key(newname) || target.children.contains_key(newname) {
            if p == np && name == newname {
                return Ok(());
            }
            return Err(Error::Exists(format!(
                "{}: entries are write-once",
                join(&np, newname)
            )));
        }
        if let Some(&ino) = st.ns[&p].entries.get(name) {
            let e = st.entries[&ino].clone();
            match &self.pools[e.pool as usize].imp {
                PoolImpl::Memfs(m) => m.rename(&p, name, &np, newname)?,
                PoolImpl::Raw(_) => {
                    if let Some(w) = st.pools[e.pool as usize].wal.as_mut() {
                        w.append(&Record::Rename {
                            off: e.offset,
                            ns: np.clone(),
                            key: newname.to_owned(),
                        })?;
                    }
                }
            }
            let n = st.ns.get_mut(&p).expect("exists");
            n.entries.remove(name);
            n.index.remove(e.slot);
            n.bytes -= e.size;
            let mut moved = e;
            moved.ns = np.clone();
            moved.key = newname.to_owned();
            st.lru.remove(&moved.lru_key);
            st.entries.remove(&ino);
            let ps = &mut st.pools[moved.pool as usize];
            ps.sealed_bytes -= moved.asize;
            ps.entries -= 1;
            self.insert_entry(&mut st, moved);
            return Ok(());
        }
        if let Some(id) = st.ns[&p].writing.get(name).copied() {
            st.ns.get_mut(&p).expect("exists").writing.remove(name);
            st.ns
                .get_mut(&np)
                .expect("exists")
                .writing
                .insert(newname.to_owned(), id);
            if let Some(a) = st.allocs.get_mut(&id) {
                let old = a.target.replace((np, newname.to_owned()));
                let (closing, new) = (a.closing, a.target.clone());
                if closing {
                    adjust_pending(&mut st, &old, -1);
                    adjust_pending(&mut st, &new, 1);
                }
            }
            return Ok(());
        }
        Err(Error::NotFound(join(&p, name)))
    }

    /// (capacity, free, entries) over all pools.
    pub fn fs_statfs(&self) -> (u64, u64, u64) {
        let st = self.st.lock();
        let mut total = 0;
        let mut free = 0;
        for p in &self.pools {
            total += match p.kind {
                PoolKind::Memfs => p.capacity,
                _ => p.capacity - REGION_ALIGN,
            };
            free += self.free_space(&st, p.id);
        }
        (total, free, st.entries.len() as u64)
    }

    /// `user.maru.*` attributes.
    pub fn fs_xattrs(&self, ino: u64) -> Result<Vec<Xattr>> {
        let st = self.st.lock();
        let x = |name: &'static str, value: String| Xattr { name, value };
        if let Some(p) = st.ns_by_ino.get(&ino) {
            let n = &st.ns[p];
            return Ok(vec![
                x("entries", n.entries.len().to_string()),
                x("bytes", n.bytes.to_string()),
            ]);
        }
        let (e, state) = match (st.entries.get(&ino), st.allocs.get(&ino)) {
            (Some(e), _) => (e.clone(), "sealed"),
            (None, Some(a)) => {
                let pool = &self.pools[a.pool as usize];
                return Ok(vec![
                    x("state", "writing".into()),
                    x("pool", pool.name.clone()),
                    x("kind", kind_name(pool.kind).into()),
                    x("size", self.alloc_attr(ino, a).size.to_string()),
                    x(
                        "access",
                        if a.file.is_some() {
                            "passthrough"
                        } else {
                            "copy"
                        }
                        .into(),
                    ),
                ]);
            }
            _ => return Err(Error::NotFound(format!("inode {ino}"))),
        };
        let pool = &self.pools[e.pool as usize];
        let (location, access) = match &pool.imp {
            PoolImpl::Memfs(m) => (
                m.entry_path(&e.ns, &e.key).display().to_string(),
                "passthrough",
            ),
            PoolImpl::Raw(_) => (format!("{}@{:#x}", pool.path.display(), e.offset), "copy"),
        };
        Ok(vec![
            x("state", state.into()),
            x("pool", pool.name.clone()),
            x("kind", kind_name(pool.kind).into()),
            x("location", location),
            x("offset", e.offset.to_string()),
            x("size", e.size.to_string()),
            x("pinned", if e.pinned { "1" } else { "0" }.into()),
            x("generation", e.ino.to_string()),
            x("access", access.into()),
        ])
    }

    /// Pins or unpins through the mount.
    pub fn fs_set_pinned(&self, c: &Caller, ino: u64, pinned: bool) -> Result<()> {
        let mut st = self.st.lock();
        let e = st
            .entries
            .get(&ino)
            .ok_or_else(|| Error::NotFound(format!("inode {ino}")))?;
        check(c, &st.ns[&e.ns], 2, "pin")?;
        self.set_pin_locked(&mut st, ino, pinned)
    }
}

/// Bytes of shared memory held in 2 MiB pages (`ShmemHugePages`): all memfs pools and any
/// other tmpfs together; reported per pool capped by its use.
fn shmem_huge_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("ShmemHugePages:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .unwrap_or(0)
        * 1024
}

/// The mode bits an entry can have: never set-user-ID or set-group-ID (entries are data; the
/// mount is `nosuid,noexec`). So no write or truncate ever has such bits (or file
/// capabilities: only `user.maru.*` attributes exist) to clear, which lets the mount take the
/// kernel's FUSE_HANDLE_KILLPRIV_V2 without a GETXATTR before every `write(2)`.
const ENTRY_MODES: u32 = 0o1777;

/// Applies a chmod/chown request; `mask` limits the mode bits that may be set.
fn set_owner_mode(
    cur: (&mut u32, &mut u32, &mut u32),
    new: (Option<u32>, Option<u32>, Option<u32>),
    mask: u32,
) {
    if let Some(m) = new.0 {
        *cur.0 = m & mask;
    }
    if let Some(u) = new.1 {
        *cur.1 = u;
    }
    if let Some(g) = new.2 {
        *cur.2 = g;
    }
}

fn kind_name(k: PoolKind) -> &'static str {
    match k {
        PoolKind::Memfs => "memfs",
        PoolKind::Devdax => "devdax",
        PoolKind::File => "file",
    }
}
