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

/// A base port for `dinomo up` such that every port it uses (see `up --help`) is free now.
fn free_up_port_base(kns: u16) -> u16 {
    let mut offsets = vec![0u16, 1, 200, 300, 2000, 2200, 2300];
    for i in 1..=kns {
        offsets.extend([100 + i, 2100 + i]);
    }
    for _ in 0..200 {
        let base = 20_000 + rand::random_range(0..40_000u16);
        if offsets
            .iter()
            .all(|o| std::net::TcpListener::bind(("127.0.0.1", base + o)).is_ok())
        {
            return base;
        }
    }
    panic!("no free port range for dinomo up");
}

/// `dinomo up` as a child process, stopped (SIGTERM, then SIGKILL) when dropped.
struct Up {
    child: std::process::Child,
    data: std::path::PathBuf,
}

impl Up {
    fn start(data: &std::path::Path, base: u16) -> Up {
        use std::io::BufRead;
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_dinomo"))
            .args(["up", "--data-dir", data.to_str().unwrap()])
            .args(["--kns", "1", "--shards", "1", "--cache-size", "1MiB"])
            .args(["--pool-size", "256MiB", "--port-base", &base.to_string()])
            .env("DINOMO_LOG", "info")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let up = Up {
            child,
            data: data.to_path_buf(),
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(90);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match rx.recv_timeout(left) {
                Ok(l) if l.starts_with("Press Ctrl-C") => return up,
                Ok(_) => {}
                Err(_) => {
                    up.dump_logs();
                    panic!("dinomo up did not come up");
                }
            }
        }
    }

    fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The pid of the dpm-node that `up` started (found by its pool path).
    fn dpm_pid(&self) -> Option<i32> {
        let pool = self.data.join("dinomo.pool");
        let out = std::process::Command::new("pgrep")
            .args(["-f", &format!("dpm-node --pool {}", pool.display())])
            .output()
            .expect("pgrep");
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .next()
            .and_then(|p| p.parse().ok())
    }

    fn dump_logs(&self) {
        for name in ["dpm-node", "monitor", "routing-node", "kn-1"] {
            let p = self.data.join("logs").join(format!("{name}.log"));
            let log = std::fs::read_to_string(&p).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            for l in tail.into_iter().rev() {
                eprintln!("{name}| {l}");
            }
        }
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::time::Instant::now() < deadline {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Finding 8 of issue 10: under `dinomo up`, a dpm-node killed with SIGKILL is restarted,
/// and the cluster carries on: every acknowledged write is readable and new writes succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_restarts_a_killed_dpm_node_and_the_cluster_carries_on() {
    let dir = tempfile::tempdir().unwrap();
    let base = free_up_port_base(1);
    let mut up = Up::start(dir.path(), base);
    let mut cfg = dinomo_client::ClientConfig::new(&[&format!("127.0.0.1:{}", base + 200)]);
    cfg.deadline = Duration::from_secs(5);
    let client = dinomo_client::Client::connect_with(cfg).await.unwrap();
    for i in 0..KEYS {
        client
            .put(format!("k{i}").into_bytes(), format!("v{i}").into_bytes())
            .await
            .unwrap_or_else(|e| panic!("put k{i}: {e}"));
    }
    let pid = up.dpm_pid().expect("the dpm-node runs");
    // SAFETY: a process of this test's cluster.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let killed = std::time::Instant::now();
    // With shm, a KN writes into the pool file itself: writes may go on while no dpm-node
    // runs. Recovery counts from the moment the new dpm-node runs, whose new grant table
    // refuses the KN's old session: a write then succeeds only once the KN registered again.
    let new_pid = loop {
        match up.dpm_pid() {
            Some(p) if p != pid => break p,
            _ if killed.elapsed() > Duration::from_secs(60) => {
                up.dump_logs();
                panic!("no new dpm-node within 60 s");
            }
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    // Recovered = the old writes read back and a new write is acknowledged.
    let mut last_err = String::new();
    let recovered = loop {
        if !up.running() {
            up.dump_logs();
            panic!("dinomo up exited after its dpm-node was killed");
        }
        if killed.elapsed() > Duration::from_secs(60) {
            break None;
        }
        let attempt = async {
            if up.dpm_pid() != Some(new_pid) {
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
        up.dump_logs();
        panic!("the cluster did not recover within 60 s of the dpm-node kill: {last_err}");
    };
    println!(
        "recovered {:.1} s after the dpm-node was killed",
        took.as_secs_f64()
    );
    // Everything acknowledged is in the pool: a whole new cluster on the same data reads it.
    drop(up);
    let up = Up::start(dir.path(), base);
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
