//! Namespaces: the directory tree of entries, with owners, modes and quotas, persisted in
//! `STATE_DIR/namespaces.json` (rewritten atomically on change).

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use maru::proto::NsInfo;
use maru::{Error, Result};
use maru_fsd::backend::ROOT_INO;
use maru_fsd::{Attr, Kind};

use super::hashmap::HashMap;
use super::policy::Perm;
use crate::nsindex::NsIndex;

/// One namespace.
pub struct Namespace {
    /// Its inode.
    pub ino: u64,
    /// Owner, group and mode.
    pub perm: Perm,
    /// Sealed entries: key → inode.
    pub entries: HashMap<String, u64>,
    /// Child namespaces: name → inode.
    pub children: HashMap<String, u64>,
    /// Entries being written through the mount: name → allocation.
    pub writing: HashMap<String, u64>,
    /// The shared index clients read.
    pub index: NsIndex,
    /// Bytes of its sealed entries.
    pub bytes: u64,
    /// Bytes reserved by writers whose close passed its checks (publication on its way).
    pub reserved: u64,
    /// Bytes of clients' publications placed and not yet answered by the authority
    /// (`Store::publish_many`): they count against the quota, as sealed bytes do.
    pub asking: u64,
    /// Last change.
    pub mtime: SystemTime,
    /// Publications on their way (writers through the mount that closed their entry).
    pub pending: u64,
    /// Most bytes of sealed entries in it and the namespaces under it.
    pub quota: Option<u64>,
}

impl Namespace {
    fn new(ino: u64, perm: Perm, slots: usize) -> Result<Self> {
        Ok(Namespace {
            ino,
            perm,
            entries: HashMap::default(),
            children: HashMap::default(),
            writing: HashMap::default(),
            index: NsIndex::new(slots)?,
            bytes: 0,
            reserved: 0,
            asking: 0,
            mtime: SystemTime::now(),
            pending: 0,
            quota: None,
        })
    }

    /// Its attributes, as the mount shows them.
    pub fn attr(&self) -> Attr {
        Attr {
            ino: self.ino,
            kind: Kind::Dir,
            size: (self.entries.len() + self.children.len()) as u64,
            mode: self.perm.mode,
            uid: self.perm.uid,
            gid: self.perm.gid,
            mtime: self.mtime,
            sealed: false,
        }
    }

    /// Adds `delta` to its publications on their way (and tells its index).
    pub fn adjust_pending(&mut self, delta: i64) {
        self.pending = self.pending.saturating_add_signed(delta);
        self.index.set_pending(self.pending);
    }

    /// Whether it holds nothing (nor any publication on its way).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
            && self.children.is_empty()
            && self.writing.is_empty()
            && self.reserved == 0
            && self.asking == 0
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
struct NsRecord {
    ns: String,
    uid: u32,
    gid: u32,
    mode: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    quota: Option<u64>,
}

/// The parent path and last name of namespace `ns` (the root is `""`).
pub fn parent(ns: &str) -> (&str, &str) {
    match ns.rsplit_once('/') {
        Some((p, n)) => (p, n),
        None => ("", ns),
    }
}

/// `ns/name`.
pub fn join(ns: &str, name: &str) -> String {
    if ns.is_empty() {
        name.to_owned()
    } else {
        format!("{ns}/{name}")
    }
}

/// Every namespace, by path and by inode.
pub struct Namespaces {
    map: HashMap<String, Namespace>,
    by_ino: HashMap<u64, String>,
    file: PathBuf,
    /// The fence every index carries (`maru::index::Table::fence`; 0 on a single host).
    fence: u64,
}

impl Namespaces {
    /// The root alone; `file` is where the tree is saved.
    pub fn new(file: PathBuf) -> Result<Self> {
        let root = Namespace::new(
            ROOT_INO,
            Perm {
                uid: 0,
                gid: 0,
                mode: 0o1777,
            },
            16,
        )?;
        Ok(Namespaces {
            map: HashMap::from_iter([(String::new(), root)]),
            by_ino: HashMap::from_iter([(ROOT_INO, String::new())]),
            file,
            fence: 0,
        })
    }

    /// The namespace `ns`.
    pub fn get(&self, ns: &str) -> Result<&Namespace> {
        self.map
            .get(ns)
            .ok_or_else(|| Error::NotFound(format!("namespace `{ns}`")))
    }

    /// The namespace `ns`, to change.
    pub fn get_mut(&mut self, ns: &str) -> Result<&mut Namespace> {
        self.map
            .get_mut(ns)
            .ok_or_else(|| Error::NotFound(format!("namespace `{ns}`")))
    }

    /// Whether `ns` exists.
    pub fn contains(&self, ns: &str) -> bool {
        self.map.contains_key(ns)
    }

    /// The path of the namespace with inode `ino`.
    pub fn path_of(&self, ino: u64) -> Result<&str> {
        self.by_ino
            .get(&ino)
            .map(String::as_str)
            .ok_or_else(|| Error::NotFound(format!("inode {ino}")))
    }

    /// Whether `ino` is a namespace.
    pub fn is_ns(&self, ino: u64) -> bool {
        self.by_ino.contains_key(&ino)
    }

    /// The permissions along `ns`'s path, from the root's child down to `ns` itself (empty
    /// for the root): what the access policy walks.
    pub fn chain(&self, ns: &str) -> Vec<Perm> {
        let mut out = Vec::new();
        if ns.is_empty() {
            return out;
        }
        let mut at = 0;
        loop {
            let end = ns[at..].find('/').map_or(ns.len(), |i| at + i);
            if let Some(n) = self.map.get(&ns[..end]) {
                out.push(n.perm);
            }
            if end == ns.len() {
                return out;
            }
            at = end + 1;
        }
    }

    /// Sets the fence of every namespace's index, and of those made from now on: until when
    /// clients may trust the indexes without asking marud.
    pub fn set_fence(&mut self, until: u64) {
        self.fence = until;
        for n in self.map.values() {
            n.index.set_fence(until);
        }
    }

    /// Adds namespace `ns` (its parent must exist) with inode `ino`.
    pub fn insert(&mut self, ns: &str, ino: u64, perm: Perm) -> Result<()> {
        let (p, name) = parent(ns);
        if !self.map.contains_key(p) {
            return Err(Error::NotFound(format!("namespace `{p}`")));
        }
        let n = Namespace::new(
            ino,
            Perm {
                mode: perm.mode & 0o7777,
                ..perm
            },
            0,
        )?;
        n.index.set_fence(self.fence);
        self.map.insert(ns.to_owned(), n);
        self.by_ino.insert(ino, ns.to_owned());
        let p = self.map.get_mut(p).expect("checked");
        p.children.insert(name.to_owned(), ino);
        p.mtime = SystemTime::now();
        Ok(())
    }

    /// Adds every missing namespace along `ns` (root's, mode 0755), taking inodes from `ino`.
    pub fn ensure_path(&mut self, ns: &str, mut ino: impl FnMut() -> u64) -> Result<()> {
        let mut cur = String::new();
        for part in ns.split('/') {
            cur = join(&cur, part);
            if !self.map.contains_key(&cur) {
                let perm = Perm {
                    uid: 0,
                    gid: 0,
                    mode: 0o755,
                };
                self.insert(&cur, ino(), perm)?;
            }
        }
        Ok(())
    }

    /// Removes the (empty) namespace `ns`.
    pub fn remove(&mut self, ns: &str) {
        if let Some(n) = self.map.remove(ns) {
            // Clients that mapped its index must not take it for the index of a namespace
            // made again under the same name: retired, it sends them for the current one.
            n.index.retire();
            self.by_ino.remove(&n.ino);
            let (p, name) = parent(ns);
            if let Some(p) = self.map.get_mut(p) {
                p.children.remove(name);
                p.mtime = SystemTime::now();
            }
        }
    }

    /// Every namespace but the root.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &Namespace)> {
        self.map.iter().filter(|(k, _)| !k.is_empty())
    }

    /// Number of namespaces, the root excluded.
    pub fn len(&self) -> usize {
        self.map.len() - 1
    }

    /// Bytes of sealed entries (and reserved ones, and those asked for) in `ns` and the
    /// namespaces under it.
    fn subtree_bytes(&self, ns: &str) -> u64 {
        let prefix = format!("{ns}/");
        self.map
            .iter()
            .filter(|(k, _)| *k == ns || k.starts_with(&prefix))
            .map(|(_, n)| n.bytes + n.reserved + n.asking)
            .sum()
    }

    /// Fails with [`Error::Quota`] if `add` more bytes in `ns` would exceed the quota of `ns`
    /// or of a namespace above it.
    pub fn check_quota(&self, ns: &str, add: u64) -> Result<()> {
        let mut at = Some(ns);
        while let Some(a) = at {
            if let Some(q) = self.map.get(a).and_then(|n| n.quota) {
                let used = self.subtree_bytes(a);
                if used.saturating_add(add) > q {
                    return Err(Error::Quota(format!(
                        "`{a}` holds {} of its {} quota; {} more do not fit",
                        maru::size::format_size(used),
                        maru::size::format_size(q),
                        maru::size::format_size(add)
                    )));
                }
            }
            at = a.rfind('/').map(|i| &a[..i]);
        }
        Ok(())
    }

    /// A namespace's description for `list` and `stats`.
    pub fn info(&self, ns: &str) -> Option<NsInfo> {
        let n = self.map.get(ns)?;
        Some(NsInfo {
            ns: ns.to_owned(),
            uid: n.perm.uid,
            gid: n.perm.gid,
            mode: n.perm.mode,
            entries: n.entries.len() as u64,
            bytes: n.bytes,
            quota: n.quota,
        })
    }

    /// Loads the saved tree (owners, modes, quotas), parents first; a namespace whose name
    /// is not valid is skipped, an unreadable file is ignored (with a warning).
    pub fn load(&mut self, mut ino: impl FnMut() -> u64) -> Result<()> {
        let mut records: Vec<NsRecord> = match std::fs::read(&self.file) {
            Ok(b) => serde_json::from_slice(&b).unwrap_or_else(|e| {
                tracing::warn!("ignoring unreadable {}: {e}", self.file.display());
                Vec::new()
            }),
            Err(_) => Vec::new(),
        };
        records.sort_by_key(|r| r.ns.matches('/').count());
        for r in records {
            if maru::name::split_ns(&r.ns).is_err() || self.map.contains_key(&r.ns) {
                continue;
            }
            let perm = Perm {
                uid: r.uid,
                gid: r.gid,
                mode: r.mode,
            };
            if self.insert(&r.ns, ino(), perm).is_ok()
                && let Some(n) = self.map.get_mut(&r.ns)
            {
                n.quota = r.quota;
            }
        }
        Ok(())
    }

    /// Saves the tree (atomically: a temporary file renamed over the old one).
    pub fn save(&self) {
        let mut recs: Vec<NsRecord> = self
            .iter()
            .map(|(k, n)| NsRecord {
                ns: k.clone(),
                uid: n.perm.uid,
                gid: n.perm.gid,
                mode: n.perm.mode,
                quota: n.quota,
            })
            .collect();
        recs.sort_by(|a, b| a.ns.cmp(&b.ns));
        if let Err(e) = write_atomically(&self.file, &recs) {
            tracing::error!("saving namespaces: {e}");
        }
    }
}

fn write_atomically(path: &Path, recs: &[NsRecord]) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(recs)?)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn perm(uid: u32, mode: u32) -> Perm {
        Perm {
            uid,
            gid: uid,
            mode,
        }
    }

    #[test]
    fn tree_chain_and_persistence() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("namespaces.json");
        let mut t = Namespaces::new(file.clone()).unwrap();
        let mut next = 10;
        let mut ino = || {
            next += 1;
            next
        };
        t.insert("a", ino(), perm(5, 0o750)).unwrap();
        t.insert("a/b", ino(), perm(6, 0o1777)).unwrap();
        assert!(t.insert("x/y", ino(), perm(6, 0o755)).is_err());
        assert_eq!(t.chain("a/b"), vec![perm(5, 0o750), perm(6, 0o1777)]);
        assert!(t.chain("").is_empty());
        t.get_mut("a").unwrap().quota = Some(100);
        t.save();
        let mut u = Namespaces::new(file).unwrap();
        u.load(|| 99).unwrap_or(());
        // Inodes are given anew; owners, modes and quotas come back.
        assert_eq!(u.get("a/b").unwrap().perm, perm(6, 0o1777));
        assert_eq!(u.get("a").unwrap().quota, Some(100));
        assert_eq!(u.len(), 2);
    }

    #[test]
    fn quotas_count_the_subtree_and_reservations() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = Namespaces::new(dir.path().join("n.json")).unwrap();
        t.insert("a", 2, perm(0, 0o755)).unwrap();
        t.insert("a/b", 3, perm(0, 0o755)).unwrap();
        t.get_mut("a").unwrap().quota = Some(100);
        t.get_mut("a/b").unwrap().bytes = 60;
        t.check_quota("a/b", 40).unwrap();
        t.get_mut("a").unwrap().reserved = 1;
        assert!(matches!(t.check_quota("a/b", 40), Err(Error::Quota(_))));
        t.remove("a/b");
        assert!(!t.contains("a/b"));
        assert!(t.get("a").unwrap().children.is_empty());
    }
}
