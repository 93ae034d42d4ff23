//! Random frame sequences against a live daemon (a property test in the normal run): whatever
//! arrives — random bytes, wrong lengths, random operations with random arguments — marud
//! answers or closes, never crashes, and keeps serving other clients with their data intact.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use maru_tests::{Daemon, Opts};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

#[derive(Debug, Clone)]
enum Frame {
    /// Raw bytes with a correct length prefix.
    Bytes(Vec<u8>),
    /// A length prefix that lies (longer than what follows; the connection then closes).
    Lying(u32, Vec<u8>),
    /// A JSON request with a known or unknown operation and random arguments.
    Json(String),
}

fn op_name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("hello"),
        Just("mkdir"),
        Just("rmdir"),
        Just("alloc"),
        Just("free"),
        Just("publish"),
        Just("retrieve"),
        Just("release"),
        Just("accessed"),
        Just("exists"),
        Just("delete"),
        Just("pin"),
        Just("hold"),
        Just("index"),
        Just("list"),
        Just("stats"),
        Just("evict"),
        Just("lane"),
        Just("bogus"),
    ]
    .prop_map(str::to_owned)
}

fn json_value() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<u64>().prop_map(serde_json::Value::from),
        "[a-z./\\x00]{0,12}".prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(2, 12, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
            proptest::collection::btree_map(
                prop_oneof![
                    Just("ns"),
                    Just("key"),
                    Just("keys"),
                    Just("size"),
                    Just("count"),
                    Just("alloc"),
                    Just("mode"),
                    Just("version"),
                    Just("client"),
                    Just("bytes"),
                    Just("gens"),
                    Just("pinned"),
                    Just("hold")
                ]
                .prop_map(str::to_owned),
                inner,
                0..5
            )
            .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

fn frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..64).prop_map(Frame::Bytes),
        (
            65u32..1_000_000,
            proptest::collection::vec(any::<u8>(), 0..16)
        )
            .prop_map(|(l, b)| Frame::Lying(l, b)),
        (any::<u64>(), op_name(), json_value()).prop_map(|(id, op, args)| {
            Frame::Json(serde_json::json!({"id": id, "op": op, "args": args}).to_string())
        }),
        (any::<u64>(), op_name())
            .prop_map(|(id, op)| Frame::Json(serde_json::json!({"id": id, "op": op}).to_string())),
    ]
}

fn send(s: &mut UnixStream, f: &Frame) -> std::io::Result<()> {
    match f {
        Frame::Bytes(b) => {
            s.write_all(&(b.len() as u32).to_le_bytes())?;
            s.write_all(b)
        }
        Frame::Lying(l, b) => {
            s.write_all(&l.to_le_bytes())?;
            s.write_all(b)
        }
        Frame::Json(j) => {
            s.write_all(&(j.len() as u32).to_le_bytes())?;
            s.write_all(j.as_bytes())
        }
    }
}

#[test]
fn random_frame_sequences_never_hurt_the_daemon() {
    maru_tests::require_root!();
    let d = Daemon::start(Opts {
        pools: vec!["memfs:{dir}/pool,size=64M".into()],
        mount: false,
        extra: vec![],
    });
    let h = d.handler();
    h.mkdir("keep", 0o755).unwrap();
    h.put("keep/k", b"intact").unwrap();
    // Random `evict` requests (sent as root) may empty the pool; a pinned entry must survive.
    h.pin("keep/k").unwrap();
    let hello =
        serde_json::json!({"id": 0, "op": "hello", "args": {"version": maru::proto::PROTOCOL_VERSION, "client": "fuzz"}})
            .to_string();
    let mut runner = TestRunner::new(Config {
        cases: 64,
        ..Config::default()
    });
    let r = runner.run(
        &(any::<bool>(), proptest::collection::vec(frame(), 1..24)),
        |(greet, frames)| {
            let mut s = UnixStream::connect(&d.socket).unwrap();
            s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
            if greet {
                send(&mut s, &Frame::Json(hello.clone())).unwrap();
            }
            for f in &frames {
                if send(&mut s, f).is_err() {
                    break; // the daemon closed this connection: allowed
                }
            }
            // Drain whatever came back.
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink);
            drop(s);
            // The daemon still serves, and the sentinel entry is intact.
            let h2 =
                maru::Handler::connect(d.client_config()).expect("marud still accepts clients");
            let m = h2.retrieve("keep/k").unwrap().unwrap();
            prop_assert_eq!(m.as_slice(), b"intact");
            Ok(())
        },
    );
    if let Err(e) = r {
        panic!("{e}");
    }
    assert!(h.stats().is_ok());
}
