//! Watches of a pool's records: entries, acknowledgements, access reports, pins, client
//! pins and quotas.

use crate::error::Result;
use crate::etcd::{self, EventType, WatchStream};
use crate::keys::*;
use crate::records::*;

/// The changes to a pool's entries, in revision order.
pub struct EntryWatch {
    pub(crate) stream: WatchStream,
    pub(crate) keys: Keys,
    pub(crate) queued: std::collections::VecDeque<EntryEvent>,
}

/// The next batch of events of a watch; `None` when it ended (etcd went away or compacted
/// past it).
async fn next_events(stream: &mut WatchStream) -> Result<Option<Vec<etcd::Event>>> {
    match stream.message().await? {
        Some(resp) if !resp.canceled => Ok(Some(resp.events)),
        _ => Ok(None),
    }
}

/// A tick's value: the validity, in nanoseconds.
fn decode_until(key: &[u8], value: &[u8]) -> Result<u64> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| bad(key, "a tick that is not a number".into()))
}

/// Changes to the acknowledgements, from [`Member::watch_acks`].
pub struct AckWatch {
    pub(crate) stream: WatchStream,
}

impl AckWatch {
    /// Waits for the next change; false when the watch ended.
    pub async fn next(&mut self) -> Result<bool> {
        Ok(next_events(&mut self.stream).await?.is_some())
    }
}

/// Access reports, from [`Member::watch_access`].
pub struct AccessWatch {
    pub(crate) stream: WatchStream,
}

impl AccessWatch {
    /// The entries the next reports name (oldest use first); `None` when the watch ended.
    pub async fn next(&mut self) -> Result<Option<Vec<(String, String)>>> {
        loop {
            let Some(events) = next_events(&mut self.stream).await? else {
                return Ok(None);
            };
            let mut used = Vec::new();
            for ev in events {
                if let (EventType::Put, Some(kv)) = (ev.r#type(), ev.kv.as_ref()) {
                    used.extend(decode::<Vec<(String, String)>>(
                        kv.key.as_slice(),
                        kv.value.as_slice(),
                    )?);
                }
            }
            if !used.is_empty() {
                return Ok(Some(used));
            }
        }
    }
}

/// The changes under one prefix: each key, and its new value (None: deleted).
pub(crate) struct PrefixWatch {
    pub(crate) stream: WatchStream,
    pub(crate) prefix: String,
    /// Changes received and not yet taken, as (key, value (None: deleted), revision).
    pub(crate) queued: std::collections::VecDeque<(Vec<u8>, Option<Vec<u8>>, i64)>,
}

impl PrefixWatch {
    async fn next(&mut self) -> Result<Option<(Vec<u8>, Option<Vec<u8>>, i64)>> {
        loop {
            if let Some(e) = self.queued.pop_front() {
                return Ok(Some(e));
            }
            let Some(events) = next_events(&mut self.stream).await? else {
                return Ok(None);
            };
            for ev in events {
                let Some(kv) = ev.kv.as_ref() else { continue };
                let value = (ev.r#type() == EventType::Put).then(|| kv.value.as_slice().to_vec());
                // A deletion's record carries the deletion's revision as its mod_revision.
                self.queued
                    .push_back((kv.key.as_slice().to_vec(), value, kv.mod_revision));
            }
        }
    }
}

/// Pins and unpins, from [`Member::watch_pins`].
pub struct PinWatch(pub(crate) PrefixWatch);

impl PinWatch {
    /// The next change, as (namespace, name, pinned, its revision); `None` when the watch
    /// ended.
    pub async fn next(&mut self) -> Result<Option<(String, String, bool, i64)>> {
        let Some((key, value, revision)) = self.0.next().await? else {
            return Ok(None);
        };
        let (ns, name) = Keys::split_name(&self.0.prefix, &key)?;
        Ok(Some((ns, name, value.is_some(), revision)))
    }
}

/// Client pins recorded and taken back, from [`Member::watch_client_pins`].
pub struct ClientPinWatch(pub(crate) PrefixWatch, pub(crate) Keys);

impl ClientPinWatch {
    /// The next change, as (namespace, name, node, pinned); `None` when the watch ended.
    pub async fn next(&mut self) -> Result<Option<(String, String, String, bool)>> {
        let Some((key, value, _)) = self.0.next().await? else {
            return Ok(None);
        };
        let (ns, name, node) = self.1.split_client_pin(&key)?;
        Ok(Some((ns, name, node, value.is_some())))
    }
}

/// Quota changes, from [`Member::watch_quotas`].
pub struct QuotaWatch(pub(crate) PrefixWatch);

impl QuotaWatch {
    /// The next change, as (namespace, quota (None: cleared), its revision); `None` when the
    /// watch ended.
    pub async fn next(&mut self) -> Result<Option<(String, Option<u64>, i64)>> {
        let Some((key, value, revision)) = self.0.next().await? else {
            return Ok(None);
        };
        let (ns, bytes) = parse_quota(&self.0.prefix, &key, value.as_deref())?;
        Ok(Some((ns, bytes, revision)))
    }
}

/// A quota key's namespace and value.
pub(crate) fn parse_quota(
    prefix: &str,
    key: &[u8],
    value: Option<&[u8]>,
) -> Result<(String, Option<u64>)> {
    let ns = std::str::from_utf8(key)
        .ok()
        .and_then(|k| k.strip_prefix(prefix))
        .ok_or_else(|| bad(key, format!("outside {prefix}")))?;
    let bytes = value
        .map(|v| {
            std::str::from_utf8(v)
                .ok()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| bad(key, "not a number of bytes".into()))
        })
        .transpose()?;
    Ok((ns.to_owned(), bytes))
}

impl EntryWatch {
    /// The next change; `None` when the watch ended (etcd went away or compacted past it).
    pub async fn next(&mut self) -> Result<Option<EntryEvent>> {
        loop {
            if let Some(e) = self.queued.pop_front() {
                return Ok(Some(e));
            }
            let Some(events) = next_events(&mut self.stream).await? else {
                return Ok(None);
            };
            for ev in events {
                let Some(kv) = ev.kv.as_ref() else { continue };
                if let Some(node) = kv.key.strip_prefix(self.keys.ticks().as_bytes()) {
                    // A tick's deletion (its lease ended) tells nothing.
                    if ev.r#type() == EventType::Put {
                        self.queued.push_back(EntryEvent::Tick {
                            node: String::from_utf8_lossy(node).into_owned(),
                            until: decode_until(kv.key.as_slice(), kv.value.as_slice())?,
                            revision: kv.mod_revision,
                        });
                    }
                    continue;
                }
                if !kv.key.starts_with(self.keys.entries().as_bytes()) {
                    continue; // under the watch's prefix, but neither (a later version's)
                }
                let (ns, name) = self.keys.split_entry(kv.key.as_slice())?;
                self.queued.push_back(match ev.r#type() {
                    EventType::Put => EntryEvent::Put {
                        ns,
                        name,
                        record: decode(kv.key.as_slice(), kv.value.as_slice())?,
                        revision: kv.create_revision,
                    },
                    EventType::Delete => {
                        let prev = ev.prev_kv.as_ref();
                        EntryEvent::Delete {
                            ns,
                            name,
                            revision: kv.mod_revision,
                            created: prev.map_or(0, |p| p.create_revision),
                            record: prev.and_then(|p| decode(&p.key, &p.value).ok()),
                        }
                    }
                });
            }
        }
    }
}
