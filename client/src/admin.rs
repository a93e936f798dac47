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
//! Before step 1 the change is recorded at the DPM, and the record is deleted after step 4
//! (see "Unfinished reconfigurations" below).
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
//! **Unfinished reconfigurations.** A change is recorded at the DPM before its first step
//! ([`RECONFIGURATION_KEY`], an [`Intent`]: both maps, the dead KNs, the term), written with
//! CompareAndPutMetadata only if no other change is recorded, and deleted after the publish.
//! The record has two phases:
//! - *Prepare* (written before PrepareMap): KNs may be paused, nothing at the DPM changed.
//!   A KN whose prepare bound (kv-node `prepare_timeout_ms`) passes withdraws the change by
//!   deleting this record (CAS over the bytes it read), then resumes under the published map.
//! - *Commit* (CAS from the Prepare record, after the leadership check before fencing): the
//!   point of no return. Fences, merges and cell changes follow, and a cell change cannot be
//!   undone by republishing `current` (a removed cell's key would have no cell, an installed
//!   one would go stale), so from here the change is only ever finished. KNs never withdraw
//!   a Commit-phase record; they wait for the map.
//!
//! The CAS between the two phases is what makes the KNs' bound safe: a KN resumes only after
//! deleting the Prepare record, and then the driver's move to Commit fails, so no fence or
//! merge runs while a prepared KN serves again (without that, a KN resuming during a slow
//! merge would write entries its successor never sees). A new leader calls
//! [`resolve_unfinished`]: if the published map is already `next`, it deletes the record and
//! commits `next` on the KNs; a Prepare record is rolled back (deleted; the paused KNs are
//! told to ask the DPM, which they do before resuming); a Commit record is finished by
//! re-running every step, each idempotent (PrepareMap again, which also re-pauses a KN that
//! restarted; fence and merge; cells, which the DPM creates or removes idempotently; publish
//! over `current`; CommitMap). Liveness of a Commit-phase change needs a leader, as any map
//! change does.
//!
//! A monitor drives a reconfiguration through [`reconfigure_led`] with its [`Leadership`]:
//! its term goes with every DPM call (the DPM refuses a term older than the newest, see
//! dpm.proto), and leadership is re-checked before each step, which aborts if it was lost.
//! Callers outside the monitor (the CLI's bootstrap, tests) use [`Unled`]: no term, no check.

use std::future::Future;
use std::time::{Duration, Instant};

use dinomo_placement::{ClusterMap, KnId, KnInfo};
use dinomo_proto::dpm::dpm_service_client::DpmServiceClient;
use dinomo_proto::dpm::{
    CompareAndPutMetadataRequest, FenceKnRequest, GetMetadataRequest, IndirectCellRequest,
    ListMetadataRequest, MergeAllRequest, NewMonitorTermRequest,
};
use dinomo_proto::kv::kv_service_client::KvServiceClient;
use dinomo_proto::kv::MapRequest;
use tonic::transport::Channel;
use tonic::{Code, Request};

use crate::error::{ClientError, Result};

/// The metadata name of the cluster map of record.
pub const CLUSTER_MAP_KEY: &str = "cluster/map";

/// The metadata name of the record of a reconfiguration in progress ([`Intent`]): written
/// before its first step, deleted after its last (or when it is rolled back).
pub const RECONFIGURATION_KEY: &str = "cluster/reconfiguration";

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

/// A DpmService client for `dpm`, as this process's identity ([`Security::of_process`]).
///
/// [`Security::of_process`]: dinomo_security::Security::of_process
async fn dpm_client(dpm: &str) -> Result<DpmServiceClient<Channel>> {
    dinomo_security::Security::of_process()
        .endpoint(dpm, dinomo_security::Service::Dpm)
        .map_err(|e| ClientError::Other(e.to_string()))?
        .connect()
        .await
        .map(DpmServiceClient::new)
        .map_err(|e| ClientError::Other(format!("cannot reach the dpm-node at {dpm}: {e}")))
}

async fn kn_client(endpoint: &str) -> Option<KvServiceClient<Channel>> {
    let ep = dinomo_security::Security::of_process()
        .endpoint(endpoint, dinomo_security::Service::Kv)
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

/// The metadata prefix under which the DPM records each registered KN's endpoint.
pub const REGISTERED_KN_PREFIX: &str = "dpm/kn/";

/// Every KN that ever registered with the DPM, by id, with the KvService endpoint it last
/// registered from. A record outlives its KN: whoever uses one probes the KN first.
pub async fn registered_kns(dpm: &str) -> Result<Vec<KnInfo>> {
    let entries = dpm_client(dpm)
        .await?
        .list_metadata(ListMetadataRequest {
            prefix: REGISTERED_KN_PREFIX.into(),
        })
        .await
        .map_err(|s| ClientError::Other(format!("listing registered KNs: {}", s.message())))?
        .into_inner()
        .entries;
    let mut kns: Vec<KnInfo> = entries
        .into_iter()
        .filter_map(|e| {
            let id = e.name.strip_prefix(REGISTERED_KN_PREFIX)?.parse().ok()?;
            let endpoint = String::from_utf8(e.value).ok()?;
            Some(KnInfo { id, endpoint })
        })
        .collect();
    kns.sort_by_key(|k| k.id);
    Ok(kns)
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

/// Publishes the leading monitor's MonitorService address (host:port) under its monitor
/// `term` (a deposed monitor's publish is refused), in the metadata entry
/// [`dinomo_proto::MONITOR_ENDPOINT_KEY`] that routing nodes hand to clients.
pub async fn publish_monitor_endpoint(dpm: &str, term: u64, endpoint: &str) -> Result<()> {
    dpm_client(dpm)
        .await?
        .put_metadata(with_term(
            dinomo_proto::dpm::PutMetadataRequest {
                name: dinomo_proto::MONITOR_ENDPOINT_KEY.into(),
                value: Some(endpoint.as_bytes().to_vec()),
            },
            Some(term),
        ))
        .await
        .map_err(|s| {
            ClientError::Other(format!("publishing the monitor's address: {}", s.message()))
        })?;
    Ok(())
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

    let t = Instant::now();
    leader.check("prepare").await?;
    // Recorded before anything is paused, so that a crash from here on leaves a trace.
    let intent = Intent {
        phase: IntentPhase::Prepare,
        term,
        nonce: nonce(),
        dead: dead.to_vec(),
        current: current.clone(),
        next: next.clone(),
    };
    let prepare_raw = intent.encode();
    cas_intent(&mut d, None, Some(prepare_raw.clone()), term)
        .await
        .map_err(|s| intent_error(&s))?;
    let prepared = match prepare_kns(current, next, dead, &mut report, true).await {
        Ok(prepared) => prepared,
        Err((prepared, why)) => {
            // A live KN is on another map: this change is stale. Withdraw it (nothing at the
            // DPM changed yet) and let the KNs paused for it resume.
            let _ = cas_intent(&mut d, Some(prepare_raw), None, term).await;
            nudge(current, &prepared_endpoints(current, next, &prepared)).await;
            return Err(ClientError::Other(format!(
                "reconfiguration to map version {} withdrawn before its fences and merges: \
                 {why}; nothing was changed, start over from the published map",
                next.version
            )));
        }
    };
    report.prepare = t.elapsed();

    leader.check("fence and merge").await?;
    // The point of no return: from here on, fences, merges and cells may change the DPM, so
    // the change is finished, never undone. Fails if a KN withdrew it (its prepare bound
    // passed) or another monitor resolved it meanwhile: nothing irreversible happened yet.
    let commit_raw = Intent {
        phase: IntentPhase::Commit,
        ..intent
    }
    .encode();
    if let Err(s) = cas_intent(&mut d, Some(prepare_raw), Some(commit_raw.clone()), term).await {
        // Tell the KNs still paused to ask the DPM: the change is no longer recorded, so they
        // resume under the published map.
        nudge(current, &prepared_endpoints(current, next, &prepared)).await;
        return Err(ClientError::Other(format!(
            "reconfiguration to map version {} withdrawn before its fences and merges (a KN's \
             prepare bound passed, or another monitor resolved it): {}; nothing was changed, \
             start over",
            next.version,
            s.message()
        )));
    }
    finish(
        &mut d,
        current,
        next,
        Some(expected),
        commit_raw,
        prepared,
        leader,
        &mut report,
    )
    .await?;
    tracing::info!(?report, "reconfigured");
    Ok(report)
}

/// KNs prepared for a change, with their clients.
type Prepared = Vec<(KnId, KvServiceClient<Channel>)>;

/// Step 1: PrepareMap to every affected KN not known dead. Returns the KNs that answered (the
/// others, which did not answer twice, are added to `report.fenced`). A KN that answers
/// FAILED_PRECONDITION is alive on another map version: with `stale_aborts` the change is
/// stale, and `Err` carries the KNs prepared so far and why, for the caller to withdraw it
/// instead of fencing a live KN; without (a Commit-phase change, which must finish), such a
/// KN is fenced like one that does not answer.
async fn prepare_kns(
    current: &ClusterMap,
    next: &ClusterMap,
    dead: &[KnId],
    report: &mut ReconfigReport,
    stale_aborts: bool,
) -> std::result::Result<Prepared, (Prepared, String)> {
    let bytes = bytes::Bytes::from(next.encode());
    let mut prepared = Vec::new();
    for &kn in &report.affected {
        if dead.contains(&kn) {
            report.fenced.push(kn);
            continue;
        }
        let mut answered = None;
        if let Some(ep) = endpoint_of(current, next, kn) {
            // Twice: a KN that must first catch up with the published map may miss one
            // deadline, and a KN that does not answer is fenced.
            for _ in 0..2 {
                let Some(mut c) = kn_client(&ep).await else {
                    continue;
                };
                match c.prepare_map(MapRequest { map: bytes.clone() }).await {
                    Ok(_) => {
                        answered = Some(c);
                        break;
                    }
                    Err(s) if s.code() == tonic::Code::FailedPrecondition => {
                        if stale_aborts {
                            let why = format!("KN {kn} is on another map: {}", s.message());
                            return Err((prepared, why));
                        }
                        break;
                    }
                    Err(_) => {}
                }
            }
        }
        match answered {
            Some(c) => prepared.push((kn, c)),
            None => report.fenced.push(kn),
        }
    }
    Ok(prepared)
}

fn endpoint_of(current: &ClusterMap, next: &ClusterMap, kn: KnId) -> Option<String> {
    next.endpoint(kn)
        .or_else(|| current.endpoint(kn))
        .map(str::to_string)
}

fn prepared_endpoints(
    current: &ClusterMap,
    next: &ClusterMap,
    prepared: &[(KnId, KvServiceClient<Channel>)],
) -> Vec<String> {
    prepared
        .iter()
        .filter_map(|(kn, _)| endpoint_of(current, next, *kn))
        .collect()
}

/// Steps 2-4 from the point of no return (the intent, `commit_raw`, is in its Commit phase):
/// fence and merge, cells, publish `next` over `expected` (None: it is published already),
/// CommitMap, and the intent deleted. Every step is idempotent, so a new leader re-runs them
/// all after a crash anywhere in between.
#[allow(clippy::too_many_arguments)]
async fn finish<L: Leadership>(
    d: &mut DpmServiceClient<Channel>,
    current: &ClusterMap,
    next: &ClusterMap,
    expected: Option<Vec<u8>>,
    commit_raw: Vec<u8>,
    prepared: Vec<(KnId, KvServiceClient<Channel>)>,
    leader: &L,
    report: &mut ReconfigReport,
) -> Result<()> {
    let term = leader.term();
    let t = Instant::now();
    for &kn in &report.fenced {
        d.fence_kn(with_term(FenceKnRequest { kn_id: kn }, term))
            .await
            .map_err(|s| ClientError::Other(format!("fencing KN {kn}: {}", s.message())))?;
    }
    // A fenced KN may still be alive (declared failed on a slow heartbeat) and serve from its
    // caches until its serving lease runs out; it cannot renew the lease after the fence (the
    // DPM's ConfirmServing). The new owners serve its keys only after the publish below, so
    // the lease is waited out first.
    let lease_out = (!report.fenced.is_empty())
        .then(|| Instant::now() + Duration::from_millis(dinomo_proto::MAX_KN_SERVE_LEASE_MS));
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
    // Both idempotent at the DPM: installing returns an existing cell, removing a missing one
    // does nothing.
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
    if let Some(at) = lease_out {
        tokio::time::sleep_until(at.into()).await;
    }
    leader.check("publish").await?;
    if let Some(expected) = expected {
        cas_map(d, Some(expected), next, term)
            .await
            .map_err(|s| publish_error(next, &s))?;
    }
    let bytes = bytes::Bytes::from(next.encode());
    for (kn, mut c) in prepared {
        if next.contains(kn) {
            if let Err(s) = c.commit_map(MapRequest { map: bytes.clone() }).await {
                tracing::warn!(kn, error = %s.message(), "commit failed; the KN will take the map from the DPM");
            }
        }
    }
    if let Err(s) = cas_intent(d, Some(commit_raw), None, term).await {
        // The map is published; a later leader finds it so and deletes the record.
        tracing::warn!(error = %s.message(), "could not delete the reconfiguration record");
    }
    report.commit = t.elapsed();
    Ok(())
}

/// How [`resolve_unfinished`] settled a reconfiguration it found recorded at the DPM.
#[derive(Debug, Clone)]
pub enum Resolution {
    /// Its map was published already: the record was deleted and the KNs told.
    WasPublished { version: u64 },
    /// It had not passed its point of no return: withdrawn, the published map stays.
    RolledBack { version: u64 },
    /// It had: its steps were re-run and its map published.
    Finished(ReconfigReport),
    /// The published map is neither its start nor its end (it was superseded): the record
    /// was deleted.
    Superseded { version: u64 },
}

/// Finds a reconfiguration recorded at the DPM and not finished (its driver crashed or lost
/// leadership) and settles it, as the module doc describes: a new leader calls this before
/// changing the map. `Ok(None)`: nothing was recorded.
pub async fn resolve_unfinished<L: Leadership>(
    dpm: &str,
    leader: &L,
) -> Result<Option<Resolution>> {
    let term = leader.term();
    let mut d = dpm_client(dpm).await?;
    let Some(raw) = get_intent(&mut d).await? else {
        return Ok(None);
    };
    let intent = Intent::decode(&raw)?;
    let (current, next) = (&intent.current, &intent.next);
    let published = published_map(dpm).await?;
    let affected = current.changed_ranges(next);
    let endpoints = || {
        affected
            .iter()
            .filter_map(|&kn| endpoint_of(current, next, kn))
            .collect::<Vec<_>>()
    };
    let same = |m: &Option<ClusterMap>, w: &ClusterMap| {
        m.as_ref().is_some_and(|m| m.encode() == w.encode())
    };
    let delete = |d: &mut DpmServiceClient<Channel>, raw: Vec<u8>| {
        let mut d = d.clone();
        async move {
            cas_intent(&mut d, Some(raw), None, term)
                .await
                .map_err(|s| {
                    ClientError::Other(format!(
                        "deleting the record of an unfinished reconfiguration: {}",
                        s.message()
                    ))
                })
        }
    };
    if same(&published, next) {
        leader.check("commit").await?;
        delete(&mut d, raw).await?;
        nudge(next, &endpoints()).await;
        tracing::info!(
            version = next.version,
            "unfinished reconfiguration was published; record deleted"
        );
        return Ok(Some(Resolution::WasPublished {
            version: next.version,
        }));
    }
    if !same(&published, current) {
        leader.check("commit").await?;
        delete(&mut d, raw).await?;
        if let Some(p) = &published {
            nudge(p, &endpoints()).await;
        }
        let version = published.map_or(0, |p| p.version);
        tracing::warn!(
            version,
            from = current.version,
            to = next.version,
            "unfinished reconfiguration was superseded; record deleted"
        );
        return Ok(Some(Resolution::Superseded { version }));
    }
    match intent.phase {
        IntentPhase::Prepare => {
            // Nothing irreversible happened (no fence, merge or cell change comes before the
            // Commit phase): withdraw it, and tell the paused KNs to ask the DPM.
            leader.check("roll back").await?;
            delete(&mut d, raw).await?;
            nudge(current, &endpoints()).await;
            tracing::warn!(
                from = current.version,
                to = next.version,
                "unfinished reconfiguration rolled back"
            );
            Ok(Some(Resolution::RolledBack {
                version: current.version,
            }))
        }
        IntentPhase::Commit => {
            // Fences, merges and cell changes may have happened: finish it. The KNs wait (a
            // Commit-phase record is never withdrawn); re-preparing them pauses again any that
            // restarted meanwhile.
            let mut report = ReconfigReport {
                from_version: current.version,
                to_version: next.version,
                affected,
                ..Default::default()
            };
            let expected = published_bytes_of(&mut d, current).await?;
            let t = Instant::now();
            leader.check("prepare").await?;
            // Past the point of no return a change is finished whatever the KNs say: one that
            // refuses is fenced like one that does not answer.
            let prepared = match prepare_kns(current, next, &intent.dead, &mut report, false).await
            {
                Ok(p) | Err((p, _)) => p,
            };
            report.prepare = t.elapsed();
            leader.check("fence and merge").await?;
            finish(
                &mut d,
                current,
                next,
                Some(expected),
                raw,
                prepared,
                leader,
                &mut report,
            )
            .await?;
            tracing::warn!(?report, "unfinished reconfiguration finished");
            Ok(Some(Resolution::Finished(report)))
        }
    }
}

/// CommitMap(`map`) to each endpoint, best effort. A KN whose transition is newer than `map`
/// takes it as a hint: it asks the DPM whether its change is still recorded, and resumes if not.
async fn nudge(map: &ClusterMap, endpoints: &[String]) {
    let bytes = bytes::Bytes::from(map.encode());
    for ep in endpoints {
        if let Some(mut c) = kn_client(ep).await {
            if let Err(s) = c.commit_map(MapRequest { map: bytes.clone() }).await {
                tracing::debug!(endpoint = %ep, error = %s.message(), "commit hint not taken");
            }
        }
    }
}

async fn get_intent(d: &mut DpmServiceClient<Channel>) -> Result<Option<Vec<u8>>> {
    Ok(d.get_metadata(GetMetadataRequest {
        name: RECONFIGURATION_KEY.into(),
    })
    .await
    .map_err(|s| {
        ClientError::Other(format!(
            "reading the reconfiguration record: {}",
            s.message()
        ))
    })?
    .into_inner()
    .value)
}

/// CompareAndPutMetadata of the reconfiguration record (value None: delete it).
async fn cas_intent(
    d: &mut DpmServiceClient<Channel>,
    expected: Option<Vec<u8>>,
    value: Option<Vec<u8>>,
    term: Option<u64>,
) -> std::result::Result<(), tonic::Status> {
    d.compare_and_put_metadata(with_term(
        CompareAndPutMetadataRequest {
            name: RECONFIGURATION_KEY.into(),
            value,
            expected,
        },
        term,
    ))
    .await
    .map(|_| ())
}

fn intent_error(s: &tonic::Status) -> ClientError {
    if s.code() == Code::FailedPrecondition {
        ClientError::Other(format!(
            "another reconfiguration is recorded at the DPM ({RECONFIGURATION_KEY}) and not \
             finished; the leading monitor resolves it first (admin::resolve_unfinished), then \
             start over ({})",
            s.message()
        ))
    } else {
        ClientError::Other(format!(
            "recording the reconfiguration at the DPM: {}",
            s.message()
        ))
    }
}

/// A value that makes each recorded reconfiguration's bytes unique, so a record withdrawn and
/// written again by someone else is never taken for the one a CAS expects.
fn nonce() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    t ^ rand::random::<u64>()
}

/// The phase of a recorded reconfiguration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntentPhase {
    /// KNs may be paused; nothing at the DPM changed yet. A KN whose prepare bound passes may
    /// withdraw it (delete the record); a new leader rolls it back.
    Prepare = 1,
    /// Past the point of no return: fences, merges and cells may have changed. Only finished.
    Commit = 2,
}

/// The record of a reconfiguration in progress ([`RECONFIGURATION_KEY`]).
///
/// Format version 1 (integers little-endian), laid out so that a KN can read the phase
/// and the target map without this crate:
///
/// | bytes | field |
/// |---|---|
/// | 0 | format version (1) |
/// | 1 | phase (1 Prepare, 2 Commit) |
/// | 2..10 | monitor term (0: none) |
/// | 10..18 | nonce |
/// | 18..22 | n = number of dead KNs, then n u32 KN ids |
/// | then | u32 length + the current map (`ClusterMap::encode`) |
/// | then | u32 length + the next map |
#[derive(Debug, Clone, PartialEq)]
pub struct Intent {
    pub phase: IntentPhase,
    pub term: Option<u64>,
    pub nonce: u64,
    pub dead: Vec<KnId>,
    pub current: ClusterMap,
    pub next: ClusterMap,
}

/// The version of [`Intent`]'s format written here.
pub const INTENT_FORMAT: u8 = 1;

impl Intent {
    pub fn encode(&self) -> Vec<u8> {
        let cur = self.current.encode();
        let next = self.next.encode();
        let mut b = Vec::with_capacity(30 + 4 * self.dead.len() + cur.len() + next.len());
        b.push(INTENT_FORMAT);
        b.push(self.phase as u8);
        b.extend_from_slice(&self.term.unwrap_or(0).to_le_bytes());
        b.extend_from_slice(&self.nonce.to_le_bytes());
        b.extend_from_slice(&(self.dead.len() as u32).to_le_bytes());
        for kn in &self.dead {
            b.extend_from_slice(&kn.to_le_bytes());
        }
        for m in [&cur, &next] {
            b.extend_from_slice(&(m.len() as u32).to_le_bytes());
            b.extend_from_slice(m);
        }
        b
    }

    pub fn decode(b: &[u8]) -> Result<Intent> {
        let bad = |what: &str| {
            ClientError::Other(format!(
                "the reconfiguration record at the DPM ({RECONFIGURATION_KEY}) is unreadable: \
                 {what}"
            ))
        };
        let mut r = b;
        let mut take = |n: usize| -> Result<&[u8]> {
            if r.len() < n {
                return Err(bad("truncated"));
            }
            let (h, t) = r.split_at(n);
            r = t;
            Ok(h)
        };
        let u32_of = |s: &[u8]| u32::from_le_bytes(s.try_into().expect("4 bytes"));
        let u64_of = |s: &[u8]| u64::from_le_bytes(s.try_into().expect("8 bytes"));
        let v = take(1)?[0];
        if v != INTENT_FORMAT {
            return Err(bad(&format!(
                "format version {v}, this build reads version {INTENT_FORMAT}"
            )));
        }
        let phase = match take(1)?[0] {
            1 => IntentPhase::Prepare,
            2 => IntentPhase::Commit,
            p => return Err(bad(&format!("unknown phase {p}"))),
        };
        let term = Some(u64_of(take(8)?)).filter(|&t| t != 0);
        let nonce = u64_of(take(8)?);
        let n = u32_of(take(4)?) as usize;
        let mut dead = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            dead.push(u32_of(take(4)?));
        }
        let mut map = || -> Result<ClusterMap> {
            let len = u32_of(take(4)?) as usize;
            ClusterMap::decode(take(len)?).map_err(|e| bad(&format!("a map: {e}")))
        };
        let current = map()?;
        let next = map()?;
        Ok(Intent {
            phase,
            term,
            nonce,
            dead,
            current,
            next,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dinomo_placement::KnInfo;

    #[test]
    fn intent_round_trips_and_refuses_other_versions() {
        let kns = (1..=3)
            .map(|id| KnInfo {
                id,
                endpoint: format!("127.0.0.1:{}", 7800 + id),
            })
            .collect();
        let current = ClusterMap::new(kns, 16, 1).unwrap();
        let next = current.with_kn_removed(2).unwrap();
        let i = Intent {
            phase: IntentPhase::Commit,
            term: Some(7),
            nonce: 42,
            dead: vec![2],
            current,
            next,
        };
        let b = i.encode();
        assert_eq!(Intent::decode(&b).unwrap(), i);
        let mut other = b.clone();
        other[0] = 2;
        let e = Intent::decode(&other).unwrap_err().to_string();
        assert!(e.contains("format version 2"), "{e}");
        assert!(Intent::decode(&b[..b.len() - 1]).is_err());
    }
}
