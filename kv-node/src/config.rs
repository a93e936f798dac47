//! Configuration of the kv-node: [`KnConfigFile`] (TOML + flags, every field documented and
//! defaulted) validated into [`KnConfig`]. config/kv-node.toml is a commented example parsed
//! by a test.

use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;

use crate::cache::Policy;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KnConfigFile {
    /// KN id to register as; absent = the DPM picks the lowest unused id.
    pub kn_id: Option<u32>,
    /// Address of the KvService.
    pub listen: String,
    /// Address clients (and the DPM's records) use to reach this KN, `HOST:PORT` or `HOST`
    /// (the listen port). Empty: `listen`, or the address this host's name resolves to when `listen` is a wildcard
    /// such as 0.0.0.0 (a wildcard is never advertised).
    pub advertise: String,
    /// gRPC address of the dpm-node.
    pub dpm: String,
    /// Worker shards (each owns a slice of this KN's keys, its cache and its log).
    pub shards: u32,
    /// Cache budget of the whole KN, split evenly across shards, e.g. "256MiB".
    pub cache_size: String,
    /// Cache policy: dac | shortcut-only | value-only | static-N (N = percent for values).
    pub cache_policy: String,
    /// Longest key accepted, in bytes.
    pub max_key_bytes: usize,
    /// Longest value accepted, in bytes.
    pub max_value_bytes: usize,
    /// A batch is flushed when it reaches this many bytes.
    pub batch_bytes: usize,
    /// ... or when its oldest write has waited this long (microseconds), if the log is busy.
    pub batch_delay_us: u64,
    /// Writes wait while a shard has more sealed-but-unmerged segments than this.
    pub max_unmerged_segments: usize,
    /// How often the cluster map is re-read from the DPM (milliseconds).
    pub map_poll_ms: u64,
    /// The KN serves only while its last successful map read started less than this long ago
    /// (milliseconds). A KN that was paused or cut off stops answering from its caches before
    /// the monitor declares it failed (keep it below the monitor's `failed_after_ms`).
    pub serve_lease_ms: u64,
    /// How long a KN stays prepared for a map change (PrepareMap) that is not committed
    /// (milliseconds). Then it asks the DPM: if the change is not recorded as past its point
    /// of no return, it withdraws it and resumes under the published map; otherwise it waits
    /// for the map and asks again after as long (docs/architecture.md, "Reconfiguration").
    /// Keep it a few times the monitor's `failed_after_ms`, well above a reconfiguration's
    /// prepare-to-publish time.
    pub prepare_timeout_ms: u64,
    /// Prometheus /metrics address; empty to disable.
    pub metrics_listen: String,
    /// Local RDMA device for the verbs fabric (when the dpm-node offers it), e.g. "rxe0".
    /// Empty: the `DINOMO_RDMA_DEVICE` environment variable, else the first device.
    pub rdma_device: String,
}

impl Default for KnConfigFile {
    fn default() -> Self {
        KnConfigFile {
            kn_id: None,
            listen: "127.0.0.1:7800".into(),
            advertise: String::new(),
            dpm: "127.0.0.1:7700".into(),
            shards: 2,
            cache_size: "256MiB".into(),
            cache_policy: "dac".into(),
            max_key_bytes: 1024,
            max_value_bytes: 1 << 20,
            batch_bytes: 256 << 10,
            batch_delay_us: 200,
            max_unmerged_segments: 2,
            map_poll_ms: 100,
            serve_lease_ms: 250,
            prepare_timeout_ms: 5000,
            metrics_listen: "127.0.0.1:9800".into(),
            rdma_device: String::new(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct KnConfig {
    pub kn_id: Option<u32>,
    pub listen: SocketAddr,
    /// Where clients reach this KN (never empty; see [`KnConfigFile::advertise`]). With
    /// `listen` on port 0, the server resolves it again once bound.
    pub advertise: String,
    /// `advertise` as configured (empty: derived from the listen address).
    pub advertise_setting: String,
    pub dpm: String,
    pub shards: u32,
    pub cache_bytes: usize,
    pub cache_policy: Policy,
    pub max_key_bytes: usize,
    pub max_value_bytes: usize,
    pub batch_bytes: usize,
    pub batch_delay: Duration,
    pub max_unmerged_segments: usize,
    pub map_poll: Duration,
    pub serve_lease: Duration,
    pub prepare_timeout: Duration,
    pub metrics_listen: Option<SocketAddr>,
    /// The verbs fabric's local RDMA device; `None`: `DINOMO_RDMA_DEVICE`, else the first.
    pub rdma_device: Option<String>,
}

impl KnConfigFile {
    pub fn from_toml(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }

    pub fn validate(self) -> Result<KnConfig, String> {
        let listen: SocketAddr = self
            .listen
            .parse()
            .map_err(|e| format!("listen = {:?}: not a socket address ({e})", self.listen))?;
        if self.shards == 0 || self.shards > 256 {
            return Err(format!("shards = {}: must be 1..=256", self.shards));
        }
        if self.max_key_bytes == 0 || self.max_key_bytes > dinomo_layout::log::MAX_KEY {
            return Err(format!(
                "max_key_bytes = {}: must be 1..={}",
                self.max_key_bytes,
                dinomo_layout::log::MAX_KEY
            ));
        }
        if self.batch_bytes < 4096 {
            return Err(format!(
                "batch_bytes = {}: must be at least 4096",
                self.batch_bytes
            ));
        }
        let cache_policy: Policy = self
            .cache_policy
            .parse()
            .map_err(|e| format!("cache_policy: {e}"))?;
        // Resolved again once the listener is bound (port 0 picks a port).
        let advertise =
            dinomo_node_common::address::advertise_address("kv-node", listen, &self.advertise)?;
        Ok(KnConfig {
            kn_id: self.kn_id,
            advertise,
            advertise_setting: self.advertise,
            listen,
            dpm: if self.dpm.starts_with("http") {
                self.dpm
            } else {
                format!("http://{}", self.dpm)
            },
            shards: self.shards,
            cache_bytes: dinomo_node_common::parse_size(&self.cache_size)? as usize,
            cache_policy,
            max_key_bytes: self.max_key_bytes,
            max_value_bytes: self.max_value_bytes,
            batch_bytes: self.batch_bytes,
            batch_delay: Duration::from_micros(self.batch_delay_us),
            max_unmerged_segments: self.max_unmerged_segments.max(1),
            map_poll: Duration::from_millis(self.map_poll_ms.max(1)),
            serve_lease: {
                if self.serve_lease_ms < 2 * self.map_poll_ms.max(1) {
                    return Err(format!(
                        "serve_lease_ms = {} must be at least twice map_poll_ms = {}, or the KN \
                         would stop serving between two map reads",
                        self.serve_lease_ms, self.map_poll_ms
                    ));
                }
                let lease = Duration::from_millis(self.serve_lease_ms);
                if lease > crate::lease::MAX_SERVE_LEASE {
                    return Err(format!(
                        "serve_lease_ms = {} is above {} ms, the longest lease a \
                         reconfiguration waits out after fencing a KN; a longer lease could \
                         serve stale values after a failover",
                        self.serve_lease_ms,
                        crate::lease::MAX_SERVE_LEASE.as_millis()
                    ));
                }
                lease
            },
            prepare_timeout: {
                if self.prepare_timeout_ms == 0 {
                    return Err("prepare_timeout_ms = 0: must be positive".into());
                }
                Duration::from_millis(self.prepare_timeout_ms)
            },
            metrics_listen: if self.metrics_listen.is_empty() {
                None
            } else {
                Some(
                    self.metrics_listen
                        .parse()
                        .map_err(|e| format!("metrics_listen: {e}"))?,
                )
            },
            rdma_device: Some(self.rdma_device).filter(|d| !d.trim().is_empty()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn example_config_parses_and_validates() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../config/kv-node.toml"
        ))
        .unwrap();
        let cfg = KnConfigFile::from_toml(&text).unwrap().validate().unwrap();
        assert_eq!(cfg.shards, 2);
        assert_eq!(cfg.cache_policy, Policy::Dac);
    }

    #[test]
    fn bad_values_are_refused() {
        assert!(KnConfigFile::from_toml("shard = 3").is_err());
        assert!(KnConfigFile {
            shards: 0,
            ..Default::default()
        }
        .validate()
        .is_err());
        assert!(KnConfigFile {
            cache_policy: "fifo".into(),
            ..Default::default()
        }
        .validate()
        .is_err());
        assert!(KnConfigFile {
            cache_size: "lots".into(),
            ..Default::default()
        }
        .validate()
        .is_err());
    }
}
