//! marud: the maru daemon as a library (so tests and benchmarks can embed it).

pub mod alloc;
pub mod nsindex;
pub mod pool;
pub mod store;
pub mod wal;
pub mod config;
pub mod mount;
pub mod server;
