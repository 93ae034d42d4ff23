//! The record of the mount's FUSE connection that marud keeps in its state directory
//! (`fuse-connection`): which process serves which connection. The next marud reads it to end a
//! predecessor stuck in its exit (doc/OPERATIONS.md, "A marud that cannot finish dying"), and
//! `maructl doctor` to say so. Reading it needs no privileges.

use std::path::{Path, PathBuf};

/// The record's file in a state directory.
pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join("fuse-connection")
}

/// Who served which connection: the daemon's pid and start time (in clock ticks after boot,
/// so that a pid used again names no other process) and the connection's id under fusectl
/// (`/sys/fs/fuse/connections/<conn>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    pub pid: u32,
    pub start: u64,
    pub conn: u32,
}

/// What became of the process a record names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
    /// Gone: its exit ended the connection.
    Gone,
    /// Running.
    Alive,
    /// On its way out (its main thread has exited, or a SIGKILL is pending for one of its
    /// threads), the connection still open while it lasts.
    Dying,
}

impl Record {
    /// The record in `state_dir`: None when there is none, `Err` with its text when it does
    /// not parse.
    pub fn read(state_dir: &Path) -> Option<Result<Record, String>> {
        let text = std::fs::read_to_string(path(state_dir)).ok()?;
        Some(Record::parse(&text).ok_or(text))
    }

    /// Parses `pid=P start=S conn=C`.
    pub fn parse(s: &str) -> Option<Record> {
        let (mut pid, mut start, mut conn) = (None, None, None);
        for field in s.split_whitespace() {
            let (k, v) = field.split_once('=')?;
            match k {
                "pid" => pid = v.parse().ok(),
                "start" => start = v.parse().ok(),
                "conn" => conn = v.parse().ok(),
                _ => {}
            }
        }
        Some(Record {
            pid: pid?,
            start: start?,
            conn: conn?,
        })
    }

    /// The record's text, one line.
    pub fn text(&self) -> String {
        format!("pid={} start={} conn={}\n", self.pid, self.start, self.conn)
    }

    /// What became of the process that wrote it.
    pub fn server(&self) -> Server {
        if start_time(self.pid) != Some(self.start) {
            Server::Gone
        } else if dying(self.pid) {
            Server::Dying
        } else {
            Server::Alive
        }
    }
}

/// A process's start time (field 22 of `/proc/PID/stat`), None when it does not exist.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count after its last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether process `pid` is on its way out: its main thread has exited (a zombie waiting for
/// the others) or a SIGKILL is pending for one of its threads.
pub fn dying(pid: u32) -> bool {
    const SIGKILL_BIT: u64 = 1 << (libc::SIGKILL - 1);
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let rest = &s[s.rfind(')')? + 1..];
            rest.split_whitespace().next().map(str::to_owned)
        });
    if matches!(state.as_deref(), Some("Z" | "X")) {
        return true;
    }
    let pending = |status: &str, field: &str| -> bool {
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .is_some_and(|m| m & SIGKILL_BIT != 0)
    };
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().any(|t| {
        std::fs::read_to_string(t.path().join("status"))
            .is_ok_and(|s| pending(&s, "SigPnd:") || pending(&s, "ShdPnd:"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_back_and_a_torn_one_is_refused() {
        let r = Record {
            pid: 42,
            start: 123_456,
            conn: 44,
        };
        assert_eq!(Record::parse(&r.text()), Some(r));
        assert_eq!(Record::parse("pid=42 start=123456"), None);
        assert_eq!(Record::parse("pid=42 start=x conn=44"), None);
        assert_eq!(Record::parse(""), None);
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(Record::read(dir.path()), None);
        std::fs::write(path(dir.path()), "pid=1").unwrap();
        assert_eq!(Record::read(dir.path()), Some(Err("pid=1".into())));
    }

    #[test]
    fn this_process_is_alive_and_a_gone_one_is_gone() {
        let me = std::process::id();
        let start = start_time(me).unwrap();
        let r = Record {
            pid: me,
            start,
            conn: 1,
        };
        assert_eq!(r.server(), Server::Alive);
        let older = Record {
            start: start + 1,
            ..r
        };
        assert_eq!(
            older.server(),
            Server::Gone,
            "a pid used again is not the same process"
        );
        assert_eq!(start_time(u32::MAX), None);
    }
}
