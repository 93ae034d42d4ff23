//! Allocations: spare grants taken in batches, and the writable mapping of a grant.

use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Weak};

use crate::error::{Error, Result};
use crate::format::ENTRY_ALIGN;
use crate::proto::{Body, Grant, MAX_FDS_PER_FRAME, Op, PoolKind};

use super::state::{Inner, PackMap, Pending, Spare, unexpected};
use super::{AllocHandle, Writable, page_size};

impl Inner {
    /// How many allocations of `size` one request asks for.
    pub(super) fn batch_count(&mut self, size: u64) -> u32 {
        // Batch only sizes that repeat (KV chunks of one model do), within a byte budget.
        if self.sizes_seen.len() > 4096 {
            self.sizes_seen.clear();
        }
        let seen = self.sizes_seen.entry(size).or_insert(0);
        *seen = seen.saturating_add(1);
        let repeats = *seen >= 2;
        // The byte budget covers every spare this handler holds, of all sizes.
        let held: u64 = self.spares.iter().map(|(sz, v)| sz * v.len() as u64).sum();
        let budget = self.cfg.batch_alloc_bytes.saturating_sub(held);
        if repeats && size <= self.cfg.batch_alloc_max && budget / size >= 2 {
            let by_bytes = (budget / size).max(1) as u32;
            self.cfg
                .batch_alloc_count
                .min(by_bytes)
                .clamp(1, MAX_FDS_PER_FRAME as u32)
        } else {
            1
        }
    }

    pub(super) fn alloc(&mut self, size: u64) -> Result<AllocHandle> {
        if size == 0 {
            return Err(Error::InvalidArgument("allocation of 0 bytes".into()));
        }
        // A refill requested earlier may be on its way: take it rather than asking again.
        while self.spares.get(&size).is_none_or(VecDeque::is_empty)
            && self.refilling.contains(&size)
        {
            self.recv_one()?;
        }
        if let Some(s) = self.take_spare(size)? {
            let left = self.spares.get(&size).map_or(0, VecDeque::len);
            let batch = self.cfg.batch_alloc_count as usize;
            if left < batch / 2 && !self.refilling.contains(&size) && batch > 1 {
                // Ask for the next batch now; the daemon creates it while we keep storing.
                let count = self.batch_count(size);
                if count > 1 {
                    let op = Op::Alloc {
                        size,
                        count,
                        pool: self.cfg.pool.clone(),
                        ns: self.cfg.namespace.clone(),
                    };
                    let id = self.send(op, &[])?;
                    self.pending.insert(id, Pending::Alloc(size));
                    self.refilling.insert(size);
                }
            }
            return self.map_grant(s);
        }
        let count = self.batch_count(size);
        let op = Op::Alloc {
            size,
            count,
            pool: self.cfg.pool.clone(),
            ns: self.cfg.namespace.clone(),
        };
        let (body, fds) = match self.call(op.clone()) {
            // Spares of other sizes hold pool memory: give them back and try once more.
            Err(Error::NoSpace(_)) if self.spares.values().any(|v| !v.is_empty()) => {
                self.free_spares()?;
                self.call(op)?
            }
            r => r?,
        };
        let grants = match body {
            Body::Allocated { grants } => grants,
            other => return Err(unexpected(&other)),
        };
        // The first granted is used now, the others kept in their order.
        let mut spares = VecDeque::from(self.spares_from(grants, fds)?);
        let first = spares
            .pop_front()
            .ok_or_else(|| Error::Protocol("empty grant".into()))?;
        self.spares.entry(size).or_default().extend(spares);
        self.map_grant(first)
    }

    /// `count` allocations of `size` bytes: spares of that size first, the rest asked for
    /// together (one exchange per [`MAX_FDS_PER_FRAME`] allocations). All or none: on an error
    /// the allocations already obtained are given back.
    pub(super) fn alloc_many(&mut self, size: u64, count: usize) -> Result<Vec<AllocHandle>> {
        if size == 0 {
            return Err(Error::InvalidArgument("allocation of 0 bytes".into()));
        }
        let mut out = Vec::with_capacity(count);
        if let Err(e) = self.alloc_many_into(size, count, &mut out) {
            let ids: Vec<u64> = out.iter().map(|h| h.grant.alloc).collect();
            drop(out); // unmapped before marud frees them
            if !ids.is_empty() {
                // The connection may be what failed: marud frees them with it then.
                let _ = self.call(Op::Free { allocs: ids });
            }
            return Err(e);
        }
        Ok(out)
    }

    fn alloc_many_into(
        &mut self,
        size: u64,
        count: usize,
        out: &mut Vec<AllocHandle>,
    ) -> Result<()> {
        while self.spares.get(&size).is_none_or(VecDeque::is_empty)
            && self.refilling.contains(&size)
        {
            self.recv_one()?;
        }
        while out.len() < count {
            if let Some(s) = self.take_spare(size)? {
                let h = self.map_grant(s)?;
                out.push(h);
                continue;
            }
            let n = (count - out.len()).min(MAX_FDS_PER_FRAME);
            let op = Op::Alloc {
                size,
                count: n as u32,
                pool: self.cfg.pool.clone(),
                ns: self.cfg.namespace.clone(),
            };
            let (body, fds) = match self.call(op.clone()) {
                // Spares of other sizes hold pool memory: give them back and try once more.
                Err(Error::NoSpace(_)) if self.spares.values().any(|v| !v.is_empty()) => {
                    self.free_spares()?;
                    self.call(op)?
                }
                r => r?,
            };
            let grants = match body {
                Body::Allocated { grants } => grants,
                other => return Err(unexpected(&other)),
            };
            if grants.is_empty() {
                return Err(Error::Protocol("empty grant".into()));
            }
            for s in self.spares_from(grants, fds)? {
                let h = self.map_grant(s)?;
                out.push(h);
            }
        }
        Ok(())
    }

    /// The oldest spare allocation of `size` bytes that may still be written into; those
    /// whose `until` passed (cluster mode: see [`Grant::until`]) are given back on the way.
    /// Oldest first: a pack's allocations are then published in the order they were carved,
    /// and the spares kept never hold back a pack filled long ago (its memory comes back only
    /// once nothing lives in it: eviction passes over the entries of a pack with a spare).
    fn take_spare(&mut self, size: u64) -> Result<Option<Spare>> {
        let mut expired = Vec::new();
        let mut found = None;
        while let Some(s) = self.spares.get_mut(&size).and_then(VecDeque::pop_front) {
            if past(&s.grant) {
                expired.push(s.grant.alloc);
            } else {
                found = Some(s);
                break;
            }
        }
        if !expired.is_empty() {
            self.call(Op::Free { allocs: expired })?;
        }
        Ok(found)
    }

    /// Gives every spare allocation back to the daemon.
    pub(super) fn free_spares(&mut self) -> Result<()> {
        let ids: Vec<u64> = self
            .spares
            .drain()
            .flat_map(|(_, v)| v.into_iter().map(|s| s.grant.alloc))
            .collect();
        if !ids.is_empty() {
            self.call(Op::Free { allocs: ids })?;
        }
        Ok(())
    }

    pub(super) fn spares_from(
        &mut self,
        grants: Vec<Grant>,
        fds: Vec<OwnedFd>,
    ) -> Result<Vec<Spare>> {
        let mut fds = fds.into_iter();
        let mut spares = Vec::with_capacity(grants.len());
        // A memfs grant in the same pack as the one before it in the reply comes without a
        // descriptor: it is that pack.
        let mut last: Option<Arc<File>> = None;
        // Where pages are no larger than the allocations' alignment, a pack's allocations
        // have pages of their own in it.
        let own_pages = ENTRY_ALIGN.is_multiple_of(page_size() as u64);
        for g in grants {
            let fd = if g.fd {
                Some(
                    fds.next()
                        .ok_or_else(|| Error::Protocol("missing descriptor".into()))?,
                )
            } else {
                None
            };
            let (file, pack) = match self.pool_kind(g.pool)? {
                PoolKind::Memfs => {
                    let f = match fd {
                        Some(fd) => Arc::new(File::from(fd)),
                        None => last
                            .clone()
                            .ok_or_else(|| Error::Protocol("memfs grant without a file".into()))?,
                    };
                    last = Some(f.clone());
                    // A grant is a slice of its pack's mapping where its pages are its own (else
                    // it gets a mapping of its own).
                    let pack = match g.pack {
                        Some(id) if own_pages => Some(self.pack_map(g.pool, id, &f)?),
                        _ => None,
                    };
                    (Some(f), pack)
                }
                _ => {
                    if let Some(fd) = fd {
                        self.pool_rw.insert(g.pool, Arc::new(File::from(fd)));
                    }
                    (None, None)
                }
            };
            spares.push(Spare {
                grant: g,
                file,
                pack,
            });
        }
        Ok(spares)
    }

    /// The writable mapping of `pool`'s pack `id`, open as `file`: the one already made while
    /// something uses it, else a new one.
    fn pack_map(&mut self, pool: u32, id: u32, file: &Arc<File>) -> Result<Arc<PackMap>> {
        if let Some(m) = self.pack_maps.get(&(pool, id)).and_then(Weak::upgrade) {
            return Ok(m);
        }
        let m = Arc::new(PackMap::of(file.clone())?);
        // Packs whose grants are all gone are unmapped by then: forget them.
        self.pack_maps.retain(|_, w| w.strong_count() > 0);
        self.pack_maps.insert((pool, id), Arc::downgrade(&m));
        Ok(m)
    }

    pub(super) fn map_grant(&mut self, s: Spare) -> Result<AllocHandle> {
        if past(&s.grant) {
            // Granted just before marud's host was cut off from its cluster (or marud
            // stopped): writing into it now could land on what another host carved since.
            self.call(Op::Free {
                allocs: vec![s.grant.alloc],
            })?;
            return Err(Error::Busy(
                "the allocation's time to be written passed before it was mapped: marud's host \
                 may be cut off from its cluster; try again"
                    .into(),
            ));
        }
        if let Some(p) = s.pack {
            let at = s.grant.offset;
            return Ok(AllocHandle {
                grant: s.grant,
                file: p.file.clone(),
                map: Some(Writable::Pack(p)),
                start: at as usize,
                base: at,
                done: false,
            });
        }
        let size = s.grant.size as usize;
        // The grant's own file or pack (memfs), else the raw pool's descriptor.
        let f = match s.file {
            Some(f) => f,
            None => self
                .pool_rw
                .get(&s.grant.pool)
                .ok_or_else(|| Error::Protocol("no descriptor for the pool".into()))?
                .clone(),
        };
        let page = page_size() as u64;
        let base = s.grant.offset / page * page;
        let start = (s.grant.offset - base) as usize;
        // SAFETY: the range was granted to this client alone (a WRITING file, or a piece of a
        // pack or of a raw pool) until it publishes or frees it.
        let map = unsafe {
            memmap2::MmapOptions::new()
                .offset(base)
                .len(start + size)
                .map_mut(&*f)?
        };
        let file = f;
        Ok(AllocHandle {
            grant: s.grant,
            map: Some(Writable::Own(map)),
            start,
            file,
            base,
            done: false,
        })
    }
}

/// Whether `g`'s time to begin writing has passed ([`Grant::until`]).
fn past(g: &Grant) -> bool {
    g.until
        .is_some_and(|until| crate::index::boottime_ns() >= until)
}
