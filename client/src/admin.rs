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
//!
//! Publication is a compare-and-swap at the DPM (CompareAndPutMetadata): the first map only
//! if none exists ([`publish_map`]), every later one only over the exact map the change
//! started from ([`reconfigure`], [`replace_map`]). Of two changes racing from the same map
//! (two monitors that both believe they lead), one publishes and the other gets an error
//! before anyone can see its map, so two different maps of one version never both become the
//! map of record; the loser's KNs, merged and paused for nothing, resume when they take the
//! winner's map.
//!
//! A monitor drives a reconfiguration through [`reconfigure_led`] with its [`Leadership`]:
//! its term goes with every DPM call (the DPM refuses a term older than the newest, see
//! dpm.proto), and leadership is re-checked before each step, which aborts if it was lost.
//! Callers outside the monitor (the CLI's bootstrap, tests) use [`Unled`]: no term, no check.

use std::future::Future;
use std::time::{Duration, Instant};

use dinomo_placement::{ClusterMap, KnId};
use dinomo_proto::dpm::dpm_service_client::DpmServiceClient;
use dinomo_proto::dpm::{
    CompareAndPutMetadataRequest, FenceKnRequest, GetMetadataRequest, IndirectCellRequest,
    MergeAllRequest, NewMonitorTermRequest,
};
use dinomo_proto::kv::kv_service_client::KvServiceClient;
use dinomo_proto::kv::MapRequest;
use tonic::transport::Channel;
use tonic::{Code, Request};

use crate::error::{ClientError, Result};

/// The metadata name of the cluster map of record.
pub const CLUSTER_MAP_KEY: &str = "cluster/map";

/// The request header that carries a monitor term to the DPM (dpm.proto, "Monitor terms";
/// the dpm-node reads the same name).
pub const MONITOR_TERM_HEADER: &str = "dinomo-monitor-term";

/// Who drives a reconfiguration, and how it makes sure it still may.
pub trait Leadership: Sync {
    /// The monitor term sent with every DPM call of the reconfiguration (`None`: no term).
    fn term(&self) -> Option<u64>;
    /// Called before each step (`step` names it); an error aborts the reconfiguration there.
    fn check(&self, step: &'static str) -> impl Future<Output = Result<()>> + Send;
}

/// A caller outside the monitor protocol (the CLI's bootstrap, tests): no term, no check.
#[derive(Debug, Clone, Copy, Default)]
pub struct Unled;

impl Leadership for Unled {
    fn term(&self) -> Option<u64> {
        None
    }

    async fn check(&self, _step: &'static str) -> Result<()> {
        Ok(())
    }
}

/// A DPM request carrying `term` in [`MONITOR_TERM_HEADER`].
fn with_term<T>(msg: T, term: Option<u64>) -> Request<T> {
    let mut r = Request::new(msg);
    if let Some(t) = term {
        r.metadata_mut()
            .insert(MONITOR_TERM_HEADER, tonic::metadata::MetadataValue::from(t));
    }
    r
}

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

/// Starts a new monitor term at the DPM (the caller just became leader): from now on the DPM
/// refuses every call carrying an older term.
pub async fn new_monitor_term(dpm: &str) -> Result<u64> {
    Ok(dpm_client(dpm)
        .await?
        .new_monitor_term(NewMonitorTermRequest {})
        .await
        .map_err(|s| ClientError::Other(format!("starting a monitor term: {}", s.message())))?
        .into_inner()
        .term)
}

/// Publishes the first map (bootstrap: no KN serves yet). Refused if a map is already
/// published: changing it takes [`reconfigure`] (or [`replace_map`]).
pub async fn publish_map(dpm: &str, map: &ClusterMap) -> Result<()> {
    let mut d = dpm_client(dpm).await?;
    cas_map(&mut d, None, map, None).await.map_err(|s| {
        if s.code() == Code::FailedPrecondition {
            ClientError::Other(format!(
                "a cluster map is already published, so map version {} was not; change the \
                 published map with a reconfiguration ({})",
                map.version,
                s.message()
            ))
        } else {
            ClientError::Other(format!("publishing the cluster map: {}", s.message()))
        }
    })
}

/// Publishes `next` over `current` without any handover: for changes that move no key
/// between serving KNs (e.g. the same KNs at new endpoints after a restart). Refused if the
/// published map is no longer `current`.
pub async fn replace_map(dpm: &str, current: &ClusterMap, next: &ClusterMap) -> Result<()> {
    check_newer(current, next)?;
    let mut d = dpm_client(dpm).await?;
    let expected = published_bytes_of(&mut d, current).await?;
    cas_map(&mut d, Some(expected), next, None)
        .await
        .map_err(|s| publish_error(next, &s))
}

/// CompareAndPutMetadata of the cluster map over `expected` (None: only if there is none).
async fn cas_map(
    d: &mut DpmServiceClient<Channel>,
    expected: Option<Vec<u8>>,
    map: &ClusterMap,
    term: Option<u64>,
) -> std::result::Result<(), tonic::Status> {
    d.compare_and_put_metadata(with_term(
        CompareAndPutMetadataRequest {
            name: CLUSTER_MAP_KEY.into(),
            value: Some(map.encode()),
            expected,
        },
        term,
    ))
    .await
    .map(|_| ())
}

fn publish_error(next: &ClusterMap, s: &tonic::Status) -> ClientError {
    ClientError::Other(format!(
        "publishing cluster map version {}: {}",
        next.version,
        s.message()
    ))
}

fn check_newer(current: &ClusterMap, next: &ClusterMap) -> Result<()> {
    if next.version <= current.version {
        return Err(ClientError::InvalidArgument(format!(
            "the new map's version {} must be higher than the current {}",
            next.version, current.version
        )));
    }
    Ok(())
}

/// The published map's bytes, if that map is `current` (the value to compare-and-swap
/// against); an error if another map was published since `current` was read.
async fn published_bytes_of(
    d: &mut DpmServiceClient<Channel>,
    current: &ClusterMap,
) -> Result<Vec<u8>> {
    let raw = d
        .get_metadata(GetMetadataRequest {
            name: CLUSTER_MAP_KEY.into(),
        })
        .await
        .map_err(|s| ClientError::Other(format!("reading the cluster map: {}", s.message())))?
        .into_inner()
        .value;
    let stale = |what: String| {
        ClientError::Other(format!(
            "the published cluster map is {what}, not version {} that this change started \
             from (someone else changed it); re-read it and start over",
            current.version
        ))
    };
    let Some(raw) = raw else {
        return Err(stale("absent".into()));
    };
    // Compared by content, not bytes: a map written by another encoder is still the same map.
    match ClusterMap::decode(&raw) {
        Ok(m) if m.encode() == current.encode() => Ok(raw),
        Ok(m) => Err(stale(format!("version {}", m.version))),
        Err(e) => Err(stale(format!("undecodable ({e})"))),
    }
}

/// Moves the cluster from `current` (the published map) to `next` (whose version must be
/// higher), as the module doc describes. Fails, before changing anything, if the published
/// map is not `current`, and at the publish step if another map was published meanwhile.
pub async fn reconfigure(
    dpm: &str,
    current: &ClusterMap,
    next: &ClusterMap,
) -> Result<ReconfigReport> {
    reconfigure_led(dpm, current, next, &[], &Unled).await
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
    reconfigure_led(dpm, current, next, dead, &Unled).await
}

/// [`reconfigure_without`] driven by a monitor: every DPM call carries `leader`'s term, and
/// `leader.check` runs before each step (prepare, fence and merge, cells, publish).
pub async fn reconfigure_led<L: Leadership>(
    dpm: &str,
    current: &ClusterMap,
    next: &ClusterMap,
    dead: &[KnId],
    leader: &L,
) -> Result<ReconfigReport> {
    check_newer(current, next)?;
    let term = leader.term();
    let mut d = dpm_client(dpm).await?;
    // Fail fast if the map moved on: the publish below would be refused anyway, after KNs
    // were paused and merged for nothing.
    let expected = published_bytes_of(&mut d, current).await?;
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
    leader.check("prepare").await?;
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
    leader.check("fence and merge").await?;
    for &kn in &report.fenced {
        d.fence_kn(with_term(FenceKnRequest { kn_id: kn }, term))
            .await
            .map_err(|s| ClientError::Other(format!("fencing KN {kn}: {}", s.message())))?;
    }
    for &kn in &report.affected {
        let seal_open = report.fenced.contains(&kn);
        let r = d
            .merge_all(with_term(
                MergeAllRequest {
                    kn_id: kn,
                    seal_open,
                },
                term,
            ))
            .await
            .map_err(|s| ClientError::Other(format!("MergeAll of KN {kn}: {}", s.message())))?
            .into_inner();
        report.merged_entries += r.entries;
    }
    leader.check("indirect cells").await?;
    for key in next.replicated.keys() {
        if !current.replicated.contains_key(key) {
            d.install_indirect_cell(with_term(
                IndirectCellRequest {
                    key: key.clone(),
                    lookup_only: false,
                },
                term,
            ))
            .await
            .map_err(|s| ClientError::Other(format!("installing a cell: {}", s.message())))?;
            report.cells_installed += 1;
        }
    }
    for key in current.replicated.keys() {
        if !next.replicated.contains_key(key) {
            d.remove_indirect_cell(with_term(
                IndirectCellRequest {
                    key: key.clone(),
                    lookup_only: false,
                },
                term,
            ))
            .await
            .map_err(|s| ClientError::Other(format!("removing a cell: {}", s.message())))?;
            report.cells_removed += 1;
        }
    }
    report.merge = t.elapsed();

    let t = Instant::now();
    leader.check("publish").await?;
    cas_map(&mut d, Some(expected), next, term)
        .await
        .map_err(|s| publish_error(next, &s))?;
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
