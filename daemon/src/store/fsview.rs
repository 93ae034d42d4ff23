//! The mount's view of the store: the filesystem's [`Backend`], by inode.
//!
//! Entries written through the mount are published by the rule of doc/SEMANTICS.md: a failed
//! write marks the entry failed; each `close(2)` of a writable descriptor commits (name, quota,
//! room) and reports a refusal as its error; the release of the last writable handle
//! publishes what was committed. A writer whose entry will not be published learns it from
//! `write` or `close`.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use maru::{Error, Result};
use maru_fsd::{Attr, Backend, Caller, DirEntry, Kind, OpenedFile, Upcall, Xattr};

use super::Store;
use super::ids::Place;
use super::namespaces::join;
use super::policy::{self, Access, ENTRY_MODES, Perm};
use super::pools::{Backing, kind_name};
use super::state::{Alloc, Invalidation, Origin, State};
use super::writer::MountWrite;
use crate::alloc::align_up;

/// Files being written grow ahead to this boundary: `huge=within_size` gives them 2 MiB pages.
const GROW: u64 = 2 << 20;

/// The store seen through the filesystem's [`Backend`] trait.
pub struct StoreFs(pub Arc<Store>);

impl StoreFs {
    /// Whether `ino` is an entry written through the mount whose close committed it and whose
    /// publication may yet fail: in a pool shared with other hosts, where the name's
    /// reservation goes with a lost lease (seed 963: a writer cut off read back its own
    /// bytes, which were never published, and then another host's entry of the name). Its
    /// writer then waits for the publication as others do; elsewhere a commit is final, and
    /// the writer reads back at once.
    fn publication_pending(&self, st: &State, ino: u64) -> bool {
        st.allocs.get(&ino).is_some_and(|a| {
            a.mount().is_some_and(|m| m.committed())
                && self.0.authority.shared()
                && st.pools[a.pool].pool.leases()
        })
    }
}

impl Backend for StoreFs {
    /// Looks `name` up in namespace `parent`. Entries being written are visible only to the
    /// process writing them (its path operations: stat, rename, unlink); a committed one
    /// makes others wait (up to 1 s) for its release. (Its writer's reads wait in `open`.)
    fn lookup(&self, c: &Caller, parent: u64, name: &str) -> Result<Attr> {
        let mut st = self.0.lock();
        let deadline = Instant::now() + Duration::from_secs(1);
        let mut tgid = None;
        loop {
            let p = st.ns.path_of(parent)?.to_owned();
            Store::allow(&st, c, &p, Access::Lookup)?;
            let n = st.ns.get(&p)?;
            if let Some(ino) = n.entries.get(name) {
                return Ok(st.entries[ino].attr());
            }
            if n.children.contains_key(name) {
                return Ok(st.ns.get(&join(&p, name))?.attr());
            }
            let Some((id, a)) = n
                .writing
                .get(name)
                .and_then(|id| st.allocs.get(id).map(|a| (*id, a)))
            else {
                return Err(Error::NotFound(join(&p, name)));
            };
            let m = a.mount().expect("a mount write");
            let me = *tgid.get_or_insert_with(|| c.tgid());
            if m.tgid == me {
                return Ok(a.attr(id));
            }
            if !m.committed() || st.wait_until(&self.0.sealed, deadline).timed_out() {
                return Err(Error::NotFound(join(&p, name)));
            }
        }
    }

    fn getattr(&self, ino: u64) -> Result<Attr> {
        let st = self.0.lock();
        if let Some(e) = st.entries.get(&ino) {
            return Ok(e.attr());
        }
        if st.ns.is_ns(ino) {
            return Ok(st.ns.get(st.ns.path_of(ino)?)?.attr());
        }
        if let Some(a) = st.allocs.get(&ino) {
            return Ok(a.attr(ino));
        }
        if let Some(z) = st.zombies.get(&ino) {
            return Ok(z.attr());
        }
        st.gone
            .get(&ino)
            .cloned()
            .ok_or_else(|| Error::NotFound(format!("inode {ino}")))
    }

    fn readdir(&self, c: &Caller, ino: u64) -> Result<Vec<DirEntry>> {
        let st = self.0.lock();
        let p = st.ns.path_of(ino)?;
        Store::allow(&st, c, p, Access::List)?;
        let n = st.ns.get(p)?;
        let dir = |(name, ino): (&String, &u64), kind| DirEntry {
            ino: *ino,
            name: name.clone(),
            kind,
        };
        let mut v: Vec<DirEntry> = n
            .children
            .iter()
            .map(|x| dir(x, Kind::Dir))
            .chain(n.entries.iter().map(|x| dir(x, Kind::File)))
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(v)
    }

    fn mkdir(&self, c: &Caller, parent: u64, name: &str, mode: u32) -> Result<Attr> {
        let p = self.0.lock().ns.path_of(parent)?.to_owned();
        let ino = self.0.mkdir(c, &join(&p, name), mode)?;
        self.getattr(ino)
    }

    fn rmdir(&self, c: &Caller, parent: u64, name: &str) -> Result<()> {
        let full = {
            let st = self.0.lock();
            let p = st.ns.path_of(parent)?;
            if st.ns.get(p)?.entries.contains_key(name) {
                return Err(Error::from_errno(libc::ENOTDIR));
            }
            join(p, name)
        };
        self.0.rmdir(c, &full)
    }

    fn create(&self, c: &Caller, parent: u64, name: &str, mode: u32) -> Result<(Attr, OpenedFile)> {
        let mut st = self.0.lock();
        let p = st.ns.path_of(parent)?.to_owned();
        if p.is_empty() {
            return Err(Error::PermissionDenied(
                "entries live in namespaces: create a directory first".into(),
            ));
        }
        Store::allow(&st, c, &p, Access::Create)?;
        let n = st.ns.get(&p)?;
        if n.entries.contains_key(name)
            || n.children.contains_key(name)
            || n.writing.contains_key(name)
            || self.0.authority.holder(&p, name).is_some()
        {
            return Err(Error::Exists(join(&p, name)));
        }
        // A namespace already at its quota takes no new entry.
        st.ns.check_quota(&p, 1)?;
        let id = st.alloc_ino();
        // Entries go to the first memfs pool (passed through to readers), else the first.
        let pool = st
            .pools
            .iter()
            .find(|s| s.pool.passthrough())
            .or(st.pools.first())
            .map(|s| s.id)
            .ok_or_else(|| Error::NoSpace("no pools".into()))?;
        let backing = st.pools[pool].pool.create(id)?;
        let a = Alloc {
            pool,
            size: 0,
            origin: Origin::Mount(MountWrite::new(&p, name, c.tgid())),
            backing,
            perm: Perm {
                uid: c.uid,
                gid: c.gid,
                mode: mode & ENTRY_MODES,
            },
            mtime: SystemTime::now(),
            acct: 0,
        };
        let (attr, file) = (a.attr(id), a.backing.file());
        st.allocs.insert(id, a);
        st.writer_opened(id)?;
        Ok((attr, OpenedFile::Writing(file)))
    }

    fn open(&self, c: &Caller, ino: u64, write: bool) -> Result<OpenedFile> {
        let mut st = self.0.lock();
        // Its writer reading back what it committed waits for the publication where that may
        // yet fail, as any other reader does (see `lookup`).
        let deadline = Instant::now() + Duration::from_secs(1);
        while !write && self.publication_pending(&st, ino) {
            if st.wait_until(&self.0.sealed, deadline).timed_out() {
                return Err(Error::NotFound(format!("inode {ino} is being published")));
            }
        }
        if let Some(e) = st.entries.get(&ino) {
            if write {
                return Err(Error::ReadOnly("sealed entries are immutable".into()));
            }
            let (ns, perm, pool) = (e.ns().to_owned(), e.perm(), e.pool());
            Store::allow(&st, c, &ns, Access::Read(&perm))?;
            st.touch(ino);
            if st.fenced_off(self.0.authority.fenced(), ino) {
                return Err(super::authority::fenced_error());
            }
            let Some(stale) = st.ready_remote(&*self.0.authority, ino) else {
                return Err(Error::NotFound(format!("{ns}: removed on another host")));
            };
            let e = &st.entries[&ino];
            let p = &st.pools[pool].pool;
            let opened = if p.passes_through(&e.loc()) {
                OpenedFile::Passthrough(Arc::new(p.open_entry(&e.loc())?))
            } else {
                st.entries.get_mut(&ino).expect("present").lease();
                *st.fuse_leases.entry(ino).or_insert(0) += 1;
                OpenedFile::Copy
            };
            drop(st);
            self.0.drop_stale(stale);
            return Ok(opened);
        }
        if let Some(a) = st.allocs.get(&ino) {
            return match (a.mount(), &a.backing) {
                // Its writer reading it back after its close committed it (the kernel's
                // release is on its way): the file it will be, passed through like the
                // sealed entry it is about to become.
                (Some(m), Backing::File { file, .. })
                    if !write && m.committed() && m.tgid == c.tgid() =>
                {
                    Ok(OpenedFile::Passthrough(file.clone()))
                }
                (Some(m), b) if m.target().is_some() && m.tgid == c.tgid() => {
                    Ok(OpenedFile::Writing(b.file()))
                }
                _ => Err(Error::NotFound(format!("inode {ino} is being written"))),
            };
        }
        if st.ns.is_ns(ino) {
            return Err(Error::from_errno(libc::EISDIR));
        }
        Err(Error::NotFound(format!("inode {ino}")))
    }

    fn reopen(&self, _c: &Caller, ino: u64) -> Result<()> {
        // The hot path of a retrieval: the kernel checked the caller's permissions
        // (default_permissions) before asking; only the use is recorded.
        if self.0.lock().touch(ino) {
            Ok(())
        } else {
            Err(Error::NotFound(format!("inode {ino}")))
        }
    }

    fn close(&self, ino: u64) {
        let mut st = self.0.lock();
        let held = match st.fuse_leases.get_mut(&ino) {
            Some(n) => {
                *n -= 1;
                if *n == 0 {
                    st.fuse_leases.remove(&ino);
                }
                true
            }
            None => false,
        };
        if held {
            st.unlease(&*self.0.authority, ino, 1);
        }
    }

    fn commit(&self, _c: &Caller, ino: u64, abandoned: bool) -> Result<()> {
        let mut st = self.0.lock();
        if st.allocs.get(&ino).and_then(Alloc::mount).is_none() {
            return Ok(());
        }
        if abandoned {
            // Its writer was killed mid-store: forget the name; the release drops the bytes.
            tracing::info!(ino, "writer killed by a signal: entry abandoned");
            self.0.abandon(&mut st, ino, Some(libc::EINTR));
            return Ok(());
        }
        let r = self.0.try_commit(&mut st, ino);
        if let Err(e) = &r {
            tracing::info!(ino, "a close through the mount refused publication: {e}");
            self.0.abandon(&mut st, ino, Some(e.errno()));
        }
        r
    }

    fn fallocate(&self, ino: u64, offset: u64, len: u64) -> Result<()> {
        let end = offset
            .checked_add(len)
            .ok_or_else(|| Error::InvalidArgument("range overflows".into()))?;
        // One size change of this entry at a time; its pages are reserved without the lock.
        let resizing = self.0.resizing(ino)?;
        let _one = resizing.lock();
        let (file, pool) = {
            let mut st = self.0.lock();
            let max = self.0.cfg.max_copy_entry;
            let pool = Store::writing(&mut st, ino)?.pool;
            let cap = st.pools[pool].pool.capacity();
            let a = &st.allocs[&ino];
            let limit = if matches!(a.backing, Backing::Buffer { .. }) {
                max
            } else {
                cap
            };
            if end > cap.min(limit) {
                return Err(Error::from_errno(libc::EFBIG));
            }
            let file = match &a.backing {
                Backing::File { file, .. } => Some(file.clone()),
                _ => None,
            };
            (file, pool)
        };
        if let Some(f) = &file {
            self.0.reserve(pool, f, offset, end)?;
        }
        // A buffer grows under its own lock, held until its length is set under the store's:
        // a write or a copy of it waits meanwhile, the store does not.
        let buf = self.0.buffer(ino)?;
        let mut grown = buf.as_ref().map(|b| b.write());
        if let Some(b) = &mut grown {
            b.grow(end as usize);
        }
        let mut st = self.0.lock();
        let a = Store::writing(&mut st, ino)?;
        if let Backing::File { span, .. } = &mut a.backing {
            *span = (*span).max(end);
        }
        let m = a.mount_mut().expect("a mount write");
        m.len = m.len.max(end);
        Ok(())
    }

    /// Publishes the entry being written `ino` at its writer's last release.
    fn seal(&self, ino: u64) -> Result<()> {
        let mut st = self.0.lock();
        let Some(m) = st.allocs.get(&ino).and_then(Alloc::mount) else {
            return Ok(());
        };
        let r = match (m.failed, m.target()) {
            (None, Some((ns, key))) => {
                tracing::debug!(ino, ns = %ns, key = %key, size = m.len, "publishing an entry written through the mount");
                self.0.seal_written(&mut st, ino)
            }
            _ => Ok(()), // failed, unlinked or abandoned: dropped below
        };
        self.0.copied(&mut st, ino);
        let dropped = st.allocs.contains_key(&ino);
        if dropped {
            if let Err(e) = &r {
                tracing::warn!(
                    ino,
                    "an entry written through the mount was not published: {e}"
                );
            }
            self.0.abandon(&mut st, ino, None);
            self.0.drop_alloc(&mut st, ino);
        }
        drop(st);
        self.0.sealed.notify_all();
        if dropped {
            self.0.forget_backing(ino);
        }
        r
    }

    fn abort(&self, ino: u64) {
        let mut st = self.0.lock();
        self.0.copied(&mut st, ino);
        self.0.abandon(&mut st, ino, None);
        self.0.drop_alloc(&mut st, ino);
        drop(st);
        self.0.forget_backing(ino);
    }

    fn truncate(&self, ino: u64, size: u64) -> Result<Attr> {
        {
            let st = self.0.lock();
            if let Some(e) = st.entries.get(&ino) {
                if e.size() == size {
                    return Ok(e.attr());
                }
                return Err(Error::ReadOnly("sealed entries are immutable".into()));
            }
        }
        // One size change of this entry at a time; its pages are reserved without the lock.
        let resizing = self.0.resizing(ino)?;
        let _one = resizing.lock();
        let mut st = self.0.lock();
        let max = self.0.cfg.max_copy_entry;
        let a = Store::writing(&mut st, ino)?;
        let pool = a.pool;
        if let Some(e) = a.mount().and_then(|m| m.failed) {
            return Err(Error::from_errno(e));
        }
        let cap = st.pools[pool].pool.capacity();
        let a = st.allocs.get_mut(&ino).expect("present");
        match &mut a.backing {
            Backing::File { file, .. } => {
                if size > cap {
                    return Err(Error::from_errno(libc::EFBIG));
                }
                let (file, old) = (file.clone(), a.size_now());
                drop(st);
                if size > old {
                    // A writer that sizes its entry is about to fill it, often through a
                    // mapping, where a page the pool cannot give is a SIGBUS: reserve them now.
                    self.0.reserve(pool, &file, old, size)?;
                }
                file.set_len(size)?;
                let mut st = self.0.lock();
                let a = Store::writing(&mut st, ino)?;
                if let Backing::File { span, .. } = &mut a.backing {
                    *span = size;
                }
                a.mtime = SystemTime::now();
                a.mount_mut().expect("a mount write").len = size;
                return Ok(a.attr(ino));
            }
            Backing::Buffer { buf, .. } => {
                if size > max {
                    return Err(Error::from_errno(libc::EFBIG));
                }
                // Resized under its own lock, held until its length is set under the store's.
                let buf = buf.clone();
                drop(st);
                let mut b = buf.write();
                b.resize(size as usize);
                let mut st = self.0.lock();
                let a = Store::writing(&mut st, ino)?;
                a.mtime = SystemTime::now();
                a.mount_mut().expect("a mount write").len = size;
                return Ok(a.attr(ino));
            }
            Backing::Extent { .. } | Backing::Packed { .. } => {}
        }
        a.mtime = SystemTime::now();
        a.mount_mut().expect("a mount write").len = size;
        Ok(a.attr(ino))
    }

    fn chmod_chown(
        &self,
        c: &Caller,
        ino: u64,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
    ) -> Result<Attr> {
        let mut guard = self.0.lock();
        let st = &mut *guard;
        let apply = |p: &mut Perm, mask: u32| {
            if let Some(m) = mode {
                p.mode = m & mask;
            }
            if let Some(u) = uid {
                p.uid = u;
            }
            if let Some(g) = gid {
                p.gid = g;
            }
        };
        let denied = || Error::from_errno(libc::EPERM);
        if st.ns.is_ns(ino) {
            let path = st.ns.path_of(ino)?.to_owned();
            let n = st.ns.get_mut(&path)?;
            if !policy::may_chown(c, &n.perm, uid, gid) {
                return Err(denied());
            }
            apply(&mut n.perm, 0o7777);
            n.mtime = SystemTime::now();
            let a = n.attr();
            st.ns.save();
            st.mirror_ns_access(&path);
            st.renew_indexes(&path);
            return Ok(a);
        }
        if let Some(a) = st.allocs.get_mut(&ino) {
            if !policy::may_chown(c, &a.perm, uid, gid) {
                return Err(denied());
            }
            apply(&mut a.perm, ENTRY_MODES);
            return Ok(a.attr(ino));
        }
        let e = st
            .entries
            .get_mut(&ino)
            .ok_or_else(|| Error::NotFound(format!("inode {ino}")))?;
        let old = e.perm();
        if !policy::may_chown(c, &old, uid, gid) {
            return Err(denied());
        }
        let mut perm = old;
        apply(&mut perm, ENTRY_MODES);
        e.set_perm(perm);
        let attr = e.attr();
        match st.pools[e.pool()].pool.set_owner_mode(&e.loc()) {
            Ok(Some(at)) => st.relocate(ino, at),
            Ok(None) => {}
            Err(err) => {
                // Nothing changed where the entry is: neither does what it says.
                st.entries.get_mut(&ino).expect("present").set_perm(old);
                return Err(err);
            }
        }
        Ok(attr)
    }

    /// Reads a sealed entry (or a removed one still leased) or one being written. The bytes
    /// are read without the store's lock: a raw pool's extent is leased meanwhile (it is not
    /// reused, the entry is not evicted), and a pack never reuses its bytes.
    fn read(&self, ino: u64, offset: u64, len: u32) -> Result<Vec<u8>> {
        let mut guard = self.0.lock();
        let st = &mut *guard;
        let sealed = st.entries.contains_key(&ino);
        if sealed || st.zombies.contains_key(&ino) {
            if st.fenced_off(self.0.authority.fenced(), ino) {
                return Err(super::authority::fenced_error());
            }
            let stale = if sealed {
                st.ready_remote(&*self.0.authority, ino).ok_or_else(|| {
                    Error::NotFound(format!("inode {ino}: removed on another host"))
                })?
            } else {
                None
            };
            let e = if sealed {
                st.entries.get_mut(&ino)
            } else {
                st.zombies.get_mut(&ino)
            }
            .expect("present");
            if offset >= e.size() {
                // Nothing read, nothing leased: not used here on this read's account.
                if sealed {
                    st.not_leased(&*self.0.authority, ino);
                }
                return Ok(Vec::new());
            }
            let n = u64::from(len).min(e.size() - offset) as usize;
            let pool = &st.pools[e.pool()].pool;
            let reader = match pool.reader(&e.loc()) {
                Ok(r) => r,
                Err(err) => {
                    if sealed {
                        st.not_leased(&*self.0.authority, ino);
                    }
                    return Err(err);
                }
            };
            let leased = pool.leases();
            if leased {
                e.lease();
            }
            let epoch = self.0.authority.fence_epoch();
            drop(guard);
            self.0.drop_stale(stale);
            let mut buf = vec![0u8; n];
            let r = reader.read(offset, &mut buf);
            // Fenced off meanwhile (a pause past the TTL): the extent may be another's now.
            let unsound = self.0.authority.fenced() || self.0.authority.fence_epoch() != epoch;
            if leased {
                self.0.lock().unlease(&*self.0.authority, ino, 1);
                if unsound {
                    return Err(super::authority::fenced_error());
                }
            }
            return r.map(|()| buf);
        }
        let a = st
            .allocs
            .get(&ino)
            .ok_or_else(|| Error::NotFound(format!("inode {ino}")))?;
        let size = a.size_now();
        if offset >= size {
            return Ok(Vec::new());
        }
        let n = u64::from(len).min(size - offset) as usize;
        match &a.backing {
            Backing::File { file, .. } => {
                use std::os::unix::fs::FileExt;
                // The writer's own file: read without the lock.
                let file = file.clone();
                drop(guard);
                let mut buf = vec![0u8; n];
                file.read_exact_at(&mut buf, offset)?;
                Ok(buf)
            }
            Backing::Buffer { buf, .. } => {
                // Copied out under the buffer's own lock.
                let buf = buf.clone();
                drop(guard);
                Ok(buf.read().read(offset as usize, n))
            }
            Backing::Extent { .. } | Backing::Packed { .. } => Ok(Vec::new()),
        }
    }

    /// Writes `data` at `offset` of the entry being written `ino`: all of it or an error,
    /// which marks the entry failed. The copy runs outside the store's lock.
    fn write(&self, ino: u64, offset: u64, data: &[u8]) -> Result<u32> {
        let end = offset
            .checked_add(data.len() as u64)
            .ok_or_else(|| Error::from_errno(libc::EFBIG))?;
        // The fault-injection seam (tests, feature `seams`): this write fails with that errno.
        let fault = self.0.data_fault(ino);
        let (file, pool) = {
            let mut st = self.0.lock();
            let max = self.0.cfg.max_copy_entry;
            let a = Store::writing(&mut st, ino)?;
            let pool = a.pool;
            let failed = a.mount().and_then(|m| m.failed);
            if let Some(e) = failed {
                return Err(Error::from_errno(e));
            }
            let cap = st.pools[pool].pool.capacity();
            let a = st.allocs.get_mut(&ino).expect("present");
            a.mtime = SystemTime::now();
            let out = match &mut a.backing {
                Backing::Buffer { buf, .. } => {
                    if end > max || fault.is_some() {
                        drop(st);
                        let errno = fault.unwrap_or(libc::EFBIG);
                        return self.0.fail(ino, Error::from_errno(errno));
                    }
                    // Copied in under the buffer's own lock, held until the length is set
                    // under the store's.
                    let buf = buf.clone();
                    drop(st);
                    let mut b = buf.write();
                    b.write(offset as usize, data);
                    let mut st = self.0.lock();
                    if let Some(m) = st.allocs.get_mut(&ino).and_then(Alloc::mount_mut) {
                        m.len = m.len.max(end);
                    }
                    return Ok(data.len() as u32);
                }
                Backing::File { file, span, .. } => {
                    if end > cap {
                        drop(st);
                        return self.0.fail(ino, Error::from_errno(libc::EFBIG));
                    }
                    if end > *span {
                        // Large writes (the kernel splits a big write(2) into pieces of
                        // max_write) grow the file to the next 2 MiB boundary, so that its
                        // pages are 2 MiB ones; a small entry keeps its size (a 2 MiB page
                        // for a few KiB would cost far more than it saves).
                        let grown = if data.len() as u64 >= GROW / 4 {
                            align_up(end, GROW).min(cap).max(end)
                        } else {
                            end
                        };
                        if let Err(e) = file.set_len(grown) {
                            drop(st);
                            return self.0.fail(ino, e.into());
                        }
                        *span = grown;
                    }
                    (file.clone(), pool)
                }
                Backing::Extent { .. } | Backing::Packed { .. } => {
                    return Err(Error::ReadOnly("a client's allocation".into()));
                }
            };
            // Counted before its bytes land: a commit meanwhile (a close) cuts none of them.
            a.mount_mut()
                .into_iter()
                .for_each(|m| m.len = m.len.max(end));
            out
        };
        let mut evicted = false;
        loop {
            use std::os::unix::fs::FileExt;
            let r = match fault {
                Some(errno) => Err(std::io::Error::from_raw_os_error(errno)),
                None => file.write_all_at(data, offset),
            };
            match r {
                Ok(()) => break,
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && !evicted => {
                    // The pool is full: make room as a store would (with eviction on), once.
                    evicted = true;
                    let want = (data.len() as u64).saturating_add(GROW);
                    if !self.0.ensure_free(&mut self.0.lock(), pool, want) {
                        return self.0.fail(ino, e.into());
                    }
                }
                Err(e) => return self.0.fail(ino, e.into()),
            }
        }
        let mut st = self.0.lock();
        if let Some(m) = st.allocs.get_mut(&ino).and_then(Alloc::mount_mut) {
            m.len = m.len.max(end);
        }
        Ok(data.len() as u32)
    }

    fn unlink(&self, c: &Caller, parent: u64, name: &str) -> Result<()> {
        let mut st = self.0.lock();
        let p = st.ns.path_of(parent)?.to_owned();
        // A writer whose publication is at the authority: its answer first.
        self.0.wait_for_asked(&mut st, &p, name)?;
        let n = st.ns.get(&p)?;
        if n.children.contains_key(name) {
            return Err(Error::from_errno(libc::EISDIR));
        }
        if let Some(&ino) = n.entries.get(name) {
            let perm = st.entries[&ino].perm();
            Store::allow(&st, c, &p, Access::Delete(&perm))?;
            let inv = self.0.delete_entry(&mut st, &p, ino)?;
            drop(st);
            // The kernel drops the name; the backing is freed once the mount lets go of it.
            self.0.notify(
                inv.map(|i| Invalidation {
                    by_kernel: true,
                    ..i
                })
                .into_iter()
                .collect(),
            );
            return Ok(());
        }
        // A name being written: its writer (or root) may drop it; its release then frees it.
        if let Some(id) = n.writing.get(name).copied() {
            let perm = st.allocs[&id].perm;
            Store::allow(&st, c, &p, Access::Delete(&perm))?;
            self.0.abandon(&mut st, id, None);
            return Ok(());
        }
        Err(Error::NotFound(join(&p, name)))
    }

    fn rename(
        &self,
        c: &Caller,
        parent: u64,
        name: &str,
        newparent: u64,
        newname: &str,
    ) -> Result<()> {
        let mut st = self.0.lock();
        let p = st.ns.path_of(parent)?.to_owned();
        let np = st.ns.path_of(newparent)?.to_owned();
        self.0.wait_for_asked(&mut st, &p, name)?;
        if st.ns.get(&p)?.children.contains_key(name) {
            return Err(Error::from_errno(libc::EXDEV));
        }
        if np.is_empty() {
            return Err(Error::PermissionDenied("entries live in namespaces".into()));
        }
        let src = st.ns.get(&p)?;
        let (sealed, writing) = (
            src.entries.get(name).copied(),
            src.writing.get(name).copied(),
        );
        let perm = match (sealed, writing) {
            (Some(i), _) => st.entries[&i].perm(),
            (None, Some(i)) => st.allocs[&i].perm,
            (None, None) => return Err(Error::NotFound(join(&p, name))),
        };
        Store::allow(&st, c, &p, Access::Delete(&perm))?;
        Store::allow(&st, c, &np, Access::Create)?;
        let target = st.ns.get(&np)?;
        if target.entries.contains_key(newname)
            || target.children.contains_key(newname)
            || target.writing.contains_key(newname)
        {
            if p == np && name == newname {
                return Ok(());
            }
            return Err(Error::Exists(format!(
                "{}: entries are write-once",
                join(&np, newname)
            )));
        }
        if let Some(ino) = sealed {
            // Into another namespace: counted against its quota.
            let moved = if np == p { 0 } else { st.entries[&ino].size() };
            st.ns.check_quota(&np, moved)?;
            return self.0.rename_sealed(&mut st, ino, &np, newname);
        }
        let id = writing.expect("checked");
        let m = st.allocs[&id].mount().expect("a mount write");
        let (committed, reserved) = (m.committed(), m.reserved());
        if committed {
            // Its publication was reserved under the old name: reserve the new one first.
            st.ns.check_quota(&np, if np == p { 0 } else { reserved })?;
            self.0
                .reserve_renamed(&mut st, id, (&p, name), (&np, newname))?;
        }
        st.writer_moved(id, &np, newname)
    }

    fn statfs(&self) -> (u64, u64, u64) {
        let st = self.0.lock();
        let (total, free) = st.pools.iter().fold((0, 0), |(t, f), p| {
            (t + p.pool.capacity(), f + p.pool.free_space())
        });
        (total, free, st.entries.len() as u64)
    }

    /// An entry whose writer's close committed it is reported once sealed (the kernel's
    /// release follows the close asynchronously; it is waited for up to a second).
    fn xattrs(&self, ino: u64) -> Result<Vec<Xattr>> {
        let mut st = self.0.lock();
        let deadline = Instant::now() + Duration::from_secs(1);
        while st
            .allocs
            .get(&ino)
            .and_then(Alloc::mount)
            .is_some_and(|m| m.committed())
        {
            if st.wait_until(&self.0.sealed, deadline).timed_out() {
                break;
            }
        }
        let x = |name: &'static str, value: String| Xattr { name, value };
        if st.ns.is_ns(ino) {
            let n = st.ns.get(st.ns.path_of(ino)?)?;
            return Ok(vec![
                x("entries", n.entries.len().to_string()),
                x("bytes", n.bytes.to_string()),
            ]);
        }
        if let Some(a) = st.allocs.get(&ino) {
            let p = &st.pools[a.pool];
            return Ok(vec![
                x("state", "writing".into()),
                x("pool", p.name.clone()),
                x("kind", kind_name(p.kind).into()),
                x("size", a.size_now().to_string()),
                x("access", "daemon".into()),
            ]);
        }
        let e = st
            .entries
            .get(&ino)
            .ok_or_else(|| Error::NotFound(format!("inode {ino}")))?;
        let p = &st.pools[e.pool()];
        Ok(vec![
            x("state", "sealed".into()),
            x("pool", p.name.clone()),
            x("kind", kind_name(p.kind).into()),
            x("location", p.pool.location(&e.loc())),
            // Where the bytes start in `location`: a memfs entry is all of its own file, or a
            // piece of a pack.
            x(
                "offset",
                match e.place() {
                    Place::Extent(off) | Place::Packed { offset: off, .. } => off,
                    Place::File(_) => 0,
                }
                .to_string(),
            ),
            x("size", e.size().to_string()),
            x("pinned", if e.pinned() { "1" } else { "0" }.into()),
            x("holds", e.holds().to_string()),
            x("generation", e.ino().to_string()),
            x(
                "access",
                if p.pool.passes_through(&e.loc()) {
                    "passthrough"
                } else {
                    "copy"
                }
                .into(),
            ),
        ])
    }

    fn set_pinned(&self, c: &Caller, ino: u64, pinned: bool) -> Result<()> {
        let (ns, key) = {
            let st = self.0.lock();
            let e = st
                .entries
                .get(&ino)
                .ok_or_else(|| Error::NotFound(format!("inode {ino}")))?;
            (e.ns().to_owned(), e.key().to_owned())
        };
        let mut out = self.0.pin(c, &ns, &[key], pinned)?;
        out.pop().expect("one outcome")
    }

    fn settled(&self) -> Result<()> {
        super::take_sync_failure().map_or(Ok(()), Err)
    }

    fn count_upcall(&self, op: Upcall) {
        self.0.counters.count_upcall(op);
    }
}
