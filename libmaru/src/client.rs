//! The client: [`Handler`] talks to marud over its control socket and maps
//! pool memory directly.
//!
//! Fast paths that take no round trip:
//! - `exists` reads the namespace's shared index (mapped read-only);
//! - `retrieve` of a key this handler retrieved before checks the index for the
//!   same generation and returns the mapping it already holds;
//! - `alloc` of small sizes takes a spare from a batch granted earlier;
//! - `store_async` queues the publication; `flush` waits for all of them.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::index::{FLAG_PINNED, SlotView, Table};
use crate::mapping::{MapInner, Mapping};
use crate::name::EntryPath;
use crate::proto::{
    self, Body, Grant, Located, MAX_FDS_PER_FRAME, NsInfo, Op, Outcome, PROTOCOL_VERSION, PoolInfo,
    PoolKind, Request, Response, Stats,
};

/// Where marud listens by default.
pub const DEFAULT_SOCKET: &str = "/run/maru/marud.sock";

/// Client settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// The daemon's control socket (`MARU_SOCKET` overrides the default).
    pub socket: PathBuf,
    /// A name shown in the daemon's per-client statistics.
    pub client_name: String,
    /// How long to wait for a reply.
    pub timeout: Duration,
    /// Allocations of at most this many bytes are requested in batches once a size repeats.
    pub batch_alloc_max: u64,
    /// Most allocations one batch requests.
    pub batch_alloc_count: u32,
    /// Most bytes one batch requests (spares count against the pool until used or freed).
    pub batch_alloc_bytes: u64,
    /// Most mappings kept for fast repeated retrieval.
    pub cache_entries: usize,
    /// Most bytes of mappings kept for fast repeated retrieval.
    pub cache_bytes: u64,
    /// Pool to allocate from (by name); the daemon's placement policy when `None`.
    pub pool: Option<String>,
    /// Map retrieved entries with `MAP_POPULATE` (page tables built at once, no faults later).
    pub populate: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            socket: std::env::var_os("MARU_SOCKET")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET)),
            client_name: format!("pid-{}", std::process::id()),
            timeout: Duration::from_secs(30),
            batch_alloc_max: 1 << 20,
            batch_alloc_count: 64,
            batch_alloc_bytes: 1 << 20,
            cache_entries: 4096,
            cache_bytes: 1 << 30,
            pool: None,
            populate: true,
        }
    }
}

/// A writable allocation, published with [`Handler::store`].
pub struct AllocHandle {
    grant: Grant,
    map: memmap2::MmapMut,
    start: usize,
}

impl AllocHandle {
    /// The writable bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let n = self.grant.size as usize;
        &mut self.map[self.start..self.start + n]
    }

    /// The bytes written so far.
    pub fn as_slice(&self) -> &[u8] {
        &self.map[self.start..self.start + self.grant.size as usize]
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.grant.size as usize
    }

    /// True for a zero-sized allocation (never handed out).
    pub fn is_empty(&self) -> bool {
        self.grant.size == 0
    }

    /// Pool id of the allocation.
    pub fn pool(&self) -> u32 {
        self.grant.pool
    }
}

impl std::fmt::Debug for AllocHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AllocHandle")
            .field("grant", &self.grant)
            .finish()
    }
}

struct Spare {
    grant: Grant,
    file: Option<File>,
}

struct NsIndex {
    map: memmap2::Mmap,
    removals_seen: u64,
}

impl NsIndex {
    fn table(&self) -> Option<Table<'_>> {
        // SAFETY: the mapping is page aligned, lives as long as self, and the daemon only
        // writes it through atomics (see crate::index).
        unsafe { Table::from_raw(self.map.as_ptr(), self.map.len()) }
    }
}

struct Cached {
    generation: u64,
    map: Mapping,
    used: u64,
}

enum Pending {
    Publish(String),
    Release,
    Alloc(u64),
}

struct Inner {
    cfg: Config,
    sock: UnixStream,
    reader: proto::FrameReader,
    next_id: u64,
    session: u64,
    server: String,
    pools: Vec<PoolInfo>,
    pool_ro: HashMap<u32, Arc<File>>,
    pool_rw: HashMap<u32, Arc<File>>,
    spares: HashMap<u64, Vec<Spare>>,
    sizes_seen: HashMap<u64, u32>,
    refilling: std::collections::HashSet<u64>,
    pending: HashMap<u64, Pending>,
    async_errors: Vec<(String, Error)>,
    indexes: HashMap<String, NsIndex>,
    cache: HashMap<(String, String), Cached>,
    cache_bytes: u64,
    clock: u64,
    releases: Arc<Mutex<Vec<u64>>>,
}

/// A connection to marud with the store's verbs.
pub struct Handler {
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for Handler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handler").finish_non_exhaustive()
    }
}

/// A sealed entry's description (see [`Handler::stat`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct EntryInfo {
    /// `ns/key`.
    pub path: String,
    /// Unique id of this sealed entry.
    pub generation: u64,
    /// Size in bytes.
    pub size: u64,
    /// Pool name.
    pub pool: String,
    /// Pool kind.
    pub kind: PoolKind,
    /// Offset in the pool (raw pools).
    pub offset: u64,
    /// Pinned against eviction.
    pub pinned: bool,
}

/// What `batch_store` reports per key.
pub type BatchResult = Vec<Result<()>>;

impl Handler {
    /// Connects and performs the handshake.
    pub fn connect(cfg: Config) -> Result<Self> {
        let sock = UnixStream::connect(&cfg.socket).map_err(|e| {
            Error::Io(std::io::Error::new(
                e.kind(),
                format!("cannot connect to marud at {}: {e}", cfg.socket.display()),
            ))
        })?;
        sock.set_read_timeout(Some(cfg.timeout))?;
        sock.set_write_timeout(Some(cfg.timeout))?;
        let mut inner = Inner {
            cfg,
            sock,
            reader: proto::FrameReader::new(),
            next_id: 1,
            session: 0,
            server: String::new(),
            pools: Vec::new(),
            pool_ro: HashMap::new(),
            pool_rw: HashMap::new(),
            spares: HashMap::new(),
            sizes_seen: HashMap::new(),
            refilling: std::collections::HashSet::new(),
            pending: HashMap::new(),
            async_errors: Vec::new(),
            indexes: HashMap::new(),
            cache: HashMap::new(),
            cache_bytes: 0,
            clock: 0,
            releases: Arc::new(Mutex::new(Vec::new())),
        };
        let name = inner.cfg.client_name.clone();
        let (body, _) = inner.call(Op::Hello {
            version: PROTOCOL_VERSION,
            client: name,
        })?;
        match body {
            Body::Hello {
                version,
                session,
                pools,
                server,
            } => {
                inner.server = server;
                if version != PROTOCOL_VERSION {
                    return Err(Error::Protocol(format!(
                        "daemon speaks protocol {version}, this client {PROTOCOL_VERSION}"
                    )));
                }
                inner.session = session;
                // Held mappings keep deleted and evicted entries' memory alive until this
                // client's next call: never let them take more than an eighth of the pools.
                let capacity: u64 = pools.iter().map(|p| p.capacity).sum();
                inner.cfg.cache_bytes = inner.cfg.cache_bytes.min(capacity / 8);
                inner.pools = pools;
            }
            other => return Err(unexpected(&other)),
        }
        Ok(Handler {
            inner: Mutex::new(inner),
        })
    }

    /// Connects with the default configuration.
    pub fn connect_default() -> Result<Self> {
        Self::connect(Config::default())
    }

    /// This connection's session id.
    pub fn session(&self) -> u64 {
        self.inner.lock().session
    }

    /// The daemon's pools as of the handshake.
    pub fn pools(&self) -> Vec<PoolInfo> {
        self.inner.lock().pools.clone()
    }

    /// Creates a namespace (parents must exist).
    pub fn mkdir(&self, ns: &str, mode: u32) -> Result<()> {
        self.inner
            .lock()
            .call(Op::Mkdir {
                ns: ns.to_owned(),
                mode,
            })
            .map(drop)
    }

    /// Sets (or clears, with `None`) the quota of namespace `ns`: the most bytes of sealed
    /// entries it and the namespaces under it may hold. Root only; stores that would go over
    /// it fail with [`Error::Quota`] (`EDQUOT`).
    pub fn set_quota(&self, ns: &str, bytes: Option<u64>) -> Result<()> {
        self.inner
            .lock()
            .call(Op::SetQuota {
                ns: ns.to_owned(),
                bytes,
            })
            .map(drop)
    }

    /// Removes an empty namespace.
    pub fn rmdir(&self, ns: &str) -> Result<()> {
        self.inner
            .lock()
            .call(Op::Rmdir { ns: ns.to_owned() })
            .map(drop)
    }

    /// Allocates `size` writable bytes in the pool.
    pub fn alloc(&self, size: u64) -> Result<AllocHandle> {
        self.inner.lock().alloc(size)
    }

    /// Gives an allocation back without publishing it.
    pub fn free(&self, handle: AllocHandle) -> Result<()> {
        let id = handle.grant.alloc;
        drop(handle);
        self.inner
            .lock()
            .call(Op::Free { allocs: vec![id] })
            .map(drop)
    }

    /// Publishes `handle` under `path` (`ns/key`) and waits for the daemon.
    /// Fails with [`Error::Exists`] if the key is taken (the allocation is then freed).
    pub fn store(&self, path: &str, handle: AllocHandle) -> Result<()> {
        self.store_len(path, handle, None)
    }

    /// Like [`store`](Self::store), publishing only the first `len` bytes.
    pub fn store_len(&self, path: &str, handle: AllocHandle, len: Option<u64>) -> Result<()> {
        let p = EntryPath::parse(path)?;
        let op = publish_op(&p, handle, len)?;
        self.inner.lock().call(op).map(drop)
    }

    /// Queues the publication of `handle` under `path` without waiting.
    /// Errors surface at the next [`flush`](Self::flush). A crash before the daemon
    /// handles it publishes nothing (the allocation is reclaimed).
    pub fn store_async(&self, path: &str, handle: AllocHandle) -> Result<()> {
        let p = EntryPath::parse(path)?;
        let op = publish_op(&p, handle, None)?;
        let mut g = self.inner.lock();
        let id = g.send(op, &[])?;
        g.pending.insert(id, Pending::Publish(p.to_string()));
        Ok(())
    }

    /// Waits until every queued publication is done; returns the failed ones.
    pub fn flush(&self) -> Result<Vec<(String, Error)>> {
        let mut g = self.inner.lock();
        while !g.pending.is_empty() {
            g.recv_one()?;
        }
        Ok(std::mem::take(&mut g.async_errors))
    }

    /// Stores a copy of `data` under `path` (alloc + copy + store).
    pub fn put(&self, path: &str, data: &[u8]) -> Result<()> {
        let mut h = self.alloc(data.len().max(1) as u64)?;
        h.as_mut_slice()[..data.len()].copy_from_slice(data);
        self.store_len(path, h, Some(data.len() as u64))
    }

    /// Publishes many handles; one outcome per item, in order.
    pub fn batch_store(&self, items: Vec<(String, AllocHandle)>) -> Result<BatchResult> {
        let mut g = self.inner.lock();
        let mut ids = Vec::with_capacity(items.len());
        for (path, h) in items {
            let p = match EntryPath::parse(&path) {
                Ok(p) => p,
                Err(e) => {
                    ids.push(Err(e));
                    continue;
                }
            };
            let op = publish_op(&p, h, None)?;
            ids.push(Ok(g.send(op, &[])?));
        }
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            out.push(match id {
                Ok(id) => g.wait(id).map(drop),
                Err(e) => Err(e),
            });
        }
        Ok(out)
    }

    /// Maps a sealed entry read-only: the pool's own pages. `None` if absent.
    pub fn retrieve(&self, path: &str) -> Result<Option<Mapping>> {
        let p = EntryPath::parse(path)?;
        let mut g = self.inner.lock();
        let mut out = g.retrieve_many(p.ns(), &[p.key().to_owned()])?;
        Ok(out.pop().flatten())
    }

    /// Retrieves many entries; one item per path, in order.
    pub fn batch_retrieve(&self, paths: &[&str]) -> Result<Vec<Option<Mapping>>> {
        let mut g = self.inner.lock();
        let mut out: Vec<Option<Mapping>> = vec![None; paths.len()];
        // Group by namespace, keep positions.
        let mut groups: Vec<(String, Vec<(usize, String)>)> = Vec::new();
        for (i, path) in paths.iter().enumerate() {
            let p = EntryPath::parse(path)?;
            match groups.iter_mut().find(|(ns, _)| ns == p.ns()) {
                Some((_, v)) => v.push((i, p.key().to_owned())),
                None => groups.push((p.ns().to_owned(), vec![(i, p.key().to_owned())])),
            }
        }
        for (ns, items) in groups {
            let keys: Vec<String> = items.iter().map(|(_, k)| k.clone()).collect();
            let maps = g.retrieve_many(&ns, &keys)?;
            for ((i, _), m) in items.into_iter().zip(maps) {
                out[i] = m;
            }
        }
        Ok(out)
    }

    /// True if a sealed entry exists at `path`.
    pub fn exists(&self, path: &str) -> Result<bool> {
        let p = EntryPath::parse(path)?;
        let mut g = self.inner.lock();
        g.exists(p.ns(), p.key())
    }

    /// `exists` for many paths.
    pub fn batch_exists(&self, paths: &[&str]) -> Result<Vec<bool>> {
        let mut g = self.inner.lock();
        let mut out = Vec::with_capacity(paths.len());
        for path in paths {
            let p = EntryPath::parse(path)?;
            out.push(g.exists(p.ns(), p.key())?);
        }
        Ok(out)
    }

    /// Deletes a sealed entry. Mappings held elsewhere stay valid until dropped.
    pub fn delete(&self, path: &str) -> Result<()> {
        self.batch_op(&[path], |ns, keys| Op::Delete { ns, keys })?
            .pop()
            .expect("one result")
    }

    /// Deletes many entries; one outcome per path.
    pub fn batch_delete(&self, paths: &[&str]) -> Result<BatchResult> {
        self.batch_op(paths, |ns, keys| Op::Delete { ns, keys })
    }

    /// Pins an entry (never evicted while pinned).
    pub fn pin(&self, path: &str) -> Result<()> {
        self.batch_pin(&[path], true)?.pop().expect("one result")
    }

    /// Unpins an entry.
    pub fn unpin(&self, path: &str) -> Result<()> {
        self.batch_pin(&[path], false)?.pop().expect("one result")
    }

    /// Pins or unpins many entries.
    pub fn batch_pin(&self, paths: &[&str], pinned: bool) -> Result<BatchResult> {
        self.batch_op(paths, |ns, keys| Op::Pin { ns, keys, pinned })
    }

    /// Describes a sealed entry without mapping it (from the shared index). `None` if absent.
    pub fn stat(&self, path: &str) -> Result<Option<EntryInfo>> {
        let p = EntryPath::parse(path)?;
        let mut g = self.inner.lock();
        if !g.exists(p.ns(), p.key())? {
            return Ok(None);
        }
        let Some(v) = g.lookup(p.ns(), p.key())? else {
            return Ok(None);
        };
        let pool = g.pools.iter().find(|x| x.id == v.pool);
        Ok(Some(EntryInfo {
            path: p.to_string(),
            generation: v.generation,
            size: v.size,
            pool: pool.map(|x| x.name.clone()).unwrap_or_default(),
            kind: pool.map(|x| x.kind).unwrap_or(PoolKind::Memfs),
            offset: v.offset,
            pinned: v.flags & FLAG_PINNED != 0,
        }))
    }

    /// The daemon's name and version, from the handshake.
    pub fn server(&self) -> String {
        self.inner.lock().server.clone()
    }

    /// True if the entry is pinned (from the shared index).
    pub fn is_pinned(&self, path: &str) -> Result<bool> {
        let p = EntryPath::parse(path)?;
        let mut g = self.inner.lock();
        Ok(g.lookup(p.ns(), p.key())?
            .is_some_and(|v| v.flags & FLAG_PINNED != 0))
    }

    /// Lists a namespace ("" for the root).
    pub fn list(&self, ns: &str) -> Result<(Option<NsInfo>, Vec<NsInfo>, Vec<Located>)> {
        match self.inner.lock().call(Op::List { ns: ns.to_owned() })?.0 {
            Body::Listing {
                ns,
                children,
                entries,
            } => Ok((ns, children, entries)),
            other => Err(unexpected(&other)),
        }
    }

    /// Store-wide statistics.
    pub fn stats(&self) -> Result<Stats> {
        match self.inner.lock().call(Op::Stats)?.0 {
            Body::Stats(s) => Ok(s),
            other => Err(unexpected(&other)),
        }
    }

    /// Asks the daemon to evict LRU entries until `bytes` are free.
    pub fn evict(&self, bytes: u64) -> Result<(u64, u64)> {
        match self.inner.lock().call(Op::Evict { bytes })?.0 {
            Body::Evicted { entries, bytes } => Ok((entries, bytes)),
            other => Err(unexpected(&other)),
        }
    }

    /// Drops cached mappings (they keep deleted entries' memory alive).
    pub fn trim(&self) {
        let mut g = self.inner.lock();
        g.cache.clear();
        g.cache_bytes = 0;
    }

    fn batch_op(
        &self,
        paths: &[&str],
        mk: impl Fn(String, Vec<String>) -> Op,
    ) -> Result<BatchResult> {
        let mut g = self.inner.lock();
        let mut out = Vec::with_capacity(paths.len());
        for path in paths {
            let p = match EntryPath::parse(path) {
                Ok(p) => p,
                Err(e) => {
                    out.push(Err(e));
                    continue;
                }
            };
            let r = match g.call(mk(p.ns().to_owned(), vec![p.key().to_owned()])) {
                Ok((Body::Batch { mut results }, _)) => match results.pop().flatten() {
                    None => Ok(()),
                    Some(w) => Err(Error::from(w)),
                },
                Ok((other, _)) => Err(unexpected(&other)),
                Err(e) => Err(e),
            };
            out.push(r);
        }
        Ok(out)
    }
}

fn publish_op(p: &EntryPath, handle: AllocHandle, len: Option<u64>) -> Result<Op> {
    if let Some(l) = len
        && l > handle.grant.size
    {
        return Err(Error::InvalidArgument(format!(
            "length {l} exceeds the allocation of {}",
            handle.grant.size
        )));
    }
    let alloc = handle.grant.alloc;
    // Unmap before publishing: this process keeps no writable view of a sealed entry.
    drop(handle);
    Ok(Op::Publish {
        alloc,
        ns: p.ns().to_owned(),
        key: p.key().to_owned(),
        len,
    })
}

fn unexpected(b: &Body) -> Error {
    Error::Protocol(format!("unexpected reply {b:?}"))
}

impl Inner {
    fn send(&mut self, op: Op, fds: &[std::os::fd::BorrowedFd<'_>]) -> Result<u64> {
        let id = self.next_id;
        self.next_id += 1;
        let frame = proto::encode(&Request { id, op });
        proto::send_all(self.sock.as_fd(), &frame, fds).map_err(io_err)?;
        Ok(id)
    }

    /// Reads one response; async ones are settled here, others returned.
    fn recv_one(&mut self) -> Result<Option<(Response, Vec<OwnedFd>)>> {
        let body = loop {
            if let Some(b) = self.reader.next_frame()? {
                break b;
            }
            let n = self.reader.read_from(self.sock.as_fd()).map_err(io_err)?;
            if n == 0 {
                return Err(Error::Disconnected);
            }
        };
        let resp: Response = proto::decode(&body)?;
        let fds = self.reader.take_fds(resp.fds as usize)?;
        if let Some(p) = self.pending.remove(&resp.id) {
            match (p, resp.result) {
                (Pending::Publish(path), Outcome::Err(w)) => {
                    self.async_errors.push((path, Error::from(w)));
                }
                (Pending::Alloc(size), Outcome::Ok(Body::Allocated { grants })) => {
                    self.refilling.remove(&size);
                    let spares = self.spares_from(grants, fds)?;
                    self.spares.entry(size).or_default().extend(spares);
                }
                (Pending::Alloc(size), _) => {
                    // A failed refill (full pool...) surfaces at the next synchronous alloc.
                    self.refilling.remove(&size);
                }
                _ => {}
            }
            return Ok(None);
        }
        Ok(Some((resp, fds)))
    }

    fn wait(&mut self, id: u64) -> Result<(Body, Vec<OwnedFd>)> {
        loop {
            if let Some((resp, fds)) = self.recv_one()? {
                if resp.id != id {
                    return Err(Error::Protocol(format!(
                        "reply to request {} while waiting for {id}",
                        resp.id
                    )));
                }
                return match resp.result {
                    Outcome::Ok(b) => Ok((b, fds)),
                    Outcome::Err(w) => Err(Error::from(w)),
                };
            }
        }
    }

    fn call(&mut self, op: Op) -> Result<(Body, Vec<OwnedFd>)> {
        self.flush_releases()?;
        let id = self.send(op, &[])?;
        self.wait(id)
    }

    fn flush_releases(&mut self) -> Result<()> {
        let gens = std::mem::take(&mut *self.releases.lock());
        if !gens.is_empty() {
            let id = self.send(Op::Release { gens }, &[])?;
            self.pending.insert(id, Pending::Release);
        }
        Ok(())
    }

    fn pool_kind(&self, id: u32) -> Result<PoolKind> {
        self.pools
            .iter()
            .find(|p| p.id == id)
            .map(|p| p.kind)
            .ok_or_else(|| Error::Protocol(format!("unknown pool {id}")))
    }

    /// How many allocations of `size` one request asks for.
    fn batch_count(&mut self, size: u64) -> u32 {
        // Batch only sizes that repeat (KV chunks of one model do), within a byte budget.
        if self.sizes_seen.len() > 4096 {
            self.sizes_seen.clear();
        }
        let seen = self.sizes_seen.entry(size).or_insert(0);
        *seen = seen.saturating_add(1);
        let repeats = *seen >= 2;
        // The byte budget covers every spare this handler holds, of all sizes.
        let held: u64 = self.spares.iter().map(|(sz, v)| sz * v.len() as u64).sum();
        let budget = self.cfg.batch_alloc_bytes.saturating_sub(held);
        if repeats && size <= self.cfg.batch_alloc_max && budget / size >= 2 {
            let by_bytes = (budget / size).max(1) as u32;
            self.cfg
                .batch_alloc_count
                .min(by_bytes)
                .clamp(1, MAX_FDS_PER_FRAME as u32)
        } else {
            1
        }
    }

    fn alloc(&mut self, size: u64) -> Result<AllocHandle> {
        if size == 0 {
            return Err(Error::InvalidArgument("allocation of 0 bytes".into()));
        }
        // A refill requested earlier may be on its way: take it rather than asking again.
        while self.spares.get(&size).is_none_or(Vec::is_empty) && self.refilling.contains(&size) {
            self.recv_one()?;
        }
        if let Some(s) = self.spares.get_mut(&size).and_then(Vec::pop) {
            let left = self.spares.get(&size).map_or(0, Vec::len);
            let batch = self.cfg.batch_alloc_count as usize;
            if left < batch / 2 && !self.refilling.contains(&size) && batch > 1 {
                // Ask for the next batch now; the daemon creates it while we keep storing.
                let count = self.batch_count(size);
                if count > 1 {
                    let op = Op::Alloc {
                        size,
                        count,
                        pool: self.cfg.pool.clone(),
                    };
                    let id = self.send(op, &[])?;
                    self.pending.insert(id, Pending::Alloc(size));
                    self.refilling.insert(size);
                }
            }
            return self.map_grant(s);
        }
        let count = self.batch_count(size);
        let op = Op::Alloc {
            size,
            count,
            pool: self.cfg.pool.clone(),
        };
        let (body, fds) = match self.call(op.clone()) {
            // Spares of other sizes hold pool memory: give them back and try once more.
            Err(Error::NoSpace(_)) if self.spares.values().any(|v| !v.is_empty()) => {
                self.free_spares()?;
                self.call(op)?
            }
            r => r?,
        };
        let grants = match body {
            Body::Allocated { grants } => grants,
            other => return Err(unexpected(&other)),
        };
        let mut spares = self.spares_from(grants, fds)?;
        let first = spares
            .pop()
            .ok_or_else(|| Error::Protocol("empty grant".into()))?;
        self.spares.entry(size).or_default().extend(spares);
        self.map_grant(first)
    }

    /// Gives every spare allocation back to the daemon.
    fn free_spares(&mut self) -> Result<()> {
        let ids: Vec<u64> = self
            .spares
            .drain()
            .flat_map(|(_, v)| v.into_iter().map(|s| s.grant.alloc))
            .collect();
        if !ids.is_empty() {
            self.call(Op::Free { allocs: ids })?;
        }
        Ok(())
    }

    fn spares_from(&mut self, grants: Vec<Grant>, fds: Vec<OwnedFd>) -> Result<Vec<Spare>> {
        let mut fds = fds.into_iter();
        let mut spares = Vec::with_capacity(grants.len());
        for g in grants {
            let fd = if g.fd {
                Some(
                    fds.next()
                        .ok_or_else(|| Error::Protocol("missing descriptor".into()))?,
                )
            } else {
                None
            };
            let file = match self.pool_kind(g.pool)? {
                PoolKind::Memfs => {
                    Some(File::from(fd.ok_or_else(|| {
                        Error::Protocol("memfs grant without a file".into())
                    })?))
                }
                _ => {
                    if let Some(fd) = fd {
                        self.pool_rw.insert(g.pool, Arc::new(File::from(fd)));
                    }
                    None
                }
            };
            spares.push(Spare { grant: g, file });
        }
        Ok(spares)
    }

    fn map_grant(&mut self, s: Spare) -> Result<AllocHandle> {
        let size = s.grant.size as usize;
        let (map, start) = match s.file {
            // SAFETY: the file is a WRITING entry only this client holds; nobody else maps it.
            Some(f) => (
                unsafe { memmap2::MmapOptions::new().len(size).map_mut(&f)? },
                0,
            ),
            None => {
                let f = self
                    .pool_rw
                    .get(&s.grant.pool)
                    .ok_or_else(|| Error::Protocol("no descriptor for the pool".into()))?;
                let page = page_size() as u64;
                let base = s.grant.offset / page * page;
                let start = (s.grant.offset - base) as usize;
                // SAFETY: the range was granted to this client alone until it publishes or frees it.
                let m = unsafe {
                    memmap2::MmapOptions::new()
                        .offset(base)
                        .len(start + size)
                        .map_mut(&**f)?
                };
                (m, start)
            }
        };
        Ok(AllocHandle {
            grant: s.grant,
            map,
            start,
        })
    }

    fn index(&mut self, ns: &str) -> Result<&NsIndex> {
        let stale = match self.indexes.get(ns) {
            None => true,
            Some(ix) => ix.table().is_none_or(|t| t.retired()),
        };
        if stale {
            let (body, mut fds) = self.call(Op::Index { ns: ns.to_owned() })?;
            if !matches!(body, Body::Index { .. }) || fds.len() != 1 {
                return Err(Error::Protocol("index reply without a descriptor".into()));
            }
            let f = File::from(fds.pop().expect("one fd"));
            // SAFETY: a read-only shared mapping of the daemon's index memfd; accessed only
            // through atomics by crate::index.
            let map = unsafe { memmap2::Mmap::map(&f)? };
            let ix = NsIndex {
                map,
                removals_seen: 0,
            };
            if ix.table().is_none() {
                return Err(Error::Protocol("malformed index table".into()));
            }
            self.indexes.insert(ns.to_owned(), ix);
        }
        Ok(self.indexes.get(ns).expect("present"))
    }

    fn lookup(&mut self, ns: &str, key: &str) -> Result<Option<SlotView>> {
        let ix = self.index(ns)?;
        Ok(ix.table().and_then(|t| t.lookup(key.as_bytes())))
    }

    /// True if publications through the mount are imminent in `ns` (a miss must ask marud).
    fn pending(&mut self, ns: &str) -> Result<bool> {
        let ix = self.index(ns)?;
        Ok(ix.table().is_some_and(|t| t.pending() > 0))
    }

    fn exists(&mut self, ns: &str, key: &str) -> Result<bool> {
        if self.lookup(ns, key)?.is_some() {
            return Ok(true);
        }
        if !self.pending(ns)? {
            return Ok(false);
        }
        match self.call(Op::Exists {
            ns: ns.to_owned(),
            keys: vec![key.to_owned()],
        })? {
            (Body::Exists { found }, _) => Ok(found.first().copied().unwrap_or(false)),
            (other, _) => Err(unexpected(&other)),
        }
    }

    fn retrieve_many(&mut self, ns: &str, keys: &[String]) -> Result<Vec<Option<Mapping>>> {
        self.sweep_cache(ns);
        let mut out: Vec<Option<Mapping>> = vec![None; keys.len()];
        let mut miss: Vec<usize> = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            let Some(v) = self.lookup(ns, k)? else {
                // Not in the index: absent, unless a publication is imminent (ask marud).
                if self.pending(ns)? {
                    miss.push(i);
                }
                continue;
            };
            self.clock += 1;
            let clock = self.clock;
            match self.cache.get_mut(&(ns.to_owned(), k.clone())) {
                Some(c) if c.generation == v.generation => {
                    c.used = clock;
                    out[i] = Some(c.map.clone());
                }
                _ => miss.push(i),
            }
        }
        for chunk in miss.chunks(MAX_FDS_PER_FRAME) {
            let ks: Vec<String> = chunk.iter().map(|&i| keys[i].clone()).collect();
            let (body, fds) = self.call(Op::Retrieve {
                ns: ns.to_owned(),
                keys: ks,
            })?;
            let items = match body {
                Body::Retrieved { items } => items,
                other => return Err(unexpected(&other)),
            };
            if items.len() != chunk.len() {
                return Err(Error::Protocol("retrieve reply of the wrong length".into()));
            }
            let mut fds = fds.into_iter();
            for (&i, item) in chunk.iter().zip(items) {
                let Some(loc) = item else { continue };
                let fd = if loc.fd { fds.next() } else { None };
                let m = self.map_located(&loc, fd)?;
                self.cache_insert(ns, &keys[i], &m);
                out[i] = Some(m);
            }
        }
        Ok(out)
    }

    fn map_located(&mut self, loc: &Located, fd: Option<OwnedFd>) -> Result<Mapping> {
        let kind = self.pool_kind(loc.pool)?;
        let inner = if kind == PoolKind::Memfs {
            let f = File::from(fd.ok_or_else(|| Error::Protocol("memfs entry without fd".into()))?);
            let mut o = memmap2::MmapOptions::new();
            o.len(loc.size.max(1) as usize);
            if self.cfg.populate {
                o.populate();
            }
            // SAFETY: a read-only shared mapping of a sealed entry's file; sealed entries are
            // never written again (see Mapping::as_slice).
            let map = unsafe { o.map(&f)? };
            MapInner {
                map,
                start: 0,
                len: loc.size as usize,
                generation: loc.generation,
                release: None,
            }
        } else {
            if let Some(fd) = fd {
                self.pool_ro.insert(loc.pool, Arc::new(File::from(fd)));
            }
            let f = self
                .pool_ro
                .get(&loc.pool)
                .ok_or_else(|| Error::Protocol("no descriptor for the pool".into()))?;
            let page = page_size() as u64;
            let base = loc.offset / page * page;
            let start = (loc.offset - base) as usize;
            // SAFETY: the extent holds a sealed entry under a lease this mapping owns until
            // MapInner::drop queues its release; the daemon does not reuse it meanwhile.
            let map = unsafe {
                memmap2::MmapOptions::new()
                    .offset(base)
                    .len((start + loc.size as usize).max(1))
                    .map(&**f)?
            };
            MapInner {
                map,
                start,
                len: loc.size as usize,
                generation: loc.generation,
                release: Some(self.releases.clone()),
            }
        };
        Ok(Mapping {
            inner: Arc::new(inner),
        })
    }

    fn cache_insert(&mut self, ns: &str, key: &str, m: &Mapping) {
        if self.cfg.cache_entries == 0 || m.len() as u64 > self.cfg.cache_bytes {
            return;
        }
        self.clock += 1;
        let c = Cached {
            generation: m.generation(),
            map: m.clone(),
            used: self.clock,
        };
        if let Some(old) = self.cache.insert((ns.to_owned(), key.to_owned()), c) {
            self.cache_bytes -= old.map.len() as u64;
        }
        self.cache_bytes += m.len() as u64;
        while self.cache.len() > self.cfg.cache_entries || self.cache_bytes > self.cfg.cache_bytes {
            let victim = self
                .cache
                .iter()
                .min_by_key(|(_, c)| c.used)
                .map(|(k, _)| k.clone())
                .expect("non-empty");
            let c = self.cache.remove(&victim).expect("present");
            self.cache_bytes -= c.map.len() as u64;
        }
    }

    /// Drops cached mappings of entries removed since the last look, so this client
    /// does not keep deleted or evicted entries' memory alive.
    fn sweep_cache(&mut self, ns: &str) {
        let Some(ix) = self.indexes.get(ns) else {
            return;
        };
        let Some(t) = ix.table() else { return };
        let removals = t.removals();
        if removals == ix.removals_seen {
            return;
        }
        let stale: Vec<(String, String)> = self
            .cache
            .iter()
            .filter(|((cns, k), c)| {
                cns == ns
                    && t.lookup(k.as_bytes())
                        .is_none_or(|v| v.generation != c.generation)
            })
            .map(|(k, _)| k.clone())
            .collect();
        for k in stale {
            if let Some(c) = self.cache.remove(&k) {
                self.cache_bytes -= c.map.len() as u64;
            }
        }
        if let Some(ix) = self.indexes.get_mut(ns) {
            ix.removals_seen = removals;
        }
    }
}

fn io_err(e: std::io::Error) -> Error {
    match e.kind() {
        std::io::ErrorKind::BrokenPipe
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::UnexpectedEof => Error::Disconnected,
        _ => Error::Io(e),
    }
}

/// The system page size.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
}

/// Measures a closure (used by the benchmark harness).
pub fn time<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let t = Instant::now();
    let v = f();
    (v, t.elapsed())
}
