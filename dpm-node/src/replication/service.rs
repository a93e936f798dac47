//! ReplicaService over gRPC, for each role a dpm-node can have: a primary with backups, a
//! primary without (answers Status only), and a backup.

use std::sync::Arc;

use dinomo_proto::dpm as pb;
use dinomo_proto::dpm::replica_service_server::ReplicaService;
use tonic::{Request, Response, Status};

use super::backup::Incremental;
use super::digest;
use super::image::Claim;
use super::{Backup, Phase, Primary};
use crate::service::to_status;

/// The role this node answers ReplicaService as.
#[derive(Debug, Clone)]
pub enum ReplicaGrpc {
    /// A primary started without backups: replication is off.
    Standalone,
    Primary(Arc<Primary>),
    Backup(Arc<Backup>),
}

fn not_a_backup() -> Status {
    Status::failed_precondition(
        "this dpm-node is a primary, not a backup: only a node started with --role backup \
         takes a primary's writes",
    )
}

impl ReplicaGrpc {
    async fn status_now(&self) -> pb::ReplicaStatusResponse {
        let pid = std::process::id();
        match self {
            ReplicaGrpc::Standalone => pb::ReplicaStatusResponse {
                role: "primary".into(),
                pid,
                ..Default::default()
            },
            ReplicaGrpc::Primary(p) => pb::ReplicaStatusResponse {
                role: "primary".into(),
                term: p.term(),
                primary: String::new(),
                backups: p
                    .backups()
                    .into_iter()
                    .map(|b| pb::BackupState {
                        address: b.address,
                        state: if b.leaving {
                            "leaving".into()
                        } else {
                            b.phase.name().into()
                        },
                        detail: match &b.phase {
                            Phase::Failed { why, .. } => why.clone(),
                            _ if b.awaiting_copy_complete => "caught up; waiting for the backup \
                                to record its copy complete (CopyComplete, retried until it \
                                answers)"
                                .into(),
                            _ => String::new(),
                        },
                        behind_records: b.behind_records,
                        behind_bytes: b.behind_bytes,
                        bytes_sent: b.bytes_sent,
                        resync_bytes: b.resync_bytes,
                        resync_ms: b.resync_ms.unwrap_or(0),
                        resync_skipped_bytes: b.resync_skipped_bytes,
                    })
                    .chain(
                        p.attaching()
                            .into_iter()
                            .map(|(address, why)| pb::BackupState {
                                address,
                                state: "attaching".into(),
                                detail: why,
                                ..Default::default()
                            }),
                    )
                    .collect(),
                pid,
                generation: p.image().generation,
                ..Default::default()
            },
            ReplicaGrpc::Backup(b) => {
                let (copy_state, copy_term) = match b.copy_marker().await {
                    Ok(Some(m)) => (m.state.as_str().to_string(), m.term),
                    Ok(None) => ("none".to_string(), 0),
                    Err(e) => (format!("unreadable: {e}"), 0),
                };
                let accepted = b.accepted().await;
                let not_promotable = if copy_state == "complete" {
                    b.pin_refusal().await.unwrap_or_default()
                } else {
                    String::new()
                };
                pb::ReplicaStatusResponse {
                    role: "backup".into(),
                    term: accepted.term,
                    primary: b.primary().await,
                    backups: Vec::new(),
                    pid,
                    copy_state,
                    copy_term,
                    generation: accepted.generation,
                    not_promotable,
                }
            }
        }
    }

    fn primary(&self) -> Result<&Arc<Primary>, Status> {
        match self {
            ReplicaGrpc::Primary(p) => Ok(p),
            ReplicaGrpc::Standalone => Err(Status::failed_precondition(
                "replication is off on this dpm-node: start it with --backup ADDRESS (and the \
                 tcp fabric) to replicate its pool",
            )),
            ReplicaGrpc::Backup(_) => Err(Status::failed_precondition(
                "this dpm-node is a backup: ask its primary",
            )),
        }
    }
}

#[tonic::async_trait]
impl ReplicaService for ReplicaGrpc {
    async fn attach(
        &self,
        req: Request<pb::AttachRequest>,
    ) -> Result<Response<pb::AttachResponse>, Status> {
        let ReplicaGrpc::Backup(b) = self else {
            return Err(not_a_backup());
        };
        let r = req.into_inner();
        // chunk_bytes 0: an older primary, which expects a pool that starts from zeroes.
        let incremental = match r.chunk_bytes {
            0 => None,
            chunk_bytes => Some(Incremental {
                chunk_bytes,
                key: r.digest_key.as_slice().try_into().map_err(|_| {
                    Status::invalid_argument(format!(
                        "a digest key of {} bytes: expected {}",
                        r.digest_key.len(),
                        digest::KEY_BYTES
                    ))
                })?,
            }),
        };
        let a = b
            .attach(
                r.term,
                r.instance,
                Claim {
                    term: r.image_term,
                    instance: r.image_instance,
                    generation: r.image_generation,
                },
                r.previous_term.zip(r.previous_instance),
                r.pool_bytes,
                &r.primary,
                incremental,
            )
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::AttachResponse {
            fabric: a.fabric,
            slot: a.key.slot,
            generation: a.key.generation,
            secret: a.key.secret.to_vec(),
            copy: a.copy,
            chunk_digests: a.chunk_digests,
        }))
    }

    async fn copy_complete(
        &self,
        req: Request<pb::CopyCompleteRequest>,
    ) -> Result<Response<pb::CopyCompleteResponse>, Status> {
        let ReplicaGrpc::Backup(b) = self else {
            return Err(not_a_backup());
        };
        let r = req.into_inner();
        b.copy_complete(r.term, r.instance, r.copy, r.generation)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::CopyCompleteResponse {}))
    }

    async fn record_generation(
        &self,
        req: Request<pb::RecordGenerationRequest>,
    ) -> Result<Response<pb::RecordGenerationResponse>, Status> {
        let ReplicaGrpc::Backup(b) = self else {
            return Err(not_a_backup());
        };
        let r = req.into_inner();
        b.record_generation(r.term, r.instance, r.generation)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::RecordGenerationResponse {}))
    }

    async fn status(
        &self,
        _req: Request<pb::ReplicaStatusRequest>,
    ) -> Result<Response<pb::ReplicaStatusResponse>, Status> {
        Ok(Response::new(self.status_now().await))
    }

    async fn add_backup(
        &self,
        req: Request<pb::BackupRequest>,
    ) -> Result<Response<pb::ReplicaStatusResponse>, Status> {
        let p = self.primary()?;
        let address = req.into_inner().address;
        p.add_backup(&address).await.map_err(to_status)?;
        Ok(Response::new(self.status_now().await))
    }

    async fn promote(
        &self,
        req: Request<pb::PromoteRequest>,
    ) -> Result<Response<pb::PromoteResponse>, Status> {
        let ReplicaGrpc::Backup(b) = self else {
            // ALREADY_EXISTS, not a refusal that changed nothing: it may be the backup an
            // earlier Promote turned into the primary.
            return Err(Status::already_exists(
                "this dpm-node is not a backup (any more): only a backup can be promoted; it \
                 may have been promoted by an earlier call",
            ));
        };
        let r = req.into_inner();
        let (accepted_term, copy_term) =
            b.promote(r.backups, r.min_term).await.map_err(to_status)?;
        Ok(Response::new(pb::PromoteResponse {
            accepted_term,
            copy_term,
        }))
    }

    async fn remove_backup(
        &self,
        req: Request<pb::BackupRequest>,
    ) -> Result<Response<pb::ReplicaStatusResponse>, Status> {
        let p = self.primary()?;
        let address = req.into_inner().address;
        if !p.remove_backup(&address).await.map_err(to_status)? {
            return Err(Status::not_found(format!(
                "{address} is not a backup of this primary"
            )));
        }
        Ok(Response::new(self.status_now().await))
    }
}
