//! The control protocol: length-prefixed serde_json frames on a Unix stream
//! socket, with file descriptors passed as `SCM_RIGHTS` ancillary data.
//!
//! A frame is a little-endian `u32` byte count followed by that many bytes of
//! JSON. A response that carries descriptors says how many in its `fds` field;
//! they arrive, in order, with the frame's bytes. See `doc/PROTOCOL.md`.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use serde::{Deserialize, Serialize};

use crate::error::{Error, WireError};

/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u32 = 3;
/// The largest frame body accepted, in bytes.
pub const MAX_FRAME: usize = 4 << 20;
/// The most descriptors one frame may carry (the kernel's `SCM_MAX_FD` is 253).
pub const MAX_FDS_PER_FRAME: usize = 240;
/// The most keys in one batch request.
pub const MAX_BATCH: usize = 4096;

/// A request from a client.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Request {
    /// Chosen by the client, echoed in the response.
    pub id: u64,
    /// What to do.
    #[serde(flatten)]
    pub op: Op,
}

/// The operations of the control protocol.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "op", content = "args", rename_all = "snake_case")]
pub enum Op {
    /// Must be the first request of a connection.
    Hello {
        /// The client's protocol version.
        version: u32,
        /// A free-form client name (shown in stats).
        client: String,
    },
    /// Create a namespace (parents must exist).
    Mkdir {
        /// Namespace path.
        ns: String,
        /// Permission bits (e.g. 0o755).
        mode: u32,
    },
    /// Remove an empty namespace.
    Rmdir {
        /// Namespace path.
        ns: String,
    },
    /// Set (or clear, with `None`) a namespace's quota: the most bytes of sealed entries it
    /// and the namespaces under it may hold. Root only.
    SetQuota {
        /// Namespace path.
        ns: String,
        /// Bytes, or `None` for no quota.
        bytes: Option<u64>,
    },
    /// Reserve `count` writable allocations of `size` bytes each.
    Alloc {
        /// Bytes per allocation (> 0).
        size: u64,
        /// How many (1..=MAX_FDS_PER_FRAME).
        count: u32,
        /// Pool to allocate from (by name); placement policy when absent.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pool: Option<String>,
        /// The namespace the allocations will be published in, if known: a memfs pool packs
        /// small ones into a file shared with that namespace's other small entries (published
        /// elsewhere, an entry is copied into a file of its own).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ns: Option<String>,
    },
    /// Give back allocations that were not published.
    Free {
        /// Allocation ids.
        allocs: Vec<u64>,
    },
    /// Publish (seal) an allocation under `ns/key`. First writer wins.
    Publish {
        /// Allocation id from `Alloc`.
        alloc: u64,
        /// Namespace.
        ns: String,
        /// Key.
        key: String,
        /// Bytes of the allocation that hold data (<= its size); the whole allocation when absent.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        len: Option<u64>,
    },
    /// Locate sealed entries and receive their descriptors.
    Retrieve {
        /// Namespace.
        ns: String,
        /// Keys.
        keys: Vec<String>,
    },
    /// Drop leases taken by `Retrieve` (raw pools).
    Release {
        /// Entry generations.
        gens: Vec<u64>,
    },
    /// Entries this client mapped by opening their files itself (memfs, through the
    /// directories `Index` gave it): marud counts them as retrieved and as recently used.
    Accessed {
        /// Entry generations.
        gens: Vec<u64>,
    },
    /// Which keys exist (sealed).
    Exists {
        /// Namespace.
        ns: String,
        /// Keys.
        keys: Vec<String>,
    },
    /// Delete sealed entries.
    Delete {
        /// Namespace.
        ns: String,
        /// Keys.
        keys: Vec<String>,
    },
    /// Pin (protect from eviction) or unpin entries.
    Pin {
        /// Namespace.
        ns: String,
        /// Keys.
        keys: Vec<String>,
        /// true = pin, false = unpin.
        pinned: bool,
    },
    /// Take (or give back) one hold per key for this connection: an entry with holds is never
    /// evicted. Holds are counted per connection and dropped when it closes.
    Hold {
        /// Namespace.
        ns: String,
        /// Keys.
        keys: Vec<String>,
        /// true = take a hold, false = give one back (`not_found` if this connection holds
        /// none on the key).
        hold: bool,
    },
    /// Get a read-only descriptor of the namespace's shared index.
    Index {
        /// Namespace.
        ns: String,
    },
    /// List a namespace: child namespaces and entries.
    List {
        /// Namespace ("" = the root).
        ns: String,
        /// A page of the listing: the names after `after` (from the first when None), as
        /// many as fit in half a frame, and whether more follow (`Listing::more`). Without
        /// it (clients before it), the whole listing in one reply, which a namespace of more
        /// than about 25,000 names does not fit.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        paged: bool,
        /// The last name of the page before (children and entries in one order).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        after: Option<String>,
    },
    /// Store-wide statistics.
    Stats,
    /// Asks for a shared-memory lane for this connection's calls (see [`crate::lane`]).
    Lane,
    /// Evict least recently used entries until `bytes` are free.
    Evict {
        /// Bytes to make free.
        bytes: u64,
    },
}

impl Op {
    /// A short name for logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Hello { .. } => "hello",
            Op::Mkdir { .. } => "mkdir",
            Op::Rmdir { .. } => "rmdir",
            Op::SetQuota { .. } => "set_quota",
            Op::Alloc { .. } => "alloc",
            Op::Free { .. } => "free",
            Op::Publish { .. } => "publish",
            Op::Retrieve { .. } => "retrieve",
            Op::Release { .. } => "release",
            Op::Accessed { .. } => "accessed",
            Op::Exists { .. } => "exists",
            Op::Delete { .. } => "delete",
            Op::Pin { .. } => "pin",
            Op::Hold { .. } => "hold",
            Op::Index { .. } => "index",
            Op::List { .. } => "list",
            Op::Stats => "stats",
            Op::Lane => "lane",
            Op::Evict { .. } => "evict",
        }
    }
}

/// A response to one request.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Response {
    /// The request's id.
    pub id: u64,
    /// How many descriptors travel with this frame.
    #[serde(default)]
    pub fds: u32,
    /// The outcome.
    #[serde(flatten)]
    pub result: Outcome,
}

/// Success with a body, or an error.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The operation succeeded.
    Ok(Body),
    /// The operation failed.
    Err(WireError),
}

/// The kind of a pool.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum PoolKind {
    /// A memory filesystem directory; one backing file per entry.
    Memfs,
    /// A DAX character device carved into regions.
    Devdax,
    /// A regular file treated like a DAX device.
    File,
}

impl PoolKind {
    /// True for pools carved into regions (devdax and file).
    pub fn is_raw(self) -> bool {
        !matches!(self, PoolKind::Memfs)
    }
}

/// A pool as the daemon describes it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PoolInfo {
    /// Index of the pool in the daemon's list (stable for the daemon's life).
    pub id: u32,
    /// Name (from the spec, or the path).
    pub name: String,
    /// Kind.
    pub kind: PoolKind,
    /// Path of the directory, device or file.
    pub path: String,
    /// Capacity in bytes.
    pub capacity: u64,
    /// Raw pools: bytes of the device or file, from offset 0 (header and entries); a client
    /// maps this much to see every entry at its offset. 0 for memfs pools.
    #[serde(default)]
    pub mapped_len: u64,
    /// Bytes in use (sealed + being written + held by leases or mappings).
    pub used: u64,
    /// Bytes of sealed entries.
    pub sealed_bytes: u64,
    /// Sealed entries.
    pub entries: u64,
    /// Bytes handed out to clients in regions or allocations, not yet published.
    pub writing_bytes: u64,
    /// Bytes of this pool in 2 MiB pages (memfs: `ShmemHugePages` share of the files; raw: n/a).
    #[serde(default)]
    pub huge_bytes: u64,
    /// Entries evicted since start.
    pub evictions: u64,
    /// Raw pools shared without hardware cache coherence (`coherent=false`): bytes whose
    /// cache lines this host wrote back before publishing them, and bytes of other hosts'
    /// entries whose lines it invalidated before their first read here.
    #[serde(default)]
    pub coherence: Option<Coherence>,
}

/// Cache maintenance of a non-coherent pool, in bytes since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Coherence {
    pub flushed: u64,
    pub invalidated: u64,
}

/// Where a sealed entry lives, as returned by `Retrieve` and `List`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Located {
    /// The key.
    pub key: String,
    /// Unique id of this sealed entry (changes if the key is deleted and stored again).
    pub generation: u64,
    /// Pool id.
    pub pool: u32,
    /// Where it is: the byte offset in a raw pool; in a memfs pool the inode number of the
    /// entry's file, or the [`crate::index::pack_location`] of a packed entry.
    pub offset: u64,
    /// Size in bytes.
    pub size: u64,
    /// Pinned against eviction.
    pub pinned: bool,
    /// Holds on it, of every connection (see [`Op::Hold`]).
    #[serde(default)]
    pub holds: u32,
    /// A descriptor travels with this item (memfs: the entry's file, or its pack the first
    /// time a reply locates an entry in it; raw: the pool, first time only).
    pub fd: bool,
}

/// One writable allocation.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Grant {
    /// Allocation id (for `Publish` / `Free`).
    pub alloc: u64,
    /// Pool id.
    pub pool: u32,
    /// Offset in the pool (raw pools); for memfs, in the file that comes with the grant (0 for a
    /// file of its own, the allocation's place in a pack).
    pub offset: u64,
    /// Size in bytes.
    pub size: u64,
    /// A descriptor travels with this item (memfs: the new file or the pack, unless the
    /// reply's previous grant is in the same pack; raw: the pool, first time only).
    pub fd: bool,
    /// The pack the allocation was carved from (memfs): a client maps each pack once for all
    /// its grants.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pack: Option<u32>,
    /// Cluster mode: the instant (`maru::index::boottime_ns`) after which the client must not
    /// begin writing into this allocation (the host's lease may have run out by then and
    /// another host carved the space again); an unused grant past it is given back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<u64>,
}

/// A namespace as listed.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct NsInfo {
    /// Full path.
    pub ns: String,
    /// Owner uid.
    pub uid: u32,
    /// Owner gid.
    pub gid: u32,
    /// Mode bits.
    pub mode: u32,
    /// Sealed entries directly in it.
    pub entries: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Quota on it and the namespaces under it, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota: Option<u64>,
}

/// Usage of one client connection.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ClientInfo {
    /// Session id.
    pub session: u64,
    /// Client name from the hello.
    pub name: String,
    /// Peer pid / uid.
    pub pid: i32,
    /// Peer uid.
    pub uid: u32,
    /// Bytes granted and not yet published or freed.
    pub allocated: u64,
    /// Bytes of entries this client published (still live).
    pub used: u64,
    /// Granted bytes not holding data (`allocated` of raw regions minus packed data).
    pub slack: u64,
    /// Leases held.
    pub leases: u64,
}

/// Upper bounds (µs) of the latency histogram buckets in [`Stats::latency_us`]; a last bucket
/// counts everything slower.
pub const LATENCY_BUCKETS_US: [u64; 14] = [
    5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 100_000, 1_000_000,
];

/// Store-wide statistics.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Stats {
    /// Pools.
    pub pools: Vec<PoolInfo>,
    /// Namespaces.
    pub namespaces: Vec<NsInfo>,
    /// Clients.
    pub clients: Vec<ClientInfo>,
    /// Operation counters by name.
    pub ops: std::collections::BTreeMap<String, u64>,
    /// Eviction policy (`lru` or `off`).
    pub eviction: String,
    /// Bytes by kind (`stored`, `retrieved`, `deleted`, `evicted`).
    #[serde(default)]
    pub bytes: std::collections::BTreeMap<String, u64>,
    /// Latency histogram of control operations by name: counts per bucket of
    /// [`LATENCY_BUCKETS_US`], then one for slower.
    #[serde(default)]
    pub latency_us: std::collections::BTreeMap<String, Vec<u64>>,
    /// Sum of latencies by operation, in µs.
    #[serde(default)]
    pub latency_sum_us: std::collections::BTreeMap<String, u64>,
    /// Seconds since the daemon started.
    #[serde(default)]
    pub uptime_s: f64,
    /// Cluster mode: this host and the others sharing its pool (None on a single host).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<Box<ClusterInfo>>,
    /// A memory node's remote door and its connected workers (None without `remote_bind`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<Box<RemoteInfo>>,
}

/// A memory node's remote door as its marud sees it (`Stats::remote`, doc/REMOTE.md). The
/// counters run from marud's start.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct RemoteInfo {
    /// Where workers connect (`HOST:PORT`).
    pub addr: String,
    /// This marud run's generation, 16 hex digits (as in the logs).
    pub generation: String,
    /// The pool remote entries live in: its name, and its UUID.
    pub pool: String,
    pub pool_uuid: String,
    /// Workers admitted (hello accepted), and connections refused (a bad token, a bad hello,
    /// none before the connection closed).
    pub connections: u64,
    pub refused: u64,
    /// Control requests after the hello, and those answered with an error.
    pub requests: u64,
    pub errors: u64,
    /// Pages reserved and their bytes.
    pub pages_reserved: u64,
    pub bytes_reserved: u64,
    /// Entries published.
    pub published: u64,
    /// Lookup requests, and the bytes of the entries they protected for reading.
    pub lookups: u64,
    pub bytes_protected: u64,
    /// Tickets (reservations, read protections) ended by their TTL.
    pub expired: u64,
    /// Pages quarantined after a timed-out WRITE.
    pub quarantined: u64,
    /// The workers connected now, in the order they connected.
    pub workers: Vec<RemoteWorker>,
}

/// A worker connected to the remote door.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct RemoteWorker {
    /// The connection's number (in the door's log lines as `worker`).
    pub id: u64,
    /// The node the worker named in its hello.
    pub node: String,
    /// The name of its token (the token file's NAME), and the uid/gid it acts as.
    pub identity: String,
    pub uid: u32,
    pub gid: u32,
    /// Its address, `IP:PORT`.
    pub peer: String,
    /// Bytes reserved, not yet published or given back.
    pub reserved: u64,
    /// Bytes of entries it protects for reading (looked up, not yet released).
    pub protected: u64,
    /// Its control requests, and those answered with an error.
    pub requests: u64,
    pub errors: u64,
}

/// A cluster as one of its hosts sees it (`Stats::cluster`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ClusterInfo {
    /// This host's node name.
    pub node: String,
    /// Whether this host holds a live etcd lease (it may publish).
    pub live: bool,
    /// The etcd endpoints.
    pub endpoints: Vec<String>,
    /// The live hosts, as of the last look (about a second old at most).
    pub hosts: Vec<HostInfo>,
    /// Entries this host published.
    pub entries_here: u64,
    /// Entries other hosts published that this host serves.
    pub entries_elsewhere: u64,
    /// Uses of this host's entries that other hosts reported (for the LRU order here).
    #[serde(default)]
    pub uses_reported: u64,
    /// This host is fenced off the shared pool now (cut off, or back and not yet caught up):
    /// it serves, lists and grants nothing of it, so what it lists is not the cluster's.
    #[serde(default)]
    pub fenced: bool,
}

impl ClusterInfo {
    /// How many of host `h`'s entries this host serves (its own, for this host).
    pub fn entries_of(&self, h: &HostInfo) -> u64 {
        if h.node == self.node {
            self.entries_here
        } else {
            h.entries
        }
    }
}

impl HostInfo {
    /// Its host name and marud's pid, as shown: `(gone)` and `-` for a host that is gone,
    /// `(orphaned)` once its entries are evictable here.
    pub fn shown_address_pid(&self) -> (String, String) {
        if self.orphaned {
            ("(orphaned)".to_owned(), "-".to_owned())
        } else if self.gone {
            ("(gone)".to_owned(), "-".to_owned())
        } else {
            (self.address.clone(), self.pid.to_string())
        }
    }
}

/// A host of a cluster.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct HostInfo {
    /// Node name.
    pub node: String,
    /// Host name.
    pub address: String,
    /// marud's pid there.
    pub pid: u32,
    /// Bytes of the pool it has claimed (2 MiB units).
    pub claimed: u64,
    /// Entries it published that this host serves.
    #[serde(default)]
    pub entries: u64,
    /// Not a live host any more (its lease is gone): listed for the entries it published,
    /// which stay.
    #[serde(default)]
    pub gone: bool,
    /// Gone for longer than `--cluster-orphans-after`: its entries are orphans, which this
    /// host's eviction may take.
    #[serde(default)]
    pub orphaned: bool,
}

/// The body of a successful response.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Body {
    /// Reply to `Hello`.
    Hello {
        /// The daemon's protocol version.
        version: u32,
        /// The daemon's name and version.
        server: String,
        /// This connection's session id.
        session: u64,
        /// The pools.
        pools: Vec<PoolInfo>,
    },
    /// Nothing to say.
    Done,
    /// Reply to `Alloc`: one grant per allocation.
    Allocated {
        /// The grants.
        grants: Vec<Grant>,
    },
    /// Reply to `Publish`.
    Published {
        /// The new entry's generation.
        generation: u64,
    },
    /// Reply to `Retrieve`: one item per key, `None` for a missing key.
    Retrieved {
        /// Items.
        items: Vec<Option<Located>>,
    },
    /// Reply to `Exists`.
    Exists {
        /// One flag per key.
        found: Vec<bool>,
    },
    /// Per-key outcome of a batch (`Delete`, `Pin`, `Hold`): `None` = success.
    Batch {
        /// One outcome per key.
        results: Vec<Option<WireError>>,
    },
    /// Reply to `Index`: the table's read-only descriptor follows, then one per `dirs`.
    Index {
        /// Slots in the table.
        slots: u64,
        /// The memfs pools whose directory of the namespace (entries are files in it, named
        /// by their keys) follows, in this order: those where the kernel decides an open of an
        /// entry's file as the access policy would (for root, every memfs pool; for others,
        /// those whose tmpfs takes ACLs, by which each directory has its namespace's access
        /// and each file its entry's owner and mode).
        #[serde(default)]
        dirs: Vec<u32>,
        /// The memfs pools whose directory of packs follows (after the namespaces'
        /// directories), in this order: for root only (packs are root's), which opens a pack
        /// (named by its id) itself the first time the index shows an entry in it.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        packs: Vec<u32>,
    },
    /// Reply to `List`.
    Listing {
        /// The namespace itself.
        ns: Option<NsInfo>,
        /// Child namespaces.
        children: Vec<NsInfo>,
        /// Sealed entries.
        entries: Vec<Located>,
        /// A paged listing's names go on after this page's last.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        more: bool,
    },
    /// Reply to `Stats`.
    Stats(Stats),
    /// Reply to `Lane`: the lane's file goes with it (one descriptor).
    Lane {
        /// Bytes of the lane file.
        bytes: u64,
    },
    /// Reply to `Evict`.
    Evicted {
        /// Entries evicted.
        entries: u64,
        /// Bytes freed.
        bytes: u64,
    },
}

/// Encodes a message as one frame (length prefix included).
pub fn encode<T: Serialize>(msg: &T) -> Vec<u8> {
    let mut out = vec![0u8; 4];
    serde_json::to_writer(&mut out, msg).expect("serializing a protocol message cannot fail");
    let len = (out.len() - 4) as u32;
    out[..4].copy_from_slice(&len.to_le_bytes());
    out
}

/// Decodes a frame body.
pub fn decode<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, Error> {
    serde_json::from_slice(body).map_err(|e| Error::Protocol(format!("bad frame: {e}")))
}

/// A `retrieved` reply, decoded by [`decode_retrieved`].
#[derive(Debug, Deserialize)]
pub struct RetrievedFrame {
    /// The request's id.
    pub id: u64,
    /// How many descriptors travel with this frame.
    #[serde(default)]
    pub fds: u32,
    ok: RetrievedBody,
}

#[derive(Debug, Deserialize)]
struct RetrievedBody {
    #[serde(rename = "type")]
    _kind: RetrievedTag,
    items: Vec<Option<Located>>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "snake_case")]
enum RetrievedTag {
    Retrieved,
}

impl RetrievedFrame {
    /// The items, one per key asked.
    pub fn into_items(self) -> Vec<Option<Located>> {
        self.ok.items
    }
}

/// Decodes a frame body if it is a successful `Retrieve` reply (`None` otherwise: decode it
/// with [`decode`]). The generic [`Response`] goes through serde's buffered form twice (its
/// outcome is flattened, its body internally tagged); this reads the hottest reply, one
/// item per key of a batch, in one pass. It stops at the first byte that differs.
pub fn decode_retrieved(body: &[u8]) -> Option<RetrievedFrame> {
    serde_json::from_slice(body).ok()
}

/// Incoming bytes and descriptors of one connection, split into frames.
#[derive(Debug, Default)]
pub struct FrameReader {
    /// Received bytes are `buf[start..end]`; `buf[end..]` is room already initialized, so
    /// a read does not zero its buffer again.
    buf: Vec<u8>,
    start: usize,
    end: usize,
    fds: VecDeque<OwnedFd>,
}

impl FrameReader {
    /// A new, empty reader.
    pub fn new() -> Self {
        Self::default()
    }

    /// One `recvmsg` from `fd` into the buffer. Returns the bytes read; 0 means end of stream.
    pub fn read_from(&mut self, fd: BorrowedFd<'_>) -> io::Result<usize> {
        self.recv(fd, MsgFlags::empty())
    }

    /// [`read_from`](Self::read_from) without blocking: `WouldBlock` when nothing is there.
    pub fn try_read_from(&mut self, fd: BorrowedFd<'_>) -> io::Result<usize> {
        self.recv(fd, MsgFlags::MSG_DONTWAIT)
    }

    fn recv(&mut self, fd: BorrowedFd<'_>, flags: MsgFlags) -> io::Result<usize> {
        const ROOM: usize = 64 * 1024;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.start > (1 << 20) {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.buf.len() < self.end + ROOM {
            self.buf.resize(self.end + ROOM, 0);
        }
        let old = self.end;
        let mut cmsg = nix::cmsg_space!([RawFd; MAX_FDS_PER_FRAME]);
        let mut iov = [io::IoSliceMut::new(&mut self.buf[old..])];
        let r = recvmsg::<()>(
            fd.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC | flags,
        );
        let msg = r?;
        let n = msg.bytes;
        let truncated = msg.flags.contains(MsgFlags::MSG_CTRUNC);
        for c in msg.cmsgs().map_err(io::Error::from)? {
            if let ControlMessageOwned::ScmRights(fds) = c {
                // SAFETY: SCM_RIGHTS hands this process new descriptors that nothing else owns.
                self.fds.extend(
                    fds.into_iter()
                        .map(|raw| unsafe { OwnedFd::from_raw_fd(raw) }),
                );
            }
        }
        self.end = old + n;
        if truncated {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "descriptors were truncated",
            ));
        }
        Ok(n)
    }

    /// Appends bytes as if received (tests and fuzzing).
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.truncate(self.end);
        self.buf.extend_from_slice(bytes);
        self.end = self.buf.len();
    }

    /// The next complete frame body, if buffered. A length over [`MAX_FRAME`] is an error.
    /// Empty frames are skipped: they are nudges that wake a side sleeping on the socket
    /// ([`crate::lane`]) and carry nothing.
    pub fn next_frame(&mut self) -> Result<Option<Vec<u8>>, Error> {
        loop {
            let avail = &self.buf[self.start..self.end];
            if avail.len() < 4 {
                return Ok(None);
            }
            let len = u32::from_le_bytes(avail[..4].try_into().expect("4 bytes")) as usize;
            if len > MAX_FRAME {
                return Err(Error::Protocol(format!(
                    "frame of {len} bytes exceeds the limit of {MAX_FRAME}"
                )));
            }
            if avail.len() < 4 + len {
                return Ok(None);
            }
            let body = avail[4..4 + len].to_vec();
            self.start += 4 + len;
            if len > 0 {
                return Ok(Some(body));
            }
        }
    }

    /// Takes the next `n` received descriptors.
    pub fn take_fds(&mut self, n: usize) -> Result<Vec<OwnedFd>, Error> {
        if self.fds.len() < n {
            return Err(Error::Protocol(format!(
                "frame announces {n} descriptors, {} arrived",
                self.fds.len()
            )));
        }
        Ok(self.fds.drain(..n).collect())
    }

    /// Descriptors received and not claimed by a frame.
    pub fn stray_fds(&self) -> usize {
        self.fds.len()
    }

    /// Drops every unclaimed descriptor.
    pub fn drop_fds(&mut self) {
        self.fds.clear();
    }
}

/// One `sendmsg` of `bytes` with `fds` attached. Returns the bytes written
/// (the descriptors go with the first byte; resend the rest without them).
pub fn send_some(fd: BorrowedFd<'_>, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
    assert!(fds.len() <= MAX_FDS_PER_FRAME);
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let rights = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &rights };
    let iov = [io::IoSlice::new(bytes)];
    Ok(sendmsg::<()>(
        fd.as_raw_fd(),
        &iov,
        cmsgs,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )?)
}

/// Sends a whole frame on a blocking socket.
pub fn send_all(fd: BorrowedFd<'_>, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let mut off = 0;
    let mut first = true;
    while off < bytes.len() {
        let r = if first {
            send_some(fd, &bytes[off..], fds)
        } else {
            send_some(fd, &bytes[off..], &[])
        };
        match r {
            Ok(n) => {
                off += n;
                first = false;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_json_shape() {
        let r = Request {
            id: 3,
            op: Op::Exists {
                ns: "m".into(),
                keys: vec!["a".into()],
            },
        };
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(
            s,
            r#"{"id":3,"op":"exists","args":{"ns":"m","keys":["a"]}}"#
        );
        let back: Request = serde_json::from_str(&s).unwrap();
        assert_eq!(back, r);
        let stats: Request = serde_json::from_str(r#"{"id":1,"op":"stats"}"#).unwrap();
        assert_eq!(stats.op, Op::Stats);
    }

    #[test]
    fn response_json_shape() {
        let r = Response {
            id: 9,
            fds: 0,
            result: Outcome::Ok(Body::Published { generation: 5 }),
        };
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(
            s,
            r#"{"id":9,"fds":0,"ok":{"type":"published","generation":5}}"#
        );
        assert_eq!(serde_json::from_str::<Response>(&s).unwrap(), r);
    }

    #[test]
    fn retrieved_replies_decode_in_one_pass_and_nothing_else_does() {
        let item = Located {
            key: "k/é".into(),
            generation: 7,
            pool: 1,
            offset: 4096,
            size: 12,
            pinned: true,
            holds: 2,
            fd: true,
        };
        let items = vec![Some(item), None];
        let r = Response {
            id: 4,
            fds: 1,
            result: Outcome::Ok(Body::Retrieved {
                items: items.clone(),
            }),
        };
        let frame = encode(&r);
        let fast = decode_retrieved(&frame[4..]).expect("a retrieved reply");
        assert_eq!((fast.id, fast.fds), (4, 1));
        assert_eq!(fast.into_items(), items);
        for (other, fast) in [
            (Outcome::Ok(Body::Retrieved { items: vec![] }), true),
            (Outcome::Ok(Body::Published { generation: 5 }), false),
            (
                Outcome::Err(WireError {
                    errno: 2,
                    kind: "not_found".into(),
                    message: "x".into(),
                }),
                false,
            ),
        ] {
            let frame = encode(&Response {
                id: 5,
                fds: 0,
                result: other,
            });
            assert_eq!(decode_retrieved(&frame[4..]).is_some(), fast);
        }
    }

    #[test]
    fn frames_roundtrip_with_fds() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        use std::os::fd::AsFd;
        let f = std::fs::File::open("/proc/self/exe").unwrap();
        let frame = encode(&Request {
            id: 1,
            op: Op::Stats,
        });
        send_all(a.as_fd(), &frame, &[f.as_fd()]).unwrap();
        send_all(a.as_fd(), &frame, &[]).unwrap();
        let mut r = FrameReader::new();
        let mut got = Vec::new();
        while got.len() < 2 {
            if let Some(body) = r.next_frame().unwrap() {
                got.push(body);
                continue;
            }
            assert!(r.read_from(b.as_fd()).unwrap() > 0);
        }
        assert_eq!(r.take_fds(1).unwrap().len(), 1);
        assert!(r.take_fds(1).is_err());
        let req: Request = decode(&got[1]).unwrap();
        assert_eq!(req.op, Op::Stats);
    }

    #[test]
    fn oversized_frame_is_refused() {
        let mut r = FrameReader::new();
        r.push(&(MAX_FRAME as u32 + 1).to_le_bytes());
        assert!(r.next_frame().is_err());
    }
}
