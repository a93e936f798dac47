//! Configuration of the kv-node, after the convention every node shares
//! ([`dinomo_node_common::config`]): [`KnConfigFile`] (TOML + flags, every field documented and
//! defaulted; sizes and the cache policy typed, so a bad one is refused when the file is read)
//! validated into [`KnConfig`]; every refusal is a [`ConfigError`] naming the field.
//! config/kv-node.toml is a commented example parsed by a test.

use std::net::SocketAddr;
use std::time::Duration;

use dinomo_node_common::config::{from_str_field, invalid, parse_toml, ByteSize, ConfigError};
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
    pub cache_size: ByteSize,
    /// Cache policy: dac | shortcut-only | value-only | static-N (N = percent for values).
    #[serde(deserialize_with = "from_str_field")]
    pub cache_policy: Policy,
    /// Longest key accepted, in bytes.
    pub max_key_bytes: usize,
    /// Longest value accepted, e.g. "1MiB".
    pub max_value_bytes: ByteSize,
    /// A batch is flushed when it reaches this size, e.g. "256KiB".
    pub batch_bytes: ByteSize,
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
            cache_size: ByteSize(256 << 20),
            cache_policy: Policy::Dac,
            max_key_bytes: 1024,
            max_value_bytes: ByteSize(1 << 20),
            batch_bytes: ByteSize(256 << 10),
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
    /// TLS and access checks for the KvService and for the channels to the dpm-node; from the
    /// command line (`--credentials`, `--insecure`), never from the file. Plain text when built
    /// in process (tests) until told otherwise.
    pub security: dinomo_security::Security,
}

impl KnConfigFile {
    /// The defaults for a KN run inside a test or a benchmark: id `kn_id`, the dpm-node at
    /// `dpm`, the KvService on an ephemeral loopback port, no metrics endpoint (process-wide).
    pub fn in_process(kn_id: u32, dpm: impl Into<String>) -> Self {
        KnConfigFile {
            kn_id: Some(kn_id),
            listen: "127.0.0.1:0".into(),
            dpm: dpm.into(),
            metrics_listen: String::new(),
            ..Default::default()
        }
    }

    /// Parses a config file's text (`origin` names it in errors).
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, ConfigError> {
        parse_toml(text, origin)
    }

    pub fn validate(self) -> Result<KnConfig, ConfigError> {
        let listen: SocketAddr = self.listen.parse().map_err(|e| {
            invalid(
                "listen",
                format!("{:?} is not a socket address ({e})", self.listen),
            )
        })?;
        // Each shard keeps one segment open in the KN's fabric write window, which holds
        // `MAX_WINDOW_RANGES` ranges: one is the cell space, and the rest leave room for the
        // segments of seals that failed and wait to be retried.
        let max_shards = (dinomo_fabric::grants::MAX_WINDOW_RANGES / 2) as u32;
        if self.shards == 0 || self.shards > max_shards {
            return Err(invalid(
                "shards",
                format!(
                    "{}: must be 1..={max_shards} (each shard's open log segment takes a range \
                     of the KN's fabric write window, which holds {})",
                    self.shards,
                    dinomo_fabric::grants::MAX_WINDOW_RANGES
                ),
            ));
        }
        if self.max_key_bytes == 0 || self.max_key_bytes > dinomo_layout::log::MAX_KEY {
            return Err(invalid(
                "max_key_bytes",
                format!(
                    "{}: must be 1..={}",
                    self.max_key_bytes,
                    dinomo_layout::log::MAX_KEY
                ),
            ));
        }
        if self.batch_bytes.bytes() < 4096 {
            return Err(invalid(
                "batch_bytes",
                format!("{}: must be at least 4KiB", self.batch_bytes),
            ));
        }
        if self.max_value_bytes.bytes() > u32::MAX as u64 {
            return Err(invalid(
                "max_value_bytes",
                format!("{}: must be below 4GiB", self.max_value_bytes),
            ));
        }
        // Resolved again once the listener is bound (port 0 picks a port).
        let advertise =
            dinomo_node_common::address::advertise_address("kv-node", listen, &self.advertise)
                .map_err(|e| invalid("advertise", e))?;
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
            cache_bytes: self.cache_size.bytes() as usize,
            cache_policy: self.cache_policy,
            max_key_bytes: self.max_key_bytes,
            max_value_bytes: self.max_value_bytes.bytes() as usize,
            batch_bytes: self.batch_bytes.bytes() as usize,
            batch_delay: Duration::from_micros(self.batch_delay_us),
            max_unmerged_segments: self.max_unmerged_segments.max(1),
            map_poll: Duration::from_millis(self.map_poll_ms.max(1)),
            serve_lease: {
                if self.serve_lease_ms < 2 * self.map_poll_ms.max(1) {
                    return Err(invalid(
                        "serve_lease_ms",
                        format!(
                            "{} must be at least twice map_poll_ms = {}, or the KN would stop \
                             serving between two map reads",
                            self.serve_lease_ms, self.map_poll_ms
                        ),
                    ));
                }
                let lease = Duration::from_millis(self.serve_lease_ms);
                if lease > crate::lease::MAX_SERVE_LEASE {
                    return Err(invalid(
                        "serve_lease_ms",
                        format!(
                            "{} is above {} ms, the longest lease a reconfiguration waits out \
                             after fencing a KN; a longer lease could serve stale values after \
                             a failover",
                            self.serve_lease_ms,
                            crate::lease::MAX_SERVE_LEASE.as_millis()
                        ),
                    ));
                }
                lease
            },
            prepare_timeout: {
                if self.prepare_timeout_ms == 0 {
                    return Err(invalid("prepare_timeout_ms", "0: must be positive"));
                }
                Duration::from_millis(self.prepare_timeout_ms)
            },
            metrics_listen: if self.metrics_listen.is_empty() {
                None
            } else {
                Some(self.metrics_listen.parse().map_err(|e| {
                    invalid(
                        "metrics_listen",
                        format!(
                            "{:?}: {e} (give IP:PORT, or \"\" to disable)",
                            self.metrics_listen
                        ),
                    )
                })?)
            },
            rdma_device: Some(self.rdma_device).filter(|d| !d.trim().is_empty()),
            security: dinomo_security::Security::Insecure,
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
        let file = KnConfigFile::from_toml(&text, "config/kv-node.toml").unwrap();
        let defaults = KnConfigFile::default();
        assert_eq!(
            format!("{file:?}"),
            format!("{defaults:?}"),
            "the example shows the defaults"
        );
        let cfg = file.validate().unwrap();
        assert_eq!(cfg.shards, 2);
        // The dpm-node counts what a KN of the default shards pins over verbs with this.
        assert_eq!(
            u64::from(cfg.shards),
            dinomo_dpm_node::verbs_pins::DEFAULT_KN_SHARDS
        );
        assert_eq!(cfg.cache_policy, Policy::Dac);
    }

    #[test]
    fn bad_values_are_refused() {
        let e = KnConfigFile::from_toml("shard = 3", "kn.toml").unwrap_err();
        assert!(e.to_string().contains("unknown field `shard`"), "{e}");
        match (KnConfigFile {
            shards: 0,
            ..Default::default()
        })
        .validate()
        .unwrap_err()
        {
            ConfigError::Invalid { field, .. } => assert_eq!(field, "shards"),
            e => panic!("{e}"),
        }
        // A bad policy or size is refused when the file is read, by name.
        for (text, field) in [
            ("cache_policy = \"fifo\"", "cache_policy"),
            ("cache_size = \"lots\"", "cache_size"),
            ("batch_bytes = \"-1\"", "batch_bytes"),
        ] {
            let e = KnConfigFile::from_toml(text, "kn.toml").unwrap_err();
            assert!(matches!(e, ConfigError::Parse { .. }), "{e}");
            assert!(e.to_string().contains(field), "{e}");
        }
        let c = KnConfigFile::from_toml(
            "cache_size = \"64MiB\"\ncache_policy = \"static-30\"\nmax_value_bytes = 16384",
            "kn.toml",
        )
        .unwrap()
        .validate()
        .unwrap();
        assert_eq!((c.cache_bytes, c.max_value_bytes), (64 << 20, 16384));
    }
}
