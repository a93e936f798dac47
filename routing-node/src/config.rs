//! Configuration of the routing node, after the convention every node shares
//! ([`dinomo_node_common::config`]): [`RoutingConfig`] is what the TOML file says (every field
//! optional, unknown fields refused), flags override it, and [`RoutingConfig::validate`] checks
//! the result. config/routing-node.toml documents every field; a test checks it parses to the
//! defaults.

use std::net::SocketAddr;
use std::time::Duration;

use dinomo_node_common::config::{invalid, ConfigError};
use serde::Deserialize;

/// The routing node's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RoutingConfig {
    /// RoutingService address (`HOST:PORT`).
    pub listen: String,
    /// dpm-node gRPC address (the cluster map of record lives in its metadata).
    pub dpm: String,
    /// How often the map is re-read from the dpm-node, milliseconds (above 0).
    pub poll_ms: u64,
    /// Prometheus /metrics address; empty to disable.
    pub metrics_listen: String,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        RoutingConfig {
            listen: "127.0.0.1:7900".into(),
            dpm: "127.0.0.1:7700".into(),
            poll_ms: 50,
            metrics_listen: "127.0.0.1:9900".into(),
        }
    }
}

impl RoutingConfig {
    /// Checks every field; `Err` names the first bad one and its value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.listen.trim().is_empty() {
            return Err(invalid("listen", "empty; give HOST:PORT"));
        }
        if self.dpm.trim().is_empty() {
            return Err(invalid("dpm", "empty; give the dpm-node's HOST:PORT"));
        }
        if self.poll_ms == 0 {
            return Err(invalid("poll_ms", "0; must be at least 1 millisecond"));
        }
        self.metrics_addr()?;
        Ok(())
    }

    /// The /metrics address, `None` when disabled.
    pub fn metrics_addr(&self) -> Result<Option<SocketAddr>, ConfigError> {
        if self.metrics_listen.is_empty() {
            return Ok(None);
        }
        self.metrics_listen.parse().map(Some).map_err(|_| {
            invalid(
                "metrics_listen",
                format!(
                    "{:?} is not IP:PORT (or empty to disable)",
                    self.metrics_listen
                ),
            )
        })
    }

    pub fn poll(&self) -> Duration {
        Duration::from_millis(self.poll_ms)
    }

    /// The dpm-node as a URL.
    pub fn dpm_url(&self) -> String {
        if self.dpm.starts_with("http") {
            self.dpm.clone()
        } else {
            format!("http://{}", self.dpm)
        }
    }
}

#[cfg(test)]
mod tests {
    use dinomo_node_common::config::parse_toml;

    use super::*;

    #[test]
    fn the_shipped_example_is_the_defaults() {
        let text = include_str!("../../config/routing-node.toml");
        let cfg: RoutingConfig = parse_toml(text, "config/routing-node.toml").unwrap();
        assert_eq!(cfg, RoutingConfig::default());
        cfg.validate().unwrap();
    }

    #[test]
    fn bad_values_are_refused_by_field() {
        let e = parse_toml::<RoutingConfig>("poll = 5", "r.toml").unwrap_err();
        assert!(e.to_string().contains("unknown field `poll`"), "{e}");
        let cfg: RoutingConfig = parse_toml("poll_ms = 0", "r.toml").unwrap();
        let e = cfg.validate().unwrap_err();
        assert!(e.to_string().starts_with("poll_ms:"), "{e}");
        let cfg: RoutingConfig = parse_toml("metrics_listen = \"x\"", "r.toml").unwrap();
        let e = cfg.validate().unwrap_err();
        assert!(e.to_string().starts_with("metrics_listen:"), "{e}");
    }
}
