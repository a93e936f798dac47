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
        pool_size: "48MiB".parse().unwrap(),
        segment_size: "256KiB".parse().unwrap(),
        durability: "dax".parse().unwrap(),
        initial_index_buckets: 64,
        ..DpmConfigFile::in_process(pool.clone())
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

/// A pool on a device-DAX device (inside the VM of `scripts/softroce-vm.sh --devdax`, which
/// sets `DINOMO_DAX_DEVICE=/dev/dax0.0` through scripts/vm-cluster.sh): refused until
/// `format_device`, then formatted over the whole device, written, merged, reopened (never
/// reformatted). Elsewhere it says it is skipped.
#[tokio::test]
async fn dpm_on_device_dax_formats_only_when_told_and_reopens() {
    let Some(dev) = std::env::var_os("DINOMO_DAX_DEVICE") else {
        println!("SKIPPED: DINOMO_DAX_DEVICE is not set (no device-DAX outside the test VM)");
        return;
    };
    let path = std::path::PathBuf::from(dev);
    let size = dinomo_fabric::pm::DaxDevice::probe(&path)
        .unwrap()
        .expect("DINOMO_DAX_DEVICE must be a device-DAX character device")
        .len;
    // Whatever an earlier run left: no pool magic.
    dinomo_fabric::PmRegion::open(&path, DurabilityRequest::ProcessCrash)
        .unwrap()
        .write_durable(0, &[0u8; 8])
        .unwrap();
    let cfg = |format_device: bool| {
        DpmConfigFile {
            pool_size: "1GiB".parse().unwrap(), // does not apply to a device
            segment_size: "256KiB".parse().unwrap(),
            durability: "dax".parse().unwrap(),
            format_device,
            initial_index_buckets: 64,
            ..DpmConfigFile::in_process(path.clone())
        }
        .validate()
        .unwrap()
    };
    let e = Dpm::open(cfg(false)).unwrap_err().to_string();
    assert!(e.contains("format_device"), "{e}");
    {
        let dpm = Dpm::open(cfg(true)).unwrap();
        assert_eq!(dpm.pool().superblock().pool_len, size);
        assert!(matches!(dpm.pool().durability(), Durability::Dax(_)));
        let reg = dpm.register_kn(Some(1), "devdax").unwrap();
        let fabric = ShmFabric::connect(&path, reg.key, DurabilityRequest::Dax).unwrap();
        let mut w = LogWriter::new(
            fabric,
            LocalSource {
                dpm: dpm.clone(),
                kn: 1,
                epoch: reg.epoch,
            },
        );
        for i in 0..200u64 {
            let r = LogRecord {
                op: LogOp::Put,
                version: i,
                key: format!("x{i}").into_bytes(),
                value: vec![i as u8; 500],
            };
            w.append(&[r]).await.unwrap();
        }
        dpm.merge_all(1, true).unwrap();
    }
    // Holds a pool now: opened as it is, with or without format_device.
    for format_device in [true, false] {
        let dpm = Dpm::open(cfg(format_device)).unwrap();
        for i in [0u64, 99, 199] {
            assert_eq!(
                dpm.lookup(format!("x{i}").as_bytes())
                    .unwrap()
                    .unwrap()
                    .value,
                vec![i as u8; 500]
            );
        }
    }
    // A backup's term and copy marker would sit in /dev beside the device, lost at reboot.
    let e = match dinomo_dpm_node::replication::backup::Backup::new(
        path.clone(),
        DurabilityRequest::Dax,
        "127.0.0.1:0".parse().unwrap(),
        String::new(),
    ) {
        Ok(_) => panic!("a backup on a device-DAX device must be refused"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("reboot"), "{e}");
    println!(
        "dpm on device-DAX {}: {size} bytes, 200 entries merged and reopened; a backup on it refused",
        path.display()
    );
}
