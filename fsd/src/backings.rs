//! Passthrough backing ids: one per inode, registered with the kernel the way the transport
//! that opened it registers them, shared by the inode's handles, and kept (idle) after the
//! last close of a sealed entry so that reopening it costs no new registration.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

use fuser::{BackingId, Errno};
use parking_lot::{MappedMutexGuard, Mutex, MutexGuard};

/// Most idle backing ids kept for fast reopening of sealed entries.
const IDLE_BACKINGS: usize = 1024;

/// A passthrough backing id registered with the kernel: through fuser's channel (requests
/// served by fuser) or through our own descriptor of the connection (requests served over
/// io_uring). Dropping it unregisters it.
pub(crate) enum Backing {
    /// Registered by fuser.
    Fuser(BackingId),
    /// Registered with `FUSE_DEV_IOC_BACKING_OPEN` on `dev`.
    Raw { id: u32, dev: Arc<OwnedFd> },
}

impl Backing {
    fn as_ref(&self) -> BackingRef {
        match self {
            Backing::Fuser(_) => BackingRef::Fuser,
            Backing::Raw { id, .. } => BackingRef::Raw(*id),
        }
    }

    fn is_raw(&self) -> bool {
        matches!(self, Backing::Raw { .. })
    }
}

impl Drop for Backing {
    fn drop(&mut self) {
        if let Backing::Raw { id, dev } = self {
            // SAFETY: FUSE_DEV_IOC_BACKING_CLOSE reads one u32, which lives for the call.
            if let Err(e) = unsafe { backing_close(dev.as_raw_fd(), id) } {
                tracing::debug!("closing backing id {id}: {e}");
            }
        }
    }
}

// `FUSE_DEV_IOC_BACKING_CLOSE`: `_IOW(229, 2, uint32_t)` (include/uapi/linux/fuse.h).
nix::ioctl_write_ptr!(backing_close, 229, 2, u32);

/// The backing id an open reply names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackingRef {
    /// Registered over our own descriptor of the connection: its id.
    Raw(u32),
    /// Registered through fuser: its [`BackingId`] is in [`Backings`]
    /// (`Backings::fuser_id`).
    Fuser,
}

/// How the transport of a request registers passthrough backing files with the kernel (the
/// same way it may reuse an inode's registered backing id).
pub enum Registrar<'r> {
    /// The request opens nothing (fuser's callbacks other than open and create).
    None,
    /// Through fuser's reply to the request (`ReplyOpen::open_backing`).
    Fuser(&'r dyn Fn(&File) -> std::io::Result<BackingId>),
    /// `FUSE_DEV_IOC_BACKING_OPEN` on this descriptor of the connection (the io_uring queues).
    Raw(&'r Arc<OwnedFd>),
}

impl Registrar<'_> {
    /// Whether the backings this registrar makes are [`Backing::Raw`]; None if it makes none.
    pub(crate) fn raw(&self) -> Option<bool> {
        match self {
            Registrar::None => None,
            Registrar::Fuser(_) => Some(false),
            Registrar::Raw(_) => Some(true),
        }
    }

    fn register(&self, file: &File) -> std::io::Result<Backing> {
        match self {
            Registrar::None => Err(std::io::Error::other(
                "no way to register a backing file for this request",
            )),
            Registrar::Fuser(open) => open(file).map(Backing::Fuser),
            Registrar::Raw(dev) => {
                BackingId::create_raw(dev.as_ref(), file).map(|id| Backing::Raw {
                    id,
                    dev: Arc::clone(dev),
                })
            }
        }
    }
}

/// An inode's registered backing.
struct Registered {
    backing: Backing,
    /// Open handles using it.
    open: u32,
    /// Reusable after the last close (a sealed entry).
    keep: bool,
    /// The backing file, so that reopening a sealed entry opens nothing in the pool.
    file: Arc<File>,
}

/// Passthrough backing ids by inode (one per inode, shared by its handles).
#[derive(Default)]
pub struct Backings {
    map: Mutex<HashMap<u64, Registered>>,
    /// Forgets so far ([`Backings::epoch`]), counted under `map`'s lock.
    forgets: std::sync::atomic::AtomicU64,
}

impl Backings {
    /// Forgets an inode's idle backing id (its entry was deleted, evicted or renamed), so the
    /// kernel drops its reference to the backing file.
    pub fn forget(&self, ino: u64) {
        let mut m = self.map.lock();
        self.forgets
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if m.get(&ino).is_some_and(|r| r.open == 0) {
            m.remove(&ino);
        } else if let Some(r) = m.get_mut(&ino) {
            r.keep = false;
        }
    }

    /// Where the forgets stand: taken before the store opens an entry and given to
    /// [`Backings::attach`], which keeps nothing of a backing registered after a forget that
    /// may have been its entry's (deleted between the open and the registration).
    pub fn epoch(&self) -> u64 {
        self.forgets.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// One more use of the kept backing of `ino` (a sealed entry opened before, see
    /// [`Backings::put`]) when it was registered the way `raw` says: its file and backing id.
    pub(crate) fn reuse_kept(&self, ino: u64, raw: bool) -> Option<(Arc<File>, BackingRef)> {
        let mut m = self.map.lock();
        let r = m
            .get_mut(&ino)
            .filter(|r| r.keep && r.backing.is_raw() == raw)?;
        r.open += 1;
        Some((r.file.clone(), r.backing.as_ref()))
    }

    /// Takes (or registers with `reg`) the backing id of `ino` for one more handle; `keep`
    /// marks it reusable after its last close (a sealed entry opened read-only, at
    /// [`Backings::epoch`] `since`: not kept if a forget came since). An idle id registered by
    /// the other transport is replaced; one in use cannot be shared (EIO).
    pub(crate) fn attach(
        &self,
        ino: u64,
        file: &Arc<File>,
        reg: &Registrar<'_>,
        keep: bool,
        since: u64,
    ) -> Result<BackingRef, Errno> {
        let raw = reg.raw().ok_or(Errno::EIO)?;
        let mut m = self.map.lock();
        let keep = keep && self.epoch() == since;
        match m.get_mut(&ino) {
            Some(r) if r.backing.is_raw() == raw => {
                r.open += 1;
                r.keep |= keep;
                return Ok(r.backing.as_ref());
            }
            Some(r) if r.open > 0 => {
                tracing::warn!(ino, "backing id in use by the other FUSE transport");
                return Err(Errno::EIO);
            }
            _ => {}
        }
        let backing = reg.register(file)?;
        let b = backing.as_ref();
        m.insert(
            ino,
            Registered {
                backing,
                open: 1,
                keep,
                file: file.clone(),
            },
        );
        Ok(b)
    }

    /// A handle is gone. Backing ids of sealed entries stay registered (idle) so that the
    /// next open of the same entry skips re-registering; entries being written drop theirs.
    pub(crate) fn put(&self, ino: u64, keep: bool) {
        let mut m = self.map.lock();
        if let Some(r) = m.get_mut(&ino) {
            r.open -= 1;
            if r.open == 0 {
                if keep && r.keep {
                    if m.len() > IDLE_BACKINGS {
                        m.retain(|_, r| r.open > 0);
                    }
                } else {
                    m.remove(&ino);
                }
            }
        }
    }

    /// The fuser-registered backing id of `ino`.
    pub(crate) fn fuser_id(&self, ino: u64) -> Option<MappedMutexGuard<'_, BackingId>> {
        MutexGuard::try_map(self.map.lock(), |m| match m.get_mut(&ino) {
            Some(Registered {
                backing: Backing::Fuser(id),
                ..
            }) => Some(id),
            _ => None,
        })
        .ok()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn backing_close_is_the_kernels_request() {
        // FUSE_DEV_IOC_BACKING_CLOSE as the kernel's headers define it.
        assert_eq!(
            nix::request_code_write!(229, 2, std::mem::size_of::<u32>()),
            0x4004_e502
        );
    }
}
