//! The connection's state: the socket, the session, what the handler keeps (spare grants,
//! indexes, cached mappings), and the request/response plumbing.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::index::{PACK_BYTES, Table};
use crate::lane::{LANE_CAP, Lane, NUDGE, Reply};
use crate::mapping::Mapping;
use crate::proto::{
    self, Body, Grant, Located, Op, Outcome, PoolInfo, PoolKind, Request, Response,
};

/// Where marud listens by default.
pub const DEFAULT_SOCKET: &str = "/run/maru/marud.sock";

/// The requests a batch sends before it reads the oldest one's answer: a batch of thousands
/// sent whole would fill both sides' socket buffers (marud blocked writing answers the client
/// does not read yet, the client blocked sending), and the call would time out.
pub(super) const WINDOW: usize = 256;

/// Entries opened by the client itself that it reports to marud at once, with no request
/// of its own to carry them (see [`Inner::flush_releases`]).
pub(super) const ACCESSED_FLUSH: usize = 1024;
/// How long such a report waits at most for a request to carry it (it goes at the next
/// retrieve after that): marud's LRU order stays that fresh.
pub(super) const ACCESSED_AGE: Duration = Duration::from_millis(100);

/// How long a call polls for its reply by default, in microseconds.
pub const DEFAULT_SPIN_US: u64 = 50;

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
    /// How long a call polls for its reply before it sleeps (`MARU_SPIN_US`, in µs). Replies
    /// to most requests come within tens of microseconds; a thread that sleeps for them pays
    /// two wakeups per call (the daemon's read of the request wakes the sleeper too), which
    /// on virtual machines cost more than the request itself. 0 sleeps at once.
    pub spin: Duration,
    /// The namespace this handler's allocations are mostly published in, if it has one: a
    /// memfs pool packs small ones into a file shared with that namespace's other small
    /// entries, so that storing one creates no file and a reader maps many at once (one
    /// published elsewhere is copied into a file of its own).
    pub namespace: Option<String>,
    /// Ask marud for a shared-memory lane (`MARU_LANE=0` says no): a call the client waits
    /// for then goes through memory both map, with no system call on either side while both
    /// poll (see [`crate::lane`]).
    pub lane: bool,
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
            spin: Duration::from_micros(
                std::env::var("MARU_SPIN_US")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(DEFAULT_SPIN_US),
            ),
            namespace: None,
            lane: std::env::var("MARU_LANE").map_or(true, |v| v != "0"),
        }
    }
}

/// A memfs pack mapped writable whole, once for all the allocations carved from it: a mapping
/// per allocation (made, then unmapped or made private) costs a small store two or three
/// system calls it otherwise does without.
pub(super) struct PackMap {
    pub(super) map: memmap2::MmapRaw,
    pub(super) file: Arc<File>,
}

impl PackMap {
    pub(super) fn of(file: Arc<File>) -> Result<PackMap> {
        // A pack is never larger than PACK_BYTES; only the granted ranges, which marud has
        // reserved in the file, are ever touched.
        let map = memmap2::MmapOptions::new()
            .len(PACK_BYTES as usize)
            .map_raw(&*file)?;
        Ok(PackMap { map, file })
    }
}

pub(super) struct Spare {
    pub(super) grant: Grant,
    pub(super) file: Option<Arc<File>>,
    /// The pack the grant was carved from, mapped writable (memfs packs).
    pub(super) pack: Option<Arc<PackMap>>,
}

pub(super) struct NsIndex {
    pub(super) map: memmap2::Mmap,
    pub(super) removals_seen: u64,
    /// The memfs pools' directories of the namespace, by pool id, when marud gave them: a
    /// first-time entry there is opened here, with no round trip.
    pub(super) dirs: Vec<(u32, OwnedFd)>,
    /// The memfs pools' directories of packs, by pool id, when marud gave them (root): a
    /// pack is opened here the first time an entry in it is retrieved.
    pub(super) packs: Vec<(u32, OwnedFd)>,
}

impl NsIndex {
    pub(super) fn table(&self) -> Option<Table<'_>> {
        // SAFETY: the mapping is page aligned, lives as long as self, and the daemon only
        // writes it through atomics (see crate::index).
        unsafe { Table::from_raw(self.map.as_ptr(), self.map.len()) }
    }

    /// The table, while it may be trusted: `None` once its fence has passed
    /// ([`Table::fenced`]; cluster mode), so that marud answers instead.
    pub(super) fn readable(&self) -> Option<Table<'_>> {
        self.table().filter(|t| !t.fenced())
    }
}

pub(super) struct Cached {
    pub(super) generation: u64,
    pub(super) map: Mapping,
    pub(super) ns: Box<str>,
    pub(super) key: Box<str>,
}

impl Cached {
    /// True if this is the mapping of `ns/key` (another name may share its cache key).
    pub(super) fn is(&self, ns: &str, key: &str) -> bool {
        &*self.key == key && &*self.ns == ns
    }

    /// True if the index names this entry where it was mapped: its generation, in its pool,
    /// at its place (a raw pool's offset, a pack's piece; a file of its own is known by its
    /// generation alone). An entry moved out of its pack (its readers changed) keeps its
    /// generation, and its piece of the pack reads zeros.
    pub(super) fn matches(&self, v: &crate::index::SlotView) -> bool {
        let at = self.map.offset();
        self.generation == v.generation && self.map.pool() == v.pool && (at == 0 || at == v.offset)
    }
}

/// The mapping cache's hasher: its keys are hashes already ([`super::lookup::cache_key`]).
#[derive(Default, Clone, Copy)]
pub(super) struct PreHashed(u64);

impl std::hash::Hasher for PreHashed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

/// Mappings kept for repeated retrieval, by [`super::lookup::cache_key`].
pub(super) type MappingCache = lru::LruCache<u64, Cached, std::hash::BuildHasherDefault<PreHashed>>;

pub(super) enum Pending {
    Publish(String),
    Release,
    Accessed,
    Alloc(u64),
}

pub(super) struct Inner {
    pub(super) cfg: Config,
    pub(super) sock: UnixStream,
    pub(super) reader: proto::FrameReader,
    pub(super) next_id: u64,
    pub(super) session: u64,
    pub(super) server: String,
    pub(super) pools: Vec<PoolInfo>,
    pub(super) pool_ro: HashMap<u32, Arc<File>>,
    /// Read-only mappings of whole raw pools: retrieved entries are slices of them, so a
    /// key retrieved for the first time costs no mapping of its own.
    pub(super) pool_views: HashMap<u32, Arc<memmap2::Mmap>>,
    /// Read-only mappings of memfs packs, by pool and pack: their entries are slices of them.
    pub(super) pack_views: HashMap<(u32, u32), Arc<memmap2::Mmap>>,
    pub(super) pool_rw: HashMap<u32, Arc<File>>,
    /// Writable mappings of the packs this client's allocations were carved from, by pool and
    /// pack, while a spare or a handle uses them.
    pub(super) pack_maps: HashMap<(u32, u32), std::sync::Weak<PackMap>>,
    /// Spare grants by size, oldest first: taken in the order they were granted, so that
    /// those kept are always the latest ones (the packs of the older ones are all published,
    /// and eviction can empty them) and the first to expire go first.
    pub(super) spares: HashMap<u64, VecDeque<Spare>>,
    pub(super) sizes_seen: HashMap<u64, u32>,
    pub(super) refilling: std::collections::HashSet<u64>,
    pub(super) pending: HashMap<u64, Pending>,
    pub(super) async_errors: Vec<(String, Error)>,
    pub(super) indexes: HashMap<String, NsIndex>,
    /// Namespaces whose index marud refused (the caller may look entries up but not list
    /// them): their lookups go to marud.
    pub(super) unlisted: std::collections::HashSet<String>,
    /// Mappings kept for repeated retrieval, least recently used first out.
    pub(super) cache: MappingCache,
    pub(super) cache_bytes: u64,
    pub(super) releases: Arc<Mutex<Vec<u64>>>,
    /// Generations of entries this client opened itself since it last told marud
    /// (`Op::Accessed`: what marud's retrievals would have counted and refreshed).
    pub(super) accessed: Vec<u64>,
    /// When the oldest of `accessed` was opened.
    pub(super) accessed_since: Option<std::time::Instant>,
    /// The connection's shared-memory lane, if marud gave one.
    pub(super) lane: Option<Lane>,
    /// The request in the lane whose reply has not been read yet.
    pub(super) lane_wait: Option<u64>,
    /// When marud was last seen alive ([`Inner::check_alive`]; coarse monotonic ns).
    pub(super) alive_at: u64,
    /// The connection was shut down here ([`Inner::close`]): every call fails.
    pub(super) closed: bool,
}

/// How long answers from the shared index may rest on the last sight of marud alive: a
/// marud killed is replaced (its pool's log replayed, its socket bound again) and an extent
/// its leases protected is carved again only far later than this.
const ALIVE_FOR_NS: u64 = 2_000_000;

/// CLOCK_MONOTONIC_COARSE in ns: a read of the vDSO's page, no system call (its resolution is
/// the kernel's tick, 1 to 4 ms).
fn coarse_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC_COARSE).map_or(0, |t| {
        t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
    })
}

impl Drop for Inner {
    fn drop(&mut self) {
        // What marud is owed goes before the connection closes (leases it drops itself then;
        // the entries this client opened itself it would not learn of otherwise).
        let _ = self.flush_releases();
    }
}

/// The items of a retrieve's reply and the descriptors that came with them.
pub(super) type RetrievedItems = (Vec<Option<Located>>, Vec<OwnedFd>);

pub(super) fn unexpected(b: &Body) -> Error {
    Error::Protocol(format!("unexpected reply {b:?}"))
}

impl Inner {
    pub(super) fn send(&mut self, op: Op, fds: &[std::os::fd::BorrowedFd<'_>]) -> Result<u64> {
        if self.closed {
            return Err(Error::Disconnected);
        }
        let id = self.next_id;
        self.next_id += 1;
        let frame = proto::encode(&Request { id, op });
        proto::send_all(self.sock.as_fd(), &frame, fds).map_err(|e| self.failed(e))?;
        Ok(id)
    }

    /// Sends a request whose reply the caller waits for before it sends anything else: in the
    /// lane when there is one, nothing else is in flight (marud handles a connection's
    /// requests in the order it sees them, and the lane and the socket are two queues) and
    /// it fits; on the socket otherwise.
    pub(super) fn send_alone(&mut self, op: Op) -> Result<u64> {
        if self.closed {
            return Err(Error::Disconnected);
        }
        let Some(lane) = self.lane.as_ref().filter(|_| self.pending.is_empty()) else {
            return self.send(op, &[]);
        };
        if self.lane_wait.is_some() {
            return self.send(op, &[]);
        }
        let id = self.next_id;
        self.next_id += 1;
        let frame = proto::encode(&Request { id, op });
        if frame.len() - 4 > LANE_CAP {
            proto::send_all(self.sock.as_fd(), &frame, &[]).map_err(|e| self.failed(e))?;
            return Ok(id);
        }
        self.lane_wait = Some(id);
        if lane.post_request(id, &frame[4..]) {
            proto::send_all(self.sock.as_fd(), &NUDGE, &[]).map_err(|e| self.failed(e))?;
        }
        Ok(id)
    }

    /// Asks marud for the connection's lane. A marud without lanes refuses the request
    /// (an unknown operation): the connection keeps to the socket.
    pub(super) fn open_lane(&mut self) -> Result<()> {
        match self.call(Op::Lane) {
            Ok((Body::Lane { .. }, fds)) => {
                let fd = fds
                    .into_iter()
                    .next()
                    .ok_or_else(|| Error::Protocol("a lane reply without its file".into()))?;
                self.lane = Some(Lane::map(&File::from(fd))?);
                Ok(())
            }
            Ok((other, _)) => Err(unexpected(&other)),
            Err(Error::Protocol(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// The reply to the request in the lane, if it is there. When marud says it answered on
    /// the socket, the request is no longer waited for in the lane.
    fn lane_reply(&mut self) -> Option<Vec<u8>> {
        let r = self.lane.as_ref()?.reply(self.lane_wait?)?;
        self.lane_wait = None;
        match r {
            Reply::Here(b) => Some(b),
            Reply::OnSocket => None,
        }
    }

    /// Forgets the lane request `id` once its reply was read (on the socket, when marud
    /// answered there: one with descriptors, or too large for the lane).
    fn answered(&mut self, id: u64) {
        if self.lane_wait == Some(id) {
            self.lane_wait = None;
        }
    }

    /// Reads one response; async ones are settled here, others returned.
    pub(super) fn recv_one(&mut self) -> Result<Option<(Response, Vec<OwnedFd>)>> {
        let body = self.next_body()?;
        self.settle(&body)
    }

    /// The next frame's body: the lane's reply, a buffered frame, or one read from the
    /// socket.
    fn next_body(&mut self) -> Result<Vec<u8>> {
        loop {
            if let Some(b) = self.lane_reply() {
                return Ok(b);
            }
            if let Some(b) = self.reader.next_frame()? {
                return Ok(b);
            }
            if !self.read_some()? {
                return Err(Error::Disconnected);
            }
        }
    }

    /// Decodes a response: async ones are settled here, others returned.
    fn settle(&mut self, body: &[u8]) -> Result<Option<(Response, Vec<OwnedFd>)>> {
        let resp: Response = proto::decode(body)?;
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

    /// Waits for the lane's reply or reads what the socket has: polls for up to `cfg.spin`,
    /// then sleeps on the socket (marud nudges a client asleep there when it answers in the
    /// lane). False once marud closed the connection.
    fn read_some(&mut self) -> Result<bool> {
        // While a reply is due in the lane only the lane is polled (a load, where the socket
        // is a system call): marud says there when it answered on the socket instead.
        let lane = self.lane_wait.filter(|_| self.lane.is_some());
        if !self.cfg.spin.is_zero() {
            let t0 = std::time::Instant::now();
            let mut polls = 0u32;
            loop {
                if let (Some(id), Some(l)) = (lane, &self.lane) {
                    if l.has_reply(id) {
                        return Ok(true);
                    }
                } else {
                    match self.reader.try_read_from(self.sock.as_fd()) {
                        Ok(n) => return Ok(n > 0),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) => return Err(io_err(e)),
                    }
                }
                // The clock is read every few polls of the lane only.
                if (lane.is_none() || polls.is_multiple_of(16)) && t0.elapsed() >= self.cfg.spin {
                    break;
                }
                polls = polls.wrapping_add(1);
                std::hint::spin_loop();
            }
        }
        if let (Some(id), Some(l)) = (lane, &self.lane)
            && l.client_asleep(true, id)
        {
            l.client_asleep(false, id);
            return Ok(true);
        }
        // A signal ends the wait early (a socket with a timeout is not restarted): waited again.
        let r = loop {
            match self.reader.read_from(self.sock.as_fd()) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                r => break r,
            }
        };
        if let (Some(id), Some(l)) = (lane, &self.lane) {
            l.client_asleep(false, id);
        }
        r.map(|n| n > 0).map_err(|e| self.failed(e))
    }

    /// The error of a send or a read that failed. One that timed out leaves the exchange half
    /// done (a request partly sent, or a reply still to come that the next call would take for
    /// its own): the connection is shut down, so that every later call fails with
    /// [`Error::Disconnected`] rather than out of step, and marud ends the session (its
    /// leases and grants with it).
    fn failed(&mut self, e: std::io::Error) -> Error {
        use std::io::ErrorKind::{TimedOut, WouldBlock};
        if !matches!(e.kind(), WouldBlock | TimedOut) {
            return io_err(e);
        }
        self.close();
        Error::Os {
            errno: libc::ETIMEDOUT,
            message: format!(
                "marud did not answer within {:?}: the connection is closed",
                self.cfg.timeout
            ),
        }
    }

    /// A reply that is not the one waited for, or one that cannot be read: the connection
    /// is out of step, and shut down ([`Self::close`]).
    pub(super) fn out_of_step(&mut self, e: Error) -> Error {
        self.close();
        e
    }

    /// Shuts the connection down for good: marud ends the session, and with it the grants
    /// of the spares kept here (forgotten, never handed out after), the lane (no call goes
    /// there, where a marud that resumes would serve it before the socket's) and the leases
    /// (the index's answers are refused: [`Self::check_alive`]).
    fn close(&mut self) {
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        self.closed = true;
        self.lane = None;
        self.lane_wait = None;
        self.spares.clear();
        self.refilling.clear();
    }

    /// [`wait`](Self::wait) for the reply to a `Retrieve`: its items and descriptors, or the
    /// error marud answered (inside); outside, what went wrong with the connection.
    pub(super) fn wait_retrieved(&mut self, id: u64) -> Result<Result<RetrievedItems>> {
        loop {
            let body = self.next_body()?;
            if let Some(r) = proto::decode_retrieved(&body).filter(|r| r.id == id) {
                self.answered(id);
                let fds = self.reader.take_fds(r.fds as usize)?;
                return Ok(Ok((r.into_items(), fds)));
            }
            if let Some((resp, fds)) = self.settle(&body)? {
                self.answered(resp.id);
                return Ok(
                    match Self::outcome(id, resp).map_err(|e| self.out_of_step(e))? {
                        Ok(Body::Retrieved { items }) => Ok((items, fds)),
                        Ok(other) => return Err(unexpected(&other)),
                        Err(e) => Err(e),
                    },
                );
            }
        }
    }

    /// The body of `resp`, the reply to request `id`, or the error marud answered (inside);
    /// a protocol error if it is the reply to another request.
    fn outcome(id: u64, resp: Response) -> Result<Result<Body>> {
        if resp.id != id {
            return Err(Error::Protocol(format!(
                "reply to request {} while waiting for {id}",
                resp.id
            )));
        }
        Ok(match resp.result {
            Outcome::Ok(b) => Ok(b),
            Outcome::Err(w) => Err(Error::from(w)),
        })
    }

    pub(super) fn wait(&mut self, id: u64) -> Result<(Body, Vec<OwnedFd>)> {
        self.wait_answer(id)?
    }

    /// [`wait`](Self::wait), marud's answer (inside) apart from what went wrong with the
    /// connection (outside).
    pub(super) fn wait_answer(&mut self, id: u64) -> Result<Result<(Body, Vec<OwnedFd>)>> {
        loop {
            if let Some((resp, fds)) = self.recv_one()? {
                self.answered(resp.id);
                let outcome = Self::outcome(id, resp).map_err(|e| self.out_of_step(e))?;
                return Ok(outcome.map(|b| (b, fds)));
            }
        }
    }

    pub(super) fn call(&mut self, op: Op) -> Result<(Body, Vec<OwnedFd>)> {
        self.flush_releases()?;
        let id = self.send_alone(op)?;
        self.wait(id)
    }

    /// Sends what this client owes marud without waiting for it: the leases its dropped
    /// mappings gave back, and the entries it opened itself. Both go with the next request,
    /// or on their own when [`Inner::report_if_due`] says so: a message of its own to an idle
    /// marud costs the sender a wakeup of marud's thread.
    /// Each goes in messages of [`crate::proto::MAX_BATCH`] at most: marud refuses a larger
    /// one whole (and a release refused is a lease held until the connection ends).
    pub(super) fn flush_releases(&mut self) -> Result<()> {
        let released = std::mem::take(&mut *self.releases.lock());
        self.send_gens(&released, |gens| (Op::Release { gens }, Pending::Release))?;
        if !self.accessed.is_empty() {
            let accessed = std::mem::take(&mut self.accessed);
            self.accessed_since = None;
            self.send_gens(&accessed, |gens| (Op::Accessed { gens }, Pending::Accessed))?;
        }
        Ok(())
    }

    /// Sends `gens` in messages `op` makes, of [`crate::proto::MAX_BATCH`] at most, without
    /// waiting for their answers.
    fn send_gens(&mut self, gens: &[u64], op: impl Fn(Vec<u64>) -> (Op, Pending)) -> Result<()> {
        for piece in gens.chunks(crate::proto::MAX_BATCH) {
            let (op, pending) = op(piece.to_vec());
            let id = self.send(op, &[])?;
            self.pending.insert(id, pending);
        }
        Ok(())
    }

    /// Fails with [`Error::Disconnected`] once marud has closed the connection (it was killed,
    /// or it stopped). What a shared index says is the word of the marud that published it,
    /// whose leases end with it; a handler whose keys are all in its cache would never call
    /// marud and notice, and after a restart could map, for a key, an extent the new marud
    /// gave another entry. Checked at each answer taken from an index, with one system call
    /// per [`ALIVE_FOR_NS`] at most.
    pub(super) fn check_alive(&mut self) -> Result<()> {
        use std::os::fd::AsRawFd;
        if self.closed {
            return Err(Error::Disconnected);
        }
        let now = coarse_ns();
        if now.saturating_sub(self.alive_at) < ALIVE_FOR_NS {
            return Ok(());
        }
        // (nix's poll flags lack POLLRDHUP: the peer's end closed.)
        let mut p = libc::pollfd {
            fd: self.sock.as_raw_fd(),
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one pollfd, valid for the call; no wait.
        if unsafe { libc::poll(&mut p, 1, 0) } < 0 {
            let e = std::io::Error::last_os_error();
            return match e.kind() {
                // A signal came first: looked at again next time.
                std::io::ErrorKind::Interrupted => Ok(()),
                _ => Err(Error::Io(e)),
            };
        }
        if p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
            return Err(Error::Disconnected);
        }
        self.alive_at = now;
        Ok(())
    }

    /// Notes that this client opened entry `generation` itself (see [`Op::Accessed`]).
    pub(super) fn note_accessed(&mut self, generation: u64) {
        if self.accessed.is_empty() {
            self.accessed_since = Some(std::time::Instant::now());
        }
        self.accessed.push(generation);
    }

    /// Sends the report of the entries opened here when it is large or old enough, with no
    /// request of its own to carry it; settles first the replies already received to what
    /// was sent without waiting (a client that only ever retrieves what it opens itself
    /// reads no other reply, and those would fill marud's side of the socket).
    pub(super) fn report_if_due(&mut self) -> Result<()> {
        let due = self.accessed.len() >= ACCESSED_FLUSH
            || self
                .accessed_since
                .is_some_and(|t| t.elapsed() >= ACCESSED_AGE);
        if !due {
            return Ok(());
        }
        while !self.pending.is_empty() {
            if let Some(body) = self.reader.next_frame()? {
                if let Some((resp, _)) = self.settle(&body)? {
                    return Err(self.out_of_step(Error::Protocol(format!(
                        "reply {} to no request in flight",
                        resp.id
                    ))));
                }
                continue;
            }
            match self.reader.try_read_from(self.sock.as_fd()) {
                Ok(0) => return Err(Error::Disconnected),
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(io_err(e)),
            }
        }
        self.flush_releases()
    }

    pub(super) fn pool_kind(&self, id: u32) -> Result<PoolKind> {
        self.pools
            .iter()
            .find(|p| p.id == id)
            .map(|p| p.kind)
            .ok_or_else(|| Error::Protocol(format!("unknown pool {id}")))
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
