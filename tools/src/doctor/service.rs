//! marud and what it needs around it: the daemon on its socket, the mount, the state
//! directory, the group, and etcd in cluster mode.

use std::io::ErrorKind;
use std::path::Path;
use std::time::Duration;

use maru::size::format_size;

use super::target::{Check, LIMIT, Target, bounded, is_root};

/// Less free space than this in the state directory is worth a warning (raw pool logs grow).
const LOW_STATE_SPACE: u64 = 64 << 20;

/// Connects to marud through libmaru as `maructl status` does and asks for its pools.
fn query(socket: &Path) -> maru::Result<(String, Vec<maru::proto::PoolInfo>)> {
    let h = maru::Handler::connect(maru::Config {
        socket: socket.to_owned(),
        client_name: "maructl-doctor".into(),
        timeout: LIMIT,
        cache_entries: 0,
        lane: false,
        ..Default::default()
    })?;
    Ok((h.server(), h.stats()?.pools))
}

/// What to do when the socket refuses this user: join the group the socket belongs to (the
/// configured one where it cannot be seen); a socket of root's group means marud found no
/// `maru` group when it started.
fn join(socket: &Path, configured: &str) -> String {
    use std::os::unix::fs::MetadataExt;
    let gid = std::fs::metadata(socket).map(|m| m.gid());
    let owner = gid.ok().and_then(|g| {
        let group = nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(g));
        group.ok().flatten()
    });
    match owner {
        Some(g) if g.gid.as_raw() != 0 => {
            format!(
                "usermod -aG {0} $USER (the socket's group is {0}), then log in again",
                g.name
            )
        }
        Some(_) => "groupadd --system maru; usermod -aG maru $USER; systemctl restart marud".into(),
        None => format!("usermod -aG {configured} $USER, then log in again"),
    }
}

/// Whether marud runs and answers on the socket, with its pools; and whether it does.
pub(super) fn marud(t: &Target) -> (Check, bool) {
    const NAME: &str = "marud";
    const START: &str = "systemctl start marud (or run marud as root with this config)";
    let sock = t.socket.clone();
    let shown = sock.display().to_string();
    let group = t.file.group.as_deref().unwrap_or("maru");
    let check = match bounded(LIMIT * 2, move || query(&sock)) {
        Some(Ok((server, pools))) => {
            let pools: Vec<String> = pools
                .iter()
                .map(|p| {
                    let kind = format!("{:?}", p.kind).to_lowercase();
                    let (used, cap) = (format_size(p.used), format_size(p.capacity));
                    format!("{} ({kind}, {used} of {cap} used)", p.name)
                })
                .collect();
            let mount = t
                .mount
                .as_ref()
                .map_or("none".into(), |m| m.display().to_string());
            return (
                Check::ok(
                    NAME,
                    format!(
                        "{server} answers on {shown}; pools: {}; mount: {mount}",
                        pools.join(", ")
                    ),
                ),
                true,
            );
        }
        None => stuck(t).unwrap_or_else(|| {
            Check::fail(
                NAME,
                format!(
                    "marud at {shown} does not answer within {}s",
                    (LIMIT * 2).as_secs()
                ),
                "systemctl restart marud (journalctl -u marud says why it hung)",
            )
        }),
        Some(Err(maru::Error::Io(e))) => match e.kind() {
            ErrorKind::NotFound => {
                Check::fail(NAME, format!("no marud: nothing at {shown}"), START)
            }
            ErrorKind::ConnectionRefused => Check::fail(
                NAME,
                format!("stale socket: {shown} is there but nobody listens (marud died?)"),
                "systemctl restart marud (it replaces the stale socket)",
            ),
            ErrorKind::PermissionDenied => Check::fail(
                NAME,
                format!("permission denied on {shown}"),
                join(&t.socket, group),
            ),
            _ => Check::fail(NAME, format!("cannot talk to marud at {shown}: {e}"), START),
        },
        Some(Err(maru::Error::PermissionDenied(e))) => Check::fail(
            NAME,
            format!("marud refuses this user: {e}"),
            join(&t.socket, group),
        ),
        Some(Err(e)) => Check::fail(
            NAME,
            format!("marud at {shown} answered badly: {e}"),
            "run the maructl that came with this marud",
        ),
    };
    (check, false)
}

/// A marud that was killed and cannot finish dying (doc/OPERATIONS.md, "A marud that cannot
/// finish dying"), as the state directory's record of the mount's connection shows it: its
/// socket accepts and its mount takes requests, and nothing answers.
fn stuck(t: &Target) -> Option<Check> {
    use maru::fuse_record::{Record, Server};
    let r = Record::read(&t.state_dir)?.ok()?;
    (r.server() == Server::Dying).then(|| {
        Check::fail(
            "marud",
            format!(
                "marud (pid {}) was killed and is stuck in its exit, its mount's FUSE connection \
                 {} open: requests to the mount wait for it",
                r.pid, r.conn
            ),
            format!(
                "systemctl restart marud (the next marud aborts the connection), or \
                 echo 1 > /sys/fs/fuse/connections/{}/abort",
                r.conn
            ),
        )
    })
}

/// The type and source of the topmost mount on `dir` in a `/proc/self/mountinfo` text.
fn mounted(mountinfo: &str, dir: &Path) -> Option<(String, String)> {
    let want = dir.to_string_lossy().replace(' ', "\\040");
    mountinfo
        .lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let mut right = right.split(' ').map(str::to_owned);
            (left.split(' ').nth(4)? == want).then(|| Some((right.next()?, right.next()?)))?
        })
        .next_back()
}

/// Whether a mount of this type and source is maru's: FUSE (`fuse`, or `fuse.maru` where
/// the subtype shows) from source `maru`, as marud mounts it.
fn is_maru(fstype: &str, source: &str) -> bool {
    (fstype == "fuse" || fstype.starts_with("fuse.")) && source == "maru"
}

/// The mount: maru's filesystem and answering, dead (its marud gone), or missing.
pub(super) fn mount(t: &Target, daemon_up: bool) -> Check {
    const NAME: &str = "mount";
    let Some(dir) = t.mount.clone() else {
        return Check::skip(NAME, "no mount configured (control socket only)");
    };
    let shown = dir.display().to_string();
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    match mounted(&info, &dir) {
        Some((fstype, source)) if is_maru(&fstype, &source) => match bounded(LIMIT, move || {
            std::fs::metadata(&dir)
        }) {
            Some(Ok(_)) => Check::ok(NAME, format!("{shown}: maru's filesystem")),
            Some(Err(e)) if e.raw_os_error() == Some(libc::ENOTCONN) => Check::fail(
                NAME,
                format!("{shown}: dead mount, its marud is gone"),
                format!("umount -l {shown}; systemctl restart marud"),
            ),
            Some(Err(e)) => Check::fail(NAME, format!("{shown}: {e}"), "systemctl restart marud"),
            None => stuck(t).map_or_else(
                || {
                    Check::fail(
                        NAME,
                        format!("{shown} does not answer within {}s", LIMIT.as_secs()),
                        "systemctl restart marud (journalctl -u marud says why it hung)",
                    )
                },
                |c| Check {
                    name: NAME.into(),
                    ..c
                },
            ),
        },
        Some((fstype, source)) => Check::warn(
            NAME,
            format!("{shown} is a {fstype} mount of {source}, not maru's"),
            format!("umount {shown}, or set mount = to another directory"),
        ),
        None if daemon_up => Check::warn(
            NAME,
            format!("nothing mounted at {shown}: the running marud has another mount"),
            "systemctl restart marud (it then reads this config)",
        ),
        None => Check::skip(
            NAME,
            format!("nothing mounted at {shown} yet: marud mounts it when it starts"),
        ),
    }
}

/// The state directory: writable (marud creates it if missing) and with room.
pub(super) fn state_dir(t: &Target) -> Check {
    const NAME: &str = "state-dir";
    const ELSEWHERE: &str =
        "set state_dir to a writable directory with room (namespaces, raw pool logs)";
    let dir = t.state_dir.clone();
    let shown = dir.display().to_string();
    let Some(existing) = dir.ancestors().find(|a| a.exists()).map(Path::to_owned) else {
        return Check::fail(NAME, format!("{shown}: no existing parent"), ELSEWHERE);
    };
    if existing == dir && !dir.is_dir() {
        return Check::fail(NAME, format!("{shown} is not a directory"), ELSEWHERE);
    }
    let probe = existing.clone();
    let r = bounded(LIMIT, move || {
        let vfs = nix::sys::statvfs::statvfs(&probe)?;
        let writable =
            !is_root() || nix::unistd::access(&probe, nix::unistd::AccessFlags::W_OK).is_ok();
        Ok::<_, nix::Error>((vfs, writable))
    });
    let (vfs, writable) = match r {
        None => {
            return Check::fail(
                NAME,
                format!("{shown}: its filesystem does not answer"),
                ELSEWHERE,
            );
        }
        Some(Err(e)) => return Check::fail(NAME, format!("{shown}: {e}"), ELSEWHERE),
        Some(Ok(v)) => v,
    };
    let free = vfs.blocks_available() * vfs.fragment_size();
    let total = vfs.blocks() * vfs.fragment_size();
    let room = format!("{} free of {}", format_size(free), format_size(total));
    if vfs.flags().contains(nix::sys::statvfs::FsFlags::ST_RDONLY) || !writable {
        Check::fail(
            NAME,
            format!("{shown}: not writable by root (read-only filesystem?)"),
            ELSEWHERE,
        )
    } else if free < LOW_STATE_SPACE {
        Check::warn(
            NAME,
            format!("{shown}: only {room}"),
            format!("free space on {} or {ELSEWHERE}", existing.display()),
        )
    } else if existing != dir {
        Check::ok(
            NAME,
            format!("{shown}: not there yet (marud creates it); {room}"),
        )
    } else {
        Check::ok(NAME, format!("{shown}: writable, {room}"))
    }
}

/// The group given the socket and the mount: `group` of the config (which must exist: marud
/// refuses to start otherwise), else `maru` where it exists; and whether this user is in it.
pub(super) fn group(t: &Target) -> Check {
    use nix::unistd::{Group, User, getgid, getgroups, getuid};
    const NAME: &str = "group";
    let (name, named) = t
        .file
        .group
        .as_deref()
        .map_or(("maru", false), |g| (g, true));
    let g = match Group::from_name(name) {
        Err(e) => {
            return Check::warn(
                NAME,
                format!("cannot look up group `{name}`: {e}"),
                "check /etc/nsswitch.conf",
            );
        }
        Ok(None) if named => {
            return Check::fail(
                NAME,
                format!(
                    "the config names group `{name}`, which does not exist: marud refuses to start"
                ),
                format!("groupadd --system {name}, or fix group = in the config"),
            );
        }
        Ok(None) => {
            return Check::warn(
                NAME,
                "no group `maru`: only root may use the socket and the mount",
                "groupadd --system maru; usermod -aG maru USER; systemctl restart marud",
            );
        }
        Ok(Some(g)) => g,
    };
    let uid = getuid();
    if uid.is_root() {
        return Check::ok(
            NAME,
            format!("group `{name}` (gid {}) exists; root needs no group", g.gid),
        );
    }
    let user = User::from_uid(uid)
        .ok()
        .flatten()
        .map_or(uid.to_string(), |u| u.name);
    let now = getgid() == g.gid || getgroups().is_ok_and(|gs| gs.contains(&g.gid));
    if now {
        Check::ok(
            NAME,
            format!("group `{name}` (gid {}): {user} is a member", g.gid),
        )
    } else if g.mem.contains(&user) {
        Check::warn(
            NAME,
            format!("{user} was added to `{name}` after this login"),
            format!("log in again (or: newgrp {name})"),
        )
    } else {
        Check::warn(
            NAME,
            format!("{user} is not in group `{name}`: the socket and the mount are closed to them"),
            format!("usermod -aG {name} {user}, then log in again"),
        )
    }
}

/// etcd, in cluster mode: reachable and answering.
pub(super) fn etcd(t: &Target) -> Check {
    const NAME: &str = "etcd";
    if t.cluster.is_empty() {
        return Check::skip(NAME, "no cluster configured (one host)");
    }
    let eps = t.cluster.clone();
    let urls = eps.join(",");
    let fix =
        format!("start etcd there or fix `cluster =` (etcdctl --endpoints={urls} endpoint health)");
    match bounded(LIMIT * 2, move || etcd_probe(&eps, LIMIT)) {
        Some(Ok(d)) => Check::ok(NAME, d),
        Some(Err(e)) => Check::fail(NAME, format!("{urls}: {e}"), fix),
        None => Check::fail(
            NAME,
            format!("{urls}: no answer within {}s", (LIMIT * 2).as_secs()),
            fix,
        ),
    }
}

/// `HOST:PORT` of an etcd endpoint URL (`http://10.0.0.1:2379`; etcd's port by default).
fn endpoint_addr(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let host = rest.split('/').next().unwrap_or(rest);
    if host
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
    {
        host.to_owned()
    } else {
        format!("{host}:2379")
    }
}

/// One HTTP/1.1 GET of `path` on etcd's client port (etcd serves `/health` and `/version` there
/// beside its gRPC API): the status code and the body, within `limit`.
fn http_get(addr: &str, path: &str, limit: Duration) -> Result<(u16, String), String> {
    use std::io::{Read, Write};
    use std::net::{TcpStream, ToSocketAddrs};
    let a = addr
        .to_socket_addrs()
        .map_err(|e| e.to_string())?
        .next()
        .ok_or("no address")?;
    let mut s = TcpStream::connect_timeout(&a, limit).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(limit)).map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(limit))
        .map_err(|e| e.to_string())?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut reply = Vec::new();
    s.take(64 << 10)
        .read_to_end(&mut reply)
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&reply);
    let code = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("not an HTTP answer from {addr}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_owned();
    Ok((code, body))
}

/// Whether one of the etcd `endpoints` answers healthy (it has a leader and a quorum) within
/// `limit`, and its version. An `https` endpoint is only checked to accept connections (the
/// doctor speaks no TLS).
fn etcd_probe(endpoints: &[String], limit: Duration) -> Result<String, String> {
    let mut errors = Vec::new();
    for url in endpoints {
        let addr = endpoint_addr(url);
        let r = if url.starts_with("https://") {
            http_get(&addr, "/health", limit)
                .map(|_| format!("{addr} accepts connections (TLS: health not checked)"))
                .or_else(|e| {
                    std::net::TcpStream::connect(&addr)
                        .map(|_| format!("{addr} accepts connections (TLS: health not checked)"))
                        .map_err(|_| e)
                })
        } else {
            http_get(&addr, "/health", limit).and_then(|(code, body)| {
                if code == 200 && body.contains("\"health\":\"true\"") {
                    let version = http_get(&addr, "/version", limit)
                        .ok()
                        .and_then(|(_, v)| {
                            let v: serde_json::Value = serde_json::from_str(&v).ok()?;
                            Some(v["etcdserver"].as_str()?.to_owned())
                        })
                        .unwrap_or_else(|| "?".into());
                    Ok(format!("etcd {version} at {addr} is healthy"))
                } else {
                    Err(format!(
                        "{addr} answers unhealthy ({code}): {}",
                        body.trim()
                    ))
                }
            })
        };
        match r {
            Ok(line) => return Ok(line),
            Err(e) if endpoints.len() == 1 => errors.push(e),
            Err(e) => errors.push(format!("{addr}: {e}")),
        }
    }
    Err(errors.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines() {
        let info = "36 25 0:32 / /run/a\\040b rw - tmpfs tmpfs rw\n\
                    40 25 0:50 / /maru rw,nosuid - fuse maru rw,user_id=0\n";
        let at = |d: &str| mounted(info, Path::new(d));
        assert_eq!(at("/maru"), Some(("fuse".into(), "maru".into())));
        assert_eq!(at("/run/a b"), Some(("tmpfs".into(), "tmpfs".into())));
        assert_eq!(at("/run"), None);
        assert!(is_maru("fuse", "maru") && is_maru("fuse.maru", "maru"));
        assert!(!is_maru("fuse", "sshfs") && !is_maru("tmpfs", "maru"));
    }

    #[test]
    fn etcd_endpoints() {
        assert_eq!(endpoint_addr("http://10.0.0.1:2379"), "10.0.0.1:2379");
        assert_eq!(endpoint_addr("https://etcd.example/"), "etcd.example:2379");
        assert_eq!(endpoint_addr("127.0.0.1:1"), "127.0.0.1:1");
        let t = std::time::Instant::now();
        let e = etcd_probe(&["http://127.0.0.1:1".into()], LIMIT).unwrap_err();
        assert!(e.contains("refused"), "{e}");
        assert!(t.elapsed() < LIMIT);
    }
}
