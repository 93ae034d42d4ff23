//! marud's config file (`/etc/maru/marud.toml`): its keys and marud's defaults. One
//! definition read by marud (which merges its flags over it) and by `maructl doctor` (which
//! checks a host against it), so that both accept and refuse the same files.

use std::path::PathBuf;

use serde::Deserialize;

/// Where marud's packaged config file lives (`--config` names another).
pub const DEFAULT_CONFIG: &str = "/etc/maru/marud.toml";
/// Default mount point.
pub const DEFAULT_MOUNT: &str = "/maru";
/// Default control socket.
pub const DEFAULT_SOCKET: &str = crate::client::DEFAULT_SOCKET;
/// Default state directory.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/maru";
/// Default pool of the embedded configuration.
pub const DEFAULT_POOL: &str = "memfs:/run/maru/pool0";

/// marud.toml: one key per flag of marud (flags win over it). Unknown keys are refused.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// Pool specs.
    #[serde(default)]
    pub pools: Vec<String>,
    /// Mount point.
    pub mount: Option<PathBuf>,
    /// No mount.
    pub no_mount: Option<bool>,
    /// Socket.
    pub socket: Option<PathBuf>,
    /// Group.
    pub group: Option<String>,
    /// State dir.
    pub state_dir: Option<PathBuf>,
    /// Log filter.
    pub log_level: Option<String>,
    /// Eviction.
    pub eviction: Option<String>,
    /// Unmount pools at exit.
    pub unmount_pools: Option<bool>,
    /// fsync logs.
    pub wal_sync: Option<bool>,
    /// FUSE threads.
    pub fuse_threads: Option<usize>,
    /// FUSE over io_uring: auto, on, off.
    pub fuse_uring: Option<String>,
    /// Niceness.
    pub nice: Option<i32>,
    /// Control socket connections served at once.
    pub max_connections: Option<usize>,
    /// Pid file.
    pub pid_file: Option<PathBuf>,
    /// Metrics address.
    pub metrics: Option<std::net::SocketAddr>,
    /// etcd endpoints, comma-separated (cluster mode).
    pub cluster: Option<String>,
    /// Node name (cluster mode).
    pub node: Option<String>,
    /// Lease TTL in seconds (cluster mode).
    pub cluster_ttl: Option<u64>,
    /// Seconds a host stays gone before the others may evict its entries (cluster mode).
    pub cluster_orphans_after: Option<u64>,
    /// The remote door's address (ADDR:PORT).
    pub remote_bind: Option<std::net::SocketAddr>,
    /// The raw pool remote entries live in.
    pub remote_pool: Option<String>,
    /// Remote workers' token file.
    pub remote_tokens: Option<PathBuf>,
    /// Admit remote workers without a token as "UID:GID".
    pub remote_anonymous: Option<String>,
    /// Seconds a remote reservation lives unpublished.
    pub remote_reserve_ttl: Option<u64>,
    /// Seconds a remote read protection lives unreleased.
    pub remote_read_ttl: Option<u64>,
    /// Seconds pages of a timed-out remote write are kept from use.
    pub remote_quarantine_ttl: Option<u64>,
    /// UCX devices for NIXL.
    pub remote_ucx_devices: Option<String>,
}
