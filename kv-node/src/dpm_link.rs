//! The KN's link to the dpm-node: registration (epoch, fabric grant), segment allocation and
//! sealing, merge progress, and the cluster map of record (DPM metadata "cluster/map").
//!
//! Sessions: a registration gives this KN an epoch and a fabric grant (a [`Session`]). Both die
//! when the DPM restarts (its grant table is new), fences the KN, or forgets it. Every call
//! that finds its session dead (PERMISSION_DENIED / FAILED_PRECONDITION from the DPM, a fabric
//! post denied access) marks it lost; [`DpmLink::reregister`] then registers again under the
//! same id (the DPM merges the previous incarnation's log first) and bumps the session's
//! generation. Shards compare generations and start over (new fabric handle, empty caches and
//! logs) when it changed. Every call to the DPM has a deadline, so a DPM that hangs is an
//! error, not a stuck shard.
//!
//! Write windows: the grant lets the KN write only its open log segments (the DPM adds one to
//! the window before AllocateSegment answers and removes it on SealSegment) and CAS the
//! indirect-cell space; READ reaches the whole pool. A log WRITE outside fails with
//! `FabricError::OutsideWindow`, which the shard treats like any failed log WRITE (outcome
//! unknown, session lost, register again).
//!
//! Fabrics: the DPM says which one in its registration answer: shm (map the pool file), tcp
//! (its software NIC) or verbs (one-sided RDMA: an RC queue pair per shard, set up through the
//! DPM's side channel; only in a build with the `rdma` feature, else refused with an error
//! that says so).

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dinomo_fabric::shm::ShmFabric;
use dinomo_fabric::tcp::TcpFabric;
use dinomo_fabric::{AccessKey, DurabilityRequest, Fabric, FabricError};
use dinomo_proto::dpm as pb;
use dinomo_proto::dpm::dpm_service_client::DpmServiceClient;
use tonic::transport::Channel;

use crate::error::{KvError, KvResult};

/// The cluster map's name in the DPM's metadata.
pub const CLUSTER_MAP_KEY: &str = "cluster/map";

/// A log segment this KN may append to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub id: u64,
    pub offset: u64,
    pub len: u64,
    pub first_batch: u64,
    pub chain_seed: u32,
}

/// Most ranges one ForwardWrites call may carry (the DPM's limit).
pub const MAX_FORWARDED_RANGES: usize = 64;

/// How long a control call to the DPM may take (allocation and sealing are quick; a DPM that
/// does not answer in this time is treated as unreachable).
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Registration merges the previous incarnation's whole log first: it may take a while.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(120);

/// One registration: what the DPM granted.
#[derive(Debug, Clone)]
pub struct Session {
    pub epoch: u64,
    pub fabric: pb::FabricInfo,
    /// 1 for the first registration of this process, +1 for each re-registration.
    pub generation: u64,
    /// The pool is replicated and this fabric stores without the DPM's CPU (shm, verbs): every
    /// WRITE and CAS, and every indirect cell read, is forwarded ([`DpmLink::forward`]) before
    /// it counts.
    pub forward_writes: bool,
}

impl Session {
    /// The fabric access key of this session. A secret that is not 16 bytes (a dpm-node of
    /// another build) is an error here, not a key that can never match.
    pub fn access_key(&self) -> KvResult<AccessKey> {
        let secret = &self.fabric.grant_secret;
        let secret: [u8; 16] = secret.as_slice().try_into().map_err(|_| {
            KvError::Internal(format!(
                "the DPM granted a fabric secret of {} bytes, not 16: the dpm-node runs \
                 another build (fabric grant format 2 is needed)",
                secret.len()
            ))
        })?;
        Ok(AccessKey {
            slot: self.fabric.grant_slot,
            generation: self.fabric.grant_generation,
            secret,
        })
    }
}

#[derive(Debug)]
pub struct DpmLink {
    client: DpmServiceClient<Channel>,
    pub kn_id: u32,
    endpoint: String,
    session: parking_lot::RwLock<Session>,
    /// The session is known dead (see the module doc).
    lost: AtomicBool,
    /// One re-registration at a time.
    reregistering: tokio::sync::Mutex<()>,
    pub index_root: u64,
    pub segment_size: u64,
    /// The local RDMA device for the verbs fabric (`None`: `DINOMO_RDMA_DEVICE`, else the
    /// first).
    rdma_device: Option<String>,
}

fn unavailable(what: &str, s: tonic::Status) -> KvError {
    KvError::Unavailable(format!("DPM {what}: {} ({:?})", s.message(), s.code()))
}

/// The DPM's fabric address: a name (the dpm-node's advertised address, e.g. a Kubernetes
/// service) or an address; resolved at every connect, so a moved dpm-node is found again.
async fn resolve(address: &str) -> KvResult<std::net::SocketAddr> {
    tokio::time::timeout(CALL_TIMEOUT, tokio::net::lookup_host(address))
        .await
        .map_err(|_| KvError::Unavailable(format!("resolving {address:?} timed out")))?
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| {
            KvError::Unavailable(format!(
                "the DPM's fabric address {address:?} does not resolve"
            ))
        })
}

/// Runs one DPM call with a deadline.
async fn with_deadline<T>(
    what: &str,
    limit: Duration,
    call: impl std::future::Future<Output = Result<T, tonic::Status>>,
) -> Result<T, tonic::Status> {
    tokio::time::timeout(limit, call).await.unwrap_or_else(|_| {
        Err(tonic::Status::deadline_exceeded(format!(
            "no answer from the dpm-node to {what} in {} s",
            limit.as_secs()
        )))
    })
}

async fn register_once(
    client: &mut DpmServiceClient<Channel>,
    kn_id: Option<u32>,
    endpoint: &str,
) -> KvResult<pb::RegisterKnResponse> {
    with_deadline(
        "register",
        REGISTER_TIMEOUT,
        client.register_kn(pb::RegisterKnRequest {
            kn_id,
            endpoint: endpoint.to_string(),
            pid: std::process::id(),
            pid_namespace: dinomo_node_common::process::pid_namespace().unwrap_or(0),
            // It does, whenever the answer asks (`Shard::forward`).
            forwards_writes: true,
        }),
    )
    .await
    .map(|r| r.into_inner())
    .map_err(|s| unavailable("register", s))
}

/// A fabric handle and the session it was connected under ([`DpmLink::connect_fabric`]).
#[derive(Clone)]
pub struct SessionFabric {
    pub fabric: Arc<dyn Fabric>,
    pub generation: u64,
    /// Whether that session asks for every store to be forwarded (ForwardWrites).
    pub forward_writes: bool,
}

impl std::fmt::Debug for SessionFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionFabric")
            .field("generation", &self.generation)
            .field("forward_writes", &self.forward_writes)
            .finish_non_exhaustive()
    }
}

impl DpmLink {
    /// Connects to the dpm-node at `url` and registers (a new incarnation of) the KN.
    pub async fn register(
        security: &dinomo_security::Security,
        url: &str,
        kn_id: Option<u32>,
        endpoint: &str,
    ) -> KvResult<Self> {
        let channel = security
            .endpoint(url, dinomo_security::Service::Dpm)
            .map_err(|e| KvError::InvalidArgument(format!("bad dpm-node address {url:?}: {e}")))?
            .connect_timeout(Duration::from_secs(2))
            .connect()
            .await
            .map_err(|e| {
                KvError::Unavailable(format!("cannot reach the dpm-node at {url}: {e}"))
            })?;
        let mut client = DpmServiceClient::new(channel);
        let r = register_once(&mut client, kn_id, endpoint).await?;
        let fabric = r
            .fabric
            .ok_or_else(|| KvError::Internal("registration without fabric info".into()))?;
        Ok(DpmLink {
            client,
            kn_id: r.kn_id,
            endpoint: endpoint.to_string(),
            session: parking_lot::RwLock::new(Session {
                epoch: r.epoch,
                fabric,
                generation: 1,
                forward_writes: r.forward_writes,
            }),
            lost: AtomicBool::new(false),
            reregistering: tokio::sync::Mutex::new(()),
            index_root: r.index_root,
            segment_size: r.segment_size,
            rdma_device: None,
        })
    }

    /// Uses the local RDMA device `device` for the verbs fabric (`None`: `DINOMO_RDMA_DEVICE`,
    /// else the first device).
    pub fn with_rdma_device(mut self, device: Option<String>) -> Self {
        self.rdma_device = device;
        self
    }

    /// The current session.
    pub fn session(&self) -> Session {
        self.session.read().clone()
    }

    /// The current session's epoch.
    pub fn epoch(&self) -> u64 {
        self.session.read().epoch
    }

    /// The current session's generation (see the module doc).
    pub fn generation(&self) -> u64 {
        self.session.read().generation
    }

    /// Marks the session of `generation` dead (a later session is not affected).
    pub fn mark_lost(&self, generation: u64, why: &str) {
        // Under the session's read lock: a re-registration (write lock) cannot slip between
        // the generation check and the flag, and wipe a loss of the new session.
        let session = self.session.read();
        if session.generation == generation && !self.lost.swap(true, Ordering::AcqRel) {
            tracing::warn!(
                kn = self.kn_id,
                generation,
                why,
                "DPM session lost; re-registering"
            );
            metrics::counter!("dinomo_kn_sessions_lost_total").increment(1);
        }
    }

    /// Is the session known dead (and not replaced yet)?
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    /// Registers again under this KN's id if the session of `generation` is lost; returns the
    /// session to use (a newer one if another caller re-registered first).
    pub async fn reregister(&self, generation: u64) -> KvResult<Session> {
        let _one = self.reregistering.lock().await;
        let current = self.session();
        if current.generation != generation || !self.is_lost() {
            return Ok(current);
        }
        let mut client = self.client.clone();
        let r = register_once(&mut client, Some(self.kn_id), &self.endpoint).await?;
        let fabric = r
            .fabric
            .ok_or_else(|| KvError::Internal("registration without fabric info".into()))?;
        let next = Session {
            epoch: r.epoch,
            fabric,
            generation: current.generation + 1,
            forward_writes: r.forward_writes,
        };
        {
            let mut session = self.session.write();
            *session = next.clone();
            self.lost.store(false, Ordering::Release);
        }
        tracing::info!(
            kn = self.kn_id,
            epoch = next.epoch,
            generation = next.generation,
            "re-registered with the DPM"
        );
        metrics::counter!("dinomo_kn_reregistrations_total").increment(1);
        Ok(next)
    }

    /// Maps a DPM answer to a KN call: a fenced or forgotten session is marked lost.
    fn failed(&self, generation: u64, what: &str, s: tonic::Status) -> KvError {
        if matches!(
            s.code(),
            tonic::Code::PermissionDenied | tonic::Code::FailedPrecondition
        ) {
            self.mark_lost(generation, s.message());
        }
        unavailable(what, s)
    }

    /// A new fabric handle for the current session (one per shard, so round trips are counted
    /// per shard), with that session's generation and `forward_writes`: all three from one
    /// session, though another shard may register a newer one meanwhile.
    pub async fn connect_fabric(&self) -> KvResult<SessionFabric> {
        let session = self.session();
        let key = session.access_key()?;
        let fabric = &session.fabric;
        // A grant refused at connect means the session is dead (the DPM restarted or fenced
        // this KN): mark it, so it is registered again.
        let refused = |e: FabricError| {
            if e.is_revoked() {
                self.mark_lost(session.generation, "the fabric refused this KN's grant");
            }
            KvError::from(e)
        };
        let handle: Arc<dyn Fabric> = match fabric.kind() {
            pb::FabricKind::Shm => Arc::new(
                ShmFabric::connect(Path::new(&fabric.address), key, DurabilityRequest::Auto)
                    .map_err(refused)?,
            ),
            pb::FabricKind::Tcp => {
                let addr = resolve(&fabric.address).await?;
                Arc::new(
                    tokio::time::timeout(CALL_TIMEOUT, TcpFabric::connect(addr, key))
                        .await
                        .map_err(|_| {
                            KvError::Unavailable(format!(
                                "the DPM fabric at {addr} did not answer in {} s",
                                CALL_TIMEOUT.as_secs()
                            ))
                        })?
                        .map_err(refused)?,
                )
            }
            pb::FabricKind::Verbs => self.connect_verbs(&fabric.address, key, refused).await?,
            other => {
                return Err(KvError::Internal(format!(
                    "the DPM offers fabric {}, which this KN does not speak",
                    other.as_str_name()
                )))
            }
        };
        Ok(SessionFabric {
            fabric: handle,
            generation: session.generation,
            forward_writes: session.forward_writes,
        })
    }

    /// An RDMA queue pair to the DPM's verbs NIC, whose side channel is at `address`.
    #[cfg(feature = "rdma")]
    async fn connect_verbs(
        &self,
        address: &str,
        key: AccessKey,
        refused: impl FnOnce(FabricError) -> KvError,
    ) -> KvResult<Arc<dyn Fabric>> {
        let addr = resolve(address).await?;
        let f = tokio::time::timeout(
            CALL_TIMEOUT,
            dinomo_fabric::verbs::VerbsFabric::connect_on(self.rdma_device.as_deref(), addr, key),
        )
        .await
        .map_err(|_| {
            KvError::Unavailable(format!(
                "the DPM's verbs side channel at {addr} did not answer in {} s",
                CALL_TIMEOUT.as_secs()
            ))
        })?
        .map_err(refused)?;
        Ok(Arc::new(f))
    }

    #[cfg(not(feature = "rdma"))]
    async fn connect_verbs(
        &self,
        _address: &str,
        _key: AccessKey,
        _refused: impl FnOnce(FabricError) -> KvError,
    ) -> KvResult<Arc<dyn Fabric>> {
        Err(KvError::Internal(
            "the DPM offers the verbs fabric, but this kv-node was built without the `rdma` \
             cargo feature; rebuild it with `--features rdma` (or run the dpm-node with \
             --fabric tcp)"
                .into(),
        ))
    }

    /// The epoch of session `generation`, or an error if a newer session replaced it (the
    /// caller must start over on the new one).
    fn epoch_of(&self, generation: u64) -> KvResult<u64> {
        let s = self.session.read();
        if s.generation == generation {
            Ok(s.epoch)
        } else {
            Err(KvError::Unavailable(format!(
                "this KN re-registered with the DPM (session {generation} -> {}); retry",
                s.generation
            )))
        }
    }

    /// Has the DPM ship `ranges` (offset, length) of the pool, which this KN stored into or read
    /// an indirect cell from, to its backups, and returns once they hold them (only when the
    /// session says `forward_writes`). An error means the ranges may be on the primary alone:
    /// the write's outcome is unknown, and a cell read must not be answered.
    pub async fn forward(&self, generation: u64, ranges: &[(u64, u64)]) -> KvResult<()> {
        let epoch = self.epoch_of(generation)?;
        let ranges = ranges
            .iter()
            .map(|&(offset, len)| pb::PoolRange { offset, len })
            .collect();
        with_deadline(
            "forward writes",
            CALL_TIMEOUT,
            self.client
                .clone()
                .forward_writes(pb::ForwardWritesRequest {
                    kn_id: self.kn_id,
                    epoch,
                    ranges,
                }),
        )
        .await
        .map_err(|s| self.failed(generation, "forward writes", s))?;
        Ok(())
    }

    /// The next segment of log `stream` (one log per shard) in session `generation`.
    /// `deletes_only`: the shard will write only deletes into it (the DPM may grant it from
    /// its delete reserve). A full pool is [`KvError::ResourceExhausted`], with the DPM's
    /// explanation.
    pub async fn allocate(
        &self,
        generation: u64,
        stream: u16,
        deletes_only: bool,
    ) -> KvResult<Segment> {
        let epoch = self.epoch_of(generation)?;
        let r = with_deadline(
            "allocate",
            CALL_TIMEOUT,
            self.client
                .clone()
                .allocate_segment(pb::AllocateSegmentRequest {
                    kn_id: self.kn_id,
                    epoch,
                    stream: u32::from(stream),
                    deletes_only,
                }),
        )
        .await
        .map_err(|s| match s.code() {
            tonic::Code::ResourceExhausted => {
                KvError::ResourceExhausted(format!("DPM: {}", s.message()))
            }
            _ => self.failed(generation, "allocate", s),
        })?
        .into_inner();
        Ok(Segment {
            id: r.segment_id,
            offset: r.offset,
            len: r.len,
            first_batch: r.first_batch,
            chain_seed: r.chain_seed,
        })
    }

    /// Seals a segment of session `generation`; returns the ids of this KN's segments still
    /// unmerged.
    pub async fn seal(&self, generation: u64, segment: u64) -> KvResult<Vec<u64>> {
        let epoch = self.epoch_of(generation)?;
        Ok(with_deadline(
            "seal",
            CALL_TIMEOUT,
            self.client.clone().seal_segment(pb::SealSegmentRequest {
                kn_id: self.kn_id,
                epoch,
                segment_id: segment,
            }),
        )
        .await
        .map_err(|s| self.failed(generation, "seal", s))?
        .into_inner()
        .pending_ids)
    }

    pub async fn pending(&self) -> KvResult<Vec<u64>> {
        Ok(with_deadline(
            "pending segments",
            CALL_TIMEOUT,
            self.client
                .clone()
                .pending_segments(pb::PendingSegmentsRequest { kn_id: self.kn_id }),
        )
        .await
        .map_err(|s| unavailable("pending segments", s))?
        .into_inner()
        .pending_ids)
    }

    /// The offset of a replicated key's indirect cell (`None`: it has none yet).
    pub async fn cell_of(&self, key: &[u8]) -> KvResult<Option<u64>> {
        match with_deadline(
            "indirect cell",
            CALL_TIMEOUT,
            self.client
                .clone()
                .install_indirect_cell(pb::IndirectCellRequest {
                    key: key.to_vec(),
                    lookup_only: true,
                }),
        )
        .await
        {
            Ok(r) => Ok(Some(r.into_inner().cell_offset)),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(None),
            Err(s) => Err(unavailable("indirect cell", s)),
        }
    }

    /// Renews the serving lease of session `generation`: the encoded map of record (if any),
    /// given only while this KN is not fenced and was not fenced under that map (see the DPM's
    /// ConfirmServing). A fenced epoch marks the session lost; "fenced under this map" does
    /// not (registering again would not help: only the next map does).
    pub async fn confirm_serving(&self, generation: u64) -> KvResult<Option<Vec<u8>>> {
        let epoch = self.epoch_of(generation)?;
        Ok(with_deadline(
            "confirm serving",
            CALL_TIMEOUT,
            self.client
                .clone()
                .confirm_serving(pb::ConfirmServingRequest {
                    kn_id: self.kn_id,
                    epoch,
                }),
        )
        .await
        .map_err(|s| {
            if s.code() == tonic::Code::PermissionDenied {
                self.mark_lost(generation, s.message());
            }
            unavailable("confirm serving", s)
        })?
        .into_inner()
        .value)
    }

    /// The encoded cluster map of record, if one was published.
    pub async fn cluster_map(&self) -> KvResult<Option<Vec<u8>>> {
        Ok(with_deadline(
            "metadata",
            CALL_TIMEOUT,
            self.client.clone().get_metadata(pb::GetMetadataRequest {
                name: CLUSTER_MAP_KEY.into(),
            }),
        )
        .await
        .map_err(|s| unavailable("metadata", s))?
        .into_inner()
        .value)
    }
}
