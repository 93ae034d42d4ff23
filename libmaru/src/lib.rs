//! # maru
//!
//! Client library of maru, a KV-cache store for LLM inference on shared
//! memory (CXL memory pools, or DRAM). Entries are write-once byte objects
//! named `namespace/key`; [`Handler`] stores them in the pool and retrieves
//! them as read-only mappings of the pool's own pages.
//!
//! ```no_run
//! let h = maru::Handler::connect_default()?;
//! let mut a = h.alloc(4096)?;
//! a.as_mut_slice().fill(7);
//! h.store("llama/chunk-0", a)?;
//! let m = h.retrieve("llama/chunk-0")?.expect("stored");
//! assert_eq!(m[0], 7);
//! # Ok::<(), maru::Error>(())
//! ```

pub mod client;
pub mod daemon_config;
pub mod error;
pub mod format;
pub mod fuse_record;
pub mod host;
pub mod index;
pub mod key;
pub mod lane;
pub mod mapping;
pub mod name;
pub mod proto;
pub mod size;

pub use client::{AfterPublish, AllocHandle, Config, DEFAULT_SOCKET, EntryInfo, Handler};
pub use error::{Error, Result};
pub use mapping::Mapping;
pub use name::EntryPath;
