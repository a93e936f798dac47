//! Configuration of the dpm-node, in two stages and after the convention every node shares
//! ([`dinomo_node_common::config`]): [`DpmConfigFile`] is what the TOML file and flags say
//! (every field documented and defaulted, sizes and enums typed so that a bad one is refused
//! when the file is read), [`DpmConfig`] is the validated runtime form. Every refusal is a
//! [`ConfigError`] naming the field. config/dpm-node.toml is a commented example parsed by a
//! test.

use std::net::SocketAddr;
use std::path::PathBuf;

use dinomo_fabric::DurabilityRequest;
use dinomo_node_common::config::{from_str_field, invalid, parse_toml, ByteSize, ConfigError};
use serde::Deserialize;

use crate::pool::FormatOptions;

/// The dpm-node's configuration file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DpmConfigFile {
    /// Path of the PM pool: a file, or a device-DAX character device such as `/dev/dax0.0`.
    /// A file on a DAX filesystem (mounted with `-o dax`) is real persistent memory; elsewhere
    /// it is an ordinary file (see `durability`). A device-DAX device is real persistent
    /// memory and the only PM the verbs fabric can serve (fsdax files cannot be registered for
    /// RDMA); a pool on it spans the whole device.
    pub pool_path: PathBuf,
    /// Size of a new pool, e.g. "1GiB". Used only when the pool is created, and not on a
    /// device-DAX device (the pool is the whole device).
    pub pool_size: ByteSize,
    /// Size of a log segment, a power of two >= 64KiB, e.g. "8MiB". Used only at creation.
    pub segment_size: ByteSize,
    /// Indirect cells (for selectively replicated hot keys) a new pool can hold at once, 64
    /// bytes each. Used only at creation. The index itself needs no share of the pool set
    /// aside: it grows into free segments.
    pub max_indirect_cells: u64,
    /// Size of the cluster-metadata area, e.g. "1MiB". Used only at creation.
    pub metadata_size: ByteSize,
    /// Create (format) the pool when the file does not exist. An existing file is never
    /// reformatted.
    pub create: bool,
    /// Format a device-DAX `pool_path` that holds no Dinomo pool (no pool magic at its start),
    /// erasing the device. Without it such a device is refused. A device that holds a pool is
    /// opened (or refused if damaged), never reformatted.
    pub format_device: bool,
    /// How stores become durable: "auto" (DAX when MAP_SYNC works, else process-crash),
    /// "dax" (fail unless DAX), "msync" (survives power loss on ordinary files, slow),
    /// "process-crash" (survives crashes of any process, not of the machine), or
    /// "simulated-power-loss" (tests only: process-crash plus a record of persisted cache
    /// lines, from which crash images that lose or tear unpersisted lines are made).
    #[serde(deserialize_with = "from_str_field")]
    pub durability: DurabilityRequest,
    /// Fault the whole pool into memory in the background after it opens (reads only: nothing
    /// is written), so that the kernel allocates and zero-fills a pool file's page-cache pages
    /// then, not inside the request path. Pages never written stay clean and reclaimable.
    /// Skipped on tmpfs and for a pool larger than half the available memory. On this
    /// project's 2-core VM a fresh 1 GiB pool file costs about 2.5 s of one core once
    /// (docs/operations.md, "Prefaulting the pool").
    pub prefault: bool,
    /// Threads that merge KN logs into the index.
    pub merge_workers: usize,
    /// Home buckets of a new index (rounded up to a power of two, at most one segment's worth);
    /// it grows one bucket at a time from there.
    pub initial_index_buckets: u64,
    /// Milliseconds between garbage-collection passes.
    pub gc_interval_ms: u64,
    /// Clean a merged segment when its live bytes fall below this share of its written bytes
    /// (or of half the segment, if less was written)
    /// (0 disables cleaning; dead segments are still freed).
    pub clean_threshold: f64,
    /// Address of the gRPC control service (DpmService).
    pub listen: String,
    /// Fabric offered to KNs: "shm" (same host; KNs map the pool), "tcp" (emulated NIC) or
    /// "verbs" (one-sided RDMA; needs a binary built with the `rdma` cargo feature and an RDMA
    /// device).
    #[serde(deserialize_with = "from_str_field")]
    pub fabric: FabricKind,
    /// Address of the tcp fabric NIC, or of the verbs NIC's side channel (the TCP handshake
    /// that hands a KN its queue pair and rkey), started only when `fabric` is "tcp" or
    /// "verbs".
    pub fabric_listen: String,
    /// Address KNs are told to reach the fabric NIC (tcp, or verbs's side channel) at,
    /// `HOST:PORT` or `HOST` (the NIC's port). Empty: `fabric_listen`, or the address this host's
    /// name resolves to when that is a wildcard such as 0.0.0.0 (a wildcard is never handed out).
    pub fabric_advertise: String,
    /// RDMA device the verbs NIC serves on, e.g. "rxe0" or "mlx5_0" (`fabric = "verbs"` only).
    /// Empty: the `DINOMO_RDMA_DEVICE` environment variable, else the first device.
    pub rdma_device: String,
    /// Address of the Prometheus /metrics endpoint; empty to disable.
    pub metrics_listen: String,
    /// Grant slots in the fabric grant table (concurrent KN registrations).
    pub max_grants: u32,
    /// Debug check for tests: after every merge and every cleaned segment, recount each
    /// segment's live bytes from the index and compare them with the counters (slow: a full
    /// index walk each time, and merges run one at a time). A mismatch fails the MergeAll that
    /// saw it and is counted in `dinomo_dpm_accounting_mismatches_total`.
    pub verify_accounting: bool,
    /// "primary" (the default: owns the pool and serves KNs) or "backup" (a replica: its pool
    /// is written only by a primary that attaches it, over the tcp fabric NIC on
    /// `fabric_listen`; docs/decisions/0007-dpm-replication.md).
    #[serde(deserialize_with = "from_str_field")]
    pub role: ReplicaRole,
    /// gRPC addresses of the backups a primary replicates its pool to (empty: no replication).
    /// Every acknowledgement then waits for every backup in sync. On tcp the NIC ships what KNs
    /// write; on shm and verbs KNs store into the pool without this node's CPU, so they
    /// forward each write's range (`ForwardWrites`) before acknowledging it.
    pub backups: Vec<String>,
    /// Milliseconds a backup may take to acknowledge a WRITE before it counts as failed (the
    /// primary then acknowledges nothing until it is removed or added again). Below the KNs'
    /// fabric deadline (5 s), so a KN hears of a failed backup before it gives up its session.
    pub replica_ack_timeout_ms: u64,
    /// Whether a primary attaches a failed backup of its set anew, by itself, once it answers
    /// again (restarted, or reachable again): its copy starts over, and until it is in sync
    /// acknowledgements do not wait for it. For deployments where nothing else tends the set
    /// (the Helm chart); `dinomo up` does it itself and leaves this off. Off: a failed backup
    /// holds every acknowledgement until someone removes it or adds it again.
    pub reattach_failed_backups: bool,
}

/// What a dpm-node is in a replica set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReplicaRole {
    #[default]
    Primary,
    Backup,
}

impl std::str::FromStr for ReplicaRole {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "primary" => Ok(ReplicaRole::Primary),
            "backup" => Ok(ReplicaRole::Backup),
            other => Err(format!(
                "unknown role {other:?}: expected primary or backup"
            )),
        }
    }
}

impl Default for DpmConfigFile {
    fn default() -> Self {
        DpmConfigFile {
            pool_path: PathBuf::from("dinomo.pool"),
            pool_size: ByteSize(1 << 30),
            segment_size: ByteSize(8 << 20),
            max_indirect_cells: 4096,
            metadata_size: ByteSize(1 << 20),
            create: true,
            format_device: false,
            durability: DurabilityRequest::Auto,
            prefault: true,
            merge_workers: 2,
            initial_index_buckets: 16384,
            gc_interval_ms: 200,
            clean_threshold: 0.25,
            listen: "127.0.0.1:7700".into(),
            fabric: FabricKind::Shm,
            fabric_listen: "127.0.0.1:7701".into(),
            fabric_advertise: String::new(),
            rdma_device: String::new(),
            metrics_listen: "127.0.0.1:9700".into(),
            max_grants: 256,
            verify_accounting: false,
            role: ReplicaRole::Primary,
            backups: Vec::new(),
            replica_ack_timeout_ms: 2000,
            reattach_failed_backups: false,
        }
    }
}

/// Which fabric KNs are told to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FabricKind {
    Shm,
    Tcp,
    /// One-sided RDMA verbs; only in a build with the `rdma` feature.
    Verbs,
}

impl FabricKind {
    /// Whether this build can serve the fabric (verbs needs the `rdma` cargo feature).
    pub fn available(self) -> bool {
        self != FabricKind::Verbs || cfg!(feature = "rdma")
    }

    /// Whether a NIC listens for KNs (tcp, and verbs's side channel).
    pub fn has_nic(self) -> bool {
        self != FabricKind::Shm
    }
}

impl std::str::FromStr for FabricKind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "shm" => Ok(FabricKind::Shm),
            "tcp" => Ok(FabricKind::Tcp),
            "verbs" => Ok(FabricKind::Verbs),
            other => Err(format!("{other:?}: expected \"shm\", \"tcp\" or \"verbs\"")),
        }
    }
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct DpmConfig {
    pub pool_path: PathBuf,
    pub format: FormatOptions,
    pub create: bool,
    pub format_device: bool,
    pub durability: DurabilityRequest,
    pub prefault: bool,
    pub merge_workers: usize,
    pub initial_index_buckets: u64,
    pub gc_interval_ms: u64,
    pub clean_threshold: f64,
    pub listen: SocketAddr,
    pub fabric: FabricKind,
    pub fabric_listen: SocketAddr,
    /// As configured; resolved once the NIC is bound (see [`DpmConfigFile::fabric_advertise`]).
    pub fabric_advertise: String,
    /// The verbs NIC's RDMA device; `None`: `DINOMO_RDMA_DEVICE`, else the first.
    pub rdma_device: Option<String>,
    pub metrics_listen: Option<SocketAddr>,
    pub max_grants: u32,
    pub verify_accounting: bool,
    pub role: ReplicaRole,
    pub backups: Vec<String>,
    pub replica_ack_timeout: std::time::Duration,
    pub reattach_failed_backups: bool,
    /// Open the pool as a primary even though its copy marker (`<pool>.copy`) says a backup's
    /// copy of it was never finished, accepting the data that copy lacks as lost. Only from the
    /// command line (`--accept-incomplete-copy`), never from the file: it is a one-off decision
    /// about one pool, not a setting.
    pub accept_incomplete_copy: bool,
    /// TLS and access checks on the gRPC port; from the command line (`--credentials`,
    /// `--insecure`), never from the file. A config built in process (tests) serves in plain
    /// text until told otherwise.
    pub security: dinomo_security::Security,
}

fn addr(field: &str, s: &str) -> Result<SocketAddr, ConfigError> {
    s.parse().map_err(|e| {
        invalid(
            field,
            format!("{s:?} is not a socket address like 127.0.0.1:7700 ({e})"),
        )
    })
}

impl DpmConfigFile {
    /// The defaults for a node run inside a test or a benchmark: the pool at `pool_path`, the
    /// gRPC service and the fabric NIC on ephemeral loopback ports, no metrics endpoint (which
    /// is process-wide and would clash between nodes of one process).
    pub fn in_process(pool_path: impl Into<PathBuf>) -> Self {
        DpmConfigFile {
            pool_path: pool_path.into(),
            listen: "127.0.0.1:0".into(),
            fabric_listen: "127.0.0.1:0".into(),
            metrics_listen: String::new(),
            // Tests and benchmarks open many small pools and time what they do with them.
            prefault: false,
            ..Default::default()
        }
    }

    /// Parses a config file's text (`origin` names it in errors).
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, ConfigError> {
        parse_toml(text, origin)
    }

    pub fn validate(self) -> Result<DpmConfig, ConfigError> {
        let format = FormatOptions {
            pool_len: self.pool_size.bytes(),
            segment_size: self.segment_size.bytes(),
            metadata_len: self.metadata_size.bytes(),
            max_cells: self.max_indirect_cells,
        };
        dinomo_layout::superblock::Superblock::plan(
            format.pool_len,
            format.segment_size,
            format.metadata_len,
            format.max_cells,
        )
        .map_err(|e| invalid("pool_size/segment_size/max_indirect_cells", e.to_string()))?;
        if self.merge_workers == 0 || self.merge_workers > 64 {
            return Err(invalid(
                "merge_workers",
                format!("{}: must be 1..=64", self.merge_workers),
            ));
        }
        if !(0.0..1.0).contains(&self.clean_threshold) {
            return Err(invalid(
                "clean_threshold",
                format!("{}: must be in [0, 1)", self.clean_threshold),
            ));
        }
        let fabric = self.fabric;
        if !fabric.available() {
            return Err(invalid(
                "fabric",
                "\"verbs\": this binary was built without the `rdma` cargo feature; \
                 rebuild it with `--features rdma` (needs libibverbs, librdmacm, cmake and \
                 libclang to build; see docs/operations.md, \"The verbs fabric\")",
            ));
        }
        let fabric_listen = addr("fabric_listen", &self.fabric_listen)?;
        if !self.backups.is_empty() {
            if self.role == ReplicaRole::Backup {
                return Err(invalid(
                    "backups",
                    "a backup has no backups of its own: set them on the primary",
                ));
            }
            for b in &self.backups {
                if b.trim().is_empty() || !b.contains(':') {
                    return Err(invalid(
                        "backups",
                        format!("{b:?} is not a backup's gRPC address (host:port)"),
                    ));
                }
            }
        }
        if self.replica_ack_timeout_ms == 0 {
            return Err(invalid("replica_ack_timeout_ms", "must be at least 1"));
        }
        if fabric.has_nic() || self.role == ReplicaRole::Backup {
            dinomo_node_common::address::advertise_address(
                "fabric_advertise",
                fabric_listen,
                &self.fabric_advertise,
            )
            .map_err(|e| invalid("fabric_advertise", e))?;
        }
        Ok(DpmConfig {
            pool_path: self.pool_path,
            format,
            create: self.create,
            format_device: self.format_device,
            durability: self.durability,
            prefault: self.prefault,
            merge_workers: self.merge_workers,
            initial_index_buckets: self.initial_index_buckets.max(64),
            gc_interval_ms: self.gc_interval_ms.max(1),
            clean_threshold: self.clean_threshold,
            listen: addr("listen", &self.listen)?,
            fabric,
            fabric_listen,
            fabric_advertise: self.fabric_advertise,
            rdma_device: Some(self.rdma_device).filter(|d| !d.trim().is_empty()),
            metrics_listen: if self.metrics_listen.is_empty() {
                None
            } else {
                Some(addr("metrics_listen", &self.metrics_listen)?)
            },
            max_grants: self.max_grants.max(1),
            verify_accounting: self.verify_accounting,
            role: self.role,
            backups: self.backups,
            replica_ack_timeout: std::time::Duration::from_millis(self.replica_ack_timeout_ms),
            reattach_failed_backups: self.reattach_failed_backups,
            accept_incomplete_copy: false,
            security: dinomo_security::Security::Insecure,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_kinds_are_refused_when_the_file_is_read() {
        let c =
            DpmConfigFile::from_toml("pool_size = \"2GiB\"\nsegment_size = 65536", "t").unwrap();
        assert_eq!(
            (c.pool_size.bytes(), c.segment_size.bytes()),
            (2 << 30, 64 << 10)
        );
        for (text, field) in [
            ("pool_size = \"8 parsecs\"", "pool_size"),
            ("fabric = \"carrier-pigeon\"", "fabric"),
            ("durability = \"forever\"", "durability"),
        ] {
            let e = DpmConfigFile::from_toml(text, "dpm.toml").unwrap_err();
            assert!(matches!(e, ConfigError::Parse { .. }), "{e}");
            let msg = e.to_string();
            assert!(msg.starts_with("dpm.toml:") && msg.contains(field), "{msg}");
        }
    }

    #[test]
    fn example_config_parses_and_validates() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../config/dpm-node.toml"
        ))
        .unwrap();
        let file = DpmConfigFile::from_toml(&text, "config/dpm-node.toml").unwrap();
        let defaults = DpmConfigFile::default();
        assert_eq!(
            format!("{file:?}"),
            format!("{defaults:?}"),
            "the example shows the defaults"
        );
        let cfg = file.validate().unwrap();
        assert_eq!(cfg.format.segment_size, 8 << 20);
    }

    #[test]
    fn replication_is_refused_where_it_cannot_work() {
        let bad = [
            (
                "fabric = \"tcp\"\nrole = \"backup\"\nbackups = [\"127.0.0.1:7720\"]",
                "a backup has no backups",
            ),
            (
                "fabric = \"tcp\"\nbackups = [\"nowhere\"]",
                "not a backup's gRPC address",
            ),
            ("replica_ack_timeout_ms = 0", "at least 1"),
        ];
        for (text, want) in bad {
            let e = DpmConfigFile::from_toml(text, "t")
                .unwrap()
                .validate()
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{text}: {e}");
        }
        let e = DpmConfigFile::from_toml("role = \"witness\"", "t").unwrap_err();
        assert!(e.to_string().contains("expected primary or backup"), "{e}");
        let ok = DpmConfigFile::from_toml(
            "fabric = \"tcp\"\nbackups = [\"127.0.0.1:7720\", \"127.0.0.1:7722\"]",
            "t",
        )
        .unwrap()
        .validate()
        .unwrap();
        assert_eq!(ok.backups.len(), 2);
        // One-sided fabrics replicate too: their KNs forward what they store.
        for fabric in ["shm", "verbs"] {
            let file = DpmConfigFile::from_toml(
                &format!("fabric = \"{fabric}\"\nbackups = [\"127.0.0.1:7720\"]"),
                "t",
            )
            .unwrap();
            if fabric == "verbs" && !FabricKind::Verbs.available() {
                continue;
            }
            assert_eq!(file.validate().unwrap().backups.len(), 1, "{fabric}");
        }
    }

    #[test]
    fn unknown_fields_and_bad_values_are_refused() {
        let e = DpmConfigFile::from_toml("pool_sise = \"1GiB\"", "dpm.toml").unwrap_err();
        assert!(e.to_string().contains("unknown field `pool_sise`"), "{e}");
        let bad = DpmConfigFile {
            merge_workers: 0,
            ..Default::default()
        };
        match bad.validate().unwrap_err() {
            ConfigError::Invalid { field, .. } => assert_eq!(field, "merge_workers"),
            e => panic!("{e}"),
        }
        let bad = DpmConfigFile {
            segment_size: ByteSize(1000),
            ..Default::default()
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn verbs_needs_the_rdma_feature_and_a_real_advertised_address() {
        let verbs = DpmConfigFile {
            fabric: FabricKind::Verbs,
            rdma_device: "rxe0".into(),
            ..Default::default()
        };
        let rdma = cfg!(feature = "rdma");
        match verbs.clone().validate() {
            Ok(c) => {
                assert!(rdma, "verbs accepted by a build without rdma");
                assert_eq!(c.fabric, FabricKind::Verbs);
                assert_eq!(c.rdma_device.as_deref(), Some("rxe0"));
            }
            Err(e) => {
                assert!(!rdma, "verbs refused by a build with rdma: {e}");
                let msg = e.to_string();
                assert!(
                    msg.contains("built without the `rdma` cargo feature"),
                    "{msg}"
                );
            }
        }
        // As for tcp, a wildcard side channel needs something to advertise instead.
        let wildcard = DpmConfigFile {
            fabric_listen: "0.0.0.0:7701".into(),
            fabric_advertise: "0.0.0.0".into(),
            ..verbs
        };
        assert!(wildcard.validate().is_err());
        assert_eq!(
            DpmConfigFile::default().validate().unwrap().rdma_device,
            None
        );
    }
}
