//! Prometheus metrics: `marud --metrics 127.0.0.1:9860` serves the text format at `/metrics`.

use std::fmt::Write;
use std::net::SocketAddr;
use std::sync::Arc;

use maru::proto::{LATENCY_BUCKETS_US, Stats};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::store::Store;

/// A per-pool gauge: name, help, how to read it.
type Gauge = (
    &'static str,
    &'static str,
    fn(&maru::proto::PoolInfo) -> u64,
);

fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn head(out: &mut String, name: &str, kind: &str, help: &str) {
    // Writing into a String cannot fail (here and below).
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Renders the store's statistics in the Prometheus text format (version 0.0.4).
pub fn render(s: &Stats) -> String {
    let mut o = String::new();
    head(
        &mut o,
        "maru_ops_total",
        "counter",
        "Control operations handled, by operation.",
    );
    for (op, n) in s.ops.iter().filter(|(k, _)| {
        !k.starts_with("fuse_")
            && !["errors", "lane_requests", "connections_refused"].contains(&k.as_str())
    }) {
        let _ = writeln!(o, "maru_ops_total{{op=\"{}\"}} {n}", esc(op));
    }
    for (name, op, help) in [
        (
            "maru_errors_total",
            "errors",
            "Control operations that failed.",
        ),
        (
            "maru_lane_requests_total",
            "lane_requests",
            "Control requests that came through a connection's shared-memory lane.",
        ),
        (
            "maru_connections_refused_total",
            "connections_refused",
            "Connections to the control socket refused: marud served --max-connections already.",
        ),
    ] {
        head(&mut o, name, "counter", help);
        let _ = writeln!(o, "{name} {}", s.ops.get(op).copied().unwrap_or(0));
    }
    head(
        &mut o,
        "maru_fuse_upcalls_total",
        "counter",
        "Requests from the kernel to the /maru filesystem, by operation.",
    );
    for (op, n) in s.ops.iter().filter(|(k, _)| k.starts_with("fuse_")) {
        let _ = writeln!(
            o,
            "maru_fuse_upcalls_total{{op=\"{}\"}} {n}",
            esc(&op["fuse_".len()..])
        );
    }
    head(
        &mut o,
        "maru_bytes_total",
        "counter",
        "Entry bytes by kind: stored, retrieved (socket), deleted, evicted.",
    );
    for (k, n) in &s.bytes {
        let _ = writeln!(o, "maru_bytes_total{{kind=\"{}\"}} {n}", esc(k));
    }
    head(
        &mut o,
        "maru_op_latency_seconds",
        "histogram",
        "Latency of control operations in the daemon, by operation.",
    );
    for (op, buckets) in &s.latency_us {
        let mut cum = 0;
        for (i, n) in buckets.iter().enumerate() {
            cum += n;
            let le = match LATENCY_BUCKETS_US.get(i) {
                Some(us) => format!("{}", *us as f64 / 1e6),
                None => "+Inf".into(),
            };
            let _ = writeln!(
                o,
                "maru_op_latency_seconds_bucket{{op=\"{}\",le=\"{le}\"}} {cum}",
                esc(op)
            );
        }
        let sum = s.latency_sum_us.get(op).copied().unwrap_or(0) as f64 / 1e6;
        let _ = writeln!(o, "maru_op_latency_seconds_sum{{op=\"{}\"}} {sum}", esc(op));
        let _ = writeln!(
            o,
            "maru_op_latency_seconds_count{{op=\"{}\"}} {cum}",
            esc(op)
        );
    }
    let gauges: [Gauge; 5] = [
        ("maru_pool_capacity_bytes", "Pool capacity.", |p| p.capacity),
        ("maru_pool_used_bytes", "Pool bytes in use.", |p| p.used),
        ("maru_pool_sealed_bytes", "Bytes of sealed entries.", |p| {
            p.sealed_bytes
        }),
        (
            "maru_pool_writing_bytes",
            "Bytes granted to writers, not yet published.",
            |p| p.writing_bytes,
        ),
        ("maru_pool_entries", "Sealed entries.", |p| p.entries),
    ];
    for (name, help, f) in gauges {
        head(&mut o, name, "gauge", help);
        for p in &s.pools {
            let _ = writeln!(
                o,
                "{name}{{pool=\"{}\",kind=\"{}\"}} {}",
                esc(&p.name),
                kind(p.kind),
                f(p)
            );
        }
    }
    head(
        &mut o,
        "maru_evictions_total",
        "counter",
        "Entries evicted, by pool.",
    );
    for p in &s.pools {
        let _ = writeln!(
            o,
            "maru_evictions_total{{pool=\"{}\"}} {}",
            esc(&p.name),
            p.evictions
        );
    }
    head(&mut o, "maru_namespaces", "gauge", "Namespaces.");
    let _ = writeln!(o, "maru_namespaces {}", s.namespaces.len());
    head(
        &mut o,
        "maru_clients",
        "gauge",
        "Connected control clients.",
    );
    let _ = writeln!(
        o,
        "maru_clients {}",
        s.clients.iter().filter(|c| c.session != 0).count()
    );
    head(
        &mut o,
        "maru_uptime_seconds",
        "gauge",
        "Seconds since marud started.",
    );
    let _ = writeln!(o, "maru_uptime_seconds {}", s.uptime_s);
    if let Some(c) = &s.cluster {
        head(
            &mut o,
            "maru_cluster_live",
            "gauge",
            "1 while this host holds its cluster lease (it may publish).",
        );
        let _ = writeln!(o, "maru_cluster_live {}", u8::from(c.live));
        head(
            &mut o,
            "maru_cluster_fenced",
            "gauge",
            "1 while this host is fenced off the shared pool (cut off, or catching up after).",
        );
        let _ = writeln!(o, "maru_cluster_fenced {}", u8::from(c.fenced));
        head(
            &mut o,
            "maru_cluster_hosts",
            "gauge",
            "Live hosts of the cluster.",
        );
        let live = c.hosts.iter().filter(|h| !h.gone).count();
        let _ = writeln!(o, "maru_cluster_hosts {live}");
        head(
            &mut o,
            "maru_cluster_orphaned_hosts",
            "gauge",
            "Hosts gone long enough that this host may evict their entries.",
        );
        let orphaned = c.hosts.iter().filter(|h| h.orphaned).count();
        let _ = writeln!(o, "maru_cluster_orphaned_hosts {orphaned}");
        head(
            &mut o,
            "maru_cluster_entries",
            "gauge",
            "Entries this host serves, by who published them.",
        );
        let _ = writeln!(
            o,
            "maru_cluster_entries{{origin=\"here\"}} {}",
            c.entries_here
        );
        let _ = writeln!(
            o,
            "maru_cluster_entries{{origin=\"elsewhere\"}} {}",
            c.entries_elsewhere
        );
        head(
            &mut o,
            "maru_cluster_uses_reported_total",
            "counter",
            "Uses of this host's entries other hosts reported (cluster-wide LRU).",
        );
        let _ = writeln!(o, "maru_cluster_uses_reported_total {}", c.uses_reported);
        head(
            &mut o,
            "maru_cluster_claimed_bytes",
            "gauge",
            "Bytes of the shared pool each host has claimed.",
        );
        for h in c.hosts.iter().filter(|h| !h.gone) {
            let _ = writeln!(
                o,
                "maru_cluster_claimed_bytes{{node=\"{}\"}} {}",
                esc(&h.node),
                h.claimed
            );
        }
        head(
            &mut o,
            "maru_cluster_host_entries",
            "gauge",
            "Entries each host published that this host serves (gone hosts' too).",
        );
        for h in &c.hosts {
            let _ = writeln!(
                o,
                "maru_cluster_host_entries{{node=\"{}\"}} {}",
                esc(&h.node),
                h.entries
            );
        }
    }
    if let Some(r) = &s.remote {
        remote(&mut o, r);
    }
    o
}

/// The remote door's counters and gauges (`maru_remote_*`).
fn remote(o: &mut String, r: &maru::proto::RemoteInfo) {
    let counters: [(&str, &str, u64); 11] = [
        (
            "maru_remote_connections_total",
            "Remote workers admitted by the door.",
            r.connections,
        ),
        (
            "maru_remote_refused_total",
            "Connections to the remote door refused (a bad token or hello, or closed before it).",
            r.refused,
        ),
        (
            "maru_remote_requests_total",
            "Control requests of remote workers after their hello.",
            r.requests,
        ),
        (
            "maru_remote_errors_total",
            "Control requests of remote workers answered with an error.",
            r.errors,
        ),
        (
            "maru_remote_pages_reserved_total",
            "Pages reserved for remote workers' writes.",
            r.pages_reserved,
        ),
        (
            "maru_remote_reserved_bytes_total",
            "Bytes of the pages reserved for remote workers' writes.",
            r.bytes_reserved,
        ),
        (
            "maru_remote_published_total",
            "Entries remote workers published.",
            r.published,
        ),
        (
            "maru_remote_lookups_total",
            "Lookup requests of remote workers.",
            r.lookups,
        ),
        (
            "maru_remote_protected_bytes_total",
            "Bytes of entries protected for remote workers' reads.",
            r.bytes_protected,
        ),
        (
            "maru_remote_expired_total",
            "Remote tickets (reservations, read protections) ended by their TTL.",
            r.expired,
        ),
        (
            "maru_remote_quarantined_total",
            "Pages quarantined after a remote worker's WRITE timed out.",
            r.quarantined,
        ),
    ];
    for (name, help, v) in counters {
        head(o, name, "counter", help);
        let _ = writeln!(o, "{name} {v}");
    }
    let gauges: [(&str, &str, u64); 3] = [
        (
            "maru_remote_workers",
            "Remote workers connected now.",
            r.workers.len() as u64,
        ),
        (
            "maru_remote_workers_reserved_bytes",
            "Bytes reserved by the connected remote workers, not yet published.",
            r.workers.iter().map(|w| w.reserved).sum(),
        ),
        (
            "maru_remote_workers_protected_bytes",
            "Bytes of entries the connected remote workers protect for reading now.",
            r.workers.iter().map(|w| w.protected).sum(),
        ),
    ];
    for (name, help, v) in gauges {
        head(o, name, "gauge", help);
        let _ = writeln!(o, "{name} {v}");
    }
}

fn kind(k: maru::proto::PoolKind) -> &'static str {
    match k {
        maru::proto::PoolKind::Memfs => "memfs",
        maru::proto::PoolKind::Devdax => "devdax",
        maru::proto::PoolKind::File => "file",
    }
}

/// Serves `/metrics` on `addr` until the task is dropped.
pub async fn serve(store: Arc<Store>, addr: SocketAddr) -> std::io::Result<()> {
    let l = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(%addr, "serving metrics");
    loop {
        let (mut s, _) = l.accept().await?;
        let store = store.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            let mut n = 0;
            // Read the request head (bounded).
            while n < buf.len() {
                match tokio::time::timeout(std::time::Duration::from_secs(5), s.read(&mut buf[n..]))
                    .await
                {
                    Ok(Ok(0)) | Err(_) | Ok(Err(_)) => break,
                    Ok(Ok(k)) => {
                        n += k;
                        if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                            break;
                        }
                    }
                }
            }
            let req = String::from_utf8_lossy(&buf[..n]);
            let path = req.split_whitespace().nth(1).unwrap_or("");
            let (status, ctype, body) =
                if req.starts_with("GET ") && (path == "/metrics" || path == "/") {
                    // The store's lock may be held a while: not on a tokio worker.
                    match tokio::task::spawn_blocking(move || render(&store.stats())).await {
                        Ok(text) => ("200 OK", "text/plain; version=0.0.4; charset=utf-8", text),
                        Err(e) => (
                            "500 Internal Server Error",
                            "text/plain",
                            format!("rendering the metrics failed: {e}\n"),
                        ),
                    }
                } else {
                    (
                        "404 Not Found",
                        "text/plain",
                        "not found: try /metrics\n".to_owned(),
                    )
                };
            let resp = format!(
                "HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            // A scraper that went away gets nothing; there is no one to tell.
            let _ = s.write_all(resp.as_bytes()).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_mode_adds_its_gauges() {
        let mut s: Stats = serde_json::from_value(serde_json::json!({
            "pools": [], "namespaces": [], "clients": [], "ops": {}, "eviction": "lru"
        }))
        .unwrap();
        assert!(!render(&s).contains("maru_cluster"));
        s.cluster = Some(Box::new(maru::proto::ClusterInfo {
            node: "b".into(),
            live: true,
            endpoints: vec!["http://127.0.0.1:2379".into()],
            hosts: vec![
                maru::proto::HostInfo {
                    node: "a\"x".into(),
                    address: "h".into(),
                    pid: 1,
                    claimed: 4 << 20,
                    entries: 5,
                    gone: false,
                    orphaned: false,
                },
                maru::proto::HostInfo {
                    node: "c".into(),
                    entries: 2,
                    gone: true,
                    orphaned: true,
                    ..Default::default()
                },
            ],
            entries_here: 3,
            entries_elsewhere: 7,
            uses_reported: 9,
            fenced: true,
        }));
        let text = render(&s);
        for line in [
            "maru_cluster_live 1",
            "maru_cluster_fenced 1",
            "maru_cluster_hosts 1",
            "maru_cluster_orphaned_hosts 1",
            "maru_cluster_entries{origin=\"here\"} 3",
            "maru_cluster_entries{origin=\"elsewhere\"} 7",
            "maru_cluster_uses_reported_total 9",
            "maru_cluster_claimed_bytes{node=\"a\\\"x\"} 4194304",
            "maru_cluster_host_entries{node=\"a\\\"x\"} 5",
            "maru_cluster_host_entries{node=\"c\"} 2",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
        }
        assert!(
            !text.contains("maru_cluster_claimed_bytes{node=\"c\"}"),
            "{text}"
        );
    }

    #[test]
    fn the_remote_door_adds_its_counters_and_gauges() {
        let mut s: Stats = serde_json::from_value(serde_json::json!({
            "pools": [], "namespaces": [], "clients": [], "ops": {}, "eviction": "lru"
        }))
        .unwrap();
        assert!(!render(&s).contains("maru_remote"));
        let worker = |reserved, protected| maru::proto::RemoteWorker {
            node: "gpu".into(),
            reserved,
            protected,
            ..Default::default()
        };
        s.remote = Some(Box::new(maru::proto::RemoteInfo {
            addr: "10.0.0.5:7860".into(),
            connections: 3,
            refused: 1,
            requests: 40,
            errors: 2,
            pages_reserved: 5,
            bytes_reserved: 5 << 20,
            published: 4,
            lookups: 6,
            bytes_protected: 7000,
            expired: 8,
            quarantined: 9,
            workers: vec![worker(4096, 0), worker(0, 100)],
            ..Default::default()
        }));
        let text = render(&s);
        for line in [
            "maru_remote_connections_total 3",
            "maru_remote_refused_total 1",
            "maru_remote_requests_total 40",
            "maru_remote_errors_total 2",
            "maru_remote_pages_reserved_total 5",
            "maru_remote_reserved_bytes_total 5242880",
            "maru_remote_published_total 4",
            "maru_remote_lookups_total 6",
            "maru_remote_protected_bytes_total 7000",
            "maru_remote_expired_total 8",
            "maru_remote_quarantined_total 9",
            "maru_remote_workers 2",
            "maru_remote_workers_reserved_bytes 4096",
            "maru_remote_workers_protected_bytes 100",
            "# TYPE maru_remote_workers gauge",
            "# TYPE maru_remote_published_total counter",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
        }
    }
}
