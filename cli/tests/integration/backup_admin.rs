//! `dinomo admin add-backup` / `remove-backup` / `promote-backup`: an operator changes a
//! running primary's replica set (a failed backup holds every acknowledgement until it is
//! removed or added again) and, the primary lost, makes a backup the primary in place (not a
//! removed one: its copy is older); each prints the set after the change; a wrong address
//! fails with the node's reason.

use std::time::{Duration, Instant};

use dinomo_proto::dpm::replica_service_client::ReplicaServiceClient;
use dinomo_proto::dpm::{ReplicaStatusRequest, ReplicaStatusResponse};

use tonic_health::pb::health_check_response::ServingStatus;

use super::cluster::{spawn_dpm, INSECURE};
use super::deploy::wait_health;

async fn primary_status(dpm: &str) -> ReplicaStatusResponse {
    let mut c = ReplicaServiceClient::connect(format!("http://{dpm}"))
        .await
        .expect("connecting to the primary");
    c.status(ReplicaStatusRequest {})
        .await
        .unwrap()
        .into_inner()
}

/// Runs `dinomo admin ARGS --insecure`; whether it succeeded, and its stdout and stderr.
async fn admin(args: &[&str]) -> (bool, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_dinomo"))
        .arg("admin")
        .args(args)
        .env(INSECURE.0, INSECURE.1)
        .env("RUST_BACKTRACE", "0")
        .output()
        .await
        .unwrap_or_else(|e| panic!("running dinomo admin {args:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("$ dinomo admin {}\n{text}", args.join(" "));
    (out.status.success(), text)
}

#[tokio::test]
async fn an_operator_adds_and_removes_backups() {
    let dir = tempfile::tempdir().unwrap();
    let sub = |name: &str| {
        let d = dir.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        d
    };
    let backup_args = ["--role", "backup", "--fabric", "tcp"];
    let b1 = spawn_dpm(&sub("b1"), &backup_args);
    // b2's probes go to a plain-text health listener, as kubelet's do: they must follow it
    // from backup to primary.
    let b2_health = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let b2 = spawn_dpm(
        &sub("b2"),
        &[backup_args.as_slice(), &["--health-addr", &b2_health]].concat(),
    );
    let primary = spawn_dpm(&sub("p"), &["--fabric", "tcp", "--backup", &b1.addr]);

    let (ok, out) = admin(&["add-backup", &b2.addr, "--dpm", &primary.addr]).await;
    assert!(ok, "{out}");
    assert!(out.contains(&format!("added backup {}", b2.addr)), "{out}");
    assert!(
        out.contains(&b1.addr) && out.contains(&b2.addr),
        "the set lists both: {out}"
    );

    // The added backup is copied and counts once in sync; removing the other one (in sync
    // too, so its copy is complete) leaves it alone in the set.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = primary_status(&primary.addr).await;
        if s.backups.len() == 2 && s.backups.iter().all(|b| b.state == "in-sync") {
            break;
        }
        assert!(Instant::now() < deadline, "not both in sync: {s:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (ok, out) = admin(&["remove-backup", &b1.addr, "--dpm", &primary.addr]).await;
    assert!(ok, "{out}");
    assert!(
        out.contains(&format!("removed backup {}", b1.addr)),
        "{out}"
    );
    let listed: Vec<&str> = out
        .lines()
        .filter(|l| l.trim_start().starts_with("backup "))
        .collect();
    assert!(
        listed.len() == 1 && listed[0].contains(&b2.addr) && listed[0].contains("in-sync"),
        "{out}"
    );

    // Wrong addresses: the primary's reason, and a failure exit.
    let (ok, out) = admin(&["remove-backup", &b1.addr, "--dpm", &primary.addr]).await;
    assert!(
        !ok && out.contains("is not a backup of this primary"),
        "{out}"
    );
    let (ok, out) = admin(&["add-backup", &b1.addr, "--dpm", &b2.addr]).await;
    assert!(!ok && out.contains("this dpm-node is a backup"), "{out}");

    // The primary is lost: the operator promotes b2, which replicates to b1 from then on.
    let old_term = primary_status(&primary.addr).await.term;
    let mut primary = primary;
    primary.kill9();
    // b1, removed while in sync, holds a complete copy too, but of an older generation of the
    // set: promoting it is refused before anything changes (b2 would refuse it anyway).
    let (ok, out) = admin(&["promote-backup", &b1.addr, "--backup", &b2.addr]).await;
    assert!(
        !ok && out.contains(&format!("Promote {} instead", b2.addr)),
        "{out}"
    );
    assert_eq!(primary_status(&b1.addr).await.role, "backup");
    let (ok, out) = admin(&["promote-backup", &b2.addr, "--backup", &b1.addr]).await;
    assert!(ok, "{out}");
    assert!(
        out.contains(&format!("{} is the primary now", b2.addr)) && out.contains(&b1.addr),
        "{out}"
    );
    let s = primary_status(&b2.addr).await;
    assert!(s.role == "primary" && s.term > old_term, "{s:?}");
    wait_health(&b2_health, ServingStatus::Serving, Duration::from_secs(10))
        .await
        .expect("the promoted node's probes say it serves");
    // Promoting it again (a retry whose first answer was lost, say) is no error: it says the
    // node is not a backup any more, waits for it to serve as the primary and shows it.
    let (ok, out) = admin(&["promote-backup", &b2.addr, "--backup", &b1.addr]).await;
    assert!(
        ok && out.contains("only a backup can be promoted")
            && out.contains("is not applied")
            && out.contains(&format!("{} is the primary now (term {})", b2.addr, s.term)),
        "{out}"
    );
    assert_eq!(
        primary_status(&b2.addr).await.term,
        s.term,
        "no second promotion"
    );
}
