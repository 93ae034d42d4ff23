//! Publication: an allocation sealed under a name, write-once.
//!
//! A client's publications take three steps. Under the store's lock, each is checked, its
//! name reserved here (so that no other writer of this host takes it meanwhile) and its bytes
//! given their place. Then the authority is asked: on a single host that is a map in memory,
//! asked under the lock as before; in cluster mode it is an etcd transaction, asked with the
//! lock released, and publications waiting at the same moment (a client's batch, other
//! clients', the mount's) go to etcd together (`crate::cluster::group`). Under the lock again,
//! each publication the authority granted is sealed, and each it refused is undone. The grant
//! is the commit point: the quota is checked before it (each publication's bytes count for
//! those placed after it until the authority has answered), not after. One that the shared
//! authority granted and the store cannot seal all the same (its namespace or name changed
//! while the lock was let go of, or its pool could not record it) is given back as a delete
//! removes an entry, since other hosts may serve it from the grant on: its removal recorded
//! with the lock let go of, its extent freed once no host maps it (`Store::give_back`). In
//! between, nothing of a publication is visible: its name is neither an entry nor free. On a
//! pool without hardware coherence across hosts, the writer's lines are written back just
//! before the authority is asked (without the lock when it is etcd): once another host can
//! learn of the entry, its bytes are on the device.
//!
//! The mount's publications take two rounds with the authority, both here: at a writer's
//! close its name is reserved for every host (`Store::try_commit`), at its release the entry
//! is published (`Store::seal`). In cluster mode, for a shared pool, each lets go of the lock
//! while etcd answers, with the writer marked as asking (an unlink, a rename or an abandon of
//! it waits for the answer), and what may have changed meanwhile is checked again after.

use std::collections::HashSet;
use std::sync::Arc;

use super::locked::Locked;
use maru::name::{check_component, split_ns};
use maru::{Error, Result};

use super::authority::{Placed, Publishing};
use super::entries::Entry;
use super::ids::{Place, SessionId};
use super::placement::Refused;
use super::policy::{self, Access, Perm};
use super::pools::Backing;
use super::state::{Alloc, Invalidation, State};
use super::stats::Bytes;
use super::{ENTRY_ALIGN, Store, align_up};
use crate::coherence::WriteBack;

/// One publication of [`Store::publish_many`]: allocation `id` as `ns/key`, of `len` bytes
/// (the whole allocation when None).
#[derive(Debug, Clone, Copy)]
pub struct Publish<'a> {
    pub id: u64,
    pub ns: &'a str,
    pub key: &'a str,
    pub len: Option<u64>,
}

/// A publication between its steps: checked, its name reserved here, its bytes placed.
struct Placing {
    size: u64,
    /// The raw pool's UUID (None for a memfs pool) and the entry's place in it (an extent of
    /// a raw pool; nowhere yet for a memfs pool, which places it when it publishes).
    pool: Option<String>,
    place: Place,
    /// A pool without hardware coherence across hosts: the writer's lines to write back
    /// before the publication is asked for.
    write_back: Option<Arc<WriteBack>>,
}

impl Placing {
    /// Writes the entry's lines back to the device, where the pool needs it: before any
    /// other host can learn of the entry.
    fn write_back(&self) {
        if let (Some(w), Some(offset)) = (&self.write_back, self.place.extent()) {
            w.flush(offset, self.size);
        }
    }

    /// Where the entry's bytes are, as the authority is told.
    fn placed(&self) -> Placed<'_> {
        Placed {
            pool: self.pool.as_deref(),
            place: self.place,
            size: self.size,
        }
    }
}

impl Store {
    /// Seals allocation `id` of `session` as `ns/key`: the first publication of a name wins.
    pub fn publish(
        &self,
        session: SessionId,
        id: u64,
        ns: &str,
        key: &str,
        len: Option<u64>,
    ) -> Result<u64> {
        let p = Publish { id, ns, key, len };
        self.publish_many(session, &[p])
            .pop()
            .expect("one outcome per publication")
    }

    /// Seals allocations of `session`, each under its name, with one outcome each (the
    /// allocation's id, or why it was refused: a refused allocation is freed). The
    /// authority is asked for all of them at once (see the module's documentation).
    pub fn publish_many(&self, session: SessionId, items: &[Publish<'_>]) -> Vec<Result<u64>> {
        let mut st = self.lock();
        // An allocation is published once: a second publication of it in the batch is refused
        // before anything is asked (granted, its seal would find the allocation gone).
        let mut seen = HashSet::new();
        let twice: Vec<bool> = items.iter().map(|p| !seen.insert(p.id)).collect();
        let mut placed: Vec<Result<Placing>> = Vec::with_capacity(items.len());
        for (p, &twice) in items.iter().zip(&twice) {
            let r = if twice {
                Err(Error::InvalidArgument(format!(
                    "allocation {} is published twice in one batch",
                    p.id
                )))
            } else {
                self.place_publication(&mut st, session, p)
            };
            // Its bytes count against its namespace's quota (and keep the namespace) until the
            // authority has answered: what is placed after it, in this batch or by other
            // clients while the lock is let go of, counts them. Once granted, nothing checks
            // the quota again.
            if let (Ok(r), Ok(n)) = (&r, st.ns.get_mut(p.ns)) {
                n.asking += r.size;
            }
            placed.push(r);
        }
        let asks: Vec<Publishing<'_>> = items
            .iter()
            .zip(&placed)
            .filter_map(|(p, r)| {
                let r = r.as_ref().ok()?;
                Some(Publishing {
                    ns: p.ns,
                    key: p.key,
                    id: p.id,
                    at: r.placed(),
                })
            })
            .collect();
        // Only a round trip (and the write-back before it) is worth letting the lock go for.
        let unlocked = self.authority.shared() && asks.iter().any(|a| a.at.pool.is_some());
        let ask = || {
            placed.iter().flatten().for_each(Placing::write_back);
            let verdicts = self.authority.publish_many(&asks);
            for (a, _) in asks.iter().zip(&verdicts).filter(|(_, v)| v.is_ok()) {
                self.ask_gate("published", a.ns, a.key);
            }
            verdicts
        };
        let verdicts = if unlocked { st.unlocked(ask) } else { ask() };
        for (p, r) in items.iter().zip(&placed) {
            if let (Ok(r), Ok(n)) = (r, st.ns.get_mut(p.ns)) {
                n.asking -= r.size;
            }
        }
        let mut verdicts = verdicts.into_iter();
        for (p, r) in items.iter().zip(&mut placed).filter(|(_, r)| r.is_ok()) {
            if let Err(e) = verdicts.next().expect("one verdict per publication") {
                self.authority.release(p.ns, p.key, p.id);
                *r = Err(e);
            }
        }
        let mut gave_way = Vec::new();
        // Granted by the shared authority and not sealed: given back once all are done.
        let mut undone: Vec<(Publish<'_>, Placing)> = Vec::new();
        let out = items
            .iter()
            .zip(placed)
            .zip(twice)
            .map(|((p, r), twice)| {
                let mut given_back = false;
                let r = r.and_then(|placing| {
                    let sealed =
                        self.seal_placed(&mut st, session, p, &placing, unlocked, &mut gave_way);
                    if sealed.is_err() {
                        if self.granted_to_all(&placing) {
                            undone.push((*p, placing));
                            given_back = true;
                        } else {
                            self.authority.release(p.ns, p.key, p.id);
                        }
                    }
                    sealed
                });
                if let Some(s) = st.sessions.get_mut(&session) {
                    s.allocs.remove(&p.id);
                    if let Ok(size) = &r {
                        s.used += size;
                    }
                }
                if r.is_err() && !given_back && !twice {
                    // The loser's allocation is freed (write-once: first writer wins).
                    self.drop_alloc(&mut st, p.id);
                }
                r.map(|_| p.id)
            })
            .collect();
        if !undone.is_empty() {
            let gone: Vec<Publishing<'_>> = undone
                .iter()
                .map(|(p, placing)| Publishing {
                    ns: p.ns,
                    key: p.key,
                    id: p.id,
                    at: placing.placed(),
                })
                .collect();
            self.give_back(&mut st, &gone);
        }
        drop(st);
        if !gave_way.is_empty() {
            // The kernel may cache the names as the entries that gave way.
            self.notify(gave_way);
        }
        out
    }

    /// The first step of a client's publication, under the lock: the checks, the name
    /// reserved here, the bytes placed.
    fn place_publication(
        &self,
        st: &mut State,
        session: SessionId,
        p: &Publish<'_>,
    ) -> Result<Placing> {
        split_ns(p.ns)?;
        check_component(p.key.as_bytes())?;
        let caller = st.caller(session)?;
        let a = Self::own_alloc(st, session, p.id)?;
        let size = match p.len {
            Some(l) if l > a.size => {
                return Err(Error::InvalidArgument(format!(
                    "length {l} exceeds the allocation of {}",
                    a.size
                )));
            }
            Some(l) => l,
            None => a.size,
        };
        Self::allow(st, &caller, p.ns, Access::Create)?;
        self.check_publishable(st, p.ns, p.key, size)?;
        self.authority.reserve(p.ns, p.key, p.id)?;
        self.place_bytes(st, p.id, size)
            .inspect_err(|_| self.authority.release(p.ns, p.key, p.id))
    }

    /// Allocation `id`, if `session`'s.
    fn own_alloc(st: &State, session: SessionId, id: u64) -> Result<&Alloc> {
        st.allocs
            .get(&id)
            .filter(|a| a.session() == Some(session))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "allocation {id} is not yours (already published or freed?)"
                ))
            })
    }

    /// The last step of a client's publication the authority granted, under the lock: the
    /// entry sealed. The name is checked again; the quota is not (the grant is the commit
    /// point: the quota was checked at the publication's placement, counting what was placed
    /// before it and not yet answered). With the lock let go of in between (`unlocked`), the
    /// allocation is checked too, and another host's entry of the name filed meanwhile gives
    /// way to a grant of the shared authority (its invalidation into `gave_way`).
    fn seal_placed(
        &self,
        st: &mut State,
        session: SessionId,
        p: &Publish<'_>,
        placing: &Placing,
        unlocked: bool,
        gave_way: &mut Vec<Invalidation>,
    ) -> Result<u64> {
        if unlocked {
            Self::own_alloc(st, session, p.id)?;
            if self.granted_to_all(placing) {
                gave_way.extend(self.give_way(st, p.ns, p.key, p.id));
            }
        }
        Self::check_free(st, p.ns, p.key)?;
        self.seal_granted(st, p.id, p.ns, p.key, placing.size)
    }

    /// Whether publication `placing` is asked of the authority that other hosts share: from
    /// its grant on, they may serve it.
    fn granted_to_all(&self, placing: &Placing) -> bool {
        placing
            .pool
            .as_deref()
            .is_some_and(|u| self.authority.shares(u))
    }

    /// Gives back publications `gone`, which the shared authority granted and the store
    /// cannot seal (their allocation, namespace or name changed while it answered, or their
    /// pool could not record them), as a delete removes an entry: other hosts may serve each
    /// from its grant on. Their removals are recorded with the lock let go of (together: a
    /// group commit), and each extent is freed once no host maps it, as a removed entry's
    /// (`State::free_unheld`); the allocations go here (a writer through the mount leaves its
    /// name; a client's caller takes each out of its session). A removal that cannot be
    /// recorded leaves the record at the authority: the extent then stays taken (until marud
    /// restarts), never carved again under it.
    fn give_back(&self, st: &mut Locked<'_>, gone: &[Publishing<'_>]) {
        let allocs: Vec<Option<Alloc>> = gone
            .iter()
            .map(|p| {
                st.writer_left(p.id);
                let a = st.allocs.remove(&p.id)?;
                st.pools[a.pool].writing_bytes -= a.acct;
                Some(a)
            })
            .collect();
        let withdrawn = st.unlocked(|| self.authority.withdraw(gone));
        for ((p, a), w) in gone.iter().zip(allocs).zip(withdrawn) {
            let held = w.and_then(|w| self.authority.unpublish(p.ns, p.key, p.id, &p.at, w));
            self.authority.settled(p.ns, p.key);
            match (held, a) {
                (Ok(true), Some(a)) => {
                    let asize = align_up(a.size.max(p.at.size).max(1), ENTRY_ALIGN);
                    let e = Entry::new(p.id, p.ns, p.key, a.pool, p.at.place, p.at.size, a.perm)
                        .stored_by(None, asize);
                    st.zombies.insert(p.id, e);
                }
                (Ok(false), Some(a)) => st.pools[a.pool].pool.abort(p.id, &a.backing),
                (Ok(_), None) => {}
                (Err(e), _) => tracing::error!(
                    ns = p.ns,
                    key = p.key,
                    "a publication given back: its removal is not recorded ({e}); its extent \
                     stays taken until marud restarts"
                ),
            }
        }
    }

    /// Fails unless `ns/key` is free and `size` more bytes fit `ns`'s quota.
    pub(super) fn check_publishable(
        &self,
        st: &State,
        ns: &str,
        key: &str,
        size: u64,
    ) -> Result<()> {
        Self::check_free(st, ns, key)?;
        st.ns.check_quota(ns, size)
    }

    /// Fails unless namespace `ns` is there and holds neither an entry nor a namespace `key`.
    fn check_free(st: &State, ns: &str, key: &str) -> Result<()> {
        let n = st.ns.get(ns)?;
        if n.entries.contains_key(key) {
            return Err(Error::Exists(format!("{ns}/{key}")));
        }
        if n.children.contains_key(key) {
            return Err(Error::Exists(format!("{ns}/{key} is a namespace")));
        }
        Ok(())
    }

    /// Gives allocation `id`'s bytes their place (raw pools written through the mount), so
    /// that the authority learns where the entry is before the pool records it.
    fn place_bytes(&self, st: &mut State, id: u64, size: u64) -> Result<Placing> {
        let a = st.allocs.get_mut(&id).expect("checked by the caller");
        let pool = &mut st.pools[a.pool].pool;
        if pool.commit(id, &mut a.backing, size)?.is_some() {
            // The mount's buffered writers are copied (`Store::copy_in`) before they get here.
            return Err(Error::Busy(format!(
                "allocation {id}: its bytes are not yet in the pool"
            )));
        }
        Ok(Placing {
            size,
            pool: pool.uuid().map(str::to_owned),
            place: a.backing.offset().map_or(Place::NOWHERE, Place::Extent),
            write_back: pool.write_back(),
        })
    }

    /// Reserves `to` for committed writer `id`, whose publication was reserved as `from`
    /// (a rename after its close), and gives `from` back. The lock is let go of while the
    /// authority reserves the name when it and the pool are shared (the writer marked as
    /// asking: an unlink or a rename of it waits); the writer and the new name are checked
    /// again after, the reservation given back when either changed.
    pub(super) fn reserve_renamed(
        &self,
        st: &mut Locked<'_>,
        id: u64,
        from: (&str, &str),
        to: (&str, &str),
    ) -> Result<()> {
        let uuid = st.pools[st.allocs[&id].pool].pool.uuid().map(str::to_owned);
        if !(self.authority.shared() && uuid.is_some()) {
            self.authority
                .reserve_everywhere(to.0, to.1, id, uuid.as_deref())?;
            self.authority.release(from.0, from.1, id);
            return Ok(());
        }
        st.writer_asking(id, true);
        let reserved = st.unlocked(|| {
            let r = self
                .authority
                .reserve_everywhere(to.0, to.1, id, uuid.as_deref());
            self.ask_gate("reserved", to.0, to.1);
            r
        });
        st.writer_asking(id, false);
        self.sealed.notify_all();
        reserved?;
        let taken = st.ns.get(to.0).map(|n| {
            n.entries.contains_key(to.1)
                || n.children.contains_key(to.1)
                || n.writing.contains_key(to.1)
        });
        if !st.writer_still(id, from.0, from.1) || !matches!(taken, Ok(false)) {
            self.authority.release(to.0, to.1, id);
            return Err(match taken {
                Ok(true) => Error::Exists(format!("{}/{}: entries are write-once", to.0, to.1)),
                _ => Error::NotFound(format!("{}/{} (changed meanwhile)", from.0, from.1)),
            });
        }
        self.authority.release(from.0, from.1, id);
        Ok(())
    }

    /// Checks that `ino` can be published under its target as it stands and reserves that:
    /// the name at the authority, its bytes of the namespace's quota, its room in the pool
    /// (with its bytes copied there, for a raw pool). The lock is let go of while the
    /// authority reserves the name when it and the pool are shared (the writer marked as
    /// asking), and while the bytes are copied; what may have changed meanwhile is checked
    /// again after.
    pub(super) fn try_commit(&self, st: &mut Locked<'_>, ino: u64) -> Result<()> {
        self.asked(st, ino);
        let Some((ns, key, _)) = Self::commit_checks(st, ino)? else {
            return Ok(()); // unlinked: nothing to publish, nothing to report
        };
        let pool = st.allocs[&ino].pool;
        let uuid = st.pools[pool].pool.uuid().map(str::to_owned);
        let asked = self.authority.shared() && uuid.is_some();
        if asked {
            st.writer_asking(ino, true);
            let reserved = st.unlocked(|| {
                self.authority
                    .reserve_everywhere(&ns, &key, ino, uuid.as_deref())
            });
            st.writer_asking(ino, false);
            self.sealed.notify_all();
            reserved?;
        } else {
            self.authority
                .reserve_everywhere(&ns, &key, ino, uuid.as_deref())?;
        }
        let unchanged = |st: &mut State| -> Result<u64> {
            if !st.writer_still(ino, &ns, &key) {
                return Err(Error::NotFound(format!("{ns}/{key} (unlinked meanwhile)")));
            }
            match Self::commit_checks(st, ino)? {
                Some((_, _, len)) => Ok(len),
                None => unreachable!("the writer still has its target"),
            }
        };
        let committed = (|| {
            let len = if asked {
                unchanged(st)?
            } else {
                st.allocs[&ino].mount().expect("a mount write").len
            };
            if self.copy_in(st, ino, len)? {
                unchanged(st)?;
            }
            // The length copied and checked: one that grew meanwhile is committed again at
            // the release (`Store::seal_written`).
            st.writer_committed(ino, len)
        })();
        if committed.is_err() {
            self.authority.release(&ns, &key, ino);
        }
        committed
    }

    /// Readies writer `ino`'s bytes for a publication of `len` bytes (`Pool::commit`): a
    /// raw pool's buffered bytes are copied into the extent reserved for them with the
    /// store's lock let go of, the writer marked as copying meanwhile (another copy of it
    /// waits; its drop too, `Store::copied`), after the claim of a region carved for them
    /// (`Pool::unclaimed`), made in the same unlocked window. Returns whether the lock was
    /// let go of.
    pub(super) fn copy_in(&self, st: &mut Locked<'_>, ino: u64, len: u64) -> Result<bool> {
        let waited = self.copied(st, ino);
        let mut refused = Refused::default();
        loop {
            let s = &mut **st;
            let a = s
                .allocs
                .get_mut(&ino)
                .ok_or_else(|| Error::NotFound(format!("inode {ino} (dropped meanwhile)")))?;
            let q = a.pool;
            let pool = &mut s.pools[q].pool;
            let copy = pool.commit(ino, &mut a.backing, len)?;
            let region = pool.unclaimed(ino);
            let uuid = pool.uuid().map(str::to_owned);
            if copy.is_none() && region.is_none() {
                return Ok(waited);
            }
            st.writer_copying(ino, true);
            let (claim, copied) = st.unlocked(|| {
                let claim = region.map(|(offset, rlen)| {
                    let uuid = uuid.as_deref().expect("only raw pools carve regions");
                    self.authority.claim_region(uuid, offset, rlen)
                });
                let copied = match (&claim, copy) {
                    (Some(Err(_)), _) | (_, None) => Ok(()),
                    (_, Some(copy)) => match self.data_fault(ino) {
                        Some(errno) => Err(Error::from_errno(errno)),
                        None => copy.run(),
                    },
                };
                (claim, copied)
            });
            st.writer_copying(ino, false);
            self.sealed.notify_all();
            if let (Some((offset, _)), Some(claim)) = (region, claim) {
                st.pools[q].pool.claimed(offset, &claim);
                if let Err(e) = claim {
                    // The region went with the bytes' place: another is tried.
                    if let Some(Backing::Buffer { placed, .. }) =
                        st.allocs.get_mut(&ino).map(|a| &mut a.backing)
                    {
                        *placed = None;
                    }
                    refused.again(e, offset, &st.pools[q].name)?;
                    continue;
                }
            }
            return copied.map(|()| true);
        }
    }

    /// Waits until no copy of writer `ino`'s bytes is under way; returns whether it waited.
    pub(super) fn copied(&self, st: &mut Locked<'_>, ino: u64) -> bool {
        let mut waited = false;
        while st
            .allocs
            .get(&ino)
            .and_then(Alloc::mount)
            .is_some_and(|m| m.copying())
        {
            st.wait(&self.sealed);
            waited = true;
        }
        waited
    }

    /// Waits until writer `ino` asks the authority nothing (a close's reservation or
    /// publication, a rename's reservation: each clears its mark and wakes the waiters
    /// however it ends, within the authority's own patience).
    pub(super) fn asked(&self, st: &mut Locked<'_>, ino: u64) {
        while st
            .allocs
            .get(&ino)
            .and_then(Alloc::mount)
            .is_some_and(|m| m.asking())
        {
            st.wait(&self.sealed);
        }
    }

    /// Publishes writer `ino` under its target at its writer's last release (the mount):
    /// committed again if its length changed since its last close (or it had no close), its
    /// bytes copied, then sealed under its target as it is then. Nothing when it was unlinked
    /// or failed meanwhile (the caller drops it).
    pub(super) fn seal_written(&self, st: &mut Locked<'_>, ino: u64) -> Result<()> {
        // A rename's (or another close's) round trip at the authority: its answer first, the
        // writer's target may move.
        self.asked(st, ino);
        let m = st.allocs[&ino].mount().expect("a mount write");
        let len = m.len;
        // Normally committed by its writer's last close; a size that changed since (or no
        // close at all) is checked here, where a refusal can only be logged.
        if !m.committed() || len != m.reserved() {
            self.try_commit(st, ino)?;
        } else {
            self.copy_in(st, ino, len)?;
        }
        let Some(m) = st.allocs.get(&ino).and_then(Alloc::mount) else {
            return Ok(());
        };
        let (Some((ns, key)), None) = (m.target().cloned(), m.failed) else {
            return Ok(()); // unlinked or failed meanwhile
        };
        if !m.committed() || m.len != m.reserved() {
            return Err(Error::Busy(format!(
                "{ns}/{key}: written while being published"
            )));
        }
        let len = m.len;
        self.seal(st, ino, &ns, &key, len).map(drop)
    }

    /// The checks of a commit of writer `ino` as it stands: its target and length, or None
    /// when it was unlinked.
    fn commit_checks(st: &State, ino: u64) -> Result<Option<(String, String, u64)>> {
        let m = st.allocs[&ino].mount().expect("a mount write");
        if let Some(e) = m.failed {
            return Err(Error::from_errno(e));
        }
        let Some((ns, key)) = m.target().cloned() else {
            return Ok(None);
        };
        let (len, reserved) = (m.len, m.reserved());
        let n = st.ns.get(&ns)?;
        if n.entries.contains_key(&key) || n.children.contains_key(&key) {
            return Err(Error::Exists(format!("{ns}/{key}: published meanwhile")));
        }
        st.ns.check_quota(&ns, len.saturating_sub(reserved))?;
        Ok(Some((ns, key, len)))
    }

    /// Renames sealed entry `ino` to `ns/key` (the mount's rename). In cluster mode, for an
    /// entry of a shared pool, the authority grants the new name and drops the old one with
    /// the lock let go of: the new name is reserved here first (no writer of this host takes
    /// it meanwhile) and the entry is marked as withdrawing (not deleted, evicted or renamed
    /// again meanwhile).
    pub(super) fn rename_sealed(
        &self,
        st: &mut Locked<'_>,
        ino: u64,
        ns: &str,
        key: &str,
    ) -> Result<()> {
        let e = &st.entries[&ino];
        let at = st.placed(e);
        if !(self.authority.shared() && at.pool.is_some()) {
            return st.rename_entry(&*self.authority, ino, ns, key);
        }
        if e.withdrawing() {
            return Err(Error::NotFound(format!(
                "{}/{} (being deleted)",
                e.ns(),
                e.key()
            )));
        }
        let (from_ns, from_key) = (e.ns().to_owned(), e.key().to_owned());
        let (pool, place, size) = (at.pool.map(str::to_owned), at.place, at.size);
        self.authority.reserve(ns, key, ino)?;
        st.entries
            .get_mut(&ino)
            .expect("present")
            .set_withdrawing(true);
        self.authority.withdrawing(&from_ns, &from_key);
        let placed = Placed {
            pool: pool.as_deref(),
            place,
            size,
        };
        let granted = st.unlocked(|| {
            self.authority.publish(ns, key, ino, &placed)?;
            self.authority
                .unpublish(&from_ns, &from_key, ino, &placed, None)
        });
        let here = match st.entries.get_mut(&ino) {
            Some(e) if e.ns() == from_ns && e.key() == from_key => {
                e.set_withdrawing(false);
                true
            }
            _ => false, // removed meanwhile (by another host, through the watch)
        };
        let moved = granted.and_then(|_| {
            if !here {
                return Err(Error::NotFound(format!("{from_ns}/{from_key}")));
            }
            st.move_entry(ino, ns, key).inspect_err(|_| {
                // Still under its old name here: the authority has it back.
                let back =
                    st.unlocked(|| self.authority.publish(&from_ns, &from_key, ino, &placed));
                if let Err(e) = back {
                    tracing::warn!(ns = %from_ns, key = %from_key, "a rename undone: {e}");
                }
            })
        });
        if moved.is_err() {
            // The new name goes: its reservation here, or its publication for every host when
            // the authority made it (a round trip, without the lock; the extent stays, the
            // entry keeps it under its old name).
            let back = st.unlocked(|| self.authority.unpublish(ns, key, ino, &placed, None));
            if let Err(e) = back {
                tracing::error!(ns, key, "a rename undone: the new name is not removed: {e}");
            }
        }
        self.authority.settled(ns, key);
        self.authority.settled(&from_ns, &from_key);
        moved
    }

    /// Publishes writer `id` (its name reserved at the authority) as `ns/key` of `size`
    /// bytes (the mount's publications); returns the size. When the authority is shared and
    /// the entry in a shared pool, the lock is let go of while it answers; the writer is
    /// marked as asking meanwhile (an unlink or a rename of it waits), and a writer unlinked
    /// anyway has its publication taken back.
    pub(super) fn seal(
        &self,
        st: &mut Locked<'_>,
        id: u64,
        ns: &str,
        key: &str,
        size: u64,
    ) -> Result<u64> {
        let placing = self.place_bytes(st, id, size)?;
        let at = Placed {
            pool: placing.pool.as_deref(),
            place: placing.place,
            size,
        };
        if self.authority.shared() && at.pool.is_some() {
            st.writer_asking(id, true);
            let granted = st.unlocked(|| {
                placing.write_back();
                let granted = self.authority.publish(ns, key, id, &at);
                if granted.is_ok() {
                    self.ask_gate("published", ns, key);
                }
                granted
            });
            st.writer_asking(id, false);
            self.sealed.notify_all();
            granted?;
            let granted = Publishing { ns, key, id, at };
            if !st.writer_still(id, ns, key) {
                // Unlinked (or failed) while the authority answered (each waits for the
                // answer: not expected), the publication is given back.
                self.give_back(st, &[granted]);
                return Err(Error::NotFound(format!(
                    "{ns}/{key} (unlinked while being published)"
                )));
            }
            // Another host's entry of the name filed meanwhile gives way to the grant; the
            // kernel is told once the entry is sealed (letting go of the lock before would let
            // an unlink or a rename of the writer in between the checks and the seal).
            let gave_way = at
                .pool
                .filter(|u| self.authority.shares(u))
                .and_then(|_| self.give_way(st, ns, key, id));
            let sealed = self.seal_granted(st, id, ns, key, size);
            if sealed.is_err() {
                // Its pool could not record it (its bytes changed since their copy, or its log
                // failed): other hosts may serve it already.
                self.give_back(st, &[granted]);
            }
            self.notify(gave_way.into_iter().collect());
            return sealed;
        }
        placing.write_back();
        self.authority.publish(ns, key, id, &at)?;
        self.seal_granted(st, id, ns, key, size)
            .inspect_err(|_| self.authority.release(ns, key, id))
    }

    /// Seals allocation `id`, placed and its publication granted by the authority, as
    /// `ns/key` of `size` bytes. On failure the caller gives the publication back (a grant of
    /// the shared authority as a delete removes an entry: `Store::give_back`).
    fn seal_granted(&self, st: &mut State, id: u64, ns: &str, key: &str, size: u64) -> Result<u64> {
        let a = st.allocs.get_mut(&id).expect("checked by the caller");
        let asize = align_up(a.size.max(size).max(1), ENTRY_ALIGN);
        let perm = Perm {
            mode: a.perm.mode & policy::ENTRY_MODES,
            ..a.perm
        };
        let e = Entry::new(id, ns, key, a.pool, Place::NOWHERE, size, perm)
            .stored_by(a.session(), asize);
        let pool = &mut st.pools[a.pool].pool;
        let offset = pool.publish(id, &mut a.backing, &e.loc())?;
        let e = e.at(offset);
        let committed = st.writer_sealing(id, ns, key)?;
        let a = st.allocs.remove(&id).expect("present");
        st.pools[a.pool].writing_bytes -= a.acct;
        st.insert_entry(e);
        self.authority.settled(ns, key);
        if committed {
            st.writer_sealed(ns)?;
        }
        self.counters.add_bytes(Bytes::Stored, size);
        Ok(size)
    }
}
