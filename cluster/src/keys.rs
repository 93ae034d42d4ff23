//! The keys of one pool's records, the units of its regions, and the checks of names.

use serde::Deserialize;

use crate::error::{Error, Result};

/// The unit of region claims: 2 MiB, the pool's region alignment.
pub const UNIT: u64 = 2 << 20;

/// Units claimed per etcd transaction: etcd's default `--max-txn-ops` (128) bounds the
/// comparisons of one transaction; one more checks the lease, and a fresh claim's checks of
/// the mappings and of the removals not yet acknowledged are two more still (its writes:
/// the units, and the host's tick).
pub(crate) const UNITS_PER_TXN: usize = 125;

/// The unit indexes of `[offset, offset + len)`.
pub(crate) fn units(offset: u64, len: u64) -> Result<Vec<u64>> {
    if len == 0 || !offset.is_multiple_of(UNIT) || !len.is_multiple_of(UNIT) {
        return Err(Error::Misaligned { offset, len });
    }
    Ok((offset / UNIT..(offset + len) / UNIT).collect())
}

/// The units a publication checks this host holds: every unit of the entry, or for an entry
/// of more units than a transaction can compare, its first and last 60.
pub(crate) fn held_units(offset: u64, len: u64) -> Vec<u64> {
    let (first, last) = (offset / UNIT, (offset + len.max(1) - 1) / UNIT);
    if last - first < 120 {
        (first..=last).collect()
    } else {
        (first..first + 60).chain(last - 59..=last).collect()
    }
}

pub(crate) fn check_name(s: &str) -> Result<()> {
    if s.is_empty() || s.contains('/') || s.contains('\0') {
        return Err(Error::InvalidName(s.to_owned()));
    }
    Ok(())
}

pub(crate) fn check_ns(ns: &str) -> Result<()> {
    for part in ns.split('/') {
        check_name(part)?;
    }
    Ok(())
}

/// The key prefixes of one pool.
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    pub(crate) root: String,
}

impl Keys {
    /// Each node's acknowledgement (`Member::acknowledge`), from a read of `acks/`.
    pub(crate) fn acks_by_node<'a>(
        &self,
        kvs: &'a [crate::etcd::KeyValue],
    ) -> std::collections::HashMap<&'a [u8], i64> {
        kvs.iter()
            .filter_map(|kv| {
                let node = kv.key.as_slice().strip_prefix(self.acks().as_bytes())?;
                let rev = std::str::from_utf8(kv.value.as_slice())
                    .ok()?
                    .parse()
                    .ok()?;
                Some((node, rev))
            })
            .collect()
    }

    pub(crate) fn node(&self, node: &str) -> String {
        format!("{}nodes/{node}", self.root)
    }
    pub(crate) fn nodes(&self) -> String {
        format!("{}nodes/", self.root)
    }
    /// A host's beat: rewritten at each renewal of its lease ([`crate::lease::beat`]).
    pub(crate) fn beat(&self, node: &str) -> String {
        format!("{}beats/{node}", self.root)
    }
    /// The keys a renewal writes: the beat, and the tick ([`crate::lease::beat`]).
    pub(crate) fn beat_keys(&self, node: &str) -> crate::lease::BeatKeys {
        crate::lease::BeatKeys {
            beat: self.beat(node),
            tick: self.tick(node),
        }
    }
    /// A host's tick: sorts just before the entries (`.` before `/`), so that the entry
    /// watch ([`Keys::entry_watch`]) carries it, in revision order with them.
    pub(crate) fn tick(&self, node: &str) -> String {
        format!("{}{node}", self.ticks())
    }
    pub(crate) fn ticks(&self) -> String {
        format!("{}entries.tick/", self.root)
    }
    /// The prefix the entry watch follows: the entries and the ticks, nothing else.
    pub(crate) fn entry_watch(&self) -> String {
        format!("{}entries", self.root)
    }
    pub(crate) fn beats(&self) -> String {
        format!("{}beats/", self.root)
    }
    pub(crate) fn region(&self, index: u64) -> String {
        format!("{}regions/{index:016x}", self.root)
    }
    pub(crate) fn regions(&self) -> String {
        format!("{}regions/", self.root)
    }
    pub(crate) fn entry(&self, ns: &str, name: &str) -> String {
        format!("{}entries/{ns}/{name}", self.root)
    }
    pub(crate) fn entries(&self) -> String {
        format!("{}entries/", self.root)
    }
    pub(crate) fn pin(&self, ns: &str, name: &str) -> String {
        format!("{}pins/{ns}/{name}", self.root)
    }
    pub(crate) fn pins(&self) -> String {
        format!("{}pins/", self.root)
    }
    pub(crate) fn client_pin(&self, ns: &str, name: &str, node: &str) -> String {
        format!("{}clientpins/{ns}/{name}/{node}", self.root)
    }
    pub(crate) fn client_pins(&self) -> String {
        format!("{}clientpins/", self.root)
    }
    /// `(namespace, name, node)` of a client pin's key.
    pub(crate) fn split_client_pin(&self, key: &[u8]) -> Result<(String, String, String)> {
        let (rest, node) = Self::split_name(&self.client_pins(), key)?;
        let (ns, name) = rest
            .rsplit_once('/')
            .ok_or_else(|| bad(key, "no namespace".into()))?;
        Ok((ns.to_owned(), name.to_owned(), node))
    }
    pub(crate) fn reservation(&self, ns: &str, name: &str) -> String {
        format!("{}reserved/{ns}/{name}", self.root)
    }
    pub(crate) fn quota(&self, ns: &str) -> String {
        format!("{}quotas/{ns}", self.root)
    }
    pub(crate) fn quotas(&self) -> String {
        format!("{}quotas/", self.root)
    }
    pub(crate) fn ack(&self, node: &str) -> String {
        format!("{}acks/{node}", self.root)
    }
    pub(crate) fn acks(&self) -> String {
        format!("{}acks/", self.root)
    }
    pub(crate) fn access_to(&self, publisher: &str) -> String {
        format!("{}access/{publisher}/", self.root)
    }
    /// Every unit from `unit` on, in key order (fixed-width hex).
    pub(crate) fn maps_from(&self, unit: u64) -> String {
        format!("{}maps/{unit:016x}/", self.root)
    }
    /// The holds of the extent at `offset` (under its first unit).
    pub(crate) fn maps_of(&self, offset: u64) -> String {
        format!("{}{offset:016x}/", self.maps_from(offset / UNIT))
    }
    pub(crate) fn map(&self, unit: u64, offset: u64, node: &str, tag: u64) -> String {
        format!("{}maps/{unit:016x}/{offset:016x}/{node}/{tag}", self.root)
    }
    /// Every removal not yet acknowledged by every live host (a *tombstone*: one key per
    /// 2 MiB unit of the removed extent, named by its remover).
    pub(crate) fn tombstones(&self) -> String {
        format!("{}gone/", self.root)
    }
    /// Every unit's tombstones from `unit` on, in key order (fixed-width hex).
    pub(crate) fn tombstones_from(&self, unit: u64) -> String {
        format!("{}{unit:016x}/", self.tombstones())
    }
    /// Every remover's tombstone of the extent at `offset` under unit `unit`.
    pub(crate) fn tombstones_at(&self, unit: u64, offset: u64) -> String {
        format!("{}{offset:016x}/", self.tombstones_from(unit))
    }
    pub(crate) fn tombstone(&self, unit: u64, offset: u64, node: &str) -> String {
        format!("{}{node}", self.tombstones_at(unit, offset))
    }
    /// The offset of the removed extent a tombstone's key names.
    pub(crate) fn tombstone_offset(&self, key: &[u8]) -> Option<u64> {
        let rest = key.strip_prefix(self.tombstones().as_bytes())?;
        let offset = rest.split(|&b| b == b'/').nth(1)?;
        u64::from_str_radix(std::str::from_utf8(offset).ok()?, 16).ok()
    }
    /// The tombstones of the extent `[offset, offset + len)` that `node` removes.
    pub(crate) fn tombstones_of(&self, offset: u64, len: u64, node: &str) -> Vec<String> {
        let (first, last) = (offset / UNIT, (offset + len.max(1) - 1) / UNIT);
        (first..=last)
            .map(|u| self.tombstone(u, offset, node))
            .collect()
    }
    /// `(namespace, name)` of an entry key (names never contain `/`; namespaces may).
    pub(crate) fn split_entry(&self, key: &[u8]) -> Result<(String, String)> {
        Self::split_name(&self.entries(), key)
    }

    /// `(namespace, name)` of a key under `prefix`.
    pub(crate) fn split_name(prefix: &str, key: &[u8]) -> Result<(String, String)> {
        let s = std::str::from_utf8(key).map_err(|e| bad(key, e.to_string()))?;
        let rest = s
            .strip_prefix(prefix)
            .ok_or_else(|| bad(key, format!("outside {prefix}")))?;
        let (ns, name) = rest
            .rsplit_once('/')
            .ok_or_else(|| bad(key, "no namespace".into()))?;
        Ok((ns.to_owned(), name.to_owned()))
    }
}

pub(crate) fn bad(key: &[u8], why: String) -> Error {
    Error::BadRecord {
        key: String::from_utf8_lossy(key).into_owned(),
        why,
    }
}

pub(crate) fn decode<T: for<'a> Deserialize<'a>>(key: &[u8], value: &[u8]) -> Result<T> {
    serde_json::from_slice(value).map_err(|e| bad(key, e.to_string()))
}
