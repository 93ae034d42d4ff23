//! What the tests of a store on a shared `file:` pool with a stand-in authority have in
//! common: the store, and a client's store over the socket.

use std::os::unix::fs::FileExt;
use std::sync::Arc;

use maru::Result;
use maru_daemon::pool::PoolSpec;
use maru_daemon::store::authority::Authority;
use maru_daemon::store::{Eviction, Store, StoreConfig};
use maru_fsd::Caller;

/// A store on a `file:` pool of `mib` MiB under `dir`, made as `maructl device init` would (a
/// pool shared with other hosts is opened, never created), deciding names with `auth`, with
/// namespace `ns`; and the pool's UUID.
pub fn store_on_file_pool(
    dir: &std::path::Path,
    mib: u64,
    auth: Arc<dyn Authority>,
) -> (Arc<Store>, String) {
    let cfg = StoreConfig {
        eviction: Eviction::Off,
        state_dir: dir.join("state"),
        wal_sync: false,
        max_copy_entry: 1 << 30,
    };
    let dev = dir.join("dev.img");
    let f = std::fs::File::create(&dev).unwrap();
    f.set_len(mib << 20).unwrap();
    let uuid = maru::format::init_header(&f).unwrap().uuid_string();
    let spec = PoolSpec::parse(&format!("file:{},size={mib}M", dev.display())).unwrap();
    let store = Store::open_with(cfg, &[spec], auth).unwrap();
    store.mkdir(&Caller::root(), "ns", 0o755).unwrap();
    (store, uuid)
}

/// Stores `data` as `ns/key` over the socket, in a session of its own; the offset it got.
pub fn put(store: &Store, key: &str, data: &[u8]) -> Result<u64> {
    let s = store.open_session("t", Caller::root());
    let r = (|| {
        let (g, _) = store
            .alloc(s, data.len() as u64, 1, None, None)?
            .pop()
            .unwrap();
        store
            .raw_pool_fd(g.pool, true)?
            .write_all_at(data, g.offset)?;
        store.publish(s, g.alloc, "ns", key, None)?;
        Ok(g.offset)
    })();
    store.close_session(s);
    r
}
