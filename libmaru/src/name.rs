//! Name rules for namespaces and keys, defined once and enforced everywhere
//! (control socket, FUSE mount, on-pool layout).
//!
//! A *path* is `ns/key` where `ns` is one or more namespace components and
//! `key` is the last component. Every component:
//! - is 1..=255 bytes long ([`MAX_NAME_LEN`], the Linux `NAME_MAX`),
//! - contains no `/` and no NUL byte,
//! - is not `.` or `..`.
//!
//! A path has at most [`MAX_DEPTH`] components and at most [`MAX_PATH_LEN`] bytes.

use crate::error::{Error, Result};

/// Longest component, in bytes (Linux `NAME_MAX`).
pub const MAX_NAME_LEN: usize = 255;
/// Most components in one path (namespaces plus the key).
pub const MAX_DEPTH: usize = 32;
/// Longest whole path, in bytes (Linux `PATH_MAX` less its NUL): long keys nest
/// (see [`crate::key`]).
pub const MAX_PATH_LEN: usize = 4095;

/// Checks one path component.
pub fn check_component(name: &[u8]) -> Result<()> {
    if name.is_empty() {
        return Err(Error::InvalidName("empty name".into()));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(Error::NameTooLong(format!(
            "{} bytes, at most {MAX_NAME_LEN}",
            name.len()
        )));
    }
    if name == b"." || name == b".." {
        return Err(Error::InvalidName("`.` and `..` are not names".into()));
    }
    if name.contains(&0) {
        return Err(Error::InvalidName("name contains a NUL byte".into()));
    }
    if name.contains(&b'/') {
        return Err(Error::InvalidName("name contains `/`".into()));
    }
    Ok(())
}

/// Checks a namespace path (`a` or `a/b/c`) and returns its components.
pub fn split_ns(ns: &str) -> Result<Vec<&str>> {
    if ns.len() > MAX_PATH_LEN {
        return Err(Error::NameTooLong(format!("path of {} bytes", ns.len())));
    }
    let parts: Vec<&str> = ns.split('/').collect();
    if parts.len() >= MAX_DEPTH {
        return Err(Error::InvalidName(format!(
            "namespace deeper than {} levels",
            MAX_DEPTH - 1
        )));
    }
    for p in &parts {
        check_component(p.as_bytes())?;
    }
    Ok(parts)
}

/// A checked `ns/key` path.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EntryPath {
    ns: String,
    key: String,
}

impl EntryPath {
    /// Parses `ns/key` (the key is the last component; the namespace is
    /// everything before it and must not be empty).
    pub fn parse(path: &str) -> Result<Self> {
        let (ns, key) = Self::split(path)?;
        Ok(Self {
            ns: ns.to_owned(),
            key: key.to_owned(),
        })
    }

    /// Checks `ns/key` as [`parse`](Self::parse) does and returns its two parts, borrowed.
    pub fn split(path: &str) -> Result<(&str, &str)> {
        let (ns, key) = path.rsplit_once('/').ok_or_else(|| {
            Error::InvalidName(format!("`{path}` has no namespace (expected ns/key)"))
        })?;
        Self::check(ns, key)?;
        Ok((ns, key))
    }

    /// Builds a path from a namespace and a key, checking both.
    pub fn new(ns: &str, key: &str) -> Result<Self> {
        Self::check(ns, key)?;
        Ok(Self {
            ns: ns.to_owned(),
            key: key.to_owned(),
        })
    }

    fn check(ns: &str, key: &str) -> Result<()> {
        split_ns(ns)?;
        check_component(key.as_bytes())?;
        if ns.len() + 1 + key.len() > MAX_PATH_LEN {
            return Err(Error::NameTooLong(format!(
                "path of {} bytes",
                ns.len() + 1 + key.len()
            )));
        }
        Ok(())
    }

    /// The namespace part.
    pub fn ns(&self) -> &str {
        &self.ns
    }

    /// The key part (last component).
    pub fn key(&self) -> &str {
        &self.key
    }
}

impl std::fmt::Display for EntryPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.ns, self.key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn components() {
        assert!(check_component(b"abc").is_ok());
        assert!(check_component(&[b'a'; 255]).is_ok());
        assert!(matches!(
            check_component(&[b'a'; 256]),
            Err(Error::NameTooLong(_))
        ));
        assert!(check_component(b"").is_err());
        assert!(check_component(b".").is_err());
        assert!(check_component(b"..").is_err());
        assert!(check_component(b"a\0b").is_err());
        assert!(check_component(b"a/b").is_err());
        assert!(check_component(b"...").is_ok());
    }

    #[test]
    fn paths() {
        let p = EntryPath::parse("llama/a/key1").unwrap();
        assert_eq!(p.ns(), "llama/a");
        assert_eq!(p.key(), "key1");
        assert_eq!(p.to_string(), "llama/a/key1");
        assert!(EntryPath::parse("nokey").is_err());
        assert!(EntryPath::parse("/key").is_err());
        assert!(EntryPath::parse("ns/").is_err());
        assert!(EntryPath::parse("ns//k").is_err());
        assert!(EntryPath::parse("ns/../k").is_err());
    }
}
