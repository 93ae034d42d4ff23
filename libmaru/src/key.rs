//! Any key as an entry name: the one reversible encoding every door uses (this crate, the
//! Python package, the LMCache plugin), so a key stored through one is found through the
//! others and under `/maru`.
//!
//! A key is any byte string (Python `str` keys are their UTF-8 bytes, `int` keys their
//! decimal digits). Its name:
//!
//! 1. **Escaping.** Each byte is kept as it is, except these, written `%XX` (two upper-case
//!    hex digits): `%`, `/`, NUL, any byte that is not part of valid UTF-8, and a `.` that
//!    starts the key (so no name is `.`, `..` or hidden). The empty key is the name `%`.
//! 2. **Long keys.** A name of at most [`MAX_NAME_LEN`] (255) bytes is the entry's name in the
//!    namespace. A longer one is cut into segments of at most [`SEGMENT_LEN`] bytes (never
//!    inside an escape or a UTF-8 character); every segment but the last ends with `%+` and is
//!    a namespace nested in the previous one: `seg1%+/seg2%+/last`. Those namespaces are
//!    created when such a key is stored.
//!
//! Decoding reverses both steps. No escaped name contains `%+` or a lone `%` other than the
//! empty key's, so plain keys, long keys and the empty key never collide.

use crate::error::{Error, Result};
use crate::name::MAX_NAME_LEN;

/// Most bytes of one segment of a long key, before its `%+` mark.
pub const SEGMENT_LEN: usize = 250;
/// The mark ending every segment of a long key but the last.
pub const CONTINUED: &str = "%+";
/// The name of the empty key.
const EMPTY: &str = "%";

/// The name of `key` relative to its namespace: one component, or `seg%+/…/last` for a long key.
pub fn encode(key: &[u8]) -> String {
    if key.is_empty() {
        return EMPTY.to_owned();
    }
    let mut out = String::with_capacity(key.len());
    let mut rest = key;
    let mut first = true;
    while !rest.is_empty() {
        let (valid, bad) = match std::str::from_utf8(rest) {
            Ok(s) => (s, &[][..]),
            Err(e) => {
                let (ok, tail) = rest.split_at(e.valid_up_to());
                let ok = std::str::from_utf8(ok).expect("valid prefix");
                let n = e.error_len().unwrap_or(tail.len());
                (ok, &tail[..n])
            }
        };
        for ch in valid.chars() {
            match ch {
                '%' | '/' | '\0' => escape(&mut out, ch as u8),
                '.' if first => escape(&mut out, b'.'),
                c => out.push(c),
            }
            first = false;
        }
        for &b in bad {
            escape(&mut out, b);
            first = false;
        }
        rest = &rest[valid.len() + bad.len()..];
    }
    if out.len() <= MAX_NAME_LEN {
        return out;
    }
    split_long(&out)
}

fn escape(out: &mut String, b: u8) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    out.push('%');
    out.push(HEX[usize::from(b >> 4)] as char);
    out.push(HEX[usize::from(b & 15)] as char);
}

/// Cuts an escaped name into segments, never inside an escape or a character.
fn split_long(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + name.len() / SEGMENT_LEN * 3);
    let mut rest = name;
    while rest.len() > MAX_NAME_LEN {
        // Cut at a character boundary, not inside a `%XX` escape, and so that no segment
        // starts with `.` (no segment is `.`, `..` or hidden).
        let mut cut = SEGMENT_LEN;
        while !rest.is_char_boundary(cut)
            || rest.as_bytes()[cut - 2..cut].contains(&b'%')
            || rest[cut..].starts_with('.')
        {
            cut -= 1;
        }
        out.push_str(&rest[..cut]);
        out.push_str(CONTINUED);
        out.push('/');
        rest = &rest[cut..];
    }
    out.push_str(rest);
    out
}

/// The key whose name is `name` (as [`encode`] wrote it, relative to its namespace).
pub fn decode(name: &str) -> Result<Vec<u8>> {
    let bad = |why: &str| Error::InvalidName(format!("`{name}` is not an encoded key: {why}"));
    if name == EMPTY {
        return Ok(Vec::new());
    }
    let parts: Vec<&str> = name.split('/').collect();
    let mut out = Vec::with_capacity(name.len());
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        let body = match (part.strip_suffix(CONTINUED), last) {
            (Some(b), false) => b,
            (None, true) => part,
            (Some(_), true) => return Err(bad("the last segment is marked continued")),
            (None, false) => return Err(bad("a segment lacks its `%+` mark")),
        };
        let b = body.as_bytes();
        let mut j = 0;
        while j < b.len() {
            if b[j] == b'%' {
                let hex = b
                    .get(j + 1..j + 3)
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .filter(|h| h.bytes().all(|c| matches!(c, b'0'..=b'9' | b'A'..=b'F')))
                    .ok_or_else(|| bad("`%` not followed by two upper-case hex digits"))?;
                out.push(u8::from_str_radix(hex, 16).expect("checked hex"));
                j += 3;
            } else {
                out.push(b[j]);
                j += 1;
            }
        }
    }
    if out.is_empty() {
        return Err(bad("empty"));
    }
    Ok(out)
}

/// The key's entry path in namespace `ns`: `ns/name`.
pub fn path(ns: &str, key: &[u8]) -> String {
    let name = encode(key);
    let mut p = String::with_capacity(ns.len() + 1 + name.len());
    p.push_str(ns);
    p.push('/');
    p.push_str(&name);
    p
}

/// For a long key's path, the namespaces its segments need, outermost first (empty for
/// a key whose name is one component).
pub fn segment_namespaces(path: &str) -> Vec<&str> {
    path.match_indices(&format!("{CONTINUED}/"))
        .map(|(i, _)| &path[..i + CONTINUED.len()])
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::name::{EntryPath, check_component};
    use proptest::prelude::*;

    #[test]
    fn plain_keys_are_their_own_names() {
        assert_eq!(encode(b"chunk-0"), "chunk-0");
        assert_eq!(encode(b"42"), "42");
        assert_eq!(encode("키".as_bytes()), "키");
        assert_eq!(encode(b"a.b"), "a.b");
        assert_eq!(
            encode(b"meta-llama/Llama-3.1-8B@1@0@ab12@bfloat16"),
            "meta-llama%2FLlama-3.1-8B@1@0@ab12@bfloat16"
        );
    }

    #[test]
    fn special_bytes_are_escaped() {
        assert_eq!(encode(b"."), "%2E");
        assert_eq!(encode(b".."), "%2E.");
        assert_eq!(encode(b".maru-alloc-1"), "%2Emaru-alloc-1");
        assert_eq!(encode(b"50%"), "50%25");
        assert_eq!(encode(b"a\0b"), "a%00b");
        assert_eq!(encode(&[0xff, b'a', 0xc3]), "%FFa%C3");
        assert_eq!(encode(b""), "%");
        assert_eq!(decode("%").unwrap(), b"");
    }

    #[test]
    fn long_keys_become_nested_segments() {
        let key = vec![b'k'; 1024];
        let name = encode(&key);
        let parts: Vec<&str> = name.split('/').collect();
        assert_eq!(parts.len(), 5);
        assert!(parts[..4].iter().all(|p| p.ends_with(CONTINUED)));
        assert_eq!(decode(&name).unwrap(), key);
        let p = path("ns", &key);
        let segs = segment_namespaces(&p);
        assert_eq!(segs.len(), 4);
        assert!(segs[0].starts_with("ns/k") && segs[0].ends_with("%+"));
        assert!(EntryPath::parse(&p).is_ok(), "{p}");
        // Escapes are never cut.
        let slashes = vec![b'/'; 1024];
        assert_eq!(decode(&encode(&slashes)).unwrap(), slashes);
        assert!(EntryPath::parse(&path("ns", &slashes)).is_ok());
    }

    #[test]
    fn malformed_names_are_refused() {
        for bad in ["a%", "a%4", "a%4g", "a%+", "a/b", ""] {
            assert!(decode(bad).is_err(), "{bad}");
        }
    }

    proptest! {
        #[test]
        fn any_key_round_trips(key in proptest::collection::vec(any::<u8>(), 0..1300)) {
            let name = encode(&key);
            prop_assert_eq!(decode(&name).unwrap(), key.clone());
            for part in name.split('/') {
                prop_assert!(check_component(part.as_bytes()).is_ok(), "{}", part);
                prop_assert!(!part.starts_with('.'));
            }
            prop_assert!(EntryPath::parse(&path("ns", &key)).is_ok());
        }

        #[test]
        fn any_text_key_round_trips(key in "\\PC{0,600}") {
            prop_assert_eq!(decode(&encode(key.as_bytes())).unwrap(), key.as_bytes());
        }
    }
}
