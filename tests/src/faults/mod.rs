//! A fault harness for the cluster mode: a seeded random workload on every host of a
//! cluster (three etcd members, marud hosts in network and mount namespaces of their own,
//! one `file:` pool), faults applied at random meanwhile ([`nemesis`]), every operation
//! recorded ([`history`]), and a checker of the history and of the pool after the cluster
//! has healed ([`check`]). See doc/RELIABILITY.md, "Cluster faults".

pub mod check;
pub mod env;
pub mod history;
pub mod nemesis;
pub mod workload;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use history::{History, Kind, Op, Outcome};

/// One run's parameters.
#[derive(Debug, Clone)]
pub struct Config {
    pub seed: u64,
    pub duration: Duration,
    pub faults: Vec<nemesis::Kind>,
    pub hosts: usize,
    /// Clients per host, through libmaru.
    pub clients: usize,
    /// Clients per host through the mount, besides.
    pub mount_clients: usize,
    pub keys: u64,
    pub ttl: Duration,
    /// How long after the faults stop every host's view must agree.
    pub converge: Duration,
    /// Whether to check that no space is lost (delete everything, fill the pool). The CI
    /// test leaves it out: it finds space held without faults too, an open finding.
    pub check_space: bool,
    /// Where a run with violations, or one whose views converged later than promised
    /// ([`PROMISED_CONVERGENCE`]), is kept for reading ([`keep`]); with it, the hosts log
    /// every change the cluster makes to an entry (`maru_daemon::cluster` at debug).
    pub keep: Option<PathBuf>,
    /// Keep every run there, with violations or not.
    pub keep_all: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            seed: 1,
            duration: Duration::from_secs(20),
            faults: nemesis::Kind::ALL.to_vec(),
            hosts: 3,
            clients: 2,
            mount_clients: 1,
            keys: 32,
            ttl: Duration::from_secs(2),
            converge: Duration::from_secs(5),
            check_space: true,
            keep: None,
            keep_all: false,
        }
    }
}

/// What a run did and found.
#[derive(Debug, Default)]
pub struct Report {
    pub seed: u64,
    /// Operations by kind: (all, acknowledged or found).
    pub ops: BTreeMap<String, (u64, u64)>,
    pub faults: BTreeMap<String, u64>,
    /// Each fault in order: kind, target, and when it began and ended (seconds into the run).
    pub sequence: Vec<String>,
    /// How long after healing every host's view agreed.
    pub converged: Option<Duration>,
    /// How long after healing the last client's operation ended (the clients stop then).
    pub clients_stopped: Option<Duration>,
    /// The slowest operations (over a second), slowest first: host, kind, key, when it began
    /// (seconds into the run), how long it took, its outcome.
    pub slowest: Vec<String>,
    /// Pool bytes a fill of 8 MiB entries could not use after everything was deleted.
    pub unusable: Option<u64>,
    /// How long after everything was deleted the fill found the whole pool usable.
    pub space_back: Option<Duration>,
    /// Each partition's recovery.
    pub recoveries: Vec<check::Recovery>,
    pub violations: Vec<String>,
}

impl Report {
    /// The keys the violations name (`ns/k7`).
    pub fn keys(&self) -> std::collections::BTreeSet<String> {
        let prefix = format!("{}/k", workload::NS);
        let mut keys = std::collections::BTreeSet::new();
        for v in &self.violations {
            for (at, _) in v.match_indices(&prefix) {
                let digits = v[at + prefix.len()..]
                    .chars()
                    .take_while(char::is_ascii_digit)
                    .count();
                if digits > 0 {
                    keys.insert(v[at..at + prefix.len() + digits].to_owned());
                }
            }
        }
        keys
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ops: Vec<String> = self
            .ops
            .iter()
            .map(|(k, (n, ok))| format!("{k} {n} ({ok} ok)"))
            .collect();
        let faults: Vec<String> = self
            .faults
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        writeln!(f, "seed {}: ops: {}", self.seed, ops.join(", "))?;
        writeln!(f, "  faults: {}", faults.join(", "))?;
        if !self.sequence.is_empty() {
            writeln!(f, "  in order: {}", self.sequence.join(", "))?;
        }
        writeln!(
            f,
            "  converged after healing in {:?} (the clients stopped after {:?}); pool bytes \
             unusable after the run: {:?}, the whole pool usable {:?} after the deletes",
            self.converged, self.clients_stopped, self.unusable, self.space_back
        )?;
        if !self.slowest.is_empty() {
            writeln!(f, "  slowest operations: {}", self.slowest.join("; "))?;
        }
        if !self.recoveries.is_empty() {
            let r: Vec<String> = self
                .recoveries
                .iter()
                .map(|r| {
                    let published = match r.published_for {
                        Some(d) => format!("stores acknowledged up to {d:?} after the cut"),
                        None => "no store acknowledged after the cut".into(),
                    };
                    let mut released = match (r.released, r.alive_at) {
                        (Some(d), Some(a)) => {
                            format!("claims released between {a:?} and {d:?} after it")
                        }
                        (Some(d), None) => format!("claims released by {d:?} after it"),
                        (None, _) => "claims not released while cut".into(),
                    };
                    if let Some(e) = r.elected {
                        released.push_str(&format!(" (etcd's new leader elected {e:?} after it)"));
                    }
                    format!("{}: {published}, {released}", r.host)
                })
                .collect();
            writeln!(f, "  partitions: {}", r.join("; "))?;
        }
        write!(f, "  violations: {}", self.violations.len())?;
        for v in &self.violations {
            write!(f, "\n    {v}")?;
        }
        Ok(())
    }
}

/// Runs once; None when the environment cannot be made (no root, no etcd) outside CI.
pub fn run(cfg: &Config) -> Option<Report> {
    let t0 = Instant::now();
    let log = cfg
        .keep
        .as_ref()
        .map(|_| "info,maru_daemon::cluster=debug,maru_cluster::lease=debug,maru_cluster::detector=debug");
    let env = Arc::new(env::Env::start(cfg.hosts, cfg.ttl, log)?);
    eprintln!("seed {}: cluster up in {:?}", cfg.seed, t0.elapsed());
    let history = Arc::new(History::new());
    let stop = Arc::new(AtomicBool::new(false));
    // Namespaces are each host's own (a host creates one when another host's entry needs
    // it): made on every host before the clients start.
    for i in 0..cfg.hosts {
        let h = env.connect(i, Duration::from_secs(10)).expect("host");
        match h.mkdir(workload::NS, 0o777) {
            Ok(()) | Err(maru::Error::Exists(_)) => {}
            Err(e) => panic!("mkdir {} on h{i}: {e}", workload::NS),
        }
    }
    let mut clients = Vec::new();
    let per_host = cfg.clients + cfg.mount_clients;
    for host in 0..cfg.hosts {
        for k in 0..per_host {
            let door = if k < cfg.clients {
                workload::Door::Socket
            } else {
                let env = env.clone();
                workload::Door::Mount(Box::new(move |key: &str| {
                    env.hosts[host].lock().ok()?.mounted_path(key)
                }))
            };
            let c = workload::Client {
                id: (host * per_host + k) as u32,
                host,
                socket: env.socket(host),
                door,
                keys: cfg.keys,
                seed: cfg.seed,
            };
            let (history, stop) = (history.clone(), stop.clone());
            clients.push(std::thread::spawn(move || c.run(history, stop)));
        }
    }
    let until = Instant::now() + cfg.duration;
    nemesis::run(&env, &history, &cfg.faults, cfg.seed, until);
    let healed = Instant::now();
    stop.store(true, Ordering::Relaxed);
    let hung = stop_clients(&env, &history, &clients);
    for c in clients {
        c.join().expect("a client panicked");
    }
    let mut report = Report {
        seed: cfg.seed,
        clients_stopped: Some(healed.elapsed()),
        ..Default::default()
    };
    report.violations.extend(hung);
    let t1 = Instant::now();
    after(&env, cfg, &history, healed, &mut report);
    eprintln!(
        "seed {}: checked after the run in {:?}",
        cfg.seed,
        t1.elapsed()
    );
    let ops = history.ops.lock().expect("history").clone();
    for o in &ops {
        let mount = o.client != u32::MAX && o.client as usize % per_host >= cfg.clients;
        let kind = format!("{:?}{}", o.kind, if mount { " (mount)" } else { "" });
        let e = report.ops.entry(kind).or_default();
        e.0 += 1;
        if matches!(o.outcome, Outcome::Ok | Outcome::Read { .. }) {
            e.1 += 1;
        }
    }
    let mut slow: Vec<&Op> = ops
        .iter()
        .filter(|o| o.end.saturating_sub(o.start) > 1_000_000)
        .collect();
    slow.sort_by_key(|o| std::cmp::Reverse(o.end - o.start));
    report.slowest = slow
        .iter()
        .take(3)
        .map(|o| {
            format!(
                "h{} {:?} {} at {:.2} s took {:.2} s: {:?}",
                o.host,
                o.kind,
                o.key,
                o.start as f64 / 1e6,
                (o.end - o.start) as f64 / 1e6,
                o.outcome
            )
        })
        .collect();
    let faults = history.faults.lock().expect("history").clone();
    for f in &faults {
        *report.faults.entry(f.kind.clone()).or_default() += 1;
        let secs = |us: u64| us as f64 / 1e6;
        report.sequence.push(format!(
            "{} {} {:.2}-{:.2} s",
            f.kind,
            f.target,
            secs(f.start),
            secs(f.end)
        ));
    }
    let (recoveries, late) = check::recoveries(&ops, &faults, cfg.ttl);
    report.recoveries = recoveries;
    report.violations.extend(late);
    let lag = cfg.converge.as_micros() as u64;
    report.violations.extend(check::check(&ops, lag));
    // A run over the promise is kept too, though within the harness's bound: where its time
    // went is then read in its logs, not guessed.
    let slow = report.converged.is_some_and(|t| t > PROMISED_CONVERGENCE);
    if let Some(dir) = &cfg.keep
        && (cfg.keep_all || slow || !report.violations.is_empty())
    {
        keep(dir, &env, &report, &ops, &faults);
    }
    Some(report)
}

/// How soon after healing doc/CLUSTER.md promises every host's view agrees. The harness's
/// bound ([`Config::converge`]) is looser, for machines busier than the one the promise is
/// measured on; a run between the two passes and is kept ([`Config::keep`]).
pub const PROMISED_CONVERGENCE: Duration = Duration::from_secs(2);

/// How long the clients have to finish their last operation once the faults stop: longer than
/// any fault's effect lasts (a cut or a pause holds an operation for its TTL and a few seconds).
const STOP_BOUND: Duration = Duration::from_secs(60);

/// Waits for the clients to finish once the faults stopped. Clients still in an operation
/// [`STOP_BOUND`] later are hung (a liveness violation, one per operation, returned): every host
/// is then killed and restarted (a successor ends a predecessor stuck in its exit, aborting its
/// mount's requests), and the clients get as long again; a client still running then stops the
/// harness, which could neither check nor clean up.
fn stop_clients(
    env: &env::Env,
    history: &History,
    clients: &[std::thread::JoinHandle<()>],
) -> Vec<String> {
    let all_done = |limit: Duration| {
        let t = Instant::now();
        while clients.iter().any(|c| !c.is_finished()) {
            if t.elapsed() > limit {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        true
    };
    if all_done(STOP_BOUND) {
        return Vec::new();
    }
    let hung: Vec<String> = history
        .running()
        .into_iter()
        .map(|r| format!("hung: {r}, still running {STOP_BOUND:?} after the faults stopped"))
        .collect();
    eprintln!("{}", hung.join("\n"));
    for h in &env.hosts {
        let mut d = h.lock().expect("host");
        d.kill9();
        d.restart();
    }
    assert!(
        all_done(STOP_BOUND),
        "clients still running after every host was restarted: {:?}",
        history.running()
    );
    hung
}

/// A run with violations (or slow to converge), kept for reading ([`Config::keep`]): each host's marud log
/// (`seed<N>-h<i>.log`), each etcd member's (`seed<N>-m<i>.log`), and the faults and every operation on the keys the violations name,
/// in time order (`seed<N>-trace.txt`).
fn keep(dir: &Path, env: &env::Env, r: &Report, ops: &[Op], faults: &[history::Fault]) {
    use std::fmt::Write;
    let _ = std::fs::create_dir_all(dir);
    for (i, h) in env.hosts.iter().enumerate() {
        let log = h.lock().expect("host").log.clone();
        let _ = std::fs::copy(log, dir.join(format!("seed{}-h{i}.log", r.seed)));
    }
    let etcd = env.etcd.lock().expect("etcd");
    for m in 0..etcd.len() {
        let _ = std::fs::copy(etcd.log(m), dir.join(format!("seed{}-m{m}.log", r.seed)));
    }
    let mut out = String::new();
    for f in faults {
        let _ = writeln!(
            out,
            "fault {} {} {}..{} µs released {:?} (still held at {:?}) elected {:?}",
            f.kind, f.target, f.start, f.end, f.released, f.alive_at, f.elected
        );
    }
    let keys = r.keys();
    for o in ops.iter().filter(|o| keys.contains(&o.key)) {
        let _ = writeln!(
            out,
            "{} c{} h{} {:?} {} v{} {}..{} {:?}",
            o.key, o.client, o.host, o.kind, o.key, o.version, o.start, o.end, o.outcome
        );
    }
    let _ = std::fs::write(dir.join(format!("seed{}-trace.txt", r.seed)), out);
}

/// After the faults: convergence, the checker's reads on every host, extents, and the space.
fn after(env: &env::Env, cfg: &Config, history: &History, healed: Instant, r: &mut Report) {
    let hs: Vec<maru::Handler> = (0..cfg.hosts)
        .map(|i| {
            env.connect(i, Duration::from_secs(30))
                .expect("a host serves after healing")
        })
        .collect();
    let (live, before) = match converged(&hs, Duration::from_secs(30)) {
        Ok(agreed) => agreed,
        Err(d) => {
            r.violations.push(format!(
                "the hosts' views did not agree within 30 s of healing: {d}"
            ));
            return;
        }
    };
    let took = healed.elapsed();
    r.converged = Some(took);
    if took > cfg.converge {
        let before = before.map_or("they agreed at once".into(), |d| format!("until then: {d}"));
        r.violations.push(format!(
            "the hosts' views agreed {took:?} after healing (bound {:?}); {before}",
            cfg.converge
        ));
    }
    // Every key, read on every host.
    for (i, h) in hs.iter().enumerate() {
        for k in 0..cfg.keys {
            let key = workload::key(k);
            let start = history.now();
            let outcome = workload::read(h, &key);
            history.op(Op {
                client: u32::MAX,
                host: i,
                kind: Kind::Retrieve,
                key,
                version: 0,
                start,
                end: history.now(),
                outcome,
            });
        }
    }
    let spans = live
        .iter()
        .map(|(k, off, len)| (*off, *len, k.clone()))
        .collect();
    r.violations.extend(check::extents(spans, env::POOL_SIZE));
    // No space lost: everything deleted, the whole pool can be filled again.
    if !cfg.check_space {
        return;
    }
    // Fresh clients: the ones that read everything may keep what they read mapped.
    drop(hs);
    let hs: Vec<maru::Handler> = (0..cfg.hosts)
        .map(|i| env.connect(i, Duration::from_secs(10)).expect("a host"))
        .collect();
    // A delete that failed in the run (its answer lost) may still land, later: one of its
    // key found gone here is that delete's doing.
    let late: std::collections::BTreeSet<String> = history
        .ops
        .lock()
        .expect("history")
        .iter()
        .filter(|o| o.kind == Kind::Delete && matches!(o.outcome, Outcome::Failed(_)))
        .map(|o| o.key.clone())
        .collect();
    for (k, ..) in &live {
        match hs[0].delete(k) {
            Ok(()) => {}
            Err(maru::Error::NotFound(_)) if late.contains(k) => {
                eprintln!(
                    "seed {}: {k} went after the run (a delete that failed in it)",
                    cfg.seed
                );
            }
            Err(e) => r
                .violations
                .push(format!("deleting {k} after the run: {e}")),
        }
    }
    match converged(&hs, Duration::from_secs(10)) {
        Ok((v, _)) if v.is_empty() => {}
        Ok((v, _)) => {
            r.violations.push(format!(
                "after deleting everything, the hosts still list {v:?}"
            ));
            return;
        }
        Err(d) => {
            r.violations.push(format!(
                "after deleting everything, the hosts disagree: {d}"
            ));
            return;
        }
    }
    // The extents come back in the background once every host acknowledged the removals:
    // host 0 fills the pool at once, with entries of 8 MiB and then of one claim unit (2 MiB:
    // holes smaller than 8 MiB that the order of the frees left are not lost space), and
    // again every 250 ms while it falls short (or a store failed for now: etcd out of reach
    // a moment after a partition healed), for three TTLs and 5 s at most. How long the
    // whole pool took to come back is reported; what is left then is lost.
    let deleted = Instant::now();
    let unit = maru_cluster::UNIT;
    let filler = env.connect(0, Duration::from_secs(5)).expect("host 0");
    let capacity = filler
        .stats()
        .ok()
        .and_then(|s| s.pools.first().map(|p| p.capacity))
        .unwrap_or(env::POOL_SIZE);
    let mut filled = workload::Filled::default();
    loop {
        filled.more(&filler, "fill");
        if let Some(e) = filled.failed.take() {
            r.violations.push(format!("filling the pool: {e}"));
            break;
        }
        if capacity.saturating_sub(filled.bytes) < unit {
            r.space_back = Some(deleted.elapsed());
            break;
        }
        if deleted.elapsed() > 3 * cfg.ttl + Duration::from_secs(5) {
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let unusable = capacity.saturating_sub(filled.bytes);
    r.unusable = Some(unusable);
    // Not one claim unit is left over when nothing is lost.
    if unusable >= unit {
        // What holds it: claims of other hosts, or records of mappings.
        let held: Vec<String> = env
            .etcd_keys(&["regions/", "maps/"])
            .into_iter()
            .filter(|(k, v)| k.contains("/maps/") || v != "h0")
            .map(|(k, v)| format!("{k} = {v}"))
            .collect();
        let last = filled
            .transient
            .as_ref()
            .map(|e| format!(" (the last store failed: {e})"))
            .unwrap_or_default();
        r.violations.push(format!(
            "after deleting everything, {} entries filled {} bytes of the pool: {unusable} of \
             its {capacity} bytes could not be used{last}; etcd holds meanwhile {held:?}",
            filled.keys.len(),
            filled.bytes
        ));
    }
    for k in &filled.keys {
        let _ = filler.delete(k);
    }
}

/// Entries as a host lists them: name (with its namespace), offset, size.
type Listing = Vec<(String, u64, u64)>;
type View = Option<Listing>;

/// How the hosts' views differ: per host, what it lists that host 0 does not, and the reverse.
fn differ(views: &[View]) -> String {
    let Some(Some(first)) = views.first() else {
        return "host 0 does not list (fenced off the pool, or failing)".into();
    };
    let mut out = Vec::new();
    for (i, v) in views.iter().enumerate().skip(1) {
        let Some(v) = v else {
            out.push(format!(
                "h{i} does not list (fenced off the pool, or failing)"
            ));
            continue;
        };
        let extra: Vec<_> = v.iter().filter(|e| !first.contains(e)).collect();
        let missing: Vec<_> = first.iter().filter(|e| !v.contains(e)).collect();
        out.push(format!(
            "h{i} lists {extra:?} that h0 does not, and lacks {missing:?}"
        ));
    }
    out.join("; ")
}

/// A host's view: its entries (keys with their namespace), with where they lie
/// (generations are a host's own). None while the host is fenced off the shared pool (it
/// lists none of it then: an empty list is not its view).
fn view(h: &maru::Handler) -> View {
    let fenced = || {
        h.stats()
            .ok()
            .and_then(|s| s.cluster)
            .is_none_or(|c| c.fenced)
    };
    if fenced() {
        return None;
    }
    let (_, _, mut es) = h.list(workload::NS).ok()?;
    if fenced() {
        return None;
    }
    es.sort_by(|a, b| a.key.cmp(&b.key));
    Some(
        es.into_iter()
            .map(|e| (format!("{}/{}", workload::NS, e.key), e.offset, e.size))
            .collect(),
    )
}

/// Waits until every host lists the same entries; what they list (and how they differed
/// last before, if they did), or how they differ.
fn converged(hs: &[maru::Handler], limit: Duration) -> Result<(Listing, Option<String>), String> {
    let t = Instant::now();
    let mut before = None;
    loop {
        let views: Vec<View> = hs.iter().map(view).collect();
        if let Some(Some(first)) = views.first()
            && views.iter().all(|v| v.as_ref() == Some(first))
        {
            return Ok((first.clone(), before));
        }
        if t.elapsed() > limit {
            return Err(differ(&views));
        }
        before = Some(differ(&views));
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::Report;

    #[test]
    fn a_report_names_the_keys_its_violations_name_each_once() {
        let r = Report {
            violations: vec![
                "ns/k2: read two ways".into(),
                "the hosts' views did not agree: h1 lists [(\"ns/k26\", 1, 2)] that h0 does \
                 not, and lacks [(\"ns/k2\", 3, 4)]; h2 ns/kx"
                    .into(),
            ],
            ..Report::default()
        };
        let keys: Vec<String> = r.keys().into_iter().collect();
        assert_eq!(keys, ["ns/k2", "ns/k26"]);
    }
}
