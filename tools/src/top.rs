//! marutop's model and views: pool gauges, per-namespace and per-client usage, operation
//! rates and latency percentiles. Rendered with ratatui, or printed as CSV.

use std::collections::BTreeMap;
use std::time::Instant;

use maru::proto::{ClusterInfo, LATENCY_BUCKETS_US, RemoteInfo, Stats};
use maru::size::format_size;
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Borders, Gauge, Paragraph, Row, Table};

/// Which view to show.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum View {
    /// Everything.
    All,
    /// Pool gauges.
    Pool,
    /// Namespaces and clients.
    Usage,
    /// Operation rates and latency.
    Stats,
}

/// Per-operation figures over the last interval.
#[derive(Debug, Clone, PartialEq)]
pub struct OpRow {
    /// Operation.
    pub op: String,
    /// Operations per second.
    pub rate: f64,
    /// Operations since start.
    pub total: u64,
    /// Median latency (µs, bucket upper bound), over the interval (or since start).
    pub p50_us: Option<u64>,
    /// 99th percentile latency (µs, bucket upper bound).
    pub p99_us: Option<u64>,
}

/// Two snapshots and what they imply.
pub struct Model {
    /// The newest snapshot.
    pub cur: Stats,
    prev: Option<Stats>,
    /// Seconds between the two snapshots.
    pub dt: f64,
    /// When the newest was taken.
    pub at: Instant,
}

/// Upper bound of the bucket holding the q-quantile of `counts` (None if empty).
pub fn quantile(counts: &[u64], q: f64) -> Option<u64> {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return None;
    }
    let want = ((total as f64) * q).ceil().max(1.0) as u64;
    let mut acc = 0;
    for (i, c) in counts.iter().enumerate() {
        acc += c;
        if acc >= want {
            return Some(LATENCY_BUCKETS_US.get(i).copied().unwrap_or(u64::MAX));
        }
    }
    None
}

impl Model {
    /// A model from a first snapshot.
    pub fn new(s: Stats) -> Self {
        Model {
            cur: s,
            prev: None,
            dt: 0.0,
            at: Instant::now(),
        }
    }

    /// Adds a newer snapshot.
    pub fn push(&mut self, s: Stats) {
        let now = Instant::now();
        self.dt = now.duration_since(self.at).as_secs_f64();
        self.at = now;
        self.prev = Some(std::mem::replace(&mut self.cur, s));
    }

    /// Operation rows: rate over the interval, latency percentiles over the interval (or
    /// since start for the first snapshot).
    pub fn ops(&self) -> Vec<OpRow> {
        let mut out = Vec::new();
        for (op, &total) in &self.cur.ops {
            let before = self
                .prev
                .as_ref()
                .and_then(|p| p.ops.get(op))
                .copied()
                .unwrap_or(0);
            let rate = if self.dt > 0.0 {
                total.saturating_sub(before) as f64 / self.dt
            } else {
                0.0
            };
            let cur = self.cur.latency_us.get(op);
            let prev = self.prev.as_ref().and_then(|p| p.latency_us.get(op));
            let hist: Option<Vec<u64>> = cur.map(|c| match prev {
                Some(p) if c.iter().zip(p).any(|(a, b)| a > b) => {
                    c.iter().zip(p).map(|(a, b)| a.saturating_sub(*b)).collect()
                }
                _ => c.clone(),
            });
            out.push(OpRow {
                op: op.clone(),
                rate,
                total,
                p50_us: hist.as_deref().and_then(|h| quantile(h, 0.5)),
                p99_us: hist.as_deref().and_then(|h| quantile(h, 0.99)),
            });
        }
        out
    }

    /// Bytes per second by kind over the interval.
    pub fn byte_rates(&self) -> BTreeMap<String, f64> {
        self.cur
            .bytes
            .iter()
            .map(|(k, &v)| {
                let b = self
                    .prev
                    .as_ref()
                    .and_then(|p| p.bytes.get(k))
                    .copied()
                    .unwrap_or(0);
                let r = if self.dt > 0.0 {
                    v.saturating_sub(b) as f64 / self.dt
                } else {
                    0.0
                };
                (k.clone(), r)
            })
            .collect()
    }
}

fn pct(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

fn lat(v: Option<u64>) -> String {
    match v {
        None => "-".into(),
        Some(u64::MAX) => ">1s".into(),
        Some(us) if us >= 1000 => format!("<{}ms", us / 1000),
        Some(us) => format!("<{us}µs"),
    }
}

fn draw_pools(f: &mut Frame, area: Rect, m: &Model) {
    let block = Block::default().borders(Borders::ALL).title(" pools ");
    let inner = block.inner(area);
    f.render_widget(block, area);
    let n = m.cur.pools.len().max(1);
    let rows = Layout::vertical(vec![Constraint::Length(3); n]).split(inner);
    for (p, r) in m.cur.pools.iter().zip(rows.iter()) {
        let used = pct(p.used, p.capacity);
        let label = format!(
            "{} used of {} · free {} · {} entries · huge {:.0}% · evicted {}",
            format_size(p.used),
            format_size(p.capacity),
            format_size(p.capacity.saturating_sub(p.used)),
            p.entries,
            pct(p.huge_bytes, p.used.max(1)) * 100.0,
            p.evictions
        );
        let g = Gauge::default()
            .block(Block::default().title(format!("{} ({:?})", p.name, p.kind).to_lowercase()))
            .gauge_style(Style::default().fg(if used > 0.9 { Color::Red } else { Color::Green }))
            .ratio(used.clamp(0.0, 1.0))
            .label(label);
        f.render_widget(g, *r);
    }
}

/// Rows the pools view takes: a gauge per pool, in cluster mode a line per host, and on a
/// memory node a line per remote worker.
fn pools_height(m: &Model) -> u16 {
    let hosts = m
        .cur
        .cluster
        .as_ref()
        .map_or(0, |c| c.hosts.len() as u16 + 3);
    let workers = m
        .cur
        .remote
        .as_ref()
        .map_or(0, |r| r.workers.len() as u16 + 3);
    (m.cur.pools.len() as u16) * 3 + 2 + hosts + workers
}

/// The pools, and below them the cluster's hosts (cluster mode) and the remote door's workers
/// (a memory node).
fn draw_pools_and_hosts(f: &mut Frame, area: Rect, m: &Model) {
    let cluster = m.cur.cluster.as_deref();
    let remote = m.cur.remote.as_deref();
    let mut parts = vec![Constraint::Fill(1)];
    parts.extend(cluster.map(|c| Constraint::Length(c.hosts.len() as u16 + 3)));
    parts.extend(remote.map(|r| Constraint::Length(r.workers.len() as u16 + 3)));
    let areas = Layout::vertical(parts).split(area);
    draw_pools(f, areas[0], m);
    let mut below = areas.iter().skip(1);
    if let Some(c) = cluster
        && let Some(a) = below.next()
    {
        draw_hosts(f, *a, c);
    }
    if let Some(r) = remote
        && let Some(a) = below.next()
    {
        draw_remote(f, *a, r);
    }
}

/// The remote door (its address, generation, pool and counters in the title) and a line per
/// connected worker.
fn draw_remote(f: &mut Frame, area: Rect, r: &RemoteInfo) {
    let header = Row::new([
        "worker",
        "identity",
        "peer",
        "reserved",
        "protected",
        "requests",
        "errors",
    ])
    .style(Style::default().add_modifier(Modifier::BOLD));
    let rows = r.workers.iter().map(|w| {
        Row::new(vec![
            w.node.clone(),
            format!("{} ({}:{})", w.identity, w.uid, w.gid),
            w.peer.clone(),
            format_size(w.reserved),
            format_size(w.protected),
            w.requests.to_string(),
            w.errors.to_string(),
        ])
    });
    let t = Table::new(
        rows,
        [
            Constraint::Fill(2),
            Constraint::Fill(2),
            Constraint::Length(22),
            Constraint::Length(10),
            Constraint::Length(10),
            Constraint::Length(9),
            Constraint::Length(7),
        ],
    )
    .header(header)
    .block(
        Block::default()
            .borders(Borders::ALL)
            .title(format!(
                " remote door {} · generation {} · pool {} ",
                r.addr, r.generation, r.pool
            ))
            .title_bottom(format!(
                " {} connections · {} refused · {} requests · {} errors · {} published · {} lookups · {} expired · {} quarantined ",
                r.connections,
                r.refused,
                r.requests,
                r.errors,
                r.published,
                r.lookups,
                r.expired,
                r.quarantined
            )),
    );
    f.render_widget(t, area);
}

/// The cluster's hosts (live, then gone ones whose entries stay): what each claimed of the
/// shared pool and how many of its entries this host serves (its own, for this host).
fn draw_hosts(f: &mut Frame, area: Rect, c: &ClusterInfo) {
    let header = Row::new(["node", "host", "pid", "claimed", "entries"])
        .style(Style::default().add_modifier(Modifier::BOLD));
    let rows = c.hosts.iter().map(|h| {
        let (address, pid) = h.shown_address_pid();
        Row::new(vec![
            format!(
                "{}{}",
                h.node,
                if h.node == c.node { " (this host)" } else { "" }
            ),
            address,
            pid,
            format_size(h.claimed),
            c.entries_of(h).to_string(),
        ])
    });
    let t = Table::new(
        rows,
        [
            Constraint::Fill(2),
            Constraint::Fill(2),
            Constraint::Length(8),
            Constraint::Length(10),
            Constraint::Length(8),
        ],
    )
    .header(header)
    .block(Block::default().borders(Borders::ALL).title(format!(
        " cluster · node {} · {} · etcd {} ",
        c.node,
        if c.live { "lease held" } else { "lease lost" },
        c.endpoints.join(",")
    )));
    f.render_widget(t, area);
}

fn draw_usage(f: &mut Frame, area: Rect, m: &Model) {
    let [a, b] =
        Layout::vertical([Constraint::Percentage(50), Constraint::Percentage(50)]).areas(area);
    let header = Row::new(["namespace", "owner", "mode", "entries", "used"])
        .style(Style::default().add_modifier(Modifier::BOLD));
    let rows = m.cur.namespaces.iter().map(|n| {
        Row::new(vec![
            n.ns.clone(),
            n.uid.to_string(),
            format!("{:o}", n.mode),
            n.entries.to_string(),
            format_size(n.bytes),
        ])
    });
    let t = Table::new(
        rows,
        [
            Constraint::Fill(3),
            Constraint::Length(6),
            Constraint::Length(6),
            Constraint::Length(8),
            Constraint::Length(10),
        ],
    )
    .header(header)
    .block(Block::default().borders(Borders::ALL).title(" namespaces "));
    f.render_widget(t, a);
    let header = Row::new([
        "client",
        "pid",
        "uid",
        "allocated",
        "used",
        "slack",
        "leases",
    ])
    .style(Style::default().add_modifier(Modifier::BOLD));
    let rows = m.cur.clients.iter().map(|c| {
        Row::new(vec![
            c.name.clone(),
            c.pid.to_string(),
            c.uid.to_string(),
            format_size(c.allocated),
            format_size(c.used),
            format_size(c.slack),
            c.leases.to_string(),
        ])
    });
    let t = Table::new(
        rows,
        [
            Constraint::Fill(2),
            Constraint::Length(8),
            Constraint::Length(6),
            Constraint::Length(10),
            Constraint::Length(10),
            Constraint::Length(10),
            Constraint::Length(7),
        ],
    )
    .header(header)
    .block(Block::default().borders(Borders::ALL).title(" clients "));
    f.render_widget(t, b);
}

fn draw_stats(f: &mut Frame, area: Rect, m: &Model) {
    let header = Row::new(["operation", "ops/s", "total", "p50", "p99"])
        .style(Style::default().add_modifier(Modifier::BOLD));
    let rows = m.ops().into_iter().map(|o| {
        Row::new(vec![
            o.op,
            format!("{:.0}", o.rate),
            o.total.to_string(),
            lat(o.p50_us),
            lat(o.p99_us),
        ])
    });
    let bytes: Vec<String> = m
        .byte_rates()
        .into_iter()
        .map(|(k, r)| format!("{k} {}/s", format_size(r as u64)))
        .collect();
    let evictions: u64 = m.cur.pools.iter().map(|p| p.evictions).sum();
    let t = Table::new(
        rows,
        [
            Constraint::Fill(2),
            Constraint::Length(10),
            Constraint::Length(10),
            Constraint::Length(9),
            Constraint::Length(9),
        ],
    )
    .header(header)
    .block(
        Block::default()
            .borders(Borders::ALL)
            .title(" operations ")
            .title_bottom(format!(
                " {} · evictions {evictions} · eviction {} ",
                bytes.join(" · "),
                m.cur.eviction
            )),
    );
    f.render_widget(t, area);
}

/// Draws `view` of `m`.
pub fn draw(f: &mut Frame, view: View, m: &Model) {
    let [top, body] =
        Layout::vertical([Constraint::Length(1), Constraint::Fill(1)]).areas(f.area());
    // Cluster mode: this node, its lease, the hosts and the entries from elsewhere.
    let cluster = m.cur.cluster.as_ref().map_or(String::new(), |c| {
        format!(
            "node {}{} · {} hosts · {} entries from other hosts · ",
            c.node,
            if c.live { "" } else { " (lease lost)" },
            c.hosts.len(),
            c.entries_elsewhere
        )
    });
    // A memory node: its remote door and the workers connected to it.
    let door = m.cur.remote.as_ref().map_or(String::new(), |r| {
        format!("door {} · {} remote workers · ", r.addr, r.workers.len())
    });
    let title = Line::from(format!(
        " marutop · up {:.0}s · {cluster}{door}{} pools · {} namespaces · {} clients · [1] pools [2] usage [3] stats [a] all [q] quit",
        m.cur.uptime_s,
        m.cur.pools.len(),
        m.cur.namespaces.len(),
        m.cur.clients.iter().filter(|c| c.session != 0).count()
    ))
    .style(Style::default().add_modifier(Modifier::REVERSED));
    f.render_widget(Paragraph::new(title), top);
    match view {
        View::Pool => draw_pools_and_hosts(f, body, m),
        View::Usage => draw_usage(f, body, m),
        View::Stats => draw_stats(f, body, m),
        View::All => {
            let [a, b, c] = Layout::vertical([
                Constraint::Length(pools_height(m)),
                Constraint::Fill(1),
                Constraint::Fill(1),
            ])
            .areas(body);
            draw_pools_and_hosts(f, a, m);
            draw_usage(f, b, m);
            draw_stats(f, c, m);
        }
    }
}

/// CSV header of a view.
pub fn csv_header(view: View) -> &'static str {
    match view {
        View::Pool | View::All => "time,pool,kind,capacity,used,free,entries,evictions,huge_bytes",
        View::Usage => "time,kind,name,uid,allocated,used,slack,entries",
        View::Stats => "time,op,ops_per_s,total,p50_us,p99_us",
    }
}

/// CSV rows of one snapshot (one per pool / namespace and client / operation), stamped `t`.
pub fn csv_rows(view: View, m: &Model, t: f64) -> Vec<String> {
    let opt = |v: Option<u64>| v.map(|x| x.to_string()).unwrap_or_default();
    let q = |s: &str| {
        if s.contains([',', '"', '\n']) {
            format!("\"{}\"", s.replace('"', "\"\""))
        } else {
            s.to_owned()
        }
    };
    match view {
        View::Pool | View::All => m
            .cur
            .pools
            .iter()
            .map(|p| {
                format!(
                    "{t:.3},{},{},{},{},{},{},{},{}",
                    q(&p.name),
                    format!("{:?}", p.kind).to_lowercase(),
                    p.capacity,
                    p.used,
                    p.capacity.saturating_sub(p.used),
                    p.entries,
                    p.evictions,
                    p.huge_bytes
                )
            })
            .collect(),
        View::Usage => m
            .cur
            .namespaces
            .iter()
            .map(|n| {
                format!(
                    "{t:.3},namespace,{},{},,{},,{}",
                    q(&n.ns),
                    n.uid,
                    n.bytes,
                    n.entries
                )
            })
            .chain(m.cur.clients.iter().map(|c| {
                format!(
                    "{t:.3},client,{},{},{},{},{},",
                    q(&format!("{}#{}", c.name, c.session)),
                    c.uid,
                    c.allocated,
                    c.used,
                    c.slack
                )
            }))
            .collect(),
        View::Stats => m
            .ops()
            .into_iter()
            .map(|o| {
                format!(
                    "{t:.3},{},{:.1},{},{},{}",
                    q(&o.op),
                    o.rate,
                    o.total,
                    opt(o.p50_us),
                    opt(o.p99_us)
                )
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use maru::proto::{ClientInfo, NsInfo, PoolInfo, PoolKind};
    use ratatui::Terminal;
    use ratatui::backend::TestBackend;

    fn stats(publishes: u64) -> Stats {
        let mut lat = vec![0; LATENCY_BUCKETS_US.len() + 1];
        lat[3] = publishes;
        Stats {
            pools: vec![PoolInfo {
                id: 0,
                name: "pool0".into(),
                kind: PoolKind::Memfs,
                path: "/run/maru/pool0".into(),
                capacity: 8 << 30,
                mapped_len: 0,
                used: 6 << 30,
                sealed_bytes: 6 << 30,
                entries: 192,
                writing_bytes: 0,
                huge_bytes: 3 << 30,
                evictions: 7,
                coherence: None,
            }],
            namespaces: vec![NsInfo {
                ns: "llama3-70b".into(),
                uid: 1000,
                gid: 1000,
                mode: 0o750,
                entries: 192,
                bytes: 6 << 30,
                quota: None,
            }],
            clients: vec![ClientInfo {
                session: 3,
                name: "vllm-0".into(),
                pid: 4242,
                uid: 1000,
                allocated: 64 << 20,
                used: 6 << 30,
                slack: 2 << 20,
                leases: 5,
            }],
            ops: BTreeMap::from([("publish".into(), publishes), ("retrieve".into(), 10)]),
            eviction: "lru".into(),
            bytes: BTreeMap::from([("stored".into(), publishes * 1000)]),
            latency_us: BTreeMap::from([("publish".into(), lat)]),
            latency_sum_us: BTreeMap::new(),
            uptime_s: 12.0,
            cluster: None,
            remote: None,
        }
    }

    fn screen(view: View) -> String {
        let mut m = Model::new(stats(100));
        m.push(stats(300));
        let mut t = Terminal::new(TestBackend::new(110, 36)).unwrap();
        t.draw(|f| draw(f, view, &m)).unwrap();
        let buf = t.backend().buffer().clone();
        let mut s = String::new();
        for y in 0..buf.area.height {
            for x in 0..buf.area.width {
                s.push_str(buf[(x, y)].symbol());
            }
            s.push('\n');
        }
        s
    }

    #[test]
    fn the_title_shows_the_cluster() {
        let mut s = stats(100);
        s.cluster = Some(Box::new(maru::proto::ClusterInfo {
            node: "host-b".into(),
            live: false,
            hosts: vec![Default::default(), Default::default()],
            entries_elsewhere: 42,
            ..Default::default()
        }));
        let m = Model::new(s);
        let mut t = Terminal::new(TestBackend::new(200, 10)).unwrap();
        t.draw(|f| draw(f, View::Pool, &m)).unwrap();
        let line: String = (0..200)
            .map(|x| t.backend().buffer()[(x, 0)].symbol().to_owned())
            .collect();
        assert!(
            line.contains("node host-b (lease lost) · 2 hosts · 42 entries from other hosts"),
            "{line}"
        );
    }

    #[test]
    fn the_pools_view_lists_the_hosts() {
        let host = |node: &str, claimed: u64, entries: u64| maru::proto::HostInfo {
            node: node.into(),
            address: format!("{node}.lan"),
            pid: 7,
            claimed,
            entries,
            gone: false,
            orphaned: false,
        };
        let mut s = stats(100);
        s.cluster = Some(Box::new(maru::proto::ClusterInfo {
            node: "host-b".into(),
            live: true,
            endpoints: vec!["http://10.0.0.1:2379".into()],
            hosts: vec![
                host("host-a", 64 << 20, 12),
                host("host-b", 8 << 20, 0),
                maru::proto::HostInfo {
                    gone: true,
                    ..host("host-c", 0, 3)
                },
                maru::proto::HostInfo {
                    gone: true,
                    orphaned: true,
                    ..host("host-d", 0, 4)
                },
            ],
            entries_here: 5,
            entries_elsewhere: 12,
            ..Default::default()
        }));
        let m = Model::new(s);
        for view in [View::Pool, View::All] {
            let mut t = Terminal::new(TestBackend::new(120, 40)).unwrap();
            t.draw(|f| draw(f, view, &m)).unwrap();
            let screen: Vec<String> = (0..40)
                .map(|y| {
                    (0..120)
                        .map(|x| t.backend().buffer()[(x, y)].symbol().to_owned())
                        .collect()
                })
                .collect();
            let find = |what: &str| screen.iter().find(|l| l.contains(what)).cloned();
            let title = find("cluster · node host-b · lease held · etcd http://10.0.0.1:2379");
            assert!(title.is_some(), "{view:?}: {screen:#?}");
            let a = find("host-a.lan").expect("host-a's line");
            assert!(a.contains("64.0 MiB") && a.contains(" 12 "), "{a}");
            let b = find("host-b (this host)").expect("this host's line");
            assert!(b.contains("8.0 MiB") && b.contains(" 5 "), "{b}");
            let c = find("host-c").expect("the gone host's line");
            assert!(c.contains("(gone)") && c.contains(" 3 "), "{c}");
            let d = find("host-d").expect("the orphaned host's line");
            assert!(d.contains("(orphaned)") && d.contains(" 4 "), "{d}");
        }
    }

    #[test]
    fn the_pools_view_lists_the_remote_workers() {
        let worker = |node: &str, reserved: u64| maru::proto::RemoteWorker {
            id: 1,
            node: node.into(),
            identity: "gpu".into(),
            uid: 0,
            gid: 0,
            peer: format!("{node}.lan:40000"),
            reserved,
            protected: 8192,
            requests: 17,
            errors: 0,
        };
        let mut s = stats(100);
        s.remote = Some(Box::new(RemoteInfo {
            addr: "10.0.0.5:7860".into(),
            generation: "00c0ffee00c0ffee".into(),
            pool: "pool0".into(),
            connections: 4,
            published: 9,
            workers: vec![worker("gpu-1", 4 << 20), worker("gpu-2", 0)],
            ..Default::default()
        }));
        let m = Model::new(s);
        for view in [View::Pool, View::All] {
            let mut t = Terminal::new(TestBackend::new(140, 44)).unwrap();
            t.draw(|f| draw(f, view, &m)).unwrap();
            let screen: Vec<String> = (0..44)
                .map(|y| {
                    (0..140)
                        .map(|x| t.backend().buffer()[(x, y)].symbol().to_owned())
                        .collect()
                })
                .collect();
            let find = |what: &str| screen.iter().find(|l| l.contains(what)).cloned();
            assert!(
                screen[0].contains("door 10.0.0.5:7860 · 2 remote workers"),
                "{view:?}: {screen:#?}"
            );
            assert!(
                find("remote door 10.0.0.5:7860 · generation 00c0ffee00c0ffee · pool pool0")
                    .is_some(),
                "{view:?}: {screen:#?}"
            );
            assert!(find("4 connections").is_some_and(|l| l.contains("9 published")));
            let one = find("gpu-1.lan:40000").expect("gpu-1's line");
            assert!(
                one.contains("gpu (0:0)") && one.contains("4.0 MiB") && one.contains("8.0 KiB"),
                "{one}"
            );
            assert!(find("gpu-2.lan:40000").is_some(), "{screen:#?}");
        }
    }

    #[test]
    fn pool_view_shows_gauges() {
        let s = screen(View::Pool);
        assert!(s.contains("pool0 (memfs)"), "{s}");
        assert!(s.contains("6.0 GiB used of 8.0 GiB"), "{s}");
        assert!(s.contains("free 2.0 GiB"), "{s}");
        assert!(s.contains("huge 50%"), "{s}");
        assert!(s.contains("evicted 7"), "{s}");
    }

    #[test]
    fn usage_view_shows_namespaces_and_clients() {
        let s = screen(View::Usage);
        assert!(s.contains("llama3-70b") && s.contains("750"), "{s}");
        assert!(
            s.contains("vllm-0") && s.contains("4242") && s.contains("64.0 MiB"),
            "{s}"
        );
    }

    #[test]
    fn stats_view_shows_rates_and_latency() {
        let s = screen(View::Stats);
        assert!(s.contains("publish"), "{s}");
        assert!(s.contains("<50µs"), "{s}");
        assert!(s.contains("evictions 7"), "{s}");
    }

    #[test]
    fn all_view_and_csv() {
        let s = screen(View::All);
        assert!(s.contains("pools") && s.contains("namespaces") && s.contains("operations"));
        let m = Model::new(stats(1));
        let rows = csv_rows(View::Pool, &m, 1.5);
        assert_eq!(
            rows,
            vec!["1.500,pool0,memfs,8589934592,6442450944,2147483648,192,7,3221225472"]
        );
        assert_eq!(
            csv_header(View::Pool).split(',').count(),
            rows[0].split(',').count()
        );
        assert_eq!(csv_rows(View::Usage, &m, 0.0).len(), 2);
    }

    #[test]
    fn quantiles_from_buckets() {
        let mut h = vec![0; LATENCY_BUCKETS_US.len() + 1];
        h[2] = 98; // <= 25 µs
        h[6] = 2; // <= 500 µs
        assert_eq!(quantile(&h, 0.5), Some(25));
        assert_eq!(quantile(&h, 0.99), Some(500));
        assert_eq!(quantile(&[0; 15], 0.5), None);
        h[14] = 1000;
        assert_eq!(quantile(&h, 0.99), Some(u64::MAX));
    }
}
