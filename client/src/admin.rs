//! Administration: changing the cluster map safely (DINOMO section 3.5) and publishing it.
//!
//! [`reconfigure`] moves the cluster from the published map to `next`:
//! 1. the KNs whose ownership changes (`ClusterMap::changed_ranges`) are told to prepare: they
//!    stop serving the keys that move (UNAVAILABLE, which clients retry), write out their open
//!    batches and seal their logs;
//! 2. the DPM merges those KNs' logs synchronously (MergeAll), so the index holds every write
//!    they acknowledged; a KN that cannot be reached (dead) is fenced first and its open
//!    segments are sealed by the merge;
//! 3. keys that become replicated get their indirect cell (initialised from the index, which
//!    now holds their latest write); keys that stop being replicated have their cell's value
//!    written back into the index and the cell removed (DINOMO 3.4);
//! 4. `next` is published in the DPM's metadata (the map of record) and the prepared KNs commit
//!    it; every other KN and the routing nodes pick it up on their next poll.
//!
//! No data moves: ownership changes only where requests are served.

use std::time::{Duration, Instant};

use dinomo_placement::{ClusterMap, KnId};
use dinomo_proto::dpm::dpm_service_client::DpmServiceClient;
use dinomo_proto::dpm::{
    FenceKnRequest, GetMetadataRequest, IndirectCellRequest, MergeAllRequest, PutMetadataRequest,
};
use dinomo_proto::kv::kv_service_client::KvServiceClient;
use dinomo_proto::kv::MapRequest;
use tonic::transport::Channel;

use crate::error::{ClientError, Result};

/// The metadata name of the cluster map of record.
pub const CLUSTER_MAP_KEY: &str = "cluster/map";

/// What a reconfiguration did and how long each step took.
#[derive(Debug, Clone, Default)]
pub struct ReconfigReport {
    pub from_version: u64,
    pub to_version: u64,
    pub affected: Vec<KnId>,
    /// KNs that could not be reached and were fenced.
    pub fenced: Vec<KnId>,
    pub merged_entries: u64,
    /// Keys whose indirect cells were installed / removed.
    pub cells_installed: usize,
    pub cells_removed: usize,
    pub prepare: Duration,
    pub merge: Duration,
    pub commit: Duration,
}

async fn dpm_client(dpm: &str) -> Result<DpmServiceClient<Channel>> {
    let url = if dpm.starts_with("http") {
        dpm.to_string()
    } else {
        format!("http://{dpm}")
    };
    DpmServiceClient::connect(url)
        .await
        .map_err(|e| ClientError::Other(format!("cannot reach the dpm-node at {dpm}: {e}")))
}

async fn kn_client(endpoint: &str) -> Option<KvServiceClient<Channel>> {
    let ep = tonic::transport::Endpoint::from_shared(format!("http://{endpoint}"))
        .ok()?
        .connect_timeout(Duration::from_millis(500))
        // Prepare waits for the KN's batch WRITE in flight and its seals: seconds at worst. A
        // KN that does not answer in time is treated as failed (fenced).
        .timeout(Duration::from_secs(5));
    ep.connect().await.ok().map(KvServiceClient::new)
}

/// The published map, if any.
pub async fn published_map(dpm: &str) -> Result<Option<ClusterMap>> {
    let v = dpm_client(dpm)
        .await?
        .get_metadata(GetMetadataRequest {
            name: CLUSTER_MAP_KEY.into(),
        })
        .await
        .map_err(|s| ClientError::Other(format!("reading the cluster map: {}", s.message())))?
        .into_inner()
        .value;
    v.map(|b| ClusterMap::decode(&b).map_err(|e| ClientError::Other(format!("published map: {e}"))))
        .transpose()
}

/// Publishes a map without any handover (bootstrap: when no KN serves yet).
pub async fn publish_map(dpm: &str, map: &ClusterMap) -> Result<()> {
    dpm_client(dpm)
        .await?
        .put_metadata(PutMetadataRequest {
            name: CLUSTER_MAP_KEY.into(),
            value: Some(map.encode()),
        })
        .await
        .map_err(|s| ClientError::Other(format!("publishing the cluster map: {}", s.message())))?;
    Ok(())
}

/// Moves the cluster from `current` (the published map) to `next` (whose version must be
/// higher), as the module doc describes.
pub async fn reconfigure(
    dpm: &str,
    current: &ClusterMap,
    next: &ClusterMap,
) -> Result<ReconfigReport> {
    reconfigure_without(dpm, current, next, &[]).await
}

/// [`reconfigure`] when the caller already knows that the KNs in `dead` have failed: they are
/// not asked to prepare (a hung KN may accept a connection and never answer), only fenced and
/// merged.
pub async fn reconfigure_without(
    dpm: &str,
    current: &ClusterMap,
    next: &ClusterMap,
    dead: &[KnId],
) -> Result<ReconfigReport> {
    if next.version <= current.version {
        return Err(ClientError::InvalidArgument(format!(
            "the new map's version {} must be higher than the current {}",
            next.version, current.version
        )));
    }
    let mut report = ReconfigReport {
        from_version: current.version,
        to_version: next.version,
        affected: current.changed_ranges(next),
        ..Default::default()
    };
    let endpoint_of = |kn: KnId| {
        next.endpoint(kn)
            .or_else(|| current.endpoint(kn))
            .map(str::to_string)
    };
    let bytes = next.encode();

    let t = Instant::now();
    let mut prepared = Vec::new();
    for &kn in &report.affected {
        if dead.contains(&kn) {
            report.fenced.push(kn);
            continue;
        }
        let ok = match endpoint_of(kn) {
            Some(ep) => match kn_client(&ep).await {
                Some(mut c) => c
                    .prepare_map(MapRequest { map: bytes.clone() })
                    .await
                    .is_ok()
                    .then_some(c),
                None => None,
            },
            None => None,
        };
        match ok {
            Some(c) => prepared.push((kn, c)),
            None => report.fenced.push(kn),
        }
    }
    report.prepare = t.elapsed();

    let t = Instant::now();
    let mut d = dpm_client(dpm).await?;
    for &kn in &report.fenced {
        d.fence_kn(FenceKnRequest { kn_id: kn })
            .await
            .map_err(|s| ClientError::Other(format!("fencing KN {kn}: {}", s.message())))?;
    }
    for &kn in &report.affected {
        let seal_open = report.fenced.contains(&kn);
        let r = d
            .merge_all(MergeAllRequest {
                kn_id: kn,
                seal_open,
            })
            .await
            .map_err(|s| ClientError::Other(format!("MergeAll of KN {kn}: {}", s.message())))?
            .into_inner();
        report.merged_entries += r.entries;
    }
    for key in next.replicated.keys() {
        if !current.replicated.contains_key(key) {
            d.install_indirect_cell(IndirectCellRequest {
                key: key.clone(),
                lookup_only: false,
            })
            .await
            .map_err(|s| ClientError::Other(format!("installing a cell: {}", s.message())))?;
            report.cells_installed += 1;
        }
    }
    for key in current.replicated.keys() {
        if !next.replicated.contains_key(key) {
            d.remove_indirect_cell(IndirectCellRequest {
                key: key.clone(),
                lookup_only: false,
            })
            .await
            .map_err(|s| ClientError::Other(format!("removing a cell: {}", s.message())))?;
            report.cells_removed += 1;
        }
    }
    report.merge = t.elapsed();

    let t = Instant::now();
    d.put_metadata(PutMetadataRequest {
        name: CLUSTER_MAP_KEY.into(),
        value: Some(bytes.clone()),
    })
    .await
    .map_err(|s| ClientError::Other(format!("publishing the cluster map: {}", s.message())))?;
    for (kn, mut c) in prepared {
        if next.contains(kn) {
            if let Err(s) = c.commit_map(MapRequest { map: bytes.clone() }).await {
                tracing::warn!(kn, error = %s.message(), "commit failed; the KN will take the map from the DPM");
            }
        }
    }
    report.commit = t.elapsed();
    tracing::info!(?report, "reconfigured");
    Ok(report)
}
