//! Publications and removals in batches: as few etcd transactions as its operation limit
//! allows, each item with its own outcome.

use crate::error::Result;
use crate::etcd::{self, Compare, Op, Txn};
use crate::keys::*;
use crate::member::Member;
use crate::records::*;

impl Member {
    /// Publishes several entries, each as [`Member::publish`] (or, for those marked reserved,
    /// [`Member::publish_reserved`]) would, in as few transactions as etcd's operation limit
    /// allows: in the common case, where every name is free, a batch of 64 small entries
    /// takes two round trips, not 64. Each item keeps its own outcome: a transaction whose
    /// comparisons fail (a name taken, a reservation elsewhere, a region lost) is retried
    /// item by item, so one taken name fails alone. An item naming an entry an earlier item
    /// of the batch names goes after the others, on its own (it finds the name taken, unless
    /// the earlier one failed).
    pub async fn publish_many(&self, items: &[Publication<'_>]) -> Vec<Result<Published>> {
        let mut out: Vec<Option<Result<Published>>> = Vec::with_capacity(items.len());
        let mut groups: Vec<Group> = Vec::new();
        let mut names = std::collections::HashSet::new();
        // Items naming an entry named earlier in the batch: each on its own, afterwards.
        let mut again = Vec::new();
        for (i, p) in items.iter().enumerate() {
            if let Err(e) = check_ns(p.ns).and_then(|()| check_name(p.name)) {
                out.push(Some(Err(e)));
                continue;
            }
            out.push(None);
            let key = self.keys.entry(p.ns, p.name);
            if !names.insert(key.clone()) {
                again.push(i);
                continue;
            }
            let g = match groups.iter_mut().position(|g| g.fits(p)) {
                Some(g) => &mut groups[g],
                None => {
                    groups.push(Group::new(self.publish_cmp().0));
                    groups.last_mut().expect("pushed")
                }
            };
            g.add(i, key, p, self);
        }
        let runs = groups.into_iter().map(|g| async move {
            let (members, txn) = g.into_txn();
            let r = self.client.txn(txn).await;
            (members, r)
        });
        for (members, r) in futures_util::future::join_all(runs).await {
            match r {
                Ok(r) if r.succeeded() => {
                    for i in members {
                        out[i] = Some(Ok(Published::New {
                            revision: r.revision(),
                        }));
                    }
                }
                // Some comparison failed: each item on its own finds out which.
                Ok(_) => {
                    for i in members {
                        let p = &items[i];
                        out[i] = Some(self.publish_as(p.ns, p.name, p.record, p.reserved).await);
                    }
                }
                // etcd could not be asked: every item of the transaction failed alike (its
                // outcome unknown, as a single publication's would be).
                Err(e) => {
                    for i in members {
                        out[i] = Some(Err(copy_of(&e).into()));
                    }
                }
            }
        }
        for i in again {
            let p = &items[i];
            out[i] = Some(self.publish_as(p.ns, p.name, p.record, p.reserved).await);
        }
        out.into_iter()
            .map(|o| o.expect("every item has its outcome"))
            .collect()
    }

    /// Removes entries, each with its pin, as [`Member::remove`] would, in as few
    /// transactions as etcd's operation limit allows. An item naming a creation revision
    /// (not 0) removes the entry only if it is that one: a removal that reaches etcd late
    /// (its caller gave up waiting) never takes a newer entry of the name; when a
    /// transaction finds one that is not, its items are removed one by one, and that one is
    /// reported as not there. A name given twice is removed once; the other reports it was
    /// not there.
    pub async fn remove_many(&self, names: &[(&str, &str, i64)]) -> Vec<Result<Removed>> {
        let mut out: Vec<Option<Result<Removed>>> = Vec::with_capacity(names.len());
        let mut seen = std::collections::HashSet::new();
        let mut todo: Vec<Removal> = Vec::new();
        let mut twice = Vec::new();
        for (i, &(ns, name, created)) in names.iter().enumerate() {
            if let Err(e) = check_ns(ns).and_then(|()| check_name(name)) {
                out.push(Some(Err(e)));
                continue;
            }
            out.push(None);
            let key = self.keys.entry(ns, name);
            if seen.insert(key.clone()) {
                todo.push(Removal {
                    i,
                    pin: self.keys.pin(ns, name),
                    key,
                    created,
                });
            } else {
                twice.push(i);
            }
        }
        let runs = todo
            .chunks(REMOVALS_PER_TXN)
            .map(|chunk| async move { (chunk, self.client.txn(Removal::txn(chunk)).await) });
        for (chunk, r) in futures_util::future::join_all(runs).await {
            match r {
                Ok(r) if r.succeeded() => {
                    for (j, t) in chunk.iter().enumerate() {
                        out[t.i] = Some(Ok(Removed {
                            existed: r.deleted(2 * j).is_some_and(|n| n > 0),
                            revision: r.revision(),
                        }));
                    }
                }
                // An entry is not the one named: each on its own.
                Ok(_) => {
                    let each = chunk.iter().map(|t| async move {
                        let r = self.client.txn(Removal::txn(std::slice::from_ref(t))).await;
                        (t.i, r)
                    });
                    for (i, r) in futures_util::future::join_all(each).await {
                        out[i] = Some(r.map_err(Into::into).map(|r| Removed {
                            existed: r.succeeded() && r.deleted(0).is_some_and(|n| n > 0),
                            revision: r.revision(),
                        }));
                    }
                }
                Err(e) => {
                    for t in chunk {
                        out[t.i] = Some(Err(copy_of(&e).into()));
                    }
                }
            }
        }
        for i in twice {
            let revision = out
                .iter()
                .flatten()
                .find_map(|r| r.as_ref().ok().map(|r| r.revision))
                .unwrap_or(0);
            out[i] = Some(Ok(Removed {
                existed: false,
                revision,
            }));
        }
        out.into_iter()
            .map(|o| o.expect("every name has its outcome"))
            .collect()
    }
}

/// One entry of [`Member::publish_many`].
#[derive(Debug, Clone, Copy)]
pub struct Publication<'a> {
    pub ns: &'a str,
    pub name: &'a str,
    pub record: &'a EntryRecord,
    /// This host reserved the name ([`Member::reserve`]): the reservation goes with it.
    pub reserved: bool,
}

/// An error of a transaction, for each of its items (a status is copied as it is; the rest
/// are said in a status of their own).
fn copy_of(e: &etcd::Error) -> etcd::Error {
    match e {
        etcd::Error::Status(s) => etcd::Error::Status(s.clone()),
        other => etcd::Error::Status(tonic::Status::unavailable(other.to_string())),
    }
}

/// Removals per transaction: two deletions each (the entry and its pin), within
/// [`MAX_TXN_OPS`].
const REMOVALS_PER_TXN: usize = 63;

/// The operations etcd takes in one transaction (`--max-txn-ops`, 128 by default), counted
/// as [`Txn::ops`] counts them.
const MAX_TXN_OPS: usize = 128;

/// One transaction of [`Member::publish_many`]: its items (their indexes), comparisons
/// (this host alive, each name free, each reservation as expected, each unit held, the
/// units once) and puts.
struct Group {
    members: Vec<usize>,
    units: std::collections::HashSet<u64>,
    when: Vec<Compare>,
    then: Vec<Op>,
}

impl Group {
    fn new(alive: Compare) -> Self {
        Group {
            members: Vec::new(),
            units: Default::default(),
            when: vec![alive],
            then: Vec::new(),
        }
    }

    /// Whether `p` can join without passing etcd's limit.
    fn fits(&self, p: &Publication<'_>) -> bool {
        let units = held_units(p.record.offset, p.record.len);
        let new_units = units.iter().filter(|u| !self.units.contains(u)).count();
        let ops = 2 + new_units + if p.reserved { 2 } else { 1 };
        self.when.len() + self.then.len() + ops <= MAX_TXN_OPS
    }

    fn add(&mut self, i: usize, key: String, p: &Publication<'_>, m: &Member) {
        let rkey = m.keys.reservation(p.ns, p.name);
        let value = serde_json::to_vec(p.record).expect("serializable");
        self.when.push(Compare::absent(key.clone()));
        if p.reserved {
            self.when
                .push(Compare::value_is(rkey.clone(), m.info.node.clone()));
            self.then.push(Op::delete(rkey));
        } else {
            self.when.push(Compare::absent(rkey));
        }
        for u in held_units(p.record.offset, p.record.len) {
            if self.units.insert(u) {
                self.when
                    .push(Compare::value_is(m.keys.region(u), m.info.node.clone()));
            }
        }
        self.then.push(Op::put(key, value, 0));
        self.members.push(i);
    }

    fn into_txn(self) -> (Vec<usize>, Txn) {
        let txn = Txn::new().when(self.when).and_then(self.then);
        (self.members, txn)
    }
}

/// One removal of [`Member::remove_many`].
struct Removal {
    /// Its place among the names.
    i: usize,
    key: String,
    pin: String,
    /// The entry's creation revision, 0 for whichever is there.
    created: i64,
}

impl Removal {
    /// The transaction removing `items` (each entry and its pin), if each is the one named.
    fn txn(items: &[Removal]) -> Txn {
        let when = items
            .iter()
            .filter(|t| t.created != 0)
            .map(|t| Compare::created(t.key.clone(), t.created));
        let ops = items
            .iter()
            .flat_map(|t| [Op::delete(t.key.clone()), Op::delete(t.pin.clone())]);
        Txn::new().when(when).and_then(ops)
    }
}
