//! Medians and spread of repeated measurements.

use serde::Serialize;

/// Repeated measurements of one quantity.
#[derive(Debug, Clone, Serialize)]
pub struct Stat {
    /// Median.
    pub median: f64,
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
    /// Every sample, in the order measured.
    pub samples: Vec<f64>,
}

impl Stat {
    /// Summarizes `samples` (at least one).
    pub fn of(samples: Vec<f64>) -> Stat {
        let mut s = samples.clone();
        s.sort_by(f64::total_cmp);
        let n = s.len();
        let median = if n == 0 {
            f64::NAN
        } else if n % 2 == 1 {
            s[n / 2]
        } else {
            (s[n / 2 - 1] + s[n / 2]) / 2.0
        };
        Stat {
            median,
            min: s.first().copied().unwrap_or(f64::NAN),
            max: s.last().copied().unwrap_or(f64::NAN),
            samples,
        }
    }

    /// `median [min–max]` with `digits` decimals.
    pub fn show(&self, digits: usize) -> String {
        format!(
            "{:.d$} [{:.d$}–{:.d$}]",
            self.median,
            self.min,
            self.max,
            d = digits
        )
    }
}

/// The `q` quantile (0..=1) of latencies, nearest rank.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// Decimals that show a value of this size sensibly.
pub fn digits_for(v: f64) -> usize {
    if v >= 100.0 {
        0
    } else if v >= 10.0 {
        1
    } else if v >= 1.0 {
        2
    } else {
        3
    }
}

/// A short human number (1.2k, 3.4M).
pub fn human(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if v >= 1e4 {
        format!("{:.0}k", v / 1e3)
    } else if v >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn human_numbers() {
        assert_eq!(super::human(1234.0), "1.2k");
        assert_eq!(super::human(3_400_000.0), "3.40M");
    }

    use super::*;

    #[test]
    fn median_and_spread() {
        let s = Stat::of(vec![3.0, 1.0, 2.0]);
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        assert_eq!(Stat::of(vec![4.0, 1.0, 2.0, 3.0]).median, 2.5);
        assert_eq!(s.show(1), "2.0 [1.0–3.0]");
        assert_eq!(quantile(&[1.0, 2.0, 3.0, 4.0, 5.0], 0.99), 5.0);
        assert_eq!(quantile(&[1.0, 2.0, 3.0, 4.0, 5.0], 0.5), 3.0);
    }
}
