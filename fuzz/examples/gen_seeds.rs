//! Writes the seed corpus: real segments, batches, entries, bucket chains, cluster maps and tcp
//! frames, made by the project's own encoders, in the input layouts of `dinomo_fuzz`'s target
//! functions. Deterministic: rerunning it rewrites the same files.
//!
//! `cargo run --manifest-path fuzz/Cargo.toml --example gen_seeds` (from the repository root;
//! scripts/fuzz.sh seeds does it). Files go to fuzz/corpus/<target>/seed-*.

use std::fs;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use dinomo_fabric::tcp::{encode_request, encode_response};
use dinomo_fabric::{Completion, FabricError, Op};
use dinomo_layout::index::{depth_word, Bucket, EntryPtr, BUCKET_SIZE};
use dinomo_layout::log::{encode_entry, BatchBuilder, LogOp};
use dinomo_layout::segment::{SegmentHeader, HEADER_SIZE};
use dinomo_placement::{ClusterMap, KnInfo};

struct Corpus {
    dir: PathBuf,
    n: usize,
}

impl Corpus {
    fn new(root: &Path, target: &str) -> Self {
        let dir = root.join(target);
        fs::create_dir_all(&dir).unwrap();
        for f in fs::read_dir(&dir).unwrap() {
            let p = f.unwrap().path();
            if p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("seed-")
            {
                fs::remove_file(p).unwrap();
            }
        }
        Corpus { dir, n: 0 }
    }

    fn add(&mut self, name: &str, bytes: &[u8]) {
        self.n += 1;
        fs::write(self.dir.join(format!("seed-{:02}-{name}", self.n)), bytes).unwrap();
    }
}

/// A batch of `n` entries with keys and values of a few shapes.
fn batch(n: usize, value_len: usize, prev_chain: u32) -> (Vec<u8>, u32) {
    let mut b = BatchBuilder::new();
    for i in 0..n {
        let key = format!("key-{i:04}");
        if i % 5 == 4 {
            b.push(LogOp::Delete, i as u64 + 1, key.as_bytes(), b"");
        } else {
            let value: Vec<u8> = (0..value_len + i).map(|j| (i * 31 + j) as u8).collect();
            b.push(LogOp::Put, i as u64 + 1, key.as_bytes(), &value);
        }
    }
    b.finish(prev_chain)
}

/// A segment: header, then `batches` batches, then zeros up to `len`.
fn segment(len: usize, batches: &[(usize, usize)], generation: u64) -> Vec<u8> {
    let h = SegmentHeader {
        kn_id: 3,
        epoch: 2,
        segment_id: 17,
        generation,
        chain_seq: 0,
        stream: 1,
    };
    let mut seg = h.encode().to_vec();
    let mut chain = h.chain_seed();
    for &(n, value_len) in batches {
        let (b, c) = batch(n, value_len, chain);
        seg.extend_from_slice(&b);
        chain = c;
    }
    assert!(seg.len() <= len);
    seg.resize(len, 0);
    seg
}

/// `mode u8 | start u32 | chain u32 | segment`.
fn scan_input(mode: u8, start: u32, chain: u32, seg: &[u8]) -> Vec<u8> {
    let mut v = vec![mode];
    v.extend_from_slice(&start.to_le_bytes());
    v.extend_from_slice(&chain.to_le_bytes());
    v.extend_from_slice(seg);
    v
}

fn segment_scan(root: &Path) {
    let mut c = Corpus::new(root, "segment_scan");
    let seg = segment(2048, &[(3, 8), (1, 100), (5, 0)], 1);
    c.add("three-batches-from-header", &scan_input(1, 0, 0, &seg));
    c.add("three-batches-repaired", &scan_input(3, 0, 0, &seg));
    c.add("empty-segment", &scan_input(1, 0, 0, &segment(256, &[], 9)));
    // A torn last batch: cut inside it.
    let full = segment(4096, &[(2, 16), (8, 40)], 4);
    let mut torn = full.clone();
    let cut = HEADER_SIZE + 2 * 8 + 200;
    torn[cut..].fill(0);
    c.add("torn-last-batch", &scan_input(1, 0, 0, &torn));
    // A stale batch from an earlier generation after a fresh one.
    let old = segment(1024, &[(2, 8), (2, 8)], 7);
    let new = segment(1024, &[(2, 8)], 8);
    let mut mixed = new.clone();
    let first_len = HEADER_SIZE + batch(2, 8, 0).0.len();
    mixed[first_len..].copy_from_slice(&old[first_len..]);
    c.add("stale-generation-tail", &scan_input(1, 0, 0, &mixed));
    // Explicit start and chain, as the merge resumes from a saved position.
    let h = SegmentHeader::decode(&seg).unwrap();
    let (b0, c0) = batch(3, 8, h.chain_seed());
    c.add(
        "resume-after-first-batch",
        &scan_input(0, (HEADER_SIZE + b0.len()) as u32, c0, &seg),
    );
    c.add(
        "one-big-batch",
        &scan_input(1, 0, 0, &segment(8192, &[(40, 64)], 2)),
    );
}

fn log_decode(root: &Path) {
    let mut c = Corpus::new(root, "log_decode");
    let mut e = Vec::new();
    encode_entry(LogOp::Put, 7, b"key", b"value!", &mut e);
    c.add("put", &e);
    let mut e = Vec::new();
    encode_entry(LogOp::Delete, 1 << 40, b"gone", b"", &mut e);
    c.add("delete", &e);
    let mut e = Vec::new();
    encode_entry(LogOp::Put, 1, b"", b"", &mut e);
    c.add("empty-key-and-value", &e);
    let mut e = Vec::new();
    encode_entry(LogOp::Put, 2, &[0xab; 300], &[0xcd; 1000], &mut e);
    c.add("long", &e);
    let mut three = Vec::new();
    for i in 0..3u8 {
        encode_entry(LogOp::Put, u64::from(i), &[i; 5], &[i; 11], &mut three);
    }
    c.add("three-entries", &three);
    c.add("batch", &batch(4, 12, 0).0);
    let (b1, c1) = batch(2, 3, 0);
    let mut two = b1;
    two.extend_from_slice(&batch(3, 20, c1).0);
    c.add("two-batches", &two);
}

/// `start u64 | max_steps u8 | stop_after u8 | image`.
fn chain_input(start: u64, max_steps: u8, stop_after: u8, image: &[u8]) -> Vec<u8> {
    let mut v = start.to_le_bytes().to_vec();
    v.push(max_steps);
    v.push(stop_after);
    v.extend_from_slice(image);
    v
}

fn bucket_chain(root: &Path) {
    let mut c = Corpus::new(root, "bucket_chain");
    let bucket = |next: u64, fill: u64| {
        let mut b = Bucket {
            next,
            state: depth_word(3),
            ..Default::default()
        };
        for (i, s) in b.slots.iter_mut().enumerate().take(fill as usize) {
            *s = (
                0x1234 + i as u64,
                EntryPtr::new(4096 + 64 * i as u64, 40).to_word(),
            );
        }
        b.encode()
    };
    // Home bucket 0 -> overflow 2 -> overflow 5 -> end.
    let mut img = vec![0u8; 8 * BUCKET_SIZE];
    img[0..64].copy_from_slice(&bucket(128, 3));
    img[128..192].copy_from_slice(&bucket(320, 3));
    img[320..384].copy_from_slice(&bucket(0, 1));
    c.add("chain-of-three", &chain_input(0, 16, 255, &img));
    c.add("chain-stop-early", &chain_input(0, 16, 1, &img));
    c.add("chain-step-limit", &chain_input(0, 2, 255, &img));
    // A cycle: 64 -> 192 -> 64.
    let mut cyc = vec![0u8; 4 * BUCKET_SIZE];
    cyc[64..128].copy_from_slice(&bucket(192, 2));
    cyc[192..256].copy_from_slice(&bucket(64, 2));
    c.add("cycle", &chain_input(64, 64, 255, &cyc));
    // Next pointers out of the image and misaligned.
    let mut out = vec![0u8; 2 * BUCKET_SIZE];
    out[0..64].copy_from_slice(&bucket(1 << 40, 1));
    c.add("next-out-of-bounds", &chain_input(0, 8, 255, &out));
    out[0..64].copy_from_slice(&bucket(72, 1));
    c.add("next-misaligned", &chain_input(0, 8, 255, &out));
    c.add("single-empty-bucket", &chain_input(0, 4, 255, &[0u8; 64]));
}

fn cluster_map_decode(root: &Path) {
    let mut c = Corpus::new(root, "cluster_map_decode");
    let kns = |ids: &[u32]| -> Vec<KnInfo> {
        ids.iter()
            .map(|&id| KnInfo {
                id,
                endpoint: format!("10.0.0.{id}:7800"),
            })
            .collect()
    };
    let empty = ClusterMap::new(vec![], 128, 4).unwrap();
    c.add("empty.json", &empty.encode());
    let one = ClusterMap::new(kns(&[1]), 64, 1).unwrap();
    c.add("one-kn.json", &one.encode());
    let three = ClusterMap::new(kns(&[1, 2, 7]), 32, 8).unwrap();
    c.add("three-kns.json", &three.encode());
    let hot = three
        .with_replicated(b"hot-key".to_vec(), vec![1, 7])
        .unwrap()
        .with_replicated(vec![0, 255, 16], vec![2])
        .unwrap();
    c.add("replicated-keys.json", &hot.encode());
    let grown = hot
        .with_kn_added(KnInfo {
            id: 9,
            endpoint: "[::1]:7809".into(),
        })
        .unwrap();
    c.add("after-join.json", &grown.encode());
}

fn tcp_frame_decode(root: &Path) {
    let mut c = Corpus::new(root, "tcp_frame_decode");
    let body = |f: Bytes| f.slice(4..).to_vec();
    // Wire version 2: the key travels once, in the connection's hello, not in each frame.
    let req = |ops: &[Op]| body(encode_request(9, ops).unwrap());
    c.add(
        "read",
        &req(&[Op::Read {
            offset: 4096,
            len: 64,
        }]),
    );
    c.add(
        "write",
        &req(&[Op::Write {
            offset: 8192,
            data: Bytes::from_static(b"a log batch would be here"),
        }]),
    );
    c.add(
        "cas-faa",
        &req(&[
            Op::Cas {
                offset: 64,
                expected: 0,
                new: 0x1000_0040,
            },
            Op::Faa { offset: 72, add: 1 },
        ]),
    );
    c.add(
        "doorbell-batch",
        &req(&(0..8)
            .map(|i| Op::Read {
                offset: 64 * i,
                len: 64,
            })
            .collect::<Vec<_>>()),
    );
    c.add("empty-post", &req(&[]));
    let resp = |r: &dinomo_fabric::Result<Vec<Completion>>| body(encode_response(9, r));
    c.add(
        "response-ok",
        &resp(&Ok(vec![
            Completion::Read(Bytes::from_static(b"sixteen bytes!!!")),
            Completion::Written,
            Completion::Cas { old: 5 },
            Completion::Faa { old: 6 },
        ])),
    );
    c.add(
        "response-denied",
        &resp(&Err(FabricError::AccessDenied { slot: 3 })),
    );
    c.add(
        "response-bounds",
        &resp(&Err(FabricError::OutOfBounds {
            offset: 1 << 30,
            len: 64,
            region_len: 1 << 20,
        })),
    );
    c.add(
        "response-other",
        &resp(&Err(FabricError::Protocol(
            "unknown operation kind 9".into(),
        ))),
    );
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    segment_scan(&root);
    log_decode(&root);
    bucket_chain(&root);
    cluster_map_decode(&root);
    tcp_frame_decode(&root);
    println!("seed corpus written to {}", root.display());
}
