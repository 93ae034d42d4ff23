//! Who a remote worker is: the deployment's tokens, each mapped to a uid and gid whose
//! namespaces the worker may use under the same access policy as local clients.
//!
//! The token file (`remote_tokens` in marud.toml, `--remote-tokens`) holds one token a line:
//! `TOKEN UID:GID [NAME]`; blank lines and `#` comments are skipped. It must belong to root
//! and be readable by nobody else (mode 0600 or stricter): a token is a password. A worker's
//! token is compared with every token in constant time. Without a token file no worker is
//! admitted, unless the operator allows anonymous workers as a uid:gid of their choosing
//! (`remote_anonymous`).

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use anyhow::{Context, bail};

/// One admitted identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub uid: u32,
    pub gid: u32,
    /// For logs and status (the token's name, or "anonymous").
    pub name: String,
}

/// The tokens and the anonymous identity, if any.
#[derive(Debug, Default)]
pub struct Tokens {
    tokens: Vec<(Vec<u8>, Identity)>,
    anonymous: Option<Identity>,
}

impl Tokens {
    /// Reads a token file; `anonymous` admits workers without a token as that identity.
    pub fn load(path: Option<&Path>, anonymous: Option<(u32, u32)>) -> anyhow::Result<Self> {
        let mut t = Tokens {
            tokens: Vec::new(),
            anonymous: anonymous.map(|(uid, gid)| Identity {
                uid,
                gid,
                name: "anonymous".into(),
            }),
        };
        if let Some(path) = path {
            let meta = std::fs::metadata(path)
                .with_context(|| format!("remote token file {}", path.display()))?;
            if meta.mode() & 0o077 != 0 || meta.uid() != 0 {
                bail!(
                    "remote token file {} must belong to root with mode 0600 (it is {:o}, uid {}): \
                     its tokens are passwords",
                    path.display(),
                    meta.mode() & 0o777,
                    meta.uid()
                );
            }
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            t.tokens = parse(&text).with_context(|| format!("in {}", path.display()))?;
        }
        if t.tokens.is_empty() && t.anonymous.is_none() {
            bail!(
                "the remote door admits nobody: give a token file (remote_tokens) or allow \
                 anonymous workers (remote_anonymous = \"UID:GID\")"
            );
        }
        Ok(t)
    }

    /// The identity of a worker presenting `token`; `None`: refused.
    pub fn admit(&self, token: &str) -> Option<Identity> {
        let mut found = None;
        // Every token is compared, whatever matched: the time taken says nothing about which.
        for (t, who) in &self.tokens {
            if constant_time_eq(t, token.as_bytes()) {
                found = Some(who.clone());
            }
        }
        found.or_else(|| token.is_empty().then(|| self.anonymous.clone()).flatten())
    }
}

/// Parses `TOKEN UID:GID [NAME]` lines.
fn parse(text: &str) -> anyhow::Result<Vec<(Vec<u8>, Identity)>> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut words = line.split_whitespace();
        let (Some(token), Some(ids)) = (words.next(), words.next()) else {
            bail!("line {}: expected `TOKEN UID:GID [NAME]`", n + 1);
        };
        if token.len() < 16 {
            bail!("line {}: a token needs 16 characters at least", n + 1);
        }
        let (uid, gid) = parse_ids(ids).with_context(|| format!("line {}", n + 1))?;
        let name = words.next().unwrap_or("token").to_owned();
        out.push((token.as_bytes().to_vec(), Identity { uid, gid, name }));
    }
    Ok(out)
}

/// `UID:GID`.
pub fn parse_ids(s: &str) -> anyhow::Result<(u32, u32)> {
    let (u, g) = s
        .split_once(':')
        .with_context(|| format!("`{s}` is not UID:GID"))?;
    Ok((
        u.parse().with_context(|| format!("uid `{u}`"))?,
        g.parse().with_context(|| format!("gid `{g}`"))?,
    ))
}

/// Equal bytes, in a time that depends on the lengths only.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u8 | u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_map_to_identities_and_nothing_else_is_admitted() {
        let text =
            "# tokens\n\nAAAAAAAAAAAAAAAAAAAA 1000:1000 gpu-a\nBBBBBBBBBBBBBBBBBBBB 1001:100\n";
        let t = Tokens {
            tokens: parse(text).unwrap(),
            anonymous: None,
        };
        assert_eq!(t.admit("AAAAAAAAAAAAAAAAAAAA").unwrap().uid, 1000);
        assert_eq!(t.admit("BBBBBBBBBBBBBBBBBBBB").unwrap().name, "token");
        assert!(t.admit("AAAAAAAAAAAAAAAAAAA").is_none());
        assert!(t.admit("AAAAAAAAAAAAAAAAAAAAA").is_none());
        assert!(t.admit("").is_none());
    }

    #[test]
    fn anonymous_only_when_allowed_and_only_without_a_token() {
        let t = Tokens {
            tokens: Vec::new(),
            anonymous: Some(Identity {
                uid: 5,
                gid: 6,
                name: "anonymous".into(),
            }),
        };
        assert_eq!(t.admit("").unwrap().gid, 6);
        assert!(t.admit("wrong-token-xxxxxxxx").is_none());
    }

    #[test]
    fn bad_lines_are_refused_with_their_number() {
        assert!(parse("short 1:1\n").is_err());
        let e = parse("# c\nAAAAAAAAAAAAAAAAAAAA x:1\n").unwrap_err();
        assert!(format!("{e:#}").contains("line 2"), "{e:#}");
        assert!(parse("AAAAAAAAAAAAAAAAAAAA\n").is_err());
    }

    #[test]
    fn equality_is_exact() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"", b"a"));
        assert!(constant_time_eq(b"", b""));
    }
}
