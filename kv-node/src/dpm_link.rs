//! The KN's link to the dpm-node: registration (epoch, fabric grant), segment allocation and
//! sealing, merge progress, and the cluster map of record (DPM metadata "cluster/map").

use std::path::Path;
use std::sync::Arc;

use dinomo_fabric::shm::ShmFabric;
use dinomo_fabric::tcp::TcpFabric;
use dinomo_fabric::{AccessKey, DurabilityRequest, Fabric};
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

#[derive(Debug, Clone)]
pub struct DpmLink {
    client: DpmServiceClient<Channel>,
    pub kn_id: u32,
    pub epoch: u64,
    pub fabric: pb::FabricInfo,
    pub index_root: u64,
    pub segment_size: u64,
}

fn unavailable(what: &str, s: tonic::Status) -> KvError {
    KvError::Unavailable(format!("DPM {what}: {} ({:?})", s.message(), s.code()))
}

impl DpmLink {
    /// Connects to the dpm-node at `url` and registers (a new incarnation of) the KN.
    pub async fn register(url: &str, kn_id: Option<u32>, endpoint: &str) -> KvResult<Self> {
        let mut client = DpmServiceClient::connect(url.to_string())
            .await
            .map_err(|e| {
                KvError::Unavailable(format!("cannot reach the dpm-node at {url}: {e}"))
            })?;
        let r = client
            .register_kn(pb::RegisterKnRequest {
                kn_id,
                endpoint: endpoint.to_string(),
            })
            .await
            .map_err(|s| unavailable("register", s))?
            .into_inner();
        let fabric = r
            .fabric
            .ok_or_else(|| KvError::Internal("registration without fabric info".into()))?;
        Ok(DpmLink {
            client,
            kn_id: r.kn_id,
            epoch: r.epoch,
            fabric,
            index_root: r.index_root,
            segment_size: r.segment_size,
        })
    }

    pub fn access_key(&self) -> AccessKey {
        AccessKey {
            slot: self.fabric.grant_slot,
            token: self.fabric.grant_token,
        }
    }

    /// A new fabric handle (one per shard, so round trips are counted per shard).
    pub async fn connect_fabric(&self) -> KvResult<Arc<dyn Fabric>> {
        let key = self.access_key();
        match self.fabric.kind.as_str() {
            "shm" => Ok(Arc::new(ShmFabric::connect(
                Path::new(&self.fabric.address),
                key,
                DurabilityRequest::Auto,
            )?)),
            "tcp" => {
                let addr = self.fabric.address.parse().map_err(|e| {
                    KvError::Internal(format!("bad fabric address {:?}: {e}", self.fabric.address))
                })?;
                Ok(Arc::new(TcpFabric::connect(addr, key).await?))
            }
            other => Err(KvError::Internal(format!(
                "the DPM offers fabric {other:?}, which this KN does not speak"
            ))),
        }
    }

    /// The next segment of log `stream` (one log per shard). `deletes_only`: the shard will
    /// write only deletes into it (the DPM may grant it from its delete reserve). A full pool
    /// is [`KvError::ResourceExhausted`], with the DPM's explanation.
    pub async fn allocate(&self, stream: u16, deletes_only: bool) -> KvResult<Segment> {
        let r = self
            .client
            .clone()
            .allocate_segment(pb::AllocateSegmentRequest {
                kn_id: self.kn_id,
                epoch: self.epoch,
                stream: u32::from(stream),
                deletes_only,
            })
            .await
            .map_err(|s| match s.code() {
                tonic::Code::ResourceExhausted => {
                    KvError::ResourceExhausted(format!("DPM: {}", s.message()))
                }
                _ => unavailable("allocate", s),
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

    /// Seals a segment; returns the ids of this KN's segments still unmerged.
    pub async fn seal(&self, segment: u64) -> KvResult<Vec<u64>> {
        Ok(self
            .client
            .clone()
            .seal_segment(pb::SealSegmentRequest {
                kn_id: self.kn_id,
                epoch: self.epoch,
                segment_id: segment,
            })
            .await
            .map_err(|s| unavailable("seal", s))?
            .into_inner()
            .pending_ids)
    }

    pub async fn pending(&self) -> KvResult<Vec<u64>> {
        Ok(self
            .client
            .clone()
            .pending_segments(pb::PendingSegmentsRequest { kn_id: self.kn_id })
            .await
            .map_err(|s| unavailable("pending segments", s))?
            .into_inner()
            .pending_ids)
    }

    /// The offset of a replicated key's indirect cell (`None`: it has none yet).
    pub async fn cell_of(&self, key: &[u8]) -> KvResult<Option<u64>> {
        match self
            .client
            .clone()
            .install_indirect_cell(pb::IndirectCellRequest {
                key: key.to_vec(),
                lookup_only: true,
            })
            .await
        {
            Ok(r) => Ok(Some(r.into_inner().cell_offset)),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(None),
            Err(s) => Err(unavailable("indirect cell", s)),
        }
    }

    /// The encoded cluster map of record, if one was published.
    pub async fn cluster_map(&self) -> KvResult<Option<Vec<u8>>> {
        Ok(self
            .client
            .clone()
            .get_metadata(pb::GetMetadataRequest {
                name: CLUSTER_MAP_KEY.into(),
            })
            .await
            .map_err(|s| unavailable("metadata", s))?
            .into_inner()
            .value)
    }
}
