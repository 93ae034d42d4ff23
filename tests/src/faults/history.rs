//! The record of a run: every client operation (who, where, what, when, what came of it)
//! and every fault, with times in microseconds since the run began.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Instant;

/// What a client asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Store,
    Retrieve,
    Delete,
    /// The operator's pin (`user.maru.pinned`, `Op::Pin`).
    Pin,
    Unpin,
    /// A connection's hold (the original API's pin counts, `Op::Hold`): another host's
    /// entry's first hold here is recorded for its publisher.
    Hold,
    Unhold,
    List,
}

/// What came of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Acknowledged (a store published, a delete done, a pin set, a list answered).
    Ok,
    /// A retrieve found the entry; its bytes parsed as `version` of this key, whole.
    Read { version: u64, checksum: u64 },
    /// A retrieve found the entry but its bytes are not a whole entry of this key.
    Corrupt(String),
    /// A retrieve, delete or pin found no such entry.
    NotFound,
    /// A store found the name taken.
    Exists,
    /// Any other error (the operation may or may not have taken effect).
    Failed(String),
}

/// One client operation.
#[derive(Debug, Clone)]
pub struct Op {
    /// Client id (`u32::MAX` for the checker's own reads after the run).
    pub client: u32,
    pub host: usize,
    pub kind: Kind,
    pub key: String,
    /// For a store, the version it writes (unique in the run).
    pub version: u64,
    pub start: u64,
    pub end: u64,
    pub outcome: Outcome,
}

/// One fault, from its injection to its healing.
#[derive(Debug, Clone)]
pub struct Fault {
    pub kind: String,
    pub target: String,
    pub start: u64,
    pub end: u64,
    /// A partition: how long after the cut etcd dropped the host's lease (its node record
    /// and its claims with it: the other hosts may claim its regions); None when it did not
    /// before the link returned.
    pub released: Option<u64>,
    /// A partition: when the last read that still found the host's node record began, after
    /// the cut (µs): etcd dropped the lease after that, and before `released`.
    pub alive_at: Option<u64>,
    /// A host cut from etcd's majority: how long after the cut the majority last elected a
    /// leader of its own, if it did (etcd renews every lease then, so the host's lease runs
    /// its TTL again from there).
    pub elected: Option<u64>,
}

/// The history, shared by clients and the nemesis.
pub struct History {
    t0: Instant,
    pub ops: Mutex<Vec<Op>>,
    pub faults: Mutex<Vec<Fault>>,
    /// Each client's operation under way: (host, kind, key, start).
    running: Mutex<BTreeMap<u32, (usize, Kind, String, u64)>>,
}

impl History {
    pub fn new() -> Self {
        History {
            t0: Instant::now(),
            ops: Mutex::new(Vec::new()),
            faults: Mutex::new(Vec::new()),
            running: Mutex::new(BTreeMap::new()),
        }
    }

    /// Microseconds since the run began.
    pub fn now(&self) -> u64 {
        self.t0.elapsed().as_micros() as u64
    }

    /// Client `client` of host `host` begins `kind` on `key` at `start`.
    pub fn begin(&self, client: u32, host: usize, kind: Kind, key: &str, start: u64) {
        let mut r = self.running.lock().expect("history");
        r.insert(client, (host, kind, key.to_owned(), start));
    }

    /// An operation ended (after [`History::begin`], or the checker's own).
    pub fn op(&self, op: Op) {
        self.running.lock().expect("history").remove(&op.client);
        self.ops.lock().expect("history").push(op);
    }

    /// The operations under way now, one line each.
    pub fn running(&self) -> Vec<String> {
        let r = self.running.lock().expect("history");
        r.iter()
            .map(|(c, (host, kind, key, start))| {
                let since = *start as f64 / 1e6;
                format!("client {c} of h{host}: {kind:?} {key} since {since:.2} s")
            })
            .collect()
    }

    pub fn fault(&self, f: Fault) {
        self.faults.lock().expect("history").push(f);
    }
}

impl Default for History {
    fn default() -> Self {
        Self::new()
    }
}

/// FNV-1a, 64 bits: the entries' checksum.
pub fn fnv(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The bytes of `version` of `key`, `len` long (at least the header and checksum): the key's
/// length and bytes, the version, bytes derived from the version, and the checksum of all
/// that in the last 8 bytes.
pub fn entry(key: &str, version: u64, len: usize) -> Vec<u8> {
    let mut b = Vec::with_capacity(len);
    b.extend_from_slice(&(key.len() as u16).to_le_bytes());
    b.extend_from_slice(key.as_bytes());
    b.extend_from_slice(&version.to_le_bytes());
    let body = len.max(b.len() + 8) - 8;
    let mut x = version | 1;
    while b.len() < body {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        b.push(x as u8);
    }
    let sum = fnv(&b);
    b.extend_from_slice(&sum.to_le_bytes());
    b
}

/// Parses bytes read under `key`: its version and checksum, or why they are not a whole entry
/// of `key`.
pub fn parse(key: &str, b: &[u8]) -> Result<(u64, u64), String> {
    if b.len() < 2 + key.len() + 16 {
        return Err(format!("{} bytes: too short", b.len()));
    }
    let n = u16::from_le_bytes([b[0], b[1]]) as usize;
    if n != key.len() || &b[2..2 + n] != key.as_bytes() {
        if n > 64 || 2 + n > b.len() {
            return Err(format!(
                "the bytes carry no name (length field {n}, first bytes {:02x?})",
                &b[..16]
            ));
        }
        let name = String::from_utf8_lossy(&b[2..2 + n]).into_owned();
        return Err(format!("the bytes carry another name: {name:?}"));
    }
    let (body, tail) = b.split_at(b.len() - 8);
    let sum = u64::from_le_bytes(tail.try_into().expect("8 bytes"));
    if fnv(body) != sum {
        return Err("bad checksum".into());
    }
    let version = u64::from_le_bytes(b[2 + n..10 + n].try_into().expect("8 bytes"));
    if entry(key, version, b.len()) != b {
        return Err("bytes differ from the version's".into());
    }
    Ok((version, sum))
}
