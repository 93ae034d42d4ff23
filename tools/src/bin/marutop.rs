//! marutop: a live view of marud, like top — pools, usage, operations — and, as in
//! `maructl device`, the header of a devdax or file: pool (`marutop device init|show|clear`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use maru_tools::ctl;
use maru_tools::top::{self, Model, View};
use ratatui::crossterm::event::{self, Event, KeyCode, KeyModifiers};

/// The options of the views (`marutop device` takes them and ignores them).
const VIEW: &str = "View options";

/// marutop: watch marud live (a terminal UI), or print CSV snapshots (`--csv`); all views
/// when no command is given.
#[derive(Parser)]
#[command(name = "marutop", version)]
struct Cli {
    /// marud's control socket.
    #[arg(
        long,
        global = true,
        env = "MARU_SOCKET",
        default_value = maru::DEFAULT_SOCKET,
        help_heading = VIEW
    )]
    socket: PathBuf,
    /// Seconds between snapshots.
    #[arg(long, short = 'd', global = true, default_value_t = 1.0, help_heading = VIEW)]
    interval: f64,
    /// Print CSV lines instead of the terminal UI (also when stdout is not a terminal).
    #[arg(long, global = true, help_heading = VIEW)]
    csv: bool,
    /// Stop after this many snapshots.
    #[arg(long, short = 'n', global = true, help_heading = VIEW)]
    count: Option<u64>,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Pool gauges: capacity, used, free, huge-page share, evictions.
    Pool,
    /// Per-namespace and per-client usage (allocated, used, slack).
    Usage,
    /// Operation rates and latency percentiles.
    Stats,
    /// The header of a devdax or file: pool, as `maructl device` (no daemon needed; refused
    /// while marud uses it).
    #[command(after_help = ctl::EXIT_CODES)]
    Device {
        #[command(flatten)]
        args: ctl::DeviceArgs,
        /// Print one JSON document (for scripts).
        #[arg(long)]
        json: bool,
    },
}

fn connect(socket: &std::path::Path) -> anyhow::Result<maru::Handler> {
    maru::Handler::connect(maru::Config {
        socket: socket.to_owned(),
        client_name: "marutop".into(),
        cache_entries: 0,
        ..Default::default()
    })
    .map_err(|e| anyhow::anyhow!("cannot reach marud at {}: {e}", socket.display()))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let view = match &cli.cmd {
        None => View::All,
        Some(Cmd::Pool) => View::Pool,
        Some(Cmd::Usage) => View::Usage,
        Some(Cmd::Stats) => View::Stats,
        Some(Cmd::Device { args, json }) => {
            return ctl::finish("marutop", *json, args.run().map(Some));
        }
    };
    let interval = Duration::from_secs_f64(cli.interval.max(0.05));
    let r = if cli.csv || !std::io::IsTerminal::is_terminal(&std::io::stdout()) {
        csv(&cli, view, interval)
    } else {
        tui(&cli, view, interval)
    };
    if let Err(e) = r {
        eprintln!("marutop: {e:#}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

fn csv(cli: &Cli, view: View, interval: Duration) -> anyhow::Result<()> {
    use std::io::Write;
    let h = connect(&cli.socket)?;
    let start = Instant::now();
    let mut model = Model::new(h.stats()?);
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", top::csv_header(view))?;
    let mut n = 0;
    loop {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        for row in top::csv_rows(view, &model, t) {
            writeln!(out, "{row}")?;
        }
        out.flush()?;
        n += 1;
        if cli.count.is_some_and(|c| n >= c) {
            return Ok(());
        }
        let next = interval * (n as u32);
        std::thread::sleep(next.saturating_sub(start.elapsed()));
        model.push(h.stats()?);
    }
}

fn tui(cli: &Cli, mut view: View, interval: Duration) -> anyhow::Result<()> {
    let h = connect(&cli.socket)?;
    let mut model = Model::new(h.stats()?);
    let mut terminal = ratatui::init();
    let r = (|| -> anyhow::Result<()> {
        let mut n = 0;
        let mut next = Instant::now() + interval;
        loop {
            terminal.draw(|f| top::draw(f, view, &model))?;
            let wait = next.saturating_duration_since(Instant::now());
            if event::poll(wait)? {
                if let Event::Key(k) = event::read()? {
                    match k.code {
                        KeyCode::Char('q') | KeyCode::Esc => return Ok(()),
                        KeyCode::Char('c') if k.modifiers.contains(KeyModifiers::CONTROL) => {
                            return Ok(());
                        }
                        KeyCode::Char('1') => view = View::Pool,
                        KeyCode::Char('2') => view = View::Usage,
                        KeyCode::Char('3') => view = View::Stats,
                        KeyCode::Char('a') => view = View::All,
                        _ => {}
                    }
                }
                continue;
            }
            next += interval;
            model.push(h.stats()?);
            n += 1;
            if cli.count.is_some_and(|c| n >= c) {
                return Ok(());
            }
        }
    })();
    ratatui::restore();
    r
}
