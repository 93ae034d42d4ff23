//! maru's remote tier: hosts without CXL (GPU nodes) store and load KV entries in a memory
//! node's pool. The memory node's marud registers its pool memory with NIXL and answers
//! control requests ([`proto`]); the worker ([`client`]) moves the bytes itself with
//! one-sided NIXL WRITE and READ between its registered memory and the pool's. See
//! doc/REMOTE.md.

pub mod client;
pub mod proto;

pub use client::{
    ARENA_ALIGN, Arena, ArenaStats, Error as RemoteError, Lease, Purpose, RemoteClient,
    RemoteConfig, Stats, Stored, chain as error_chain,
};
