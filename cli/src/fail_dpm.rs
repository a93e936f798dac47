//! `dinomo admin fail-dpm`: kills the dpm-node primary of a replicated cluster (SIGKILL, an
//! experiment) and measures the failover: until a new primary (a newer term) answers at the
//! dpm-node's address, and until a write through the routing node is acknowledged again.
//! The primary must run on this host (its pid comes from its ReplicaStatus); `dinomo up
//! --dpm-replicas N` is what replaces it.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use dinomo_security::Security;

/// The key the probe writes (its value: the time of the failover, for the record).
pub const PROBE_KEY: &str = "dinomo/fail-dpm/probe";

/// How long every backup must have been in sync before the primary is killed.
const IN_SYNC_FOR: Duration = Duration::from_millis(600);

pub async fn run(
    dpm: &str,
    routing: &str,
    writer: Security,
    within: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    // Every backup in sync, and for a while: `dinomo up` promotes a backup it saw in sync at
    // its last check (every 200 ms), so a kill right after the backups caught up would find
    // none it knows to be in sync.
    let mut in_sync_since: Option<Instant> = None;
    let before = loop {
        let s = crate::status::replica_status(dpm)
            .await
            .with_context(|| format!("asking the dpm-node at {dpm} for its replica set"))?;
        if s.term == 0 {
            bail!(
                "the dpm-node at {dpm} has no backups: killing it would lose the cluster \
                 (start it with `dinomo up --dpm-replicas 3`)"
            );
        }
        if !s.backups.is_empty() && s.backups.iter().all(|b| b.state == "in-sync") {
            let since = *in_sync_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= IN_SYNC_FOR {
                break s;
            }
        } else {
            in_sync_since = None;
        }
        if Instant::now() > deadline {
            bail!("the backups are not all in sync; not killing the primary: {s:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let pid = before.pid as i32;
    if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
        bail!("the primary (pid {pid}) does not run on this host");
    }
    let mut cfg = dinomo_client::ClientConfig::new(&[routing]);
    cfg.deadline = within;
    cfg.security = writer;
    let client = dinomo_client::Client::connect_with(cfg)
        .await
        .with_context(|| format!("routing node {routing}"))?;
    // SAFETY: a plain signal to a process id read from the primary itself.
    if unsafe { libc::kill(pid, libc::SIGKILL) } != 0 {
        bail!(
            "cannot kill the primary (pid {pid}): {}",
            std::io::Error::last_os_error()
        );
    }
    let killed = Instant::now();
    println!(
        "killed the dpm-node primary (pid {pid}, term {}) with SIGKILL",
        before.term
    );
    let new = loop {
        match crate::status::replica_status(dpm).await {
            Ok(s) if s.term > before.term && s.pid as i32 != pid => break s,
            _ if Instant::now() > deadline => bail!(
                "no new primary answered at {dpm} within {} s",
                within.as_secs()
            ),
            _ => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    };
    let serving = killed.elapsed();
    // The first writes may fail with an unknown outcome (a KN's batch in flight on its
    // connection to the dead primary); the probe is an upsert, so it is simply written again.
    let stamp = format!("{:?}", std::time::SystemTime::now());
    let mut unknown = 0;
    loop {
        match client
            .put(PROBE_KEY.as_bytes().to_vec(), stamp.clone().into_bytes())
            .await
        {
            Ok(()) => break,
            Err(dinomo_client::ClientError::OutcomeUnknown(_)) if Instant::now() < deadline => {
                unknown += 1;
            }
            Err(e) => return Err(e).context("the first write after the failover"),
        }
    }
    let writing = killed.elapsed();
    println!(
        "new primary (pid {}, term {}) answered after {} ms; the first write through {routing} \
         was acknowledged after {} ms ({unknown} earlier {} with an unknown outcome)",
        new.pid,
        new.term,
        serving.as_millis(),
        writing.as_millis(),
        if unknown == 1 { "attempt" } else { "attempts" }
    );
    Ok(())
}
