//! What a deployment across hosts relies on (issue 11): `grpc.health.v1` on every node,
//! reporting SERVING only when the node can do its job, and the addresses a node hands out
//! (never a wildcard).

use std::time::{Duration, Instant};

use dinomo_client::admin;
use dinomo_placement::{ClusterMap, KnInfo};
use dinomo_proto::dpm::dpm_service_client::DpmServiceClient;
use dinomo_proto::dpm::GetMetadataRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use super::cluster::{dpm_and_routing, spawn_dpm, Proc};

/// The overall status a node reports, or the error that kept it from answering.
async fn health(addr: &str) -> Result<ServingStatus, String> {
    let ep = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(1))
        .timeout(Duration::from_secs(2));
    let ch = ep.connect().await.map_err(|e| e.to_string())?;
    let r = HealthClient::new(ch)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))?;
    Ok(r.into_inner().status())
}

/// Waits (bounded) until `addr` reports `want`; the last answer otherwise.
pub(crate) async fn wait_health(
    addr: &str,
    want: ServingStatus,
    within: Duration,
) -> Result<(), String> {
    let start = Instant::now();
    loop {
        let got = health(addr).await;
        if got == Ok(want) {
            return Ok(());
        }
        if start.elapsed() > within {
            return Err(format!("{addr}: {got:?} after {within:?}, not {want:?}"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub(crate) fn spawn_kn(dir: &std::path::Path, dpm: &str, id: u32, extra: &[&str]) -> Proc {
    let id_s = id.to_string();
    let mut args = vec![
        "kv-node",
        "--kn-id",
        &id_s,
        "--dpm",
        dpm,
        "--metrics-listen",
        "",
        "--cache-size",
        "1MiB",
    ];
    args.extend_from_slice(extra);
    if !extra.contains(&"--listen") {
        args.extend(["--listen", "127.0.0.1:0"]);
    }
    Proc::spawn(&args, &dir.join(format!("kn{id}.log")), "addr=")
}

/// A map with KN 1 (`kn`) as its only member.
fn one_kn_map(kn: &Proc) -> ClusterMap {
    ClusterMap::new(
        vec![KnInfo {
            id: 1,
            endpoint: kn.addr.clone(),
        }],
        64,
        1,
    )
    .unwrap()
}

async fn kn_record(dpm: &str, kn: u32) -> Option<String> {
    let mut c = DpmServiceClient::connect(format!("http://{dpm}"))
        .await
        .unwrap();
    c.get_metadata(GetMetadataRequest {
        name: format!("dpm/kn/{kn}"),
    })
    .await
    .unwrap()
    .into_inner()
    .value
    .map(|v| String::from_utf8(v).unwrap())
}

/// dpm-node: SERVING once its pool is open. Routing node and KV node: NOT_SERVING until a
/// cluster map is published, then SERVING. A KV node whose dpm-node is gone turns NOT_SERVING
/// (its DPM session breaks), so a readiness probe takes it out of rotation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_node_reports_health_by_whether_it_can_do_its_job() {
    let dir = tempfile::tempdir().unwrap();
    let (mut dpm, routing) = dpm_and_routing(dir.path());
    assert_eq!(health(&dpm.addr).await, Ok(ServingStatus::Serving));
    let kn = spawn_kn(dir.path(), &dpm.addr, 1, &[]);
    // No map published yet.
    assert_eq!(health(&routing.addr).await, Ok(ServingStatus::NotServing));
    assert_eq!(health(&kn.addr).await, Ok(ServingStatus::NotServing));

    admin::publish_map(&dpm.addr, &one_kn_map(&kn))
        .await
        .unwrap();
    wait_health(
        &routing.addr,
        ServingStatus::Serving,
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    wait_health(&kn.addr, ServingStatus::Serving, Duration::from_secs(10))
        .await
        .unwrap();

    dpm.kill9();
    // The session keeper declares the session broken after 5 s without the DPM.
    wait_health(&kn.addr, ServingStatus::NotServing, Duration::from_secs(20))
        .await
        .unwrap();
}

/// A KV node registers the address it advertises; one listening on a wildcard without
/// `--advertise` hands out the address its host's name resolves to (when that is not loopback)
/// or refuses to start with a message naming `--advertise`: never 0.0.0.0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_node_advertises_a_dialable_address_never_a_wildcard() {
    let dir = tempfile::tempdir().unwrap();
    let (dpm, _routing) = dpm_and_routing(dir.path());

    let _kn = spawn_kn(
        dir.path(),
        &dpm.addr,
        1,
        &[
            "--listen",
            "0.0.0.0:0",
            "--advertise",
            "kn-1.dinomo-kn.test.svc",
        ],
    );
    let rec = kn_record(&dpm.addr, 1).await.unwrap();
    assert!(
        rec.starts_with("kn-1.dinomo-kn.test.svc:") && !rec.ends_with(":0"),
        "recorded endpoint {rec:?}: the advertised host with the bound port"
    );

    let mut cmd = insecure_dinomo();
    cmd.args(["kv-node", "--kn-id", "2", "--dpm", &dpm.addr])
        .args([
            "--listen",
            "0.0.0.0:0",
            "--metrics-listen",
            "",
            "--print-ready",
        ])
        .env("DINOMO_LOG", "info");
    let log = dir.path().join("kn2.log");
    match dinomo_node_common::spawn_until_ready("kn2", cmd, &log, Duration::from_secs(30)) {
        Ok((mut child, line)) => {
            let rec = kn_record(&dpm.addr, 2).await.unwrap();
            let _ = child.kill();
            let _ = child.wait();
            let ip = rec.parse::<std::net::SocketAddr>().map(|a| a.ip());
            assert!(
                ip.is_ok_and(|ip| !ip.is_loopback() && !ip.is_unspecified()),
                "wildcard listen ({line}) recorded {rec:?}, not this host's address"
            );
        }
        Err(e) => {
            let log = std::fs::read_to_string(&log).unwrap_or_default();
            assert!(
                log.contains("--advertise") && log.contains("wildcard"),
                "a KN on a wildcard without a dialable host name must say to set --advertise \
                 ({e}); log:\n{log}"
            );
        }
    }
}

/// `--id-from-ordinal` takes the KN id from the StatefulSet ordinal (+1, as the monitor's
/// kubernetes orchestrator numbers KNs), from DINOMO_KN_POD_INDEX (the downward API) here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_node_takes_its_id_from_the_pod_ordinal() {
    let dir = tempfile::tempdir().unwrap();
    let (dpm, _routing) = dpm_and_routing(dir.path());
    let mut cmd = insecure_dinomo();
    cmd.args(["kv-node", "--id-from-ordinal", "--dpm", &dpm.addr])
        .args([
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "",
            "--print-ready",
        ])
        .env("DINOMO_KN_POD_INDEX", "4")
        .env("DINOMO_LOG", "info");
    let (mut child, line) = dinomo_node_common::spawn_until_ready(
        "kn",
        cmd,
        &dir.path().join("kn.log"),
        Duration::from_secs(30),
    )
    .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(
        dinomo_node_common::ready_field(&line, "kn="),
        Some("5"),
        "{line}"
    );

    // A bad ordinal is refused with the reason, before anything registers.
    let out = insecure_dinomo()
        .args(["kv-node", "--id-from-ordinal", "--dpm", &dpm.addr])
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", ""])
        .env("DINOMO_KN_POD_INDEX", "four")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("DINOMO_KN_POD_INDEX"), "{err}");
}

/// A dpm-node on the tcp fabric that advertises its NIC by name: KNs resolve the name (as
/// they would a Kubernetes service) and write through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_nodes_reach_a_fabric_advertised_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = spawn_dpm(
        dir.path(),
        &["--fabric", "tcp", "--fabric-advertise", "localhost"],
    );
    let kn = spawn_kn(dir.path(), &dpm.addr, 1, &[]);
    admin::publish_map(&dpm.addr, &one_kn_map(&kn))
        .await
        .unwrap();
    let mut c = dinomo_proto::kv::kv_service_client::KvServiceClient::connect(format!(
        "http://{}",
        kn.addr
    ))
    .await
    .unwrap();
    let start = Instant::now();
    loop {
        let r = c
            .put(dinomo_proto::kv::PutRequest {
                key: b"k".to_vec().into(),
                value: b"v".to_vec().into(),
                mode: dinomo_proto::kv::PutMode::Upsert as i32,
            })
            .await;
        match r {
            Ok(_) => break,
            Err(e) if start.elapsed() > Duration::from_secs(10) => {
                panic!(
                    "no write through the fabric at localhost: {e}; KN log:\n{}",
                    std::fs::read_to_string(dir.path().join("kn1.log")).unwrap_or_default()
                )
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let log = std::fs::read_to_string(dir.path().join("kn1.log")).unwrap_or_default();
    assert!(log.contains("FABRIC_KIND_TCP"), "{log}");
}

/// A build without the `rdma` feature refuses the verbs fabric up front, saying why, in the
/// dpm-node and in `dinomo up` alike (instead of telling KNs to speak a fabric nobody serves).
#[cfg(not(feature = "rdma"))]
#[test]
fn verbs_is_refused_clearly_by_a_build_without_rdma() {
    let dir = tempfile::tempdir().unwrap();
    let pool = dir.path().join("pool");
    let dpm = insecure_dinomo()
        .args([
            "dpm-node",
            "--pool",
            pool.to_str().unwrap(),
            "--fabric",
            "verbs",
        ])
        .args(["--listen", "127.0.0.1:0", "--fabric-listen", "127.0.0.1:0"])
        .args(["--metrics-listen", ""])
        .output()
        .unwrap();
    let up = insecure_dinomo()
        .args([
            "up",
            "--data-dir",
            dir.path().to_str().unwrap(),
            "--fabric",
            "verbs",
        ])
        .output()
        .unwrap();
    for (what, out) in [("dpm-node", dpm), ("up", up)] {
        assert!(!out.status.success(), "{what} started");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("built without the `rdma` cargo feature"),
            "{what}: {err}"
        );
    }
    assert!(!pool.exists(), "nothing was formatted");
}

/// The `dinomo` binary, run with `--insecure` (these tests are about deployment, not TLS).
fn insecure_dinomo() -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_dinomo"));
    cmd.env(crate::cluster::INSECURE.0, crate::cluster::INSECURE.1);
    cmd
}
