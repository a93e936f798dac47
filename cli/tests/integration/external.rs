//! The monitor with KNs that someone else starts (`--orchestrator external`, what the compose
//! deployment uses; the kubernetes orchestrator's first map goes the same way): the first map
//! waits for the registered KNs, `add-kn` adopts a registered KN outside the map, a removed KN
//! keeps running and can be adopted again without serving what it cached before, and a dead
//! KN's registration record is never adopted.

use std::time::Duration;

use dinomo_client::{admin, Client, ClientConfig};
use dinomo_proto::monitor::monitor_service_client::MonitorServiceClient;
use dinomo_proto::monitor::{AddKnRequest, KnRequest};

use super::cluster::{dpm_and_routing, Proc};
use super::deploy::spawn_kn;

fn spawn_monitor(dir: &std::path::Path, dpm: &str, routing: &str, kns: u32) -> Proc {
    let kns = kns.to_string();
    Proc::spawn(
        &[
            "monitor",
            "--orchestrator",
            "external",
            "--listen",
            "127.0.0.1:0",
            "--dpm",
            dpm,
            "--routing",
            routing,
            "--metrics-listen",
            "",
            "--kns",
            &kns,
            "--adopt-timeout-ms",
            "2000",
            "--vnodes",
            "64",
        ],
        &dir.join("monitor.log"),
        "addr=",
    )
}

async fn admin_client(monitor: &str) -> MonitorServiceClient<tonic::transport::Channel> {
    MonitorServiceClient::connect(format!("http://{monitor}"))
        .await
        .unwrap()
}

async fn map_ids(dpm: &str) -> Vec<u32> {
    admin::published_map(dpm)
        .await
        .unwrap()
        .map(|m| m.kn_ids().collect())
        .unwrap_or_default()
}

/// Writes `value` under keys 0..n and reads every one back through the routing node.
async fn write_and_check(client: &Client, n: u32, value: &str) {
    for i in 0..n {
        client
            .put(format!("ext-{i}"), format!("{value}-{i}"))
            .await
            .unwrap();
    }
    check(client, n, value).await;
}

async fn check(client: &Client, n: u32, value: &str) {
    for i in 0..n {
        let got = client.get(format!("ext-{i}")).await.unwrap();
        assert_eq!(
            got.as_deref(),
            Some(format!("{value}-{i}").as_bytes()),
            "key ext-{i}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_external_orchestrator_adopts_registered_kns() {
    let dir = tempfile::tempdir().unwrap();
    let (dpm, routing) = dpm_and_routing(dir.path());
    let _kn1 = spawn_kn(dir.path(), &dpm.addr, 1, &[]);

    // The first map waits for two KNs: none is published while only KN 1 runs.
    let (d, r, p) = (
        dpm.addr.clone(),
        routing.addr.clone(),
        dir.path().to_owned(),
    );
    let monitor = std::thread::spawn(move || spawn_monitor(&p, &d, &r, 2));
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        admin::published_map(&dpm.addr).await.unwrap().is_none(),
        "a map was published before its second KN registered"
    );
    let _kn2 = spawn_kn(dir.path(), &dpm.addr, 2, &[]);
    let monitor = monitor.join().unwrap();
    assert_eq!(map_ids(&dpm.addr).await, vec![1, 2]);

    let mut cfg = ClientConfig::new(&[&routing.addr]);
    cfg.deadline = Duration::from_secs(20);
    let client = Client::connect_with(cfg).await.unwrap();
    write_and_check(&client, 200, "a").await;

    // add-kn with nothing to adopt: refused, saying what to do.
    let mut m = admin_client(&monitor.addr).await;
    let err = m.add_kn(AddKnRequest {}).await.unwrap_err();
    assert!(err.message().contains("no KN to adopt"), "{err:?}");

    // A third KN started by hand is adopted.
    let mut kn3 = spawn_kn(dir.path(), &dpm.addr, 3, &[]);
    let added = m.add_kn(AddKnRequest {}).await.unwrap().into_inner();
    assert_eq!(added.kn_id, 3);
    assert_eq!(map_ids(&dpm.addr).await, vec![1, 2, 3]);
    check(&client, 200, "a").await;

    // Nothing here kills processes.
    let err = m.fail_kn(KnRequest { kn_id: 3 }).await.unwrap_err();
    assert!(err.message().contains("cannot kill KN 3"), "{err:?}");

    // Removed: out of the map, still running. Its keys change meanwhile; once adopted again
    // it serves the new values, not what it cached while it owned them.
    m.remove_kn(KnRequest { kn_id: 3 }).await.unwrap();
    assert_eq!(map_ids(&dpm.addr).await, vec![1, 2]);
    write_and_check(&client, 200, "b").await;
    let again = m.add_kn(AddKnRequest {}).await.unwrap().into_inner();
    assert_eq!(again.kn_id, 3);
    assert_eq!(map_ids(&dpm.addr).await, vec![1, 2, 3]);
    check(&client, 200, "b").await;

    // Killed: the monitor's probes take it out of the map, and its record is not adopted.
    kn3.kill9();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while map_ids(&dpm.addr).await.contains(&3) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "KN 3 still in the map"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let err = m.add_kn(AddKnRequest {}).await.unwrap_err();
    assert!(err.message().contains("no KN to adopt"), "{err:?}");
    check(&client, 200, "b").await;
}
