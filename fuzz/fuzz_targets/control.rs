//! Fuzzes the control protocol: arbitrary bytes are split into frames and dispatched to an
//! in-process store (a `file:` pool in a temporary directory), as marud does for a
//! connection. Any panic is a bug; the store's invariants must hold afterwards.
#![no_main]

use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use maru::proto::FrameReader;
use maru_daemon::pool::PoolSpec;
use maru_daemon::server::Dispatcher;
use maru_daemon::store::{Eviction, Store, StoreConfig};
use maru_fsd::Caller;

fn store() -> &'static Arc<Store> {
    static S: OnceLock<(tempfile::TempDir, Arc<Store>)> = OnceLock::new();
    &S.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        let spec = PoolSpec::parse(&format!("file:{}/dev.img,size=16M", dir.path().display()))
            .expect("spec");
        let store = Store::open(
            StoreConfig {
                eviction: Eviction::Lru,
                state_dir: dir.path().join("state"),
                wal_sync: false,
                max_copy_entry: 1 << 20,
            },
            &[spec],
        )
        .expect("store");
        (dir, store)
    })
    .1
}

fuzz_target!(|data: &[u8]| {
    let store = store();
    // Half the inputs start with a valid handshake so the fuzzer reaches the operations.
    let mut d = Dispatcher::new(
        store.clone(),
        Caller::with_group_list(
            data.first().map_or(0, |b| u32::from(*b & 1) * 1000),
            0,
            1,
            Vec::new(),
        ),
    );
    let mut r = FrameReader::new();
    if data.len() > 1 && data[1] & 1 == 1 {
        let hello = format!(
            r#"{{"id":0,"op":"hello","args":{{"version":{},"client":"fuzz"}}}}"#,
            maru::proto::PROTOCOL_VERSION
        );
        let hello = hello.as_bytes();
        r.push(&(hello.len() as u32).to_le_bytes());
        r.push(hello);
    }
    r.push(data.get(2..).unwrap_or_default());
    while let Ok(Some(body)) = r.next_frame() {
        if d.handle(&body) {
            break;
        }
    }
    drop(d);
    store.check_invariants().expect("store invariants");
});
