//! Restarts of single nodes: whatever a node acknowledged before it died is readable after it
//! (or its replacement) is back.

use std::time::Duration;

use dinomo_proto::kv::kv_service_client::KvServiceClient;
use dinomo_proto::kv::{GetRequest, PutMode, PutRequest};

use super::cluster::{dpm_and_routing, Proc};

const KEYS: u32 = 200;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn spawn_kn_without_id(dpm: &str, listen: &str, log: &std::path::Path) -> Proc {
    Proc::spawn(
        &[
            "kv-node",
            "--listen",
            listen,
            "--dpm",
            dpm,
            "--metrics-listen",
            "",
            "--cache-size",
            "1MiB",
        ],
        log,
        "addr=",
    )
}

async fn kn_client(addr: &str) -> KvServiceClient<tonic::transport::Channel> {
    KvServiceClient::connect(format!("http://{addr}")).await.unwrap()
}

/// Finding 6 of issue 10: a KV node started without `--kn-id` (no monitor, no published
/// map: it serves every key itself) is killed and started again on the same address. Its
/// writes sat in its open log segment; the new process must not serve without them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kn_restarted_without_an_id_serves_its_acknowledged_writes() {
    let dir = tempfile::tempdir().unwrap();
    let (dpm, _routing) = dpm_and_routing(dir.path());
    let listen = format!("127.0.0.1:{}", free_port());
    let log = dir.path().join("kn.log");
    let mut kn = spawn_kn_without_id(&dpm.addr, &listen, &log);
    let mut c = kn_client(&kn.addr).await;
    for i in 0..KEYS {
        c.put(PutRequest {
            key: format!("k{i}").into_bytes(),
            value: format!("v{i}").into_bytes(),
            mode: PutMode::Upsert as i32,
        })
        .await
        .unwrap_or_else(|s| panic!("put k{i}: {s}"));
    }
    kn.kill9();
    let kn = spawn_kn_without_id(&dpm.addr, &listen, &log);
    let mut c = kn_client(&kn.addr).await;
    let mut lost = Vec::new();
    for i in 0..KEYS {
        let r = tokio::time::timeout(
            Duration::from_secs(10),
            c.get(GetRequest {
                key: format!("k{i}").into_bytes(),
            }),
        )
        .await
        .expect("get answered");
        match r {
            Ok(v) => assert_eq!(v.into_inner().value, format!("v{i}").into_bytes()),
            Err(s) if s.code() == tonic::Code::NotFound => lost.push(i),
            Err(s) => panic!("get k{i}: {s}"),
        }
    }
    assert!(
        lost.is_empty(),
        "{} of {KEYS} acknowledged writes lost after the restart (first: k{}); log:\n{}",
        lost.len(),
        lost[0],
        std::fs::read_to_string(&log).unwrap_or_default()
    );
}
