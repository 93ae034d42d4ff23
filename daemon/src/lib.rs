//! marud: the maru daemon as a library (so tests and benchmarks can embed it).

pub mod acl;
pub mod alloc;
pub mod cluster;
pub mod coherence;
pub mod config;
pub mod metrics;
pub mod mount;
pub mod nsindex;
pub mod pool;
pub mod remote;
pub mod server;
pub mod store;
pub mod wal;
