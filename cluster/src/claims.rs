//! This host's claims of the pool's regions in etcd: made, made again after a rejoin,
//! given back (each 2 MiB unit a key holding its holder's name), and listed.

use std::collections::BTreeMap;

use crate::error::Result;
use crate::etcd::{Compare, Op, Range, Txn};
use crate::keys::*;
use crate::lease::{boottime_ns, valid_until};
use crate::member::Member;

impl Member {
    /// Claims `[offset, offset + len)` of the pool for this host to carve afresh, every 2 MiB
    /// unit of it ([`UNIT`]; both must be multiples), all or nothing; false if another host
    /// holds any unit of it, any host still maps an extent there (a removed entry another
    /// host has not let go of), or a removal there is not yet acknowledged by every live host
    /// (its tombstone: [`Member::remove_many`], [`Member::sweep`]): nothing is claimed then.
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`] when this host's lease is gone; [`Error::Misaligned`] for a
    /// range that is not whole units.
    ///
    /// Claimed, the revision of the (last) claim: the entries another host published in
    /// the range before it lost its claim all precede it. The claim also writes this
    /// host's tick ([`EntryEvent::Tick`]), so the caller can wait for its entry watch to
    /// have carried everything up to it before it carves the range.
    pub async fn claim(&self, offset: u64, len: u64) -> Result<Option<i64>> {
        self.claim_range(offset, len, true).await
    }

    /// Claims again units that hold this host's own entries (after a restart, or a rejoin):
    /// as [`Member::claim`], but other hosts' mappings of those entries do not stand in the way.
    pub async fn claim_again(&self, offset: u64, len: u64) -> Result<bool> {
        Ok(self.claim_range(offset, len, false).await?.is_some())
    }

    async fn claim_range(&self, offset: u64, len: u64, fresh: bool) -> Result<Option<i64>> {
        let units = units(offset, len)?;
        let mut done = 0;
        let mut revision = 0;
        for piece in units.chunks(UNITS_PER_TXN) {
            let Some(r) = self.claim_units(piece, fresh).await? else {
                // Another host holds a unit: give back what this call took, claim nothing.
                self.release_units(&units[..done]).await?;
                return Ok(None);
            };
            revision = r;
            done += piece.len();
        }
        Ok(Some(revision))
    }

    async fn claim_units(&self, units: &[u64], fresh: bool) -> Result<Option<i64>> {
        // As a publication: a claim whose answer was lost cannot land after a fence
        // (`fence_publications`), so a claim given back after it cannot come back.
        let (current, epoch) = self.publish_cmp();
        let mut when = vec![current];
        if let (true, Some(first), Some(last)) = (fresh, units.first(), units.last()) {
            // No key in the range: etcd compares a range's absent keys as created at 0. No
            // host maps a removed extent there, and every live host has applied the removals
            // of what was there (a host whose view lags would still serve it, and would not
            // have recorded its mapping yet).
            when.push(Compare::none_in(
                self.keys.maps_from(*first),
                self.keys.maps_from(last + 1),
            ));
            when.push(Compare::none_in(
                self.keys.tombstones_from(*first),
                self.keys.tombstones_from(last + 1),
            ));
        }
        let mut then = Vec::with_capacity(units.len() + 1);
        for &u in units {
            let key = self.keys.region(u);
            when.push(Compare::absent(key.clone()));
            then.push(Op::put(key, self.info.node.clone(), self.lease));
        }
        // The tick tells no more than the renewals' do of the lease (the claim renews
        // nothing): the view's validity alone moves on with it.
        let until = valid_until(boottime_ns(), self.ttl, self.ttl);
        then.push(Op::put(
            self.keys.tick(&self.info.node),
            until.to_string(),
            self.lease,
        ));
        let txn = Txn::new()
            .when(when)
            .and_then(then)
            .or_else([Op::get(self.keys.node(&self.info.node), Range::KEY)]);
        let r = self.client.txn(txn).await?;
        if r.succeeded() {
            return Ok(Some(r.revision()));
        }
        if self.epoch_moved(&r, epoch) {
            return Box::pin(self.claim_units(units, fresh)).await;
        }
        self.check_alive(&r)?;
        Ok(None)
    }

    /// Gives `[offset, offset + len)` back: the units this host holds in it (others' stay).
    pub async fn release(&self, offset: u64, len: u64) -> Result<()> {
        self.release_units(&units(offset, len)?).await
    }

    async fn release_units(&self, units: &[u64]) -> Result<()> {
        for &u in units {
            self.delete_if_mine(self.keys.region(u)).await?;
        }
        Ok(())
    }

    /// The requests a release of `[offset, offset + len)` sends now, one a unit (tests: one
    /// the network holds back, to land after a fence).
    pub fn release_requests(&self, offset: u64, len: u64) -> Result<Vec<Txn>> {
        Ok(units(offset, len)?
            .into_iter()
            .map(|u| self.delete_if_mine_txn(self.keys.region(u)).0)
            .collect())
    }

    /// Deletes `key` if its value is this node's name (a claim or reservation of its own).
    /// As a publication, it compares the fence (`publish_cmp`): one whose answer was lost,
    /// landing late, never deletes a claim this host made again after a fence. Failed, it
    /// reads the node record, as a publication does (`epoch_moved`): written after the epoch
    /// it compared (a fence whose answer was lost, or is still on its way to the task that
    /// asked for it), it is asked again under that write. The epoch held here is no proof
    /// that no fence came: taken for one, a release that failed on such a fence was dropped
    /// as another host's, and the claim stayed in etcd, the region no host's to carve, for as
    /// long as this one lived (seed 2272).
    pub(crate) async fn delete_if_mine(&self, key: String) -> Result<()> {
        loop {
            let (txn, epoch) = self.delete_if_mine_txn(key.clone());
            let r = self.client.txn(txn).await?;
            if r.succeeded() || !self.epoch_moved(&r, epoch) {
                return Ok(()); // deleted, or not this node's (or its lease is gone)
            }
        }
    }

    fn delete_if_mine_txn(&self, key: String) -> (Txn, i64) {
        let (current, epoch) = self.publish_cmp();
        let txn = Txn::new()
            .when([
                Compare::value_is(key.clone(), self.info.node.clone()),
                current,
            ])
            .and_then([Op::delete(key)])
            .or_else([Op::get(self.keys.node(&self.info.node), Range::KEY)]);
        (txn, epoch)
    }

    /// Every claimed unit (by index: offset / [`UNIT`]) and its holder.
    pub async fn regions(&self) -> Result<BTreeMap<u64, String>> {
        let prefix = self.keys.regions();
        let r = self.client.get(prefix.clone(), Range::PREFIX).await?;
        let mut out = BTreeMap::new();
        for kv in r.kvs {
            let hex = &kv.key.as_slice()[prefix.len()..];
            let index = std::str::from_utf8(hex)
                .ok()
                .and_then(|h| u64::from_str_radix(h, 16).ok())
                .ok_or_else(|| bad(kv.key.as_slice(), "not a region index".into()))?;
            out.insert(
                index,
                String::from_utf8_lossy(kv.value.as_slice()).into_owned(),
            );
        }
        Ok(out)
    }
}
