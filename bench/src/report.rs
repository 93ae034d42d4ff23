//! The report: Markdown tables, the JSON file, the charts, and the section of
//! doc/BENCHMARKS.md they regenerate.

use std::fmt::Write as _;
use std::path::Path;

use plotters::style::RGBColor;
use serde::Serialize;

use crate::cases::{ChurnRow, ContextRow, FanoutRow, MetaRow};
use crate::chart::{LineChart, Series, bars};
use crate::data;
use crate::stats::digits_for;
use crate::systems::System;

/// Where and how the suite ran.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    /// CPU model.
    pub cpu: String,
    /// CPUs online.
    pub cpus: usize,
    /// Memory, GiB.
    pub mem_gib: f64,
    /// Kernel release.
    pub kernel: String,
    /// Redis version.
    pub redis: String,
    /// UTC date and time of the run.
    pub date: String,
}

impl Machine {
    /// Reads this machine's description.
    pub fn here() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .map(|s| s.trim_start_matches([' ', '\t', ':']).to_string())
            .unwrap_or_else(|| "unknown".into());
        let mem_kib: f64 = std::fs::read_to_string("/proc/meminfo")
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|s| s.split_whitespace().next()?.parse().ok())
            .unwrap_or(0.0);
        let cmd = |c: &str, a: &[&str]| {
            std::process::Command::new(c)
                .args(a)
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
                .unwrap_or_default()
        };
        Machine {
            cpu,
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            mem_gib: mem_kib / (1 << 20) as f64,
            kernel: cmd("uname", &["-r"]),
            redis: cmd("redis-server", &["--version"])
                .split_whitespace()
                .find_map(|w| w.strip_prefix("v="))
                .unwrap_or("?")
                .to_string(),
            date: cmd("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
        }
    }
}

/// One target of the issue: measured against its goal.
#[derive(Debug, Clone, Serialize)]
pub struct Target {
    /// What is compared.
    pub what: String,
    /// Measured ratio.
    pub measured: f64,
    /// Goal.
    pub goal: f64,
    /// Whether higher is better.
    pub at_least: bool,
    /// Whether the goal is met.
    pub met: bool,
}

/// Everything one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Results {
    /// The machine.
    pub machine: Machine,
    /// Whether this was the short smoke run.
    pub quick: bool,
    /// Rounds per case.
    pub reps: usize,
    /// Context length case.
    pub context: Vec<ContextRow>,
    /// Fan-out case.
    pub fanout: Vec<FanoutRow>,
    /// Tokens each fan-out consumer retrieves.
    pub fanout_tokens: usize,
    /// Churn case.
    pub churn: Vec<ChurnRow>,
    /// Churn parameters: pool bytes, value bytes, operations.
    pub churn_params: (u64, usize, usize),
    /// Metadata case.
    pub metadata: Vec<MetaRow>,
    /// Targets.
    pub targets: Vec<Target>,
    /// Seconds the whole run took.
    pub seconds: f64,
}

/// Chart color of a system.
pub fn color(s: System) -> RGBColor {
    match s {
        System::MaruFs => RGBColor(214, 39, 40),
        System::Libmaru => RGBColor(255, 127, 14),
        System::Direct => RGBColor(127, 127, 127),
        System::Copy => RGBColor(140, 86, 75),
        System::Tcp => RGBColor(31, 119, 180),
        System::Redis => RGBColor(148, 103, 189),
    }
}

fn ctx(r: &Results, tokens: usize, s: System) -> Option<&ContextRow> {
    r.context
        .iter()
        .find(|c| c.tokens == tokens && c.system == s)
}

fn fan(r: &Results, n: usize, s: System) -> Option<&FanoutRow> {
    r.fanout.iter().find(|c| c.consumers == n && c.system == s)
}

/// The issue's targets, from the largest measured context up to 16K tokens and the largest
/// fan-out.
pub fn targets(r: &Results) -> Vec<Target> {
    let mut t = Vec::new();
    let mut push = |what: String, measured: f64, goal: f64, at_least: bool| {
        let met = if at_least {
            measured >= goal
        } else {
            measured <= goal
        };
        t.push(Target {
            what,
            measured,
            goal,
            at_least,
            met,
        });
    };
    let tokens = r
        .context
        .iter()
        .map(|c| c.tokens)
        .filter(|t| *t <= 16384)
        .max();
    if let Some(tk) = tokens {
        let l = data::tokens_label(tk);
        if let (Some(m), Some(tcp), Some(red), Some(d)) = (
            ctx(r, tk, System::MaruFs),
            ctx(r, tk, System::Tcp),
            ctx(r, tk, System::Redis),
            ctx(r, tk, System::Direct),
        ) {
            let a = m.addressable_ms.median;
            let ro = m.read_once_ms.median;
            push(
                format!("{l}: TCP ÷ /maru, until addressable"),
                tcp.addressable_ms.median / a,
                20.0,
                true,
            );
            push(
                format!("{l}: Redis ÷ /maru, until addressable"),
                red.addressable_ms.median / a,
                20.0,
                true,
            );
            push(
                format!("{l}: TCP ÷ /maru, until read once"),
                tcp.read_once_ms.median / ro,
                5.0,
                true,
            );
            push(
                format!("{l}: Redis ÷ /maru, until read once"),
                red.read_once_ms.median / ro,
                5.0,
                true,
            );
            push(
                format!("{l}: /maru ÷ direct mapping, until addressable"),
                a / d.addressable_ms.median,
                2.0,
                false,
            );
        }
    }
    if let Some(n) = r.fanout.iter().map(|f| f.consumers).max()
        && let (Some(m), Some(tcp)) = (fan(r, n, System::MaruFs), fan(r, n, System::Tcp))
    {
        push(
            format!("fan-out, {n} consumers: TCP wall ÷ /maru wall"),
            tcp.wall_ms.median / m.wall_ms.median,
            10.0,
            true,
        );
    }
    t
}

fn ms(s: &crate::stats::Stat) -> String {
    s.show(digits_for(s.median))
}

/// The Markdown report; charts are linked with `img_prefix` before their file names.
pub fn markdown(r: &Results, img_prefix: &str) -> String {
    let mut o = String::new();
    let m = &r.machine;
    let _ = writeln!(
        o,
        "Generated by `./target/release/maru-bench`{} on {} ({} × {}, {:.0} GiB, Linux {}, Redis {}); the whole run took {:.0} s. Every time is a median over {} rounds with [min–max]; within a round the systems run one after another in an order drawn anew each round (fixed seed), and the stored KV's pages are touched between two consumers, so that machine noise and the memory churn of the systems with big receive buffers hit them alike (BENCHMARKING.md).\n",
        if r.quick { " --quick" } else { "" },
        m.date,
        m.cpus,
        m.cpu,
        m.mem_gib,
        m.kernel,
        m.redis,
        r.seconds,
        r.reps
    );
    o.push_str("### Targets\n\n| target | measured | goal | |\n|---|---:|---:|---|\n");
    for t in &r.targets {
        let _ = writeln!(
            o,
            "| {} | {:.1}x | {}{}x | {} |",
            t.what,
            t.measured,
            if t.at_least { "≥ " } else { "≤ " },
            t.goal,
            if t.met { "met" } else { "**NOT met**" }
        );
    }
    o.push_str("\n### Context length: a second process gets the KV a first one stored\n\n");
    o.push_str("KV of a Llama-3.1-8B-shaped model (128 KiB per token in bf16) in 256-token chunks of 32 MiB, stored by the benchmark process, retrieved by a fresh consumer process. *Until addressable*: every chunk is mapped (or received) in the consumer with every page touched. *Until read once*: then every byte read once (the pass a copy to the GPU makes). The consumer's connection and receive buffer (faulted in) are ready before the clock starts. *Store*: the producer writing the chunks (through `/maru`, or Redis SET); the TCP producer keeps its KV in its own memory.\n\n");
    let _ = writeln!(
        o,
        "![retrieve time until addressable vs context length]({img_prefix}context_addressable.png)\n![retrieve time until read once vs context length]({img_prefix}context_read_once.png)\n"
    );
    o.push_str("| context | KV | system | until addressable, ms | until read once, ms | consumer CPU, ms | store, ms |\n|---|---:|---|---:|---:|---:|---:|\n");
    for c in &r.context {
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {} | {} | {} |",
            data::tokens_label(c.tokens),
            data::size_label(c.bytes),
            c.system.label(),
            ms(&c.addressable_ms),
            ms(&c.read_once_ms),
            ms(&c.consumer_cpu_ms),
            c.store_ms
                .map(|v| format!("{v:.0}"))
                .unwrap_or_else(|| "–".into())
        );
    }
    o.push_str("\nRatios of medians (higher = maru faster; the last column: how far `/maru` is from mapping the pool's files directly):\n\n| context | TCP ÷ /maru (addressable) | Redis ÷ /maru (addressable) | TCP ÷ /maru (read once) | Redis ÷ /maru (read once) | /maru ÷ direct (addressable) | libmaru ÷ direct (addressable) |\n|---|---:|---:|---:|---:|---:|---:|\n");
    let mut tokens: Vec<usize> = r.context.iter().map(|c| c.tokens).collect();
    tokens.dedup();
    for t in tokens {
        let g = |s| ctx(r, t, s);
        if let (Some(mf), Some(lib), Some(d), Some(tcp), Some(red)) = (
            g(System::MaruFs),
            g(System::Libmaru),
            g(System::Direct),
            g(System::Tcp),
            g(System::Redis),
        ) {
            let a = mf.addressable_ms.median;
            let ro = mf.read_once_ms.median;
            let _ = writeln!(
                o,
                "| {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} |",
                data::tokens_label(t),
                tcp.addressable_ms.median / a,
                red.addressable_ms.median / a,
                tcp.read_once_ms.median / ro,
                red.read_once_ms.median / ro,
                a / d.addressable_ms.median,
                lib.addressable_ms.median / d.addressable_ms.median
            );
        }
    }
    let _ = writeln!(
        o,
        "\n### Fan-out: consumers retrieving the same {}-token KV ({}) at once\n\nAll consumers are started and ready, then released together. *Wall*: from the release until the last consumer holds the whole KV (every page touched). *CPU*: all consumers' CPU time together, and the serving process's (marud for maru, the TCP producer, redis-server; none for the limits). This machine has {} CPUs, so every system slows when more consumers share them; what differs is the work each consumer costs.\n",
        data::tokens_label(r.fanout_tokens),
        data::size_label(r.fanout_tokens / data::CHUNK_TOKENS * data::CHUNK_BYTES),
        m.cpus
    );
    let _ = writeln!(
        o,
        "![fan-out wall time vs consumers]({img_prefix}fanout_wall.png)\n![fan-out CPU time vs consumers]({img_prefix}fanout_cpu.png)\n"
    );
    o.push_str("| consumers | system | wall, ms | consumers' CPU, ms | server CPU, ms | CPU per consumer, ms |\n|---:|---|---:|---:|---:|---:|\n");
    for f in &r.fanout {
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {} | {:.1} |",
            f.consumers,
            f.system.label(),
            ms(&f.wall_ms),
            ms(&f.consumer_cpu_ms),
            ms(&f.server_cpu_ms),
            (f.consumer_cpu_ms.median + f.server_cpu_ms.median) / f.consumers as f64
        );
    }
    let (pool, value, ops) = r.churn_params;
    let _ = writeln!(
        o,
        "\n### Churn: mixed load with eviction active\n\nA pool of {} filled to 90% with {} entries, then {ops} operations from one client: 25% stores of new keys, 40% retrieves (mapped and every page touched, or GET), 25% exists, 10% deletes, over the most recent keys (some already evicted). maru evicts least-recently-used entries; Redis runs with the same `maxmemory` and `allkeys-lru`. The same operation sequence for every system.\n\n![churn throughput]({img_prefix}churn.png)\n",
        data::size_label(pool as usize),
        data::size_label(value)
    );
    o.push_str("| system | ops/s | store p50/p99 µs | retrieve p50/p99 µs | exists p50/p99 µs | delete p50/p99 µs | retrieve hits | evicted |\n|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for c in &r.churn {
        let cell = |name: &str| {
            c.per_op
                .iter()
                .find(|p| p.0 == name)
                .map(|p| format!("{:.0} / {:.0}", p.2, p.3))
                .unwrap_or_default()
        };
        let retrieves = c
            .per_op
            .iter()
            .find(|p| p.0 == "retrieve")
            .map_or(0, |p| p.1);
        let _ = writeln!(
            o,
            "| {} | {:.0} | {} | {} | {} | {} | {} of {} | {} |",
            c.system,
            c.ops_per_s,
            cell("store"),
            cell("retrieve"),
            cell("exists"),
            cell("delete"),
            c.retrieve_hits,
            retrieves,
            c.evicted
        );
    }
    let _ = writeln!(
        o,
        "\n### Metadata: exists, lookup, batch lookup\n\nOne client, random keys among those stored, calls back to back. A batch call counts its 64 keys.\n\n![metadata rates]({img_prefix}metadata.png)\n"
    );
    o.push_str("| operation | system | keys/s | p50 µs per call | p99 µs per call |\n|---|---|---:|---:|---:|\n");
    for mrow in &r.metadata {
        let _ = writeln!(
            o,
            "| {} | {} | {:.0} | {:.1} | {:.1} |",
            mrow.case, mrow.system, mrow.keys_per_s, mrow.p50_us, mrow.p99_us
        );
    }
    o
}

/// One line per system, from rows that each give (system, x, y).
fn per_system<T>(rows: &[T], point: impl Fn(&T) -> (System, f64, f64)) -> Vec<Series> {
    System::ALL
        .iter()
        .map(|&s| Series {
            name: s.label().into(),
            color: color(s),
            points: rows
                .iter()
                .map(&point)
                .filter(|p| p.0 == s)
                .map(|p| (p.1, p.2))
                .collect(),
        })
        .collect()
}

/// Draws every chart into `dir`.
pub fn charts(r: &Results, dir: &Path) -> anyhow::Result<()> {
    let tokens_label = |x: f64| data::tokens_label(x.round() as usize);
    let count_label = |x: f64| format!("{}", x.round() as usize);
    let contexts = if r.context.is_empty() {
        &[][..]
    } else {
        &[false, true][..]
    };
    for (file, title, read) in [
        (
            "context_addressable.png",
            "Retrieve KV in a second process: until addressable",
            false,
        ),
        (
            "context_read_once.png",
            "Retrieve KV in a second process: until every byte is read once",
            true,
        ),
    ]
    .into_iter()
    .filter(|c| contexts.contains(&c.2))
    {
        LineChart {
            title,
            x_desc: "context length, tokens (Llama-3.1-8B KV, 128 KiB per token)",
            y_desc: "time, ms (log scale)",
            x_label_of: &tokens_label,
            series: per_system(&r.context, |c| {
                let st = if read {
                    &c.read_once_ms
                } else {
                    &c.addressable_ms
                };
                (c.system, c.tokens as f64, st.median)
            }),
        }
        .draw(&dir.join(file))?;
    }
    for (file, title, y_desc, cpu) in [
        (
            "fanout_wall.png",
            "Fan-out: wall time until every consumer holds the KV",
            "wall time, ms (log scale)",
            false,
        ),
        (
            "fanout_cpu.png",
            "Fan-out: CPU time of consumers and server together",
            "CPU time, ms (log scale)",
            true,
        ),
    ]
    .into_iter()
    .filter(|_| !r.fanout.is_empty())
    {
        LineChart {
            title,
            x_desc: "consumer processes",
            y_desc,
            x_label_of: &count_label,
            series: per_system(&r.fanout, |f| {
                let v = if cpu {
                    f.consumer_cpu_ms.median + f.server_cpu_ms.median
                } else {
                    f.wall_ms.median
                };
                (f.system, f.consumers as f64, v)
            }),
        }
        .draw(&dir.join(file))?;
    }
    let churn_color = |s: &str| match s {
        "libmaru" => color(System::Libmaru),
        "maru-fs" => color(System::MaruFs),
        _ => color(System::Redis),
    };
    if !r.churn.is_empty() {
        bars(
            &dir.join("churn.png"),
            "Churn: mixed operations with eviction active",
            "operations per second (log scale)",
            &r.churn
                .iter()
                .map(|c| (c.system.clone(), c.ops_per_s, churn_color(&c.system)))
                .collect::<Vec<_>>(),
        )?;
    }
    if !r.metadata.is_empty() {
        bars(
            &dir.join("metadata.png"),
            "Metadata operations",
            "keys per second (log scale)",
            &r.metadata
                .iter()
                .map(|m| {
                    let c = if m.system.starts_with("Redis") {
                        color(System::Redis)
                    } else if m.system.starts_with("/maru") {
                        color(System::MaruFs)
                    } else {
                        color(System::Libmaru)
                    };
                    (format!("{}: {}", m.case, m.system), m.keys_per_s, c)
                })
                .collect::<Vec<_>>(),
        )?;
    }
    Ok(())
}

/// Markers around the generated section of doc/BENCHMARKS.md.
pub const BEGIN: &str = "<!-- maru-bench:begin (generated by ./target/release/maru-bench; edits here are overwritten) -->";
/// End marker.
pub const END: &str = "<!-- maru-bench:end -->";

/// Replaces the generated section of `doc` (or appends it) with `section`.
pub fn splice(doc: &str, section: &str) -> String {
    match (doc.find(BEGIN), doc.find(END)) {
        (Some(a), Some(b)) if a < b => {
            format!("{}{BEGIN}\n{section}{}", &doc[..a], &doc[b..])
        }
        _ => format!(
            "{}\n{BEGIN}\n{section}{END}\n",
            doc.trim_end_matches('\n').to_string() + "\n"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splice_replaces_only_the_generated_section() {
        let doc = "# B\n\nhand written\n";
        let once = splice(doc, "one\n");
        assert!(once.starts_with(doc));
        assert!(once.contains("one\n"));
        let twice = splice(&once, "two\n");
        assert!(twice.contains("two\n") && !twice.contains("one\n"));
        assert!(twice.starts_with(doc) && twice.ends_with(&format!("{END}\n")));
    }
}
