//! `maru-bench`: the benchmark suite. maru (through `/maru` and libmaru) against the limits
//! (direct mapping of the pool's files, `read()` of them) and what users would pick instead
//! (a loopback TCP transfer, Redis), on the same bytes, in one run, with a Markdown table,
//! a JSON file and PNG charts. See doc/BENCHMARKS.md.

mod cases;
mod chart;
mod data;
mod report;
mod servers;
mod stats;
mod systems;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;

use maru_tools::env::PrivateDaemon;

/// The maru benchmark suite: starts its own daemon on a temporary pool and mount, and its own
/// Redis, runs every case and writes results.md, results.json and the charts.
#[derive(Parser, Debug)]
#[command(version)]
struct Cli {
    /// Where to write results.md, results.json and the PNG charts.
    #[arg(long, default_value = "doc/bench")]
    out: PathBuf,
    /// The document whose generated section is replaced with the results (skipped when it
    /// does not exist).
    #[arg(long, default_value = "doc/BENCHMARKS.md")]
    doc: PathBuf,
    /// Do not touch the document.
    #[arg(long)]
    no_doc: bool,
    /// A short smoke run (small contexts, few rounds; about a minute). Implies --no-doc.
    #[arg(long)]
    quick: bool,
    /// Rounds per case (default 5; 3 at 32K tokens and for fan-out).
    #[arg(long)]
    reps: Option<usize>,
    /// Context lengths in tokens, comma-separated (default 1024,4096,16384,32768).
    #[arg(long, value_delimiter = ',')]
    tokens: Option<Vec<usize>>,
    /// Cases to run, comma-separated: context, fanout, churn, metadata (default all).
    #[arg(long, value_delimiter = ',')]
    only: Option<Vec<String>>,
    /// An extra flag for the benchmark's marud (repeatable), e.g. `--marud-arg=--nice=0`.
    #[arg(long, allow_hyphen_values = true)]
    marud_arg: Vec<String>,
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("__consume") => {
            return systems::consume_main(args.get(2).context("spec")?);
        }
        Some("__tcp-kv") => {
            let n = args.get(2).context("chunks")?.parse()?;
            let b = args.get(3).context("chunk bytes")?.parse()?;
            return servers::tcp_kv_main(n, b);
        }
        _ => {}
    }
    let cli = Cli::parse();
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    anyhow::ensure!(
        euid == 0,
        "maru-bench mounts a tmpfs pool and a FUSE filesystem: run it as root"
    );
    chart::init_fonts()?;
    run(&cli)
}

struct Plan {
    tokens: Vec<usize>,
    reps: usize,
    big_reps: usize,
    fanout_tokens: usize,
    consumers: Vec<usize>,
    fanout_reps: usize,
    churn: (u64, usize, usize),
    meta: (usize, usize),
}

impl Plan {
    fn new(cli: &Cli) -> Plan {
        if cli.quick {
            let r = cli.reps.unwrap_or(2);
            return Plan {
                tokens: vec![256, 512],
                reps: r,
                big_reps: r,
                fanout_tokens: 512,
                consumers: vec![1, 2],
                fanout_reps: r,
                churn: (64 << 20, 1 << 20, 300),
                meta: (200, 2_000),
            };
        }
        let r = cli.reps.unwrap_or(5);
        Plan {
            tokens: cli
                .tokens
                .clone()
                .unwrap_or_else(|| vec![1024, 4096, 16384, 32768]),
            reps: r,
            big_reps: r.min(3),
            fanout_tokens: 4096,
            consumers: vec![1, 2, 4, 8],
            fanout_reps: r.min(3),
            churn: (1 << 30, 1 << 20, 20_000),
            meta: (1_000, 50_000),
        }
    }
}

fn run(cli: &Cli) -> anyhow::Result<()> {
    let start = Instant::now();
    let plan = Plan::new(cli);
    let tmp = tempfile::Builder::new()
        .prefix("maru-bench-")
        .tempdir_in("/tmp")?;
    let max_tokens = plan.tokens.iter().copied().max().unwrap_or(0);
    let pool_bytes = (max_tokens + plan.fanout_tokens) * data::BYTES_PER_TOKEN + (1 << 30);
    let mut marud_args = vec!["--eviction", "off"];
    marud_args.extend(cli.marud_arg.iter().map(String::as_str));
    let daemon = PrivateDaemon::start_with(
        tmp.path(),
        "maru",
        &[&format!("memfs:{{dir}}/pool,size={pool_bytes}")],
        true,
        &marud_args,
    )?;
    let wants = |case: &str| {
        cli.only
            .as_ref()
            .is_none_or(|o| o.iter().any(|c| c == case))
    };
    let env = cases::Env {
        mount: daemon.mount.clone().context("mount")?,
        pool: daemon.pool_dirs.first().cloned().context("pool")?,
        redis: servers::Redis::start(&tmp.path().join("redis"), None)?,
        daemon,
        dir: tmp.path().to_owned(),
    };
    let mut context = Vec::new();
    if wants("context") {
        for &t in &plan.tokens {
            let reps = if t > 16384 { plan.big_reps } else { plan.reps };
            context.extend(cases::context(&env, &[t], reps)?);
        }
    }
    let fanout = if wants("fanout") {
        cases::fanout(&env, plan.fanout_tokens, &plan.consumers, plan.fanout_reps)?
    } else {
        Vec::new()
    };
    let metadata = if wants("metadata") {
        cases::metadata(&env, plan.meta.0, plan.meta.1)?
    } else {
        Vec::new()
    };
    let (pool, value, ops) = plan.churn;
    let churn = if wants("churn") {
        cases::churn(&env.dir, pool, value, ops)?
    } else {
        Vec::new()
    };
    drop(env);
    let mut results = report::Results {
        machine: report::Machine::here(),
        quick: cli.quick,
        reps: plan.reps,
        context,
        fanout,
        fanout_tokens: plan.fanout_tokens,
        churn,
        churn_params: plan.churn,
        metadata,
        targets: Vec::new(),
        seconds: 0.0,
    };
    results.targets = report::targets(&results);
    results.seconds = start.elapsed().as_secs_f64();

    std::fs::create_dir_all(&cli.out)?;
    report::charts(&results, &cli.out)?;
    std::fs::write(
        cli.out.join("results.json"),
        serde_json::to_vec_pretty(&results)?,
    )?;
    let md = report::markdown(&results, "");
    std::fs::write(
        cli.out.join("results.md"),
        format!("# maru-bench results\n\n{md}"),
    )?;
    println!("{md}");
    let complete = cli.only.is_none() && cli.tokens.is_none();
    if !cli.quick && !cli.no_doc && complete && cli.doc.exists() {
        let doc_dir = cli.doc.parent().unwrap_or(std::path::Path::new("."));
        let out_abs = std::fs::canonicalize(&cli.out)?;
        let doc_abs = std::fs::canonicalize(doc_dir)?;
        let prefix = match out_abs.strip_prefix(&doc_abs) {
            Ok(rel) => format!("{}/", rel.display()),
            Err(_) => format!("{}/", out_abs.display()),
        };
        let section = report::markdown(&results, &prefix);
        let doc = std::fs::read_to_string(&cli.doc)?;
        std::fs::write(&cli.doc, report::splice(&doc, &section))?;
        eprintln!("updated {}", cli.doc.display());
    }
    eprintln!(
        "wrote {}/results.md, results.json and 6 charts in {:.0} s",
        cli.out.display(),
        results.seconds
    );
    Ok(())
}
