//! `maructl --remote tcp://HOST:PORT`: `ls`, `stat`, `get` and `put` against a memory node's
//! pool from a host without it, as a remote worker does (`maru_remote::RemoteClient`: control
//! over TCP to the memory node's marud, the bytes by one-sided NIXL READ and WRITE). The token
//! is read from `--remote-token-file` or `MARU_REMOTE_TOKEN` (none: anonymous, where the door
//! admits it). Output and exit codes are the local commands' (doc/OPERATIONS.md).

use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

use maru::name::EntryPath;
use maru::size::format_size;
use maru_remote::error_chain as chain;
use maru_remote::{RemoteClient, RemoteConfig, RemoteError, Stored};
use serde_json::json;

use crate::ctl::{Failure, R, exit, out};

/// The environment variable that carries the token when no file is named.
pub const TOKEN_ENV: &str = "MARU_REMOTE_TOKEN";

/// The token: the first line of `file` (surrounding white space trimmed), else
/// [`TOKEN_ENV`], else none ("": anonymous).
pub fn token(file: Option<&Path>) -> Result<String, Failure> {
    match file {
        Some(f) => {
            let text = std::fs::read_to_string(f).map_err(|e| {
                Failure::new(
                    exit::FAILED,
                    "io",
                    format!("reading the token file {}: {e}", f.display()),
                )
            })?;
            let line = text.lines().map(str::trim).find(|l| !l.is_empty());
            line.map(str::to_owned).ok_or_else(|| {
                Failure::new(
                    exit::INVALID,
                    "invalid_argument",
                    format!("the token file {} holds no token", f.display()),
                )
            })
        }
        None => Ok(std::env::var(TOKEN_ENV).unwrap_or_default()),
    }
}

/// Connects to the door at `url` with a staging buffer of `staging` bytes (the largest entry
/// `get` and `put` move).
pub fn connect(url: &str, token: String, staging: u64) -> Result<RemoteClient, Failure> {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default();
    RemoteClient::connect(RemoteConfig {
        url: url.to_owned(),
        token,
        node: if host.is_empty() {
            "maructl".into()
        } else {
            format!("maructl-{host}")
        },
        staging_bytes: staging.max(4096),
        transfer_timeout: Duration::from_secs(30),
        ..Default::default()
    })
    .map_err(failure)
}

/// A remote error as maructl's failure: marud's refusals keep their kind and exit code; a
/// door that cannot be reached is `unreachable` (exit 4).
pub fn failure(e: RemoteError) -> Failure {
    let message = chain(&e);
    match e {
        RemoteError::Server(inner) => Failure {
            message,
            ..Failure::from(inner)
        },
        RemoteError::PoolFull(_) => Failure::new(exit::NO_SPACE, "no_space", message),
        RemoteError::InvalidArgument(_) => Failure::new(exit::INVALID, "invalid_argument", message),
        RemoteError::Io {
            during: "connecting" | "resolving",
            ..
        }
        | RemoteError::Unavailable { .. } => {
            Failure::new(exit::UNREACHABLE, "unreachable", message)
        }
        RemoteError::Io { .. } => Failure::new(exit::FAILED, "io", message),
        RemoteError::Nixl { .. } | RemoteError::Staging { .. } | RemoteError::Stuck(_) => {
            Failure::new(exit::FAILED, "nixl", message)
        }
        RemoteError::Protocol(_) | RemoteError::StaleGeneration => {
            Failure::new(exit::FAILED, "protocol", message)
        }
    }
}

fn split(path: &str) -> Result<(&str, &str), Failure> {
    Ok(EntryPath::split(path)?)
}

/// `maructl --remote URL ls [NS]`: child namespaces (`NAME/`), then entries (size, key).
pub fn ls(c: &RemoteClient, ns: &str) -> R {
    let l = c.list(ns).map_err(failure)?;
    let mut text = String::new();
    for child in &l.children {
        text.push_str(&format!("{child}/\n"));
    }
    for e in &l.entries {
        text.push_str(&format!("{:>12} {}\n", e.size, e.key));
    }
    out(
        json!({"ns": ns, "children": l.children, "entries": l.entries}),
        text,
    )
}

/// The size of entry `path`, from its namespace's listing.
fn size_of(c: &RemoteClient, path: &str) -> Result<u64, Failure> {
    let (ns, key) = split(path)?;
    c.list(ns)
        .map_err(failure)?
        .entries
        .into_iter()
        .find(|e| e.key == key)
        .map(|e| e.size)
        .ok_or_else(|| Failure::new(exit::NOT_FOUND, "not_found", format!("not found: {path}")))
}

/// `maructl --remote URL stat NS/KEY`: the entry's size (exit 3 when it does not exist).
pub fn stat(c: &RemoteClient, path: &str) -> R {
    let size = size_of(c, path)?;
    out(
        json!({"path": path, "size": size, "exists": true}),
        format!("{path}\n  size: {size}\n  exists: true\n"),
    )
}

/// `maructl --remote URL get NS/KEY [-o FILE]`: the bytes, to stdout by default.
pub fn get(c: &RemoteClient, path: &str, file: Option<&Path>, json_mode: bool) -> R {
    let (ns, key) = split(path)?;
    let to_stdout = file.is_none_or(|f| f == Path::new("-"));
    if to_stdout && json_mode {
        return Err(Failure::new(
            exit::USAGE,
            "usage",
            "--json get needs an output FILE (the bytes would mix with the JSON)",
        ));
    }
    let bytes = c
        .retrieve(ns, key)
        .map_err(failure)?
        .ok_or_else(|| Failure::new(exit::NOT_FOUND, "not_found", format!("not found: {path}")))?;
    match file {
        Some(f) if !to_stdout => {
            std::fs::write(f, &bytes)?;
            out(
                json!({"path": path, "size": bytes.len(), "file": f}),
                format!("wrote {} bytes to {}\n", bytes.len(), f.display()),
            )
        }
        _ => {
            std::io::stdout().lock().write_all(&bytes)?;
            out(json!({"path": path, "size": bytes.len()}), "")
        }
    }
}

/// The bytes `put` stores: the file's, or stdin's for `-` or none.
pub fn input(file: Option<&Path>) -> Result<Vec<u8>, Failure> {
    Ok(match file {
        Some(f) if f != Path::new("-") => std::fs::read(f)?,
        _ => {
            let mut v = Vec::new();
            std::io::stdin().read_to_end(&mut v)?;
            v
        }
    })
}

/// `maructl --remote URL put NS/KEY FILE`: stores the bytes (write-once: a name taken is
/// `already present`, exit 0, its bytes untouched).
pub fn put(c: &RemoteClient, path: &str, data: &[u8]) -> R {
    let (ns, key) = split(path)?;
    let (word, text) = match c.store(ns, key, data).map_err(failure)? {
        Stored::Created => (
            "created",
            format!("created {path} ({})\n", format_size(data.len() as u64)),
        ),
        Stored::AlreadyPresent => (
            "already_present",
            format!("already present: {path} (entries are write-once; not replaced)\n"),
        ),
    };
    out(
        json!({"path": path, "size": data.len(), "stored": word}),
        text,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_keep_their_exit_codes() {
        let f = failure(RemoteError::Server(maru::Error::NotFound("a/b".into())));
        assert_eq!((f.code, f.kind.as_str()), (exit::NOT_FOUND, "not_found"));
        assert_eq!(f.message, "marud refused: not found: a/b");
        let f = failure(RemoteError::Server(maru::Error::PermissionDenied(
            "ns".into(),
        )));
        assert_eq!(f.code, exit::DENIED);
        assert_eq!(
            failure(RemoteError::PoolFull(String::new())).code,
            exit::NO_SPACE
        );
        let refused = RemoteError::Io {
            addr: "10.0.0.5:7860".into(),
            during: "connecting",
            source: std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
        };
        let f = failure(refused);
        assert_eq!(
            (f.code, f.kind.as_str()),
            (exit::UNREACHABLE, "unreachable")
        );
        assert!(
            f.message
                .starts_with("marud at 10.0.0.5:7860: connecting: "),
            "{}",
            f.message
        );
        let f = failure(RemoteError::InvalidArgument("x".into()));
        assert_eq!(f.code, exit::INVALID);
    }

    #[test]
    fn the_token_is_the_files_first_line() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("token");
        std::fs::write(&f, "\n  a-token-of-some-length \nignored\n").unwrap();
        assert_eq!(token(Some(&f)).unwrap(), "a-token-of-some-length");
        std::fs::write(&f, " \n").unwrap();
        assert_eq!(token(Some(&f)).unwrap_err().code, exit::INVALID);
        assert_eq!(
            token(Some(&dir.path().join("none"))).unwrap_err().code,
            exit::FAILED
        );
    }
}
