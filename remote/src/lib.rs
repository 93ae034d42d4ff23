//! maru's remote tier: hosts without CXL (GPU nodes) store and load KV entries in a memory
//! node's pool. The memory node's marud registers its pool memory with NIXL and answers
//! control requests ([`proto`]); the worker ([`client`]) moves the bytes itself with
//! one-sided NIXL WRITE and READ between its registered memory and the pool's. See
//! doc/REMOTE.md.

pub mod client;
pub mod memory;
pub mod proto;
pub mod report;

pub use client::{Error as RemoteError, RemoteClient, RemoteConfig, Stats, Stored};
pub use memory::{ARENA_ALIGN, Arena, ArenaStats, Lease, Purpose};
pub use report::chain as error_chain;
