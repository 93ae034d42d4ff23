//! What readers get beside retrievals: a namespace's shared index, with, for root, the
//! directories in which its memfs entries are files; and their reports of the entries they
//! opened there themselves.

use std::fs::File;

use maru::Result;
use maru::name::split_ns;
use maru_fsd::Caller;

use super::Store;
use super::policy::Access;
use super::state::State;
use super::stats::Bytes;

/// A namespace's shared index, as given to a client.
pub struct IndexGrant {
    /// The table, read-only.
    pub table: File,
    /// Its slots.
    pub slots: u64,
    /// The memfs pools' directories of the namespace, by pool id (root callers only).
    pub dirs: Vec<(u32, File)>,
}

impl Store {
    /// A read-only descriptor of a namespace's index (it reveals the names: listing rights),
    /// and for root the directories in which its memfs entries are files.
    pub fn index_fd(&self, c: &Caller, ns: &str) -> Result<IndexGrant> {
        split_ns(ns)?;
        let st = self.st.lock();
        Self::allow(&st, c, ns, Access::List)?;
        let n = st.ns.get(ns)?;
        // The memfs pools' directories of the namespace, for a caller that may open the
        // entries' files itself: only root, for whom the kernel decides as the policy does
        // (root may read every entry). Anyone else asks marud for each entry's descriptor.
        let mut dirs = Vec::new();
        if c.uid == 0 {
            for (id, p) in st.pools.iter().enumerate() {
                match p.pool.ns_dir(ns) {
                    Ok(Some(d)) => dirs.push((id as u32, d)),
                    Ok(None) => {}
                    // The client asks for that pool's entries instead.
                    Err(e) => tracing::warn!(ns, pool = id, "opening a namespace directory: {e}"),
                }
            }
        }
        Ok(IndexGrant {
            table: n.index.ro_fd()?,
            slots: n.index.nslots() as u64,
            dirs,
        })
    }

    /// Entries a client mapped by opening their files itself (see `index_fd`): they count as
    /// retrieved and become the most recently used. Generations of entries gone are ignored.
    pub fn accessed(&self, gens: &[u64]) {
        let mut st = self.st.lock();
        let State { entries, lru, .. } = &mut *st;
        for g in gens {
            if let Some(e) = entries.get_mut(g) {
                lru.touch(&mut e.lru);
                self.counters.add_bytes(Bytes::Retrieved, e.size);
            }
        }
    }
}
