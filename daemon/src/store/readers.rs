//! What readers get: retrievals; a namespace's shared index, with the directories in which
//! its memfs entries are files; and their reports of the entries they opened there
//! themselves.

use std::fs::File;

use maru::Result;
use maru::name::split_ns;
use maru_fsd::Caller;

use super::ids::SessionId;
use super::policy::{self, Access, Perm};
use super::state::State;
use super::stats::Bytes;
use super::{Retrieved, Store};

/// A namespace's shared index, as given to a client.
pub struct IndexGrant {
    /// The table, read-only.
    pub table: File,
    /// Its slots.
    pub slots: u64,
    /// The memfs pools' directories of the namespace, by pool id: for root, and for others
    /// where the kernel applies the namespace's access to them.
    pub dirs: Vec<(u32, File)>,
    /// The memfs pools' directories of packs, by pool id: for root only.
    pub packs: Vec<(u32, File)>,
}

impl Store {
    /// Looks entries up for a session; memfs items carry the entry's file, raw items take a
    /// lease. `holds_pool_fd(pool)` says whether the session already holds the pool's
    /// read-only descriptor; the first item of a raw pool it does not hold carries it (the
    /// caller notes as held the pools of the items that carry one, once the answer is sent).
    /// All or nothing: an item whose descriptor cannot be had fails the call before any item
    /// is leased, counted or touched.
    pub fn retrieve(
        &self,
        session: SessionId,
        ns: &str,
        keys: &[String],
        holds_pool_fd: impl Fn(u32) -> bool,
    ) -> Result<Retrieved> {
        split_ns(ns)?;
        let mut st = self.lock();
        let c = st.caller(session)?;
        self.wait_imminent(&mut st, ns, keys);
        let chain = st.ns.chain(ns);
        policy::check(&c, &chain, ns, Access::Lookup)?;
        let n = st.ns.get(ns)?;
        let inos: Vec<Option<u64>> = keys.iter().map(|k| n.entries.get(k).copied()).collect();
        for ino in inos.iter().flatten() {
            policy::check(&c, &chain, ns, Access::Read(&st.entries[ino].perm()))?;
        }
        let fenced = self.authority.fenced();
        let mut stale = Vec::new();
        // The entries readied for this answer: should it fail, none is leased on its account.
        let mut readied = Vec::new();
        // First every item's descriptor, which may fail; then what the answer changes.
        let mut found: Vec<Option<(u64, Option<File>)>> = Vec::with_capacity(keys.len());
        let mut packs_sent = std::collections::HashSet::new();
        let mut pools_sent = std::collections::HashSet::new();
        let mut failed = None;
        for ino in inos {
            let Some(ino) = ino else {
                found.push(None);
                continue;
            };
            // Another host's, removed there a moment ago; or fenced off: either is a miss.
            let ready = if st.fenced_off(fenced, ino) {
                None
            } else {
                st.ready_remote(&*self.authority, ino)
            };
            let Some(lines) = ready else {
                found.push(None);
                continue;
            };
            readied.push(ino);
            stale.extend(lines);
            let e = &st.entries[&ino];
            let pool = e.pool();
            // A pack's descriptor goes once per reply; a raw pool's once per connection.
            let first = match e.place().packed() {
                Some((pack, _)) => packs_sent.insert((pool, pack)),
                None => !holds_pool_fd(pool.get()) && pools_sent.insert(pool),
            };
            match st.pools[pool].pool.retrieve_fd(&e.loc(), first) {
                Ok(f) => found.push(Some((ino, f))),
                Err(err) => {
                    failed = Some(err);
                    break;
                }
            }
        }
        let out = match failed {
            Some(err) => {
                // Marked used at the authority, and leased by no client: left so, a removal of
                // another host's entry among them would make this host hold its extent for the
                // life of its lease, with no last lease here to let go of it.
                for ino in readied {
                    st.not_leased(&*self.authority, ino);
                }
                Err(err)
            }
            None => {
                let State {
                    entries,
                    lru,
                    pools,
                    sessions,
                    ..
                } = &mut *st;
                let mut out = Vec::with_capacity(found.len());
                for item in found {
                    let Some((ino, f)) = item else {
                        out.push(None);
                        continue;
                    };
                    let e = entries.get_mut(&ino).expect("present");
                    lru.touch(e.as_mut());
                    self.counters.add_bytes(Bytes::Retrieved, e.size());
                    out.push(Some((e.located(f.is_some()), f)));
                    if pools[e.pool()].pool.leases() {
                        e.lease();
                        let s = sessions.get_mut(&session).expect("live");
                        *s.leases.entry(ino).or_insert(0) += 1;
                    }
                }
                Ok(out)
            }
        };
        drop(st);
        for lines in stale {
            self.drop_stale(Some(lines));
        }
        out
    }

    /// A read-only descriptor of a namespace's index (it reveals the names: listing rights),
    /// and the directories in which its memfs entries are files.
    pub fn index_fd(&self, c: &Caller, ns: &str) -> Result<IndexGrant> {
        split_ns(ns)?;
        let st = self.lock();
        Self::allow(&st, c, ns, Access::List)?;
        let n = st.ns.get(ns)?;
        // The memfs pools' directories of the namespace, for a caller that may open the
        // entries' files itself because the kernel decides as the policy does: root may read
        // every entry; anyone else where each directory has its namespace's access and each
        // file its entry's owner and mode (`MemfsPool::set_ns_access`). The search on the
        // namespaces above was checked here, once, as for a directory held open under /maru.
        // Other clients ask marud for each entry's descriptor.
        let mut dirs = Vec::new();
        let mut packs = Vec::new();
        for (id, p) in st.pools.iter().enumerate() {
            // Root may read every entry, so every pack (a pack's file is root's, in a
            // directory only root may search).
            if c.uid == 0 {
                match p.pool.pack_dir() {
                    Ok(Some(d)) => packs.push((id as u32, d)),
                    Ok(None) => {}
                    Err(e) => tracing::warn!(pool = id, "opening the packs' directory: {e}"),
                }
            }
            if c.uid != 0 && !p.pool.mirrors_access() {
                continue;
            }
            match p.pool.ns_dir(ns) {
                Ok(Some(d)) => dirs.push((id as u32, d)),
                Ok(None) => {}
                // The client asks for that pool's entries instead.
                Err(e) => tracing::warn!(ns, pool = id, "opening a namespace directory: {e}"),
            }
        }
        Ok(IndexGrant {
            table: n.index.ro_fd()?,
            slots: n.index.nslots() as u64,
            dirs,
            packs,
        })
    }

    /// Entries client `c` mapped by opening their files itself (see `index_fd`): they count as
    /// retrieved and become the most recently used. Generations of entries gone, or that `c`
    /// may not read, are ignored.
    pub fn accessed(&self, c: &Caller, gens: &[u64]) {
        let mut st = self.lock();
        // The permissions along the last namespace seen (a report is mostly of one).
        let mut chain: Option<(String, Vec<Perm>)> = None;
        for g in gens {
            let Some(e) = st.entries.get(g) else { continue };
            if c.uid != 0 {
                if chain.as_ref().is_none_or(|(ns, _)| *ns != e.ns()) {
                    chain = Some((e.ns().to_owned(), st.ns.chain(e.ns())));
                }
                let (ns, path) = chain.as_ref().expect("set above");
                if policy::check(c, path, ns, Access::Read(&e.perm())).is_err() {
                    continue;
                }
            }
            let State { entries, lru, .. } = &mut *st;
            let e = entries.get_mut(g).expect("looked up above");
            lru.touch(e.as_mut());
            self.counters.add_bytes(Bytes::Retrieved, e.size());
        }
    }
}
