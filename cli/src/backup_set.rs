//! Changing the dpm-node replica set: adding a backup (the primary attaches it and copies what
//! its pool lacks) or removing one (the primary stops waiting for it), through the primary's
//! ReplicaService, and promoting a backup (a failover an operator decided), through the
//! backup's; as the process's identity (admin). Used by `dinomo admin add-backup` /
//! `remove-backup` / `promote-backup` and by `dinomo up --dpm-replicas` when it restarts a
//! backup.

use std::time::Duration;

use anyhow::Context;
use dinomo_proto::dpm::replica_service_client::ReplicaServiceClient;
use dinomo_proto::dpm::{BackupRequest, PromoteRequest, ReplicaStatusResponse};

/// Adds (`add`) or removes the backup whose gRPC address is `backup` at the primary `dpm`,
/// waiting at most `timeout` for the answer; the primary's replica status after the change.
/// An add answers once the backup attached, which reads and digests the whole pool the
/// backup holds (the primary allows 30 s + 4 s per GiB of pool for that).
pub(crate) async fn change(
    dpm: &str,
    backup: &str,
    add: bool,
    timeout: Duration,
) -> anyhow::Result<ReplicaStatusResponse> {
    let ch = dinomo_security::Security::of_process()
        .endpoint(dpm, dinomo_security::Service::Dpm)?
        .connect_timeout(Duration::from_millis(500))
        .timeout(timeout)
        .connect()
        .await
        .with_context(|| format!("cannot reach the dpm-node at {dpm}"))?;
    let mut c = ReplicaServiceClient::new(ch);
    let req = BackupRequest {
        address: backup.to_string(),
    };
    let (what, reply) = if add {
        ("adding", c.add_backup(req).await)
    } else {
        ("removing", c.remove_backup(req).await)
    };
    reply.map(|r| r.into_inner()).map_err(|s| {
        let hint = if s.code() == tonic::Code::Cancelled || s.message().contains("Timeout") {
            format!(
                " (no answer within {} s: an attach digests the backup's whole pool first; \
                 a larger --timeout-secs waits longer)",
                timeout.as_secs()
            )
        } else {
            String::new()
        };
        anyhow::anyhow!("{what} backup {backup} at {dpm}: {}{hint}", s.message())
    })
}

/// Makes the backup at `backup` the primary, replicating to `others` (see `Promote` in
/// proto/dpm.proto), and waits up to `timeout` until it answers as a primary. The new primary
/// takes a term later than any the target and `others` report (those that answer). Prints
/// what it does; the new primary's status at the end.
pub(crate) async fn promote(
    backup: &str,
    others: &[String],
    timeout: Duration,
) -> anyhow::Result<ReplicaStatusResponse> {
    let mut min_term = 0;
    let mut target = None;
    let mut answered = Vec::new();
    for addr in std::iter::once(backup).chain(others.iter().map(String::as_str)) {
        match crate::status::replica_status(addr).await {
            Ok(s) => {
                min_term = min_term.max(s.term);
                if addr == backup {
                    target = Some(s);
                } else {
                    answered.push((addr, s));
                }
            }
            Err(e) => println!("  {addr}: no status ({e:#}); its term is not counted"),
        }
    }
    // A backup removed from the set keeps a complete copy, older than the ones that stayed
    // (a newer generation of the same term): the new primary would be refused by them. Said
    // here, before anything changes.
    if let Some(t) = target.filter(|t| t.copy_state == "complete") {
        if let Some((addr, s)) = answered.iter().find(|(_, s)| {
            s.copy_state == "complete" && s.copy_term == t.copy_term && s.generation > t.generation
        }) {
            anyhow::bail!(
                "not promoting {backup}: its copy (term {}, replica-set generation {}) is older \
                 than {addr}'s (generation {}): {backup} left the replica set before writes \
                 {addr} holds were acknowledged. Promote {addr} instead{}",
                t.copy_term,
                t.generation,
                s.generation,
                if s.not_promotable.is_empty() {
                    String::new()
                } else {
                    format!(" (once it can be: it says {})", s.not_promotable)
                }
            );
        }
    }
    let ch = dinomo_security::Security::of_process()
        .endpoint(backup, dinomo_security::Service::Dpm)?
        .connect_timeout(Duration::from_millis(500))
        .timeout(Duration::from_secs(30))
        .connect()
        .await
        .with_context(|| format!("cannot reach the backup at {backup}"))?;
    let reply = ReplicaServiceClient::new(ch)
        .promote(PromoteRequest {
            backups: others.to_vec(),
            min_term,
        })
        .await;
    match reply {
        Ok(r) => {
            let r = r.into_inner();
            println!(
                "{backup} holds a complete copy made under term {} and is starting as the \
                 primary (after term {})",
                r.copy_term,
                r.accepted_term.max(min_term)
            );
        }
        // Being promoted by an earlier call (this one's retry after a lost answer, or the
        // monitor's), or the primary already: what was asked for is under way or done, so
        // wait for it as for our own promotion. That call's backups are the ones it attaches.
        Err(s) if s.code() == tonic::Code::AlreadyExists => {
            println!("{backup}: {}", s.message());
            if !others.is_empty() {
                println!(
                    "  the --backup list of this call is not applied: the primary attaches the \
                     backups it was started or promoted with (add-backup / remove-backup change \
                     them)"
                );
            }
        }
        Err(s) => anyhow::bail!("promoting {backup}: {}", s.message()),
    }
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Ok(s) = crate::status::replica_status(backup).await {
            if s.role == "primary" {
                return Ok(s);
            }
        }
        if tokio::time::Instant::now() >= deadline {
            anyhow::bail!(
                "{backup} did not answer as a primary within {} s (it recovers the pool \
                 first; see its log)",
                timeout.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
