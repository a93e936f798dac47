//! Replication of the memory node (docs/decisions/0007-dpm-replication.md): a primary and
//! backups whose pools are byte mirrors of its own.
//!
//! The primary ships every persisted line of its pool to every backup, in one order, with
//! one-sided WRITEs over the tcp fabric ([`replicator`]); a backup's CPU applies nothing itself
//! ([`backup`]). KNs write their log batches to the primary's NIC as before; the NIC answers
//! a post only once its lines are at every backup in sync, and so does every control answer:
//! an acknowledged batch, metadata write or segment state is on every live replica. A backup's
//! pool is always a state a power failure of the primary could have left, so promoting it is
//! opening it as a primary (the recovery that runs after a power failure).
//!
//! Terms fence primaries: a primary takes the next term at start ([`Primary::start`]) and
//! attaches each backup with it; a backup refuses a term older than one it accepted.
//!
//! Replication needs the tcp fabric: on shm the KNs store into the pool file themselves and on
//! verbs the RNIC does, so the primary never sees their WRITEs to ship them.

pub mod backup;
pub mod replicator;
mod service;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use dinomo_fabric::AccessKey;
use dinomo_proto::dpm as pb;
use dinomo_proto::dpm::replica_service_client::ReplicaServiceClient;
use dinomo_security::Security;

pub use backup::Backup;
pub use replicator::{BackupStatus, Phase, Replicator, ReplicatorOptions};
pub use service::ReplicaGrpc;

use crate::dpm::Dpm;
use crate::error::{DpmError, Result};

/// A primary's replica set: its term and the replicator installed on its pool.
#[derive(Debug)]
pub struct Primary {
    dpm: Arc<Dpm>,
    term: u64,
    /// This node's gRPC address, as backups are told.
    address: String,
    security: Security,
    replicator: Arc<Replicator>,
}

impl Primary {
    /// Takes the next replica term and installs a replicator on `dpm`'s pool (no backup yet:
    /// [`Primary::add_backup`]).
    pub fn start(
        dpm: Arc<Dpm>,
        address: String,
        security: Security,
        opts: ReplicatorOptions,
    ) -> Result<Arc<Self>> {
        let on_file = backup::read_term(&dpm.config.pool_path)?;
        let term = dpm.next_replica_term(on_file)?;
        let region = dpm.pool().region().clone();
        let replicator = Replicator::new(region.clone(), opts);
        region.set_mirror(Some(replicator.clone()));
        Ok(Arc::new(Primary {
            dpm,
            term,
            address,
            security,
            replicator,
        }))
    }

    pub fn term(&self) -> u64 {
        self.term
    }

    /// Attaches the backup at `address` (its gRPC address) with this primary's term and starts
    /// copying the pool to it. Refused (FAILED_PRECONDITION from the backup) when a newer
    /// primary attached it.
    pub async fn add_backup(&self, address: &str) -> Result<()> {
        let channel = self
            .security
            .endpoint(address, dinomo_security::Service::Dpm)
            .map_err(|e| DpmError::InvalidArgument(format!("backup address {address:?}: {e}")))?
            .connect_timeout(Duration::from_secs(2))
            .timeout(Duration::from_secs(30))
            .connect()
            .await
            .map_err(|e| {
                DpmError::Replication(format!("cannot reach the backup at {address}: {e}"))
            })?;
        let pool_bytes = self.dpm.pool().region().len();
        let r = ReplicaServiceClient::new(channel)
            .attach(pb::AttachRequest {
                term: self.term,
                pool_bytes,
                primary: self.address.clone(),
            })
            .await
            .map_err(|s| {
                DpmError::Replication(format!(
                    "the backup at {address} refused to attach: {}",
                    s.message()
                ))
            })?
            .into_inner();
        let nic: SocketAddr = tokio::net::lookup_host(&r.fabric)
            .await
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| {
                DpmError::Replication(format!(
                    "the backup at {address} gave a fabric address that does not resolve: {:?}",
                    r.fabric
                ))
            })?;
        let secret: [u8; 16] = r.secret.as_slice().try_into().map_err(|_| {
            DpmError::Replication(format!(
                "the backup at {address} gave a key of {} bytes, not 16",
                r.secret.len()
            ))
        })?;
        let key = AccessKey {
            slot: r.slot,
            generation: r.generation,
            secret,
        };
        self.replicator.add(address, nic, key);
        Ok(())
    }

    pub fn remove_backup(&self, address: &str) -> bool {
        self.replicator.remove(address)
    }

    pub fn backups(&self) -> Vec<BackupStatus> {
        self.replicator.status()
    }

    /// Stops shipping (the node is stopping).
    pub fn shutdown(&self) {
        self.dpm.pool().region().set_mirror(None);
        self.replicator.shutdown();
    }
}
