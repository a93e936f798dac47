//! One configuration convention for every node (dpm-node, kv-node, routing-node, monitor):
//!
//! - a TOML file (`--config`, or the node's `DINOMO_<NODE>_CONFIG` variable) in which every
//!   field is optional (it takes its default) and an unknown field is an error, so a typo never
//!   falls back to a default unnoticed; config/<node>.toml documents every field and a test
//!   checks that it parses to the defaults;
//! - a flag (or its `DINOMO_*` variable) overrides the file, which overrides the default;
//! - sizes are [`ByteSize`] and durations integer milliseconds in fields named `*_ms`, both
//!   typed in the file's struct, so a bad value is refused when the file is read, by name;
//! - every refusal is a [`ConfigError`]: which file, which field, what was wrong.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Why a node's configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("reading {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The text is not valid TOML for the node's config (syntax, a wrong type, an unknown
    /// field, a malformed size). `origin` is the file (or what the text is).
    #[error("{origin}: {message}")]
    Parse { origin: String, message: String },
    /// A field (or flag) has a value outside its allowed range. `field` is its dotted name
    /// (`policy.under_utilized`, `pool_size`); `message` states the bad value and the rule.
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
}

/// A [`ConfigError::Invalid`] for `field`.
pub fn invalid(field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.to_string(),
        message: message.into(),
    }
}

/// Parses a TOML document into `T`; `origin` names it in errors.
pub fn parse_toml<T: DeserializeOwned>(text: &str, origin: &str) -> Result<T, ConfigError> {
    toml::from_str(text).map_err(|e| ConfigError::Parse {
        origin: origin.to_string(),
        message: e.to_string().trim_end().to_string(),
    })
}

/// Reads and parses the TOML file at `path`; `None` gives the defaults.
pub fn load_toml<T: DeserializeOwned + Default>(path: Option<&Path>) -> Result<T, ConfigError> {
    let Some(path) = path else {
        return Ok(T::default());
    };
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse_toml(&text, &path.display().to_string())
}

/// Deserializes a field written as a string through its `FromStr` (`#[serde(deserialize_with =
/// "...")]`), for enums such as a fabric kind or a cache policy: a bad value is refused when
/// the file is read, with the field and its line named, like any other type error.
pub fn from_str_field<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr,
    T::Err: fmt::Display,
{
    let text = String::deserialize(d)?;
    text.parse()
        .map_err(|e| serde::de::Error::custom(format!("{text:?}: {e}")))
}

/// A size in bytes, written with an optional binary unit: "64KiB", "8MiB", "1GiB", "512"
/// (K/KB, M/MB, G/GB, T/TB read as the binary units too). In TOML either such a string or an
/// integer number of bytes; as a flag, the string.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

impl ByteSize {
    pub const fn bytes(self) -> u64 {
        self.0
    }
}

impl FromStr for ByteSize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        crate::parse_size(s).map(ByteSize)
    }
}

impl fmt::Display for ByteSize {
    /// The largest binary unit that divides the size exactly: "8MiB", "1536KiB", "100B".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(u64, &str); 4] = [
            (1 << 40, "TiB"),
            (1 << 30, "GiB"),
            (1 << 20, "MiB"),
            (1 << 10, "KiB"),
        ];
        for (size, unit) in UNITS {
            if self.0 >= size && self.0.is_multiple_of(size) {
                return write!(f, "{}{unit}", self.0 / size);
            }
        }
        write!(f, "{}B", self.0)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Bytes(u64),
            Text(String),
        }
        match Written::deserialize(d)? {
            Written::Bytes(n) => Ok(ByteSize(n)),
            Written::Text(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Default, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    struct Sample {
        size: ByteSize,
        every_ms: u64,
        #[serde(deserialize_with = "from_str_field")]
        port: u16,
    }

    #[test]
    fn string_fields_are_parsed_when_the_file_is_read() {
        let s: Sample = parse_toml("port = \"7700\"", "t").unwrap();
        assert_eq!(s.port, 7700);
        let e = parse_toml::<Sample>("port = \"seventy\"", "node.toml").unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("port") && msg.contains("\"seventy\""), "{msg}");
    }

    #[test]
    fn sizes_are_read_as_text_with_units_or_as_integers() {
        let s: Sample = parse_toml("size = \"8MiB\"", "t").unwrap();
        assert_eq!(s.size, ByteSize(8 << 20));
        let s: Sample = parse_toml("size = 4096", "t").unwrap();
        assert_eq!(s.size, ByteSize(4096));
        assert_eq!("1GiB".parse::<ByteSize>().unwrap(), ByteSize(1 << 30));
    }

    #[test]
    fn a_bad_size_or_unknown_field_names_the_field_and_the_file() {
        let e = parse_toml::<Sample>("size = \"8 parsecs\"", "node.toml").unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, ConfigError::Parse { .. }), "{msg}");
        assert!(
            msg.starts_with("node.toml:") && msg.contains("size"),
            "{msg}"
        );
        assert!(msg.contains("unknown unit"), "{msg}");
        let e = parse_toml::<Sample>("every = 5", "node.toml").unwrap_err();
        assert!(e.to_string().contains("unknown field `every`"), "{e}");
        let e = parse_toml::<Sample>("every_ms = \"5s\"", "node.toml").unwrap_err();
        assert!(e.to_string().contains("every_ms"), "{e}");
    }

    #[test]
    fn sizes_print_in_the_largest_exact_unit_and_read_back() {
        for (n, text) in [
            (8u64 << 20, "8MiB"),
            (1536 << 10, "1536KiB"),
            (100, "100B"),
            (3 << 30, "3GiB"),
        ] {
            assert_eq!(ByteSize(n).to_string(), text);
            assert_eq!(text.parse::<ByteSize>().unwrap(), ByteSize(n));
        }
    }

    #[test]
    fn no_file_means_defaults_and_a_missing_file_is_an_io_error() {
        let s: Sample = load_toml(None).unwrap();
        assert_eq!(s.size, ByteSize(0));
        let e = load_toml::<Sample>(Some(Path::new("/nonexistent/node.toml"))).unwrap_err();
        assert!(matches!(e, ConfigError::Io { .. }), "{e}");
        assert!(e.to_string().contains("/nonexistent/node.toml"), "{e}");
    }
}
