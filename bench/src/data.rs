//! The KV bytes every system moves: a deterministic pattern per chunk, so that any process
//! can produce the same chunk and every consumer proves it read the right bytes by a checksum.

/// Bytes of KV cache per token of a Llama-3.1-8B-shaped model in bf16:
/// 32 layers x 8 KV heads x 128 dims x 2 (K and V) x 2 bytes.
pub const BYTES_PER_TOKEN: usize = 32 * 8 * 128 * 2 * 2;
/// Tokens per chunk (LMCache's default chunk size).
pub const CHUNK_TOKENS: usize = 256;
/// Bytes per chunk (32 MiB).
pub const CHUNK_BYTES: usize = BYTES_PER_TOKEN * CHUNK_TOKENS;

fn word(chunk: u64, i: u64) -> u64 {
    (chunk << 40 | i).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Fills `buf` (a multiple of 8 bytes) with chunk `chunk`'s bytes.
pub fn fill(chunk: u64, buf: &mut [u8]) {
    for (i, w) in buf.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&word(chunk, i as u64).to_ne_bytes());
    }
}

#[cfg(test)]
/// The checksum [`sum`] gives over chunk `chunk` of `len` bytes, computed without the bytes.
pub fn expected_sum(chunk: u64, len: usize) -> u64 {
    (0..(len / 8) as u64).fold(0u64, |a, i| a.wrapping_add(word(chunk, i)))
}

/// Reads every byte once: the wrapping sum of the 8-byte words.
pub fn sum(bytes: &[u8]) -> u64 {
    let mut acc = [0u64; 4];
    let mut it = bytes.chunks_exact(32);
    for c in &mut it {
        for (k, a) in acc.iter_mut().enumerate() {
            let w = u64::from_ne_bytes(c[k * 8..k * 8 + 8].try_into().unwrap_or_default());
            *a = a.wrapping_add(w);
        }
    }
    let mut s = acc.iter().fold(0u64, |a, b| a.wrapping_add(*b));
    for w in it.remainder().chunks_exact(8) {
        s = s.wrapping_add(u64::from_ne_bytes(w.try_into().unwrap_or_default()));
    }
    s
}

/// A human label for a byte count.
pub fn size_label(b: usize) -> String {
    if b >= 1 << 30 && b.is_multiple_of(1 << 30) {
        format!("{} GiB", b >> 30)
    } else if b >= 1 << 20 {
        format!("{} MiB", b >> 20)
    } else {
        format!("{} KiB", b >> 10)
    }
}

/// A human label for a token count (1K = 1024 tokens).
pub fn tokens_label(t: usize) -> String {
    if t >= 1024 && t.is_multiple_of(1024) {
        format!("{}K", t / 1024)
    } else {
        t.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sum_of_filled_bytes_is_the_expected_sum() {
        let mut b = vec![0u8; 4096 + 40];
        fill(3, &mut b);
        assert_eq!(sum(&b), expected_sum(3, b.len()));
        let mut c = b.clone();
        fill(4, &mut c);
        assert_ne!(sum(&c), sum(&b), "chunks differ");
        c[100] ^= 1;
        assert_ne!(sum(&c), expected_sum(4, c.len()), "a flipped bit shows");
    }

    #[test]
    fn a_chunk_is_32_mib() {
        assert_eq!(CHUNK_BYTES, 32 << 20);
        assert_eq!(tokens_label(16384), "16K");
        assert_eq!(size_label(2 << 30), "2 GiB");
    }
}
