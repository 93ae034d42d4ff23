//! Load: 8 concurrent clients × 10,000 mixed operations (store, retrieve, exists, delete) on a
//! small pool with eviction active, readers holding mappings of entries that get evicted.
//! No error, no wrong byte, no leak. Prints the rate.

use std::time::Instant;

use maru::Error;
use maru_tests::{Daemon, Opts, pattern};
use rand::Rng;

const CLIENTS: usize = 8;
const OPS: usize = 10_000;
const KEYS: u64 = 3000;

fn size_of(k: u64) -> usize {
    4096 + ((k * 2_654_435_761) % 60_000) as usize
}

#[test]
fn eight_clients_mixed_load_with_eviction() {
    maru_tests::require_root!();
    let d = Daemon::start(Opts {
        pools: vec!["memfs:{dir}/pool,size=48M".into()],
        mount: false,
        extra: vec![],
    });
    d.handler().mkdir("l", 0o755).unwrap();
    let t = Instant::now();
    let threads: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let cfg = maru::Config {
                cache_bytes: 1 << 20,
                ..d.client_config()
            };
            std::thread::spawn(move || {
                let h = maru::Handler::connect(cfg).unwrap();
                let mut rng = rand::thread_rng();
                let mut held: Vec<(u64, maru::Mapping)> = Vec::new();
                let mut counts = [0u64; 4];
                for _ in 0..OPS {
                    let k = rng.gen_range(0..KEYS);
                    let path = format!("l/k{k}");
                    match rng.gen_range(0..10) {
                        0..=3 => {
                            counts[0] += 1;
                            match h.put(&path, &pattern(k, size_of(k))) {
                                Ok(()) | Err(Error::Exists(_)) => {}
                                Err(e) => panic!("client {c}: store {path}: {e}"),
                            }
                        }
                        4..=6 => {
                            counts[1] += 1;
                            if let Some(m) = h.retrieve(&path).unwrap() {
                                assert!(
                                    m.as_slice() == pattern(k, size_of(k)),
                                    "client {c}: {path} wrong bytes"
                                );
                                if held.len() < 16 {
                                    held.push((k, m));
                                } else {
                                    held[rng.gen_range(0..16)] = (k, m);
                                }
                            }
                        }
                        7 | 8 => {
                            counts[2] += 1;
                            h.exists(&path).unwrap();
                        }
                        _ => {
                            counts[3] += 1;
                            match h.delete(&path) {
                                Ok(()) | Err(Error::NotFound(_)) => {}
                                Err(e) => panic!("client {c}: delete {path}: {e}"),
                            }
                        }
                    }
                }
                // Mappings held across evictions and deletions still hold the right bytes.
                for (k, m) in &held {
                    assert!(
                        m.as_slice() == pattern(*k, size_of(*k)),
                        "client {c}: held k{k} changed"
                    );
                }
                counts
            })
        })
        .collect();
    let mut totals = [0u64; 4];
    for th in threads {
        let c = th.join().unwrap();
        for i in 0..4 {
            totals[i] += c[i];
        }
    }
    let secs = t.elapsed().as_secs_f64();
    let h = d.handler();
    let st = h.stats().unwrap();
    let p = &st.pools[0];
    eprintln!(
        "load: {} clients x {OPS} ops in {secs:.1} s = {:.0} ops/s (store {}, retrieve {}, exists {}, delete {}); {} evictions, {} entries left",
        CLIENTS,
        (CLIENTS * OPS) as f64 / secs,
        totals[0],
        totals[1],
        totals[2],
        totals[3],
        p.evictions,
        p.entries
    );
    assert!(p.evictions > 0, "the load never filled the pool");
    // No leak: every surviving entry is intact, and deleting them all empties the pool.
    assert_eq!(p.writing_bytes, 0);
    let (_, _, entries) = h.list("l").unwrap();
    for e in &entries {
        let k: u64 = e.key[1..].parse().unwrap();
        assert!(
            h.retrieve(&format!("l/{}", e.key))
                .unwrap()
                .unwrap()
                .as_slice()
                == pattern(k, size_of(k))
        );
    }
    let keys: Vec<String> = entries.iter().map(|e| format!("l/{}", e.key)).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    for chunk in refs.chunks(500) {
        assert!(h.batch_delete(chunk).unwrap().iter().all(Result::is_ok));
    }
    h.trim();
    let st = h.stats().unwrap();
    assert_eq!(st.pools[0].entries, 0);
    assert!(
        st.pools[0].used < 1 << 20,
        "{} bytes still used",
        st.pools[0].used
    );
}
