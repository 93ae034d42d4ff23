//! marud: the maru daemon as a library (so tests and benchmarks can embed it).

mod acl;
mod alloc;
pub mod cluster;
mod coherence;
pub mod config;
pub mod metrics;
pub mod mount;
mod nsindex;
pub mod pool;
pub mod remote;
pub mod server;
pub mod store;
pub mod wal;
