//! maructl's commands: each talks to marud through libmaru (or, for `device`, to the device
//! header directly) and prints for people or, with `--json`, one JSON document for scripts.
//! `marutop device` runs the same `device` command through the same [`DeviceArgs`] and
//! [`finish`].

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use maru::Error;
use maru::format::{self, DevHeader, HeaderError};
use maru::size::format_size;
use serde_json::{Value, json};

/// The exit codes and the `--json` error form, as `maructl --help` and `marutop device --help`
/// show them (and doc/OPERATIONS.md).
pub const EXIT_CODES: &str = "\
Exit codes:
  0  success
  1  the operation failed (I/O or a daemon error not listed here)
  2  bad command line
  3  no such entry or namespace
  4  marud is not reachable on the socket (not running?)
  5  permission denied
  6  the name is taken (entries are write-once) / the device already has a header
  7  no space in the pools
  8  invalid name or argument
  9  the device is in use by a running marud

With --json every command prints one JSON document on stdout, errors included:
  {\"error\": {\"kind\": \"not_found\", \"exit\": 3, \"message\": \"...\"}}";

/// Exit codes a script can rely on (also in `maructl --help` and doc/OPERATIONS.md).
pub mod exit {
    /// Success.
    pub const OK: i32 = 0;
    /// The operation failed (I/O, daemon error not listed below).
    pub const FAILED: i32 = 1;
    /// Bad command line.
    pub const USAGE: i32 = 2;
    /// No such entry or namespace.
    pub const NOT_FOUND: i32 = 3;
    /// marud is not running or not reachable on the socket.
    pub const UNREACHABLE: i32 = 4;
    /// Permission denied.
    pub const DENIED: i32 = 5;
    /// The name is taken (entries are write-once).
    pub const EXISTS: i32 = 6;
    /// No space in the pools.
    pub const NO_SPACE: i32 = 7;
    /// Invalid name or argument.
    pub const INVALID: i32 = 8;
    /// The device is in use by a running marud.
    pub const BUSY: i32 = 9;
}

/// A command's failure: exit code, stable kind, message.
#[derive(Debug)]
pub struct Failure {
    /// Exit code.
    pub code: i32,
    /// Stable kind (`not_found`, `unreachable`...).
    pub kind: String,
    /// Message for people.
    pub message: String,
}

impl Failure {
    /// A failure with exit code `code` and kind `kind`.
    pub fn new(code: i32, kind: &str, message: impl Into<String>) -> Self {
        Failure {
            code,
            kind: kind.into(),
            message: message.into(),
        }
    }

    /// The JSON form printed with `--json`.
    pub fn to_json(&self) -> Value {
        json!({"error": {"kind": self.kind, "exit": self.code, "message": self.message}})
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        let code = match &e {
            Error::NotFound(_) => exit::NOT_FOUND,
            Error::Disconnected => exit::UNREACHABLE,
            Error::PermissionDenied(_) => exit::DENIED,
            Error::Exists(_) => exit::EXISTS,
            Error::NoSpace(_) | Error::Quota(_) => exit::NO_SPACE,
            Error::InvalidName(_) | Error::NameTooLong(_) | Error::InvalidArgument(_) => {
                exit::INVALID
            }
            Error::Busy(_) => exit::BUSY,
            _ => exit::FAILED,
        };
        Failure::new(code, e.kind(), e.to_string())
    }
}

impl From<std::io::Error> for Failure {
    fn from(e: std::io::Error) -> Self {
        Failure::new(exit::FAILED, "io", e.to_string())
    }
}

/// Output of a command: JSON (always built) and the human text.
pub struct Output {
    /// For `--json`.
    pub json: Value,
    /// For people.
    pub text: String,
}

/// What a command returns.
pub type R = Result<Output, Failure>;

/// Prints a command's result as maructl does and returns its exit code: the output's JSON
/// document (`json`) or text on stdout; a failure as its JSON document on stdout (`json`) or
/// as `PROG: message` on stderr, exiting with its code. `Ok(None)`: the command printed its own.
pub fn finish(prog: &str, json: bool, r: Result<Option<Output>, Failure>) -> ExitCode {
    match r {
        Ok(Some(o)) => {
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&o.json).expect("serializable")
                );
            } else {
                print!("{}", o.text);
            }
            ExitCode::SUCCESS
        }
        Ok(None) => ExitCode::SUCCESS,
        Err(f) => {
            if json {
                println!("{}", f.to_json());
            } else {
                eprintln!("{prog}: {}", f.message);
            }
            ExitCode::from(u8::try_from(f.code).unwrap_or(1))
        }
    }
}

/// A command's output: its JSON document and its text.
pub fn out(json: Value, text: impl Into<String>) -> R {
    Ok(Output {
        json,
        text: text.into(),
    })
}

/// Connects to marud on `socket`.
pub fn connect(socket: &Path) -> Result<maru::Handler, Failure> {
    maru::Handler::connect(maru::Config {
        socket: socket.to_owned(),
        client_name: "maructl".into(),
        cache_entries: 0,
        ..Default::default()
    })
    .map_err(|e| match e {
        Error::Io(io) => Failure::new(
            exit::UNREACHABLE,
            "unreachable",
            format!(
                "cannot reach marud at {}: {io} (is it running?)",
                socket.display()
            ),
        ),
        other => other.into(),
    })
}

/// `maructl status`.
pub fn status(h: &maru::Handler) -> R {
    let s = h.stats()?;
    let entries: u64 = s.pools.iter().map(|p| p.entries).sum();
    let cap: u64 = s.pools.iter().map(|p| p.capacity).sum();
    let used: u64 = s.pools.iter().map(|p| p.used).sum();
    let mut text = format!(
        "{}\npools: {} ({} of {} used)\nentries: {entries}\nnamespaces: {}\nclients: {}\neviction: {}\n",
        h.server(),
        s.pools.len(),
        format_size(used),
        format_size(cap),
        s.namespaces.len(),
        s.clients.len().saturating_sub(1),
        s.eviction
    );
    if let Some(c) = &s.cluster {
        text.push_str(&format!(
            "cluster: node {} ({}), etcd {}\nentries: {} published here, {} by other hosts\n",
            c.node,
            if c.live {
                "live"
            } else {
                "lease lost: not publishing"
            },
            c.endpoints.join(","),
            c.entries_here,
            c.entries_elsewhere
        ));
        for host in &c.hosts {
            let (address, pid) = host.shown_address_pid();
            text.push_str(&format!(
                "  host {:<16} {:<24} pid {:<8} claims {:>10}  entries {}\n",
                host.node,
                address,
                pid,
                format_size(host.claimed),
                c.entries_of(host)
            ));
        }
    }
    if let Some(r) = &s.remote {
        text.push_str(&remote_lines(r));
    }
    let mut j =
        serde_json::to_value(&s).map_err(|e| Failure::new(exit::FAILED, "io", e.to_string()))?;
    j["server"] = json!(h.server());
    out(j, text)
}

/// `maructl status`'s lines of the remote door: the door, its counters, a line per connected
/// worker.
pub fn remote_lines(r: &maru::proto::RemoteInfo) -> String {
    let mut text = format!(
        "remote door: {} (generation {}), pool {} ({}), {} workers\n  \
         {} connections, {} refused; {} requests, {} errors; reserved {} pages ({}), \
         {} published, {} lookups ({} protected), {} expired, {} quarantined\n",
        r.addr,
        r.generation,
        r.pool,
        r.pool_uuid,
        r.workers.len(),
        r.connections,
        r.refused,
        r.requests,
        r.errors,
        r.pages_reserved,
        format_size(r.bytes_reserved),
        r.published,
        r.lookups,
        format_size(r.bytes_protected),
        r.expired,
        r.quarantined
    );
    for w in &r.workers {
        text.push_str(&format!(
            "  worker {:<16} {:<12} {:<21} reserved {:>10}  protected {:>10}  requests {:<8} errors {}\n",
            w.node,
            format!("{} ({}:{})", w.identity, w.uid, w.gid),
            w.peer,
            format_size(w.reserved),
            format_size(w.protected),
            w.requests,
            w.errors
        ));
    }
    text
}

/// `maructl pools`.
pub fn pools(h: &maru::Handler) -> R {
    let s = h.stats()?;
    let mut text = format!(
        "{:<24} {:<7} {:>10} {:>10} {:>10} {:>8} {:>9}\n",
        "POOL", "KIND", "CAPACITY", "USED", "FREE", "ENTRIES", "EVICTED"
    );
    for p in &s.pools {
        text.push_str(&format!(
            "{:<24} {:<7} {:>10} {:>10} {:>10} {:>8} {:>9}\n",
            p.name,
            format!("{:?}", p.kind).to_lowercase(),
            format_size(p.capacity),
            format_size(p.used),
            format_size(p.capacity.saturating_sub(p.used)),
            p.entries,
            p.evictions
        ));
        if let Some(c) = p.coherence {
            text.push_str(&format!(
                "{:<24} not coherent across hosts: {} written back, {} invalidated\n",
                "",
                format_size(c.flushed),
                format_size(c.invalidated)
            ));
        }
    }
    out(json!({"pools": s.pools}), text)
}

/// `maructl ls [NS]`.
pub fn ls(h: &maru::Handler, ns: &str) -> R {
    let (me, children, entries) = h.list(ns)?;
    let mut text = String::new();
    for c in &children {
        text.push_str(&format!(
            "{:o} {:>5} {:>5} {:>10} {}/\n",
            c.mode, c.uid, c.gid, c.entries, c.ns
        ));
    }
    for e in &entries {
        text.push_str(&format!(
            "{:>12} {}{}\n",
            e.size,
            e.key,
            if e.pinned { "  [pinned]" } else { "" }
        ));
    }
    out(
        json!({"ns": me, "children": children, "entries": entries}),
        text,
    )
}

/// `maructl stat NS/KEY`.
pub fn stat(h: &maru::Handler, path: &str) -> R {
    let info = h
        .stat(path)?
        .ok_or_else(|| Failure::new(exit::NOT_FOUND, "not_found", format!("not found: {path}")))?;
    let place = if info.kind == maru::proto::PoolKind::Memfs {
        "inode"
    } else {
        "offset"
    };
    let text = format!(
        "{}\n  size: {}\n  pool: {} ({:?})\n  {place}: {}\n  generation: {}\n  pinned: {}\n",
        info.path, info.size, info.pool, info.kind, info.offset, info.generation, info.pinned
    );
    out(serde_json::to_value(&info).expect("serializable"), text)
}

/// `maructl put NS/KEY [FILE|-]`.
pub fn put(h: &maru::Handler, path: &str, file: Option<&Path>) -> R {
    let data = match file {
        Some(f) if f != Path::new("-") => std::fs::read(f)?,
        _ => {
            let mut v = Vec::new();
            std::io::stdin().read_to_end(&mut v)?;
            v
        }
    };
    h.put(path, &data)?;
    out(
        json!({"path": path, "size": data.len()}),
        format!("stored {path} ({} bytes)\n", data.len()),
    )
}

/// `maructl get NS/KEY [FILE|-]`: writes the bytes (to stdout by default).
pub fn get(h: &maru::Handler, path: &str, file: Option<&Path>, json_mode: bool) -> R {
    let m = h
        .retrieve(path)?
        .ok_or_else(|| Failure::new(exit::NOT_FOUND, "not_found", format!("not found: {path}")))?;
    match file {
        Some(f) if f != Path::new("-") => {
            std::fs::write(f, m.as_slice())?;
            out(
                json!({"path": path, "size": m.len(), "file": f}),
                format!("wrote {} bytes to {}\n", m.len(), f.display()),
            )
        }
        _ if json_mode => Err(Failure::new(
            exit::USAGE,
            "usage",
            "--json get needs an output FILE (the bytes would mix with the JSON)",
        )),
        _ => {
            std::io::stdout().lock().write_all(m.as_slice())?;
            out(json!({"path": path, "size": m.len()}), "")
        }
    }
}

fn batch(results: Vec<maru::Result<()>>, paths: &[String], verb: &str) -> R {
    let mut text = String::new();
    let mut items = Vec::new();
    let mut first_err: Option<Failure> = None;
    for (p, r) in paths.iter().zip(results) {
        match r {
            Ok(()) => {
                text.push_str(&format!("{verb} {p}\n"));
                items.push(json!({"path": p, "ok": true}));
            }
            Err(e) => {
                items.push(json!({"path": p, "ok": false, "error": e.to_wire()}));
                if first_err.is_none() {
                    first_err = Some(Failure::from(e));
                }
            }
        }
    }
    match first_err {
        Some(mut f) if paths.len() > 1 => {
            f.message = format!("{} (other paths: {})", f.message, json!(items));
            Err(f)
        }
        Some(f) => Err(f),
        None => out(json!({"results": items}), text),
    }
}

/// `maructl rm PATH...`.
pub fn rm(h: &maru::Handler, paths: &[String]) -> R {
    let refs: Vec<&str> = paths.iter().map(String::as_str).collect();
    batch(h.batch_delete(&refs)?, paths, "removed")
}

/// `maructl pin|unpin PATH...`.
pub fn pin(h: &maru::Handler, paths: &[String], pinned: bool) -> R {
    let refs: Vec<&str> = paths.iter().map(String::as_str).collect();
    batch(
        h.batch_pin(&refs, pinned)?,
        paths,
        if pinned { "pinned" } else { "unpinned" },
    )
}

/// `maructl mkdir NS`.
pub fn mkdir(h: &maru::Handler, ns: &str, mode: u32) -> R {
    h.mkdir(ns, mode)?;
    out(json!({"ns": ns, "mode": mode}), format!("created {ns}\n"))
}

/// `maructl quota NS SIZE|none`.
pub fn quota(h: &maru::Handler, ns: &str, bytes: Option<u64>) -> R {
    h.set_quota(ns, bytes)?;
    out(
        json!({"ns": ns, "quota": bytes}),
        match bytes {
            Some(b) => format!("quota of {ns}: {}\n", maru::size::format_size(b)),
            None => format!("quota of {ns} cleared\n"),
        },
    )
}

/// `maructl rmdir NS`.
pub fn rmdir(h: &maru::Handler, ns: &str) -> R {
    h.rmdir(ns)?;
    out(json!({"ns": ns}), format!("removed {ns}\n"))
}

/// `maructl evict --bytes N`.
pub fn evict(h: &maru::Handler, bytes: u64) -> R {
    let (entries, freed) = h.evict(bytes)?;
    out(
        json!({"entries": entries, "bytes": freed}),
        format!("evicted {entries} entries ({})\n", format_size(freed)),
    )
}

fn open_device(path: &Path, write: bool) -> Result<std::fs::File, Failure> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .open(path)
        .map_err(|e| {
            let code = if e.kind() == std::io::ErrorKind::NotFound {
                exit::NOT_FOUND
            } else {
                exit::FAILED
            };
            Failure::new(code, "io", format!("{}: {e}", path.display()))
        })?;
    if write && !format::lock_device(&f)? {
        return Err(Failure::new(
            exit::BUSY,
            "busy",
            format!("{} is in use by a running marud", path.display()),
        ));
    }
    Ok(f)
}

/// A header error of the device at `path`; `hint` ends the message of an unknown version.
fn header_failure(path: &Path, e: HeaderError, hint: &str) -> Failure {
    match &e {
        HeaderError::UnknownVersion { .. } => Failure::new(
            exit::FAILED,
            "unsupported_version",
            format!("{}: {e}{hint}", path.display()),
        ),
        HeaderError::Read(io) | HeaderError::Write(io) => {
            Failure::new(exit::FAILED, "io", format!("{}: {e}: {io}", path.display()))
        }
    }
}

/// How init and clear refuse a header of an unknown version.
const FORCE_HINT: &str = "; --force overwrites it and orphans whatever that pool holds";

/// Reads the header; one of an unknown version is an error (its message ended by `hint`)
/// unless `force` (then: `None`).
fn read_header(
    path: &Path,
    f: &std::fs::File,
    force: bool,
    hint: &str,
) -> Result<Option<DevHeader>, Failure> {
    match format::read_header(f) {
        Ok(h) => Ok(h),
        Err(HeaderError::UnknownVersion { .. }) if force => Ok(None),
        Err(e) => Err(header_failure(path, e, hint)),
    }
}

fn header_json(path: &Path, h: Option<DevHeader>) -> Value {
    match h {
        Some(h) => {
            json!({"device": path, "initialized": true, "magic": "MARUDEV", "version": h.version(), "uuid": h.uuid_string()})
        }
        None => json!({"device": path, "initialized": false}),
    }
}

/// The arguments of `maructl device` and `marutop device` (one definition for both).
#[derive(clap::Args)]
pub struct DeviceArgs {
    /// init | show | clear
    #[arg(value_parser = ["init", "show", "clear"])]
    pub action: String,
    /// The device or file.
    pub path: PathBuf,
    /// init: replace an existing header. init, clear: overwrite a header of a format
    /// version this build does not know (refused otherwise).
    #[arg(long)]
    pub force: bool,
}

impl DeviceArgs {
    /// Runs [`device`] with these arguments.
    pub fn run(&self) -> R {
        device(&self.action, &self.path, self.force)
    }
}

/// `maructl device init|show|clear PATH` (also `marutop device`). A header of a format
/// version this build does not know is refused; `force` lets init and clear overwrite it.
pub fn device(action: &str, path: &Path, force: bool) -> R {
    match action {
        "show" => {
            let f = open_device(path, false)?;
            let h = read_header(path, &f, false, "")?;
            let text = match &h {
                Some(h) => format!(
                    "{}: maru device, format version {}, uuid {}\n",
                    path.display(),
                    h.version(),
                    h.uuid_string()
                ),
                None => format!("{}: no maru header\n", path.display()),
            };
            out(header_json(path, h), text)
        }
        "init" => {
            let f = open_device(path, true)?;
            if let Some(old) = read_header(path, &f, force, FORCE_HINT)?
                && !force
            {
                return Err(Failure::new(
                    exit::EXISTS,
                    "exists",
                    format!(
                        "{} already has a maru header (uuid {}); --force replaces it and orphans its entries",
                        path.display(),
                        old.uuid_string()
                    ),
                ));
            }
            let h = format::init_header(&f).map_err(|e| header_failure(path, e, ""))?;
            out(
                header_json(path, Some(h)),
                format!(
                    "initialized {} (uuid {})\n",
                    path.display(),
                    h.uuid_string()
                ),
            )
        }
        "clear" => {
            let f = open_device(path, true)?;
            read_header(path, &f, force, FORCE_HINT)?;
            format::clear_header(&f).map_err(|e| header_failure(path, e, ""))?;
            out(
                header_json(path, None),
                format!("cleared {}\n", path.display()),
            )
        }
        other => Err(Failure::new(
            exit::USAGE,
            "usage",
            format!("unknown device action `{other}`"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::*;

    fn dev(dir: &Path) -> std::path::PathBuf {
        let p = dir.join("dev.img");
        std::fs::File::create(&p).unwrap().set_len(4 << 20).unwrap();
        p
    }

    fn fails(r: R, code: i32, kind: &str) -> Failure {
        let f = r.err().expect("a failure");
        assert_eq!((f.code, f.kind.as_str()), (code, kind), "{}", f.message);
        f
    }

    #[test]
    fn status_lists_the_remote_door_and_its_workers() {
        let r = maru::proto::RemoteInfo {
            addr: "10.0.0.5:7860".into(),
            generation: "00c0ffee00c0ffee".into(),
            pool: "pool0".into(),
            pool_uuid: "1234".into(),
            connections: 3,
            published: 7,
            workers: vec![maru::proto::RemoteWorker {
                id: 2,
                node: "gpu-1".into(),
                identity: "gpu".into(),
                uid: 1000,
                gid: 1000,
                peer: "10.0.0.7:51234".into(),
                reserved: 4 << 20,
                protected: 8192,
                requests: 12,
                errors: 1,
            }],
            ..Default::default()
        };
        let text = remote_lines(&r);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(
            lines[0].starts_with("remote door: 10.0.0.5:7860 (generation 00c0ffee00c0ffee), pool pool0 (1234), 1 workers"),
            "{text}"
        );
        assert!(
            lines[1].contains("3 connections") && lines[1].contains("7 published"),
            "{text}"
        );
        for part in [
            "gpu-1",
            "gpu (1000:1000)",
            "10.0.0.7:51234",
            "4.0 MiB",
            "8.0 KiB",
            "requests 12",
            "errors 1",
        ] {
            assert!(lines[2].contains(part), "{part}: {text}");
        }
    }

    #[test]
    fn device_init_show_clear() {
        let dir = tempfile::tempdir().unwrap();
        let p = dev(dir.path());
        let show = device("show", &p, false).unwrap();
        assert_eq!(show.json["initialized"], false);
        let init = device("init", &p, false).unwrap();
        assert_eq!(init.json["version"], format::DEV_VERSION);
        let show = device("show", &p, false).unwrap();
        assert_eq!(show.json["uuid"], init.json["uuid"]);
        fails(device("init", &p, false), exit::EXISTS, "exists");
        let again = device("init", &p, true).unwrap();
        assert_ne!(again.json["uuid"], init.json["uuid"]);
        device("clear", &p, false).unwrap();
        assert_eq!(
            device("show", &p, false).unwrap().json["initialized"],
            false
        );
        fails(
            device("show", &dir.path().join("none"), false),
            exit::NOT_FOUND,
            "io",
        );
    }

    #[test]
    fn a_device_in_use_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dev(dir.path());
        let held = std::fs::File::open(&p).unwrap();
        assert!(format::lock_device(&held).unwrap());
        fails(device("init", &p, true), exit::BUSY, "busy");
        fails(device("clear", &p, true), exit::BUSY, "busy");
        device("show", &p, false).unwrap();
    }

    #[test]
    fn an_unknown_format_version_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dev(dir.path());
        let mut b = DevHeader::fresh().encode();
        b[8..12].copy_from_slice(&9u32.to_le_bytes());
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .write_all_at(&b, 0)
            .unwrap();
        let f = fails(
            device("show", &p, false),
            exit::FAILED,
            "unsupported_version",
        );
        assert_eq!(
            f.message,
            format!(
                "{}: pool format version 9 is not supported (this build supports version 1)",
                p.display()
            )
        );
        let f = fails(
            device("init", &p, false),
            exit::FAILED,
            "unsupported_version",
        );
        assert!(
            f.message
                .ends_with("--force overwrites it and orphans whatever that pool holds")
        );
        fails(
            device("clear", &p, false),
            exit::FAILED,
            "unsupported_version",
        );
        // Untouched by the refusals.
        assert_eq!(&std::fs::read(&p).unwrap()[..32], &b);
        device("clear", &p, true).unwrap();
        assert_eq!(
            device("show", &p, false).unwrap().json["initialized"],
            false
        );
        b[8..12].copy_from_slice(&9u32.to_le_bytes());
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .write_all_at(&b, 0)
            .unwrap();
        let init = device("init", &p, true).unwrap();
        assert_eq!(init.json["version"], format::DEV_VERSION);
    }
}
