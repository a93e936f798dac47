//! The monitor's automatic failover of the dpm-node replica set (monitor/src/dpm_replicas), on
//! real processes run the way Kubernetes runs the chart's pods: fixed addresses, and a
//! "kubelet" that starts a node again whenever it exits (a node whose machine is lost is held
//! down instead). The watcher runs in this process with a pointer that records where it points
//! the clients (on Kubernetes, the primary Service's label).
//!
//! A primary lost for good is replaced by a backup that was in sync, every acknowledged write
//! is read back from it, it acknowledges new ones; the old primary, back, demotes itself and is
//! attached as a backup; then the new primary is lost too and the set fails over again. A
//! primary restarted in place is kept. A monitor that takes over from a leader that died
//! promoting a backup waits for that backup instead of promoting another.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use dinomo_monitor::dpm_replicas::{
    Alone, DpmReplicasConfig, Leadership, MemberConfig, Outcome, PrimaryPointer, Watcher,
};
use dinomo_proto::dpm::dpm_service_client::DpmServiceClient;
use dinomo_proto::dpm::replica_service_client::ReplicaServiceClient;
use dinomo_proto::dpm::{
    GetMetadataRequest, PutMetadataRequest, ReplicaStatusRequest, ReplicaStatusResponse,
};

use super::cluster::{free_port_base, INSECURE};

/// A node run as a pod: started again after it exits unless held.
struct Pod {
    name: String,
    grpc: String,
    held: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    pid: Arc<AtomicU32>,
    starts: Arc<AtomicU32>,
    kubelet: Option<std::thread::JoinHandle<()>>,
}

impl Pod {
    fn start(name: &str, dir: &Path, grpc: u16, fabric: u16, extra: &[String]) -> Pod {
        let pool = dir.join(format!("{name}.pool"));
        let log = dir.join(format!("{name}.log"));
        let mut args: Vec<String> = [
            "dpm-node",
            "--config",
            dir.join("dpm-node.toml").to_str().unwrap(),
            "--pool",
            pool.to_str().unwrap(),
            "--pool-size",
            "128MiB",
            "--fabric",
            "tcp",
            "--metrics-listen",
            "",
        ]
        .map(String::from)
        .to_vec();
        args.extend([
            "--listen".into(),
            format!("127.0.0.1:{grpc}"),
            "--fabric-listen".into(),
            format!("127.0.0.1:{fabric}"),
        ]);
        args.extend_from_slice(extra);
        let (held, stop) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let (pid, starts) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
        let kubelet = {
            let (held, stop, pid, starts) =
                (held.clone(), stop.clone(), pid.clone(), starts.clone());
            std::thread::spawn(move || kubelet(args, log, held, stop, pid, starts))
        };
        Pod {
            name: name.into(),
            grpc: format!("127.0.0.1:{grpc}"),
            held,
            stop,
            pid,
            starts,
            kubelet: Some(kubelet),
        }
    }

    /// SIGKILL; with `hold`, not started again until [`Pod::release`] (its machine is lost).
    fn kill(&self, hold: bool) {
        self.held.store(hold, Ordering::SeqCst);
        let pid = self.pid.load(Ordering::SeqCst);
        if pid != 0 {
            // SAFETY: signalling a child this test started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    }

    fn release(&self) {
        self.held.store(false, Ordering::SeqCst);
    }

    /// The node's log, without the colours' escape sequences.
    fn log(&self, dir: &Path) -> String {
        let raw =
            std::fs::read_to_string(dir.join(format!("{}.log", self.name))).unwrap_or_default();
        let mut out = String::with_capacity(raw.len());
        let mut chars = raw.chars();
        while let Some(c) = chars.next() {
            if c == '\u{1b}' {
                // CSI: ESC [ parameters final-letter
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            } else {
                out.push(c);
            }
        }
        out
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.kill(true);
        if let Some(k) = self.kubelet.take() {
            let _ = k.join();
        }
    }
}

fn kubelet(
    args: Vec<String>,
    log: PathBuf,
    held: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    pid: Arc<AtomicU32>,
    starts: Arc<AtomicU32>,
) {
    while !stop.load(Ordering::SeqCst) {
        if held.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_dinomo"))
            .args(&args)
            .env(INSECURE.0, INSECURE.1)
            .env("DINOMO_LOG", "info")
            .env("DINOMO_DPM_PREFAULT", "false")
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("starting dinomo dpm-node");
        pid.store(child.id(), Ordering::SeqCst);
        starts.fetch_add(1, Ordering::SeqCst);
        // Poll, so that stop is seen while the node runs.
        loop {
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            if stop.load(Ordering::SeqCst) {
                let _ = child.kill();
                let _ = child.wait();
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        pid.store(0, Ordering::SeqCst);
        // CrashLoopBackOff's first delays are longer; short here to keep the test short.
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// Records where the watcher points the clients.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<usize>>>);

#[async_trait]
impl PrimaryPointer for Recorder {
    async fn point_at(&self, _: &[MemberConfig], to: usize) -> anyhow::Result<()> {
        self.0.lock().unwrap().push(to);
        Ok(())
    }
}

impl Recorder {
    fn last(&self) -> Option<usize> {
        self.0.lock().unwrap().last().copied()
    }
}

/// Bounds a call of this test to a node (a hung node must fail the test, not hang it).
async fn within<T>(f: impl std::future::Future<Output = Option<T>>) -> Option<T> {
    tokio::time::timeout(Duration::from_secs(5), f)
        .await
        .ok()
        .flatten()
}

async fn status(addr: &str) -> Option<ReplicaStatusResponse> {
    within(async {
        let mut c = ReplicaServiceClient::connect(format!("http://{addr}"))
            .await
            .ok()?;
        Some(c.status(ReplicaStatusRequest {}).await.ok()?.into_inner())
    })
    .await
}

async fn put(addr: &str, name: &str) -> Result<(), String> {
    let put = async {
        let mut c = DpmServiceClient::connect(format!("http://{addr}"))
            .await
            .map_err(|e| e.to_string())?;
        c.put_metadata(PutMetadataRequest {
            name: name.into(),
            value: Some(name.as_bytes().to_vec()),
        })
        .await
        .map(|_| ())
        .map_err(|s| s.message().to_string())
    };
    tokio::time::timeout(Duration::from_secs(5), put)
        .await
        .map_err(|_| "no answer within 5 s".to_string())?
}

/// `name`'s value at `addr` (`Ok(None)`: the node answered that it holds none), or why the
/// call failed.
async fn get(addr: &str, name: &str) -> Result<Option<Vec<u8>>, String> {
    let get = async {
        let mut c = DpmServiceClient::connect(format!("http://{addr}"))
            .await
            .map_err(|e| e.to_string())?;
        c.get_metadata(GetMetadataRequest { name: name.into() })
            .await
            .map(|r| r.into_inner().value)
            .map_err(|s| s.message().to_string())
    };
    tokio::time::timeout(Duration::from_secs(5), get)
        .await
        .map_err(|_| "no answer within 5 s".to_string())?
}

/// Runs watcher rounds until `done` says so (or panics after `limit`, with the pods' logs).
async fn rounds_until(
    watcher: &mut Watcher,
    pods: &[&Pod],
    dir: &Path,
    limit: Duration,
    what: &str,
    mut done: impl FnMut(&Outcome) -> bool,
) -> Outcome {
    let started = Instant::now();
    loop {
        let o = watcher.round().await;
        if done(&o) {
            return o;
        }
        if started.elapsed() > limit {
            fail(
                pods,
                dir,
                &format!("{what}: not within {limit:?}; last round {o:?}"),
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Kills `pods[victim]` for good (held down) and runs rounds until a backup is promoted and
/// serves; the promoted member.
async fn kill_and_fail_over(
    watcher: &mut Watcher,
    pods: &[&Pod],
    d: &Path,
    victim: usize,
) -> usize {
    pods[victim].kill(true);
    let what = format!("a promotion after {} was killed", pods[victim].name);
    let o = rounds_until(watcher, pods, d, Duration::from_secs(30), &what, |o| {
        matches!(o, Outcome::Promoted { .. })
    })
    .await;
    let Outcome::Promoted { member } = o else {
        unreachable!()
    };
    assert_ne!(member, victim);
    let what = format!("{} serving once promoted", pods[member].name);
    rounds_until(watcher, pods, d, Duration::from_secs(60), &what, |o| {
        *o == Outcome::Serving { primary: member }
    })
    .await;
    member
}

/// Writes `n` keys named `prefix-i` through `primary`, each acknowledged (retrying while the
/// primary is not ready to acknowledge yet: no backup in sync).
async fn write_keys(primary: &str, prefix: &str, n: u32) -> Vec<String> {
    let mut keys = Vec::new();
    for i in 0..n {
        let key = format!("dinomo-test/{prefix}-{i}");
        let deadline = Instant::now() + Duration::from_secs(30);
        while let Err(e) = put(primary, &key).await {
            assert!(Instant::now() < deadline, "writing {key} to {primary}: {e}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        keys.push(key);
    }
    keys
}

/// Every key of `keys` reads back at `primary`. A call that fails (a loaded machine, a node
/// still starting) is asked again for up to 30 s; an answer without the value fails at once.
async fn assert_all_read(primary: &str, keys: &[String]) {
    for k in keys {
        let deadline = Instant::now() + Duration::from_secs(30);
        let value = loop {
            match get(primary, k).await {
                Ok(v) => break v,
                Err(e) if Instant::now() < deadline => {
                    println!("reading {k} at {primary}: {e}; asking again");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("reading {k} at {primary}: {e}, for 30 s"),
            }
        };
        assert_eq!(
            value.as_deref(),
            Some(k.as_bytes()),
            "{k}, acknowledged before the failover, is missing at {primary}"
        );
    }
}

/// A primary `p` and backups `b1`, `b2` on fixed ports, as pods, with the chart's dpm-node
/// settings that matter here (the primary re-attaches a failed backup by itself).
fn replica_set(d: &Path) -> [Pod; 3] {
    std::fs::write(
        d.join("dpm-node.toml"),
        "replica_ack_timeout_ms = 2000\nreattach_failed_backups = true\n",
    )
    .unwrap();
    let base = free_port_base(&[0, 1, 2, 3, 4, 5]);
    let addr = |i: u16| format!("127.0.0.1:{}", base + 2 * i);
    let backup = ["--role".to_string(), "backup".to_string()];
    let b1 = Pod::start("b1", d, base + 2, base + 3, &backup);
    let b2 = Pod::start("b2", d, base + 4, base + 5, &backup);
    let p = Pod::start(
        "p",
        d,
        base,
        base + 1,
        &["--backup".into(), addr(1), "--backup".into(), addr(2)],
    );
    [p, b1, b2]
}

/// The watcher's config for `pods`, checking every 100 ms.
fn watching(pods: &[&Pod]) -> DpmReplicasConfig {
    let cfg = DpmReplicasConfig {
        members: pods
            .iter()
            .map(|p| MemberConfig {
                address: p.grpc.clone(),
                pod: p.name.clone(),
            })
            .collect(),
        check_every_ms: 100,
        // The default: a debug-build restart in place must answer within it, on a loaded CI
        // machine too.
        failover_after_ms: 3000,
        // A debug-build pool of these tests opens within a second: a promoted backup still
        // silent after 3 s is reported stuck (the mid-promotion test waits for that report).
        promotion_stuck_after_ms: 3000,
        ..DpmReplicasConfig::default()
    };
    cfg.validate(true).unwrap();
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_monitor_fails_the_dpm_primary_over_twice_and_keeps_every_write() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let [p, b1, b2] = replica_set(d);
    let pods = [&p, &b1, &b2];
    let cfg = watching(&pods);
    let pointer = Recorder::default();
    let mut watcher = Watcher::new(cfg, Box::new(Alone), Box::new(pointer.clone()));

    // The primary serves with its backups in sync: the clients are pointed at it.
    rounds_until(
        &mut watcher,
        &pods,
        d,
        Duration::from_secs(60),
        "p serving",
        |o| *o == Outcome::Serving { primary: 0 },
    )
    .await;
    assert_eq!(pointer.last(), Some(0));
    let mut keys = write_keys(&p.grpc, "before", 20).await;

    // Restarted in place (its pool intact): kept, not failed over.
    p.kill(false);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let o = watcher.round().await;
        let in_sync = status(&p.grpc).await.map_or(0, |s| {
            s.backups.iter().filter(|b| b.state == "in-sync").count()
        });
        if p.starts.load(Ordering::SeqCst) == 2 && in_sync == 2 {
            assert_eq!(o, Outcome::Serving { primary: 0 });
            break;
        }
        assert!(
            !matches!(o, Outcome::Promoted { .. }),
            "p restarted in place was failed over"
        );
        if Instant::now() > deadline {
            fail(&pods, d, "p restarted in place with its backups in sync");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Labelled again under its new term: a pod recreated by its StatefulSet comes back
    // without the label, and every start takes a new term. (The watcher also labels again
    // every 10 s: a slow run may show more.)
    let pointed = pointer.0.lock().unwrap().clone();
    assert!(
        pointed.len() >= 2 && pointed.iter().all(|&m| m == 0),
        "p restarted in place was failed over, or not labelled again: {pointed:?}"
    );
    keys.extend(write_keys(&p.grpc, "after-restart", 10).await);

    // Its machine is lost: a backup that was in sync is promoted and pointed at.
    let killed = Instant::now();
    let first = kill_and_fail_over(&mut watcher, &pods, d, 0).await;
    assert!(first == 1 || first == 2);
    let new_primary = pods[first].grpc.clone();
    let promoted_serving = killed.elapsed();
    assert_eq!(pointer.last(), Some(first));
    assert_all_read(&new_primary, &keys).await;
    keys.extend(write_keys(&new_primary, "after-failover-1-first", 1).await);
    let first_write = killed.elapsed();
    keys.extend(write_keys(&new_primary, "after-failover-1", 10).await);
    println!(
        "failover 1: {} promoted and serving {} ms after the kill; first write acknowledged \
         {} ms after the kill",
        pods[first].name,
        promoted_serving.as_millis(),
        first_write.as_millis()
    );

    // The old primary comes back: it demotes itself (a newer primary holds its backups) and
    // is attached as a backup of the new one.
    p.release();
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        watcher.round().await;
        let in_sync = status(&new_primary).await.map_or(0, |s| {
            s.backups.iter().filter(|b| b.state == "in-sync").count()
        });
        let p_role = status(&p.grpc).await.map(|s| s.role);
        if in_sync == 2 && p_role.as_deref() == Some("backup") {
            break;
        }
        if Instant::now() > deadline {
            fail(
                &pods,
                d,
                &format!("p a backup of {new_primary} in sync (in sync: {in_sync}, p: {p_role:?})"),
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "the old primary was started {} times",
        p.starts.load(Ordering::SeqCst)
    );
    // Attached once: the promoted primary reports a named backup it has not reached yet as
    // "attaching", so the watcher does not add it a second time (which copied it again).
    let attaches = pods[first]
        .log(d)
        .lines()
        .filter(|l| l.contains("backup added") && l.contains(&format!("backup={}", p.grpc)))
        .count();
    assert_eq!(
        attaches, 1,
        "{} attached the old primary {attaches} times",
        pods[first].name
    );

    // The new primary's machine is lost too: the set fails over again.
    let killed = Instant::now();
    let second = kill_and_fail_over(&mut watcher, &pods, d, first).await;
    assert_ne!(second, first);
    let newest = pods[second].grpc.clone();
    assert_eq!(pointer.last(), Some(second));
    assert_all_read(&newest, &keys).await;
    keys.extend(write_keys(&newest, "after-failover-2", 10).await);
    println!(
        "failover 2: {} serving {} ms after the kill; {} keys read back, pointed at {:?}",
        pods[second].name,
        killed.elapsed().as_millis(),
        keys.len(),
        pointer.0.lock().unwrap()
    );
}

/// A Lease two watchers share, as two monitor pods share theirs: who leads, the note the
/// leader leaves ([`Leadership::leave_note`]), and whether writing a note fails (an API server
/// that does not answer).
#[derive(Clone, Default)]
struct SharedLease(Arc<Mutex<(usize, Option<String>, bool)>>);

/// One monitor's view of a [`SharedLease`].
struct Holder {
    lease: SharedLease,
    me: usize,
}

#[async_trait]
impl Leadership for Holder {
    async fn leads(&self) -> bool {
        self.lease.0.lock().unwrap().0 == self.me
    }

    async fn leave_note(&self, note: Option<String>) -> anyhow::Result<bool> {
        let mut l = self.lease.0.lock().unwrap();
        if l.2 {
            anyhow::bail!("the API server does not answer");
        }
        if l.0 != self.me {
            return Ok(false);
        }
        l.1 = note;
        Ok(true)
    }

    async fn note(&self) -> anyhow::Result<Option<String>> {
        Ok(self.lease.0.lock().unwrap().1.clone())
    }
}

/// The leading monitor promotes a backup and dies; the promoted backup answers nothing yet
/// (here: it is down; on Kubernetes it may be opening a large pool). The standby that takes
/// over holds the same observation, by which the other backup, in sync and complete, could
/// be promoted: it must read its predecessor's note and wait for the promoted backup instead
/// (two promoted backups take one term and stop each other, and the set serves nothing). Once
/// the promoted backup is back and serving, the new leader follows it and removes the note.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_monitor_taking_over_mid_promotion_waits_for_the_backup_its_predecessor_promoted() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let [p, b1, b2] = replica_set(d);
    let pods = [&p, &b1, &b2];
    let lease = SharedLease::default();
    let watcher_of = |me: usize| {
        let holder = Holder {
            lease: lease.clone(),
            me,
        };
        let pointer = Recorder::default();
        let watcher = Watcher::new(watching(&pods), Box::new(holder), Box::new(pointer.clone()));
        (watcher, pointer)
    };
    let ((mut leader, _), (mut standby, standby_pointer)) = (watcher_of(0), watcher_of(1));

    // Both watch p serve with both backups in sync; only the leader acts.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let o = leader.round().await;
        assert_eq!(standby.round().await, Outcome::Standby);
        if o == (Outcome::Serving { primary: 0 }) && in_sync_backups(&p.grpc).await == 2 {
            // One more round each, so that both observed p with both backups in sync.
            leader.round().await;
            standby.round().await;
            break;
        }
        if Instant::now() > deadline {
            fail(&pods, d, "p serving with both backups in sync");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let p_term = status_eventually(&p.grpc).await.term;

    // p's machine is lost. While the note cannot be written, the leader promotes nothing.
    lease.0.lock().unwrap().2 = true;
    p.kill(true);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let o = leader.round().await;
        standby.round().await;
        assert!(
            !matches!(o, Outcome::Promoted { .. }),
            "promoted without a note: {o:?}"
        );
        if matches!(&o, Outcome::Failed(why) if why.contains("noting the promotion")) {
            break;
        }
        if Instant::now() > deadline {
            fail(
                &pods,
                d,
                &format!("a promotion held back for its note; last round {o:?}"),
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for b in [&b1, &b2] {
        assert_eq!(status_eventually(&b.grpc).await.role, "backup");
    }
    // Then the leader promotes a backup, which is lost at once (before it serves, before the
    // standby's next round), and so is the leader: the standby takes over.
    lease.0.lock().unwrap().2 = false;
    let promoted = loop {
        let o = leader.round().await;
        if let Outcome::Promoted { member } = o {
            pods[member].kill(true);
            break member;
        }
        standby.round().await;
        if Instant::now() > deadline + Duration::from_secs(30) {
            fail(
                &pods,
                d,
                &format!("a promotion after p was lost; last round {o:?}"),
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let other = 3 - promoted;
    let noted = lease.0.lock().unwrap().1.clone();
    assert!(
        noted
            .as_deref()
            .is_some_and(|n| n.starts_with(&format!("{} ", pods[promoted].grpc))),
        "the leader noted its promotion before asking for it: {noted:?}"
    );
    drop(leader);
    lease.0.lock().unwrap().0 = 1;

    // Past the failover delay, twice over: the new leader promotes nobody else, and says why.
    let waiting_since = Instant::now();
    let mut last = None;
    while waiting_since.elapsed() < Duration::from_secs(7) {
        let o = standby.round().await;
        assert!(
            !matches!(o, Outcome::Promoted { .. }),
            "the new leader promoted a second backup while {} was being promoted: {o:?}",
            pods[promoted].name
        );
        last = Some(o);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let Some(Outcome::Stuck(why)) = last else {
        fail(
            &pods,
            d,
            &format!("stuck waiting for the promoted backup; last round {last:?}"),
        );
    };
    let s = status_eventually(&pods[other].grpc).await;
    assert_eq!(s.role, "backup", "{} was promoted too", pods[other].name);
    // Unless the promoted backup reached the other one before it was killed (it raised that
    // one's term: the plan is stuck by the newer-term rule first), it is the note's pin that
    // holds the new leader back.
    if s.term.max(s.copy_term) == p_term {
        assert!(
            why.contains(&pods[promoted].grpc) && why.contains("promoting no other backup"),
            "{why}"
        );
    } else {
        println!(
            "the promoted backup reached {} first: {why}",
            pods[other].name
        );
    }

    // The promoted backup comes back: it starts as the primary it was made, attaches the
    // other backup, and the new leader follows it, and removes the note once that backup is
    // in sync with it (until then the old primary could still report one: a next leader
    // needs the note).
    pods[promoted].release();
    rounds_until(
        &mut standby,
        &pods,
        d,
        Duration::from_secs(90),
        "the promoted backup serving under the new leader",
        |o| *o == Outcome::Serving { primary: promoted },
    )
    .await;
    rounds_until(
        &mut standby,
        &pods,
        d,
        Duration::from_secs(90),
        "the note removed once a backup is in sync with the promoted one",
        |o| {
            assert!(
                !matches!(o, Outcome::Serving { primary } if *primary != promoted),
                "{o:?}"
            );
            lease.0.lock().unwrap().1.is_none()
        },
    )
    .await;
    assert_eq!(
        standby_pointer.last(),
        Some(promoted),
        "the clients follow it"
    );
}

/// `addr`'s status, asked again for up to 30 s while it does not answer (a loaded machine).
async fn status_eventually(addr: &str) -> ReplicaStatusResponse {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match status(addr).await {
            Some(s) => return s,
            None if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            None => panic!("{addr} did not answer Status for 30 s"),
        }
    }
}

fn fail(pods: &[&Pod], dir: &Path, what: &str) -> ! {
    let logs: Vec<String> = pods
        .iter()
        .map(|p| format!("--- {}:\n{}", p.name, p.log(dir)))
        .collect();
    panic!("{what}\n{}", logs.join("\n"));
}

/// What a Kubernetes Service does for the primary: a fixed address whose connections go to
/// the pod the watcher labelled; a change drops the connections to the previous one (its
/// pod is gone, or is no primary any more).
struct ServiceProxy {
    addr: String,
    backend: Arc<tokio::sync::watch::Sender<Option<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl ServiceProxy {
    async fn start() -> ServiceProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let backend = Arc::new(tokio::sync::watch::channel(None::<String>).0);
        let b = backend.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                let mut changed = b.subscribe();
                let Some(to) = changed.borrow_and_update().clone() else {
                    continue;
                };
                tokio::spawn(async move {
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(&to).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = changed.changed() => {}
                    }
                });
            }
        });
        ServiceProxy {
            addr,
            backend,
            task,
        }
    }
}

impl Drop for ServiceProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Points the proxy at the labelled member, and records it.
struct Label {
    proxy: Arc<tokio::sync::watch::Sender<Option<String>>>,
    recorder: Recorder,
}

#[async_trait]
impl PrimaryPointer for Label {
    async fn point_at(&self, members: &[MemberConfig], to: usize) -> anyhow::Result<()> {
        self.proxy.send_replace(Some(members[to].address.clone()));
        self.recorder.point_at(members, to).await
    }
}

async fn in_sync_backups(addr: &str) -> usize {
    status(addr).await.map_or(0, |s| {
        s.backups.iter().filter(|b| b.state == "in-sync").count()
    })
}

/// KV nodes and SDK clients reach the dpm-node only through a Service-like proxy that the
/// watcher points; the primary is killed (and held down, its machine lost) `kills` times
/// under a Zipf load, each time once both backups are in sync; the old one is let back
/// before the next kill. Every kill must fail over, the KNs must write again through the
/// promoted primary (whose fabric address is another: they learn it when they register
/// again), and the history must be linearizable (an acknowledged write lost is a violation).
/// `DINOMO_AUTO_FAILOVER_KILLS` (default 2); `scripts/dpm-auto-failover.sh` runs the long form.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_nodes_follow_the_primary_the_monitor_promotes_under_load() {
    use super::cluster::Proc;
    use super::e2e::{start_load_with, Keys};
    use dinomo_checker::{check, History, Op, Res};
    use dinomo_client::{Client, ClientConfig, ClientError};
    use dinomo_placement::{ClusterMap, KnInfo};

    const KEYS: u32 = 64;
    let kills: u32 = std::env::var("DINOMO_AUTO_FAILOVER_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let pods = replica_set(d);
    let pods_ref = [&pods[0], &pods[1], &pods[2]];
    let service = ServiceProxy::start().await;
    let recorder = Recorder::default();
    let mut watcher = Watcher::new(
        watching(&pods_ref),
        Box::new(Alone),
        Box::new(Label {
            proxy: service.backend.clone(),
            recorder: recorder.clone(),
        }),
    );
    rounds_until(
        &mut watcher,
        &pods_ref,
        d,
        Duration::from_secs(60),
        "p serving",
        |o| *o == Outcome::Serving { primary: 0 },
    )
    .await;
    let watching = tokio::spawn(watcher.run());

    let dpm = service.addr.clone();
    let mut kns = Vec::new();
    let mut infos = Vec::new();
    for id in 1..=2u32 {
        let kn = Proc::spawn(
            &[
                "kv-node",
                "--kn-id",
                &id.to_string(),
                "--listen",
                "127.0.0.1:0",
                "--dpm",
                &dpm,
                "--metrics-listen",
                "",
                "--cache-size",
                "1MiB",
            ],
            &d.join(format!("kn{id}.log")),
            "addr=",
        );
        infos.push(KnInfo {
            id,
            endpoint: kn.addr.clone(),
        });
        kns.push(kn);
    }
    let routing = Proc::spawn(
        &[
            "routing-node",
            "--listen",
            "127.0.0.1:0",
            "--dpm",
            &dpm,
            "--metrics-listen",
            "",
            "--poll-ms",
            "20",
        ],
        &d.join("routing.log"),
        "addr=",
    );
    dinomo_client::admin::publish_map(&dpm, &ClusterMap::new(infos, 64, 1).unwrap())
        .await
        .unwrap();
    let client = |deadline| {
        let mut cfg = ClientConfig::new(&[&routing.addr]);
        cfg.deadline = deadline;
        Client::connect_with(cfg)
    };
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(client(Duration::from_secs(60)).await.unwrap());
    }
    let probe = client(Duration::from_secs(30)).await.unwrap();
    let history = Arc::new(History::new());
    let load = start_load_with(
        clients,
        Keys::zipf(KEYS, 1.2),
        1_000_000,
        history.clone(),
        0,
    );

    let mut failure = None;
    let mut times = Vec::new();
    for k in 0..kills {
        let primary = recorder.last().unwrap();
        let deadline = Instant::now() + Duration::from_secs(90);
        while in_sync_backups(&pods[primary].grpc).await < 2 {
            if Instant::now() > deadline {
                failure = Some(format!(
                    "kill {}: the backups of {} not in sync",
                    k + 1,
                    pods[primary].name
                ));
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if failure.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(300 + 400 * u64::from(k % 3))).await;
        let killed = Instant::now();
        pods[primary].kill(true);
        let written = loop {
            match probe.put(&b"failover-probe"[..], format!("p{k}")).await {
                Ok(()) => break Ok(killed.elapsed()),
                Err(ClientError::OutcomeUnknown(_))
                    if killed.elapsed() < Duration::from_secs(60) => {}
                Err(e) => break Err(format!("kill {}: probe write: {e}", k + 1)),
            }
        };
        let now = recorder.last().unwrap();
        match written {
            Ok(t) if now != primary => times.push(t.as_millis()),
            Ok(_) => {
                failure = Some(format!(
                    "kill {}: a write was acknowledged but nobody was promoted",
                    k + 1
                ))
            }
            Err(e) => failure = Some(e),
        }
        pods[primary].release();
        if failure.is_some() {
            break;
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (_, seen) = load.finish().await;
    for key in 0..KEYS {
        let key = format!("key{key}").into_bytes();
        let h = history.invoke(999, Op::Get { key: key.clone() });
        match probe.get(key).await {
            Ok(v) => history.complete(h, Res::Value(v.map(|b| b.to_vec()))),
            Err(e) => {
                history.complete_unknown(h);
                failure.get_or_insert(format!("read-back failed: {e}"));
            }
        }
    }
    watching.abort();
    let h2 = history.clone();
    let verdict = tokio::task::spawn_blocking(move || check(&h2))
        .await
        .unwrap();
    let ops = seen.ops.load(Ordering::Relaxed);
    let (errors, unknown) = (
        seen.errors.load(Ordering::Relaxed),
        seen.unknown.load(Ordering::Relaxed),
    );
    times.sort_unstable();
    println!(
        "AUTO-FAILOVER kills={} ops={ops} unknown={unknown} other_errors={} violations={} \
         first_write_ms={times:?} pointed={:?}",
        times.len(),
        errors - unknown,
        u32::from(verdict.is_err()),
        recorder.0.lock().unwrap()
    );
    if let Err(v) = verdict {
        fail(&pods_ref, d, &format!("VIOLATION: {v}"));
    }
    if let Some(f) = failure {
        fail(&pods_ref, d, &f);
    }
    assert_eq!(times.len(), kills as usize);
    assert_eq!(
        errors, unknown,
        "only outcome-unknown writes may reach a caller"
    );
    drop(kns);
}
