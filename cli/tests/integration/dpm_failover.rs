//! Failover of the dpm-node (issue 14): `dinomo up --dpm-replicas 3`, SDK clients
//! on a Zipf workload recording a history, and the primary killed with SIGKILL several times at
//! random moments, each time once every backup has been in sync for a while (one failure at a
//! time: a replica set of 3 survives one loss, then re-replicates before the next). `up`
//! promotes a backup each time. Then every key is read back and the whole history is checked
//! for linearizability (dinomo-checker): an acknowledged write lost in a failover is a read
//! that misses it, a violation.
//!
//! Before the first kill, `dinomo status` must show both backups' copies complete
//! (promotable), asked of each backup.
//!
//! Printed: one `DPM-FAILOVER` line with the kills, operations, unknown outcomes, violations
//! and the failover times (kill -> a new primary answers; kill -> a probe client's write is
//! acknowledged again), median and max.
//!
//! Run on tcp (the dpm-node's NIC ships what it applies) and on shm (the KV nodes forward each
//! batch they store, docs/decisions/0007 "One-sided fabrics").
//!
//! Environment: `DINOMO_DPM_FAILOVER_KILLS` (default 3 on tcp, 2 on shm),
//! `DINOMO_DPM_FAILOVER_SEED` (default: random, printed), `DINOMO_DPM_FAILOVER_FABRIC` (only
//! this fabric's test runs). `scripts/dpm-failover.sh` runs the long form (50 kills).

use std::time::{Duration, Instant};

use dinomo_checker::{check, History, Op, Res};
use dinomo_client::{Client, ClientConfig, ClientError};
use dinomo_proto::dpm::replica_service_client::ReplicaServiceClient;
use dinomo_proto::dpm::{ReplicaStatusRequest, ReplicaStatusResponse};
use dinomo_proto::monitor::monitor_service_client::MonitorServiceClient;
use dinomo_proto::monitor::StatusRequest;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::cluster::UpCluster;
use super::e2e::{start_load_with, Keys};

const KEYS: u32 = 64;
const CLIENTS: usize = 4;
/// A client gives up on an operation only on a stuck cluster.
const OP_DEADLINE: Duration = Duration::from_secs(30);
/// Bound on each wait (backups in sync, a new primary, a write acknowledged).
const BOUND: Duration = Duration::from_secs(60);

fn env<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

async fn status(dpm: &str) -> Option<ReplicaStatusResponse> {
    let mut c = ReplicaServiceClient::connect(format!("http://{dpm}"))
        .await
        .ok()?;
    c.status(ReplicaStatusRequest {})
        .await
        .ok()
        .map(|r| r.into_inner())
}

/// Waits until every backup has been in sync for 600 ms (`up` checks every 200 ms and
/// promotes only a backup it saw in sync); the primary's status then.
async fn wait_in_sync(dpm: &str, backups: usize) -> Result<ReplicaStatusResponse, String> {
    let deadline = Instant::now() + BOUND;
    let mut since: Option<Instant> = None;
    let mut last = None;
    while Instant::now() < deadline {
        let s = status(dpm).await;
        match &s {
            Some(s)
                if s.backups.len() == backups && s.backups.iter().all(|b| b.state == "in-sync") =>
            {
                if since.get_or_insert_with(Instant::now).elapsed() >= Duration::from_millis(600) {
                    return Ok(s.clone());
                }
            }
            _ => since = None,
        }
        last = s;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(format!("backups not in sync within {BOUND:?}: {last:?}"))
}

/// A put of the probe key, acknowledged; retried on an unknown outcome (a KN's batch in flight
/// on its connection to the dead primary).
async fn probe_write(probe: &Client, n: u64) -> Result<(), String> {
    let deadline = Instant::now() + BOUND;
    loop {
        match probe.put(&b"failover-probe"[..], format!("p{n}")).await {
            Ok(()) => return Ok(()),
            Err(ClientError::OutcomeUnknown(_)) if Instant::now() < deadline => {}
            Err(e) => return Err(format!("probe write: {e}")),
        }
    }
}

/// Runs `dinomo admin fail-dpm` against the cluster; its output (stdout and stderr).
async fn fail_dpm(dpm: &str, routing: &str) -> String {
    dinomo(&[
        "admin",
        "--insecure",
        "fail-dpm",
        "--dpm",
        dpm,
        "--routing",
        routing,
    ])
    .await
}

/// `dinomo status --dpm <dpm>`'s output (stdout and stderr).
async fn dinomo_status(dpm: &str, routing: &str) -> String {
    dinomo(&["status", "--insecure", "--dpm", dpm, "--routing", routing]).await
}

/// Runs the dinomo binary with `args`; its output (stdout and stderr).
async fn dinomo(args: &[&str]) -> String {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_dinomo"))
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .await
        .unwrap_or_else(|e| panic!("running dinomo {args:?}: {e}"));
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn median_max(v: &mut [u128]) -> (u128, u128) {
    v.sort_unstable();
    (v[v.len() / 2], v[v.len() - 1])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_dpm_primary_loses_no_acknowledged_write() {
    if env::<String>("DINOMO_DPM_FAILOVER_FABRIC").is_some_and(|f| f != "tcp") {
        return; // the long form runs one fabric at a time
    }
    let kills: u32 = env("DINOMO_DPM_FAILOVER_KILLS").unwrap_or(3);
    failover("tcp", kills, None).await;
}

/// The same on shm: the KV nodes store into the pool themselves and forward each batch to the
/// dpm-node, which ships it to its backups before the batch counts (docs/decisions/0007,
/// "One-sided fabrics"). Verbs takes the same path (run in the VM). The monitor's policy is
/// set to replicate hot keys (an SLO every operation violates), so the hottest keys are
/// served through indirect cells, whose CASes and reads the KV nodes forward too: the first
/// kill waits until one is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_dpm_primary_on_shm_loses_no_acknowledged_write() {
    if env::<String>("DINOMO_DPM_FAILOVER_FABRIC").is_some_and(|f| f != "shm") {
        return; // the long form runs one fabric at a time
    }
    let kills: u32 = env("DINOMO_DPM_FAILOVER_KILLS").unwrap_or(2);
    failover("shm", kills, Some(HOT_KEYS_REPLICATED)).await;
}

/// A monitor policy that replicates hot keys and never adds or removes a KV node.
const HOT_KEYS_REPLICATED: &str = r#"
[policy]
avg_latency_slo_us = 1
tail_latency_slo_us = 1000000000
over_utilized = 1.0
under_utilized = 0.0
epoch_ms = 400
grace_period_ms = 0
"#;

/// Waits until the monitor reports a replicated key (served through an indirect cell).
async fn wait_replicated(monitor: &str) -> Result<String, String> {
    let deadline = Instant::now() + BOUND;
    let mut admin = MonitorServiceClient::connect(format!("http://{monitor}"))
        .await
        .map_err(|e| format!("the monitor at {monitor}: {e}"))?;
    loop {
        let s = admin
            .status(StatusRequest {})
            .await
            .map_err(|e| format!("monitor status: {e}"))?
            .into_inner();
        if !s.replicated.is_empty() {
            return Ok(format!("{:?}", s.replicated));
        }
        if Instant::now() > deadline {
            return Err(format!("no key replicated within {BOUND:?}: {s:?}"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `monitor_toml`: a policy that replicates hot keys (then the first kill waits for one).
async fn failover(fabric: &str, kills: u32, monitor_toml: Option<&str>) {
    let seed: u64 = env("DINOMO_DPM_FAILOVER_SEED").unwrap_or_else(rand::random);
    println!(
        "dpm failover on {fabric}: {kills} kills, seed {seed} (replay with DINOMO_DPM_FAILOVER_SEED)"
    );
    let mut rng = StdRng::seed_from_u64(seed);
    let mut up = UpCluster::start_replicated_on(fabric, 2, 3, monitor_toml);
    let dpm = up.dpm_addr();
    let client = |deadline| {
        let mut cfg = ClientConfig::new(&[up.routing_addr()]);
        cfg.deadline = deadline;
        // Within the policy's 400 ms epoch, so that every epoch has latencies.
        cfg.report_every = Duration::from_millis(200);
        Client::connect_with(cfg)
    };
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        clients.push(client(OP_DEADLINE).await.expect("a client connects"));
    }
    let probe = client(Duration::from_secs(10))
        .await
        .expect("the probe connects");
    // `dinomo status` asks each backup for its copy marker: complete once in sync. Asked
    // directly, a backup says what it is.
    let synced = wait_in_sync(&dpm, 2)
        .await
        .expect("the backups get in sync");
    let out = dinomo_status(&dpm, &up.routing_addr()).await;
    assert_eq!(
        out.matches("copy complete (made under term").count(),
        2,
        "{out}"
    );
    let out = dinomo_status(&synced.backups[0].address, &up.routing_addr()).await;
    assert!(
        out.contains("a backup (term") && out.contains(": promotable"),
        "{out}"
    );
    let history = Arc::new(History::new());
    let first_id = (seed % 1_000_000) * 1000;
    let load = start_load_with(
        clients,
        Keys::zipf(KEYS, 1.2),
        1_000_000,
        history.clone(),
        first_id,
    );

    let (mut serving_ms, mut writing_ms) = (Vec::new(), Vec::new());
    let mut failure = None;
    if monitor_toml.is_some() {
        match wait_replicated(&up.monitor_addr()).await {
            Ok(keys) => println!("replicated keys (hex key -> factor): {keys}"),
            Err(e) => failure = Some(e),
        }
    }
    for k in 0..kills {
        if failure.is_some() {
            break;
        }
        let before = match wait_in_sync(&dpm, 2).await {
            Ok(s) => s,
            Err(e) => {
                failure = Some(format!("before kill {}: {e}", k + 1));
                break;
            }
        };
        // A random moment of the load.
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..1500))).await;
        let killed = Instant::now();
        if k == 0 {
            // The first kill as an operator makes it: `dinomo admin fail-dpm`.
            let out = fail_dpm(&dpm, &up.routing_addr()).await;
            if !out.contains("was acknowledged after") {
                failure = Some(format!("dinomo admin fail-dpm: {out}"));
                break;
            }
            println!("{}", out.trim());
        } else {
            // SAFETY: a process of this test's cluster (its pid from its own status).
            unsafe { libc::kill(before.pid as i32, libc::SIGKILL) };
        }
        let serving = loop {
            match status(&dpm).await {
                Some(s) if s.term > before.term && s.pid != before.pid => {
                    break Some(killed.elapsed())
                }
                _ if killed.elapsed() > BOUND => break None,
                _ => tokio::time::sleep(Duration::from_millis(5)).await,
            }
        };
        let Some(serving) = serving else {
            failure = Some(format!("kill {}: no new primary within {BOUND:?}", k + 1));
            break;
        };
        if let Err(e) = probe_write(&probe, u64::from(k)).await {
            failure = Some(format!("kill {}: {e}", k + 1));
            break;
        }
        serving_ms.push(serving.as_millis());
        writing_ms.push(killed.elapsed().as_millis());
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (_, seen) = load.finish().await;

    // Every key read back, recorded: the checker sees whether each read is the last write.
    // Bounded: a cluster that does not serve fails the test, it does not hang it.
    let read_back = Instant::now();
    for key in 0..KEYS {
        if failure.is_some() && read_back.elapsed() > BOUND {
            break;
        }
        let key = format!("key{key}").into_bytes();
        let h = history.invoke(first_id + 999, Op::Get { key: key.clone() });
        match probe.get(key).await {
            Ok(v) => history.complete(h, Res::Value(v.map(|b| b.to_vec()))),
            Err(e) => {
                history.complete_unknown(h);
                failure.get_or_insert(format!("read-back failed: {e}"));
            }
        }
    }
    let h2 = history.clone();
    let verdict = tokio::task::spawn_blocking(move || check(&h2))
        .await
        .unwrap();
    let log = std::fs::read_to_string(up.dir.path().join("up.log")).unwrap_or_default();
    let promotions = log.matches("promoting backup").count();
    let in_place = log.matches("restarting it on its own pool").count();
    let ops = seen.ops.load(Ordering::Relaxed);
    let unknown = seen.unknown.load(Ordering::Relaxed);
    let errors = seen.errors.load(Ordering::Relaxed);
    let (s_med, s_max) = if serving_ms.is_empty() {
        (0, 0)
    } else {
        median_max(&mut serving_ms)
    };
    let (w_med, w_max) = if writing_ms.is_empty() {
        (0, 0)
    } else {
        median_max(&mut writing_ms)
    };
    println!(
        "DPM-FAILOVER fabric={fabric} seed={seed} kills={} promotions={promotions} in_place_restarts={in_place} \
         ops={ops} unknown={unknown} other_errors={} violations={} \
         new_primary_ms_median={s_med} new_primary_ms_max={s_max} \
         first_write_ms_median={w_med} first_write_ms_max={w_max}",
        writing_ms.len(),
        errors - unknown,
        u32::from(verdict.is_err()),
    );
    if failure.is_some() || verdict.is_err() || !up.running() {
        up.dump_logs(30);
    }
    assert!(up.running(), "dinomo up exited");
    if let Err(v) = verdict {
        panic!("VIOLATION (seed {seed}): {v}");
    }
    if let Some(f) = failure {
        panic!("seed {seed}: {f}");
    }
    assert_eq!(
        (promotions, in_place),
        (kills as usize, 0),
        "every kill must promote a backup (seed {seed})"
    );
    assert_eq!(
        errors, unknown,
        "only outcome-unknown writes may reach a caller (seed {seed})"
    );
}
