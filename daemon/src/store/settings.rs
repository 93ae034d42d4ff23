//! The store's settings.

use std::path::PathBuf;

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
