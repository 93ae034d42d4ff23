//! The client's verbs over leased memory ([`crate::memory`]): an arena registered with the
//! client's agent, stores from leases and loads into new leases.

use super::*;
use crate::memory::{ARENA_ALIGN, Arena, Extents, Keep, Lease, Purpose, Shared};

impl RemoteClient {
    /// Maps `bytes` of host memory (rounded up to [`ARENA_ALIGN`]) and registers it with this
    /// client's agent, to lease out; stores leave `load_reserve` bytes of it free for loads.
    pub fn arena(&self, bytes: usize, load_reserve: usize) -> Result<Arena> {
        let len = bytes
            .checked_next_multiple_of(ARENA_ALIGN)
            .filter(|&n| n > 0)
            .ok_or_else(|| Error::InvalidArgument(format!("an arena of {bytes} bytes")))?;
        let map = MmapMut::map_anon(len).map_err(|source| Error::Staging { bytes: len, source })?;
        let addr = map.as_ptr() as u64;
        self.agent
            .register(Mem::Dram, &[Desc::host(addr, len as u64)])
            .map_err(nixl_err("registering a lease arena"))?;
        Ok(Arena {
            shared: Arc::new(Shared {
                map: Some(map),
                addr,
                len,
                mem: Mem::Dram,
                dev: 0,
                reserve: load_reserve.min(len),
                agent: self.agent.clone(),
                extents: Mutex::new(Extents::new(len)),
            }),
        })
    }

    /// Stores `(key, lease, len)` items: each entry is the lease's first `len` bytes, written
    /// into the pool straight from the lease (one WRITE list per chunk, as
    /// [`batch_store`](Self::batch_store)). One outcome per item, in order; an item that is
    /// empty, longer than its lease, or leased from another client's arena fails alone
    /// ([`Error::InvalidArgument`]); a failure of the pool fails the call (chunks before it
    /// may be stored). The leases stay the caller's.
    pub fn store_leased(
        &self,
        ns: &str,
        items: &[(&str, &Lease, usize)],
    ) -> Result<Vec<Result<Stored>>> {
        let mut out: Vec<Option<Result<Stored>>> = Vec::with_capacity(items.len());
        let mut valid = Vec::with_capacity(items.len());
        let mut mem = None;
        for (i, &(key, lease, len)) in items.iter().enumerate() {
            let bad = if len == 0 {
                Some(format!("{key}: an empty value is not stored remotely"))
            } else if len > lease.len {
                Some(format!(
                    "{key}: {len} bytes asked of a lease of {}",
                    lease.len
                ))
            } else if !Arc::ptr_eq(&lease.arena.agent, &self.agent) {
                Some(format!("{key}: the lease is of another client's arena"))
            } else if mem.is_some_and(|m| m != lease.arena.mem) {
                Some(format!("{key}: leases of one call are of one memory kind"))
            } else {
                None
            };
            match bad {
                Some(m) => out.push(Some(Err(Error::InvalidArgument(m)))),
                None => {
                    mem = Some(lease.arena.mem);
                    out.push(None);
                    valid.push((i, key, lease, len));
                }
            }
        }
        let keys: Vec<&str> = valid.iter().map(|v| v.1).collect();
        let mut start = 0;
        while start < valid.len() {
            let (end, part) = self.run(|inner| {
                let end = plan_keys(ns, &keys, start, max_items(inner));
                let part = self.store_leased_chunk(inner, ns, &valid[start..end])?;
                Ok((end, part))
            })?;
            for (&(i, ..), r) in valid[start..end].iter().zip(part) {
                out[i] = Some(r);
            }
            start = end;
        }
        Ok(out
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(Error::Protocol("no outcome".into()))))
            .collect())
    }

    /// Loads entries into new leases of `arena` (for loads: the whole arena), in order:
    /// `None` for a key that is missing, for an entry no free piece of the arena fits (counted
    /// in [`ArenaStats::load_refused`]), and while the pool is left alone.
    pub fn retrieve_leased(
        &self,
        ns: &str,
        keys: &[&str],
        arena: &Arena,
    ) -> Result<Vec<Option<Lease>>> {
        if !Arc::ptr_eq(&arena.shared.agent, &self.agent) {
            return Err(Error::InvalidArgument(
                "the arena is registered with another client's agent".into(),
            ));
        }
        let mut out: Vec<Option<Lease>> = Vec::with_capacity(keys.len());
        let mut start = 0;
        while start < keys.len() {
            let got = self.run(|inner| {
                let end = plan_keys(ns, keys, start, max_items(inner));
                let part = self.read_leased_chunk(inner, ns, &keys[start..end], arena)?;
                Ok((end, part))
            });
            match got {
                Ok((end, part)) => {
                    out.extend(part);
                    start = end;
                }
                Err(e) if e.is_unavailable() => break,
                Err(e) => return Err(e),
            }
        }
        out.resize_with(keys.len(), || None);
        Ok(out)
    }

    /// Stores one chunk of leased items (within the item limits).
    fn store_leased_chunk(
        &self,
        inner: &mut Inner,
        ns: &str,
        items: &[(usize, &str, &Lease, usize)],
    ) -> Result<Vec<Result<Stored>>> {
        if !inner.made.contains(ns) {
            let op = Op::Mkdir {
                ns: ns.into(),
                mode: 0o755,
            };
            match self.call(inner, op)? {
                Reply::Done => {
                    inner.made.insert(ns.to_owned());
                }
                other => return Err(unexpected("mkdir", &other)),
            }
        }
        let keys = items.iter().map(|it| it.1.to_owned()).collect();
        let present = match self.call(
            inner,
            Op::Exists {
                ns: ns.into(),
                keys,
            },
        )? {
            Reply::Exists(v) if v.len() == items.len() => v,
            Reply::Exists(v) => return Err(count_mismatch("exists", items.len(), v.len())),
            other => return Err(unexpected("exists", &other)),
        };
        let mut out: Vec<Result<Stored>> =
            items.iter().map(|_| Ok(Stored::AlreadyPresent)).collect();
        let todo: Vec<usize> = (0..items.len()).filter(|&i| !present[i]).collect();
        if todo.is_empty() {
            return Ok(out);
        }
        let sizes: Vec<u64> = todo.iter().map(|&i| items[i].3 as u64).collect();
        let pages = match self.call(
            inner,
            Op::Reserve {
                ns: ns.into(),
                sizes: sizes.clone(),
            },
        )? {
            Reply::Reserved(p) => p,
            other => return Err(unexpected("reserve", &other)),
        };
        let tickets: Vec<u64> = pages.iter().map(|p| p.ticket).collect();
        if let Err(e) = self.check_pages(inner, &pages, &sizes, usize::MAX) {
            self.give_back(inner, Op::Abandon { tickets });
            return Err(e);
        }
        let local: Vec<Desc> = todo.iter().map(|&i| items[i].2.desc(items[i].3)).collect();
        let remote: Vec<Desc> = pages
            .iter()
            .zip(&sizes)
            .map(|(p, &len)| Desc::host(p.addr, len))
            .collect();
        let mem = items[todo[0]].2.arena.mem;
        // The leases stay the caller's; their arenas are kept while the WRITE may read them.
        let mut sources: Vec<Arc<Shared>> = Vec::new();
        for &i in &todo {
            let a = &items[i].2.arena;
            if !sources.iter().any(|s| Arc::ptr_eq(s, a)) {
                sources.push(a.clone());
            }
        }
        let written = self.transfer_on(
            inner,
            maru_nixl::Op::Write,
            mem,
            &local,
            &remote,
            tickets.clone(),
            Keep::Sources(sources),
        );
        let names: Vec<(String, u64)> = todo
            .iter()
            .map(|&i| (items[i].1.to_owned(), items[i].3 as u64))
            .collect();
        self.finish_store(inner, ns, written, tickets, &todo, &pages, names, &mut out)?;
        Ok(out)
    }

    /// Loads one chunk of keys into new leases of `arena`.
    fn read_leased_chunk(
        &self,
        inner: &mut Inner,
        ns: &str,
        keys: &[&str],
        arena: &Arena,
    ) -> Result<Vec<Option<Lease>>> {
        let op = Op::Lookup {
            ns: ns.into(),
            keys: keys.iter().map(|k| (*k).to_owned()).collect(),
        };
        let pages = match self.call(inner, op)? {
            Reply::Found(v) if v.len() == keys.len() => v,
            Reply::Found(v) => return Err(count_mismatch("lookup", keys.len(), v.len())),
            other => return Err(unexpected("lookup", &other)),
        };
        let tickets: Vec<u64> = pages.iter().flatten().map(|p| p.ticket).collect();
        let read = self.read_into_leases(inner, &pages, arena);
        if !tickets.is_empty() && inner.conn.is_some() {
            // The bytes are read (or given up): the protections can end.
            self.give_back(inner, Op::Release { tickets });
        }
        read
    }

    fn read_into_leases(
        &self,
        inner: &mut Inner,
        pages: &[Option<Page>],
        arena: &Arena,
    ) -> Result<Vec<Option<Lease>>> {
        let regions = inner
            .conn
            .as_ref()
            .map(|c| c.regions.as_slice())
            .unwrap_or_default();
        if let Some(p) = pages
            .iter()
            .flatten()
            .find(|p| !registered(regions, p.addr, p.len))
        {
            return Err(Error::Protocol(format!(
                "entry {:#x}+{} lies outside marud's registered memory",
                p.addr, p.len
            )));
        }
        let mut out: Vec<Option<Lease>> = Vec::with_capacity(pages.len());
        // The leases read into, and the item each is for.
        let (mut reading, mut items) = (Vec::new(), Vec::new());
        let (mut local, mut remote) = (Vec::new(), Vec::new());
        for (i, p) in pages.iter().enumerate() {
            out.push(None);
            let Some(p) = p else { continue };
            let Ok(len) = usize::try_from(p.len) else {
                continue;
            };
            let Some(lease) = arena.lease(len, Purpose::Load) else {
                continue;
            };
            if len == 0 {
                out[i] = Some(lease);
                continue;
            }
            local.push(lease.desc(len));
            remote.push(Desc::host(p.addr, p.len));
            reading.push(lease);
            items.push(i);
        }
        if reading.is_empty() {
            return Ok(out);
        }
        self.transfer_on(
            inner,
            maru_nixl::Op::Read,
            arena.shared.mem,
            &local,
            &remote,
            Vec::new(),
            Keep::Leases(&mut reading),
        )
        .map_err(|f| f.during("reading from the pool"))?;
        for (i, lease) in items.into_iter().zip(reading) {
            out[i] = Some(lease);
        }
        Ok(out)
    }
}
