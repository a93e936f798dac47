//! What each fuzz target checks, as plain functions over bytes: the targets in fuzz_targets/
//! call them under libFuzzer, and `tests/corpus.rs` replays the committed corpus through them
//! with a plain `cargo test` (no libFuzzer, no nightly).
//!
//! Every function must return normally for every input: a panic (an assertion below, an index
//! out of bounds, an arithmetic overflow: cargo-fuzz builds with debug assertions) is a bug in
//! the decoder, or in an invariant stated here. Input layouts are documented per function; the
//! seed generator (`examples/gen_seeds.rs`) writes real data in the same layouts.

use bytes::Bytes;
use dinomo_fabric::tcp::{decode_request, decode_response, encode_request, encode_response};
use dinomo_layout::index::{walk_chain, Bucket, WalkError, BUCKET_SIZE};
use dinomo_layout::log::{
    decode_entry, encode_entry, entry_len, entry_len_from_header, scan, Scan, BATCH_HEADER,
    BATCH_MAGIC, BATCH_TRAILER, ENTRY_HEADER, TRAILER_MAGIC,
};
use dinomo_layout::segment::{SegmentHeader, HEADER_SIZE};
use dinomo_placement::map::ClusterMap;

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// Rewrites the checksums of the log in `buf` from `start`, as a writer would have computed
/// them: each entry's CRC32C and each batch's chain and trailer magic, batch after batch while
/// a batch magic and a plausible payload length are found. Random bytes almost never carry
/// valid checksums, so without this the fuzzer would rarely get past them to the entry and
/// batch parsing behind them.
pub fn repair_log(buf: &mut [u8], start: usize, mut chain: u32) {
    let mut pos = start;
    loop {
        if pos > buf.len() || buf.len() - pos < BATCH_HEADER + BATCH_TRAILER {
            return;
        }
        if u32_at(buf, pos) != BATCH_MAGIC {
            return;
        }
        let payload = u32_at(buf, pos + 4) as usize;
        if !payload.is_multiple_of(8) || payload > buf.len() - pos - BATCH_HEADER - BATCH_TRAILER {
            return;
        }
        let end = pos + BATCH_HEADER + payload;
        let mut at = pos + BATCH_HEADER;
        while end - at >= ENTRY_HEADER {
            let body =
                ENTRY_HEADER + usize::from(u16_at(buf, at + 6)) + u32_at(buf, at + 8) as usize;
            if body > end - at {
                break;
            }
            let crc = crc32c::crc32c(&buf[at + 4..at + body]);
            buf[at..at + 4].copy_from_slice(&crc.to_le_bytes());
            at += (body + 7) & !7;
        }
        chain = crc32c::crc32c_append(chain, &buf[pos..end]);
        buf[end..end + 4].copy_from_slice(&chain.to_le_bytes());
        buf[end + 4..end + 8].copy_from_slice(&TRAILER_MAGIC.to_le_bytes());
        pos = end + BATCH_TRAILER;
    }
}

/// Scans `buf` from `start` with `chain` and checks what the scan promises: batches are
/// contiguous from `start`, lie inside the buffer, hold entries that lie inside their payload
/// and decode alone to the same thing; the scan's end is just past the last batch; resuming at
/// the end finds nothing more. Returns the number of batches.
pub fn check_scan(buf: &[u8], start: usize, chain: u32) -> usize {
    let mut s = scan(buf, start, chain);
    let mut end = start;
    let mut batches = 0;
    for b in s.by_ref() {
        assert_eq!(b.offset, end, "batches are contiguous");
        assert!(b.len >= BATCH_HEADER + BATCH_TRAILER);
        assert!(b.offset + b.len <= buf.len(), "batch inside the buffer");
        let payload_end = b.offset + b.len - BATCH_TRAILER;
        let mut next = b.offset + BATCH_HEADER;
        for (off, e) in &b.entries {
            assert_eq!(*off, next, "entries are contiguous");
            let len = entry_len(e.key.len(), e.value.len());
            assert!(off + len <= payload_end, "entry inside its batch");
            let (again, n) = decode_entry(&buf[*off..payload_end]).expect("entry decodes alone");
            assert_eq!((again, n), (*e, len));
            next += len;
        }
        assert_eq!(next, payload_end, "entries fill the payload");
        end = b.offset + b.len;
        batches += 1;
        assert!(batches <= buf.len() / (BATCH_HEADER + BATCH_TRAILER));
    }
    assert_eq!(s.end(), end);
    if batches == 0 {
        assert_eq!(Scan::chain(&s), chain);
    }
    // Resuming where a scan stopped finds nothing more (it stopped for a reason).
    assert!(scan(buf, s.end(), Scan::chain(&s)).next().is_none());
    batches
}

/// Target `segment_scan`. Input: `mode u8 | start u32 | chain u32 | segment bytes`.
/// Mode bit 0: take start and chain from the segment's header when it decodes (as the DPM's
/// merge and GC do), else from the input, `start` reduced modulo the segment length plus 64 so
/// that it also lands past the end. Bit 1: repair the checksums first (see [`repair_log`]).
pub fn segment_scan(data: &[u8]) {
    if data.len() < 9 {
        return;
    }
    let mode = data[0];
    let seg = &data[9..];
    let mut start = u32_at(data, 1) as usize % (seg.len() + 64);
    let mut chain = u32_at(data, 5);
    if mode & 1 != 0 {
        if let Ok(h) = SegmentHeader::decode(seg) {
            assert_eq!(SegmentHeader::decode(&h.encode()), Ok(h));
            start = HEADER_SIZE;
            chain = h.chain_seed();
        }
    }
    if mode & 2 != 0 {
        let mut fixed = seg.to_vec();
        repair_log(&mut fixed, start, chain);
        check_scan(&fixed, start, chain);
    } else {
        check_scan(seg, start, chain);
    }
}

/// Target `log_decode`. Input: bytes that should start with an entry, or with a batch chained
/// from 0. Checks single-entry decoding (and that it agrees with the header-only length and
/// survives re-encoding), walking consecutive entries, and batch decoding with and without
/// repaired checksums.
pub fn log_decode(data: &[u8]) {
    let from_header = entry_len_from_header(data);
    if let Ok(n) = from_header {
        assert!(n >= ENTRY_HEADER && n.is_multiple_of(8));
    }
    if let Ok((e, n)) = decode_entry(data) {
        assert_eq!(Ok(n), from_header);
        assert!(ENTRY_HEADER + e.key.len() + e.value.len() <= data.len());
        let mut again = Vec::new();
        encode_entry(e.op, e.version, e.key, e.value, &mut again);
        assert_eq!(again.len(), n);
        assert_eq!(decode_entry(&again).map(|(e2, _)| e2), Ok(e));
    }
    // Consecutive entries, as inside a batch's payload.
    let mut at = 0;
    while at < data.len() {
        match decode_entry(&data[at..]) {
            Ok((_, n)) => at += n,
            Err(_) => break,
        }
    }
    check_scan(data, 0, 0);
    let mut fixed = data.to_vec();
    repair_log(&mut fixed, 0, 0);
    check_scan(&fixed, 0, 0);
}

/// Target `bucket_chain`. Input: `start u64 | max_steps u8 | stop_after u8 | pool image`.
/// A `start` below 2^63 is reduced modulo the image length plus 128 (so it is often inside);
/// otherwise it is used as is. Walks the chain with `walk_chain` and checks that every bucket
/// visited is aligned and inside the image, that it follows the `next` pointers, that the walk
/// takes at most `max_steps` buckets and says why it stopped truthfully.
pub fn bucket_chain(data: &[u8]) {
    if data.len() < 10 {
        return;
    }
    let raw = u64_at(data, 0);
    let max_steps = usize::from(data[8]);
    let stop_after = usize::from(data[9]);
    let image = &data[10..];
    let start = if raw >> 63 == 0 {
        raw % (image.len() as u64 + 128)
    } else {
        raw
    };
    let mut visited: Vec<(u64, Bucket)> = Vec::new();
    let r = walk_chain(image, start, max_steps, |off, b| {
        assert_eq!(off % BUCKET_SIZE as u64, 0, "aligned bucket");
        let at = off as usize;
        assert!(at + BUCKET_SIZE <= image.len(), "bucket inside the image");
        let bytes = &image[at..at + BUCKET_SIZE];
        assert_eq!(Bucket::decode(bytes).as_ref(), Ok(b));
        assert_eq!(&b.encode()[..], bytes);
        let _ = b.depth();
        for (slot, ptr) in b.candidates(b.slots[0].0) {
            assert!(slot < b.slots.len());
            assert_eq!(b.slots[slot].0, b.slots[0].0);
            assert_eq!(ptr.to_word(), b.slots[slot].1, "entry words round-trip");
        }
        visited.push((off, *b));
        visited.len() <= stop_after
    });
    assert!(visited.len() <= max_steps);
    match visited.first() {
        Some((off, _)) => assert_eq!(*off, start),
        None => assert!(max_steps == 0 || r.is_err()),
    }
    for w in visited.windows(2) {
        assert_eq!(w[0].1.next, w[1].0, "the walk follows next pointers");
    }
    match r {
        Ok(()) => {
            let (_, last) = visited.last().expect("an Ok walk visited a bucket");
            assert!(visited.len() == stop_after + 1 || last.next == 0);
        }
        Err(WalkError::TooLong) => assert_eq!(visited.len(), max_steps),
        Err(WalkError::OutOfBounds(off)) => {
            let expected = visited.last().map_or(start, |(_, b)| b.next);
            assert_eq!(off, expected);
        }
    }
}

/// Target `cluster_map_decode`. Input: bytes that should be an encoded cluster map (JSON). A
/// map that decodes must be valid, re-encode to a map that decodes equal, and answer ownership
/// questions within its members.
pub fn cluster_map_decode(data: &[u8]) {
    let Ok(map) = ClusterMap::decode(data) else {
        return;
    };
    map.validate().expect("a decoded map is valid");
    let again = ClusterMap::decode(&map.encode()).expect("an encoded map decodes");
    assert_eq!(again, map);
    // Ring lookups build the ring: only for small maps, to keep executions fast.
    if map.kns.len() as u64 * u64::from(map.vnodes) > 1 << 14 {
        return;
    }
    let mut keys: Vec<Vec<u8>> = vec![b"k".to_vec(), data.iter().take(16).copied().collect()];
    keys.extend(map.replicated.keys().take(4).cloned());
    for key in &keys {
        assert!(map.shard_of(key) < map.shards_per_kn);
        let owners = map.owners(key);
        assert_eq!(owners.is_empty(), map.kns.is_empty());
        for kn in owners {
            assert!(map.contains(kn));
            assert!(map.is_owner(kn, key));
            assert!(map.endpoint(kn).is_some());
        }
    }
    if let Some(first) = map.kns.first() {
        if let Ok(next) = map.with_kn_removed(first.id) {
            assert_eq!(next.version, map.version + 1);
            next.validate().expect("a transition keeps the map valid");
            let _ = map.changed_ranges(&next);
        }
    }
}

/// Target `tcp_frame_decode`. Input: a frame body (without its length prefix), given to both
/// the request and the response decoder. What decodes must re-encode to the same bytes (the
/// encoding is canonical), except error responses, whose message is re-rendered.
pub fn tcp_frame_decode(data: &[u8]) {
    let b = Bytes::copy_from_slice(data);
    if let Ok((id, ops)) = decode_request(b.clone()) {
        let f = encode_request(id, &ops).expect("a decoded request re-encodes");
        assert_eq!(&f[4..], data);
    }
    if let Ok((id, Ok(cs))) = decode_response(b) {
        let f = encode_response(id, &Ok(cs));
        assert_eq!(&f[4..], data);
    }
}
