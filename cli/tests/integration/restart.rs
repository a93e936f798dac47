//! Restarts of single nodes: whatever a node acknowledged before it died is readable after it
//! (or its replacement) is back.

use std::time::Duration;

use dinomo_proto::kv::kv_service_client::KvServiceClient;
use dinomo_proto::kv::{GetRequest, PutMode, PutRequest};

use super::cluster::{dpm_and_routing, Proc, Role, UpCluster};

const KEYS: u32 = 200;

/// A free port outside the ephemeral range: the KN is started again on it.
fn free_port() -> u16 {
    super::cluster::free_port_base(&[0])
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
    KvServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
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
            key: format!("k{i}").into(),
            value: format!("v{i}").into(),
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
                key: format!("k{i}").into(),
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

/// Finding 8 of issue 10: under `dinomo up`, a dpm-node killed with SIGKILL is restarted,
/// and the cluster carries on: every acknowledged write is readable and new writes succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_restarts_a_killed_dpm_node_and_the_cluster_carries_on() {
    let mut up = UpCluster::start_on("shm", 1, 1, None);
    let mut cfg = dinomo_client::ClientConfig::new(&[up.routing_addr()]);
    cfg.deadline = Duration::from_secs(5);
    let client = dinomo_client::Client::connect_with(cfg).await.unwrap();
    for i in 0..KEYS {
        client
            .put(format!("k{i}").into_bytes(), format!("v{i}").into_bytes())
            .await
            .unwrap_or_else(|e| panic!("put k{i}: {e}"));
    }
    let pid = up.pid(Role::Dpm).expect("the dpm-node runs");
    // SAFETY: a process of this test's cluster.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let killed = std::time::Instant::now();
    // With shm, a KN writes into the pool file itself: writes may go on while no dpm-node
    // runs. Recovery counts from the moment the new dpm-node runs, whose new grant table
    // refuses the KN's old session: a write then succeeds only once the KN registered again.
    let new_pid = loop {
        match up.pid(Role::Dpm) {
            Some(p) if p != pid => break p,
            _ if killed.elapsed() > Duration::from_secs(60) => {
                up.dump_logs(30);
                panic!("no new dpm-node within 60 s");
            }
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    // Recovered = the old writes read back and a new write is acknowledged.
    let mut last_err = String::new();
    let recovered = loop {
        if !up.running() {
            up.dump_logs(30);
            panic!("dinomo up exited after its dpm-node was killed");
        }
        if killed.elapsed() > Duration::from_secs(60) {
            break None;
        }
        let attempt = async {
            if up.pid(Role::Dpm) != Some(new_pid) {
                return Err(dinomo_client::ClientError::Other(
                    "dpm-node not up yet".into(),
                ));
            }
            client.put(&b"after"[..], &b"restart"[..]).await?;
            for i in 0..KEYS {
                let v = client.get(format!("k{i}").into_bytes()).await?;
                if v.as_deref() != Some(format!("v{i}").as_bytes()) {
                    return Err(dinomo_client::ClientError::Other(format!(
                        "k{i} reads {v:?}"
                    )));
                }
            }
            Ok::<_, dinomo_client::ClientError>(())
        };
        match attempt.await {
            Ok(()) => break Some(killed.elapsed()),
            Err(e) => last_err = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let Some(took) = recovered else {
        up.dump_logs(30);
        panic!("the cluster did not recover within 60 s of the dpm-node kill: {last_err}");
    };
    println!(
        "recovered {:.1} s after the dpm-node was killed",
        took.as_secs_f64()
    );
    // Everything acknowledged is in the pool: a whole new cluster on the same data reads it.
    let up = up.restart();
    for i in 0..KEYS {
        let v = client.get(format!("k{i}").into_bytes()).await;
        assert_eq!(
            v.as_ref().ok().and_then(|v| v.as_deref()),
            Some(format!("v{i}").as_bytes()),
            "k{i} after a restart of the whole cluster: {v:?}"
        );
    }
    let v = client.get(&b"after"[..]).await.unwrap();
    assert_eq!(v.as_deref(), Some(&b"restart"[..]));
    drop(up);
}
