//! A recording [`Backend`] for the unit tests: every entry is inode 7, being written, and
//! served as the test says.

use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
use std::time::SystemTime;

use maru::{Error, Result};
use parking_lot::Mutex;

use crate::backend::{Attr, Backend, Caller, DirEntry, Kind, OpenedFile, Upcall, Xattr};

/// A call the store saw (those the tests look at).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    Create { mode: u32 },
    Commit { ino: u64, abandoned: bool },
    Fallocate { ino: u64, offset: u64, len: u64 },
    Abort { ino: u64 },
}

/// The recording backend.
pub struct Rec {
    opened: OpenedFile,
    seals: AtomicU32,
    /// Errno of the next commits (0: they succeed).
    commit_errno: AtomicI32,
    /// Writes report one byte fewer than given.
    short: AtomicU32,
    calls: Mutex<Vec<Call>>,
    upcalls: Mutex<Vec<Upcall>>,
}

impl Default for Rec {
    fn default() -> Self {
        Rec::serving(OpenedFile::Copy)
    }
}

impl Rec {
    /// Opens and creates serve entries as `opened`.
    pub fn serving(opened: OpenedFile) -> Self {
        Rec {
            opened,
            seals: AtomicU32::new(0),
            commit_errno: AtomicI32::new(0),
            short: AtomicU32::new(0),
            calls: Mutex::new(Vec::new()),
            upcalls: Mutex::new(Vec::new()),
        }
    }

    pub fn seals(&self) -> u32 {
        self.seals.load(Ordering::SeqCst)
    }

    pub fn fail_commits(&self, errno: i32) {
        self.commit_errno.store(errno, Ordering::SeqCst);
    }

    pub fn short_writes(&self) {
        self.short.store(1, Ordering::SeqCst);
    }

    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().clone()
    }

    pub fn upcalls(&self) -> Vec<Upcall> {
        self.upcalls.lock().clone()
    }

    /// The mode of the last create.
    pub fn created_mode(&self) -> Option<u32> {
        self.calls.lock().iter().rev().find_map(|c| match c {
            Call::Create { mode } => Some(*mode),
            _ => None,
        })
    }
}

pub fn attr(ino: u64, sealed: bool) -> Attr {
    Attr {
        ino,
        kind: if ino == 1 { Kind::Dir } else { Kind::File },
        size: 0,
        mode: 0o644,
        uid: 0,
        gid: 0,
        mtime: SystemTime::UNIX_EPOCH,
        sealed,
    }
}

impl Backend for Rec {
    fn lookup(&self, _: &Caller, _: u64, _: &str) -> Result<Attr> {
        Err(Error::NotFound("x".into()))
    }
    fn getattr(&self, ino: u64) -> Result<Attr> {
        Ok(attr(ino, false))
    }
    fn readdir(&self, _: &Caller, _: u64) -> Result<Vec<DirEntry>> {
        Ok(vec![])
    }
    fn mkdir(&self, _: &Caller, _: u64, _: &str, _: u32) -> Result<Attr> {
        unreachable!()
    }
    fn rmdir(&self, _: &Caller, _: u64, _: &str) -> Result<()> {
        unreachable!()
    }
    fn create(&self, _: &Caller, _: u64, _: &str, mode: u32) -> Result<(Attr, OpenedFile)> {
        self.calls.lock().push(Call::Create { mode });
        Ok((attr(7, false), self.opened.clone()))
    }
    fn open(&self, _: &Caller, _: u64, _: bool) -> Result<OpenedFile> {
        Ok(self.opened.clone())
    }
    fn commit(&self, _: &Caller, ino: u64, abandoned: bool) -> Result<()> {
        self.calls.lock().push(Call::Commit { ino, abandoned });
        match self.commit_errno.load(Ordering::SeqCst) {
            0 => Ok(()),
            e => Err(Error::from_errno(e)),
        }
    }
    fn fallocate(&self, ino: u64, offset: u64, len: u64) -> Result<()> {
        self.calls.lock().push(Call::Fallocate { ino, offset, len });
        Ok(())
    }
    fn seal(&self, _: u64) -> Result<()> {
        self.seals.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn abort(&self, ino: u64) {
        self.calls.lock().push(Call::Abort { ino });
    }
    fn truncate(&self, ino: u64, _: u64) -> Result<Attr> {
        Ok(attr(ino, false))
    }
    fn chmod_chown(
        &self,
        _: &Caller,
        ino: u64,
        _: Option<u32>,
        _: Option<u32>,
        _: Option<u32>,
    ) -> Result<Attr> {
        Ok(attr(ino, false))
    }
    fn read(&self, _: u64, _: u64, _: u32) -> Result<Vec<u8>> {
        Ok(vec![])
    }
    fn write(&self, _: u64, _: u64, d: &[u8]) -> Result<u32> {
        Ok(d.len() as u32 - self.short.load(Ordering::SeqCst))
    }
    fn unlink(&self, _: &Caller, _: u64, _: &str) -> Result<()> {
        Ok(())
    }
    fn rename(&self, _: &Caller, _: u64, _: &str, _: u64, _: &str) -> Result<()> {
        Ok(())
    }
    fn statfs(&self) -> (u64, u64, u64) {
        (0, 0, 0)
    }
    fn xattrs(&self, _: u64) -> Result<Vec<Xattr>> {
        Ok(vec![Xattr {
            name: "state",
            value: "writing".into(),
        }])
    }
    fn set_pinned(&self, _: &Caller, _: u64, _: bool) -> Result<()> {
        Ok(())
    }
    fn count_upcall(&self, op: Upcall) {
        self.upcalls.lock().push(op);
    }
}
