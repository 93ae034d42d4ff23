//! The transitions of a writer's life (see the parent module), as methods of the store's
//! state: the only code that changes a writer's bookkeeping.

use maru::Result;

use super::super::state::{Alloc, State};
use super::MountWrite;

impl State {
    fn writer(&mut self, id: u64) -> Option<&mut MountWrite> {
        self.allocs.get_mut(&id).and_then(Alloc::mount_mut)
    }

    /// Writer `id` (its allocation filed) is opened as `ns/name`.
    pub(in crate::store) fn writer_opened(&mut self, id: u64) -> Result<()> {
        let (ns, name) = self
            .writer(id)
            .and_then(|m| m.target.clone())
            .expect("a new writer has its target");
        self.ns.get_mut(&ns)?.writing.insert(name, id);
        Ok(())
    }

    /// Writer `id` passed its publication's checks with `len` bytes: `len` bytes of its
    /// namespace's quota are reserved (in place of what was before) and, the first time, its
    /// publication is counted as pending.
    pub(in crate::store) fn writer_committed(&mut self, id: u64, len: u64) -> Result<()> {
        let m = self.writer(id).expect("a mount write");
        let (ns, _) = m.target.clone().expect("a committed writer has its target");
        let (was, before) = (m.committed, m.reserved);
        m.committed = true;
        m.reserved = len;
        let n = self.ns.get_mut(&ns)?;
        n.reserved = n.reserved + len - before;
        if !was {
            n.adjust_pending(1);
        }
        Ok(())
    }

    /// Writer `id` leaves its target (unlinked, abandoned, failed or dropped): its name is
    /// no longer being written, its reservation and its pending publication go. Returns the
    /// target it had, whose name the caller gives back at the authority.
    pub(in crate::store) fn writer_left(&mut self, id: u64) -> Option<(String, String)> {
        let m = self.writer(id)?;
        let (target, committed, reserved) = (m.target.take(), m.committed, m.reserved);
        m.committed = false;
        m.reserved = 0;
        let (ns, key) = target?;
        if let Ok(n) = self.ns.get_mut(&ns) {
            if n.writing.get(&key) == Some(&id) {
                n.writing.remove(&key);
            }
            if committed {
                n.adjust_pending(-1);
                n.reserved -= reserved;
            }
        }
        Some((ns, key))
    }

    /// Writer `id` moves to `ns/name` (a rename; the authority granted the new name). A
    /// committed writer's reservation and pending publication move with it.
    pub(in crate::store) fn writer_moved(&mut self, id: u64, ns: &str, name: &str) -> Result<()> {
        let m = self.writer(id).expect("a mount write");
        let (from, key) = m
            .target
            .clone()
            .expect("a writer being renamed has its target");
        let (committed, reserved) = (m.committed, m.reserved);
        self.ns.get(ns)?;
        let src = self.ns.get_mut(&from)?;
        src.writing.remove(&key);
        if committed {
            src.reserved -= reserved;
            src.adjust_pending(-1);
        }
        let dst = self.ns.get_mut(ns)?;
        dst.writing.insert(name.to_owned(), id);
        if committed {
            dst.reserved += reserved;
            dst.adjust_pending(1);
        }
        if let Some(m) = self.writer(id) {
            m.target = Some((ns.to_owned(), name.to_owned()));
        }
        Ok(())
    }

    /// Writer `id`'s publication goes to the authority (`true`) or came back (`false`).
    pub(in crate::store) fn writer_asking(&mut self, id: u64, asking: bool) {
        if let Some(m) = self.writer(id) {
            m.asking = asking;
        }
    }

    /// Writer `id`'s bytes are being copied into their extent (`true`), or the copy is over.
    pub(in crate::store) fn writer_copying(&mut self, id: u64, copying: bool) {
        if let Some(m) = self.writer(id) {
            m.copying = copying;
        }
    }

    /// Whether writer `id` is still to be published as `ns/key` (not unlinked, renamed or
    /// failed meanwhile).
    pub(in crate::store) fn writer_still(&mut self, id: u64, ns: &str, key: &str) -> bool {
        self.writer(id).is_some_and(|m| {
            m.failed.is_none() && m.target.as_ref().is_some_and(|(n, k)| n == ns && k == key)
        })
    }

    /// Writer `id` is being sealed as `ns/key` (its allocation still filed): its name is no
    /// longer being written and its reservation goes; true when its publication was
    /// counted as pending, which [`State::writer_sealed`] then takes back once the entry is
    /// in the index. False for an allocation that is not a writer.
    pub(in crate::store) fn writer_sealing(
        &mut self,
        id: u64,
        ns: &str,
        key: &str,
    ) -> Result<bool> {
        let Some(m) = self.writer(id) else {
            return Ok(false);
        };
        let (committed, reserved) = (m.committed, m.reserved);
        let n = self.ns.get_mut(ns)?;
        n.writing.remove(key);
        if committed {
            n.reserved -= reserved;
        }
        Ok(committed)
    }

    /// The entry of a committed writer sealed in `ns` is in the index: its publication is
    /// no longer pending. (Only now may lock-free readers stop asking: they read the
    /// pending count before they look, see libmaru's `Inner::lookup`.)
    pub(in crate::store) fn writer_sealed(&mut self, ns: &str) -> Result<()> {
        self.ns.get_mut(ns)?.adjust_pending(-1);
        Ok(())
    }
}
