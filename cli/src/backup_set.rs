//! Changing the dpm-node primary's replica set: adding a backup (the primary attaches it and
//! copies what its pool lacks) or removing one (the primary stops waiting for it), through the
//! primary's ReplicaService, as the process's identity (admin). Used by `dinomo admin
//! add-backup` / `remove-backup` and by `dinomo up --dpm-replicas` when it restarts a backup.

use std::time::Duration;

use dinomo_proto::dpm::replica_service_client::ReplicaServiceClient;
use dinomo_proto::dpm::{BackupRequest, ReplicaStatusResponse};

/// Adds (`add`) or removes the backup whose gRPC address is `backup` at the primary `dpm`;
/// the primary's replica status after the change.
pub(crate) async fn change(
    dpm: &str,
    backup: &str,
    add: bool,
) -> anyhow::Result<ReplicaStatusResponse> {
    let ch = dinomo_security::Security::of_process()
        .endpoint(dpm, dinomo_security::Service::Dpm)?
        .connect_timeout(Duration::from_millis(500))
        // An attach answers once the backup digested its pool (30 s + 4 s per GiB at most).
        .timeout(Duration::from_secs(120))
        .connect()
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach the dpm-node at {dpm}: {e}"))?;
    let mut c = ReplicaServiceClient::new(ch);
    let req = BackupRequest {
        address: backup.to_string(),
    };
    let (what, reply) = if add {
        ("adding", c.add_backup(req).await)
    } else {
        ("removing", c.remove_backup(req).await)
    };
    reply
        .map(|r| r.into_inner())
        .map_err(|s| anyhow::anyhow!("{what} backup {backup} at {dpm}: {}", s.message()))
}
