//! The worker's client end to end, over real NIXL (UCX's TCP transport on loopback), against
//! a small pool server of this test's own (`pool` below: a TCP listener speaking `proto`, a
//! NIXL agent with a registered 64 MiB buffer as the pool, a first-fit page allocator and a
//! write-once map of entries), since marud's side is not needed to check the client.
//!
//! Skips where NIXL is not installed, except where `MARU_REQUIRE_NIXL` is set (CI), where it
//! fails. One test function: UCX reads its environment once, so it is set before anything.

use std::time::{Duration, Instant};

use maru_nixl::Nixl;
use maru_remote::client::Error;
use maru_remote::{RemoteClient, RemoteConfig, Stored};

fn nixl() -> Option<Nixl> {
    // SAFETY: the only test of this binary, before any thread of NIXL's or UCX's exists.
    unsafe {
        std::env::set_var("UCX_TLS", "tcp");
        std::env::set_var("UCX_NET_DEVICES", "lo");
        // Where rdma-core is installed, UCX's ib module crashes NIXL processes at exit.
        std::env::set_var("UCX_MODULES", "^ib");
    }
    match Nixl::load() {
        Ok(n) => Some(n),
        Err(e) if std::env::var_os("MARU_REQUIRE_NIXL").is_none() => {
            eprintln!("skipped: {e}");
            None
        }
        Err(e) => panic!("MARU_REQUIRE_NIXL is set and NIXL does not load: {e}"),
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8)
        .collect()
}

const TOKEN: &str = "s3cret";

fn config(server: &pool::Server) -> RemoteConfig {
    RemoteConfig {
        url: format!("tcp://{}", server.addr),
        token: TOKEN.into(),
        node: "test".into(),
        transfer_timeout: Duration::from_secs(20),
        retry: Duration::from_millis(800),
        control_timeout: Duration::from_secs(2),
        ..RemoteConfig::default()
    }
}

/// Waits until the client would ask the pool again.
fn wait_out(client: &RemoteClient) {
    if let Some(until) = client.unavailable_until() {
        std::thread::sleep(
            until.saturating_duration_since(Instant::now()) + Duration::from_millis(20),
        );
    }
}

#[test]
fn a_worker_stores_and_loads_through_nixl() {
    let Some(nixl) = nixl() else { return };
    let mut server = pool::Server::start(&nixl, 16);

    // A bad token is refused at connect.
    let bad = RemoteClient::connect(RemoteConfig {
        token: "wrong".into(),
        ..config(&server)
    });
    assert!(
        matches!(bad, Err(Error::Server(maru::Error::PermissionDenied(_)))),
        "{bad:?}"
    );

    // A TCP interface is no UCX device for NIXL (it would ask UCX for `lo:1`).
    let lo = RemoteClient::connect(RemoteConfig {
        ucx_device: Some("lo".into()),
        ..config(&server)
    });
    assert!(matches!(lo, Err(Error::InvalidArgument(_))), "{lo:?}");

    let client = RemoteClient::connect(config(&server)).expect("connect");
    client.ping().expect("ping");
    client.mkdir("ns/sub", 0o755).expect("mkdir");
    assert_eq!(server.count("mkdir"), 1);

    // Store, then retrieve the same bytes; a second store finds the key taken.
    let small = pattern(1000, 1);
    assert_eq!(
        client.store("ns", "small", &small).unwrap(),
        Stored::Created
    );
    assert_eq!(
        client.retrieve("ns", "small").unwrap().as_deref(),
        Some(&small[..])
    );
    assert!(client.exists("ns", "small").unwrap());
    assert_eq!(
        client.store("ns", "small", &pattern(1000, 2)).unwrap(),
        Stored::AlreadyPresent
    );
    assert_eq!(
        client.retrieve("ns", "small").unwrap().as_deref(),
        Some(&small[..])
    );
    // The same key twice in one batch: both reserved and written, the first published.
    let (a, b) = (pattern(5000, 3), pattern(5000, 4));
    let twice = client
        .batch_store("ns", &[("twice", &a), ("twice", &b)])
        .unwrap();
    assert!(
        matches!(twice[..], [Ok(Stored::Created), Ok(Stored::AlreadyPresent)]),
        "{twice:?}"
    );
    assert_eq!(
        client.retrieve("ns", "twice").unwrap().as_deref(),
        Some(&a[..])
    );

    // 32 MiB, both ways; into a buffer of the caller's, and one too small.
    let big = pattern(32 << 20, 5);
    assert_eq!(client.store("ns", "big", &big).unwrap(), Stored::Created);
    let back = client.retrieve("ns", "big").unwrap().expect("big is there");
    assert!(back == big, "the 32 MiB entry came back different");
    let mut dst = vec![0u8; 33 << 20];
    assert_eq!(
        client.retrieve_into("ns", "big", &mut dst).unwrap(),
        Some(32 << 20)
    );
    assert!(dst[..32 << 20] == big[..]);
    let mut short = vec![0u8; 100];
    assert!(matches!(
        client.retrieve_into("ns", "big", &mut short),
        Err(Error::InvalidArgument(_))
    ));
    drop((back, dst));

    // 64 × 4 KiB in one batch: chunks of at most 16 items (the welcome's limit).
    let reserves = server.count("reserve");
    let values: Vec<Vec<u8>> = (0..64).map(|i| pattern(4096, i as u8)).collect();
    let names: Vec<String> = (0..64).map(|i| format!("page-{i}")).collect();
    let items: Vec<(&str, &[u8])> = names
        .iter()
        .map(String::as_str)
        .zip(values.iter().map(Vec::as_slice))
        .collect();
    let stored = client.batch_store("ns", &items).unwrap();
    assert!(
        stored.iter().all(|r| matches!(r, Ok(Stored::Created))),
        "{stored:?}"
    );
    assert_eq!(server.count("reserve") - reserves, 4);
    assert!(server.max_items_seen() <= 16);
    let mut keys: Vec<&str> = names.iter().map(String::as_str).collect();
    keys.push("missing");
    let got = client.batch_retrieve("ns", &keys).unwrap();
    for (i, v) in values.iter().enumerate() {
        assert_eq!(got[i].as_deref(), Some(&v[..]), "page-{i}");
    }
    assert_eq!(got[64], None);
    let there = client.batch_exists("ns", &keys).unwrap();
    assert!(there[..64].iter().all(|&x| x) && !there[64]);
    // A listing of 67 entries comes in pages of 16, whole and in order.
    let listing = client.list("ns").unwrap();
    let mut want: Vec<(String, u64)> = names.iter().map(|n| (n.clone(), 4096)).collect();
    want.extend([
        ("big".into(), 32 << 20),
        ("small".into(), 1000),
        ("twice".into(), 5000),
    ]);
    want.sort();
    let got: Vec<(String, u64)> = listing
        .entries
        .iter()
        .map(|e| (e.key.clone(), e.size))
        .collect();
    assert_eq!(got, want);
    assert_eq!(server.count("list"), 5);

    // Threads share one client.
    let shared = std::sync::Arc::new(client);
    let workers: Vec<_> = (0..4u8)
        .map(|t| {
            let c = shared.clone();
            std::thread::spawn(move || {
                for i in 0..16u8 {
                    let (key, value) =
                        (format!("thread-{t}-{i}"), pattern(8192 + i as usize, t ^ i));
                    assert_eq!(c.store("ns", &key, &value).unwrap(), Stored::Created);
                    assert_eq!(c.retrieve("ns", &key).unwrap(), Some(value));
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("a worker thread failed");
    }
    let client = std::sync::Arc::into_inner(shared).unwrap();

    // Misses, deletion, pins.
    assert_eq!(client.retrieve("ns", "nope").unwrap(), None);
    assert_eq!(
        client.retrieve_into("ns", "nope", &mut short).unwrap(),
        None
    );
    assert!(!client.exists("other", "small").unwrap());
    let deleted = client.delete("ns", &["small", "nope"]).unwrap();
    assert!(deleted[0].is_ok());
    assert!(
        matches!(&deleted[1], Err(Error::Server(maru::Error::NotFound(_)))),
        "{deleted:?}"
    );
    assert!(!client.exists("ns", "small").unwrap());
    assert_eq!(client.retrieve("ns", "small").unwrap(), None);
    let pinned = client.pin("ns", &["twice", "nope"], true).unwrap();
    assert!(pinned[0].is_ok() && pinned[1].is_err());
    assert!(matches!(
        client.store("ns", "empty", b""),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(client.stats().errors, 0);

    // A small staging buffer: batches are cut to fit it; larger values are refused.
    let narrow = RemoteClient::connect(RemoteConfig {
        staging_bytes: 1 << 20,
        ..config(&server)
    })
    .expect("connect with 1 MiB of staging");
    let wide: Vec<Vec<u8>> = (0..64).map(|i| pattern(64 << 10, 100 + i as u8)).collect();
    let wide_names: Vec<String> = (0..64).map(|i| format!("wide-{i}")).collect();
    let items: Vec<(&str, &[u8])> = wide_names
        .iter()
        .map(String::as_str)
        .zip(wide.iter().map(Vec::as_slice))
        .collect();
    let before = narrow.stats().transfers;
    let stored = narrow.batch_store("ns", &items).unwrap();
    assert!(stored.iter().all(|r| matches!(r, Ok(Stored::Created))));
    // 64 × 64 KiB through 1 MiB: at least 4 WRITEs (16 items a chunk, 15 fit with alignment).
    assert!(narrow.stats().transfers - before >= 4);
    let keys: Vec<&str> = wide_names.iter().map(String::as_str).collect();
    let got = narrow.batch_retrieve("ns", &keys).unwrap();
    assert!(
        got.iter()
            .zip(&wide)
            .all(|(g, w)| g.as_deref() == Some(&w[..]))
    );
    assert!(matches!(
        narrow.store("ns", "too-big", &pattern(2 << 20, 0)),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        narrow.retrieve("ns", "big"),
        Err(Error::InvalidArgument(_))
    ));
    drop(narrow);

    // A newer registration: the client loads marud's metadata again before using addresses.
    let metadata = server.count("metadata");
    server.with(|s| s.registration += 1);
    assert_eq!(
        client.retrieve("ns", "twice").unwrap().as_deref(),
        Some(&a[..])
    );
    assert_eq!(server.count("metadata"), metadata + 1);
    assert_eq!(
        client.store("ns", "after-registration", &small).unwrap(),
        Stored::Created
    );

    // marud restarted: a stale generation, a reconnection, the request repeated once.
    let hellos = server.count("hello");
    server.with(|s| s.restart_at_next = true);
    assert_eq!(
        client.store("ns", "after-restart", &small).unwrap(),
        Stored::Created
    );
    assert_eq!(server.count("hello"), hellos + 1);
    assert_eq!(client.stats().reconnects, 1);
    assert_eq!(
        client.retrieve("ns", "after-restart").unwrap().as_deref(),
        Some(&small[..])
    );

    // A transfer that fails: the reserved pages are abandoned, the pool left alone a while.
    let abandons = server.count("abandon");
    server.with(|s| s.unregistered_pages = true);
    let failed = client.store("ns", "unreachable", &small);
    assert!(matches!(failed, Err(Error::Nixl { .. })), "{failed:?}");
    assert_eq!(server.count("abandon"), abandons + 1);
    server.with(|s| s.unregistered_pages = false);
    let t = Instant::now();
    assert_eq!(
        client.retrieve("ns", "twice").unwrap(),
        None,
        "a miss while left alone"
    );
    assert!(!client.exists("ns", "twice").unwrap());
    assert!(
        client
            .store("ns", "x", &small)
            .unwrap_err()
            .is_unavailable()
    );
    assert!(
        t.elapsed() < Duration::from_millis(200),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(client.stats().errors, 1);
    assert!(client.stats().skipped >= 3);
    wait_out(&client);
    assert_eq!(
        client.retrieve("ns", "twice").unwrap().as_deref(),
        Some(&a[..])
    );

    // A WRITE that times out: its pages are quarantined, then abandoned once NIXL says it is
    // over; its staging buffer is not reused meanwhile.
    // (Room for it: the 32 MiB entry goes.)
    assert!(client.delete("ns", &["big"]).unwrap()[0].is_ok());
    let hasty = RemoteClient::connect(RemoteConfig {
        transfer_timeout: Duration::ZERO,
        retry: Duration::from_millis(300),
        ..config(&server)
    })
    .expect("connect");
    let (quarantines, abandons) = (server.count("quarantine"), server.count("abandon"));
    let timed_out = hasty.store("ns", "hasty", &big);
    assert!(
        matches!(
            &timed_out,
            Err(Error::Nixl {
                source: maru_nixl::Error::TimedOut(_),
                ..
            })
        ),
        "{timed_out:?}"
    );
    assert_eq!(server.count("quarantine"), quarantines + 1);
    assert_eq!(hasty.stats().lingering, 1);
    std::thread::sleep(Duration::from_millis(200));
    wait_out(&hasty);
    hasty.ping().expect("ping after the timeout");
    assert_eq!(hasty.stats().lingering, 0, "the transfer never ended");
    assert_eq!(server.count("abandon"), abandons + 1);
    assert!(!client.exists("ns", "hasty").unwrap());
    drop(hasty);

    // marud does not answer: the request fails within the control timeout.
    server.with(|s| s.mute = true);
    let t = Instant::now();
    let silent = client.ping();
    let took = t.elapsed();
    assert!(matches!(silent, Err(Error::Io { .. })), "{silent:?}");
    assert!(
        took >= Duration::from_millis(1900) && took < Duration::from_secs(4),
        "{took:?}"
    );
    assert_eq!(client.retrieve("ns", "twice").unwrap(), None);
    server.with(|s| s.mute = false);
    wait_out(&client);
    assert_eq!(
        client.retrieve("ns", "twice").unwrap().as_deref(),
        Some(&a[..])
    );

    // marud goes away: errors within the timeouts, then misses while left alone.
    server.stop();
    let t = Instant::now();
    let gone = client.store("ns", "gone", &small);
    assert!(
        gone.is_err() && !gone.as_ref().unwrap_err().is_unavailable(),
        "{gone:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let t = Instant::now();
    assert_eq!(client.retrieve("ns", "twice").unwrap(), None);
    assert_eq!(
        client.batch_retrieve("ns", &["twice", "big"]).unwrap(),
        vec![None, None]
    );
    assert!(!client.exists("ns", "twice").unwrap());
    assert!(
        client
            .store("ns", "gone", &small)
            .unwrap_err()
            .is_unavailable()
    );
    assert!(
        client
            .delete("ns", &["twice"])
            .unwrap_err()
            .is_unavailable()
    );
    assert!(client.mkdir("ns", 0o755).unwrap_err().is_unavailable());
    assert!(
        t.elapsed() < Duration::from_millis(200),
        "{:?}",
        t.elapsed()
    );
    wait_out(&client);
    let t = Instant::now();
    let refused = client.retrieve("ns", "twice");
    assert!(matches!(refused, Err(Error::Io { .. })), "{refused:?}");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    let stats = client.stats();
    assert!(stats.transfers > 0 && stats.bytes_written >= 32 << 20 && stats.bytes_read >= 64 << 20);
    assert_eq!(stats.errors, 4, "{stats:?}");
}

/// The test's pool server.
mod pool {
    use std::collections::HashMap;
    use std::io::Write;
    use std::net::{SocketAddr, TcpListener, TcpStream};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use maru::error::WireError;
    use maru_nixl::{Agent, AgentConfig, Desc, Mem, Nixl};
    use maru_remote::proto::{
        self, Op, Outcome, Page, Published, Registration, Reply, Request, Response, Welcome,
    };
    use memmap2::MmapMut;

    const PAGE: u64 = 4096;
    /// The registered pool.
    const POOL: u64 = 64 << 20;

    /// What the server knows, and the test's switches.
    pub struct State {
        pub generation: u64,
        pub registration: u64,
        /// The next request (not a hello) is answered as by a restarted marud.
        pub restart_at_next: bool,
        /// Requests are read and never answered.
        pub mute: bool,
        /// Pages are handed out beyond the registered memory (a transfer to them fails).
        pub unregistered_pages: bool,
        max_items: usize,
        max_seen: usize,
        used: Vec<bool>,
        entries: HashMap<(String, String), (u64, u64)>,
        writes: HashMap<u64, (u64, u64, bool)>,
        reads: HashMap<u64, ()>,
        next_ticket: u64,
        counts: HashMap<&'static str, u64>,
    }

    pub struct Server {
        pub addr: SocketAddr,
        state: Arc<Mutex<State>>,
        stop: Arc<AtomicBool>,
        streams: Arc<Mutex<Vec<TcpStream>>>,
        accept: Option<std::thread::JoinHandle<()>>,
        agent: Option<Agent>,
        /// Twice the pool: the registered half, and an unregistered one.
        memory: MmapMut,
    }

    impl Server {
        pub fn start(nixl: &Nixl, max_items: usize) -> Server {
            let mut agent = nixl
                .agent("test-pool", &AgentConfig::default())
                .expect("pool agent");
            agent.add_backend("UCX", &[]).expect("pool UCX backend");
            let memory = MmapMut::map_anon(2 * POOL as usize).expect("pool memory");
            let base = memory.as_ptr() as u64;
            agent
                .register(Mem::Dram, &[Desc::host(base, POOL)])
                .expect("register the pool");
            let metadata = agent.metadata().expect("metadata");
            let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
            listener.set_nonblocking(true).expect("nonblocking");
            let addr = listener.local_addr().unwrap();
            let state = Arc::new(Mutex::new(State {
                generation: 0x1000,
                registration: 1,
                restart_at_next: false,
                mute: false,
                unregistered_pages: false,
                max_items,
                max_seen: 0,
                used: vec![false; (POOL / PAGE) as usize],
                entries: HashMap::new(),
                writes: HashMap::new(),
                reads: HashMap::new(),
                next_ticket: 1,
                counts: HashMap::new(),
            }));
            let stop = Arc::new(AtomicBool::new(false));
            let streams = Arc::new(Mutex::new(Vec::new()));
            let registration = ("test-pool".to_owned(), metadata);
            let accept = {
                let (state, stop, streams) = (state.clone(), stop.clone(), streams.clone());
                let reg = registration.clone();
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        match listener.accept() {
                            Ok((s, _)) => {
                                s.set_nonblocking(false).unwrap();
                                streams.lock().unwrap().push(s.try_clone().unwrap());
                                let (state, reg) = (state.clone(), reg.clone());
                                std::thread::spawn(move || serve(s, state, reg, base));
                            }
                            Err(_) => std::thread::sleep(Duration::from_millis(5)),
                        }
                    }
                })
            };
            Server {
                addr,
                state,
                stop,
                streams,
                accept: Some(accept),
                agent: Some(agent),
                memory,
            }
        }

        pub fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
            f(&mut self.state.lock().unwrap())
        }

        /// How many requests of `op` were served.
        pub fn count(&self, op: &str) -> u64 {
            self.with(|s| s.counts.get(op).copied().unwrap_or(0))
        }

        pub fn max_items_seen(&self) -> usize {
            self.with(|s| s.max_seen)
        }

        /// Goes away: the listener closed, every connection cut, the agent gone.
        pub fn stop(&mut self) {
            self.stop.store(true, Ordering::Relaxed);
            if let Some(t) = self.accept.take() {
                t.join().unwrap();
            }
            for s in self.streams.lock().unwrap().drain(..) {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
            if let Some(agent) = self.agent.take() {
                let base = self.memory.as_ptr() as u64;
                agent
                    .deregister(Mem::Dram, &[Desc::host(base, POOL)])
                    .unwrap();
            }
        }
    }

    impl Drop for Server {
        fn drop(&mut self) {
            self.stop();
        }
    }

    fn err(kind: &str, message: &str) -> WireError {
        WireError {
            errno: libc_errno(kind),
            kind: kind.into(),
            message: message.into(),
        }
    }

    fn libc_errno(kind: &str) -> i32 {
        match kind {
            "not_found" => 2,
            "permission_denied" => 13,
            "no_space" => 28,
            _ => 22,
        }
    }

    fn serve(mut s: TcpStream, state: Arc<Mutex<State>>, reg: (String, Vec<u8>), base: u64) {
        let mut body = Vec::new();
        while let Ok(Some(())) = proto::read_frame(&mut s, &mut body) {
            let req: Request = proto::decode_request(&body).expect("a well-formed request");
            let mut st = state.lock().unwrap();
            if st.mute {
                continue;
            }
            *st.counts.entry(req.op.name()).or_default() += 1;
            st.max_seen = st.max_seen.max(req.op.items());
            let outcome = handle(&mut st, req.generation, req.op, &reg, base);
            let resp = Response {
                id: req.id,
                generation: st.generation,
                registration: st.registration,
                outcome: match outcome {
                    Ok(r) => Outcome::Ok(r),
                    Err(w) => Outcome::Err(w),
                },
            };
            drop(st);
            if proto::write_frame(&mut s, &resp)
                .and_then(|()| s.flush())
                .is_err()
            {
                return;
            }
        }
    }

    fn registration(st: &State, reg: &(String, Vec<u8>), base: u64) -> Registration {
        Registration {
            agent: reg.0.clone(),
            metadata: proto::Blob(reg.1.clone()),
            version: st.registration,
            // Claims the unregistered half too (for `unregistered_pages`).
            regions: vec![(base, 2 * POOL)],
        }
    }

    fn handle(
        st: &mut State,
        generation: u64,
        op: Op,
        reg: &(String, Vec<u8>),
        base: u64,
    ) -> Result<Reply, WireError> {
        if let Op::Hello { token, .. } = &op {
            if token != super::TOKEN {
                return Err(err("permission_denied", "bad token"));
            }
            return Ok(Reply::Hello(Welcome {
                generation: st.generation,
                pool: "test-pool".into(),
                page_align: PAGE,
                reserve_ttl_ms: 60_000,
                read_ttl_ms: 120_000,
                quarantine_ttl_ms: 300_000,
                max_items: st.max_items,
                uid: 0,
                gid: 0,
                registration: registration(st, reg, base),
            }));
        }
        if std::mem::take(&mut st.restart_at_next) {
            // A new run: every ticket of the old one is dead.
            st.generation += 1;
            let tickets: Vec<u64> = st.writes.keys().copied().collect();
            for t in tickets {
                free_ticket(st, t);
            }
            st.reads.clear();
        }
        if generation != st.generation {
            return Err(err(proto::STALE_GENERATION, "stale generation"));
        }
        let key = |ns: &str, k: &str| (ns.to_owned(), k.to_owned());
        Ok(match op {
            Op::Hello { .. } => unreachable!(),
            Op::Metadata => Reply::Metadata(registration(st, reg, base)),
            Op::Ping => Reply::Pong,
            Op::Mkdir { .. } => Reply::Done,
            Op::Reserve { sizes, .. } => {
                let mut pages: Vec<Page> = Vec::new();
                for &size in &sizes {
                    if size == 0 {
                        return Err(err("invalid_argument", "a page of 0 bytes"));
                    }
                    let Some(first) = alloc(st, size.div_ceil(PAGE)) else {
                        for p in &pages {
                            free_ticket(st, p.ticket);
                        }
                        return Err(err("no_space", "pool full"));
                    };
                    let ticket = st.next_ticket;
                    st.next_ticket += 1;
                    st.writes
                        .insert(ticket, (first, size.div_ceil(PAGE), false));
                    let addr = base + first * PAGE + if st.unregistered_pages { POOL } else { 0 };
                    pages.push(Page {
                        ticket,
                        addr,
                        len: size,
                    });
                }
                Reply::Reserved(pages)
            }
            Op::Publish { ns, items } => Reply::Published(
                items
                    .into_iter()
                    .map(|it| match st.writes.get(&it.ticket).copied() {
                        None => Published::Rejected(err("invalid_argument", "no such ticket")),
                        Some((_, _, true)) => Published::Rejected(err("busy", "quarantined")),
                        Some((first, _, false)) => {
                            if st.entries.contains_key(&key(&ns, &it.key)) {
                                free_ticket(st, it.ticket);
                                Published::AlreadyPresent
                            } else {
                                st.writes.remove(&it.ticket);
                                st.entries.insert(key(&ns, &it.key), (first, it.len));
                                Published::Created
                            }
                        }
                    })
                    .collect(),
            ),
            Op::Abandon { tickets } => {
                for t in tickets {
                    free_ticket(st, t);
                }
                Reply::Done
            }
            Op::Quarantine { tickets } => {
                for t in tickets {
                    if let Some(w) = st.writes.get_mut(&t) {
                        w.2 = true;
                    }
                }
                Reply::Done
            }
            Op::Exists { ns, keys } => Reply::Exists(
                keys.iter()
                    .map(|k| st.entries.contains_key(&key(&ns, k)))
                    .collect(),
            ),
            Op::Lookup { ns, keys } => Reply::Found(
                keys.iter()
                    .map(|k| {
                        let &(first, len) = st.entries.get(&key(&ns, k))?;
                        let ticket = st.next_ticket;
                        st.next_ticket += 1;
                        st.reads.insert(ticket, ());
                        Some(Page {
                            ticket,
                            addr: base + first * PAGE,
                            len,
                        })
                    })
                    .collect(),
            ),
            Op::Release { tickets } => {
                for t in tickets {
                    st.reads.remove(&t);
                }
                Reply::Done
            }
            Op::Delete { ns, keys } => Reply::Each(
                keys.iter()
                    .map(|k| match st.entries.remove(&key(&ns, k)) {
                        Some((first, len)) => {
                            release_pages(st, first, len.div_ceil(PAGE));
                            None
                        }
                        None => Some(err("not_found", &format!("{ns}/{k}"))),
                    })
                    .collect(),
            ),
            Op::Pin { ns, keys, .. } => Reply::Each(
                keys.iter()
                    .map(|k| {
                        (!st.entries.contains_key(&key(&ns, k)))
                            .then(|| err("not_found", "no such entry"))
                    })
                    .collect(),
            ),
            Op::List { ns, after } => {
                // Pages of 16 names, so that a listing takes several.
                let mut names: Vec<(String, u64)> = st
                    .entries
                    .iter()
                    .filter(|((n, k), _)| *n == ns && after.as_ref().is_none_or(|a| k > a))
                    .map(|((_, k), &(_, len))| (k.clone(), len))
                    .collect();
                names.sort();
                let more = names.len() > 16;
                names.truncate(16);
                Reply::Listing(proto::Listing {
                    children: Vec::new(),
                    entries: names
                        .into_iter()
                        .map(|(key, size)| proto::Listed { key, size })
                        .collect(),
                    more,
                })
            }
        })
    }

    /// First fit of `n` free pages.
    fn alloc(st: &mut State, n: u64) -> Option<u64> {
        let n = n as usize;
        let mut run = 0;
        for i in 0..st.used.len() {
            run = if st.used[i] { 0 } else { run + 1 };
            if run == n {
                let first = i + 1 - n;
                st.used[first..=i].iter_mut().for_each(|u| *u = true);
                return Some(first as u64);
            }
        }
        None
    }

    fn release_pages(st: &mut State, first: u64, n: u64) {
        st.used[first as usize..(first + n) as usize]
            .iter_mut()
            .for_each(|u| *u = false);
    }

    fn free_ticket(st: &mut State, ticket: u64) {
        if let Some((first, n, _)) = st.writes.remove(&ticket) {
            release_pages(st, first, n);
        }
    }
}
