//! The worker's side of the remote tier: [`RemoteClient`] stores and loads entries in a memory
//! node's pool. Control travels over one TCP connection in [`proto`] frames; the bytes move by
//! one-sided NIXL WRITE and READ between the client's registered staging buffer and the pages
//! marud names, without marud touching them.
//!
//! - A store: `exists` (keys already present are answered at once, no bytes move) ->
//!   `reserve` (all the chunk's pages or none) -> one WRITE list -> `publish`.
//! - A load: `lookup` (which protects each entry found from eviction and reuse) -> READ lists
//!   into the staging buffer -> `release` -> copy out.
//! - Batches are cut into chunks that fit the staging buffer, the item limit of the welcome and
//!   half a control frame, in order.
//!
//! Restarts: a request refused as `stale_generation`, or a connection that breaks, means
//! marud restarted: the client reconnects (a new hello, marud's NIXL metadata forgotten and
//! loaded again) and repeats the chunk once; the old run's tickets are never sent again.
//! A reply naming a newer registration makes the client load marud's metadata again before it
//! uses any address of that reply.
//!
//! Failures: after a failure (connection refused, a control timeout, a NIXL transfer that
//! failed or timed out, a broken protocol) the client leaves the pool alone for
//! [`RemoteConfig::retry`]: loads and lookups then answer misses and stores
//! [`Error::Unavailable`] at once, without waiting for the connection. Each step has its
//! timeout: [`RemoteConfig::control_timeout`] for the TCP connect and each send and read of a
//! control request, [`RemoteConfig::transfer_timeout`] for each transfer (a call may also wait
//! its turn behind another thread's request).
//!
//! A transfer that timed out may still move bytes: a WRITE's pages are quarantined at once
//! (marud keeps them from every use), and its staging buffer stays with the transfer, never
//! reused, until NIXL says it ended; then the quarantined pages are abandoned (when the
//! connection that reserved them still stands) and the buffer is used again. Meanwhile the
//! client works in a new staging buffer (at most 4 are held so).
//!
//! Threads: [`RemoteClient`] is `Send + Sync`; its requests take turns on the one connection
//! and staging buffer. See doc/REMOTE.md.
//!
//! Leased memory ([`Arena`], [`Lease`]): callers that keep values in registered memory of
//! their own store from it and load into it with no copy through the staging buffer
//! ([`RemoteClient::store_leased`], [`RemoteClient::retrieve_leased`]).

use std::io;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use maru::error::WireError;
use maru_nixl::{Agent, AgentConfig, Desc, Mem, Nixl, Transfer};
use memmap2::MmapMut;

use crate::proto::{
    self, Blob, FrameError, Op, Outcome, Page, PublishItem, Published, Registration, Reply,
    Request, Response,
};

mod leases;
use crate::memory::{Keep, Lease, Shared, lock};
use crate::report::chain;

/// Pieces in the staging buffer start at multiples of this (a cache line).
const STAGING_ALIGN: usize = 64;
/// Timed-out transfers that may hold staging buffers at once; past it, nothing moves until
/// one ends.
const MAX_LINGERING: usize = 4;

/// How a worker reaches a memory node's pool.
#[derive(Debug, Clone)]
pub struct RemoteConfig {
    /// marud's remote door, `tcp://HOST:PORT` (or `HOST:PORT`).
    pub url: String,
    /// The deployment's shared secret ("" where marud admits anonymous workers).
    pub token: String,
    /// This worker's node, for marud's operators; it also names the NIXL agent.
    pub node: String,
    /// The RDMA device(s) NIXL's UCX backend uses, e.g. `mlx5_0` or `mlx5_0,mlx5_1` (a `:1`
    /// port suffix is accepted): passed as the UCX backend's `device_list` parameter (NIXL
    /// 1.5's UCX plugin has no `ucx_devices`), which NIXL turns into
    /// `UCX_NET_DEVICES=<dev>:1,...`, overriding the environment. For a TCP interface (`eth0`,
    /// `lo`) leave it unset and set `UCX_NET_DEVICES` (and `UCX_TLS=tcp`) in the environment
    /// instead: UCX knows no `eth0:1`, so `connect` refuses a name this host knows as a
    /// network interface only. Unset: UCX's own choice (`UCX_NET_DEVICES`, or every device).
    pub ucx_device: Option<String>,
    /// How long one NIXL transfer may take, from its posting to its end as first seen (default
    /// 5 s); one seen ended later has timed out.
    pub transfer_timeout: Duration,
    /// How long the pool is left alone after a failure (default 10 s).
    pub retry: Duration,
    /// The registered staging buffer every transfer goes through (default 64 MiB): the
    /// largest value this client stores or loads.
    pub staging_bytes: u64,
    /// The TCP connect, send and answer timeouts of the control connection (default 5 s).
    pub control_timeout: Duration,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        RemoteConfig {
            url: String::new(),
            token: String::new(),
            node: "worker".into(),
            ucx_device: None,
            transfer_timeout: Duration::from_secs(5),
            retry: Duration::from_secs(10),
            staging_bytes: 64 << 20,
            control_timeout: Duration::from_secs(5),
        }
    }
}

/// The outcome of one store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// The entry is in the pool now, with these bytes.
    Created,
    /// The key was taken already (write-once); the pool's bytes are someone else's.
    AlreadyPresent,
}

/// Counters for operators.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Control requests sent (hellos included).
    pub requests: u64,
    /// NIXL transfers that completed.
    pub transfers: u64,
    /// Bytes written into the pool and read from it.
    pub bytes_written: u64,
    pub bytes_read: u64,
    /// Failures that made the client leave the pool alone for a while.
    pub errors: u64,
    /// Connections made again after the first (marud restarted, or a connection broke).
    pub reconnects: u64,
    /// Calls answered without the pool while it was left alone.
    pub skipped: u64,
    /// Timed-out transfers NIXL has not yet said are over (each holds a staging buffer).
    pub lingering: u64,
    /// Where the time of the calls went: waiting for control replies, waiting for NIXL
    /// transfers (from posting to completion), copying between callers' memory and the
    /// staging buffer.
    pub control_time: Duration,
    pub transfer_time: Duration,
    pub copy_time: Duration,
}

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a remote call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// NIXL failed: loading it, setting up the agent, or a transfer (one that timed out may
    /// still be moving bytes).
    #[error("NIXL: {during}")]
    Nixl {
        during: &'static str,
        #[source]
        source: maru_nixl::Error,
    },
    /// The control connection to marud failed (refused, timed out, cut).
    #[error("marud at {addr}: {during}")]
    Io {
        addr: String,
        during: &'static str,
        #[source]
        source: io::Error,
    },
    /// The staging buffer could not be mapped.
    #[error("mapping a staging buffer of {bytes} bytes")]
    Staging {
        bytes: usize,
        #[source]
        source: io::Error,
    },
    /// marud answered something the protocol does not allow.
    #[error("marud broke the protocol: {0}")]
    Protocol(String),
    /// marud refused the request (a bad name, a quota, a missing entry, a bad token...).
    #[error("marud refused: {0}")]
    Server(maru::Error),
    /// No room for the entries, even after eviction.
    #[error("the remote pool is full{}", if .0.is_empty() { String::new() } else { format!(": {}", .0) })]
    PoolFull(String),
    /// marud restarted again while the request was repeated after a restart.
    #[error("marud restarted during the request (stale generation), again after reconnecting")]
    StaleGeneration,
    /// Transfers that timed out have not ended, and hold every staging buffer allowed.
    #[error("{0} timed-out NIXL transfers have not ended; no staging buffer is free")]
    Stuck(usize),
    /// The pool is left alone after a failure: nothing was sent.
    #[error("the remote pool is skipped for another {:?} after a failure: {last}", remaining(*.until))]
    Unavailable { until: Instant, last: String },
    /// A bad argument (a value larger than the staging buffer, an empty value, a bad URL...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl Error {
    /// Whether this is [`Error::Unavailable`]: the pool was not asked.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Error::Unavailable { .. })
    }
}

/// What is left until `until`, to the millisecond.
fn remaining(until: Instant) -> Duration {
    let d = until.saturating_duration_since(Instant::now());
    Duration::from_millis(d.as_millis() as u64)
}

fn nixl_err(during: &'static str) -> impl FnOnce(maru_nixl::Error) -> Error {
    move |source| Error::Nixl { during, source }
}

/// marud's refusal as an error ("pool full" has a kind of its own here).
fn server_error(w: WireError) -> Error {
    if w.kind == "no_space" {
        let m = w.message.strip_prefix("pool full").unwrap_or(&w.message);
        let m = m.strip_prefix(": ").unwrap_or(m);
        return Error::PoolFull(m.to_owned());
    }
    Error::Server(maru::Error::from(w))
}

/// What a failure means for the connection and the pool.
#[derive(Debug, PartialEq, Eq)]
enum Class {
    /// marud restarted, or the connection broke: reconnect and repeat once.
    Retry,
    /// Leave the pool alone for a while.
    Down,
    /// An answer about this request only.
    Plain,
}

fn class(e: &Error) -> Class {
    match e {
        Error::StaleGeneration => Class::Retry,
        Error::Io { source, .. } => match source.kind() {
            io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::UnexpectedEof
            | io::ErrorKind::NotConnected => Class::Retry,
            _ => Class::Down,
        },
        Error::Nixl { .. } | Error::Protocol(_) | Error::Staging { .. } | Error::Stuck(_) => {
            Class::Down
        }
        Error::Server(_)
        | Error::PoolFull(_)
        | Error::Unavailable { .. }
        | Error::InvalidArgument(_) => Class::Plain,
    }
}

/// `HOST:PORT` of a `tcp://HOST:PORT` URL.
fn parse_url(url: &str) -> Result<String> {
    let rest = match url.split_once("://") {
        Some(("tcp", rest)) => rest,
        Some((scheme, _)) => {
            return Err(Error::InvalidArgument(format!(
                "remote URL {url:?}: scheme `{scheme}` is not spoken (tcp://HOST:PORT)"
            )));
        }
        None => url,
    };
    let rest = rest.trim_end_matches('/');
    let port_ok = rest
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
    if !port_ok {
        return Err(Error::InvalidArgument(format!(
            "remote URL {url:?} is not tcp://HOST:PORT"
        )));
    }
    Ok(rest.to_owned())
}

/// The UCX backend's `device_list` for `ucx_device`: NIXL splits it at ", " and adds the port
/// `:1` to each device itself.
fn device_list(device: &str) -> Result<String> {
    let mut devs = Vec::new();
    for d in device.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let d = d.strip_suffix(":1").unwrap_or(d);
        if d.contains(':') {
            return Err(Error::InvalidArgument(format!(
                "UCX device {d:?}: NIXL's UCX backend uses port 1 of each device (name it \
                 `mlx5_0` or `mlx5_0:1`)"
            )));
        }
        devs.push(d);
    }
    if devs.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "UCX device {device:?} names no device"
        )));
    }
    Ok(devs.join(", "))
}

/// The first of `devices` (a `device_list`) that this host knows as a network interface and
/// not as an RDMA device: UCX knows such a device by its bare name, which NIXL's port suffix
/// spoils.
fn plain_interface(devices: &str) -> Option<&str> {
    let sys = std::path::Path::new("/sys/class");
    devices
        .split(", ")
        .find(|d| sys.join("net").join(d).exists() && !sys.join("infiniband").join(d).exists())
}

fn align_up(n: usize) -> usize {
    n.div_ceil(STAGING_ALIGN) * STAGING_ALIGN
}

/// A string's length in JSON, quotes and escapes included.
fn json_len(s: &str) -> usize {
    2 + s
        .bytes()
        .map(|b| match b {
            b'"' | b'\\' => 2,
            0..=0x1f => 6,
            _ => 1,
        })
        .sum::<usize>()
}

/// What one key may cost in a request and its answer (a publish item, an error message that
/// names the key and its namespace).
fn item_cost(ns: &str, key: &str) -> usize {
    2 * json_len(key) + json_len(ns) + 128
}

/// The end of the chunk of keys from `start`: at most `max_items`, within half a frame.
fn plan_keys(ns: &str, keys: &[&str], start: usize, max_items: usize) -> usize {
    let mut budget = proto::MAX_FRAME / 2;
    let mut end = start;
    while end < keys.len() && end - start < max_items {
        let cost = item_cost(ns, keys[end]);
        if end > start && cost > budget {
            break;
        }
        budget = budget.saturating_sub(cost);
        end += 1;
    }
    end
}

/// The end of the chunk of values from `start`: within [`plan_keys`]'s limits and the
/// staging buffer (each value fits it alone).
fn plan_values(
    ns: &str,
    items: &[(usize, &str, &[u8])],
    start: usize,
    max_items: usize,
    staging: usize,
) -> usize {
    let mut budget = proto::MAX_FRAME / 2;
    let mut used = 0usize;
    let mut end = start;
    while end < items.len() && end - start < max_items {
        let (_, key, value) = items[end];
        let cost = item_cost(ns, key);
        let fill = align_up(used) + value.len();
        if end > start && (cost > budget || fill > staging) {
            break;
        }
        budget = budget.saturating_sub(cost);
        used = fill;
        end += 1;
    }
    end
}

/// Whether `[addr, addr + len)` lies in one of the registered regions.
fn registered(regions: &[(u64, u64)], addr: u64, len: u64) -> bool {
    regions.iter().any(|&(start, rlen)| {
        addr >= start
            && addr
                .checked_add(len)
                .zip(start.checked_add(rlen))
                .is_some_and(|(end, rend)| end <= rend)
    })
}

fn reply_name(r: &Reply) -> &'static str {
    match r {
        Reply::Hello(_) => "hello",
        Reply::Metadata(_) => "metadata",
        Reply::Reserved(_) => "reserved",
        Reply::Published(_) => "published",
        Reply::Exists(_) => "exists",
        Reply::Found(_) => "found",
        Reply::Each(_) => "each",
        Reply::Listing(_) => "listing",
        Reply::Done => "done",
        Reply::Pong => "pong",
    }
}

fn unexpected(op: &str, r: &Reply) -> Error {
    Error::Protocol(format!("{op} was answered with `{}`", reply_name(r)))
}

fn count_mismatch(op: &str, want: usize, got: usize) -> Error {
    Error::Protocol(format!(
        "{op} of {want} items was answered with {got} outcomes"
    ))
}

/// A registered staging buffer; deregistered before it is unmapped.
struct Staging {
    map: Option<MmapMut>,
    addr: u64,
    len: usize,
    agent: Arc<Agent>,
}

impl Staging {
    fn new(agent: &Arc<Agent>, len: usize) -> Result<Staging> {
        let map = MmapMut::map_anon(len).map_err(|source| Error::Staging { bytes: len, source })?;
        let addr = map.as_ptr() as u64;
        agent
            .register(Mem::Dram, &[Desc::host(addr, len as u64)])
            .map_err(nixl_err("registering the staging buffer"))?;
        Ok(Staging {
            map: Some(map),
            addr,
            len,
            agent: agent.clone(),
        })
    }

    fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or_default()
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        self.map.as_deref_mut().unwrap_or_default()
    }

    /// Never unmaps it (a transfer NIXL could not end may still write into it).
    fn leak(mut self) {
        if let Some(map) = self.map.take() {
            std::mem::forget(map);
        }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let Some(map) = self.map.take() else { return };
        match self
            .agent
            .deregister(Mem::Dram, &[Desc::host(self.addr, self.len as u64)])
        {
            Ok(()) => drop(map),
            Err(e) => {
                tracing::warn!(
                    bytes = self.len,
                    "a staging buffer could not be deregistered from NIXL; it stays mapped: {}",
                    chain(&e)
                );
                std::mem::forget(map);
            }
        }
    }
}

/// A transfer that timed out, or failed while NIXL still holds it, with the memory it may
/// still use.
struct Lingering {
    // Declared first: dropped (released) before the staging buffer and the agent.
    transfer: Transfer<'static>,
    staging: Option<Staging>,
    /// The leases a READ into leased memory may still write into.
    leases: Vec<Lease>,
    /// The arenas a WRITE from leased memory may still read.
    sources: Vec<Arc<Shared>>,
    /// A WRITE's quarantined tickets, abandoned once the transfer is over.
    tickets: Vec<u64>,
    /// The connection that reserved them.
    conn: u64,
    /// The agent `transfer` borrows: kept alive as long as it.
    _agent: Arc<Agent>,
}

// SAFETY: NIXL's agents are created with read-write thread synchronisation, so a request may
// be polled and released from any thread; a `Lingering` is only used under the client's mutex,
// by one thread at a time.
unsafe impl Send for Lingering {}

impl Lingering {
    /// True once nothing of the transfer moves any more: it ended, or it failed and NIXL
    /// released it.
    fn over(&mut self) -> bool {
        match self.transfer.poll() {
            Ok(done) => done,
            Err(_) => self.transfer.release(),
        }
    }
}

impl Drop for Lingering {
    fn drop(&mut self) {
        if !self.over()
            && let Some(s) = self.staging.take()
        {
            tracing::warn!(
                bytes = s.len,
                "a timed-out NIXL transfer never ended; its staging buffer is leaked"
            );
            s.leak();
        }
        if !self.leases.is_empty() && !self.over() {
            tracing::warn!(
                leases = self.leases.len(),
                "a timed-out NIXL read into leased memory never ended; the leases are leaked"
            );
            for l in self.leases.drain(..) {
                std::mem::forget(l);
            }
        }
        if !self.sources.is_empty() && !self.over() {
            tracing::warn!(
                arenas = self.sources.len(),
                "a timed-out NIXL write from leased memory never ended; its arenas are leaked"
            );
            for a in self.sources.drain(..) {
                std::mem::forget(a);
            }
        }
    }
}

/// A transfer that failed: why, and whether it lingers (a timeout, or a failure NIXL cannot
/// release yet: it may still move bytes, so the memory it uses is kept, and a WRITE's pages
/// are to be quarantined rather than given back).
#[derive(Debug)]
struct Failed {
    error: maru_nixl::Error,
    lingers: bool,
}

impl Failed {
    /// The error, as the client reports it.
    fn during(self, during: &'static str) -> Error {
        Error::Nixl {
            during,
            source: self.error,
        }
    }
}

/// The control connection to one marud run.
struct Conn {
    stream: TcpStream,
    /// Which connection of this client (tickets belong to it).
    serial: u64,
    generation: u64,
    registration: u64,
    regions: Vec<(u64, u64)>,
    max_items: usize,
    /// Each transfer's timeout: the configured one, kept under half the door's TTLs.
    transfer_timeout: Duration,
    /// How long the door keeps a read protection ([`Welcome::read_ttl_ms`]).
    read_ttl: Duration,
}

/// Everything one request at a time uses.
struct Inner {
    conn: Option<Conn>,
    serial: u64,
    next_id: u64,
    frame: Vec<u8>,
    /// marud's NIXL agent as loaded (kept across connections, so it can be forgotten).
    peer: Option<String>,
    staging: Option<Staging>,
    lingering: Vec<Lingering>,
    /// Namespaces this client made sure exist (a store makes its namespace, as a local
    /// client's `mkdir -p` would, once per namespace).
    made: std::collections::HashSet<String>,
}

struct Down {
    until: Instant,
    last: String,
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    transfers: AtomicU64,
    bytes_written: AtomicU64,
    bytes_read: AtomicU64,
    errors: AtomicU64,
    reconnects: AtomicU64,
    skipped: AtomicU64,
    lingering: AtomicU64,
    control_ns: AtomicU64,
    transfer_ns: AtomicU64,
    copy_ns: AtomicU64,
}

/// Adds the time since `since` to a counter of nanoseconds.
fn add_time(counter: &AtomicU64, since: Instant) {
    let ns = u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX);
    counter.fetch_add(ns, Relaxed);
}

/// A worker's connection to a memory node's pool (see the module's documentation).
pub struct RemoteClient {
    cfg: RemoteConfig,
    /// `HOST:PORT`.
    addr: String,
    staging_len: usize,
    agent: Arc<Agent>,
    inner: Mutex<Inner>,
    down: Mutex<Option<Down>>,
    counters: Counters,
}

impl std::fmt::Debug for RemoteClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteClient")
            .field("addr", &self.addr)
            .field("agent", &self.agent.name())
            .finish_non_exhaustive()
    }
}

/// One request and its answer on `stream`.
fn exchange(
    stream: &mut TcpStream,
    frame: &mut Vec<u8>,
    req: &Request,
    addr: &str,
    timeout: Duration,
) -> Result<Response> {
    let io_err = |during, source| Error::Io {
        addr: addr.to_owned(),
        during,
        source,
    };
    let timed_out = |e: io::Error| {
        if e.kind() == io::ErrorKind::WouldBlock {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no progress within {timeout:?}"),
            )
        } else {
            e
        }
    };
    proto::write_frame(stream, req).map_err(|e| io_err("sending a request", timed_out(e)))?;
    match proto::read_frame(stream, frame) {
        Ok(Some(())) => {}
        Ok(None) => {
            return Err(io_err(
                "reading the answer",
                io::Error::new(io::ErrorKind::UnexpectedEof, "marud closed the connection"),
            ));
        }
        Err(FrameError::Io(e)) => return Err(io_err("reading the answer", timed_out(e))),
        Err(e) => return Err(Error::Protocol(e.to_string())),
    }
    let resp = proto::decode_response(frame).map_err(|e| Error::Protocol(e.to_string()))?;
    if resp.id != req.id {
        return Err(Error::Protocol(format!(
            "request {} ({}) was answered as request {}",
            req.id,
            req.op.name(),
            resp.id
        )));
    }
    Ok(resp)
}

impl RemoteClient {
    /// Loads NIXL, creates this worker's agent (UCX backend) and registered staging buffer,
    /// connects to marud and says hello. Fails when NIXL is not installed, when the
    /// configuration is bad, or when marud cannot be reached or refuses the worker.
    ///
    /// Loading NIXL may set `NIXL_PLUGIN_DIR` ([`Nixl::load`]), and UCX reads its environment
    /// (`UCX_TLS`, `UCX_NET_DEVICES`) once: the first client of a process is best made before
    /// the process starts threads that read or change the environment.
    pub fn connect(cfg: RemoteConfig) -> Result<RemoteClient> {
        let addr = parse_url(&cfg.url)?;
        let staging_len = usize::try_from(cfg.staging_bytes)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                Error::InvalidArgument(format!("a staging buffer of {} bytes", cfg.staging_bytes))
            })?;
        if cfg.control_timeout.is_zero() {
            return Err(Error::InvalidArgument(
                "the control timeout must be longer than 0".into(),
            ));
        }
        let devices = cfg.ucx_device.as_deref().map(device_list).transpose()?;
        if let Some(netdev) = devices.as_deref().and_then(plain_interface) {
            return Err(Error::InvalidArgument(format!(
                "UCX device {netdev:?} is a network interface, not an RDMA device: NIXL's UCX \
                 backend would ask UCX for `{netdev}:1` and find nothing. For TCP, leave \
                 ucx_device unset and set UCX_NET_DEVICES={netdev} (and UCX_TLS=tcp)"
            )));
        }
        let nixl = Nixl::load().map_err(nixl_err("loading NIXL"))?;
        let name = format!(
            "maru-{}-{}-{:08x}",
            cfg.node,
            std::process::id(),
            random32()
        );
        let mut agent = nixl
            .agent(&name, &AgentConfig::default())
            .map_err(nixl_err("creating the worker's agent"))?;
        let params: Vec<(&str, &str)> = devices
            .as_deref()
            .map(|d| vec![("device_list", d)])
            .unwrap_or_default();
        agent
            .add_backend("UCX", &params)
            .map_err(nixl_err("creating the UCX backend"))?;
        let agent = Arc::new(agent);
        let staging = Staging::new(&agent, staging_len)?;
        let client = RemoteClient {
            cfg,
            addr,
            staging_len,
            agent,
            inner: Mutex::new(Inner {
                conn: None,
                serial: 0,
                next_id: 1,
                frame: Vec::new(),
                peer: None,
                staging: Some(staging),
                lingering: Vec::new(),
                made: Default::default(),
            }),
            down: Mutex::new(None),
            counters: Counters::default(),
        };
        client.reconnect(&mut lock(&client.inner))?;
        Ok(client)
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &RemoteConfig {
        &self.cfg
    }

    /// This worker's NIXL agent name.
    pub fn agent_name(&self) -> &str {
        self.agent.name()
    }

    /// Until when the pool is left alone after a failure, if it is now.
    pub fn unavailable_until(&self) -> Option<Instant> {
        lock(&self.down)
            .as_ref()
            .map(|d| d.until)
            .filter(|&u| u > Instant::now())
    }

    /// The counters.
    pub fn stats(&self) -> Stats {
        let c = &self.counters;
        Stats {
            requests: c.requests.load(Relaxed),
            transfers: c.transfers.load(Relaxed),
            bytes_written: c.bytes_written.load(Relaxed),
            bytes_read: c.bytes_read.load(Relaxed),
            errors: c.errors.load(Relaxed),
            reconnects: c.reconnects.load(Relaxed),
            skipped: c.skipped.load(Relaxed),
            lingering: c.lingering.load(Relaxed),
            control_time: Duration::from_nanos(c.control_ns.load(Relaxed)),
            transfer_time: Duration::from_nanos(c.transfer_ns.load(Relaxed)),
            copy_time: Duration::from_nanos(c.copy_ns.load(Relaxed)),
        }
    }

    /// Stores one entry (write-once).
    pub fn store(&self, ns: &str, key: &str, value: &[u8]) -> Result<Stored> {
        self.batch_store(ns, &[(key, value)])?
            .pop()
            .unwrap_or_else(|| Err(Error::Protocol("a store without an outcome".into())))
    }

    /// Stores entries, one outcome per item, in order. A value that is empty or larger than
    /// the staging buffer fails alone ([`Error::InvalidArgument`]); a failure of the pool
    /// fails the call (chunks before it may be stored).
    pub fn batch_store(&self, ns: &str, items: &[(&str, &[u8])]) -> Result<Vec<Result<Stored>>> {
        let mut out: Vec<Option<Result<Stored>>> = Vec::with_capacity(items.len());
        let mut valid = Vec::with_capacity(items.len());
        for (i, &(key, value)) in items.iter().enumerate() {
            if value.is_empty() {
                out.push(Some(Err(Error::InvalidArgument(format!(
                    "{key}: an empty value is not stored remotely"
                )))));
            } else if value.len() > self.staging_len {
                out.push(Some(Err(Error::InvalidArgument(format!(
                    "{key}: a value of {} bytes exceeds the staging buffer of {} bytes",
                    value.len(),
                    self.staging_len
                )))));
            } else {
                out.push(None);
                valid.push((i, key, value));
            }
        }
        let mut start = 0;
        while start < valid.len() {
            let (end, part) = self.run(|inner| {
                let end = plan_values(ns, &valid, start, max_items(inner), self.staging_len);
                let part = self.store_chunk(inner, ns, &valid[start..end])?;
                Ok((end, part))
            })?;
            for (&(i, _, _), r) in valid[start..end].iter().zip(part) {
                out[i] = Some(r);
            }
            start = end;
        }
        Ok(out
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(Error::Protocol("no outcome".into()))))
            .collect())
    }

    /// Loads one entry; `None` when it is missing, or while the pool is left alone.
    pub fn retrieve(&self, ns: &str, key: &str) -> Result<Option<Vec<u8>>> {
        Ok(self.batch_retrieve(ns, &[key])?.pop().flatten())
    }

    /// Loads entries, in order; misses while the pool is left alone. An entry larger than
    /// the staging buffer fails the call ([`Error::InvalidArgument`]).
    pub fn batch_retrieve(&self, ns: &str, keys: &[&str]) -> Result<Vec<Option<Vec<u8>>>> {
        let mut out: Vec<Option<Vec<u8>>> = vec![None; keys.len()];
        let mut start = 0;
        while start < keys.len() {
            let got = self.run(|inner| {
                let end = plan_keys(ns, keys, start, max_items(inner));
                let mut part: Vec<Option<Vec<u8>>> = vec![None; end - start];
                self.read_chunk(inner, ns, &keys[start..end], None, &mut |i, bytes| {
                    part[i] = Some(bytes.to_vec())
                })?;
                Ok((end, part))
            });
            match got {
                Ok((end, part)) => {
                    for (slot, v) in out[start..end].iter_mut().zip(part) {
                        *slot = v;
                    }
                    start = end;
                }
                Err(e) if e.is_unavailable() => break,
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// Loads one entry into `dst`: its length, `None` when it is missing or while the pool is
    /// left alone. An entry longer than `dst` is [`Error::InvalidArgument`].
    pub fn retrieve_into(&self, ns: &str, key: &str, dst: &mut [u8]) -> Result<Option<usize>> {
        let mut len = None;
        let got = self.run(|inner| {
            len = None;
            self.read_chunk(inner, ns, &[key], Some(dst.len()), &mut |_, bytes| {
                let t = Instant::now();
                dst[..bytes.len()].copy_from_slice(bytes);
                add_time(&self.counters.copy_ns, t);
                len = Some(bytes.len());
            })
        });
        match got {
            Ok(()) => Ok(len),
            Err(e) if e.is_unavailable() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Whether an entry exists; `false` while the pool is left alone.
    pub fn exists(&self, ns: &str, key: &str) -> Result<bool> {
        Ok(self.batch_exists(ns, &[key])?.pop().unwrap_or(false))
    }

    /// Which entries exist; `false` for the rest while the pool is left alone.
    pub fn batch_exists(&self, ns: &str, keys: &[&str]) -> Result<Vec<bool>> {
        let mut out = vec![false; keys.len()];
        let mut start = 0;
        while start < keys.len() {
            let got = self.run(|inner| {
                let end = plan_keys(ns, keys, start, max_items(inner));
                let op = Op::Exists {
                    ns: ns.to_owned(),
                    keys: keys[start..end].iter().map(|k| (*k).to_owned()).collect(),
                };
                match self.call(inner, op)? {
                    Reply::Exists(v) if v.len() == end - start => Ok((end, v)),
                    Reply::Exists(v) => Err(count_mismatch("exists", end - start, v.len())),
                    other => Err(unexpected("exists", &other)),
                }
            });
            match got {
                Ok((end, part)) => {
                    out[start..end].copy_from_slice(&part);
                    start = end;
                }
                Err(e) if e.is_unavailable() => break,
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// Deletes entries; one outcome per key.
    pub fn delete(&self, ns: &str, keys: &[&str]) -> Result<Vec<Result<()>>> {
        self.each(ns, keys, "delete", |ns, keys| Op::Delete { ns, keys })
    }

    /// Pins (`true`: never evicted) or unpins entries; one outcome per key.
    pub fn pin(&self, ns: &str, keys: &[&str], pinned: bool) -> Result<Vec<Result<()>>> {
        self.each(ns, keys, "pin", |ns, keys| Op::Pin { ns, keys, pinned })
    }

    /// Makes namespace `ns` and the namespaces above it that are missing (`mode` for those
    /// it makes); nothing when they all exist.
    pub fn mkdir(&self, ns: &str, mode: u32) -> Result<()> {
        self.run(|inner| {
            let op = Op::Mkdir {
                ns: ns.to_owned(),
                mode,
            };
            match self.call(inner, op)? {
                Reply::Done => Ok(()),
                other => Err(unexpected("mkdir", &other)),
            }
        })
    }

    /// Lists namespace `ns` (`""`: the root): its child namespaces and entries, each sorted
    /// by name; asked a page at a time (one request each), all pages in one listing.
    pub fn list(&self, ns: &str) -> Result<proto::Listing> {
        let mut all = proto::Listing::default();
        let mut after: Option<String> = None;
        loop {
            let page = self.run(|inner| {
                let op = Op::List {
                    ns: ns.to_owned(),
                    after: after.clone(),
                };
                match self.call(inner, op)? {
                    Reply::Listing(l) => Ok(l),
                    other => Err(unexpected("list", &other)),
                }
            })?;
            let last = page
                .children
                .iter()
                .chain(page.entries.iter().map(|e| &e.key))
                .max()
                .cloned();
            all.children.extend(page.children);
            all.entries.extend(page.entries);
            if !page.more {
                all.children.sort();
                all.entries.sort_by(|a, b| a.key.cmp(&b.key));
                return Ok(all);
            }
            match last {
                Some(l) if after.as_ref().is_none_or(|a| l > *a) => after = Some(l),
                _ => {
                    return Err(Error::Protocol(
                        "a listing's page said more names follow, and named none further".into(),
                    ));
                }
            }
        }
    }

    /// Asks marud whether it is there; the round trip's time.
    pub fn ping(&self) -> Result<Duration> {
        self.run(|inner| {
            let start = Instant::now();
            match self.call(inner, Op::Ping)? {
                Reply::Pong => Ok(start.elapsed()),
                other => Err(unexpected("ping", &other)),
            }
        })
    }

    fn each(
        &self,
        ns: &str,
        keys: &[&str],
        name: &str,
        op: impl Fn(String, Vec<String>) -> Op,
    ) -> Result<Vec<Result<()>>> {
        let mut out = Vec::with_capacity(keys.len());
        let mut start = 0;
        while start < keys.len() {
            let (end, part) = self.run(|inner| {
                let end = plan_keys(ns, keys, start, max_items(inner));
                let keys = keys[start..end].iter().map(|k| (*k).to_owned()).collect();
                match self.call(inner, op(ns.to_owned(), keys))? {
                    Reply::Each(v) if v.len() == end - start => Ok((end, v)),
                    Reply::Each(v) => Err(count_mismatch(name, end - start, v.len())),
                    other => Err(unexpected(name, &other)),
                }
            })?;
            out.extend(part.into_iter().map(|e| match e {
                None => Ok(()),
                Some(w) => Err(server_error(w)),
            }));
            start = end;
        }
        Ok(out)
    }

    /// Runs `f` with the connection: not at all while the pool is left alone
    /// ([`Error::Unavailable`]); once more after a reconnection when marud restarted or the
    /// connection broke; a failure makes the pool left alone for [`RemoteConfig::retry`].
    fn run<T>(&self, mut f: impl FnMut(&mut Inner) -> Result<T>) -> Result<T> {
        self.check_down()?;
        let mut guard = self.inner.lock().unwrap_or_else(|p| {
            // A panic mid-request may have left the connection inside a frame.
            self.inner.clear_poison();
            let mut g = p.into_inner();
            g.conn = None;
            g
        });
        // Another thread may have failed while this one waited.
        self.check_down()?;
        let inner = &mut *guard;
        self.settle(inner);
        let mut repeated = false;
        loop {
            if inner.conn.is_none()
                && let Err(e) = self.reconnect(inner)
            {
                self.mark_down(inner, &e);
                return Err(e);
            }
            match f(inner) {
                Ok(v) => return Ok(v),
                Err(e) => match class(&e) {
                    Class::Plain => return Err(e),
                    Class::Retry if !repeated => {
                        tracing::info!(
                            "marud restarted or the connection broke: reconnecting ({})",
                            chain(&e)
                        );
                        repeated = true;
                        inner.conn = None;
                    }
                    Class::Retry | Class::Down => {
                        self.mark_down(inner, &e);
                        return Err(e);
                    }
                },
            }
        }
    }

    fn check_down(&self) -> Result<()> {
        let mut down = lock(&self.down);
        if let Some(d) = down.as_ref() {
            if Instant::now() < d.until {
                self.counters.skipped.fetch_add(1, Relaxed);
                return Err(Error::Unavailable {
                    until: d.until,
                    last: d.last.clone(),
                });
            }
            *down = None;
        }
        Ok(())
    }

    fn mark_down(&self, inner: &mut Inner, e: &Error) {
        // A transfer that timed out leaves the connection standing: its quarantined pages
        // are abandoned on it once NIXL says the transfer is over. Any other failure ends it
        // (the next connection loads marud's NIXL metadata afresh).
        let timed_out = matches!(
            e,
            Error::Nixl {
                source: maru_nixl::Error::TimedOut(_),
                ..
            }
        );
        if !timed_out {
            inner.conn = None;
        }
        self.counters.errors.fetch_add(1, Relaxed);
        let last = chain(e);
        tracing::warn!(
            addr = %self.addr,
            retry = ?self.cfg.retry,
            "the remote pool failed; leaving it alone for a while: {last}"
        );
        *lock(&self.down) = Some(Down {
            until: Instant::now() + self.cfg.retry,
            last,
        });
    }

    /// Ends what timed-out transfers NIXL now says are over: their quarantined pages are
    /// abandoned (on the connection that reserved them), their staging buffers used again.
    fn settle(&self, inner: &mut Inner) {
        let mut i = 0;
        while i < inner.lingering.len() {
            if !inner.lingering[i].over() {
                i += 1;
                continue;
            }
            let mut l = inner.lingering.swap_remove(i);
            self.counters.lingering.fetch_sub(1, Relaxed);
            let same_conn = inner.conn.as_ref().is_some_and(|c| c.serial == l.conn);
            if same_conn && !l.tickets.is_empty() {
                let tickets = std::mem::take(&mut l.tickets);
                self.give_back(inner, Op::Abandon { tickets });
            }
            if inner.staging.is_none() {
                inner.staging = l.staging.take();
            }
        }
    }

    /// Sends a request whose failure changes nothing for the caller (abandon, quarantine,
    /// release): a broken connection is made again by the next request.
    fn give_back(&self, inner: &mut Inner, op: Op) {
        let name = op.name();
        if let Err(e) = self.call(inner, op) {
            tracing::info!("remote {name} failed: {}", chain(&e));
            if class(&e) != Class::Plain {
                inner.conn = None;
            }
        }
    }

    /// A new connection: hello, and marud's NIXL metadata loaded in place of the old.
    fn reconnect(&self, inner: &mut Inner) -> Result<()> {
        inner.conn = None;
        if inner.serial > 0 {
            self.counters.reconnects.fetch_add(1, Relaxed);
        }
        let mut stream = self.dial()?;
        let metadata = self
            .agent
            .metadata()
            .map_err(nixl_err("reading the worker's agent metadata"))?;
        let req = Request {
            id: inner.next_id,
            generation: 0,
            op: Op::Hello {
                version: proto::VERSION,
                token: self.cfg.token.clone(),
                node: self.cfg.node.clone(),
                metadata: Blob(metadata),
            },
        };
        inner.next_id += 1;
        self.counters.requests.fetch_add(1, Relaxed);
        let resp = exchange(
            &mut stream,
            &mut inner.frame,
            &req,
            &self.addr,
            self.cfg.control_timeout,
        )?;
        let welcome = match resp.outcome {
            Outcome::Ok(Reply::Hello(w)) => w,
            Outcome::Ok(other) => return Err(unexpected("hello", &other)),
            Outcome::Err(w) => return Err(server_error(w)),
        };
        inner.serial += 1;
        let read_ttl = Duration::from_millis(welcome.read_ttl_ms);
        // A transfer that outlives its reservation or read protection may write pages the
        // door gave to another, or read an entry removed meanwhile: kept well inside both.
        let most = read_ttl.min(Duration::from_millis(welcome.reserve_ttl_ms)) / 2;
        let transfer_timeout = if self.cfg.transfer_timeout > most {
            tracing::warn!(
                addr = %self.addr,
                configured = ?self.cfg.transfer_timeout,
                used = ?most,
                "the transfer timeout is lowered to half the door's shortest TTL"
            );
            most
        } else {
            self.cfg.transfer_timeout
        };
        inner.conn = Some(Conn {
            stream,
            serial: inner.serial,
            generation: welcome.generation,
            registration: 0,
            regions: Vec::new(),
            max_items: welcome.max_items.clamp(1, proto::MAX_ITEMS),
            transfer_timeout,
            read_ttl,
        });
        if let Err(e) = self.load_registration(inner, &welcome.registration) {
            inner.conn = None;
            return Err(e);
        }
        tracing::info!(
            addr = %self.addr,
            pool = %welcome.pool,
            generation = format_args!("{:016x}", welcome.generation),
            peer = ?inner.peer,
            "connected to the remote pool"
        );
        Ok(())
    }

    fn dial(&self) -> Result<TcpStream> {
        let io_err = |during, source| Error::Io {
            addr: self.addr.clone(),
            during,
            source,
        };
        let timeout = self.cfg.control_timeout;
        let mut last = None;
        for a in self
            .addr
            .to_socket_addrs()
            .map_err(|e| io_err("resolving", e))?
        {
            match TcpStream::connect_timeout(&a, timeout) {
                Ok(s) => {
                    let setup = s
                        .set_nodelay(true)
                        .and_then(|()| s.set_read_timeout(Some(timeout)))
                        .and_then(|()| s.set_write_timeout(Some(timeout)));
                    setup.map_err(|e| io_err("setting up the connection", e))?;
                    return Ok(s);
                }
                Err(e) => last = Some(e),
            }
        }
        Err(io_err(
            "connecting",
            last.unwrap_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no address")),
        ))
    }

    /// Forgets marud's old NIXL metadata and loads `reg`'s.
    fn load_registration(&self, inner: &mut Inner, reg: &Registration) -> Result<()> {
        if let Some(old) = inner.peer.take()
            && let Err(e) = self.agent.forget_peer(&old)
        {
            tracing::debug!(
                peer = old,
                "forgetting marud's old NIXL metadata: {}",
                chain(&e)
            );
        }
        let name = self
            .agent
            .load_peer(&reg.metadata.0)
            .map_err(nixl_err("loading marud's NIXL metadata"))?;
        if name != reg.agent {
            tracing::warn!(
                loaded = name,
                announced = reg.agent,
                "marud's NIXL metadata names another agent than announced"
            );
        }
        inner.peer = Some(name);
        if let Some(c) = inner.conn.as_mut() {
            c.registration = reg.version;
            c.regions = reg.regions.clone();
        }
        Ok(())
    }

    /// One request on the current connection, with the generation and registration checks.
    fn call(&self, inner: &mut Inner, op: Op) -> Result<Reply> {
        let _span = tracing::debug_span!("remote", op = op.name(), items = op.items()).entered();
        let Some(conn) = inner.conn.as_mut() else {
            return Err(Error::Io {
                addr: self.addr.clone(),
                during: "sending a request",
                source: io::Error::from(io::ErrorKind::NotConnected),
            });
        };
        let req = Request {
            id: inner.next_id,
            generation: conn.generation,
            op,
        };
        inner.next_id += 1;
        self.counters.requests.fetch_add(1, Relaxed);
        let t = Instant::now();
        let resp = exchange(
            &mut conn.stream,
            &mut inner.frame,
            &req,
            &self.addr,
            self.cfg.control_timeout,
        );
        add_time(&self.counters.control_ns, t);
        let resp = resp?;
        if resp.generation != conn.generation
            || matches!(&resp.outcome, Outcome::Err(w) if w.kind == proto::STALE_GENERATION)
        {
            return Err(Error::StaleGeneration);
        }
        if resp.registration > conn.registration {
            self.refresh_registration(inner)?;
        }
        match resp.outcome {
            Outcome::Ok(r) => Ok(r),
            Outcome::Err(w) => Err(server_error(w)),
        }
    }

    /// Asks for marud's registration and loads it.
    fn refresh_registration(&self, inner: &mut Inner) -> Result<()> {
        let Some(conn) = inner.conn.as_mut() else {
            return Ok(());
        };
        let req = Request {
            id: inner.next_id,
            generation: conn.generation,
            op: Op::Metadata,
        };
        inner.next_id += 1;
        self.counters.requests.fetch_add(1, Relaxed);
        let resp = exchange(
            &mut conn.stream,
            &mut inner.frame,
            &req,
            &self.addr,
            self.cfg.control_timeout,
        )?;
        match resp.outcome {
            Outcome::Err(w) if w.kind == proto::STALE_GENERATION => Err(Error::StaleGeneration),
            Outcome::Err(w) => Err(server_error(w)),
            Outcome::Ok(Reply::Metadata(reg)) => {
                tracing::info!(version = reg.version, "marud's NIXL registration changed");
                self.load_registration(inner, &reg)
            }
            Outcome::Ok(other) => Err(unexpected("metadata", &other)),
        }
    }

    /// The staging buffer's address and length, mapping a new one when the last went with a
    /// timed-out transfer.
    fn ensure_staging(&self, inner: &mut Inner) -> Result<(u64, usize)> {
        if inner.staging.is_none() && inner.lingering.len() >= MAX_LINGERING {
            return Err(Error::Stuck(inner.lingering.len()));
        }
        let s = match &mut inner.staging {
            Some(s) => s,
            slot @ None => slot.insert(Staging::new(&self.agent, self.staging_len)?),
        };
        Ok((s.addr, s.len))
    }

    /// One transfer between the staging buffer and the pool, waited for. One that lingers
    /// ([`Failed`]) keeps the staging buffer (and a WRITE's `tickets`, quarantined by the
    /// caller) until NIXL says it is over.
    fn transfer(
        &self,
        inner: &mut Inner,
        op: maru_nixl::Op,
        local: &[Desc],
        remote: &[Desc],
        tickets: Vec<u64>,
    ) -> std::result::Result<(), Failed> {
        self.transfer_on(inner, op, Mem::Dram, local, remote, tickets, Keep::Staging)
    }

    /// [`transfer`](Self::transfer) with local memory of kind `local_mem`; one that lingers
    /// keeps what `keep` names (the staging buffer, the leases it reads into, the arenas it
    /// writes from) until NIXL says it is over.
    #[allow(clippy::too_many_arguments)]
    fn transfer_on(
        &self,
        inner: &mut Inner,
        op: maru_nixl::Op,
        local_mem: Mem,
        local: &[Desc],
        remote: &[Desc],
        tickets: Vec<u64>,
        keep: Keep<'_>,
    ) -> std::result::Result<(), Failed> {
        let peer = inner.peer.as_deref().unwrap_or_default();
        let posted = Instant::now();
        let mut t = self
            .agent
            .transfer(op, local_mem, local, Mem::Dram, remote, peer)
            .map_err(|error| Failed {
                error,
                lingers: false,
            })?;
        let timeout = inner
            .conn
            .as_ref()
            .map_or(self.cfg.transfer_timeout, |c| c.transfer_timeout);
        let waited = t.wait(timeout);
        add_time(&self.counters.transfer_ns, posted);
        match waited {
            Ok(()) => {
                let bytes: u64 = local.iter().map(|d| d.len).sum();
                self.counters.transfers.fetch_add(1, Relaxed);
                let moved = match op {
                    maru_nixl::Op::Write => &self.counters.bytes_written,
                    maru_nixl::Op::Read => &self.counters.bytes_read,
                };
                moved.fetch_add(bytes, Relaxed);
                Ok(())
            }
            // A transfer that failed, and that NIXL lets go: nothing of it moves any more.
            Err(error) if !matches!(error, maru_nixl::Error::TimedOut(_)) && t.release() => {
                Err(Failed {
                    error,
                    lingers: false,
                })
            }
            // Timed out, or failed while NIXL still holds it: it may still move bytes.
            Err(error) => {
                // SAFETY: `t` borrows the agent inside `self.agent`, an `Arc` whose pointee never
                // moves; the `Lingering` holds a clone of that `Arc` in a field dropped after
                // `transfer`, so the agent outlives the borrow the lifetime no longer names.
                let transfer = unsafe { std::mem::transmute::<Transfer<'_>, Transfer<'static>>(t) };
                let (staging, leases, sources) = match keep {
                    Keep::Staging => (inner.staging.take(), Vec::new(), Vec::new()),
                    Keep::Leases(v) => (None, std::mem::take(v), Vec::new()),
                    Keep::Sources(a) => (None, Vec::new(), a),
                };
                inner.lingering.push(Lingering {
                    transfer,
                    staging,
                    leases,
                    sources,
                    tickets,
                    conn: inner.conn.as_ref().map_or(0, |c| c.serial),
                    _agent: self.agent.clone(),
                });
                self.counters.lingering.fetch_add(1, Relaxed);
                Err(Failed {
                    error,
                    lingers: true,
                })
            }
        }
    }

    /// Stores one chunk (it fits the staging buffer and the item limits).
    fn store_chunk(
        &self,
        inner: &mut Inner,
        ns: &str,
        items: &[(usize, &str, &[u8])],
    ) -> Result<Vec<Result<Stored>>> {
        let (staging_addr, staging_len) = self.ensure_staging(inner)?;
        if !inner.made.contains(ns) {
            let op = Op::Mkdir {
                ns: ns.into(),
                mode: 0o755,
            };
            match self.call(inner, op)? {
                Reply::Done => {
                    inner.made.insert(ns.to_owned());
                }
                other => return Err(unexpected("mkdir", &other)),
            }
        }
        let keys = items.iter().map(|(_, k, _)| (*k).to_owned()).collect();
        let present = match self.call(
            inner,
            Op::Exists {
                ns: ns.into(),
                keys,
            },
        )? {
            Reply::Exists(v) if v.len() == items.len() => v,
            Reply::Exists(v) => return Err(count_mismatch("exists", items.len(), v.len())),
            other => return Err(unexpected("exists", &other)),
        };
        let mut out: Vec<Result<Stored>> =
            items.iter().map(|_| Ok(Stored::AlreadyPresent)).collect();
        let todo: Vec<usize> = (0..items.len()).filter(|&i| !present[i]).collect();
        if todo.is_empty() {
            return Ok(out);
        }
        let sizes: Vec<u64> = todo.iter().map(|&i| items[i].2.len() as u64).collect();
        let pages = match self.call(
            inner,
            Op::Reserve {
                ns: ns.into(),
                sizes: sizes.clone(),
            },
        )? {
            Reply::Reserved(p) => p,
            other => return Err(unexpected("reserve", &other)),
        };
        let tickets: Vec<u64> = pages.iter().map(|p| p.ticket).collect();
        if let Err(e) = self.check_pages(inner, &pages, &sizes, staging_len) {
            self.give_back(inner, Op::Abandon { tickets });
            return Err(e);
        }

        let mut local = Vec::with_capacity(todo.len());
        let mut remote = Vec::with_capacity(todo.len());
        if let Some(staging) = inner.staging.as_mut() {
            let copying = Instant::now();
            let buf = staging.bytes_mut();
            let mut off = 0;
            for (&i, page) in todo.iter().zip(&pages) {
                let value = items[i].2;
                off = align_up(off);
                buf[off..off + value.len()].copy_from_slice(value);
                local.push(Desc::host(staging_addr + off as u64, value.len() as u64));
                remote.push(Desc::host(page.addr, value.len() as u64));
                off += value.len();
            }
            add_time(&self.counters.copy_ns, copying);
        }
        let written = self.transfer(
            inner,
            maru_nixl::Op::Write,
            &local,
            &remote,
            tickets.clone(),
        );
        let names: Vec<(String, u64)> = todo
            .iter()
            .map(|&i| (items[i].1.to_owned(), items[i].2.len() as u64))
            .collect();
        self.finish_store(inner, ns, written, tickets, &todo, &pages, names, &mut out)?;
        Ok(out)
    }

    /// Ends a store after its WRITE of `pages` (for items `todo` of the chunk, named and sized
    /// by `names`): a WRITE that failed gives the pages back (quarantined when it lingers: it
    /// may still land, so they are kept from every use until it is known over); one that
    /// succeeded publishes them, each outcome in `out`.
    #[allow(clippy::too_many_arguments)]
    fn finish_store(
        &self,
        inner: &mut Inner,
        ns: &str,
        written: std::result::Result<(), Failed>,
        tickets: Vec<u64>,
        todo: &[usize],
        pages: &[proto::Page],
        names: Vec<(String, u64)>,
        out: &mut [Result<Stored>],
    ) -> Result<()> {
        if let Err(f) = written {
            let op = if f.lingers {
                Op::Quarantine { tickets }
            } else {
                Op::Abandon { tickets }
            };
            self.give_back(inner, op);
            return Err(f.during("writing into the pool"));
        }
        let publish = pages
            .iter()
            .zip(names)
            .map(|(p, (key, len))| PublishItem {
                ticket: p.ticket,
                key,
                len,
            })
            .collect();
        let op = Op::Publish {
            ns: ns.into(),
            items: publish,
        };
        let outcomes = match self.call(inner, op)? {
            Reply::Published(v) if v.len() == todo.len() => v,
            Reply::Published(v) => return Err(count_mismatch("publish", todo.len(), v.len())),
            other => return Err(unexpected("publish", &other)),
        };
        for (&i, o) in todo.iter().zip(outcomes) {
            out[i] = match o {
                Published::Created => Ok(Stored::Created),
                Published::AlreadyPresent => Ok(Stored::AlreadyPresent),
                Published::Rejected(w) => Err(server_error(w)),
            };
        }
        Ok(())
    }

    /// Checks reserved pages: one per size, each large enough, in marud's registered memory.
    fn check_pages(
        &self,
        inner: &Inner,
        pages: &[Page],
        sizes: &[u64],
        staging: usize,
    ) -> Result<()> {
        if pages.len() != sizes.len() {
            return Err(count_mismatch("reserve", sizes.len(), pages.len()));
        }
        let regions = inner
            .conn
            .as_ref()
            .map(|c| c.regions.as_slice())
            .unwrap_or_default();
        let mut used = 0usize;
        for (p, &size) in pages.iter().zip(sizes) {
            if p.len < size {
                return Err(Error::Protocol(format!(
                    "a page of {} bytes was reserved for {size} bytes",
                    p.len
                )));
            }
            if !registered(regions, p.addr, size) {
                return Err(Error::Protocol(format!(
                    "page {:#x}+{size} lies outside marud's registered memory",
                    p.addr
                )));
            }
            used = align_up(used) + size as usize;
        }
        if used > staging {
            return Err(Error::InvalidArgument(format!(
                "a chunk of {used} bytes exceeds the staging buffer of {staging} bytes"
            )));
        }
        Ok(())
    }

    /// Loads one chunk of keys: `found(i, bytes)` for each entry found. Entries longer than
    /// `max_len` (or the staging buffer) are [`Error::InvalidArgument`].
    fn read_chunk(
        &self,
        inner: &mut Inner,
        ns: &str,
        keys: &[&str],
        max_len: Option<usize>,
        found: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        self.ensure_staging(inner)?;
        let op = Op::Lookup {
            ns: ns.into(),
            keys: keys.iter().map(|k| (*k).to_owned()).collect(),
        };
        // The protections live the door's read TTL from the lookup's arrival, later than this.
        let asked = Instant::now();
        let pages = match self.call(inner, op)? {
            Reply::Found(v) if v.len() == keys.len() => v,
            Reply::Found(v) => return Err(count_mismatch("lookup", keys.len(), v.len())),
            other => return Err(unexpected("lookup", &other)),
        };
        let protected = asked + inner.conn.as_ref().map_or(Duration::ZERO, |c| c.read_ttl);
        let tickets: Vec<u64> = pages.iter().flatten().map(|p| p.ticket).collect();
        let read = self.read_pages(inner, &pages, max_len, protected, found);
        if !tickets.is_empty() && inner.conn.is_some() {
            // The bytes are read (or given up): the protections can end.
            self.give_back(inner, Op::Release { tickets });
        }
        read
    }

    /// READs `pages` into the staging buffer, round by round, each piece handed to `found`;
    /// pieces of a round that ends at `protected` or after are not (misses): their read
    /// protections may have ended, and the entries' pages been reused meanwhile.
    fn read_pages(
        &self,
        inner: &mut Inner,
        pages: &[Option<Page>],
        max_len: Option<usize>,
        protected: Instant,
        found: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        let (staging_addr, staging_len) = self.ensure_staging(inner)?;
        let regions = inner
            .conn
            .as_ref()
            .map(|c| c.regions.as_slice())
            .unwrap_or_default();
        for p in pages.iter().flatten() {
            let limit = max_len.unwrap_or(staging_len).min(staging_len);
            if p.len > limit as u64 {
                return Err(Error::InvalidArgument(format!(
                    "an entry of {} bytes exceeds the {} of {limit} bytes",
                    p.len,
                    if max_len.is_some_and(|m| m < staging_len) {
                        "buffer given"
                    } else {
                        "staging buffer"
                    }
                )));
            }
            if !registered(regions, p.addr, p.len) {
                return Err(Error::Protocol(format!(
                    "entry {:#x}+{} lies outside marud's registered memory",
                    p.addr, p.len
                )));
            }
        }
        // (item, offset in the staging buffer, length) of each piece of the round.
        let mut round: Vec<(usize, usize, usize)> = Vec::new();
        let (mut local, mut remote) = (Vec::new(), Vec::new());
        let mut used = 0usize;
        for (i, p) in pages.iter().enumerate() {
            let Some(p) = p else { continue };
            let len = p.len as usize;
            if len == 0 {
                found(i, &[]);
                continue;
            }
            let mut off = align_up(used);
            if off + len > staging_len {
                self.read_round(inner, &mut round, &mut local, &mut remote, protected, found)?;
                off = 0;
            }
            round.push((i, off, len));
            local.push(Desc::host(staging_addr + off as u64, p.len));
            remote.push(Desc::host(p.addr, p.len));
            used = off + len;
        }
        if !round.is_empty() {
            self.read_round(inner, &mut round, &mut local, &mut remote, protected, found)?;
        }
        Ok(())
    }

    /// One READ list into the staging buffer, its pieces handed to `found`.
    fn read_round(
        &self,
        inner: &mut Inner,
        round: &mut Vec<(usize, usize, usize)>,
        local: &mut Vec<Desc>,
        remote: &mut Vec<Desc>,
        protected: Instant,
        found: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        self.transfer(inner, maru_nixl::Op::Read, local, remote, Vec::new())
            .map_err(|f| f.during("reading from the pool"))?;
        if Instant::now() >= protected {
            tracing::warn!(
                addr = %self.addr,
                pieces = round.len(),
                "a READ ended after its read protections may have: its pieces are misses"
            );
        } else if let Some(staging) = inner.staging.as_ref() {
            let buf = staging.bytes();
            for &(i, off, len) in round.iter() {
                found(i, &buf[off..off + len]);
            }
        }
        round.clear();
        local.clear();
        remote.clear();
        Ok(())
    }
}

fn max_items(inner: &Inner) -> usize {
    inner.conn.as_ref().map_or(1, |c| c.max_items)
}

/// 32 random bits (std's hasher keys are seeded from the OS).
fn random32() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish() as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(parse_url("tcp://10.0.0.1:7860").unwrap(), "10.0.0.1:7860");
        assert_eq!(parse_url("tcp://pool-a:7860/").unwrap(), "pool-a:7860");
        assert_eq!(parse_url("[::1]:7860").unwrap(), "[::1]:7860");
        assert!(parse_url("http://pool:80").is_err());
        assert!(parse_url("tcp://pool").is_err());
        assert!(parse_url("tcp://:7860").is_err());
        assert!(parse_url("tcp://pool:99999").is_err());
    }

    #[test]
    fn ucx_devices_lose_their_port() {
        assert_eq!(device_list("mlx5_0").unwrap(), "mlx5_0");
        assert_eq!(device_list("mlx5_0:1, mlx5_1").unwrap(), "mlx5_0, mlx5_1");
        assert!(device_list("mlx5_0:2").is_err());
        assert!(device_list(" , ").is_err());
        assert_eq!(plain_interface("mlx5_0, lo"), Some("lo"));
        assert_eq!(plain_interface("no-such-device-here"), None);
    }

    #[test]
    fn chunks_fit_the_items_the_frame_and_the_staging_buffer() {
        let keys: Vec<String> = (0..100).map(|i| format!("k{i}")).collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        assert_eq!(plan_keys("ns", &keys, 0, 16), 16);
        assert_eq!(plan_keys("ns", &keys, 96, 16), 100);
        // Long keys: half a frame's worth.
        let long = "x".repeat(255);
        let many: Vec<&str> = vec![long.as_str(); proto::MAX_ITEMS];
        let end = plan_keys("ns", &many, 0, proto::MAX_ITEMS);
        assert!(end < proto::MAX_ITEMS && end * item_cost("ns", &long) <= proto::MAX_FRAME / 2);
        // Quotes and control bytes count as escaped.
        assert_eq!(json_len("a\"\u{1}"), 2 + 1 + 2 + 6);

        let v = vec![0u8; 1000];
        let items: Vec<(usize, &str, &[u8])> = (0..10).map(|i| (i, "k", v.as_slice())).collect();
        // 1000 bytes take 1024 with alignment: three fit 3000 bytes, the fourth does not.
        assert_eq!(plan_values("ns", &items, 0, 100, 3100), 3);
        assert_eq!(plan_values("ns", &items, 9, 100, 3100), 10);
        assert_eq!(plan_values("ns", &items, 0, 2, 1 << 20), 2);
        // A value that fills the buffer goes alone.
        assert_eq!(plan_values("ns", &items, 0, 100, 1000), 1);
    }

    #[test]
    fn pages_must_lie_in_registered_memory() {
        let regions = [(0x1000, 0x1000)];
        assert!(registered(&regions, 0x1000, 0x1000));
        assert!(registered(&regions, 0x1800, 0x10));
        assert!(!registered(&regions, 0x1800, 0x1000));
        assert!(!registered(&regions, 0xfff, 2));
        assert!(!registered(&regions, u64::MAX, 2));
        assert!(!registered(&[], 0x1000, 1));
    }

    #[test]
    fn refusals_keep_their_kind_and_say_it_once() {
        let w = maru::Error::NotFound("ns/k".into()).to_wire();
        let e = server_error(w);
        assert_eq!(e.to_string(), "marud refused: not found: ns/k");
        assert!(matches!(e, Error::Server(maru::Error::NotFound(_))));
        let full = server_error(maru::Error::NoSpace("pool full: 3 pages".into()).to_wire());
        assert_eq!(full.to_string(), "the remote pool is full: 3 pages");
        let full = server_error(maru::Error::NoSpace("pool full".into()).to_wire());
        assert_eq!(full.to_string(), "the remote pool is full");
        assert_eq!(class(&full), Class::Plain);
        let stale = Error::StaleGeneration;
        assert_eq!(class(&stale), Class::Retry);
        let cut = Error::Io {
            addr: "x".into(),
            during: "reading",
            source: io::Error::from(io::ErrorKind::UnexpectedEof),
        };
        assert_eq!(class(&cut), Class::Retry);
        let slow = Error::Io {
            addr: "x".into(),
            during: "reading",
            source: io::Error::from(io::ErrorKind::TimedOut),
        };
        assert_eq!(class(&slow), Class::Down);
    }

    #[test]
    fn the_client_is_send_and_sync() {
        fn both<T: Send + Sync>() {}
        both::<RemoteClient>();
    }
}
