//! The DPM on real DAX persistent memory (inside the Soft-RoCE/DAX VM, scripts/vm-tests.sh):
//! the pool is mapped with MAP_SYNC and persisted with CLWB/CLFLUSHOPT + SFENCE. Outside the
//! VM this test says it is skipped; inside it (DINOMO_VM=1) a missing DAX directory fails it.

use dinomo_dpm_node::config::DpmConfigFile;
use dinomo_dpm_node::testkit::{LocalSource, LogRecord, LogWriter};
use dinomo_dpm_node::Dpm;
use dinomo_fabric::shm::ShmFabric;
use dinomo_fabric::{Durability, DurabilityRequest};
use dinomo_layout::log::LogOp;

#[tokio::test]
async fn dpm_on_dax_merges_and_reopens() {
    let Some(dir) = std::env::var_os("DINOMO_PM_DIR") else {
        assert!(
            std::env::var_os("DINOMO_VM").is_none(),
            "inside the VM DINOMO_PM_DIR must be set"
        );
        println!("skipped: DINOMO_PM_DIR is not set (no DAX filesystem outside the test VM)");
        return;
    };
    let pool = std::path::Path::new(&dir).join(format!("dpm-dax-{}.pool", std::process::id()));
    let _ = std::fs::remove_file(&pool);
    let cfg = DpmConfigFile {
        pool_path: pool.clone(),
        pool_size: "48MiB".into(),
        segment_size: "256KiB".into(),
        durability: "dax".into(),
        listen: "127.0.0.1:0".into(),
        fabric_listen: "127.0.0.1:0".into(),
        metrics_listen: String::new(),
        initial_index_buckets: 64,
        ..Default::default()
    }
    .validate()
    .unwrap();
    {
        let dpm = Dpm::open(cfg.clone()).unwrap();
        assert!(
            matches!(dpm.pool().durability(), Durability::Dax(_)),
            "{}",
            dpm.pool().durability()
        );
        let reg = dpm.register_kn(Some(1), "dax").unwrap();
        let fabric = ShmFabric::connect(&pool, reg.key, DurabilityRequest::Dax).unwrap();
        let mut w = LogWriter::new(
            fabric,
            LocalSource {
                dpm: dpm.clone(),
                kn: 1,
                epoch: reg.epoch,
            },
        );
        for i in 0..300u64 {
            let r = LogRecord {
                op: LogOp::Put,
                version: i,
                key: format!("d{i}").into_bytes(),
                value: vec![i as u8; 700],
            };
            w.append(&[r]).await.unwrap();
        }
        dpm.merge_all(1, true).unwrap();
        assert!(dpm.stats().index_resizes > 0);
    }
    let dpm = Dpm::open(cfg).unwrap();
    for i in 0..300u64 {
        assert_eq!(
            dpm.lookup(format!("d{i}").as_bytes())
                .unwrap()
                .unwrap()
                .value,
            vec![i as u8; 700]
        );
    }
    drop(dpm);
    let _ = std::fs::remove_file(&pool);
    println!("dpm on DAX: 300 entries merged, resized, reopened and read back");
}
