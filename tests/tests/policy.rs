//! One access policy, two doors: every operation, by every kind of caller, in namespaces of
//! every interesting mode, gets the same answer over the control socket (libmaru) as through
//! the mount, and that answer is the POSIX rule, computed here from the mode bits:
//!
//! - search(P): execute on every namespace along P (the mount's root is root's, mode 1777);
//! - look up `P/k`: search(P); list P: search(P's parent) + read on P;
//! - read `P/k`: search(P) + read on the entry (libmaru creates entries mode 0644);
//! - create `P/k`: search(P) + write on P;
//! - delete `P/k`: search(P) + write on P, and under a sticky P only root, the entry's owner
//!   or P's owner;
//! - pin `P/k`: search(P) + write on the entry;
//! - set a quota (socket only): root only.
//!
//! Each caller runs all its operations on one door in one `maru-probe ops` process.
//! `MARU_TEST_SHOWTABLE=1` prints every case's answers, not only the wrong ones.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::process::Command;

use maru_tests::{Daemon, Opts, bin};

/// A user the test acts as (`setpriv`; root runs the probe directly).
struct User {
    name: &'static str,
    uid: u32,
    gid: u32,
    groups: &'static [u32],
}

const ROOT: User = User {
    name: "root",
    uid: 0,
    gid: 0,
    groups: &[],
};
/// Creates the namespaces (and the entries callers look up, read and pin).
const OWNER: User = User {
    name: "owner",
    uid: 61001,
    gid: 61001,
    groups: &[],
};
/// In the owner's group.
const MEMBER: User = User {
    name: "member",
    uid: 61002,
    gid: 61002,
    groups: &[61001],
};
const OTHER: User = User {
    name: "other",
    uid: 61003,
    gid: 61003,
    groups: &[],
};
/// Not a caller: owns the entries callers try to delete as "another user's".
const STRANGER: User = User {
    name: "stranger",
    uid: 61004,
    gid: 61004,
    groups: &[],
};

const CALLERS: [&User; 4] = [&OWNER, &MEMBER, &OTHER, &ROOT];
const MODES: [u32; 6] = [0o1777, 0o755, 0o750, 0o700, 0o770, 0o711];
const DOORS: [&str; 2] = ["socket", "mount"];
/// The mode libmaru gives the entries it creates.
const ENTRY_MODE: u32 = 0o644;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Op {
    Lookup,
    List,
    Read,
    Create,
    DeleteOwn,
    DeleteOthers,
    Pin,
    Quota,
}

impl Op {
    const ALL: [Op; 8] = [
        Op::Lookup,
        Op::List,
        Op::Read,
        Op::Create,
        Op::DeleteOwn,
        Op::DeleteOthers,
        Op::Pin,
        Op::Quota,
    ];

    fn name(self) -> &'static str {
        match self {
            Op::Lookup => "lookup",
            Op::List => "list",
            Op::Read => "read",
            Op::Create => "create",
            Op::DeleteOwn => "delete-own-entry",
            Op::DeleteOthers => "delete-another-users-entry",
            Op::Pin => "pin",
            Op::Quota => "set-quota",
        }
    }

    /// The probe step for `caller` on `door` in namespace `ns`; `None` where the door has no
    /// such operation (the mount sets no quotas).
    fn step(self, door: &str, ns: &str, caller: &User) -> Option<String> {
        let me = format!("{}-{door}", caller.name);
        let (verb, path) = match self {
            Op::Lookup => ("lookup", format!("{ns}/entry-{me}")),
            Op::List => ("list", ns.to_owned()),
            Op::Read => ("read", format!("{ns}/entry-{me}")),
            Op::Create => ("create", format!("{ns}/new-{me}")),
            Op::DeleteOwn => ("delete", format!("{ns}/own-{me}")),
            Op::DeleteOthers => ("delete", format!("{ns}/theirs-{me}")),
            Op::Pin => ("pin", format!("{ns}/pin-{me}")),
            Op::Quota if door == "mount" => return None,
            Op::Quota => ("quota", ns.to_owned()),
        };
        Some(format!("{door}:{verb}:{path}"))
    }
}

fn ns_of(mode: u32) -> String {
    format!("m{mode:04o}")
}

/// POSIX: may `u` access a file of `mode`, owned by `owner` (uid, gid), for `bit` (4 read,
/// 2 write, 1 execute/search)? Root may do anything (CAP_DAC_OVERRIDE); otherwise the one
/// class the caller falls in decides (owner, then group, then others).
fn may(u: &User, owner: (u32, u32), mode: u32, bit: u32) -> bool {
    if u.uid == 0 {
        return true;
    }
    let class = if u.uid == owner.0 {
        mode >> 6
    } else if u.gid == owner.1 || u.groups.contains(&owner.1) {
        mode >> 3
    } else {
        mode
    };
    class & bit != 0
}

/// The rule: is `op` by `u` allowed in a namespace of `mode` created by OWNER?
fn expected(op: Op, u: &User, mode: u32) -> bool {
    const R: u32 = 4;
    const W: u32 = 2;
    const X: u32 = 1;
    let root_dir = ((0, 0), 0o1777);
    let ns = ((OWNER.uid, OWNER.gid), mode);
    // Entries of the namespace's owner (looked up, read, pinned), created by libmaru.
    let owners_entry = ((OWNER.uid, OWNER.gid), ENTRY_MODE);
    let search = may(u, root_dir.0, root_dir.1, X) && may(u, ns.0, ns.1, X);
    let sticky_lets = |entry_uid: u32| {
        mode & 0o1000 == 0 || u.uid == 0 || u.uid == entry_uid || u.uid == OWNER.uid
    };
    match op {
        Op::Lookup => search,
        Op::List => may(u, root_dir.0, root_dir.1, X) && may(u, ns.0, ns.1, R),
        Op::Read => search && may(u, owners_entry.0, owners_entry.1, R),
        Op::Create => search && may(u, ns.0, ns.1, W),
        Op::DeleteOwn => search && may(u, ns.0, ns.1, W) && sticky_lets(u.uid),
        Op::DeleteOthers => search && may(u, ns.0, ns.1, W) && sticky_lets(STRANGER.uid),
        Op::Pin => search && may(u, owners_entry.0, owners_entry.1, W),
        Op::Quota => u.uid == 0,
    }
}

/// One step's answer.
#[derive(Debug, Clone, PartialEq)]
enum Answer {
    Allowed,
    /// EACCES or EPERM.
    Denied(i32),
    /// Anything else: the fixture is broken, or the door is.
    Failed(String),
}

impl Answer {
    fn allowed(&self) -> Option<bool> {
        match self {
            Answer::Allowed => Some(true),
            Answer::Denied(_) => Some(false),
            Answer::Failed(_) => None,
        }
    }
}

impl std::fmt::Display for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // (`pad`, so that the table's widths apply.)
        match self {
            Answer::Allowed => f.pad("allowed"),
            Answer::Denied(libc::EPERM) => f.pad("denied (EPERM)"),
            Answer::Denied(_) => f.pad("denied (EACCES)"),
            Answer::Failed(why) => f.pad(&format!("failed: {why}")),
        }
    }
}

/// Runs `maru-probe ops` as `u` with `steps`; returns each step's answer.
fn run_as(d: &Daemon, u: &User, steps: &[String]) -> BTreeMap<String, Answer> {
    let mut cmd = if u.uid == 0 {
        Command::new(bin("maru-probe"))
    } else {
        let mut c = Command::new("setpriv");
        c.arg(format!("--reuid={}", u.uid))
            .arg(format!("--regid={}", u.gid));
        if u.groups.is_empty() {
            c.arg("--clear-groups");
        } else {
            let g: Vec<String> = u.groups.iter().map(u32::to_string).collect();
            c.arg(format!("--groups={}", g.join(",")));
        }
        c.arg(bin("maru-probe"));
        c
    };
    let out = cmd
        .arg("ops")
        .arg(&d.socket)
        .arg(d.mount.as_ref().expect("mounted"))
        .args(steps)
        .output()
        .expect("running maru-probe");
    assert!(
        out.status.success(),
        "maru-probe ops as {}: {}",
        u.name,
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("utf8");
    let mut answers = BTreeMap::new();
    for line in text.lines() {
        let (step, rest) = line.split_once(' ').expect("STEP ANSWER");
        let answer = match rest.split_once(' ') {
            None if rest == "ok" => Answer::Allowed,
            Some(("errno", e)) => {
                let (n, msg) = e.split_once(' ').unwrap_or((e, ""));
                match n.parse::<i32>().expect("errno") {
                    n @ (libc::EACCES | libc::EPERM) => Answer::Denied(n),
                    n => Answer::Failed(format!("errno {n}: {msg}")),
                }
            }
            _ => panic!("maru-probe printed {line:?}"),
        };
        answers.insert(step.to_owned(), answer);
    }
    assert_eq!(
        answers.len(),
        steps.len(),
        "maru-probe ops as {} answered {} of {} steps:\n{text}",
        u.name,
        answers.len(),
        steps.len()
    );
    answers
}

/// Runs setup steps as `u`; every one must succeed.
fn setup_as(d: &Daemon, u: &User, steps: &[String]) {
    let bad: Vec<String> = run_as(d, u, steps)
        .into_iter()
        .filter(|(_, a)| *a != Answer::Allowed)
        .map(|(s, a)| format!("  {s}: {a}"))
        .collect();
    assert!(
        bad.is_empty(),
        "setting up as {}, these steps failed:\n{}",
        u.name,
        bad.join("\n")
    );
}

#[test]
fn both_doors_apply_the_same_access_policy() {
    maru_tests::require_root!();
    let d = Daemon::start(Opts {
        pools: vec!["memfs:{dir}/pool,size=64M".into()],
        mount: true,
        extra: vec![],
    });
    // Every caller reaches the mount point and the socket (the socket's group would do the
    // latter in production; these users share no group).
    std::fs::set_permissions(&d.dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&d.socket, std::fs::Permissions::from_mode(0o666)).unwrap();

    // The fixture. The owner makes each namespace and opens it to everyone (0777) while each
    // caller creates, for each door, the entries it will delete as its own, a stranger the
    // ones callers try to delete as another user's, and the owner the ones each caller looks
    // up and reads and the ones it pins; then the owner sets the namespace's mode. Every
    // caller has targets of its own on each door: no answer depends on what the kernel
    // cached for an earlier caller (it checks cached names itself, with the caller's
    // supplementary groups, where marud would be asked about a new one).
    let mut owner_steps = Vec::new();
    for mode in MODES {
        let ns = ns_of(mode);
        owner_steps.push(format!("mount:mkdir:{ns}"));
        owner_steps.push(format!("mount:chmod:{ns}:777"));
        owner_steps.push(format!("socket:create:{ns}/data"));
        for c in CALLERS {
            for door in DOORS {
                owner_steps.push(format!("socket:create:{ns}/entry-{}-{door}", c.name));
                owner_steps.push(format!("socket:create:{ns}/pin-{}-{door}", c.name));
            }
        }
    }
    setup_as(&d, &OWNER, &owner_steps);
    for c in CALLERS {
        let steps: Vec<String> = MODES
            .iter()
            .flat_map(|m| {
                DOORS.map(|door| format!("socket:create:{}/own-{}-{door}", ns_of(*m), c.name))
            })
            .collect();
        setup_as(&d, c, &steps);
    }
    let steps: Vec<String> = MODES
        .iter()
        .flat_map(|m| {
            CALLERS.into_iter().flat_map(move |c| {
                DOORS.map(|door| format!("socket:create:{}/theirs-{}-{door}", ns_of(*m), c.name))
            })
        })
        .collect();
    setup_as(&d, &STRANGER, &steps);
    let steps: Vec<String> = MODES
        .iter()
        .map(|m| format!("mount:chmod:{}:{m:o}", ns_of(*m)))
        .collect();
    setup_as(&d, &OWNER, &steps);

    // The fixture is what the rule assumes.
    let mut findings = Vec::new();
    for mode in MODES {
        let ns = ns_of(mode);
        let m = std::fs::metadata(d.path(&ns)).unwrap();
        let got = (m.uid(), m.gid(), m.mode() & 0o7777);
        if got != (OWNER.uid, OWNER.gid, mode) {
            findings.push(format!(
                "fixture: namespace {ns} is uid {} gid {} mode {:04o}, not the owner's {mode:04o}",
                got.0, got.1, got.2
            ));
        }
        let e = std::fs::metadata(d.path(&format!("{ns}/data"))).unwrap();
        if e.mode() & 0o7777 != ENTRY_MODE || e.uid() != OWNER.uid {
            findings.push(format!(
                "fixture: {ns}/data (stored by the owner through libmaru) is uid {} mode {:04o}, \
                 the rule says the owner's and {ENTRY_MODE:04o}",
                e.uid(),
                e.mode() & 0o7777
            ));
        }
    }

    // One process per caller and door, every operation in every namespace.
    let mut answers: BTreeMap<(&str, u32, Op, &str), Answer> = BTreeMap::new();
    for c in CALLERS {
        for door in DOORS {
            let mut steps = Vec::new();
            let mut keys = Vec::new();
            for mode in MODES {
                for op in Op::ALL {
                    if let Some(s) = op.step(door, &ns_of(mode), c) {
                        keys.push((s.clone(), (c.name, mode, op, door)));
                        steps.push(s);
                    }
                }
            }
            let mut got = run_as(&d, c, &steps);
            for (s, key) in keys {
                answers.insert(key, got.remove(&s).expect("answered"));
            }
        }
    }

    // (a) Both doors agree; (b) the answer is the rule's.
    let mut table = String::new();
    for mode in MODES {
        for c in CALLERS {
            for op in Op::ALL {
                let want = expected(op, c, mode);
                let socket = &answers[&(c.name, mode, op, "socket")];
                let mount = answers.get(&(c.name, mode, op, "mount"));
                let wrong = |a: &Answer| a.allowed() != Some(want);
                if wrong(socket) || mount.is_some_and(wrong) {
                    let disagree = mount.is_some_and(|m| m.allowed() != socket.allowed());
                    findings.push(format!(
                        "{:04o} {:<6} {:<26} rule: {:<7} socket: {socket:<15} mount: {}{}",
                        mode,
                        c.name,
                        op.name(),
                        if want { "allowed" } else { "denied" },
                        mount.map_or("(no such op)".to_owned(), Answer::to_string),
                        if disagree {
                            "  <- the doors disagree"
                        } else {
                            ""
                        },
                    ));
                }
                let _ = writeln!(
                    table,
                    "{mode:04o} {:<6} {:<26} {:<7} {socket:<15} {}",
                    c.name,
                    op.name(),
                    if want { "allowed" } else { "denied" },
                    mount.map_or("-".to_owned(), Answer::to_string)
                );
            }
        }
    }
    if std::env::var_os("MARU_TEST_SHOWTABLE").is_some() {
        eprintln!("mode caller op rule socket mount\n{table}");
    }
    assert!(
        findings.is_empty(),
        "{} of {} cases break the policy (mode, caller, operation):\n{}",
        findings.len(),
        MODES.len() * CALLERS.len() * Op::ALL.len(),
        findings.join("\n")
    );
}
