//! The `/maru` filesystem.
//!
//! [`fs`] holds the logic (handles, publication at the last writable release, errno choices,
//! cache lifetimes) over a [`Backend`] — the store. [`server`] is the FUSE server whichever
//! way requests travel: one request type, one dispatch, one reply type, and the passthrough
//! [`backings`] both transports share. [`fuse`] (fuser, over `/dev/fuse`) and [`ring`] (FUSE
//! over io_uring) only translate requests and replies; the ring reads and writes the kernel's
//! structures ([`abi`]) with [`codec`]. Most of the logic is tested without a mount.
//!
//! Modules depend on each other one way only (`a ← b`: b uses a): `backend` ← `fs` ←
//! `server` ← `fuse`; `backings` ← `server`; `abi`, `server` ← `codec` ← `ring`.

pub mod abi;
pub mod backend;
pub mod backings;
pub mod codec;
pub mod fs;
pub mod fuse;
pub mod ring;
pub mod server;
#[cfg(test)]
mod testing;

pub use backend::{Attr, Backend, Caller, DirEntry, Kind, OpenedFile, Upcall, Xattr};
