//! One pool, one dpm-node process: a second process on a pool that is served, as a primary or
//! as a backup, is refused and says who holds it; the lock dies with its holder, SIGKILL
//! included, so a crashed node's pool is served again at once.

use std::time::Duration;

use super::process::{write_config, DpmProcess};

#[tokio::test]
async fn a_served_pool_is_refused_to_a_second_process_until_its_holder_dies() {
    let dir = tempfile::tempdir().unwrap();
    let primary_config = write_config(dir.path(), "");
    let mut first = DpmProcess::start(&primary_config, &dir.path().join("first.log"));

    let second = DpmProcess::try_start(&primary_config, &dir.path().join("second.log"), &[]);
    let log = std::fs::read_to_string(dir.path().join("second.log")).unwrap();
    assert!(
        second.is_err(),
        "a second primary served the pool; log: {log}"
    );
    assert!(
        log.contains("is in use") && log.contains(&format!("pid {}", first.pid())),
        "the refusal does not say who holds the pool: {log}"
    );

    // A backup is the same danger: it would overwrite the pool with another primary's copy.
    let text = std::fs::read_to_string(&primary_config).unwrap();
    let backup_config = dir.path().join("backup.toml");
    std::fs::write(&backup_config, format!("{text}role = \"backup\"\n")).unwrap();
    let backup = DpmProcess::try_start(&backup_config, &dir.path().join("backup.log"), &[]);
    let log = std::fs::read_to_string(dir.path().join("backup.log")).unwrap();
    assert!(
        backup.is_err(),
        "a backup served the primary's pool; log: {log}"
    );
    assert!(log.contains("is in use"), "{log}");

    // The first one still serves, untouched by the refusals.
    assert!(!first.exits_within(Duration::from_millis(100)));
    first.kill9();
    let third = DpmProcess::start(&primary_config, &dir.path().join("third.log"));
    third
        .client()
        .await
        .stats(dinomo_proto::dpm::StatsRequest {})
        .await
        .expect("the restarted node serves the pool");
}
