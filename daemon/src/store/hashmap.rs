//! The store's hash maps.

/// The store's maps. Their keys are inodes and names, looked up several times for each key
/// of a batch under the store's lock; foldhash (seeded per process) costs a fraction of the
/// standard library's SipHash there. They grow incrementally (griddle moves a few items per
/// insert after a resize): the entries' map doubling all at once held the store's lock for
/// up to 29 ms at 58,000 entries.
pub type HashMap<K, V> = griddle::HashMap<K, V, foldhash::fast::RandomState>;
