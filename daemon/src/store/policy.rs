//! The access policy: who may do what to a namespace or an entry. Both doors (the control
//! socket and the mount) ask it, and nothing else decides access.
//!
//! The rules are POSIX's, as the kernel applies them to the mount (`default_permissions`), so
//! that a verb over the socket is allowed exactly when its file operation through `/maru` is:
//!
//! | operation | needs |
//! |---|---|
//! | look an entry up (`exists`, `stat`) | search (`x`) on every namespace of its path |
//! | list a namespace (`list`, the shared index, `readdir`) | search on its parents, read (`r`) on it |
//! | read an entry (`retrieve`, `open(O_RDONLY)`) | search on its path, read on the entry |
//! | hold an entry (`hold`; giving the hold back is a look up) | as read |
//! | create an entry or namespace (`store`, `mkdir`, `create`) | search on its path, write (`w`) on the namespace |
//! | delete an entry or namespace (`delete`, `unlink`, `rmdir`) | as create; in a sticky namespace (`1xxx`) the caller must also own the entry or the namespace |
//! | pin an entry (`pin`, `setfattr user.maru.pinned`) | search on its path, write on the entry (sealed entries stay immutable whatever their mode) |
//! | set a quota, evict | root |
//! | chmod/chown a node | its owner or root (chown to another user: root) |
//!
//! Root may do everything.

use maru::{Error, Result};
use maru_fsd::Caller;

/// Read permission bit.
pub const R: u32 = 4;
/// Write permission bit.
pub const W: u32 = 2;
/// Search (execute) permission bit.
pub const X: u32 = 1;
/// The sticky bit of a namespace.
pub const STICKY: u32 = 0o1000;
/// The mode bits an entry can have: never set-user-ID or set-group-ID (entries are data; the
/// mount is `nosuid,noexec`), so no write or truncate ever has such bits (or file
/// capabilities: only `user.maru.*` attributes exist) to clear, which lets the mount take the
/// kernel's FUSE_HANDLE_KILLPRIV_V2 without a GETXATTR before every `write(2)`.
pub const ENTRY_MODES: u32 = 0o777;

/// Owner, group and mode of a node (namespace or entry).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Perm {
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Mode bits (`0o7777`).
    pub mode: u32,
}

/// What a caller wants to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access<'a> {
    /// Look a name up in the namespace.
    Lookup,
    /// List the namespace (names, sizes, the shared index).
    List,
    /// Read the entry `Perm`.
    Read(&'a Perm),
    /// Create a name in the namespace.
    Create,
    /// Delete the node `Perm` (an entry, or a namespace's child) from the namespace.
    Delete(&'a Perm),
    /// Pin or unpin the entry `Perm`.
    Pin(&'a Perm),
    /// Set a namespace quota.
    SetQuota,
    /// Evict entries by hand.
    Evict,
}

impl Access<'_> {
    fn verb(&self) -> &'static str {
        match self {
            Access::Lookup => "look up in",
            Access::List => "list",
            Access::Read(_) => "read in",
            Access::Create => "create in",
            Access::Delete(_) => "delete in",
            Access::Pin(_) => "pin in",
            Access::SetQuota => "set the quota of",
            Access::Evict => "evict from",
        }
    }
}

/// Whether `mode` owned by `p` grants `want` (a mask of [`R`], [`W`], [`X`]) to `c`.
pub fn grants(c: &Caller, p: &Perm, want: u32) -> bool {
    if c.uid == 0 {
        return true;
    }
    let bits = if c.uid == p.uid {
        (p.mode >> 6) & 7
    } else if c.in_group(p.gid) {
        (p.mode >> 3) & 7
    } else {
        p.mode & 7
    };
    bits & want == want
}

/// Decides `access` by `c` in the namespace whose path (the namespaces from the root's
/// first child down to it, the namespace itself last) is `path`; `name` names it in errors.
pub fn check(c: &Caller, path: &[Perm], name: &str, access: Access<'_>) -> Result<()> {
    let denied = || Error::PermissionDenied(format!("{} `{name}`", access.verb()));
    if c.uid == 0 {
        return Ok(());
    }
    let Some((ns, parents)) = path.split_last() else {
        // The mount's root (mode 1777, root's): anyone may look up, list and create
        // namespaces in it; deletion follows the sticky rule.
        return match access {
            Access::Lookup | Access::List | Access::Create => Ok(()),
            Access::Delete(p) if p.uid == c.uid => Ok(()),
            _ => Err(denied()),
        };
    };
    if !parents.iter().all(|p| grants(c, p, X)) {
        return Err(denied());
    }
    let ok = match access {
        Access::Lookup => grants(c, ns, X),
        Access::List => grants(c, ns, R),
        Access::Read(e) => grants(c, ns, X) && grants(c, e, R),
        Access::Create => grants(c, ns, W | X),
        Access::Delete(e) => {
            grants(c, ns, W | X) && (ns.mode & STICKY == 0 || c.uid == e.uid || c.uid == ns.uid)
        }
        Access::Pin(e) => grants(c, ns, X) && grants(c, e, W),
        Access::SetQuota | Access::Evict => false,
    };
    if ok { Ok(()) } else { Err(denied()) }
}

/// Whether `c` may change the mode of the node `p` (and its owner to `uid`, group to `gid`).
pub fn may_chown(c: &Caller, p: &Perm, uid: Option<u32>, gid: Option<u32>) -> bool {
    if c.uid == 0 {
        return true;
    }
    c.uid == p.uid && uid.is_none_or(|u| u == c.uid) && gid.is_none_or(|g| c.in_group(g))
}

#[cfg(test)]
mod tests {
    use super::*;

    const OWNER: u32 = 1001;
    const MEMBER: u32 = 1002;
    const OTHER: u32 = 1003;

    fn caller(uid: u32) -> Caller {
        let groups = if uid == MEMBER { vec![OWNER] } else { vec![] };
        Caller::with_group_list(uid, uid, 0, groups)
    }

    fn ns(mode: u32) -> Perm {
        Perm {
            uid: OWNER,
            gid: OWNER,
            mode,
        }
    }

    #[test]
    fn sticky_namespaces_protect_other_users_entries() {
        let n = [ns(0o1777)];
        let mine = Perm {
            uid: OTHER,
            gid: OTHER,
            mode: 0o644,
        };
        let owners = Perm {
            uid: OWNER,
            gid: OWNER,
            mode: 0o644,
        };
        assert!(check(&caller(OTHER), &n, "s", Access::Delete(&mine)).is_ok());
        assert!(check(&caller(OTHER), &n, "s", Access::Delete(&owners)).is_err());
        assert!(check(&caller(OWNER), &n, "s", Access::Delete(&mine)).is_ok());
        assert!(check(&caller(0), &n, "s", Access::Delete(&owners)).is_ok());
        let plain = [ns(0o777)];
        assert!(check(&caller(OTHER), &plain, "s", Access::Delete(&owners)).is_ok());
    }

    #[test]
    fn read_needs_search_on_the_path_and_read_on_the_entry() {
        let e = Perm {
            uid: OWNER,
            gid: OWNER,
            mode: 0o644,
        };
        assert!(check(&caller(OTHER), &[ns(0o711)], "n", Access::Read(&e)).is_ok());
        assert!(check(&caller(OTHER), &[ns(0o711)], "n", Access::List).is_err());
        assert!(check(&caller(OTHER), &[ns(0o744)], "n", Access::Read(&e)).is_err());
        assert!(check(&caller(MEMBER), &[ns(0o750)], "n", Access::Read(&e)).is_ok());
        assert!(
            check(
                &caller(OTHER),
                &[ns(0o700), ns(0o777)],
                "n/c",
                Access::Lookup
            )
            .is_err()
        );
        let private = Perm { mode: 0o600, ..e };
        assert!(check(&caller(MEMBER), &[ns(0o750)], "n", Access::Read(&private)).is_err());
    }

    #[test]
    fn pin_needs_write_on_the_entry() {
        let e = Perm {
            uid: OWNER,
            gid: OWNER,
            mode: 0o644,
        };
        assert!(check(&caller(OWNER), &[ns(0o755)], "n", Access::Pin(&e)).is_ok());
        assert!(check(&caller(MEMBER), &[ns(0o777)], "n", Access::Pin(&e)).is_err());
        assert!(check(&caller(0), &[ns(0o700)], "n", Access::Pin(&e)).is_ok());
    }

    #[test]
    fn quotas_and_eviction_are_for_root() {
        assert!(check(&caller(OWNER), &[ns(0o777)], "n", Access::SetQuota).is_err());
        assert!(check(&caller(0), &[ns(0o777)], "n", Access::SetQuota).is_ok());
        assert!(check(&caller(OWNER), &[], "", Access::Evict).is_err());
    }

    #[test]
    fn the_root_namespace_is_open_to_all_and_sticky() {
        let theirs = ns(0o755);
        assert!(check(&caller(OTHER), &[], "", Access::Create).is_ok());
        assert!(check(&caller(OTHER), &[], "", Access::Delete(&theirs)).is_err());
        assert!(check(&caller(OWNER), &[], "", Access::Delete(&theirs)).is_ok());
    }
}
