//! DpmService over gRPC: decoding requests, calling [`Dpm`], and the one place where a
//! [`DpmError`] becomes a `tonic::Status`. Blocking work (merging, allocation, PM persists)
//! runs on the blocking pool so the runtime keeps serving. Sizes ([`crate::limits`]: metadata
//! names and values, KN endpoints) are checked on arrival, before any lock; ListMetadata
//! answers at most [`crate::limits::MAX_LIST_BYTES`].
//!
//! The calls a reconfiguration makes (metadata writes, FenceKn, MergeAll, cell changes) run
//! under the caller's monitor term when the request carries one in the [`MONITOR_TERM_HEADER`]
//! header (see dpm.proto, "Monitor terms"): a deposed monitor's call is refused before it
//! does anything. Calls without the header are not checked.

use std::sync::Arc;
use std::time::Instant;

use dinomo_proto::dpm as pb;
use dinomo_proto::dpm::dpm_service_server::DpmService;
use tonic::{Request, Response, Status};

use crate::config::FabricKind;
use crate::dpm::Dpm;
use crate::error::DpmError;
use crate::limits;

/// The request header carrying the caller's monitor term (ASCII decimal), see dpm.proto.
pub const MONITOR_TERM_HEADER: &str = "dinomo-monitor-term";

/// The metadata entry a KN may delete, to withdraw a reconfiguration whose prepare bound
/// passed (`KvNode::settle_transition`); every other write is the monitor's.
const RECONFIGURATION_RECORD: &str = "cluster/reconfiguration";

/// Whether `record` is a reconfiguration record (`client::admin::Intent`: format byte 1, then
/// the phase byte) in its Prepare phase (1). The compare-and-swap then deletes exactly that
/// record, so a node can never delete one in its Commit phase.
fn is_prepare_phase_record(record: Option<&[u8]>) -> bool {
    const INTENT_FORMAT: u8 = 1;
    const PREPARE: u8 = 1;
    matches!(record, Some([INTENT_FORMAT, PREPARE, ..]))
}

/// Whether the caller proved role `node` (never true without TLS: no caller is known then).
fn is_node<T>(req: &Request<T>) -> bool {
    dinomo_security::access::caller_of(req).is_some_and(|c| c.role == dinomo_security::Role::Node)
}

/// The monitor term a request carries, if any.
fn monitor_term<T>(req: &Request<T>) -> Result<Option<u64>, Status> {
    let Some(v) = req.metadata().get(MONITOR_TERM_HEADER) else {
        return Ok(None);
    };
    v.to_str()
        .ok()
        .and_then(|t| t.parse::<u64>().ok())
        .map(Some)
        .ok_or_else(|| {
            Status::invalid_argument(format!(
                "the {MONITOR_TERM_HEADER} header must be a decimal term, got {v:?}"
            ))
        })
}

/// Maps library errors to gRPC statuses with messages that say what to do.
pub fn to_status(e: DpmError) -> Status {
    let msg = e.to_string();
    match e {
        DpmError::Fenced { .. } => {
            Status::permission_denied(format!("{msg}; re-register to get a new epoch"))
        }
        DpmError::StaleMonitorTerm { .. } => Status::permission_denied(msg),
        DpmError::MetadataChanged { .. } | DpmError::MapNotByCas(_) => {
            Status::failed_precondition(msg)
        }
        // Not FAILED_PRECONDITION (a KN reads that as "register again"): it must wait.
        DpmError::FencedUnderMap { .. } => Status::unavailable(msg),
        DpmError::UnknownKn { .. } | DpmError::NoSession { .. } => {
            Status::failed_precondition(format!("{msg}; call RegisterKn first"))
        }
        DpmError::KnOutOfRange { .. }
        | DpmError::InvalidArgument(_)
        | DpmError::MapVersion { .. }
        | DpmError::BadSegment { .. } => Status::invalid_argument(msg),
        DpmError::PoolFull { .. }
        | DpmError::CellsFull { .. }
        | DpmError::MetadataFull { .. }
        | DpmError::MetadataTooLarge { .. } => Status::resource_exhausted(msg),
        DpmError::StaleTerm { .. }
        | DpmError::StaleCopy { .. }
        | DpmError::StaleImage { .. }
        | DpmError::SupersededImage { .. }
        | DpmError::NotPromotable { .. } => Status::failed_precondition(msg),
        DpmError::BeingPromoted => Status::already_exists(msg),
        DpmError::Replication(_) | DpmError::CellsChurning { .. } => Status::unavailable(msg),
        _ => Status::internal(msg),
    }
}

#[derive(Debug, Clone)]
pub struct DpmGrpc {
    dpm: Arc<Dpm>,
    /// What KNs are told to use to reach the pool.
    fabric_kind: FabricKind,
    fabric_address: String,
    /// KNs store into the pool without this node's CPU (shm, verbs) and the pool is
    /// replicated: they forward each write (ForwardWrites) before acknowledging it.
    forward_writes: bool,
}

impl DpmGrpc {
    pub fn new(dpm: Arc<Dpm>, fabric_kind: FabricKind, fabric_address: String) -> Self {
        let forward_writes = !dpm.config.backups.is_empty() && fabric_kind != FabricKind::Tcp;
        DpmGrpc {
            dpm,
            fabric_kind,
            fabric_address,
            forward_writes,
        }
    }

    /// Runs `f` on the blocking pool, then waits for the backups ([`DpmGrpc::replicated`]).
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Dpm) -> Result<T, DpmError> + Send + 'static,
    ) -> Result<T, Status> {
        let out = self.blocking_local(f).await?;
        self.replicated().await?;
        Ok(out)
    }

    /// Runs `f` on the blocking pool (the caller waits for the backups itself).
    async fn blocking_local<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Dpm) -> Result<T, DpmError> + Send + 'static,
    ) -> Result<T, Status> {
        let dpm = self.dpm.clone();
        tokio::task::spawn_blocking(move || f(&dpm))
            .await
            .map_err(|e| Status::internal(format!("DPM task failed: {e}")))?
            .map_err(to_status)
    }

    /// Waits until what this node persisted so far is at every backup that must acknowledge
    /// (at once without replication): an answer never reports, or shows, a change that the
    /// primary's loss could still take back.
    async fn replicated(&self) -> Result<(), Status> {
        self.dpm
            .pool()
            .region()
            .mirror_barrier()
            .await
            .map_err(|e| {
                Status::unavailable(format!(
                    "the memory node's backups did not acknowledge ({e}); the outcome is unknown"
                ))
            })
    }
}

#[tonic::async_trait]
impl DpmService for DpmGrpc {
    async fn register_kn(
        &self,
        req: Request<pb::RegisterKnRequest>,
    ) -> Result<Response<pb::RegisterKnResponse>, Status> {
        let r = req.into_inner();
        limits::check_endpoint(&r.endpoint).map_err(to_status)?;
        if self.forward_writes && !r.forwards_writes {
            // A KN built before ForwardWrites existed would ignore `forward_writes` in the
            // answer and acknowledge writes that are on this node alone.
            return Err(Status::failed_precondition(
                "this memory node is replicated and its fabric is one-sided: its KNs must \
                 forward what they store (ForwardWrites), and this KN does not say it does \
                 (built before forwarding existed?); upgrade the KN",
            ));
        }
        let reg = self
            .blocking(move |d| {
                // A pid means something here only within the dpm-node's own pid namespace.
                let same_ns = r.pid_namespace != 0
                    && Some(r.pid_namespace) == dinomo_node_common::process::pid_namespace();
                if r.pid != 0 && !same_ns {
                    tracing::warn!(
                        pid = r.pid,
                        endpoint = %r.endpoint,
                        "the KN's process is in another pid namespace: it cannot be watched, so \
                         if it is fenced while still running (shm), its segments may be reused"
                    );
                }
                let pid = (r.pid != 0 && same_ns).then_some(r.pid);
                d.register_kn_process(r.kn_id, &r.endpoint, pid)
            })
            .await?;
        let kind = match self.fabric_kind {
            FabricKind::Shm => pb::FabricKind::Shm,
            FabricKind::Tcp => pb::FabricKind::Tcp,
            FabricKind::Verbs => pb::FabricKind::Verbs,
        };
        Ok(Response::new(pb::RegisterKnResponse {
            kn_id: reg.kn_id,
            epoch: reg.epoch,
            fabric: Some(pb::FabricInfo {
                kind: kind as i32,
                address: self.fabric_address.clone(),
                grant_slot: reg.key.slot,
                grant_generation: reg.key.generation,
                grant_secret: reg.key.secret.to_vec(),
            }),
            pool_len: reg.pool_len,
            segment_size: reg.segment_size,
            index_root: reg.index_root,
            forward_writes: self.forward_writes,
        }))
    }

    async fn forward_writes(
        &self,
        req: Request<pb::ForwardWritesRequest>,
    ) -> Result<Response<pb::ForwardWritesResponse>, Status> {
        let r = req.into_inner();
        let ranges = limits::check_forwarded_ranges(
            r.ranges.iter().map(|g| (g.offset, g.len)),
            self.dpm.pool().region().len(),
            self.dpm.pool().superblock().segment_size,
        )
        .map_err(to_status)?;
        let kn = r.kn_id;
        let d = &self.dpm;
        // The session must be this process's: a KN that stored into another primary's pool
        // (shm, not knowing of a failover) must not hear its batch is at these backups.
        if let Err(e) = d.check_session(kn, r.epoch) {
            metrics::counter!("dinomo_dpm_forwards_refused_total").increment(1);
            return Err(to_status(e));
        }
        metrics::counter!("dinomo_dpm_forwards_total").increment(1);
        metrics::counter!("dinomo_dpm_forwarded_bytes_total")
            .increment(ranges.iter().map(|&(_, len)| len).sum());
        // Recorded with their current bytes, after everything persisted before: what the KN
        // stored (or read in a cell) reaches the backups in order with the rest. On this
        // thread, as the tcp NIC records a post it applied: a persist of a batch is a flush
        // and a copy into the mirror's queues (never waiting for room on a runtime thread:
        // the barrier below bounds what one call queues).
        let mut in_segments = Vec::new();
        for (offset, len) in ranges {
            d.pool()
                .region()
                .persist(offset, len)
                .map_err(|e| to_status(e.into()))?;
            if let Some(s) = d.forwarded_segment(kn, offset, len) {
                in_segments.push(s);
            }
        }
        self.replicated().await?;
        // At the backups now: a merge of these batches need not ship them again.
        for (segment, generation, offset, end) in in_segments {
            self.dpm
                .merger()
                .note_forwarded(segment, generation, offset, end);
        }
        Ok(Response::new(pb::ForwardWritesResponse {}))
    }

    async fn allocate_segment(
        &self,
        req: Request<pb::AllocateSegmentRequest>,
    ) -> Result<Response<pb::AllocateSegmentResponse>, Status> {
        let r = req.into_inner();
        let stream = u16::try_from(r.stream).map_err(|_| {
            Status::invalid_argument(format!("stream {} is out of range (0..65536)", r.stream))
        })?;
        let (kn, epoch) = (r.kn_id, r.epoch);
        let g = self
            .blocking_local(move |d| d.allocate_segment(kn, stream, epoch, r.deletes_only))
            .await?;
        if let Err(status) = self.replicated().await {
            // The KN never hears of this segment: seal it, or its log's merge would stop at
            // an open segment no one writes (as the DPM's own error paths do).
            let id = g.segment_id;
            if let Err(e) = self
                .blocking_local(move |d| d.seal_segment(kn, epoch, id))
                .await
            {
                tracing::warn!(kn, segment = id, error = %e, "sealing a segment whose allocation was not acknowledged");
            }
            return Err(status);
        }
        Ok(Response::new(pb::AllocateSegmentResponse {
            segment_id: g.segment_id,
            offset: g.offset,
            len: g.len,
            chain_seq: g.chain_seq,
            first_batch: g.first_batch,
            chain_seed: g.chain_seed,
        }))
    }

    async fn seal_segment(
        &self,
        req: Request<pb::SealSegmentRequest>,
    ) -> Result<Response<pb::SealSegmentResponse>, Status> {
        let r = req.into_inner();
        let (pending, ids) = self
            .blocking(move |d| {
                let n = d.seal_segment(r.kn_id, r.epoch, r.segment_id)?;
                Ok((n, d.pending_segment_ids(r.kn_id)))
            })
            .await?;
        Ok(Response::new(pb::SealSegmentResponse {
            pending_segments: pending,
            pending_ids: ids,
        }))
    }

    async fn pending_segments(
        &self,
        req: Request<pb::PendingSegmentsRequest>,
    ) -> Result<Response<pb::PendingSegmentsResponse>, Status> {
        let kn = req.into_inner().kn_id;
        let pending_ids = self.dpm.pending_segment_ids(kn);
        self.replicated().await?;
        Ok(Response::new(pb::PendingSegmentsResponse { pending_ids }))
    }

    async fn confirm_serving(
        &self,
        req: Request<pb::ConfirmServingRequest>,
    ) -> Result<Response<pb::GetMetadataResponse>, Status> {
        let r = req.into_inner();
        let value = self
            .blocking(move |d| d.confirm_serving(r.kn_id, r.epoch))
            .await?;
        Ok(Response::new(pb::GetMetadataResponse { value }))
    }

    async fn merge_all(
        &self,
        req: Request<pb::MergeAllRequest>,
    ) -> Result<Response<pb::MergeAllResponse>, Status> {
        let term = monitor_term(&req)?;
        let r = req.into_inner();
        let start = Instant::now();
        let rep = self
            .blocking(move |d| d.with_monitor_term(term, |d| d.merge_all(r.kn_id, r.seal_open)))
            .await?;
        let micros = start.elapsed().as_micros() as u64;
        metrics::histogram!("dinomo_dpm_merge_all_seconds").record(start.elapsed().as_secs_f64());
        Ok(Response::new(pb::MergeAllResponse {
            segments: rep.segments,
            batches: rep.batches,
            entries: rep.entries,
            invalid_tails: rep.invalid_tails,
            micros,
        }))
    }

    async fn fence_kn(
        &self,
        req: Request<pb::FenceKnRequest>,
    ) -> Result<Response<pb::FenceKnResponse>, Status> {
        let term = monitor_term(&req)?;
        let kn = req.into_inner().kn_id;
        self.blocking(move |d| d.with_monitor_term(term, |d| d.fence_kn(kn)))
            .await?;
        Ok(Response::new(pb::FenceKnResponse {}))
    }

    async fn install_indirect_cell(
        &self,
        req: Request<pb::IndirectCellRequest>,
    ) -> Result<Response<pb::IndirectCellResponse>, Status> {
        let term = monitor_term(&req)?;
        if is_node(&req) && !req.get_ref().lookup_only {
            return Err(Status::permission_denied(
                "a node may only look indirect cells up (lookup_only = true); installing one \
                 needs role monitor",
            ));
        }
        let req = req.into_inner();
        let key = req.key;
        if key.is_empty() {
            return Err(Status::invalid_argument("key must not be empty"));
        }
        if req.lookup_only {
            return match self.dpm.cell_of(&key) {
                Some(off) => Ok(Response::new(pb::IndirectCellResponse { cell_offset: off })),
                None => Err(Status::not_found("the key has no indirect cell")),
            };
        }
        let off = self
            .blocking(move |d| d.with_monitor_term(term, |d| d.install_cell(&key)))
            .await?;
        Ok(Response::new(pb::IndirectCellResponse { cell_offset: off }))
    }

    async fn remove_indirect_cell(
        &self,
        req: Request<pb::IndirectCellRequest>,
    ) -> Result<Response<pb::RemoveIndirectCellResponse>, Status> {
        let term = monitor_term(&req)?;
        let key = req.into_inner().key;
        let existed = self
            .blocking(move |d| d.with_monitor_term(term, |d| d.remove_cell(&key)))
            .await?;
        Ok(Response::new(pb::RemoveIndirectCellResponse { existed }))
    }

    async fn put_metadata(
        &self,
        req: Request<pb::PutMetadataRequest>,
    ) -> Result<Response<pb::PutMetadataResponse>, Status> {
        let term = monitor_term(&req)?;
        let r = req.into_inner();
        limits::check_metadata_write(&r.name, r.value.as_deref(), None).map_err(to_status)?;
        self.blocking(move |d| {
            d.with_monitor_term(term, |d| d.put_metadata(&r.name, r.value.as_deref()))
        })
        .await?;
        Ok(Response::new(pb::PutMetadataResponse {}))
    }

    async fn compare_and_put_metadata(
        &self,
        req: Request<pb::CompareAndPutMetadataRequest>,
    ) -> Result<Response<pb::PutMetadataResponse>, Status> {
        let term = monitor_term(&req)?;
        if is_node(&req) {
            let r = req.get_ref();
            if r.name != RECONFIGURATION_RECORD || r.value.is_some() {
                return Err(Status::permission_denied(format!(
                    "a node may only withdraw {RECONFIGURATION_RECORD:?} (delete it); writing \
                     {:?} needs role monitor",
                    r.name
                )));
            }
            if !is_prepare_phase_record(r.expected.as_deref()) {
                return Err(Status::permission_denied(
                    "a node may withdraw a reconfiguration only in its Prepare phase, named by \
                     the record it read (expected); past its point of no return only a monitor \
                     finishes it",
                ));
            }
        }
        let r = req.into_inner();
        limits::check_metadata_write(&r.name, r.value.as_deref(), r.expected.as_deref())
            .map_err(to_status)?;
        self.blocking(move |d| {
            d.with_monitor_term(term, |d| {
                d.compare_and_put_metadata(&r.name, r.expected.as_deref(), r.value.as_deref())
            })
        })
        .await?;
        Ok(Response::new(pb::PutMetadataResponse {}))
    }

    async fn new_monitor_term(
        &self,
        _req: Request<pb::NewMonitorTermRequest>,
    ) -> Result<Response<pb::NewMonitorTermResponse>, Status> {
        let term = self.blocking(|d| d.new_monitor_term()).await?;
        Ok(Response::new(pb::NewMonitorTermResponse { term }))
    }

    async fn get_metadata(
        &self,
        req: Request<pb::GetMetadataRequest>,
    ) -> Result<Response<pb::GetMetadataResponse>, Status> {
        let name = req.into_inner().name;
        let value = self.dpm.get_metadata(&name);
        self.replicated().await?;
        Ok(Response::new(pb::GetMetadataResponse { value }))
    }

    async fn list_metadata(
        &self,
        req: Request<pb::ListMetadataRequest>,
    ) -> Result<Response<pb::ListMetadataResponse>, Status> {
        let prefix = req.into_inner().prefix;
        let (entries, left_out) = self
            .dpm
            .list_metadata_bounded(&prefix, limits::MAX_LIST_BYTES);
        self.replicated().await?;
        let entries = entries
            .into_iter()
            .map(|(name, value)| pb::MetadataEntry { name, value })
            .collect();
        let mut resp = Response::new(pb::ListMetadataResponse { entries });
        // The proto has no paging: a listing over the bound stops in name order, and says
        // where (the name is ASCII, see limits; a name a header cannot carry is not named).
        if let Some(name) = left_out {
            tracing::warn!(
                %prefix,
                first_left_out = %name,
                max_bytes = limits::MAX_LIST_BYTES,
                "ListMetadata answer truncated"
            );
            let v = tonic::metadata::MetadataValue::try_from(name.as_str())
                .unwrap_or_else(|_| tonic::metadata::MetadataValue::from_static("?"));
            resp.metadata_mut().insert(limits::LIST_TRUNCATED_HEADER, v);
        }
        Ok(resp)
    }

    async fn stats(
        &self,
        _req: Request<pb::StatsRequest>,
    ) -> Result<Response<pb::StatsResponse>, Status> {
        let s = self.dpm.stats();
        Ok(Response::new(pb::StatsResponse {
            segments_total: s.segments_total,
            segments_free: s.segments_free,
            index_items: s.index_items,
            index_buckets: s.index_buckets,
            index_resizes: s.index_resizes,
            entries_merged: s.entries_merged,
            pending_segments: s.pending_segments.into_iter().collect(),
            durability: self.dpm.pool().durability().to_string(),
            pool_bytes: self.dpm.pool().superblock().pool_len,
            segment_size: self.dpm.pool().superblock().segment_size,
            live_log_bytes: s.live_log_bytes,
            index_bytes: s.index_space.bytes,
            segments_reserved: s.segments_reserved,
        }))
    }
}
