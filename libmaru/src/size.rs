//! Byte sizes with suffixes (`4G`, `512M`, `64k`, `1GiB`).

use crate::error::{Error, Result};

/// Parses a byte count: a number with an optional binary suffix
/// (`k`/`K`/`KiB`, `M`/`MiB`, `G`/`GiB`, `T`/`TiB`; all powers of 1024).
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    if digits == 0 {
        return Err(Error::InvalidArgument(format!("bad size `{s}`")));
    }
    let n: u64 = t[..digits]
        .parse()
        .map_err(|_| Error::InvalidArgument(format!("bad size `{s}`")))?;
    let shift = match t[digits..].trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        other => return Err(Error::InvalidArgument(format!("bad size suffix `{other}`"))),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| Error::InvalidArgument(format!("size `{s}` overflows")))
}

/// Formats bytes for people (`1.5 GiB`).
pub fn format_size(n: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4G").unwrap(), 4 << 30);
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(parse_size("64k").unwrap(), 64 << 10);
        assert_eq!(parse_size("2MiB").unwrap(), 2 << 20);
        assert!(parse_size("x").is_err());
        assert!(parse_size("1Q").is_err());
        assert!(parse_size("99999999999T").is_err());
        assert_eq!(format_size(1536), "1.5 KiB");
    }
}
