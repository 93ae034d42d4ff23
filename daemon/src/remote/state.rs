//! What the door's connections share: its settings, its counters and workers (what operators
//! see), and the pool and registration every connection serves.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use maru::proto::{RemoteInfo, RemoteWorker};
use maru_remote::proto::Registration;
use parking_lot::Mutex;

use super::auth;
use crate::store::{RemoteView, Store};

/// The remote door's settings (marud.toml's `remote_*` keys, `--remote-*` flags).
#[derive(Debug, Clone)]
pub struct RemoteSettings {
    /// Where workers connect.
    pub bind: SocketAddr,
    /// The raw pool remote entries live in (default: the first raw pool).
    pub pool: Option<String>,
    /// The token file (see [`auth`]).
    pub tokens: Option<PathBuf>,
    /// Admit workers without a token as this uid:gid.
    pub anonymous: Option<(u32, u32)>,
    /// How long a reservation lives unpublished.
    pub reserve_ttl: Duration,
    /// How long a read protection lives unreleased.
    pub read_ttl: Duration,
    /// How long pages quarantined after a timed-out transfer are kept from use.
    pub quarantine_ttl: Duration,
    /// RDMA devices for NIXL's UCX backend (its `device_list` parameter), e.g. `mlx5_0`.
    pub ucx_devices: Option<String>,
}

impl RemoteSettings {
    /// Defaults for a door at `bind`: the original's TTLs (60 s for reservations, 120 s for
    /// read protections), 300 s of quarantine.
    pub fn new(bind: SocketAddr) -> Self {
        RemoteSettings {
            bind,
            pool: None,
            tokens: None,
            anonymous: None,
            reserve_ttl: Duration::from_secs(60),
            read_ttl: Duration::from_secs(120),
            quarantine_ttl: Duration::from_secs(300),
            ucx_devices: None,
        }
    }
}

/// The door and its counters, and the connected workers, for `maructl status`, marutop and the
/// metrics (the store reports them in its statistics: [`Store::set_remote`]).
#[derive(Debug)]
pub struct RemoteStats {
    /// Where workers connect.
    pub addr: SocketAddr,
    /// This run's generation.
    pub generation: u64,
    /// The pool remote entries live in: its name and UUID.
    pub pool: String,
    pub pool_uuid: String,
    pub connections: AtomicU64,
    pub refused: AtomicU64,
    pub requests: AtomicU64,
    pub errors: AtomicU64,
    pub pages_reserved: AtomicU64,
    pub bytes_reserved: AtomicU64,
    pub published: AtomicU64,
    pub lookups: AtomicU64,
    pub bytes_protected: AtomicU64,
    pub expired: AtomicU64,
    pub quarantined: AtomicU64,
    /// The workers connected now.
    pub workers: Mutex<Vec<WorkerInfo>>,
}

impl RemoteStats {
    /// The counters of a door that opened at `addr`, all at zero.
    pub fn new(addr: SocketAddr, generation: u64, pool: String, pool_uuid: String) -> Self {
        RemoteStats {
            addr,
            generation,
            pool,
            pool_uuid,
            connections: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            pages_reserved: AtomicU64::new(0),
            bytes_reserved: AtomicU64::new(0),
            published: AtomicU64::new(0),
            lookups: AtomicU64::new(0),
            bytes_protected: AtomicU64::new(0),
            expired: AtomicU64::new(0),
            quarantined: AtomicU64::new(0),
            workers: Mutex::new(Vec::new()),
        }
    }
}

impl RemoteView for RemoteStats {
    fn info(&self) -> RemoteInfo {
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let workers = self
            .workers
            .lock()
            .iter()
            .map(|w| RemoteWorker {
                id: w.id,
                node: w.node.clone(),
                identity: w.identity.clone(),
                uid: w.uid,
                gid: w.gid,
                peer: w.peer.to_string(),
                reserved: w.reserved,
                protected: w.protected,
                requests: w.requests,
                errors: w.errors,
            })
            .collect();
        RemoteInfo {
            addr: self.addr.to_string(),
            generation: format!("{:016x}", self.generation),
            pool: self.pool.clone(),
            pool_uuid: self.pool_uuid.clone(),
            connections: n(&self.connections),
            refused: n(&self.refused),
            requests: n(&self.requests),
            errors: n(&self.errors),
            pages_reserved: n(&self.pages_reserved),
            bytes_reserved: n(&self.bytes_reserved),
            published: n(&self.published),
            lookups: n(&self.lookups),
            bytes_protected: n(&self.bytes_protected),
            expired: n(&self.expired),
            quarantined: n(&self.quarantined),
            workers,
        }
    }
}

/// One connected worker.
#[derive(Debug, Clone)]
pub struct WorkerInfo {
    pub id: u64,
    pub node: String,
    pub peer: SocketAddr,
    pub identity: String,
    pub uid: u32,
    pub gid: u32,
    /// Bytes reserved and not yet published or given back.
    pub reserved: u64,
    /// Bytes of the entries it protects for reading.
    pub protected: u64,
    pub requests: u64,
    pub errors: u64,
}

/// What every connection shares.
pub(crate) struct Shared {
    pub(super) store: Arc<Store>,
    pub(super) settings: RemoteSettings,
    pub(super) tokens: auth::Tokens,
    pub(super) generation: u64,
    /// The pool remote entries live in, and where marud mapped it.
    pub(super) pool: u32,
    pub(super) pool_name: String,
    pub(super) pool_uuid: String,
    pub(super) base: u64,
    pub(super) len: u64,
    pub(super) registration: Registration,
    pub(super) stats: Arc<RemoteStats>,
    pub(super) next_conn: AtomicU64,
}
