//! The connection's shared-memory lane (`maru::lane`): calls through it agree with calls on
//! the socket, whichever side sleeps, and replies that cannot go in the lane (descriptors,
//! more than the lane holds) come on the socket, which the lane then says; a client that scribbles on its lane gets an
//! error and hurts no one.

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use maru::lane::{LANE_CAP, Lane, NUDGE, Reply};
use maru::proto::{self, FrameReader, Outcome, Response};
use maru_tests::{Daemon, Opts, pattern};

fn daemon() -> Daemon {
    Daemon::start(Opts {
        pools: vec!["memfs:{dir}/pool,size=256M".into()],
        mount: false,
        extra: vec![],
    })
}

/// Requests marud took from lanes so far (asked on the socket).
fn lane_requests(d: &Daemon) -> u64 {
    let h = maru::Handler::connect(maru::Config {
        lane: false,
        ..d.client_config()
    })
    .unwrap();
    h.stats().unwrap().ops["lane_requests"]
}

#[test]
fn calls_through_the_lane_agree_with_the_socket_whichever_side_sleeps() {
    maru_tests::require_root!();
    let d = daemon();
    let cfg = |lane: bool, spin_us: u64| maru::Config {
        lane,
        spin: Duration::from_micros(spin_us),
        namespace: Some("ln".into()),
        ..d.client_config()
    };
    d.handler().mkdir("ln", 0o755).unwrap();
    // Keys long enough that a listing of 400 of them does not fit in the lane.
    let long = "k".repeat(200);
    for (tag, lane, spin) in [
        ("lane", true, 50),
        ("socket", false, 50),
        ("asleep", true, 0),
    ] {
        let before = lane_requests(&d);
        let h = maru::Handler::connect(cfg(lane, spin)).unwrap();
        for i in 0..200u64 {
            let mut a = h.alloc(4096).unwrap();
            a.as_mut_slice().copy_from_slice(&pattern(i, 4096));
            h.store(&format!("ln/{tag}-{i}"), a).unwrap();
            if i % 50 == 0 {
                // marud's thread stops polling and sleeps: the next call must wake it.
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        assert!(matches!(
            h.store(&format!("ln/{tag}-0"), h.alloc(4096).unwrap()),
            Err(maru::Error::Exists(_))
        ));
        // Another client's first retrieves: replies with the pack's descriptor.
        let r = maru::Handler::connect(cfg(lane, spin)).unwrap();
        for i in 0..200u64 {
            let m = r.retrieve(&format!("ln/{tag}-{i}")).unwrap().unwrap();
            assert_eq!(m.as_slice(), &pattern(i, 4096)[..], "{tag} {i}");
        }
        for i in 0..400u64 {
            h.put(&format!("ln/{tag}-{long}-{i}"), b"x").unwrap();
        }
        let (_, _, entries) = h.list("ln").unwrap();
        let listed = entries
            .iter()
            .filter(|e| e.key.starts_with(&format!("{tag}-{long}")))
            .count();
        assert_eq!(
            listed, 400,
            "{tag}: a reply larger than the lane ({LANE_CAP})"
        );
        h.delete(&format!("ln/{tag}-7")).unwrap();
        assert!(r.retrieve(&format!("ln/{tag}-7")).unwrap().is_none());
        let took = lane_requests(&d) - before;
        if lane {
            // Publications (600), first retrieves, the listing, the delete; some go on the
            // socket while an allocation refill is in flight.
            assert!(took >= 400, "{tag}: {took} requests came through the lane");
        } else {
            assert_eq!(took, 0, "{tag}: a client without a lane");
        }
    }
}

/// Reads frames from `s` until one is complete.
fn frame(s: &UnixStream, r: &mut FrameReader) -> Option<Vec<u8>> {
    loop {
        if let Some(b) = r.next_frame().unwrap() {
            return Some(b);
        }
        if r.read_from(s.as_fd()).expect("reading the socket") == 0 {
            return None;
        }
    }
}

fn send(s: &UnixStream, json: serde_json::Value) {
    let body = json.to_string();
    let mut f = (body.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(body.as_bytes());
    proto::send_all(s.as_fd(), &f, &[]).unwrap();
}

#[test]
fn a_client_scribbling_on_its_lane_gets_an_error_and_hurts_no_one() {
    maru_tests::require_root!();
    let d = daemon();
    let h = d.handler();
    h.mkdir("keep", 0o755).unwrap();
    h.put("keep/k", b"intact").unwrap();

    let s = UnixStream::connect(&d.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut r = FrameReader::new();
    send(
        &s,
        serde_json::json!({"id": 1, "op": "hello", "args": {"version": proto::PROTOCOL_VERSION, "client": "scribbler"}}),
    );
    let hello: Response = proto::decode(&frame(&s, &mut r).unwrap()).unwrap();
    assert!(matches!(hello.result, Outcome::Ok(_)), "{hello:?}");
    send(&s, serde_json::json!({"id": 2, "op": "lane"}));
    let reply: Response = proto::decode(&frame(&s, &mut r).unwrap()).unwrap();
    assert_eq!(reply.fds, 1);
    let file = File::from(r.take_fds(1).unwrap().pop().unwrap());
    assert!(file.set_len(1).is_err(), "the lane's size is sealed");
    send(&s, serde_json::json!({"id": 3, "op": "lane"}));
    let again: Response = proto::decode(&frame(&s, &mut r).unwrap()).unwrap();
    assert!(
        matches!(again.result, Outcome::Err(_)),
        "one lane per connection"
    );

    // Bytes that are no request: an error in the lane, and the connection goes on.
    let lane = Lane::map(&file).unwrap();
    if lane.post_request(7, b"not a request") {
        proto::send_all(s.as_fd(), &NUDGE, &[]).unwrap();
    }
    let t0 = Instant::now();
    let body = loop {
        if let Some(Reply::Here(b)) = lane.reply(7) {
            break b;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "no reply in the lane"
        );
        std::thread::yield_now();
    };
    let err: Response = proto::decode(&body).unwrap();
    assert!(matches!(err.result, Outcome::Err(_)), "{err:?}");

    // A reply with a descriptor goes on the socket, and the lane says so.
    let index = serde_json::json!({"id": 9, "op": "index", "args": {"ns": "keep"}}).to_string();
    if lane.post_request(9, index.as_bytes()) {
        proto::send_all(s.as_fd(), &NUDGE, &[]).unwrap();
    }
    let on_socket: Response = proto::decode(&frame(&s, &mut r).unwrap()).unwrap();
    assert!(on_socket.id == 9 && on_socket.fds > 0, "{on_socket:?}");
    r.drop_fds();
    // (posted right after the send)
    let t0 = Instant::now();
    while lane.reply(9).is_none() && t0.elapsed() < Duration::from_secs(10) {
        std::thread::yield_now();
    }
    assert_eq!(lane.reply(9), Some(Reply::OnSocket));

    // A length beyond the lane: marud says why on the socket and closes the connection.
    let map = memmap2::MmapOptions::new().map_raw(&file).unwrap();
    // SAFETY: the lane's first words, accessed as atomics as marud does.
    let words = unsafe { std::slice::from_raw_parts(map.as_ptr().cast::<AtomicU64>(), 16) };
    // Once marud's thread sleeps on the socket, so that it reads the nudge before it closes
    // (a close with unread bytes would reset the connection before its last reply is read).
    let t0 = Instant::now();
    while words[8].load(Ordering::SeqCst) == 0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "marud never slept");
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(20));
    words[1].store(u64::MAX, Ordering::SeqCst);
    words[0].store(8, Ordering::SeqCst);
    proto::send_all(s.as_fd(), &NUDGE, &[]).unwrap();
    let why: Response = proto::decode(&frame(&s, &mut r).unwrap()).unwrap();
    match why.result {
        Outcome::Err(e) => assert!(e.message.contains("exceeds the lane"), "{e:?}"),
        other => panic!("{other:?}"),
    }
    assert!(frame(&s, &mut r).is_none(), "the connection is closed");

    // Everyone else is served as before.
    let m = d.handler().retrieve("keep/k").unwrap().unwrap();
    assert_eq!(m.as_slice(), b"intact");
    assert!(h.stats().is_ok());
}
