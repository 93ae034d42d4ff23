//! A remote worker for the remote tier's end-to-end tests: a process of its own (run in a
//! network namespace of a "GPU node") that talks to a memory node's marud through
//! `maru_remote::RemoteClient` (real NIXL), or speaks the raw control protocol, and prints one
//! JSON line per result.
//!
//! Commands (URL is `HOST:PORT`; the token is in `MARU_REMOTE_TOKEN`):
//! - `store URL NS KEY LEN SEED [START_AT_UNIX_MS]`: one store (started at a given moment for
//!   races); prints `{"stored": "created"|"already_present"}` or `{"error": ...}`.
//! - `batch URL NS PREFIX N LEN SEED`: `batch_store` of N entries `PREFIX-i`, then
//!   `batch_retrieve` of them; prints the outcomes and whether every value read back equals.
//! - `get URL NS KEY`: prints `{"len": N, "sum": CHECKSUM}` or `{"missing": true}`.
//! - `loop URL NS SECS`: stores and retrieves small entries for SECS seconds; prints counts of
//!   successes and failures, the longest call, and whether the last calls succeeded.
//! - `hold URL NS KEY`: raw protocol: reserves 4 MiB and protects KEY for reading, prints
//!   `{"held": true}`, then sleeps (to be killed).
//! - `raw URL JSON`: sends one hand-made frame body, prints the answer (or the error);
//!   `oversized URL`: a frame whose length is over the limit.
//! - `foreign URL NS KEY`: raw protocol: publishes a ticket it was never given.
//! - `reserve URL NS SIZE...`: raw protocol: one reservation; prints the pages or the error.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use maru_remote::proto::{self, Blob, Op, Outcome, Reply, Request};
use maru_remote::{RemoteClient, RemoteConfig, Stored};
use maru_tests::pattern;
use serde_json::json;

fn config(url: &str) -> RemoteConfig {
    RemoteConfig {
        url: url.to_owned(),
        token: std::env::var("MARU_REMOTE_TOKEN").unwrap_or_default(),
        node: std::env::var("MARU_REMOTE_NODE").unwrap_or_else(|_| "worker".into()),
        transfer_timeout: Duration::from_secs(3),
        retry: Duration::from_secs(1),
        control_timeout: Duration::from_secs(2),
        staging_bytes: 64 << 20,
        ..Default::default()
    }
}

/// FNV-1a over the bytes: what the test compares.
fn checksum(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3)
    })
}

fn say(v: serde_json::Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

fn stored(r: &maru_remote::client::Result<Stored>) -> serde_json::Value {
    match r {
        Ok(Stored::Created) => json!({"stored": "created"}),
        Ok(Stored::AlreadyPresent) => json!({"stored": "already_present"}),
        Err(e) => json!({"error": e.to_string()}),
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    match a.get(1..) {
        Some(["store", url, ns, key, len, seed, rest @ ..]) => {
            let c = match RemoteClient::connect(config(url)) {
                Ok(c) => c,
                Err(e) => {
                    say(json!({"error": e.to_string()}));
                    return Ok(());
                }
            };
            let value = pattern(seed.parse()?, len.parse()?);
            if let Some(at) = rest.first() {
                let at: u128 = at.parse()?;
                loop {
                    let now = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)?
                        .as_millis();
                    if now >= at {
                        break;
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
            say(stored(&c.store(ns, key, &value)));
        }
        Some(["batch", url, ns, prefix, n, len, seed]) => {
            let c = RemoteClient::connect(config(url))?;
            let (n, len, seed): (usize, usize, u64) = (n.parse()?, len.parse()?, seed.parse()?);
            let keys: Vec<String> = (0..n).map(|i| format!("{prefix}-{i}")).collect();
            let values: Vec<Vec<u8>> = (0..n).map(|i| pattern(seed + i as u64, len)).collect();
            let items: Vec<(&str, &[u8])> = keys
                .iter()
                .zip(&values)
                .map(|(k, v)| (k.as_str(), v.as_slice()))
                .collect();
            let outcomes: Vec<serde_json::Value> =
                c.batch_store(ns, &items)?.iter().map(stored).collect();
            let names: Vec<&str> = keys.iter().map(String::as_str).collect();
            let back = c.batch_retrieve(ns, &names)?;
            let equal = back
                .iter()
                .zip(&values)
                .all(|(b, v)| b.as_deref() == Some(v.as_slice()));
            say(json!({"outcomes": outcomes, "equal": equal}));
        }
        Some(["get", url, ns, key]) => {
            let c = RemoteClient::connect(config(url))?;
            match c.retrieve(ns, key)? {
                Some(v) => say(json!({"len": v.len(), "sum": checksum(&v)})),
                None => say(json!({"missing": true})),
            }
        }
        Some(["loop", url, ns, secs]) => run_loop(url, ns, secs.parse()?)?,
        Some(["hold", url, ns, key]) => hold(url, ns, key)?,
        Some(["foreign", url, ns, key]) => foreign(url, ns, key)?,
        Some(["reserve", url, ns, sizes @ ..]) => {
            let (mut s, g) = raw_session(url, "raw")?;
            raw_call(
                &mut s,
                2,
                g,
                Op::Mkdir {
                    ns: (*ns).into(),
                    mode: 0o755,
                },
            )?;
            let sizes = sizes
                .iter()
                .map(|x| x.parse())
                .collect::<Result<Vec<u64>, _>>()?;
            let op = Op::Reserve {
                ns: (*ns).into(),
                sizes,
            };
            match raw_call(&mut s, 3, g, op) {
                Ok(Reply::Reserved(p)) => say(json!({"pages": p.len()})),
                Ok(other) => say(json!({"unexpected": format!("{other:?}")})),
                Err(e) => say(json!({"error": e.to_string()})),
            }
        }
        Some([cmd @ ("raw" | "oversized"), url, body @ ..]) => {
            let mut s = TcpStream::connect(url)?;
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            let frame = if *cmd == "oversized" {
                // A length over the limit, and a little of a body.
                let mut f = ((proto::MAX_FRAME + 1) as u32).to_le_bytes().to_vec();
                f.extend_from_slice(b"{\"id\":1");
                f
            } else {
                let body = body.first().copied().unwrap_or_default();
                let mut f = (body.len() as u32).to_le_bytes().to_vec();
                f.extend_from_slice(body.as_bytes());
                f
            };
            s.write_all(&frame)?;
            let mut buf = Vec::new();
            match proto::read_frame(&mut s, &mut buf) {
                Ok(Some(())) => say(serde_json::from_slice(&buf)?),
                Ok(None) => say(json!({"closed": true})),
                Err(e) => say(json!({"error": e.to_string()})),
            }
            // Whether marud closed the connection after answering.
            let mut one = [0u8; 1];
            let closed = matches!(s.read(&mut one), Ok(0));
            say(json!({"closed_after": closed}));
        }
        _ => anyhow::bail!("usage: see the source's documentation"),
    }
    Ok(())
}

/// Stores and retrieves for `secs` seconds, surviving marud's restarts.
fn run_loop(url: &str, ns: &str, secs: u64) -> anyhow::Result<()> {
    let c = RemoteClient::connect(config(url))?;
    let (mut ok, mut failed, mut longest, mut last_ok) = (0u64, 0u64, Duration::ZERO, false);
    let end = Instant::now() + Duration::from_secs(secs);
    let mut i = 0u64;
    while Instant::now() < end {
        let key = format!("loop-{}-{i}", std::process::id());
        let value = pattern(i, 8192);
        let t = Instant::now();
        let r = c.store(ns, &key, &value).and_then(|_| c.retrieve(ns, &key));
        longest = longest.max(t.elapsed());
        match r {
            Ok(Some(v)) if v == value => {
                ok += 1;
                last_ok = true;
            }
            _ => {
                failed += 1;
                last_ok = false;
            }
        }
        i += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    let s = c.stats();
    say(json!({
        "ok": ok, "failed": failed, "longest_ms": longest.as_millis() as u64,
        "last_ok": last_ok, "reconnects": s.reconnects,
    }));
    Ok(())
}

/// A raw-protocol connection after its hello: the stream, the generation, the next id.
fn raw_session(url: &str, node: &str) -> anyhow::Result<(TcpStream, u64)> {
    let mut s = TcpStream::connect(url)?;
    let Reply::Hello(w) = raw_call(
        &mut s,
        1,
        0,
        Op::Hello {
            version: proto::VERSION,
            token: std::env::var("MARU_REMOTE_TOKEN").unwrap_or_default(),
            node: node.into(),
            metadata: Blob(Vec::new()),
        },
    )?
    else {
        anyhow::bail!("no welcome");
    };
    Ok((s, w.generation))
}

fn raw_call(s: &mut TcpStream, id: u64, generation: u64, op: Op) -> anyhow::Result<Reply> {
    proto::write_frame(s, &Request { id, generation, op })?;
    let mut buf = Vec::new();
    proto::read_frame(s, &mut buf)?.ok_or_else(|| anyhow::anyhow!("closed"))?;
    match proto::decode_response(&buf)?.outcome {
        Outcome::Ok(r) => Ok(r),
        Outcome::Err(w) => anyhow::bail!("{}: {}", w.kind, w.message),
    }
}

/// Raw protocol: publishes a ticket nobody gave it.
fn foreign(url: &str, ns: &str, key: &str) -> anyhow::Result<()> {
    let (mut s, g) = raw_session(url, "raw")?;
    raw_call(
        &mut s,
        2,
        g,
        Op::Mkdir {
            ns: ns.into(),
            mode: 0o755,
        },
    )?;
    let r = raw_call(
        &mut s,
        3,
        g,
        Op::Publish {
            ns: ns.into(),
            items: vec![proto::PublishItem {
                ticket: 123_456_789,
                key: key.into(),
                len: 4096,
            }],
        },
    )?;
    say(json!({ "published": match r {
        Reply::Published(p) => serde_json::to_value(p)?,
        other => json!({"unexpected": format!("{other:?}")}),
    }}));
    Ok(())
}

/// Raw protocol: hello, a reservation, a read protection; then sleeps holding them.
fn hold(url: &str, ns: &str, key: &str) -> anyhow::Result<()> {
    let (mut s, g) = raw_session(url, "holder")?;
    let op = Op::Reserve {
        ns: ns.into(),
        sizes: vec![4 << 20],
    };
    let Reply::Reserved(pages) = raw_call(&mut s, 2, g, op)? else {
        anyhow::bail!("no pages");
    };
    let op = Op::Lookup {
        ns: ns.into(),
        keys: vec![key.into()],
    };
    let Reply::Found(found) = raw_call(&mut s, 3, g, op)? else {
        anyhow::bail!("no lookup");
    };
    say(json!({"held": true, "pages": pages.len(), "found": found.iter().flatten().count()}));
    std::thread::sleep(Duration::from_secs(3600));
    Ok(())
}
