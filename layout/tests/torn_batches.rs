//! Torn batch WRITEs, exhaustively and deterministically.
//!
//! A KN writes a batch with one WRITE; a crash can leave any prefix of it on PM (the rest keeps
//! whatever the segment held before: zeros on a fresh pool, or the bytes of an older log from a
//! previous allocation of the same segment, chained from another seed). For every byte offset k
//! of the last batch, the scan must return exactly the earlier batches, drop the torn batch
//! whole and report its offset as the end of the log. Because real PM persists cache lines in
//! any order, the same is checked for writes missing one cache line, or a pseudo-random subset
//! of cache lines. Finally an older log is never taken for a continuation of a newer one.

use dinomo_layout::log::{scan, BatchBuilder, LogOp, Scan, ScannedBatch};
use dinomo_layout::segment::{SegmentHeader, HEADER_SIZE};

/// Smallest segment size a pool accepts; the logs below fit well inside.
const SEG_LEN: usize = 64 << 10;

/// One log entry: (op, version, key, value).
type Ent = (LogOp, u64, Vec<u8>, Vec<u8>);

/// xorshift64*: deterministic bytes without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

fn header(kn_id: u32, generation: u64) -> SegmentHeader {
    SegmentHeader {
        kn_id,
        epoch: 9,
        segment_id: 42,
        generation,
        chain_seq: 3,
        stream: 1,
    }
}

fn put(rng: &mut Rng, version: u64, key_len: usize, value_len: usize) -> Ent {
    (
        LogOp::Put,
        version,
        rng.bytes(key_len),
        rng.bytes(value_len),
    )
}

fn del(rng: &mut Rng, version: u64, key_len: usize) -> Ent {
    (LogOp::Delete, version, rng.bytes(key_len), Vec::new())
}

/// Five batches with mixed entry sizes (1-byte to 255-byte keys, values from empty to 3000
/// bytes, sizes that need padding and sizes that do not), puts and deletes, and an empty batch.
/// The last batch is about 4 KiB so that it spans many cache lines.
fn batches(salt: u64) -> Vec<Vec<Ent>> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ salt);
    let r = &mut rng;
    vec![
        vec![put(r, 1, 8, 16)],
        vec![put(r, 2, 200, 1500), del(r, 3, 1), put(r, 4, 13, 7)],
        vec![],
        vec![
            del(r, 5, 32),
            put(r, 6, 1, 0),
            put(r, 7, 40, 100),
            del(r, 8, 9),
            put(r, 9, 16, 24),
        ],
        vec![
            put(r, 10, 255, 3000),
            del(r, 11, 17),
            put(r, 12, 3, 5),
            put(r, 13, 64, 640),
            del(r, 14, 8),
        ],
    ]
}

/// One batch as written: where, its bytes, its chain value, its entries.
struct Written {
    offset: usize,
    bytes: Vec<u8>,
    chain: u32,
    entries: Vec<Ent>,
}

/// Encodes `batches` as the log of a segment with header `hdr`, laid out from HEADER_SIZE.
fn encode_log(hdr: &SegmentHeader, batches: &[Vec<Ent>]) -> Vec<Written> {
    let mut chain = hdr.chain_seed();
    let mut offset = HEADER_SIZE;
    let mut out = Vec::new();
    for entries in batches {
        let mut b = BatchBuilder::new();
        for (op, version, key, value) in entries {
            b.push(*op, *version, key, value);
        }
        let (bytes, c) = b.finish(chain);
        chain = c;
        let len = bytes.len();
        out.push(Written {
            offset,
            bytes,
            chain,
            entries: entries.clone(),
        });
        offset += len;
    }
    out
}

/// Writes the header and every batch fully into `seg`.
fn write_log(seg: &mut [u8], hdr: &SegmentHeader, log: &[Written]) {
    seg[..HEADER_SIZE].copy_from_slice(&hdr.encode());
    for w in log {
        seg[w.offset..w.offset + w.bytes.len()].copy_from_slice(&w.bytes);
    }
}

fn end_of(log: &[Written]) -> usize {
    log.last().map_or(HEADER_SIZE, |w| w.offset + w.bytes.len())
}

/// Checks that a scan returned exactly `want` (offsets, lengths, chains, entries).
fn assert_batches(got: &[ScannedBatch<'_>], want: &[Written], ctx: &str) {
    assert_eq!(got.len(), want.len(), "{ctx}: batch count");
    for (g, w) in got.iter().zip(want) {
        assert_eq!(
            (g.offset, g.len, g.chain),
            (w.offset, w.bytes.len(), w.chain),
            "{ctx}"
        );
        assert_eq!(g.entries.len(), w.entries.len(), "{ctx}: entry count");
        for ((_, e), (op, version, key, value)) in g.entries.iter().zip(&w.entries) {
            assert_eq!(
                (e.op, e.version, e.key, e.value),
                (*op, *version, &key[..], &value[..]),
                "{ctx}"
            );
        }
    }
}

/// Segment backgrounds a new log can be written over.
struct Background {
    name: &'static str,
    bytes: Vec<u8>,
}

/// A zeroed segment, and two segments holding a complete older log of the previous generation
/// (another seed): one with other contents and shifted batch boundaries, and one with
/// exactly the same batches (boundaries and bytes line up; only the chain values differ, the
/// hardest case). Both older logs are longer than the new one, so stale batches follow it.
fn backgrounds(new_hdr: &SegmentHeader) -> Vec<Background> {
    let old_hdr = header(new_hdr.kn_id, new_hdr.generation - 1);
    assert_ne!(old_hdr.chain_seed(), new_hdr.chain_seed());
    let mut same = batches(0);
    same.extend(batches(0));
    // A small extra first batch shifts every later boundary of the older log by 104 bytes.
    let mut different = vec![vec![put(&mut Rng(7), 1, 3, 50)]];
    different.extend(batches(1));
    different.extend(batches(2));
    let mut out = vec![Background {
        name: "zeroed",
        bytes: vec![0; SEG_LEN],
    }];
    for (name, content) in [
        ("stale log, different batches", different),
        ("stale log, same batches", same),
    ] {
        let old = encode_log(&old_hdr, &content);
        assert!(end_of(&old) > end_of(&encode_log(new_hdr, &batches(0))) + 4096);
        let mut bytes = vec![0; SEG_LEN];
        write_log(&mut bytes, &old_hdr, &old);
        // The stale log is valid under its own seed.
        let mut s = scan(&bytes, HEADER_SIZE, old_hdr.chain_seed());
        let got: Vec<_> = s.by_ref().collect();
        assert_batches(&got, &old, name);
        out.push(Background { name, bytes });
    }
    out
}

/// What a scan of `image` must give when `log` was written in full except that its last batch
/// may be torn: all batches when the last batch's bytes are all on PM, otherwise exactly the
/// earlier ones, ending at the last batch's offset. Returns whether the last batch was accepted.
fn check_scan(image: &[u8], hdr: &SegmentHeader, log: &[Written], ctx: &str) -> bool {
    let last = log.last().expect("a log with batches");
    let complete = image[last.offset..last.offset + last.bytes.len()] == last.bytes[..];
    let keep = if complete { log.len() } else { log.len() - 1 };
    let mut s = scan(image, HEADER_SIZE, hdr.chain_seed());
    let got: Vec<_> = s.by_ref().collect();
    assert_batches(&got, &log[..keep], ctx);
    let (end, chain) = if complete {
        (end_of(log), last.chain)
    } else {
        let before = &log[..log.len() - 1];
        (
            end_of(before),
            before.last().map_or(hdr.chain_seed(), |w| w.chain),
        )
    };
    assert_eq!(s.end(), end, "{ctx}: end of the log");
    assert_eq!(Scan::chain(&s), chain, "{ctx}: chain at the end");
    // Recovery: the next batch is written at the end found, chained from the chain found, over
    // whatever the torn write left; the log then reads as the kept batches plus that one.
    let mut b = BatchBuilder::new();
    b.push(LogOp::Put, 99, b"after-recovery", b"value");
    let (bytes, c) = b.finish(chain);
    let mut again = image.to_vec();
    again[end..end + bytes.len()].copy_from_slice(&bytes);
    let mut s = scan(&again, HEADER_SIZE, hdr.chain_seed());
    assert_eq!(s.by_ref().count(), keep + 1, "{ctx}: append after recovery");
    assert_eq!((s.end(), Scan::chain(&s)), (end + bytes.len(), c), "{ctx}");
    complete
}

#[test]
fn torn_last_batch_is_dropped_whole_at_every_byte() {
    let hdr = header(5, 1000);
    let log = encode_log(&hdr, &batches(0));
    let last = log.last().unwrap();
    let len = last.bytes.len();
    assert!(
        len > 4000,
        "the last batch spans many cache lines ({len} bytes)"
    );
    for bg in backgrounds(&hdr) {
        // Everything but the last batch written in full, over the background.
        let mut image = bg.bytes.clone();
        write_log(&mut image, &hdr, &log[..log.len() - 1]);
        let mut accepted = Vec::new();
        for k in 0..=len {
            // The WRITE of the last batch reached PM up to byte k; the rest is the background.
            if k > 0 {
                image[last.offset + k - 1] = last.bytes[k - 1];
            }
            let ctx = format!("{}: last batch torn after {k} of {len} bytes", bg.name);
            if check_scan(&image, &hdr, &log, &ctx) {
                accepted.push(k);
            }
            let mut s = scan(&image, HEADER_SIZE, hdr.chain_seed());
            s.by_ref().for_each(drop);
            if k >= 4 && k < len {
                // Its magic is on PM: the torn batch is reported, not taken for a clean end.
                assert!(s.stop_reason().is_some(), "{ctx}: no stop reason");
            }
            if k == 0 && bg.name == "zeroed" {
                assert!(s.stop_reason().is_none(), "{ctx}: zeros are a clean end");
            }
        }
        // Accepted only once every byte is on PM. Over the same stale batch only the trailer
        // magic (identical in both logs) may be missing: those bytes are already right.
        // (Its chain bytes differ, so at most the last 8 bytes can be missing.)
        if bg.name == "stale log, same batches" {
            assert!(accepted.contains(&(len - 4)), "{}: {accepted:?}", bg.name);
            assert!(
                accepted.iter().all(|&k| k >= len - 8),
                "{}: {accepted:?}",
                bg.name
            );
            let first = accepted[0];
            assert_eq!(accepted, (first..=len).collect::<Vec<_>>(), "{}", bg.name);
        } else {
            assert_eq!(
                accepted,
                vec![len],
                "{}: offsets at which the batch was accepted",
                bg.name
            );
        }
    }
}

#[test]
fn fully_written_last_batch_is_accepted() {
    let hdr = header(5, 1000);
    let log = encode_log(&hdr, &batches(0));
    for bg in backgrounds(&hdr) {
        let mut image = bg.bytes.clone();
        write_log(&mut image, &hdr, &log);
        let mut s = scan(&image, HEADER_SIZE, hdr.chain_seed());
        let got: Vec<_> = s.by_ref().collect();
        assert_batches(&got, &log, bg.name);
        assert_eq!(s.end(), end_of(&log), "{}", bg.name);
        assert_eq!(Scan::chain(&s), log.last().unwrap().chain, "{}", bg.name);
        // Over zeros the log ends cleanly; over the aligned stale log the next (stale) batch is
        // refused and reported. (Over the other stale log the next bytes are the middle of some
        // stale batch, which reads as a clean end unless they happen to look like a magic.)
        match bg.name {
            "zeroed" => assert!(s.stop_reason().is_none()),
            "stale log, same batches" => assert!(s.stop_reason().is_some()),
            _ => {}
        }
    }
}

/// Persistence is per cache line, in any order: a WRITE interrupted by a crash may have any
/// subset of its lines on PM. Every single missing line, and pseudo-random subsets of lines,
/// must drop the batch whole.
#[test]
fn last_batch_missing_cache_lines_is_dropped_whole() {
    const LINE: usize = 64;
    let hdr = header(5, 1000);
    let log = encode_log(&hdr, &batches(0));
    let last = log.last().unwrap();
    let (start, stop) = (last.offset, last.offset + last.bytes.len());
    let lines: Vec<usize> = (start / LINE..stop.div_ceil(LINE)).collect();
    let mut rng = Rng(0xC0FF_EE00_D15E_A5E5);
    for bg in backgrounds(&hdr) {
        let mut full = bg.bytes.clone();
        write_log(&mut full, &hdr, &log);
        let mut subsets: Vec<Vec<bool>> = (0..lines.len())
            .map(|missing| (0..lines.len()).map(|i| i != missing).collect())
            .collect();
        subsets.extend((0..300).map(|_| lines.iter().map(|_| rng.next() & 1 == 0).collect()));
        for (n, written) in subsets.iter().enumerate() {
            if written.iter().all(|&w| w) {
                continue;
            }
            let mut image = bg.bytes.clone();
            write_log(&mut image, &hdr, &log[..log.len() - 1]);
            for (&line, &w) in lines.iter().zip(written) {
                let (a, b) = ((line * LINE).max(start), ((line + 1) * LINE).min(stop));
                if w {
                    image[a..b].copy_from_slice(&full[a..b]);
                }
            }
            let ctx = format!("{}: line subset {n}", bg.name);
            let accepted = check_scan(&image, &hdr, &log, &ctx);
            // Only the stale identical batch can already hold the missing bytes.
            assert!(
                !accepted || bg.name == "stale log, same batches",
                "{ctx}: accepted with lines missing"
            );
        }
    }
}

/// A segment reallocated to a new generation (or another KN) still holds its older log; the
/// new log's scan must never run on into it, even when the older log's batches are
/// byte-identical and boundary-aligned.
#[test]
fn stale_log_of_a_previous_generation_is_never_a_continuation() {
    let old_hdr = header(5, 41);
    let new_hdrs = [
        header(5, 42),
        header(5, 41 + (1 << 40)),
        header(6, 42),
        SegmentHeader {
            epoch: 10,
            ..header(5, 42)
        },
    ];
    for new_hdr in new_hdrs {
        assert_ne!(old_hdr.chain_seed(), new_hdr.chain_seed());
        let mut stale_batches = batches(0);
        stale_batches.extend(batches(3));
        let old = encode_log(&old_hdr, &stale_batches);
        let mut seg = vec![0u8; SEG_LEN];
        write_log(&mut seg, &old_hdr, &old);

        // The new owner's header is written; no batch yet: nothing of the old log is valid.
        seg[..HEADER_SIZE].copy_from_slice(&new_hdr.encode());
        let mut s = scan(&seg, HEADER_SIZE, new_hdr.chain_seed());
        assert_eq!(s.by_ref().count(), 0, "{new_hdr:?}: empty new log");
        assert_eq!(s.end(), HEADER_SIZE);
        assert!(s.stop_reason().is_some(), "a stale batch is reported");

        // New logs of 1..=5 batches, identical to the start of the old one: each ends exactly
        // where it was written, though the old log continues with valid-looking batches.
        let all = batches(0);
        for n in 1..=all.len() {
            let new = encode_log(&new_hdr, &all[..n]);
            let mut image = seg.clone();
            write_log(&mut image, &new_hdr, &new);
            assert_eq!(
                image[end_of(&new)..end_of(&new) + 4],
                old[n].bytes[..4],
                "a stale batch magic follows the new log"
            );
            let mut s = scan(&image, HEADER_SIZE, new_hdr.chain_seed());
            let got: Vec<_> = s.by_ref().collect();
            assert_batches(&got, &new, &format!("{new_hdr:?}: {n} new batches"));
            assert_eq!(s.end(), end_of(&new));
            assert!(s.stop_reason().is_some());
        }

        // Starting a scan anywhere in the old log with any chain value the new log could have
        // produced accepts nothing.
        let new = encode_log(&new_hdr, &all);
        let chains: Vec<u32> = std::iter::once(new_hdr.chain_seed())
            .chain(new.iter().map(|w| w.chain))
            .collect();
        for w in &old {
            for &c in &chains {
                assert_eq!(
                    scan(&seg, w.offset, c).count(),
                    0,
                    "stale batch at {}",
                    w.offset
                );
            }
        }
    }
}
