//! The KV node as a library: registers with the DPM, starts its shards, keeps the cluster map
//! (of record in the DPM's metadata) and routes each request to the shard that owns its key,
//! after checking that this KN owns it.
//!
//! Map installs: a KN resets its shards (caches, copies of merged segments) whenever the map it
//! installs changes its ownership, judged against the map it had. Maps carry no per-range
//! ownership epochs, so a KN that skips versions (it polls, or missed a commit) cannot tell
//! whether a range moved away and back between the versions it saw: any jump of more than one
//! version resets too.
//!
//! Map changes: between PrepareMap and CommitMap the KN pauses the keys that move (the
//! `transition`). That state is bounded by `prepare_timeout`: then the KN settles it with the
//! DPM's record of the change ([`KvNode::settle_transition`]): withdrawn if it had not passed
//! its point of no return, waited for if it had; when it ends, the KN takes the published map
//! through [`KvNode::install_map`], so it never serves a key the map of record does not give
//! it, nor a value cached under an ownership it lost. PrepareMap and CommitMap take only the
//! next version after the KN's map (after catching up with the published map if the KN is
//! behind): whoever sends them, a map far ahead can neither pause keys nor become a map that
//! no later one can replace.
//!
//! Stopping: [`KvNode::shutdown`] refuses new requests, lets every admitted one reach its shard,
//! and waits (bounded) for each shard to write out and seal its log.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dinomo_fabric::Fabric;
use dinomo_placement::{ClusterMap, KnInfo};
use parking_lot::RwLock;
use tokio::sync::{mpsc, oneshot};

use crate::cache::CacheConfig;
use crate::config::KnConfig;
use crate::dpm_link::DpmLink;
use crate::error::{KvError, KvResult};
use crate::shard::{
    self, AnswerSink, Control, OpKind, Reply, ShardConfig, ShardHandle, ShardMsg, ShardOp,
    ShardRequest, Tag,
};

/// The map a KN uses until one is published: itself alone, version 0.
fn bootstrap_map(kn: u32, endpoint: &str) -> ClusterMap {
    let mut m = ClusterMap::new(
        vec![KnInfo {
            id: kn,
            endpoint: endpoint.to_string(),
        }],
        64,
        1,
    )
    .expect("a one-KN map is valid");
    m.version = 0;
    m
}

/// Wraps each shard's fabric handle (shard id, handle) before the shard uses it: how tests put
/// a fault-injecting fabric ([`dinomo_fabric::fault::Faulty`]) under a KN. Production passes none.
pub type FabricHook = Arc<dyn Fn(u32, Arc<dyn Fabric>) -> Arc<dyn Fabric> + Send + Sync>;

/// Totals across shards, for the Stats RPC and /metrics.
#[derive(Debug, Clone, Default)]
pub struct NodeStats {
    pub gets: u64,
    pub puts: u64,
    pub deletes: u64,
    pub value_hits: u64,
    pub shortcut_hits: u64,
    pub unmerged_hits: u64,
    pub misses: u64,
    pub wrong_owner: u64,
    pub batches: u64,
    pub round_trips: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub occupancy: f64,
    pub cache_values: u64,
    pub cache_shortcuts: u64,
    pub promotions: u64,
    pub demotions: u64,
    pub top_keys: Vec<(Bytes, u64)>,
}

#[derive(Debug)]
pub struct KvNode {
    pub config: KnConfig,
    link: Arc<DpmLink>,
    shards: Vec<ShardHandle>,
    map: RwLock<Arc<ClusterMap>>,
    wrong_owner: AtomicU64,
    occupancy: RwLock<f64>,
    /// The map being moved to (between PrepareMap and CommitMap).
    transition: RwLock<Option<Arc<ClusterMap>>>,
    /// When `transition` was last set or re-checked: it is settled with the DPM once
    /// `config.prepare_timeout` has passed since ([`KvNode::settle_transition`]).
    transition_since: RwLock<Instant>,
    install_lock: tokio::sync::Mutex<()>,
    /// Held shared by a request from its ownership check until it is queued at its shard;
    /// PrepareMap takes it exclusively (after setting `transition`), so every request admitted
    /// under the old map is queued before the SealLog that follows.
    gate: tokio::sync::RwLock<()>,
    lease: Arc<crate::lease::ServeLease>,
    /// Whether the DPM session works (the session keeper updates it).
    session_health: Arc<crate::session::SessionHealth>,
    /// Indirect-cell offsets of the replicated keys this KN co-owns, valid under the map
    /// version they are tagged with (a key de-replicated and replicated again gets a new cell).
    cells: RwLock<(u64, hashbrown::HashMap<Bytes, u64>)>,
    /// Set by [`KvNode::shutdown`]: requests are refused.
    stopping: AtomicBool,
    /// `dinomo_kn_request_seconds{op}` for get, put and delete, registered once: the macro
    /// looks its series up in the registry on every call, a cost paid per request.
    request_seconds: [metrics::Histogram; 3],
}

/// How long [`KvNode::shutdown`] waits for the shards to seal their logs.
pub const SHUTDOWN_WAIT: Duration = Duration::from_secs(10);

impl KvNode {
    /// Registers with the DPM and starts the shards and the map watcher.
    pub async fn start(config: KnConfig) -> KvResult<Arc<Self>> {
        Self::start_with(config, None).await
    }

    /// [`KvNode::start`], with each shard's fabric handle passed through `hook` (tests).
    pub async fn start_with(config: KnConfig, hook: Option<FabricHook>) -> KvResult<Arc<Self>> {
        let link = Arc::new(
            DpmLink::register(
                &config.security,
                &config.dpm,
                config.kn_id,
                &config.advertise,
            )
            .await?
            .with_rdma_device(config.rdma_device.clone()),
        );
        let largest = config.max_key_bytes + config.max_value_bytes + 64;
        if largest as u64 > link.segment_size / 4 {
            return Err(KvError::InvalidArgument(format!(
                "max_key_bytes + max_value_bytes = {largest} is too large for the DPM's {}-byte segments (at most a quarter)",
                link.segment_size
            )));
        }
        tracing::info!(
            kn = link.kn_id,
            epoch = link.epoch(),
            fabric = link.session().fabric.kind().as_str_name(),
            "registered with the DPM"
        );
        // Versions: unique per KN incarnation and increasing across incarnations.
        let versions = Arc::new(AtomicU64::new(link.epoch() << 32));
        let lease = Arc::new(crate::lease::ServeLease::new(config.serve_lease));
        let session_health = Arc::new(crate::session::SessionHealth::default());
        let per_shard = config.cache_bytes / config.shards as usize;
        let mut shards = Vec::new();
        for i in 0..config.shards {
            let cfg = ShardConfig {
                cache: CacheConfig {
                    budget_bytes: per_shard,
                    policy: config.cache_policy,
                },
                lease: lease.clone(),
                batch_bytes: config.batch_bytes,
                batch_delay: config.batch_delay,
                max_unmerged_segments: config.max_unmerged_segments,
            };
            shards.push(shard::spawn(i, cfg, link.clone(), versions.clone(), hook.as_ref()).await?);
        }
        let map = match link.cluster_map().await? {
            Some(b) => ClusterMap::decode(&b)
                .map_err(|e| KvError::Internal(format!("cluster map in the DPM: {e}")))?,
            None => bootstrap_map(link.kn_id, &config.advertise),
        };
        let first_version = map.version;
        let node = Arc::new(KvNode {
            config,
            link,
            shards,
            map: RwLock::new(Arc::new(map)),
            wrong_owner: AtomicU64::new(0),
            occupancy: RwLock::new(0.0),
            transition: RwLock::new(None),
            transition_since: RwLock::new(Instant::now()),
            install_lock: tokio::sync::Mutex::new(()),
            gate: tokio::sync::RwLock::new(()),
            lease,
            session_health: session_health.clone(),
            cells: RwLock::new((first_version, hashbrown::HashMap::new())),
            stopping: AtomicBool::new(false),
            request_seconds: ["get", "put", "delete"]
                .map(|op| metrics::histogram!("dinomo_kn_request_seconds", "op" => op)),
        });
        tokio::spawn(watch_map(Arc::downgrade(&node)));
        tokio::spawn(expire_transitions(Arc::downgrade(&node)));
        tokio::spawn(crate::session::keep(
            Arc::downgrade(&node.link),
            session_health,
            node.link.index_root,
        ));
        tokio::spawn(measure_occupancy(Arc::downgrade(&node)));
        Ok(node)
    }

    pub fn kn_id(&self) -> u32 {
        self.link.kn_id
    }

    /// False once the DPM session has been broken for a while (session module): the Stats
    /// heartbeat then fails, so the monitor does not take a KN that cannot write for a live one.
    pub fn session_healthy(&self) -> bool {
        self.session_health.healthy()
    }

    pub fn epoch(&self) -> u64 {
        self.link.epoch()
    }

    pub fn map(&self) -> Arc<ClusterMap> {
        self.map.read().clone()
    }

    /// Installs a newer map (older or equal versions are ignored). When the KN's ownership
    /// changes under it, or versions were skipped (module doc), every shard is reset first
    /// (caches, and copies of merged segments), so a key it gains is never served from state
    /// cached under an older ownership.
    pub async fn install_map(&self, map: ClusterMap) {
        let _g = self.install_lock.lock().await;
        let cur = self.map();
        if map.version <= cur.version {
            return;
        }
        let me = self.link.kn_id;
        let changes = cur.changed_ranges(&map);
        // A skipped version may have moved this KN's keys away and back.
        let skipped = map.version - cur.version > 1;
        let reset = skipped || changes.contains(&me);
        if reset {
            self.control_all(Control::Reset).await;
        }
        {
            let mut cells = self.cells.write();
            if skipped || cur.replicated != map.replicated {
                // A key de-replicated and replicated again gets a new cell.
                cells.1.clear();
            }
            cells.0 = map.version;
        }
        tracing::info!(
            from = cur.version,
            to = map.version,
            kns = map.kns.len(),
            ownership_changed = changes.contains(&me),
            reset,
            "cluster map installed"
        );
        *self.map.write() = Arc::new(map);
    }

    /// Reconfiguration step 1 (DINOMO 3.5): stop serving every key whose owner changes under
    /// `next` and this KN is part of, and write out and seal the logs, so that a MergeAll at the
    /// DPM covers every write this KN acknowledged.
    ///
    /// `next` must be the next version after this KN's map (refused otherwise, see
    /// [`KvNode::check_next_version`]): a change moves the map of record one version on, and
    /// a map far ahead would pause keys for a change that cannot be published.
    pub async fn prepare_map(&self, next: ClusterMap) -> KvResult<u64> {
        let cur = self.check_next_version("PrepareMap", next.version).await?;
        let v = next.version;
        {
            let mut t = self.transition.write();
            *t = Some(Arc::new(next));
            *self.transition_since.write() = Instant::now();
        }
        // Wait out the requests between their ownership check and their shard queue.
        drop(self.gate.write().await);
        self.control_all(Control::SealLog).await;
        tracing::info!(
            from = cur.version,
            to = v,
            "prepared for a map change: moving keys paused, logs sealed"
        );
        Ok(v)
    }

    /// Reconfiguration step 3: take the new map and resume. A map older than the one this KN
    /// is prepared for is a hint that the change was rolled back: the KN asks the DPM
    /// ([`KvNode::settle_transition`], without withdrawing anything) and resumes if the change
    /// is no longer recorded. The hint is checked, never trusted: a late commit of an earlier
    /// change must not end the pause of the current one.
    ///
    /// Only the next version after this KN's map is installed. A KN further behind takes the
    /// published map first; a map still further ahead is refused (FAILED_PRECONDITION), so a
    /// forged `u64::MAX` map cannot stop the KN from ever installing the real next one. A map
    /// of the KN's version or older installs nothing and stays a hint (the rollback's
    /// `admin::nudge` sends the published map, and a commit can race the KN's own poll).
    pub async fn commit_map(&self, next: ClusterMap) -> KvResult<u64> {
        let v = next.version;
        if v > self.map().version {
            let cur = self.catch_up(v).await?;
            if v > cur.version.saturating_add(1) {
                return Err(KvError::MapVersion {
                    rpc: "CommitMap",
                    kn: cur.version,
                    offered: v,
                });
            }
            self.install_map(next).await;
        }
        let pending = {
            let mut t = self.transition.write();
            if t.as_ref().is_some_and(|m| m.version <= v) {
                *t = None;
            }
            t.clone()
        };
        if let Some(t) = pending {
            if let Err(e) = self.settle_transition(t, false).await {
                tracing::debug!(error = %e, "cannot settle the transition now; its bound will");
            }
        }
        Ok(self.map().version)
    }

    /// Ends the transition to `t` (if it is still the one in progress) unless the DPM says
    /// its change must still complete; returns whether it ended. The reconfiguration record
    /// (`client::admin::Intent`, metadata "cluster/reconfiguration") decides:
    /// - it records `t` in its Commit phase: the change is past its point of no return and a
    ///   monitor will publish `t`; the KN keeps waiting;
    /// - it records `t` in its Prepare phase: with `withdraw` (the prepare bound passed), the
    ///   KN deletes the record (CompareAndPutMetadata over the bytes read), after which the
    ///   change can no longer reach its fences and merges; without, it keeps waiting;
    /// - anything else (no record, another change): `t`'s change was finished or abandoned.
    ///
    /// Then the KN takes the published map through [`KvNode::install_map`] (which resets the
    /// shards if its ownership changed) and leaves the transition: it serves what the map of
    /// record gives it and nothing else.
    pub async fn settle_transition(&self, t: Arc<ClusterMap>, withdraw: bool) -> KvResult<bool> {
        if t.version > self.map().version {
            use dinomo_proto::dpm as pb;
            let unavailable = |what: &str, s: tonic::Status| {
                KvError::Unavailable(format!("{what}: {}", s.message()))
            };
            let ep = (self.config.security)
                .endpoint(&self.config.dpm, dinomo_security::Service::Dpm)
                .map_err(|e| KvError::Internal(format!("dpm address: {e}")))?
                .connect_timeout(Duration::from_secs(1))
                .timeout(Duration::from_secs(2));
            let mut d = pb::dpm_service_client::DpmServiceClient::new(ep.connect_lazy());
            let raw = d
                .get_metadata(pb::GetMetadataRequest {
                    name: RECONFIGURATION_KEY.into(),
                })
                .await
                .map_err(|s| unavailable("reading the reconfiguration record", s))?
                .into_inner()
                .value;
            if let Some(raw) = raw {
                match recorded_change(&raw) {
                    None => {
                        tracing::warn!(
                            "the reconfiguration record is unreadable; staying prepared"
                        );
                        return Ok(false);
                    }
                    Some((phase, next)) if next.encode() == t.encode() => {
                        if phase != INTENT_PREPARE || !withdraw {
                            return Ok(false);
                        }
                        d.compare_and_put_metadata(pb::CompareAndPutMetadataRequest {
                            name: RECONFIGURATION_KEY.into(),
                            value: None,
                            expected: Some(raw),
                        })
                        .await
                        .map_err(|s| unavailable("withdrawing the reconfiguration", s))?;
                        tracing::warn!(
                            to = t.version,
                            "prepare bound passed: map change withdrawn at the DPM"
                        );
                    }
                    Some(_) => {}
                }
            }
            self.refresh_map().await?;
        }
        let mut cur = self.transition.write();
        if cur.as_ref().is_some_and(|c| Arc::ptr_eq(c, &t)) {
            *cur = None;
            tracing::info!(
                prepared_for = t.version,
                map = self.map().version,
                "left the map transition; serving under the published map"
            );
        }
        Ok(true)
    }

    /// Installs the published map (the map of record in the DPM's metadata), if there is one.
    async fn refresh_map(&self) -> KvResult<()> {
        if let Some(b) = self.link.cluster_map().await? {
            let m = ClusterMap::decode(&b)
                .map_err(|e| KvError::Internal(format!("cluster map in the DPM: {e}")))?;
            self.install_map(m).await;
        }
        Ok(())
    }

    /// This KN's map, after taking the published one if `version` is further ahead than the
    /// next version (the KN is behind: it polls, or missed a commit).
    async fn catch_up(&self, version: u64) -> KvResult<Arc<ClusterMap>> {
        if version > self.map().version.saturating_add(1) {
            self.refresh_map().await?;
        }
        Ok(self.map())
    }

    /// This KN's map, if `version` is the next version after it ([`KvNode::catch_up`] first);
    /// otherwise [`KvError::MapVersion`] names both versions.
    async fn check_next_version(
        &self,
        rpc: &'static str,
        version: u64,
    ) -> KvResult<Arc<ClusterMap>> {
        let cur = self.catch_up(version).await?;
        if cur.version.checked_add(1) != Some(version) {
            return Err(KvError::MapVersion {
                rpc,
                kn: cur.version,
                offered: version,
            });
        }
        Ok(cur)
    }

    async fn control_all(&self, ctl: Control) {
        let mut acks = Vec::new();
        for sh in &self.shards {
            let (tx, rx) = oneshot::channel();
            if sh.tx.send(ShardMsg::Control(ctl, tx)).await.is_ok() {
                acks.push(rx);
            }
        }
        for a in acks {
            let _ = a.await;
        }
    }

    fn shard_of_hash(&self, key_hash: u64) -> usize {
        // The local ring (salted, so one KN's keys spread evenly over its shards).
        dinomo_placement::shard_of_hash(key_hash, self.shards.len() as u32) as usize
    }

    fn validate_key(&self, key: &[u8]) -> KvResult<()> {
        if key.is_empty() {
            return Err(KvError::InvalidArgument("the key is empty".into()));
        }
        if key.len() > self.config.max_key_bytes {
            return Err(KvError::InvalidArgument(format!(
                "the key is {} bytes; the limit is {} (max_key_bytes)",
                key.len(),
                self.config.max_key_bytes
            )));
        }
        Ok(())
    }

    /// Checks one operation against `map` (and the map being moved to, if any): sizes, a key
    /// moving between KNs, ownership. Returns the key's hash (computed once, for the ring and
    /// the shard).
    fn admit(&self, map: &ClusterMap, next: Option<&ClusterMap>, op: &ShardOp) -> KvResult<u64> {
        let key = op.key();
        if let ShardOp::Put { value, .. } = op {
            if value.len() > self.config.max_value_bytes {
                return Err(KvError::InvalidArgument(format!(
                    "the value is {} bytes; the limit is {} (max_value_bytes)",
                    value.len(),
                    self.config.max_value_bytes
                )));
            }
        }
        self.validate_key(key)?;
        let me = self.link.kn_id;
        if let Some(next) = next {
            if next.version > map.version
                && map.owners(key) != next.owners(key)
                && (map.is_owner(me, key) || next.is_owner(me, key))
            {
                return Err(KvError::Unavailable(format!(
                    "the key is moving between KNs (map version {} -> {})",
                    map.version, next.version
                )));
            }
        }
        let hash = dinomo_layout::key_hash(key);
        let mine = match map.replicated.get(&key[..]) {
            Some(owners) => owners.contains(&me),
            None => map.owner_by_hash(hash) == Some(me),
        };
        if !mine {
            self.wrong_owner.fetch_add(1, Ordering::Relaxed);
            return Err(KvError::WrongOwner {
                kn: me,
                map_version: map.version,
            });
        }
        Ok(hash)
    }

    /// The key's indirect cell if `map` replicates it (DINOMO 3.4: a replicated key is read
    /// and written through its cell).
    async fn cell_if_replicated(&self, map: &ClusterMap, key: &Bytes) -> KvResult<Option<u64>> {
        if map.replicated.is_empty() || !map.replicated.contains_key(&key[..]) {
            return Ok(None);
        }
        self.cell_of(key, map.version).await.map(Some)
    }

    /// Records a request answered at `answered` in `dinomo_kn_request_seconds` (and the error
    /// counter).
    pub fn record(
        &self,
        kind: OpKind,
        started: Instant,
        answered: Instant,
        result: &KvResult<Option<Bytes>>,
    ) {
        self.request_seconds[kind as usize]
            .record(answered.saturating_duration_since(started).as_secs_f64());
        if let Err(e) = result {
            metrics::counter!("dinomo_kn_request_errors_total", "op" => kind.as_str(), "code" => format!("{:?}", e.code())).increment(1);
        }
    }

    /// Validates, checks ownership and runs one operation on its shard. A put's value must be a
    /// buffer of its own (see `ShardOp::Put`), as for [`KvNode::submit`].
    pub async fn execute(&self, op: ShardOp) -> KvResult<Option<Bytes>> {
        let kind = op.kind();
        let start = Instant::now();
        let r = self.execute_inner(op).await;
        self.record(kind, start, Instant::now(), &r);
        r
    }

    async fn execute_inner(&self, op: ShardOp) -> KvResult<Option<Bytes>> {
        let _admitted = self.gate.read().await;
        if self.stopping.load(Ordering::Acquire) {
            return Err(KvError::Unavailable("the KN is stopping".into()));
        }
        let map = self.map();
        let next = self.transition.read().clone();
        let hash = self.admit(&map, next.as_deref(), &op)?;
        let cell = self.cell_if_replicated(&map, op.key()).await?;
        let (reply, rx) = oneshot::channel();
        let shard = &self.shards[self.shard_of_hash(hash)];
        shard
            .tx
            .send(ShardMsg::Op(ShardRequest {
                op,
                reply: Reply::Once(reply),
                cell,
            }))
            .await
            .map_err(|_| KvError::Unavailable("the KN is stopping".into()))?;
        rx.await
            .map_err(|_| KvError::Unavailable("the KN is stopping".into()))?
    }

    /// Runs the requests a Pipeline stream read together; their answers go to `to`, each as
    /// soon as its shard has it. The gate, the stop flag and the maps are consulted once for
    /// all of them, and each shard gets one message with its requests in the order given.
    /// A put's value must be a buffer of its own, not a view into a read buffer: the cache and
    /// the unmerged log keep it as it is (see `ShardOp::Put`).
    pub async fn submit(&self, reqs: Vec<(Tag, ShardOp)>, to: &AnswerSink) {
        let _admitted = self.gate.read().await;
        if self.stopping.load(Ordering::Acquire) {
            for (tag, _) in reqs {
                let _ = Reply::stream(tag, to.clone())
                    .send(Err(KvError::Unavailable("the KN is stopping".into())));
            }
            return;
        }
        let map = self.map();
        let next = self.transition.read().clone();
        let mut by_shard: Vec<Vec<ShardRequest>> = Vec::new();
        by_shard.resize_with(self.shards.len(), Vec::new);
        for (tag, op) in reqs {
            let reply = Reply::stream(tag, to.clone());
            let admitted = match self.admit(&map, next.as_deref(), &op) {
                Ok(hash) => match self.cell_if_replicated(&map, op.key()).await {
                    Ok(cell) => Ok((hash, cell)),
                    Err(e) => Err(e),
                },
                Err(e) => Err(e),
            };
            match admitted {
                Ok((hash, cell)) => {
                    by_shard[self.shard_of_hash(hash)].push(ShardRequest { op, reply, cell })
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            }
        }
        for (shard, reqs) in self.shards.iter().zip(by_shard) {
            if reqs.is_empty() {
                continue;
            }
            if let Err(mpsc::error::SendError(msg)) = shard.tx.send(ShardMsg::Batch(reqs)).await {
                let ShardMsg::Batch(reqs) = msg else {
                    unreachable!("the message sent was a batch")
                };
                for r in reqs {
                    let _ = r
                        .reply
                        .send(Err(KvError::Unavailable("the KN is stopping".into())));
                }
            }
        }
    }

    async fn cell_of(&self, key: &Bytes, map_version: u64) -> KvResult<u64> {
        {
            let cells = self.cells.read();
            if cells.0 == map_version {
                if let Some(&off) = cells.1.get(key) {
                    return Ok(off);
                }
            }
        }
        match self.link.cell_of(key).await? {
            Some(off) => {
                let mut cells = self.cells.write();
                if cells.0 == map_version {
                    cells.1.insert(key.clone(), off);
                }
                Ok(off)
            }
            None => Err(KvError::Unavailable(
                "the replicated key's indirect cell is not installed yet".into(),
            )),
        }
    }

    pub fn stats(&self, top: usize) -> NodeStats {
        let mut s = NodeStats {
            wrong_owner: self.wrong_owner.load(Ordering::Relaxed),
            ..Default::default()
        };
        let mut tops = Vec::new();
        for sh in &self.shards {
            let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
            s.gets += r(&sh.stats.gets);
            s.puts += r(&sh.stats.puts);
            s.deletes += r(&sh.stats.deletes);
            s.value_hits += r(&sh.stats.value_hits);
            s.shortcut_hits += r(&sh.stats.shortcut_hits);
            s.unmerged_hits += r(&sh.stats.unmerged_hits);
            s.misses += r(&sh.stats.misses);
            s.batches += r(&sh.stats.batches);
            let f = sh.fabric.stats().snapshot();
            s.round_trips += f.round_trips;
            s.bytes_read += f.bytes_read;
            s.bytes_written += f.bytes_written;
            let c = sh.cache_stats.lock().clone();
            s.cache_values += c.values as u64;
            s.cache_shortcuts += c.shortcuts as u64;
            s.promotions += c.promotions;
            s.demotions += c.demotions;
            tops.extend(sh.top.lock().top(top));
        }
        tops.sort_by_key(|t| std::cmp::Reverse(t.1));
        tops.truncate(top);
        s.top_keys = tops;
        s.occupancy = *self.occupancy.read();
        s
    }

    /// A clean stop: refuses new requests, then has every shard finish the requests it was
    /// given, write out its open batch and seal its log, and waits for that (at most
    /// [`SHUTDOWN_WAIT`]). Returns false if some shard did not finish in time (its log is then
    /// left for a MergeAll). Requests after this answer UNAVAILABLE.
    pub async fn shutdown(&self) -> bool {
        self.stopping.store(true, Ordering::Release);
        let all = async {
            // Wait out the admitted requests: each holds the gate until it is queued at its
            // shard, and a shard handles its queue in order, so the Stop comes after them.
            drop(self.gate.write().await);
            let mut acks = Vec::new();
            for sh in &self.shards {
                let (tx, rx) = oneshot::channel();
                if sh.tx.send(ShardMsg::Stop(tx)).await.is_ok() {
                    acks.push(rx);
                }
            }
            for a in acks {
                let _ = a.await;
            }
        };
        let done = tokio::time::timeout(SHUTDOWN_WAIT, all).await.is_ok();
        if !done {
            tracing::warn!(
                "the shards did not seal their logs within {SHUTDOWN_WAIT:?}; stopping anyway"
            );
        }
        done
    }
}

/// The reconfiguration record's name (client::admin::RECONFIGURATION_KEY).
const RECONFIGURATION_KEY: &str = "cluster/reconfiguration";
/// Its Prepare phase (client::admin::IntentPhase).
const INTENT_PREPARE: u8 = 1;

/// The phase and target map of a reconfiguration record (format 1, laid out in
/// `client::admin::Intent`): None if it is of another format or unreadable.
fn recorded_change(b: &[u8]) -> Option<(u8, ClusterMap)> {
    let u32_at = |o: usize| -> Option<usize> {
        Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?) as usize)
    };
    if *b.first()? != 1 {
        return None;
    }
    let phase = *b.get(1)?;
    let mut o = 18;
    o += 4 + 4 * u32_at(o)?; // the dead KNs
    o += 4 + u32_at(o)?; // the current map
    let len = u32_at(o)?;
    let next = ClusterMap::decode(b.get(o + 4..o + 4 + len)?).ok()?;
    Some((phase, next))
}

/// Bounds a KN's prepared state: a transition older than `prepare_timeout` is settled with
/// the DPM ([`KvNode::settle_transition`], withdrawing it if it is not past its point of no
/// return); if it must still complete, it is checked again after as long.
async fn expire_transitions(node: std::sync::Weak<KvNode>) {
    loop {
        let Some(n) = node.upgrade() else { return };
        let bound = n.config.prepare_timeout;
        let t = n.transition.read().clone();
        if let Some(t) = t {
            if n.transition_since.read().elapsed() >= bound {
                match n.settle_transition(t.clone(), true).await {
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::info!(
                            prepared_for = t.version,
                            "map change past its point of no return: waiting for its map"
                        );
                        *n.transition_since.write() = Instant::now();
                    }
                    Err(e) => tracing::warn!(error = %e, "cannot settle the map transition yet"),
                }
            }
        }
        drop(n);
        tokio::time::sleep((bound / 4).clamp(Duration::from_millis(5), Duration::from_millis(500)))
            .await;
    }
}

async fn watch_map(node: std::sync::Weak<KvNode>) {
    loop {
        let Some(n) = node.upgrade() else { return };
        let every = n.config.map_poll;
        let started = Instant::now();
        // Not a plain map read: the DPM confirms that this KN is not fenced (lease module).
        match n.link.confirm_serving(n.link.generation()).await {
            Ok(Some(b)) => match ClusterMap::decode(&b) {
                Ok(m) => {
                    n.install_map(m).await;
                    n.lease.confirm(started);
                }
                Err(e) => tracing::warn!(error = %e, "the published cluster map does not decode"),
            },
            Ok(None) => n.lease.confirm(started),
            Err(e) => tracing::debug!(error = %e, "cannot read the cluster map"),
        }
        drop(n);
        tokio::time::sleep(every).await;
    }
}

/// CPU time (user + system) this process has used so far.
fn process_cpu() -> Duration {
    // SAFETY: getrusage fills the struct we pass and has no other effect.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return Duration::ZERO;
    }
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Occupancy, as DINOMO defines it: the CPU working time of the KN per epoch (one second),
/// as a share of the CPU it can use (its runtime's worker threads, at most the machine's
/// cores). It counts everything the KN does for its requests (gRPC included); the shards' own
/// busy share is exported as `dinomo_kn_shard_busy`.
async fn measure_occupancy(node: std::sync::Weak<KvNode>) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let mut last: Option<(Instant, u64, Duration)> = None;
    loop {
        let Some(n) = node.upgrade() else { return };
        let busy: u64 = n
            .shards
            .iter()
            .map(|s| s.stats.busy_ns.load(Ordering::Relaxed))
            .sum();
        let cpu = process_cpu();
        let now = Instant::now();
        if let Some((t, b, c)) = last {
            let elapsed = now.duration_since(t).as_secs_f64();
            let wall = elapsed * 1e9 * n.shards.len() as f64;
            let shard_busy = ((busy - b) as f64 / wall).clamp(0.0, 1.0);
            metrics::gauge!("dinomo_kn_shard_busy").set(shard_busy);
            let occ = ((cpu.saturating_sub(c)).as_secs_f64() / (elapsed * cores)).clamp(0.0, 1.0);
            *n.occupancy.write() = occ;
            metrics::gauge!("dinomo_kn_occupancy").set(occ);
            let s = n.stats(0);
            metrics::gauge!("dinomo_kn_gets").set(s.gets as f64);
            metrics::gauge!("dinomo_kn_puts").set(s.puts as f64);
            metrics::gauge!("dinomo_kn_deletes").set(s.deletes as f64);
            metrics::gauge!("dinomo_kn_value_hits").set(s.value_hits as f64);
            metrics::gauge!("dinomo_kn_shortcut_hits").set(s.shortcut_hits as f64);
            metrics::gauge!("dinomo_kn_unmerged_hits").set(s.unmerged_hits as f64);
            metrics::gauge!("dinomo_kn_misses").set(s.misses as f64);
            metrics::gauge!("dinomo_kn_wrong_owner").set(s.wrong_owner as f64);
            metrics::gauge!("dinomo_kn_batches").set(s.batches as f64);
            metrics::gauge!("dinomo_kn_fabric_round_trips").set(s.round_trips as f64);
            metrics::gauge!("dinomo_kn_fabric_bytes_read").set(s.bytes_read as f64);
            metrics::gauge!("dinomo_kn_fabric_bytes_written").set(s.bytes_written as f64);
            metrics::gauge!("dinomo_kn_cache_values").set(s.cache_values as f64);
            metrics::gauge!("dinomo_kn_cache_shortcuts").set(s.cache_shortcuts as f64);
        }
        last = Some((now, busy, cpu));
        drop(n);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
