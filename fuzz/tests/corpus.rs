//! Replays every committed input (the seed corpus, and reproducers of fixed crashes under
//! regressions/) through the target functions with a plain `cargo test`: stable Rust, no
//! libFuzzer. `cargo test --manifest-path fuzz/Cargo.toml`.

use std::path::Path;

fn replay(target: &str, check: fn(&[u8])) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut n = 0;
    for dir in [
        root.join("corpus").join(target),
        root.join("regressions").join(target),
    ] {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries {
            let path = e.unwrap().path();
            let data = std::fs::read(&path).unwrap();
            let r = std::panic::catch_unwind(|| check(&data));
            assert!(r.is_ok(), "{target}: {} fails", path.display());
            n += 1;
        }
    }
    assert!(n > 0, "{target}: no corpus (run scripts/fuzz.sh seeds)");
}

#[test]
fn segment_scan() {
    replay("segment_scan", dinomo_fuzz::segment_scan);
}

#[test]
fn log_decode() {
    replay("log_decode", dinomo_fuzz::log_decode);
}

#[test]
fn bucket_chain() {
    replay("bucket_chain", dinomo_fuzz::bucket_chain);
}

#[test]
fn cluster_map_decode() {
    replay("cluster_map_decode", dinomo_fuzz::cluster_map_decode);
}

#[test]
fn tcp_frame_decode() {
    replay("tcp_frame_decode", dinomo_fuzz::tcp_frame_decode);
}

/// The seeds really reach past the checksums: the segment seeds hold valid batches.
#[test]
fn seeds_are_real_data() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let seg = std::fs::read(root.join("segment_scan/seed-01-three-batches-from-header")).unwrap();
    let h = dinomo_layout::segment::SegmentHeader::decode(&seg[9..]).unwrap();
    let batches = dinomo_fuzz::check_scan(
        &seg[9..],
        dinomo_layout::segment::HEADER_SIZE,
        h.chain_seed(),
    );
    assert_eq!(batches, 3);
}
