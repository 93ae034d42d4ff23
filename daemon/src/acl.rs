//! POSIX access ACLs, written as the kernel takes them: the `system.posix_acl_access` extended
//! attribute (`include/uapi/linux/posix_acl_xattr.h`): a `u32` version (2), then one entry per
//! grant, `u16` tag, `u16` permission bits, `u32` id, little-endian, ordered by tag and id.
//! (Written here rather than through libacl, whose headers every build would then need.)

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

const VERSION: u32 = 2;
const USER_OBJ: u16 = 0x01;
const USER: u16 = 0x02;
const GROUP_OBJ: u16 = 0x04;
const MASK: u16 = 0x10;
const OTHER: u16 = 0x20;
/// The id of entries that name no one (the owner, the owning group, the mask, others).
const NO_ID: u32 = u32::MAX;

/// Read permission.
pub const READ: u32 = 4;
/// Search (execute) permission.
pub const SEARCH: u32 = 1;

/// An access ACL: the owner's, one named user's (if any), the owning group's and others'
/// permission bits (`rwx`, 0 to 7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Acl {
    /// The file's owner.
    pub owner: u32,
    /// A named user and its bits.
    pub user: Option<(u32, u32)>,
    /// The owning group.
    pub group: u32,
    /// Everyone else.
    pub other: u32,
}

impl Acl {
    /// The attribute's bytes. With a named user the mask is the union of the named user's and
    /// the owning group's bits, so it takes nothing from either.
    pub fn to_xattr(self) -> Vec<u8> {
        let mut ents: Vec<(u16, u32, u32)> = vec![(USER_OBJ, self.owner, NO_ID)];
        if let Some((uid, bits)) = self.user {
            ents.push((USER, bits, uid));
        }
        ents.push((GROUP_OBJ, self.group, NO_ID));
        if let Some((_, bits)) = self.user {
            ents.push((MASK, bits | self.group, NO_ID));
        }
        ents.push((OTHER, self.other, NO_ID));
        let mut b = VERSION.to_le_bytes().to_vec();
        for (tag, perm, id) in ents {
            b.extend_from_slice(&tag.to_le_bytes());
            b.extend_from_slice(&((perm & 7) as u16).to_le_bytes());
            b.extend_from_slice(&id.to_le_bytes());
        }
        b
    }

    /// Makes this the access ACL of `f` (and its mode bits the kernel's reflection of it);
    /// `EOPNOTSUPP` on a filesystem without ACLs.
    pub fn apply(&self, f: &File) -> io::Result<()> {
        self.set(f, c"system.posix_acl_access")
    }

    /// Makes this the default ACL of directory `f`: what files created in it take instead of
    /// the creating process's umask (their mode is the one asked for, within these bits).
    pub fn apply_default(&self, f: &File) -> io::Result<()> {
        self.set(f, c"system.posix_acl_default")
    }

    fn set(&self, f: &File, name: &std::ffi::CStr) -> io::Result<()> {
        let v = self.to_xattr();
        // SAFETY: a valid descriptor, a NUL-terminated name, and a buffer of `v.len()` bytes.
        let r =
            unsafe { libc::fsetxattr(f.as_raw_fd(), name.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

/// Removes the access ACL of `f` (its mode bits stay); nothing to do where it has none or the
/// filesystem takes no ACLs.
pub fn remove_access(f: &File) -> io::Result<()> {
    remove(f, c"system.posix_acl_access")
}

/// Removes the default ACL of directory `f`, as [`remove_access`].
pub fn remove_default(f: &File) -> io::Result<()> {
    remove(f, c"system.posix_acl_default")
}

fn remove(f: &File, name: &std::ffi::CStr) -> io::Result<()> {
    // SAFETY: a valid descriptor and a NUL-terminated name.
    if unsafe { libc::fremovexattr(f.as_raw_fd(), name.as_ptr()) } == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ENODATA | libc::EOPNOTSUPP) => Ok(()),
        _ => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_ordered_with_a_mask_only_for_a_named_user() {
        let plain = Acl {
            owner: 7,
            user: None,
            group: 5,
            other: 0,
        };
        // version, then user::rwx, group::r-x, other::---
        let mut want = vec![2, 0, 0, 0];
        for (tag, perm, id) in [
            (1u16, 7u16, u32::MAX),
            (4, 5, u32::MAX),
            (0x20, 0, u32::MAX),
        ] {
            want.extend_from_slice(&tag.to_le_bytes());
            want.extend_from_slice(&perm.to_le_bytes());
            want.extend_from_slice(&id.to_le_bytes());
        }
        assert_eq!(plain.to_xattr(), want);
        let named = Acl {
            user: Some((1000, 1)),
            group: 4,
            ..plain
        };
        let b = named.to_xattr();
        let ents: Vec<(u16, u16, u32)> = b[4..]
            .chunks(8)
            .map(|c| {
                (
                    u16::from_le_bytes([c[0], c[1]]),
                    u16::from_le_bytes([c[2], c[3]]),
                    u32::from_le_bytes([c[4], c[5], c[6], c[7]]),
                )
            })
            .collect();
        assert_eq!(
            ents,
            vec![
                (0x01, 7, u32::MAX),
                (0x02, 1, 1000),
                (0x04, 4, u32::MAX),
                (0x10, 5, u32::MAX),
                (0x20, 0, u32::MAX),
            ]
        );
    }
}
