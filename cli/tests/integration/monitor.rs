//! The monitor on real processes: failure recovery, adding and removing KNs under load, and
//! selective replication of hot keys driven by its policy; every history checked linearizable.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dinomo_checker::{History, Op, Res};
use dinomo_proto::monitor::{AddKnRequest, KnRequest, PolicyRequest, StatusRequest};

use super::cluster::MonitoredCluster;
use super::e2e::{assert_linearizable, run_load, start_load_with, Keys};

/// Fast failure detection; a policy that never acts on its own (SLOs unreachable to violate,
/// nothing ever under-utilised), so the test drives every change. In the emulated Soft-RoCE VM
/// (DINOMO_VM, scripts/vm-cluster.sh) a busy KN can miss heartbeats for seconds, and a false
/// failover there would change the membership a test checks: detection is slower there.
fn passive() -> String {
    let failed_after_ms = if std::env::var_os("DINOMO_VM").is_some() {
        15_000
    } else {
        1000
    };
    format!("[failure]\nprobe_every_ms = 20\nfailed_after_ms = {failed_after_ms}\n{PASSIVE_POLICY}")
}

const PASSIVE_POLICY: &str = r#"
[policy]
avg_latency_slo_us = 1000000000
tail_latency_slo_us = 1000000000
over_utilized = 1.0
under_utilized = 0.0
epoch_ms = 300
grace_period_ms = 0
"#;

async fn clients(c: &MonitoredCluster, n: usize) -> Vec<dinomo_client::Client> {
    let mut v = Vec::new();
    for _ in 0..n {
        v.push(c.client().await);
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_monitor_recovers_a_killed_kn_without_losing_acknowledged_writes() {
    let cluster = MonitoredCluster::start(3, &passive()).await;
    let history = Arc::new(History::new());
    let load = start_load_with(
        clients(&cluster, 4).await,
        Keys::uniform(24),
        100_000,
        history.clone(),
        0,
    );
    run_load(&load.seen, Duration::from_millis(700), 100).await;
    let t = Instant::now();
    let reply = cluster
        .admin()
        .await
        .fail_kn(KnRequest { kn_id: 2 })
        .await
        .unwrap_or_else(|e| {
            cluster.dump_monitor_log();
            panic!("fail-kn: {e}")
        })
        .into_inner();
    println!(
        "KN 2 killed; recovery {} us after detection (call took {:?}): {}",
        reply.recovery_us,
        t.elapsed(),
        reply.message
    );
    let after = load.seen.ops.load(Ordering::Relaxed) + 101;
    run_load(&load.seen, Duration::from_millis(700), after).await;
    let seen = load.finish().await.1;
    let (ops, errors, unknown) = (
        seen.ops.load(Ordering::Relaxed),
        seen.errors.load(Ordering::Relaxed),
        seen.unknown.load(Ordering::Relaxed),
    );
    println!("ops {ops} errors {errors} (unknown outcome {unknown})");
    let map = cluster.map().await;
    assert!(!map.contains(2), "the dead KN left the map: {map:?}");
    assert_eq!(map.kns.len(), 2);
    assert!(ops > 200);
    assert_eq!(
        errors, unknown,
        "the only errors a failure may cause are in-flight writes of unknown outcome"
    );
    // Every acknowledged write, and every later read of it, is in the history.
    assert_linearizable(
        &history,
        "KN 2 killed, detected and recovered by the monitor",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adding_and_removing_kns_through_the_monitor_reaches_no_client() {
    let cluster = MonitoredCluster::start(2, &passive()).await;
    let history = Arc::new(History::new());
    let load = start_load_with(
        clients(&cluster, 4).await,
        Keys::uniform(24),
        100_000,
        history.clone(),
        0,
    );
    let mut admin = cluster.admin().await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let added = admin.add_kn(AddKnRequest {}).await.unwrap().into_inner();
    println!("{added:?}");
    tokio::time::sleep(Duration::from_millis(600)).await;
    let removed = admin
        .remove_kn(KnRequest { kn_id: 1 })
        .await
        .unwrap()
        .into_inner();
    println!("{removed:?}");
    tokio::time::sleep(Duration::from_millis(600)).await;
    let seen = load.finish().await.1;
    let (ops, errors) = (
        seen.ops.load(Ordering::Relaxed),
        seen.errors.load(Ordering::Relaxed),
    );
    println!("ops {ops} errors {errors}");
    assert_eq!(added.kn_id, 3);
    assert_eq!(cluster.map().await.kn_ids().collect::<Vec<_>>(), vec![2, 3]);
    assert!(ops > 200);
    assert_eq!(errors, 0, "scaling must not surface errors to callers");
    assert_linearizable(&history, "KN 3 added, KN 1 removed by the monitor");
    // Removing the unknown or the last KN is refused with a clear message.
    let e = admin.remove_kn(KnRequest { kn_id: 42 }).await.unwrap_err();
    assert!(e.message().contains("not in the cluster map"), "{e}");
}

/// Phase 1: zipf-2 load, an SLO it violates, KNs not over-utilised -> the policy replicates
/// the hot key(s). Phase 2: the skew goes away (a uniform load over other keys) and the SLO is
/// met -> the policy de-replicates them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_replicates_hot_keys_under_zipf_2_and_dereplicates_them_after() {
    let violated = r#"
[failure]
probe_every_ms = 50
failed_after_ms = 5000

[policy]
avg_latency_slo_us = 1
tail_latency_slo_us = 1000000000
over_utilized = 1.0
under_utilized = 0.0
epoch_ms = 400
grace_period_ms = 0
"#;
    let cluster = MonitoredCluster::start(3, violated).await;
    let history = Arc::new(History::new());
    let load = start_load_with(
        clients(&cluster, 4).await,
        Keys::zipf(200, 2.0),
        100_000,
        history.clone(),
        0,
    );
    let mut admin = cluster.admin().await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let replicated = loop {
        let s = admin.status(StatusRequest {}).await.unwrap().into_inner();
        if !s.replicated.is_empty() {
            break s.replicated;
        }
        if Instant::now() > deadline {
            cluster.dump_monitor_log();
            panic!("no key was replicated under zipf 2 within 20 s: {s:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!("replicated (hex key -> factor): {replicated:?}");
    let key0 = "key0"
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect::<String>();
    assert!(
        replicated.get(&key0).is_some_and(|&r| r >= 2),
        "the hottest key is replicated: {replicated:?}"
    );
    let map = cluster.map().await;
    assert!(map.owners(b"key0").len() >= 2, "{map:?}");
    // Let the replicated key serve a while, through its cell, from several KNs.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let seen1 = load.finish().await.1;

    // Phase 2: the SLO is met and the skew is gone.
    admin
        .set_policy(PolicyRequest {
            toml: violated
                .replace(
                    "avg_latency_slo_us = 1\n",
                    "avg_latency_slo_us = 1000000000\n",
                )
                .split("[policy]")
                .nth(1)
                .unwrap()
                .to_string(),
        })
        .await
        .unwrap();
    let load = start_load_with(
        clients(&cluster, 2).await,
        Keys::uniform(200).shifted(1000),
        100_000,
        history.clone(),
        100,
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = admin.status(StatusRequest {}).await.unwrap().into_inner();
        if s.replicated.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            cluster.dump_monitor_log();
            panic!("the hot keys were not de-replicated within 30 s: {s:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let seen2 = load.finish().await.1;
    assert!(cluster.map().await.replicated.is_empty());
    // The value of record went back from the cell to the index: a read after de-replication
    // must see the last write made through the cell (checked with the rest of the history).
    let c = cluster.client().await;
    for k in 0..8 {
        let key = format!("key{k}").into_bytes();
        let h = history.invoke(999, Op::Get { key: key.clone() });
        let v = c.get(key).await.unwrap();
        history.complete(h, Res::Value(v.map(|b| b.to_vec())));
    }
    let ops = seen1.ops.load(Ordering::Relaxed) + seen2.ops.load(Ordering::Relaxed);
    let errors = seen1.errors.load(Ordering::Relaxed) + seen2.errors.load(Ordering::Relaxed);
    println!("ops {ops} errors {errors}");
    assert_eq!(errors, 0, "replication changes must not surface errors");
    assert_linearizable(&history, "zipf-2 hot keys replicated, then de-replicated");
}

/// A KN that hangs (SIGSTOP: its process is alive, so only missed heartbeats can tell) is
/// declared failed, fenced and replaced in the map; when it wakes up, its late writes are
/// refused by the DPM, and the history stays linearizable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_kn_is_detected_by_missed_heartbeats_and_fenced() {
    let cluster = MonitoredCluster::start(3, &passive()).await;
    let history = Arc::new(History::new());
    let mut cs = Vec::new();
    for _ in 0..4 {
        let mut cfg = dinomo_client::ClientConfig::new(&[&cluster.routing.addr]);
        cfg.deadline = Duration::from_secs(20);
        // Requests stuck at the hung KN give up after this (their outcome is then unknown).
        cfg.rpc_timeout = Duration::from_secs(1);
        cs.push(dinomo_client::Client::connect_with(cfg).await.unwrap());
    }
    let load = start_load_with(cs, Keys::uniform(24), 100_000, history.clone(), 0);
    tokio::time::sleep(Duration::from_millis(700)).await;
    let pid = cluster.kn_pid(2);
    // SAFETY: signalling a process of this test's cluster.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let stopped = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(15);
    while cluster.map().await.contains(2) {
        if Instant::now() > deadline {
            unsafe { libc::kill(pid, libc::SIGCONT) };
            cluster.dump_monitor_log();
            panic!("the hung KN was not taken out of the map within 15 s");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    println!(
        "hung KN 2 out of the map {:?} after SIGSTOP (failed_after_ms = 1000)",
        stopped.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Wake it: whatever it still had queued must not reach the pool.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    tokio::time::sleep(Duration::from_millis(700)).await;
    let seen = load.finish().await.1;
    let (ops, errors, unknown) = (
        seen.ops.load(Ordering::Relaxed),
        seen.errors.load(Ordering::Relaxed),
        seen.unknown.load(Ordering::Relaxed),
    );
    println!("ops {ops} errors {errors} (unknown outcome {unknown})");
    assert!(ops > 200);
    assert_eq!(
        errors, unknown,
        "only requests stuck at the hung KN may fail"
    );
    let log = std::fs::read_to_string(cluster.dir.path().join("monitor.log")).unwrap();
    assert!(
        log.contains("missed heartbeats"),
        "detected by heartbeats, not by the orchestrator"
    );
    assert_linearizable(&history, "KN 2 hung, fenced, woken up");
}

/// The last KN of the map dies: failure recovery alone would leave a map with no KN, where no
/// key is served until someone adds one (a nemesis schedule found this). The monitor starts a
/// replacement (policy.min_kns, at least one), which serves every acknowledged write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_kn_killed_is_replaced_and_its_writes_are_served() {
    let cluster = MonitoredCluster::start(1, &passive()).await;
    let client = cluster.client().await;
    for i in 0..50 {
        client
            .put(format!("k{i}").into_bytes(), format!("v{i}").into_bytes())
            .await
            .unwrap();
    }
    let first = cluster.map().await;
    let only = first.kns[0].id;
    // SAFETY: a KN process of this test's cluster.
    unsafe { libc::kill(cluster.kn_pid(only), libc::SIGKILL) };
    let start = Instant::now();
    let replaced = loop {
        let m = cluster.map().await;
        if !m.contains(only) && !m.kns.is_empty() {
            break m;
        }
        if start.elapsed() > Duration::from_secs(60) {
            cluster.dump_monitor_log();
            panic!("no replacement for the only KN within 60 s; map {m:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!(
        "KN {only} killed; map v{} with KN(s) {:?} after {:?}",
        replaced.version,
        replaced.kn_ids().collect::<Vec<_>>(),
        start.elapsed()
    );
    for i in 0..50 {
        let v = client.get(format!("k{i}").into_bytes()).await.unwrap();
        assert_eq!(v.as_deref(), Some(format!("v{i}").as_bytes()), "k{i}");
    }
    client
        .put(&b"after"[..], &b"replacement"[..])
        .await
        .unwrap();
}
