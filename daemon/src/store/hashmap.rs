//! The store's hash maps.

/// The store's maps. Their keys are inodes and names, looked up several times for each key
/// of a batch under the store's lock; foldhash (seeded per process) costs a fraction of the
/// standard library's SipHash there.
pub type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
