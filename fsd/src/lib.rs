//! The `/maru` filesystem.
//!
//! [`fs`] holds the logic (handles, sealing on last writable close, errno
//! choices, cache lifetimes) over a [`Backend`] — the store. [`fuse`] only
//! translates fuser's calls to [`fs`] and replies. Most of the logic is tested
//! without a mount.

pub mod backend;
pub mod fs;
pub mod fuse;
pub mod ring;

pub use backend::{Attr, Backend, Caller, DirEntry, Kind, OpenedFile, Upcall, Xattr};
