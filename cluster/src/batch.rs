//! Publications and removals in batches: as few etcd transactions as its operation limit
//! allows, each item with its own outcome.

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;

use crate::error::Result;
use crate::etcd::{self, Compare, Op, Range, Txn};
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
        let mut out: Vec<Option<Result<Published>>> = items.iter().map(|_| None).collect();
        self.publish_each(items, |i, r| out[i] = Some(r)).await;
        out.into_iter()
            .map(|o| o.expect("every item has its outcome"))
            .collect()
    }

    /// [`Member::publish_many`], telling `done` each item's outcome (its index in `items`)
    /// as soon as its own transaction has it: a transaction etcd answered is not held back
    /// by another of the batch that waits out its timeout (seed 2001: a publication etcd
    /// took before its host was cut off, acknowledged 2 s late, with a mount's publication
    /// sent to a member just cut off).
    pub async fn publish_each(
        &self,
        items: &[Publication<'_>],
        mut done: impl FnMut(usize, Result<Published>),
    ) {
        let mut groups: Vec<Group> = Vec::new();
        let mut names = std::collections::HashSet::new();
        // Items naming an entry named earlier in the batch: each on its own, afterwards.
        let mut again = Vec::new();
        for (i, p) in items.iter().enumerate() {
            if let Err(e) = check_ns(p.ns).and_then(|()| check_name(p.name)) {
                done(i, Err(e));
                continue;
            }
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
        let mut runs: FuturesUnordered<_> = groups
            .into_iter()
            .map(|g| async move {
                let (members, txn) = g.into_txn();
                match self.client.txn(txn).await {
                    Ok(r) if r.succeeded() => members
                        .into_iter()
                        .map(|i| {
                            let revision = r.revision();
                            (i, Ok(Published::New { revision }))
                        })
                        .collect(),
                    // Some comparison failed: each item on its own finds out which.
                    Ok(_) => {
                        let mut each = Vec::with_capacity(members.len());
                        for i in members {
                            let p = &items[i];
                            let r = self.publish_as(p.ns, p.name, p.record, p.reserved).await;
                            each.push((i, r));
                        }
                        each
                    }
                    // etcd could not be asked: every item of the transaction failed alike (its
                    // outcome unknown, as a single publication's would be).
                    Err(e) => members
                        .into_iter()
                        .map(|i| (i, Err(copy_of(&e).into())))
                        .collect::<Vec<_>>(),
                }
            })
            .collect();
        while let Some(outcomes) = runs.next().await {
            for (i, r) in outcomes {
                done(i, r);
            }
        }
        for i in again {
            let p = &items[i];
            done(i, self.publish_as(p.ns, p.name, p.record, p.reserved).await);
        }
    }

    /// Removes entries, each with its pin, in as few transactions as etcd's operation limit
    /// allows. Each removal leaves a *tombstone* in the same transaction: a key per 2 MiB
    /// unit of the removed extent, named by this host and bound to no lease, which a fresh
    /// claim of those units finds ([`Member::claim`]) until every live host acknowledged the
    /// removal ([`Member::sweep`]): a host whose view lags behind still serves the entry, and
    /// the extent must not be carved again, whoever frees it (its publisher, or anyone once
    /// the publisher's lease is gone). An item naming its entry ([`Removing::entry`]) removes
    /// that one only: a removal that reaches etcd late (its caller gave up waiting) never
    /// takes a newer entry of the name; the others are read first. When a transaction finds
    /// an entry not the one named, its items are removed one by one, and that one is reported
    /// as not there. A name given twice is removed once; the other reports it was not there.
    pub async fn remove_many(&self, items: &[Removing<'_>]) -> Vec<Result<Removed>> {
        let mut out: Vec<Option<Result<Removed>>> = Vec::with_capacity(items.len());
        let mut seen = std::collections::HashSet::new();
        let (mut todo, mut unknown, mut twice) = (Vec::new(), Vec::new(), Vec::new());
        for (i, r) in items.iter().enumerate() {
            if let Err(e) = check_ns(r.ns).and_then(|()| check_name(r.name)) {
                out.push(Some(Err(e)));
                continue;
            }
            out.push(None);
            let key = self.keys.entry(r.ns, r.name);
            if !seen.insert(key.clone()) {
                twice.push(i);
                continue;
            }
            match r.entry {
                Some(at) => todo.push(Removal::new(self, i, r, key, at)),
                None => unknown.push((i, key)),
            }
        }
        // The entries not named: read first, each removed only if it is still the one read.
        for chunk in unknown.chunks(MAX_TXN_OPS) {
            let gets = chunk.iter().map(|(_, k)| Op::get(k.clone(), Range::KEY));
            let read = self.client.txn(Txn::new().and_then(gets)).await;
            for (j, (i, key)) in chunk.iter().enumerate() {
                let found = match &read {
                    Ok(r) => r.range(j).and_then(|g| g.kvs.first()).map(|kv| {
                        decode::<EntryRecord>(kv.key.as_slice(), kv.value.as_slice())
                            .map(|rec| EntryAt::of(kv.create_revision, &rec))
                    }),
                    Err(e) => Some(Err(copy_of(e).into())),
                };
                match found {
                    Some(Ok(at)) => todo.push(Removal::new(self, *i, &items[*i], key.clone(), at)),
                    Some(Err(e)) => out[*i] = Some(Err(e)),
                    None => {
                        out[*i] = Some(Ok(Removed {
                            existed: false,
                            revision: read.as_ref().map_or(0, |r| r.revision()),
                        }))
                    }
                }
            }
        }
        // Packed into transactions; one whose tombstones alone pass the limit goes its own way.
        let (mut groups, mut big): (Vec<Vec<Removal>>, Vec<Removal>) = (Vec::new(), Vec::new());
        for t in todo {
            if t.ops() > MAX_TXN_OPS {
                big.push(t);
            } else if let Some(g) = groups
                .iter_mut()
                .find(|g| g.iter().map(Removal::ops).sum::<usize>() + t.ops() <= MAX_TXN_OPS)
            {
                g.push(t);
            } else {
                groups.push(vec![t]);
            }
        }
        let node = &self.info.node;
        let runs = groups
            .iter()
            .map(|g| async move { (g, self.client.txn(Removal::txn(g, node)).await) });
        for (group, r) in futures_util::future::join_all(runs).await {
            match r {
                Ok(r) if r.succeeded() => {
                    for t in group {
                        out[t.i] = Some(Ok(Removed {
                            existed: true,
                            revision: r.revision(),
                        }));
                    }
                }
                // An entry is not the one named: each on its own.
                Ok(_) => {
                    let each = group.iter().map(|t| async move {
                        let txn = Removal::txn(std::slice::from_ref(t), node).or_else([t.gone()]);
                        (t, self.client.txn(txn).await)
                    });
                    for (t, r) in futures_util::future::join_all(each).await {
                        out[t.i] = Some(r.map_err(Into::into).map(|r| t.removed(&r)));
                    }
                }
                Err(e) => {
                    for t in group {
                        out[t.i] = Some(Err(copy_of(&e).into()));
                    }
                }
            }
        }
        for t in &big {
            out[t.i] = Some(self.remove_big(t).await);
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

    /// A removal whose tombstones do not fit in its transaction: they go first, while the
    /// entry is still the one named (left behind by a failure, they only keep units from a
    /// fresh claim while the entry is there anyway, and are swept after its removal), then
    /// the removal, which puts one of them again: a host that learns of the removal from a
    /// read of every entry waits for the acknowledgement of its revision, the newest of its
    /// tombstones' ([`crate::Snapshot::removed_at`]), not of a tombstone put before it; so
    /// does a removal that finds the entry gone ([`Removal::removed`]). Those put are taken
    /// back when the entry was not the one named.
    async fn remove_big(&self, t: &Removal) -> Result<Removed> {
        let node = self.info.node.clone();
        let mut put: Vec<String> = Vec::new();
        let mut removal = None;
        for chunk in t.tombstones.chunks(MAX_TXN_OPS - 1) {
            let txn = Txn::new()
                .when([Compare::created(t.key.clone(), t.created)])
                .and_then(chunk.iter().map(|k| Op::put(k.clone(), node.clone(), 0)))
                .or_else([t.gone()]);
            let r = self.client.txn(txn).await?;
            if !r.succeeded() {
                removal = Some(r);
                break;
            }
            put.extend_from_slice(chunk);
        }
        let r = match removal {
            Some(r) => r,
            None => {
                let mut ops = vec![Op::delete(t.key.clone()), Op::delete(t.pin.clone())];
                ops.extend(
                    t.tombstones
                        .last()
                        .map(|k| Op::put(k.clone(), node.clone(), 0)),
                );
                let txn = Txn::new()
                    .when([Compare::created(t.key.clone(), t.created)])
                    .and_then(ops)
                    .or_else([t.gone()]);
                self.client.txn(txn).await?
            }
        };
        if !r.succeeded() {
            self.delete_keys(&put).await?;
        }
        Ok(t.removed(&r))
    }

    /// Takes away the tombstones of removals every live host has acknowledged
    /// ([`Member::acknowledge`]: each has applied the removal, and recorded a hold if its
    /// clients map the extent): this host's own, and those whose remover is gone (its lease
    /// ran out, or it left). Returns how many of this host's are left.
    pub async fn sweep(&self) -> Result<usize> {
        Ok(self.sweep_acknowledged().await?.0)
    }

    /// [`Member::sweep`]; true when every tombstone this host put at or before `revision` is
    /// gone (every live host, this one included, has acknowledged it).
    pub async fn sweep_through(&self, revision: i64) -> Result<bool> {
        let (_, least) = self.sweep_acknowledged().await?;
        Ok(least.is_none_or(|l| l >= revision))
    }

    /// [`Member::sweep`]: how many of this host's tombstones are left, and the least
    /// revision every live host acknowledged (None: no tombstone was there to sweep).
    async fn sweep_acknowledged(&self) -> Result<(usize, Option<i64>)> {
        let read = Txn::new().and_then([
            Op::get(self.keys.nodes(), Range::KEYS_UNDER),
            Op::get(self.keys.acks(), Range::PREFIX),
            Op::get(self.keys.tombstones(), Range::KEYS_UNDER),
        ]);
        let r = self.client.txn(read).await?;
        let (Some(nodes), Some(acks), Some(stones)) = (r.range(0), r.range(1), r.range(2)) else {
            return Err(bad(
                self.keys.tombstones().as_bytes(),
                "an unexpected reply".into(),
            ));
        };
        if stones.kvs.is_empty() {
            return Ok((0, None));
        }
        let live: Vec<&[u8]> = nodes
            .kvs
            .iter()
            .filter_map(|kv| kv.key.as_slice().strip_prefix(self.keys.nodes().as_bytes()))
            .collect();
        let acked = self.keys.acks_by_node(&acks.kvs);
        // Every live host's acknowledgement (one that has none yet counts as 0).
        let least = live
            .iter()
            .map(|n| acked.get(n).copied().unwrap_or(0))
            .min()
            .unwrap_or(0);
        let (mut sweep, mut left) = (Vec::new(), 0);
        for kv in &stones.kvs {
            let remover = kv.key.rsplit(|&b| b == b'/').next().unwrap_or_default();
            let mine = remover == self.info.node.as_bytes();
            if (mine || !live.contains(&remover)) && kv.mod_revision <= least {
                sweep.push((kv.key.clone(), kv.mod_revision));
            } else if mine {
                left += 1;
            }
        }
        for chunk in sweep.chunks(MAX_TXN_OPS / 2) {
            // Only the tombstone read: one written again since (a newer removal) stays.
            let txn = Txn::new()
                .when(
                    chunk
                        .iter()
                        .map(|(k, rev)| Compare::modified(k.clone(), *rev)),
                )
                .and_then(chunk.iter().map(|(k, _)| Op::delete(k.clone())));
            let r = self.client.txn(txn).await?;
            if !r.succeeded() {
                for (k, rev) in chunk {
                    let one = Txn::new()
                        .when([Compare::modified(k.clone(), *rev)])
                        .and_then([Op::delete(k.clone())]);
                    self.client.txn(one).await?;
                }
            }
        }
        Ok((left, Some(least)))
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

/// One removal of [`Member::remove_many`], as it goes to etcd.
struct Removal {
    /// Its place among the items.
    i: usize,
    key: String,
    pin: String,
    /// The entry's creation revision.
    created: i64,
    tombstones: Vec<String>,
    /// Every remover's tombstones of the extent's last unit: each removal of the entry puts
    /// its own there at the removal's revision (even one whose tombstones go ahead of it,
    /// [`Member::remove_big`]).
    last_gone: String,
}

impl Removal {
    fn new(m: &Member, i: usize, r: &Removing<'_>, key: String, at: EntryAt) -> Self {
        let last = (at.offset + at.len.max(1) - 1) / UNIT;
        Removal {
            i,
            key,
            pin: m.keys.pin(r.ns, r.name),
            created: at.created,
            tombstones: m.keys.tombstones_of(at.offset, at.len, &m.info.node),
            last_gone: m.keys.tombstones_at(last, at.offset),
        }
    }

    /// The read of the failure branch of a transaction of this removal alone: the
    /// tombstones of the extent's last unit ([`Removal::removed`]).
    fn gone(&self) -> Op {
        Op::get(self.last_gone.clone(), Range::KEYS_UNDER)
    }

    /// What a transaction of this removal alone did, its failure branch reading
    /// [`Removal::gone`]: the entry removed, at the transaction's revision; or the entry
    /// gone already, at the revision of the removal that took it, which this one joins. That
    /// is the newest tombstone of the extent put since the entry's creation (the other
    /// removal's: a removal puts tombstones only while the entry is there, and nothing is
    /// placed in the extent again before its publisher frees it), or, once every one is swept,
    /// the revision after the creation: a tombstone is swept once every live host has
    /// acknowledged its removal, and a host that joins later acknowledges its first read of
    /// the entries. Not the transaction's own revision: hosts acknowledge the revisions of
    /// the removals they apply, and in a quiet cluster none comes after it (the entry's
    /// publisher, whose removal lost to another host's, kept the extent until some later
    /// removal).
    fn removed(&self, r: &etcd::TxnResponse) -> Removed {
        if r.succeeded() {
            return Removed {
                existed: true,
                revision: r.revision(),
            };
        }
        let revision = match r.range(0) {
            Some(stones) => stones
                .kvs
                .iter()
                .map(|kv| kv.mod_revision)
                .filter(|&m| m > self.created)
                .max()
                .unwrap_or(self.created + 1),
            // Nothing read (never: every such transaction reads them): as late as can be.
            None => r.revision(),
        };
        Removed {
            existed: false,
            revision,
        }
    }

    /// Its operations in a transaction, comparisons included.
    fn ops(&self) -> usize {
        3 + self.tombstones.len()
    }

    /// The transaction removing `items` (each entry and its pin, and leaving its tombstones),
    /// if each is the one named.
    fn txn(items: &[Removal], node: &str) -> Txn {
        let when = items
            .iter()
            .map(|t| Compare::created(t.key.clone(), t.created));
        let ops = items.iter().flat_map(|t| {
            [Op::delete(t.key.clone()), Op::delete(t.pin.clone())]
                .into_iter()
                .chain(t.tombstones.iter().map(|k| Op::put(k.clone(), node, 0)))
        });
        Txn::new().when(when).and_then(ops)
    }
}
