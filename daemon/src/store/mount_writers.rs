//! The store's side of the mount's writers: the entry being written found by inode, a
//! failed writer's abandon, the reservation of a file's pages without the store's lock, and
//! what a size change of one holds.

use maru::{Error, Result};

use super::Store;
use super::ids::PoolIdx;
use super::locked::Locked;
use super::pools::Backing;
use super::state::{Alloc, Invalidation, State};

impl Store {
    /// The entry being written through the mount `ino`.
    pub(super) fn writing(st: &mut State, ino: u64) -> Result<&mut Alloc> {
        let a = st
            .allocs
            .get_mut(&ino)
            .ok_or_else(|| Error::ReadOnly("not an entry being written".into()))?;
        if a.mount().is_none() {
            return Err(Error::ReadOnly("not an entry being written".into()));
        }
        Ok(a)
    }

    /// Gives up on publishing `ino`: its name and reservations go; with `failed`, it is
    /// marked failed (its writer's next close reports it). A writer asking the authority
    /// waits for the answer first, as an unlink does: its asker settles what was granted.
    pub(super) fn abandon(&self, st: &mut Locked<'_>, ino: u64, failed: Option<i32>) {
        self.asked(st, ino);
        let Some(m) = st.allocs.get_mut(&ino).and_then(Alloc::mount_mut) else {
            return;
        };
        if failed.is_some() && m.failed.is_none() {
            m.failed = failed;
        }
        if let Some((ns, key)) = st.writer_left(ino) {
            self.authority.release(&ns, &key, ino);
        }
        self.sealed.notify_all();
    }

    /// Marks `ino` failed with `e` (it will not be published) and returns `e`.
    pub(super) fn fail<T>(&self, ino: u64, e: Error) -> Result<T> {
        let errno = e.errno();
        tracing::info!(
            ino,
            errno,
            "a write through the mount failed: the entry will not be published"
        );
        let mut st = self.lock();
        self.abandon(&mut st, ino, Some(errno));
        Err(e)
    }

    /// The mount drops the passthrough backing of `ino` (an entry being written that will
    /// not be published), so that the pool gets its memory back once no process maps it.
    pub(super) fn forget_backing(&self, ino: u64) {
        self.notify(vec![Invalidation {
            parent: 0,
            name: String::new(),
            ino,
            by_kernel: true,
        }]);
    }

    /// Reserves `[offset, end)` of the file of an entry being written in `pool` (growing the
    /// file to `end` first, so that a tmpfs with `huge=within_size` gives it 2 MiB pages);
    /// with eviction on, a full pool evicts and the reservation is tried again. A refusal
    /// leaves the file's size as it was. Called without the store's lock (the pages'
    /// allocation takes as long as zeroing them), which it takes to evict only.
    pub(super) fn reserve(
        &self,
        pool: PoolIdx,
        f: &std::fs::File,
        offset: u64,
        end: u64,
    ) -> Result<()> {
        let before = f.metadata()?.len();
        if before < end {
            f.set_len(end)?;
        }
        let fallocate = || {
            nix::fcntl::fallocate(
                f,
                nix::fcntl::FallocateFlags::empty(),
                offset as i64,
                (end - offset) as i64,
            )
        };
        let r = match fallocate() {
            Ok(()) => Ok(()),
            Err(nix::errno::Errno::ENOSPC)
                if self.ensure_free(&mut self.lock(), pool, end - offset) =>
            {
                fallocate()
            }
            Err(e) => Err(e),
        };
        r.map_err(|e| {
            if before < end {
                // Back to its size; were this to fail, the file would only span more than
                // its entry (sparse), which publication cuts.
                let _ = f.set_len(before);
            }
            Error::Io(e.into())
        })
    }

    /// The buffer of `ino` (an entry being written through the mount into a raw pool).
    pub(super) fn buffer(&self, ino: u64) -> Result<Option<super::pools::buffer::Shared>> {
        let mut st = self.lock();
        Ok(match &Store::writing(&mut st, ino)?.backing {
            Backing::Buffer { buf, .. } => Some(buf.clone()),
            _ => None,
        })
    }

    /// The guard of `ino`'s size changes (an entry being written through the mount).
    pub(super) fn resizing(&self, ino: u64) -> Result<std::sync::Arc<parking_lot::Mutex<()>>> {
        let mut st = self.lock();
        let m = Store::writing(&mut st, ino)?
            .mount()
            .expect("a mount write");
        Ok(m.resizing.clone())
    }
}
