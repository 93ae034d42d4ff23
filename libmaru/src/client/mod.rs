//! The client: [`Handler`] talks to marud over its control socket and maps
//! pool memory directly.
//!
//! Fast paths that take no round trip:
//! - `exists` reads the namespace's shared index (mapped read-only);
//! - `retrieve` of a key this handler retrieved before checks the index for the
//!   same generation and returns the mapping it already holds;
//! - `alloc` of small sizes takes a spare from a batch granted earlier;
//! - `store_async` queues the publication; `flush` waits for all of them.

mod alloc;
mod lookup;
mod state;

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::index::{FLAG_HELD, FLAG_PINNED};
use crate::mapping::Mapping;
use crate::name::EntryPath;
use crate::proto::{
    self, Body, Grant, Located, NsInfo, Op, PROTOCOL_VERSION, PoolInfo, PoolKind, Stats,
};

pub use state::{Config, DEFAULT_SOCKET};
use state::{Inner, Pending, unexpected};

/// A writable allocation, published with [`Handler::store`].
pub struct AllocHandle {
    grant: Grant,
    /// Where the bytes are mapped writable; gone once the handle was given up to a publication.
    map: Option<Writable>,
    /// Where the allocation's first byte is in `map`.
    start: usize,
    /// The file mapped (the entry's or its pack for memfs pools, the pool for raw ones); the
    /// allocation's pages start at `base` in it.
    file: Arc<std::fs::File>,
    base: u64,
    /// Published or freed: the grant is no longer this handle's.
    done: bool,
}

/// The mapping an allocation's bytes are written through.
enum Writable {
    /// A mapping of the allocation's pages alone (a file of its own, a range of a raw pool).
    Own(memmap2::MmapMut),
    /// Its pack's mapping, shared with the other allocations carved from it (each has pages of
    /// its own in it).
    Pack(Arc<state::PackMap>),
}

impl Writable {
    /// The address of byte `at` of the mapping, and the mapping's length.
    fn at(&self, at: usize) -> (*mut u8, usize) {
        match self {
            Writable::Own(m) => (m.as_ptr().cast_mut().wrapping_add(at), m.len()),
            Writable::Pack(p) => (p.map.as_mut_ptr().wrapping_add(at), p.map.len()),
        }
    }
}

impl AllocHandle {
    /// Address of the first writable byte (valid while the handle lives, unless a publication
    /// with [`AfterPublish::Nothing`] gave its bytes up).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_slice().as_mut_ptr()
    }

    /// The allocation's id at marud.
    pub fn id(&self) -> u64 {
        self.grant.alloc
    }

    /// Offset of the allocation in its pool (raw pools), or in its pack (memfs; 0 for an
    /// allocation in a file of its own).
    pub fn offset(&self) -> u64 {
        self.grant.offset
    }

    /// True once the allocation was published or freed through
    /// [`Handler::publish`] / [`Handler::free_in_place`]: its bytes are then this
    /// process's private copy.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Gives up the grant's shared pages but keeps the address range valid: the range
    /// becomes a private copy-on-write mapping of the same bytes (reads see what was
    /// written, later writes stay in this process and never reach the pool). Where the
    /// pool refuses private mappings (device DAX), the range becomes read-only instead.
    fn detach(&mut self) -> Result<()> {
        use nix::sys::mman::{MapFlags, ProtFlags, mmap, mprotect};
        let map = self.map.as_ref().expect("detached before it is given up");
        // The allocation's pages: all of its own mapping, or its pages in its pack's.
        let (ptr, len) = match map {
            Writable::Own(m) => (m.as_ptr().cast_mut(), m.len()),
            Writable::Pack(_) => {
                let page = page_size();
                let len = (self.grant.size as usize).div_ceil(page) * page;
                (map.at(self.start).0, len)
            }
        };
        let len = std::num::NonZeroUsize::new(len).expect("never empty");
        let addr = std::ptr::NonNull::new(ptr.cast()).expect("mapped");
        // SAFETY: the range is this handle's pages alone (its own mapping, or pages of its
        // pack no other allocation is carved from), replaced by a mapping of the same length
        // at the same address (MAP_FIXED); the mapping holding them still unmaps them.
        let remapped = unsafe {
            mmap(
                Some(addr.addr()),
                len,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_PRIVATE | MapFlags::MAP_FIXED,
                &*self.file,
                self.base as i64,
            )
        };
        if remapped.is_err() {
            // SAFETY: same range as above, made read-only; writes through it now fault.
            unsafe { mprotect(addr, len.get(), ProtFlags::PROT_READ) }
                .map_err(|e| Error::Io(e.into()))?;
        }
        self.done = true;
        if matches!(map, Writable::Pack(_)) && remapped.is_ok() {
            // A copy-on-write page not yet written still reads the pack, and marud punches
            // the pages of an allocation that leaves it (freed, or published where its pack's
            // readers may not read): each page is copied now.
            let page = page_size();
            for at in (0..len.get()).step_by(page) {
                // SAFETY: inside the private, writable mapping just made; writing a byte
                // back makes the kernel copy its page.
                unsafe {
                    let b = ptr.add(at);
                    b.write_volatile(b.read_volatile());
                }
            }
        }
        Ok(())
    }

    /// Lets go of the grant being published: this process keeps no shared writable view of an
    /// entry it asked to seal, only a private copy where the caller keeps the handle.
    fn let_go(&mut self, keep: AfterPublish) -> Result<()> {
        if self.done {
            // Let go of already, before the publication was sent (see `leaves_pack`).
            return Ok(());
        }
        match keep {
            AfterPublish::PrivateCopy => self.detach(),
            AfterPublish::Nothing => {
                // Given up by its caller: unmapped now, while marud publishes.
                self.map = None;
                self.done = true;
                Ok(())
            }
        }
    }

    /// Whether publishing this allocation under namespace `ns` takes it out of its pack (the
    /// handler's allocations are packed for namespace `declared`): marud then punches its pages
    /// out of the pack, so a private copy of them must be made before the publication goes.
    fn leaves_pack(&self, ns: &str, declared: Option<&str>) -> bool {
        matches!(self.map, Some(Writable::Pack(_))) && declared != Some(ns)
    }

    /// The allocation's first byte.
    fn first(&self) -> *mut u8 {
        let map = self
            .map
            .as_ref()
            .expect("a handle given up is never used again");
        let (p, len) = map.at(self.start);
        assert!(self.start + self.grant.size as usize <= len);
        p
    }

    /// The writable bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the range is mapped (checked in `first`) while `map` lives, and is this
        // allocation's alone until it is given up; `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.first(), self.grant.size as usize) }
    }

    /// The bytes written so far.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: as in `as_mut_slice`; shared, as `&self` is.
        unsafe { std::slice::from_raw_parts(self.first(), self.grant.size as usize) }
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
    /// Offset in the pool (raw pools); the inode number of the entry's file (memfs).
    pub offset: u64,
    /// Pinned against eviction.
    pub pinned: bool,
    /// Held by some connection ([`Handler::hold`]; in cluster mode, of any host).
    pub held: bool,
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
            pool_views: HashMap::new(),
            pack_views: HashMap::new(),
            pool_rw: HashMap::new(),
            pack_maps: HashMap::new(),
            spares: HashMap::new(),
            sizes_seen: HashMap::new(),
            refilling: std::collections::HashSet::new(),
            pending: HashMap::new(),
            async_errors: Vec::new(),
            indexes: HashMap::new(),
            unlisted: std::collections::HashSet::new(),
            cache: state::MappingCache::unbounded_with_hasher(Default::default()),
            cache_bytes: 0,
            releases: Arc::new(Mutex::new(Vec::new())),
            accessed: Vec::new(),
            accessed_since: None,
            lane: None,
            lane_wait: None,
            alive_at: 0,
            closed: false,
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
        if inner.cfg.lane {
            inner.open_lane()?;
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

    /// Allocates `count` allocations of `size` bytes in one exchange (one per
    /// [`MAX_FDS_PER_FRAME`](crate::proto::MAX_FDS_PER_FRAME)), whatever their size: for a
    /// batch of entries larger than the sizes [`alloc`](Self::alloc) asks for in batches. All
    /// or none.
    pub fn alloc_many(&self, size: u64, count: usize) -> Result<Vec<AllocHandle>> {
        self.inner.lock().alloc_many(size, count)
    }

    /// Gives an allocation back without publishing it.
    pub fn free(&self, mut handle: AllocHandle) -> Result<()> {
        self.free_in_place(&mut handle)
    }

    /// Gives an allocation back, keeping `handle`'s bytes readable as this process's
    /// private copy (for callers that cannot prove nobody still looks at them).
    pub fn free_in_place(&self, handle: &mut AllocHandle) -> Result<()> {
        if handle.done {
            return Err(already_done());
        }
        handle.detach()?;
        self.inner
            .lock()
            .call(Op::Free {
                allocs: vec![handle.grant.alloc],
            })
            .map(drop)
    }

    /// Publishes `handle` under `path` like [`store_len`](Self::store_len), keeping its
    /// bytes readable as this process's private copy (writes to them after this call never
    /// reach the pool). Whatever the outcome the grant is gone: marud frees a refused one.
    pub fn publish(&self, path: &str, handle: &mut AllocHandle, len: Option<u64>) -> Result<()> {
        self.publish_then(path, handle, len, AfterPublish::PrivateCopy)
    }

    /// [`publish`](Self::publish), leaving the handle's bytes as `keep` says.
    pub fn publish_then(
        &self,
        path: &str,
        handle: &mut AllocHandle,
        len: Option<u64>,
        keep: AfterPublish,
    ) -> Result<()> {
        let p = EntryPath::parse(path)?;
        self.make_segments(&p)?;
        let op = publish_op(&p, handle, len)?;
        let mut g = self.inner.lock();
        if keep == AfterPublish::PrivateCopy
            && handle.leaves_pack(p.ns(), g.cfg.namespace.as_deref())
        {
            handle.detach()?;
        }
        let sent = g.send_alone(op);
        // While marud publishes (whatever the outcome, the grant is gone).
        let let_go = handle.let_go(keep);
        let r = sent.and_then(|id| g.wait(id)).map(drop);
        r.and(let_go)
    }

    /// [`publish`](Self::publish) for many handles in one exchange (requests pipelined);
    /// one outcome per item, in order.
    pub fn publish_many(&self, items: &mut [(&str, &mut AllocHandle)]) -> Result<BatchResult> {
        let mut items: Vec<_> = items
            .iter_mut()
            .map(|(p, h)| (*p, &mut **h, AfterPublish::PrivateCopy))
            .collect();
        self.publish_many_then(&mut items)
    }

    /// [`publish_many`](Self::publish_many), leaving each handle's bytes as its item says.
    pub fn publish_many_then(
        &self,
        items: &mut [(&str, &mut AllocHandle, AfterPublish)],
    ) -> Result<BatchResult> {
        let declared = self.inner.lock().cfg.namespace.clone();
        let mut ops = Vec::with_capacity(items.len());
        for (path, h, keep) in items.iter_mut() {
            ops.push(
                EntryPath::parse(path)
                    .and_then(|p| self.make_segments(&p).map(|()| p))
                    .and_then(|p| {
                        let op = publish_op(&p, h, None)?;
                        // As in `publish_then`.
                        if *keep == AfterPublish::PrivateCopy
                            && h.leaves_pack(p.ns(), declared.as_deref())
                        {
                            h.detach()?;
                        }
                        Ok(op)
                    }),
            );
        }
        let mut g = self.inner.lock();
        // The requests of the items that are valid, until one cannot be sent; at most
        // `WINDOW` unanswered (then half of them are read before more are sent), so that
        // neither side fills its socket with the other blocked writing too. Each valid handle,
        // sent or not, is let go of once its request is on its way (as it would be once
        // published or refused), before anyone can remove what it publishes.
        let mut answers: Vec<Result<()>> = Vec::with_capacity(ops.len());
        let mut let_go: Vec<Result<()>> = Vec::with_capacity(ops.len());
        let mut in_flight = std::collections::VecDeque::new();
        let mut failed = None;
        for (op, (_, h, keep)) in ops.into_iter().zip(items.iter_mut()) {
            let op = match op {
                Ok(op) => op,
                Err(e) => {
                    answers.push(Err(e));
                    let_go.push(Ok(()));
                    continue;
                }
            };
            if failed.is_none() && in_flight.len() >= state::WINDOW {
                while in_flight.len() > state::WINDOW / 2 {
                    let (at, id) = in_flight.pop_front().expect("in flight");
                    match g.wait_answer(id) {
                        Ok(a) => answers[at] = a.map(drop),
                        Err(e) => {
                            failed = Some(e);
                            break;
                        }
                    }
                }
            }
            // Not sent after the connection failed: the batch fails as a whole below.
            let sent = match failed {
                None => g.send(op, &[]),
                Some(_) => Err(Error::Protocol("not sent".into())),
            };
            match sent {
                Ok(id) => in_flight.push_back((answers.len(), id)),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
            answers.push(Ok(()));
            let_go.push(h.let_go(*keep));
        }
        if let Some(e) = failed {
            return Err(e);
        }
        for (at, id) in in_flight {
            answers[at] = g.wait_answer(id)?.map(drop);
        }
        Ok(answers
            .into_iter()
            .zip(let_go)
            .map(|(a, l)| a.and(l))
            .collect())
    }

    /// Creates the namespaces a long key's path nests in (see [`crate::key`]).
    fn make_segments(&self, p: &EntryPath) -> Result<()> {
        if !p.ns().ends_with(crate::key::CONTINUED) {
            return Ok(());
        }
        let full = p.to_string();
        for ns in crate::key::segment_namespaces(&full) {
            match self.mkdir(ns, 0o755) {
                Ok(()) | Err(Error::Exists(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Publishes `handle` under `path` (`ns/key`) and waits for the daemon.
    /// Fails with [`Error::Exists`] if the key is taken (the allocation is then freed).
    pub fn store(&self, path: &str, handle: AllocHandle) -> Result<()> {
        self.store_len(path, handle, None)
    }

    /// Like [`store`](Self::store), publishing only the first `len` bytes.
    pub fn store_len(&self, path: &str, mut handle: AllocHandle, len: Option<u64>) -> Result<()> {
        // The handle is the caller's no more: no private copy of its bytes to keep.
        self.publish_then(path, &mut handle, len, AfterPublish::Nothing)
    }

    /// Queues the publication of `handle` under `path` without waiting.
    /// Errors surface at the next [`flush`](Self::flush). A crash before the daemon
    /// handles it publishes nothing (the allocation is reclaimed).
    pub fn store_async(&self, path: &str, mut handle: AllocHandle) -> Result<()> {
        let p = EntryPath::parse(path)?;
        self.make_segments(&p)?;
        let op = publish_op(&p, &mut handle, None)?;
        let mut g = self.inner.lock();
        // At most `WINDOW` unanswered: marud's answers would fill the socket otherwise.
        while g.pending.len() >= state::WINDOW {
            g.recv_one()?;
        }
        let id = g.send(op, &[])?;
        // Unmapped without a private copy: the caller gave the handle up.
        drop(handle);
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
    pub fn batch_store(&self, mut items: Vec<(String, AllocHandle)>) -> Result<BatchResult> {
        let mut refs: Vec<_> = items
            .iter_mut()
            .map(|(p, h)| (p.as_str(), h, AfterPublish::Nothing))
            .collect();
        self.publish_many_then(&mut refs)
    }

    /// Maps a sealed entry read-only: the pool's own pages. `None` if absent.
    pub fn retrieve(&self, path: &str) -> Result<Option<Mapping>> {
        let p = EntryPath::parse(path)?;
        let mut g = self.inner.lock();
        let mut out = g.retrieve_many(p.ns(), &[p.key()])?;
        Ok(out.pop().flatten())
    }

    /// Retrieves many entries; one item per path, in order.
    pub fn batch_retrieve(&self, paths: &[&str]) -> Result<Vec<Option<Mapping>>> {
        let mut g = self.inner.lock();
        let mut out: Vec<Option<Mapping>> = vec![None; paths.len()];
        // Group by namespace, keep positions.
        let mut groups: Vec<(&str, Vec<usize>, Vec<&str>)> = Vec::new();
        for (i, path) in paths.iter().enumerate() {
            let (ns, key) = EntryPath::split(path)?;
            match groups.iter_mut().find(|(n, _, _)| *n == ns) {
                Some((_, at, keys)) => {
                    at.push(i);
                    keys.push(key);
                }
                None => groups.push((ns, vec![i], vec![key])),
            }
        }
        for (ns, at, keys) in groups {
            let maps = g.retrieve_many(ns, &keys)?;
            for (i, m) in at.into_iter().zip(maps) {
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

    /// Takes a hold on an entry for this connection: it is not evicted while held. Holds are
    /// counted (each `hold` needs its `unhold`), other connections' holds are their own, and
    /// all of this connection's are dropped when it closes. The persistent pin is apart.
    pub fn hold(&self, path: &str) -> Result<()> {
        self.batch_hold(&[path], true)?.pop().expect("one result")
    }

    /// Gives back one hold of this connection (`NotFound` if it holds none on the entry).
    pub fn unhold(&self, path: &str) -> Result<()> {
        self.batch_hold(&[path], false)?.pop().expect("one result")
    }

    /// Takes or gives back one hold per path, in one request per namespace; one outcome per
    /// path.
    pub fn batch_hold(&self, paths: &[&str], hold: bool) -> Result<BatchResult> {
        self.batch_op(paths, |ns, keys| Op::Hold { ns, keys, hold })
    }

    /// Describes a sealed entry without mapping it (from the shared index). `None` if absent.
    pub fn stat(&self, path: &str) -> Result<Option<EntryInfo>> {
        let p = EntryPath::parse(path)?;
        let mut g = self.inner.lock();
        if !g.exists(p.ns(), p.key())? {
            return Ok(None);
        }
        let Some(v) = g.found(p.ns(), p.key())? else {
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
            held: v.flags & FLAG_HELD != 0,
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
        Ok(g.found(p.ns(), p.key())?
            .is_some_and(|v| v.flags & FLAG_PINNED != 0))
    }

    /// Lists a namespace ("" for the root): itself, its children and its entries, each in
    /// name order. Asked a page at a time (a reply is one frame); names published or removed
    /// while the pages come may show or not, each name at most once.
    pub fn list(&self, ns: &str) -> Result<(Option<NsInfo>, Vec<NsInfo>, Vec<Located>)> {
        let (mut children, mut entries) = (Vec::new(), Vec::new());
        let mut after = None;
        loop {
            let op = Op::List {
                ns: ns.to_owned(),
                paged: true,
                after: after.take(),
            };
            let (me, more) = match self.inner.lock().call(op)?.0 {
                Body::Listing {
                    ns,
                    children: c,
                    entries: e,
                    more,
                } => {
                    // Pages are in name order: the last name is the later of the two lasts.
                    let last_child = c.last().and_then(|c| c.ns.rsplit('/').next());
                    after = last_child
                        .into_iter()
                        .chain(e.last().map(|e| e.key.as_str()))
                        .max()
                        .map(str::to_owned);
                    children.extend(c);
                    entries.extend(e);
                    (ns, more)
                }
                other => return Err(unexpected(&other)),
            };
            if !more {
                return Ok((me, children, entries));
            }
            if after.is_none() {
                return Err(Error::Protocol(
                    "a listing's page with no name said more follow".into(),
                ));
            }
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

    /// Drops cached mappings, of entries and of packs (they keep deleted entries' memory
    /// alive).
    pub fn trim(&self) {
        let mut g = self.inner.lock();
        g.cache.clear();
        g.cache_bytes = 0;
        g.pack_views.clear();
    }

    /// A read-only view of all of raw pool `pool` (the original design's region view), once
    /// this client holds the pool's descriptor (after its first allocation or retrieval
    /// there); `None` before, and for memfs pools (their entries are files of their own).
    pub fn map_pool(&self, pool: u32) -> Result<Option<Mapping>> {
        self.inner.lock().map_pool(pool)
    }

    /// One verb over many paths, in one request per namespace (and per
    /// [`proto::MAX_BATCH`] keys; the namespaces in order of first appearance); one outcome
    /// per path.
    fn batch_op(
        &self,
        paths: &[&str],
        mk: impl Fn(String, Vec<String>) -> Op,
    ) -> Result<BatchResult> {
        let mut out: Vec<Option<Result<()>>> = paths.iter().map(|_| None).collect();
        // Namespaces in order of first appearance, each with its keys and their places.
        let mut groups: Vec<(String, Vec<(usize, String)>)> = Vec::new();
        for (i, path) in paths.iter().enumerate() {
            let p = match EntryPath::parse(path) {
                Ok(p) => p,
                Err(e) => {
                    out[i] = Some(Err(e));
                    continue;
                }
            };
            let item = (i, p.key().to_owned());
            match groups.iter_mut().find(|(ns, _)| ns == p.ns()) {
                Some((_, items)) => items.push(item),
                None => groups.push((p.ns().to_owned(), vec![item])),
            }
        }
        let mut g = self.inner.lock();
        for (ns, items) in groups {
            for chunk in items.chunks(proto::MAX_BATCH) {
                let keys = chunk.iter().map(|(_, k)| k.clone()).collect();
                let r = match g.call(mk(ns.clone(), keys)) {
                    Ok((Body::Batch { results }, _)) if results.len() == chunk.len() => Ok(results),
                    Ok((other, _)) => Err(unexpected(&other)),
                    Err(e) => Err(e),
                };
                match r {
                    Ok(results) => {
                        for ((i, _), w) in chunk.iter().zip(results) {
                            out[*i] = Some(w.map_or(Ok(()), |w| Err(Error::from(w))));
                        }
                    }
                    // The request as a whole failed (the namespace, the connection): so did
                    // each of its keys.
                    Err(e) => {
                        let w = e.to_wire();
                        for (i, _) in chunk {
                            out[*i] = Some(Err(Error::from(w.clone())));
                        }
                    }
                }
            }
        }
        Ok(out
            .into_iter()
            .map(|r| r.expect("every path has an outcome"))
            .collect())
    }
}

fn already_done() -> Error {
    Error::InvalidArgument("the allocation was already stored or freed".into())
}

/// What a publication leaves this process of the handle's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterPublish {
    /// A private copy-on-write mapping at the same address: the caller keeps the handle and
    /// may read it (writes never reach the pool).
    PrivateCopy,
    /// Nothing: the bytes are unmapped from the handle, which can only be dropped, and
    /// pointers taken from [`AllocHandle::as_mut_ptr`] must not be used any more (for callers
    /// that know nothing looks at the bytes: no system call, where a private copy costs one).
    Nothing,
}

fn publish_op(p: &EntryPath, handle: &mut AllocHandle, len: Option<u64>) -> Result<Op> {
    if handle.done {
        return Err(already_done());
    }
    if let Some(l) = len
        && l > handle.grant.size
    {
        return Err(Error::InvalidArgument(format!(
            "length {l} exceeds the allocation of {}",
            handle.grant.size
        )));
    }
    let alloc = handle.grant.alloc;
    Ok(Op::Publish {
        alloc,
        ns: p.ns().to_owned(),
        key: p.key().to_owned(),
        len,
    })
}

/// The system page size.
pub fn page_size() -> usize {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .map_or(4096, |n| n as usize)
}

/// Measures a closure (used by the benchmark harness).
pub fn time<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let t = Instant::now();
    let v = f();
    (v, t.elapsed())
}
