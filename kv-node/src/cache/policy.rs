//! Cache policies and their names in configs and on the command line.

use std::fmt;
use std::str::FromStr;

/// How a KN divides its cache between values and shortcuts.
///
/// Names (`FromStr`/`Display` round-trip): `dac`, `shortcut-only`, `value-only`,
/// `static-<0..=100>` (e.g. `static-50`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Policy {
    /// Disaggregated Adaptive Caching (paper Table 3, Eq. 1).
    Dac,
    /// Shortcuts only, LFU eviction (the paper's DINOMO-S).
    ShortcutOnly,
    /// Values only, LRU eviction.
    ValueOnly,
    /// `value_percent`% of the budget for values (LRU), the rest for shortcuts (LFU).
    Static { value_percent: u8 },
}

/// A policy name that is not one of the accepted forms.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown cache policy {0:?}: expected \"dac\", \"shortcut-only\", \"value-only\" \
     or \"static-N\" with N a percentage of the cache for values (0..=100)"
)]
pub struct ParsePolicyError(pub String);

impl FromStr for Policy {
    type Err = ParsePolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "dac" => Ok(Policy::Dac),
            "shortcut-only" => Ok(Policy::ShortcutOnly),
            "value-only" => Ok(Policy::ValueOnly),
            _ => s
                .strip_prefix("static-")
                // u8::from_str accepts a leading '+'; a percentage is digits only.
                .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|n| n.parse::<u8>().ok())
                .filter(|&p| p <= 100)
                .map(|value_percent| Policy::Static { value_percent })
                .ok_or_else(|| ParsePolicyError(s.to_owned())),
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Policy::Dac => f.write_str("dac"),
            Policy::ShortcutOnly => f.write_str("shortcut-only"),
            Policy::ValueOnly => f.write_str("value-only"),
            Policy::Static { value_percent } => write!(f, "static-{value_percent}"),
        }
    }
}
