//! Property tests for every codec of dinomo-layout.
//!
//! For each on-PM structure: encode/decode round trips, corruption (flipped bits, torn images)
//! is refused with an error, and decoders never panic on arbitrary bytes, because everything
//! read back from PM is untrusted. Case counts are kept moderate so the whole layout test run
//! stays well under 30 s on a 2-core machine. Failures are not persisted to regression files
//! (no files are written next to the tests); proptest prints the minimal failing input instead.

use dinomo_layout::index::{
    depth_word, next_home, slot_entry_offset, slot_hash_offset, walk_chain, Bucket, EntryPtr,
    IndexHeader, Shape, BUCKET_SIZE, INDEX_MAGIC, SLOTS, STATE_OFFSET,
};
use dinomo_layout::log::{
    batch_len, decode_entry, encode_entry, entry_len, entry_len_from_header, scan, BatchBuilder,
    LogOp, Scan, BATCH_HEADER, BATCH_MAGIC, BATCH_TRAILER, ENTRY_HEADER, TRAILER_MAGIC,
};
use dinomo_layout::meta::{decode_slot, encode_slot, Roots, ROOTS_SIZE, SLOT_HEADER};
use dinomo_layout::segment::{
    SegState, SegmentHeader, TableEntry, HEADER_MAGIC, HEADER_SIZE, TABLE_ENTRY_SIZE,
};
use dinomo_layout::superblock::{Superblock, MAGIC, SUPERBLOCK_SIZE};
use dinomo_layout::{align8, key_hash, LayoutError, FORMAT_VERSION};
use proptest::prelude::*;
use proptest::sample::Index;

// ---------------------------------------------------------------------------------------------
// Helpers and strategies
// ---------------------------------------------------------------------------------------------

/// `cases` scaled by the environment variable `LAYOUT_PROPTEST_SCALE` (default 1), for a
/// longer soak run: `LAYOUT_PROPTEST_SCALE=50 cargo test -p dinomo-layout`.
fn cfg(cases: u32) -> ProptestConfig {
    let scale = std::env::var("LAYOUT_PROPTEST_SCALE")
        .ok()
        .and_then(|s| s.parse::<u32>().ok())
        .unwrap_or(1)
        .max(1);
    ProptestConfig {
        cases: cases.saturating_mul(scale),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn flip_bit(b: &mut [u8], bit: usize) {
    b[bit / 8] ^= 1 << (bit % 8);
}

/// A u64 that is often at an edge: zero, all ones, a power of two, a 4 KiB multiple, or random.
fn edgy_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(u64::MAX),
        (0u32..64).prop_map(|s| 1u64 << s),
        (0u64..1 << 40).prop_map(|x| x * 4096),
        any::<u64>(),
    ]
}

fn op() -> impl Strategy<Value = LogOp> {
    prop_oneof![Just(LogOp::Put), Just(LogOp::Delete)]
}

/// One log entry: (op, version, key, value).
type Ent = (LogOp, u64, Vec<u8>, Vec<u8>);

fn ent(max_key: usize, max_value: usize) -> impl Strategy<Value = Ent> {
    (
        op(),
        any::<u64>(),
        prop::collection::vec(any::<u8>(), 0..max_key),
        prop::collection::vec(any::<u8>(), 0..max_value),
    )
}

fn seg_header() -> impl Strategy<Value = SegmentHeader> {
    (
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(
            |(kn_id, epoch, segment_id, generation, chain_seq)| SegmentHeader {
                kn_id,
                epoch,
                segment_id,
                generation,
                chain_seq,
                stream: (generation % 7) as u16,
            },
        )
}

/// A superblock produced by `Superblock::plan` over log-uniform pool sizes (1 MiB .. 2 TiB)
/// and segment sizes 64 KiB .. 64 MiB, with a random pool id and creation time.
fn planned_superblock() -> impl Strategy<Value = Superblock> {
    (
        20u32..41,
        any::<u64>(),
        16u32..=26,
        0u64..(8 << 20),
        0u64..8192,
        any::<u64>(),
        any::<u64>(),
    )
        .prop_filter_map(
            "pool too small for 4 segments",
            |(shift, r, seg_shift, meta, cells, id, t)| {
                let pool = (1u64 << shift) + r % (1u64 << shift);
                let mut sb = Superblock::plan(pool, 1 << seg_shift, meta, cells).ok()?;
                sb.pool_id = id;
                sb.created_unix = t;
                Some(sb)
            },
        )
}

/// Checks the promise of `Superblock::decode`: every area is 4 KiB aligned, after the
/// superblock, in order, non-overlapping and inside the pool; segments are segment-aligned.
/// Computed in u128 so the check itself cannot overflow.
fn assert_sane_layout(sb: &Superblock) {
    let areas = [
        (sb.roots_off, u128::from(ROOTS_SIZE)),
        (
            sb.segment_table_off,
            u128::from(sb.segment_count) * u128::from(TABLE_ENTRY_SIZE),
        ),
        (sb.metadata_off, u128::from(sb.metadata_len)),
        (sb.index_area_off, u128::from(sb.index_area_len)),
        (
            sb.segments_off,
            u128::from(sb.segment_count) * u128::from(sb.segment_size),
        ),
    ];
    let mut end = u128::from(SUPERBLOCK_SIZE);
    for (off, len) in areas {
        assert_eq!(off % 4096, 0, "area at {off} is not 4 KiB aligned: {sb:?}");
        assert!(u128::from(off) >= end, "area at {off} overlaps: {sb:?}");
        end = u128::from(off) + len;
    }
    assert!(
        end <= u128::from(sb.pool_len),
        "areas end past the pool: {sb:?}"
    );
    assert!(sb.segment_size.is_power_of_two() && sb.segment_size >= 64 << 10);
    assert_eq!(sb.segments_off % sb.segment_size, 0);
}

/// Encodes a batch from raw parts with a correct chain: lets tests forge batches whose chain
/// is valid but whose contents are not what `BatchBuilder` would produce.
fn forge_batch(prev_chain: u32, count: u32, payload: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&BATCH_MAGIC.to_le_bytes());
    b.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    b.extend_from_slice(&count.to_le_bytes());
    b.extend_from_slice(&[0u8; 4]);
    b.extend_from_slice(payload);
    let chain = crc32c::crc32c_append(prev_chain, &b);
    b.extend_from_slice(&chain.to_le_bytes());
    b.extend_from_slice(&TRAILER_MAGIC.to_le_bytes());
    b
}

/// What a test expects of one batch: its offset, length, chain and entries with offsets.
struct Expected {
    offset: usize,
    len: usize,
    chain: u32,
    entries: Vec<(usize, Ent)>,
}

/// Writes `batches` as a log starting at `start` of a buffer whose first bytes are the segment
/// header `hdr`; returns the buffer (with `tail` zero bytes after the log) and the expectation.
fn build_log(
    hdr: &SegmentHeader,
    batches: &[Vec<Ent>],
    tail: usize,
) -> (Vec<u8>, Vec<Expected>, u32) {
    let mut seg = hdr.encode().to_vec();
    let mut chain = hdr.chain_seed();
    let mut expected = Vec::new();
    for batch in batches {
        let offset = seg.len();
        let mut bb = BatchBuilder::new();
        assert!(bb.is_empty());
        let mut entries = Vec::new();
        let mut payload = 0;
        for e in batch {
            let at = bb.push(e.0, e.1, &e.2, &e.3);
            assert_eq!(
                at,
                BATCH_HEADER + payload,
                "push returns the entry's batch offset"
            );
            payload += entry_len(e.2.len(), e.3.len());
            entries.push((offset + at, e.clone()));
        }
        assert_eq!(bb.count() as usize, batch.len());
        assert_eq!(bb.is_empty(), batch.is_empty());
        let promised = bb.encoded_len();
        let (bytes, c) = bb.finish(chain);
        assert_eq!(bytes.len(), promised, "encoded_len is the finished length");
        assert_eq!(bytes.len(), batch_len(payload));
        seg.extend_from_slice(&bytes);
        chain = c;
        expected.push(Expected {
            offset,
            len: bytes.len(),
            chain: c,
            entries,
        });
    }
    seg.resize(seg.len() + tail, 0);
    (seg, expected, chain)
}

// ---------------------------------------------------------------------------------------------
// Superblock
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(cfg(256))]

    #[test]
    fn superblock_planned_roundtrip(sb in planned_superblock()) {
        assert_sane_layout(&sb);
        prop_assert!(sb.segment_count >= 4);
        let enc = sb.encode();
        prop_assert!(enc.len() as u64 <= SUPERBLOCK_SIZE);
        prop_assert_eq!(&enc[0..8], &MAGIC.to_le_bytes());
        prop_assert_eq!(&enc[8..12], &FORMAT_VERSION.to_le_bytes());
        prop_assert_eq!(Superblock::decode(&enc), Ok(sb));
        // The whole 4 KiB block (zero tail after the checksum) decodes the same.
        let mut block = vec![0u8; SUPERBLOCK_SIZE as usize];
        block[..enc.len()].copy_from_slice(&enc);
        prop_assert_eq!(Superblock::decode(&block), Ok(sb));
        // Every segment maps back to itself; the bytes around the segments area do not.
        for id in [0, 1, sb.segment_count / 2, sb.segment_count - 1] {
            let off = sb.segment_offset(id);
            prop_assert!(off + sb.segment_size <= sb.pool_len);
            prop_assert_eq!(sb.segment_of(off), Some(id));
            prop_assert_eq!(sb.segment_of(off + sb.segment_size - 1), Some(id));
        }
        prop_assert_eq!(sb.segment_of(sb.segments_off - 1), None);
        prop_assert_eq!(sb.segment_of(sb.segment_offset(sb.segment_count)), None);
    }

    #[test]
    fn superblock_truncated_is_refused(sb in planned_superblock(), cut in any::<Index>()) {
        let enc = sb.encode();
        let n = cut.index(enc.len());
        let is_truncated = matches!(Superblock::decode(&enc[..n]), Err(LayoutError::Truncated { .. }));
        prop_assert!(is_truncated);
    }

    #[test]
    fn plan_refuses_bad_parameters_without_panicking(
        pool in edgy_u64(),
        seg in edgy_u64(),
        meta in prop_oneof![0u64..(64 << 20), edgy_u64()],
        cells in prop_oneof![0u64..8192, edgy_u64()],
    ) {
        match Superblock::plan(pool, seg, meta, cells) {
            Ok(sb) => {
                assert_sane_layout(&sb);
                prop_assert!(sb.segment_count >= 4);
                prop_assert_eq!(sb.pool_len, pool);
                prop_assert_eq!(sb.segment_size, seg);
                prop_assert!(sb.metadata_len >= meta);
            }
            Err(e) => {
                let is_invalid = matches!(e, LayoutError::Invalid { .. });
                prop_assert!(is_invalid);
            }
        }
    }
}

proptest! {
    #![proptest_config(cfg(64))]

    /// Every single flipped bit of the encoded superblock is refused (magic, version or
    /// checksum), never decoded into a different layout.
    #[test]
    fn superblock_any_bit_flip_is_refused(sb in planned_superblock()) {
        let mut enc = sb.encode();
        for bit in 0..enc.len() * 8 {
            flip_bit(&mut enc, bit);
            let r = Superblock::decode(&enc);
            prop_assert!(r.is_err(), "bit {} flipped was accepted: {:?}", bit, r);
            flip_bit(&mut enc, bit);
        }
        prop_assert_eq!(Superblock::decode(&enc), Ok(sb));
    }
}

proptest! {
    #![proptest_config(cfg(256))]

    #[test]
    fn superblock_decode_never_panics_on_arbitrary_bytes(
        bytes in prop::collection::vec(any::<u8>(), 0..300),
    ) {
        let _ = Superblock::decode(&bytes);
    }

    /// Arbitrary field values behind a valid magic, version and checksum (what a buggy writer
    /// could have persisted): decode never panics, and whatever it accepts is a sane layout that
    /// keeps every area inside the pool.
    #[test]
    fn superblock_decode_checks_fields_behind_a_valid_checksum(
        w in prop::array::uniform12(edgy_u64()),
        seg_shift in prop_oneof![16u32..64, 0u32..64],
    ) {
        let sb = Superblock {
            pool_len: w[0],
            pool_id: w[1],
            created_unix: w[2],
            segment_size: 1u64 << seg_shift,
            segment_count: w[4],
            roots_off: w[5],
            segment_table_off: w[6],
            metadata_off: w[7],
            metadata_len: w[8],
            index_area_off: w[9],
            index_area_len: w[10],
            segments_off: w[11],
        };
        let enc = sb.encode();
        if let Ok(got) = Superblock::decode(&enc) {
            prop_assert_eq!(got, sb);
            assert_sane_layout(&got);
        }
    }
}

/// The example layout in docs/formats.md (the dpm-node defaults: 1 GiB pool, 8 MiB segments,
/// 1 MiB of metadata, 4096 indirect cells). Keep the two in step.
#[test]
fn default_pool_plan_matches_the_docs() {
    let sb = Superblock::plan(1 << 30, 8 << 20, 1 << 20, 4096).unwrap();
    assert_eq!(
        (
            sb.roots_off,
            sb.segment_table_off,
            sb.metadata_off,
            sb.metadata_len,
            sb.index_area_off,
            sb.index_area_len,
            sb.segments_off,
            sb.segment_count,
        ),
        (
            4096,
            8192,
            12288,
            1 << 20,
            1_060_864,
            270_336,
            8_388_608,
            127
        )
    );
    assert_eq!(sb.encode().len(), 132);
}

/// Regression: a segment count so large that `count * 32` overflows u64 used to panic in debug
/// builds (and wrap, passing the bounds check, in release builds).
#[test]
fn superblock_with_overflowing_segment_table_is_refused() {
    let mut sb = Superblock::plan(1 << 30, 1 << 20, 0, 64).unwrap();
    sb.segment_count = u64::MAX / TABLE_ENTRY_SIZE + 2;
    let r = Superblock::decode(&sb.encode());
    assert!(
        matches!(r, Err(LayoutError::Invalid { .. })),
        "accepted or wrong error: {r:?}"
    );
}

/// Regression: `plan` with sizes whose rounding or sums overflow u64 used to panic in debug
/// builds and, in release builds, wrap (a metadata length near u64::MAX rounded up to 0 bytes).
#[test]
fn plan_refuses_sizes_that_overflow() {
    for (pool, seg, meta, cells) in [
        (1u64 << 40, 1u64 << 16, u64::MAX, 64u64),
        (1u64 << 40, 1u64 << 16, u64::MAX - 1_000_000, 64),
        (u64::MAX, 1u64 << 63, 0, 64),
        (u64::MAX - 4095, 1u64 << 62, 0, 64),
        (1u64 << 30, 1u64 << 16, 0, u64::MAX),
    ] {
        let r = Superblock::plan(pool, seg, meta, cells);
        assert!(
            matches!(r, Err(LayoutError::Invalid { .. })),
            "plan({pool}, {seg}, {meta}, {cells}) gave {r:?}"
        );
    }
    let sb = Superblock::plan(u64::MAX, 1 << 16, 0, 4096).unwrap();
    assert_sane_layout(&sb);
}

#[test]
fn superblock_other_version_is_refused_by_name() {
    let sb = Superblock::plan(1 << 30, 8 << 20, 1 << 20, 4096).unwrap();
    let mut enc = sb.encode();
    enc[8..12].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
    let crc = crc32c::crc32c(&enc[..enc.len() - 4]);
    let n = enc.len();
    enc[n - 4..].copy_from_slice(&crc.to_le_bytes());
    assert_eq!(
        Superblock::decode(&enc),
        Err(LayoutError::Version {
            what: "pool",
            found: FORMAT_VERSION + 1,
            expected: FORMAT_VERSION
        })
    );
    let mut zero = [0u8; 4096];
    assert!(matches!(
        Superblock::decode(&zero),
        Err(LayoutError::BadMagic { found: 0, .. })
    ));
    zero[..enc.len()].copy_from_slice(&sb.encode());
    assert_eq!(Superblock::decode(&zero), Ok(sb));
}

// ---------------------------------------------------------------------------------------------
// Segment header and segment table
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(cfg(256))]

    #[test]
    fn segment_header_roundtrip(h in seg_header()) {
        let enc = h.encode();
        prop_assert_eq!(enc.len(), HEADER_SIZE);
        prop_assert_eq!(&enc[0..8], &HEADER_MAGIC.to_le_bytes());
        prop_assert_eq!(&enc[8..12], &h.kn_id.to_le_bytes());
        prop_assert_eq!(&enc[12..16], &FORMAT_VERSION.to_le_bytes());
        prop_assert_eq!(&enc[32..40], &h.generation.to_le_bytes());
        prop_assert_eq!(&enc[48..50], &h.stream.to_le_bytes());
        prop_assert!(enc[50..60].iter().all(|&b| b == 0), "reserved bytes are zero");
        prop_assert_eq!(&enc[60..64], &h.chain_seed().to_le_bytes());
        prop_assert_eq!(SegmentHeader::decode(&enc), Ok(h));
        let mut longer = enc.to_vec();
        longer.extend_from_slice(&[0xAB; 100]);
        prop_assert_eq!(SegmentHeader::decode(&longer), Ok(h));
        let is_truncated = matches!(
            SegmentHeader::decode(&enc[..HEADER_SIZE - 1]),
            Err(LayoutError::Truncated { .. })
        );
        prop_assert!(is_truncated);
    }

    #[test]
    fn segment_header_any_bit_flip_is_refused(h in seg_header()) {
        let mut enc = h.encode();
        for bit in 0..HEADER_SIZE * 8 {
            flip_bit(&mut enc, bit);
            let r = SegmentHeader::decode(&enc);
            prop_assert!(r.is_err(), "bit {} flipped was accepted: {:?}", bit, r);
            flip_bit(&mut enc, bit);
        }
    }

    /// Reallocating a segment bumps its generation, which must change the chain seed.
    #[test]
    fn chain_seed_differs_when_generation_differs(h in seg_header(), other in any::<u64>()) {
        prop_assume!(other != h.generation);
        let h2 = SegmentHeader { generation: other, ..h };
        prop_assert_ne!(h.chain_seed(), h2.chain_seed());
    }

    /// For generations below 2^32 the difference is a burst of at most 32 bits, which CRC32C
    /// always detects: distinct seeds are guaranteed, not just likely.
    #[test]
    fn chain_seed_differs_for_small_generations(
        h in seg_header(),
        g1 in any::<u32>(),
        g2 in any::<u32>(),
    ) {
        prop_assume!(g1 != g2);
        let a = SegmentHeader { generation: u64::from(g1), ..h };
        let b = SegmentHeader { generation: u64::from(g2), ..h };
        prop_assert_ne!(a.chain_seed(), b.chain_seed());
    }

    /// Two different seeds never give the same chain over the same bytes (the CRC state
    /// difference is multiplied by an invertible power of x), so a batch chained from an old
    /// generation's seed can never verify under the new one.
    #[test]
    fn chains_from_different_seeds_never_meet(
        s1 in any::<u32>(),
        s2 in any::<u32>(),
        data in prop::collection::vec(any::<u8>(), 0..600),
    ) {
        prop_assume!(s1 != s2);
        prop_assert_ne!(crc32c::crc32c_append(s1, &data), crc32c::crc32c_append(s2, &data));
    }

    #[test]
    fn segment_header_decode_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..160)) {
        let _ = SegmentHeader::decode(&bytes);
    }

    #[test]
    fn table_entry_words_roundtrip(
        state in prop_oneof![
            Just(SegState::Free),
            Just(SegState::Open),
            Just(SegState::Sealed),
            Just(SegState::Merged),
            Just(SegState::Index)
        ],
        kn_id in any::<u32>(),
        stream in any::<u16>(),
        generation in any::<u64>(),
        chain_seq in any::<u64>(),
        merged_upto in any::<u64>(),
    ) {
        let e = TableEntry { state, kn_id, stream, generation, chain_seq, merged_upto };
        let w = e.words();
        prop_assert_eq!(w[0], state as u64 | (u64::from(stream) << 16) | (u64::from(kn_id) << 32));
        prop_assert_eq!(w[0], TableEntry::state_word(state, kn_id, stream));
        prop_assert_eq!(&w[1..], &[generation, chain_seq, merged_upto][..]);
        prop_assert_eq!(TableEntry::from_words(w), Ok(e));
        prop_assert_eq!(SegState::from_u8(state as u8), Ok(state));
    }

    #[test]
    fn table_entry_unknown_state_is_refused(
        state in 5u8..=255,
        rest in any::<u64>(),
        w in prop::array::uniform3(any::<u64>()),
    ) {
        let w0 = (rest & !0xff) | u64::from(state);
        let is_invalid = matches!(
            TableEntry::from_words([w0, w[0], w[1], w[2]]),
            Err(LayoutError::Invalid { .. })
        );
        prop_assert!(is_invalid);
    }
}

#[test]
fn free_table_entry_is_all_zero_words() {
    // A freshly formatted (zero-filled) pool must read as all segments free.
    assert_eq!(TableEntry::FREE.words(), [0; 4]);
    assert_eq!(TableEntry::from_words([0; 4]), Ok(TableEntry::FREE));
}

// ---------------------------------------------------------------------------------------------
// Log entries
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(cfg(256))]

    #[test]
    fn log_entry_roundtrip(e in ent(300, 2000), prefix in 0usize..3) {
        let (op, version, key, value) = &e;
        // Entries are appended after whatever the buffer holds.
        let mut buf = vec![0x5Au8; prefix * 8];
        encode_entry(*op, *version, key, value, &mut buf);
        let enc = &buf[prefix * 8..];
        let len = entry_len(key.len(), value.len());
        prop_assert_eq!(enc.len(), len);
        prop_assert_eq!(len % 8, 0);
        prop_assert_eq!(len, align8(ENTRY_HEADER + key.len() + value.len()));
        prop_assert_eq!(entry_len_from_header(&enc[..ENTRY_HEADER]), Ok(len));
        prop_assert!(enc[ENTRY_HEADER + key.len() + value.len()..].iter().all(|&b| b == 0));
        let (got, n) = decode_entry(enc).unwrap();
        prop_assert_eq!(n, len);
        prop_assert_eq!(got.op, *op);
        prop_assert_eq!(got.version, *version);
        prop_assert_eq!(got.key, &key[..]);
        prop_assert_eq!(got.value, &value[..]);
        // Without its padding the entry still verifies (a READ of exactly the body).
        let body = ENTRY_HEADER + key.len() + value.len();
        prop_assert_eq!(decode_entry(&enc[..body]).map(|(e, _)| e), Ok(got));
        let is_truncated = matches!(decode_entry(&enc[..body - 1]), Err(LayoutError::Truncated { .. }));
        prop_assert!(is_truncated);
    }
}

proptest! {
    #![proptest_config(cfg(96))]

    /// Every bit of the header, and sampled bits of the key and value, flipped one at a time:
    /// always refused. Padding is outside the CRC and is checked to be ignored.
    #[test]
    fn log_entry_bit_flips_are_detected(
        e in ent(300, 2000),
        picks in prop::collection::vec(any::<Index>(), 32),
    ) {
        let (op, version, key, value) = &e;
        let mut enc = Vec::new();
        encode_entry(*op, *version, key, value, &mut enc);
        let body = ENTRY_HEADER + key.len() + value.len();
        let mut bits: Vec<usize> = (0..ENTRY_HEADER * 8).collect();
        if body > ENTRY_HEADER {
            bits.extend(picks.iter().map(|p| ENTRY_HEADER * 8 + p.index((body - ENTRY_HEADER) * 8)));
        }
        for bit in bits {
            flip_bit(&mut enc, bit);
            let r = decode_entry(&enc);
            prop_assert!(r.is_err(), "bit {} flipped was accepted: {:?}", bit, r);
            flip_bit(&mut enc, bit);
        }
        for bit in body * 8..enc.len() * 8 {
            flip_bit(&mut enc, bit);
            prop_assert!(decode_entry(&enc).is_ok(), "padding is not covered by the CRC");
            flip_bit(&mut enc, bit);
        }
    }
}

proptest! {
    #![proptest_config(cfg(256))]

    #[test]
    fn decode_entry_never_panics_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        if let Ok((e, n)) = decode_entry(&bytes) {
            prop_assert_eq!(n, entry_len(e.key.len(), e.value.len()));
        }
        let _ = entry_len_from_header(&bytes);
    }

    /// A valid entry with random header fields overwritten (lengths, op, flags) and the CRC
    /// recomputed: decode must still either refuse it or stay inside the buffer.
    #[test]
    fn decode_entry_checks_fields_behind_a_valid_crc(
        e in ent(40, 100),
        op_byte in any::<u8>(),
        key_len in prop_oneof![any::<u16>(), 0u16..64],
        value_len in prop_oneof![any::<u32>(), 0u32..128],
    ) {
        let mut enc = Vec::new();
        encode_entry(e.0, e.1, &e.2, &e.3, &mut enc);
        enc[4] = op_byte;
        enc[6..8].copy_from_slice(&key_len.to_le_bytes());
        enc[8..12].copy_from_slice(&value_len.to_le_bytes());
        let body = (ENTRY_HEADER + usize::from(key_len) + value_len as usize).min(enc.len());
        let crc = crc32c::crc32c(&enc[4..body]);
        enc[0..4].copy_from_slice(&crc.to_le_bytes());
        if let Ok((got, _)) = decode_entry(&enc) {
            prop_assert!(op_byte == 1 || op_byte == 2);
            prop_assert_eq!(got.key.len(), usize::from(key_len));
            prop_assert_eq!(got.value.len(), value_len as usize);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Batches and scan
// ---------------------------------------------------------------------------------------------

fn batches() -> impl Strategy<Value = Vec<Vec<Ent>>> {
    prop::collection::vec(prop::collection::vec(ent(64, 300), 0..6), 0..8)
}

proptest! {
    #![proptest_config(cfg(192))]

    /// Scan returns exactly the batches written, in order, with their entries at the offsets
    /// the builder reported; `end()` is the log's length and `chain()` the last chain value.
    #[test]
    fn scan_returns_exactly_the_batches_written(
        h in seg_header(),
        batches in batches(),
        tail in 0usize..64,
    ) {
        let (seg, expected, last_chain) = build_log(&h, &batches, tail);
        let start = HEADER_SIZE;
        let total_end = expected.last().map_or(start, |b| b.offset + b.len);
        prop_assert_eq!(total_end, seg.len() - tail);
        let mut s = scan(&seg, start, h.chain_seed());
        let got: Vec<_> = s.by_ref().collect();
        prop_assert_eq!(got.len(), expected.len());
        for (g, x) in got.iter().zip(&expected) {
            prop_assert_eq!(g.offset, x.offset);
            prop_assert_eq!(g.len, x.len);
            prop_assert_eq!(g.chain, x.chain);
            prop_assert_eq!(g.entries.len(), x.entries.len());
            for ((off, e), (xoff, (op, version, key, value))) in g.entries.iter().zip(&x.entries) {
                prop_assert_eq!(off, xoff);
                prop_assert_eq!((e.op, e.version, e.key, e.value), (*op, *version, &key[..], &value[..]));
                // The offset points at the entry itself: decoding there gives the same entry.
                let (again, n) = decode_entry(&seg[*off..]).unwrap();
                prop_assert_eq!(again, *e);
                prop_assert_eq!(n, entry_len(key.len(), value.len()));
            }
        }
        prop_assert_eq!(s.end(), total_end);
        prop_assert_eq!(Scan::chain(&s), last_chain);
        prop_assert!(s.stop_reason().is_none(), "a zero tail is a clean end: {:?}", s.stop_reason());
        // Scanning again from any batch boundary with that batch's chain gives the rest.
        for (i, x) in expected.iter().enumerate() {
            let prev = if i == 0 { h.chain_seed() } else { expected[i - 1].chain };
            let rest: Vec<_> = scan(&seg, x.offset, prev).map(|b| b.offset).collect();
            let want: Vec<_> = expected[i..].iter().map(|b| b.offset).collect();
            prop_assert_eq!(rest, want);
        }
    }

    /// One corrupted byte anywhere in the log: scan returns exactly the batches before the one
    /// holding it and ends at that batch; a byte changed past the end changes nothing.
    #[test]
    fn scan_stops_at_the_corrupted_batch(
        h in seg_header(),
        batches in batches(),
        at in any::<Index>(),
        mask in 1u8..=255,
    ) {
        let (mut seg, expected, _) = build_log(&h, &batches, 64);
        let p = HEADER_SIZE + at.index(seg.len() - HEADER_SIZE);
        seg[p] ^= mask;
        let hit = expected.iter().position(|b| p >= b.offset && p < b.offset + b.len);
        let keep = hit.unwrap_or(expected.len());
        let mut s = scan(&seg, HEADER_SIZE, h.chain_seed());
        let got: Vec<_> = s.by_ref().map(|b| b.offset).collect();
        let want: Vec<_> = expected[..keep].iter().map(|b| b.offset).collect();
        prop_assert_eq!(got, want);
        let end = if keep == 0 { HEADER_SIZE } else { expected[keep - 1].offset + expected[keep - 1].len };
        prop_assert_eq!(s.end(), end);
        // A damaged batch magic reads as the clean end of the log (no stop reason); anything
        // else inside a batch is reported.
        if let Some(i) = hit {
            let in_magic = p < expected[i].offset + 4;
            prop_assert_eq!(s.stop_reason().is_some(), !in_magic);
        }
    }

    /// The chain value after batch i is the CRC32C of the segment header's first 60 bytes
    /// followed by every batch so far without its 8-byte trailer: one running checksum over
    /// the whole log.
    #[test]
    fn chain_is_the_crc_of_the_log_prefix(h in seg_header(), batches in batches()) {
        let (seg, expected, _) = build_log(&h, &batches, 0);
        let mut covered = seg[..60].to_vec();
        prop_assert_eq!(crc32c::crc32c(&covered), h.chain_seed());
        for b in &expected {
            covered.extend_from_slice(&seg[b.offset..b.offset + b.len - BATCH_TRAILER]);
            prop_assert_eq!(crc32c::crc32c(&covered), b.chain);
            prop_assert_eq!(&seg[b.offset + b.len - 8..b.offset + b.len - 4], &b.chain.to_le_bytes());
        }
    }

    /// The wrong seed (another generation of the segment) accepts nothing.
    #[test]
    fn scan_with_another_seed_accepts_nothing(h in seg_header(), batches in batches(), other in any::<u32>()) {
        prop_assume!(other != h.chain_seed());
        let (seg, expected, _) = build_log(&h, &batches, 8);
        let mut s = scan(&seg, HEADER_SIZE, other);
        prop_assert_eq!(s.by_ref().count(), 0);
        prop_assert_eq!(s.end(), HEADER_SIZE);
        prop_assert_eq!(Scan::chain(&s), other);
        prop_assert_eq!(s.stop_reason().is_some(), !expected.is_empty());
    }
}

proptest! {
    #![proptest_config(cfg(256))]

    #[test]
    fn scan_never_panics_on_arbitrary_bytes(
        bytes in prop::collection::vec(any::<u8>(), 0..1024),
        start in 0usize..1100,
        chain in any::<u32>(),
    ) {
        let mut s = scan(&bytes, start, chain);
        let mut pos = start;
        for b in s.by_ref() {
            prop_assert_eq!(b.offset, pos);
            pos += b.len;
            prop_assert!(pos <= bytes.len());
        }
        prop_assert_eq!(s.end(), pos);
    }

    /// Random bytes behind a batch magic and a plausible payload length, so the length and
    /// chain checks are exercised rather than the magic check.
    #[test]
    fn scan_never_panics_on_random_batches(
        mut bytes in prop::collection::vec(any::<u8>(), 24..1024),
        payload in prop_oneof![any::<u32>(), (0u32..128).prop_map(|x| x * 8)],
        chain in any::<u32>(),
    ) {
        bytes[0..4].copy_from_slice(&BATCH_MAGIC.to_le_bytes());
        bytes[4..8].copy_from_slice(&payload.to_le_bytes());
        let mut s = scan(&bytes, 0, chain);
        let _ = s.by_ref().count();
        prop_assert!(s.end() <= bytes.len());
    }

    /// Batches with a valid chain but forged contents (garbage payload, or real entries with a
    /// wrong count, including counts near u32::MAX): never a panic; accepted only when the
    /// entries verify and the count matches.
    #[test]
    fn scan_checks_batch_contents_behind_a_valid_chain(
        entries in prop::collection::vec(ent(16, 40), 0..4),
        garbage in prop::collection::vec(any::<u8>(), 0..20),
        count in prop_oneof![0u32..6, any::<u32>(), Just(u32::MAX)],
        use_garbage in any::<bool>(),
        seed in any::<u32>(),
    ) {
        let mut payload = Vec::new();
        for e in &entries {
            encode_entry(e.0, e.1, &e.2, &e.3, &mut payload);
        }
        if use_garbage {
            payload.extend_from_slice(&garbage);
            payload.resize(align8(payload.len()), 0xEE);
        }
        let batch = forge_batch(seed, count, &payload);
        let mut buf = batch.clone();
        buf.extend_from_slice(&[0u8; 16]);
        let mut s = scan(&buf, 0, seed);
        let got: Vec<_> = s.by_ref().collect();
        let garbage_present = use_garbage && !garbage.is_empty();
        if !garbage_present && count as usize == entries.len() {
            prop_assert_eq!(got.len(), 1);
            prop_assert_eq!(s.end(), batch.len());
        } else if garbage_present {
            // Garbage that happens to be a valid entry is astronomically unlikely.
            prop_assert_eq!(got.len(), 0);
            prop_assert!(s.stop_reason().is_some());
        } else {
            prop_assert_eq!(got.len(), 0);
            let is_invalid = matches!(s.stop_reason(), Some(LayoutError::Invalid { .. }));
            prop_assert!(is_invalid);
            prop_assert_eq!(s.end(), 0);
        }
    }
}

/// Regression: a batch whose count field is near u32::MAX behind a valid chain used to make
/// `scan` reserve room for billions of entries (an allocation failure aborts the process).
#[test]
fn scan_survives_a_forged_huge_count() {
    let mut payload = Vec::new();
    encode_entry(LogOp::Put, 1, b"k", b"v", &mut payload);
    let batch = forge_batch(7, u32::MAX, &payload);
    let mut s = scan(&batch, 0, 7);
    assert_eq!(s.by_ref().count(), 0);
    assert!(matches!(s.stop_reason(), Some(LayoutError::Invalid { .. })));
    assert_eq!(s.end(), 0);
}

#[test]
fn empty_batch_is_valid_and_minimal() {
    let (bytes, chain) = BatchBuilder::new().finish(42);
    assert_eq!(bytes.len(), BATCH_HEADER + BATCH_TRAILER);
    assert_eq!(bytes.len(), batch_len(0));
    let mut s = scan(&bytes, 0, 42);
    let b = s.next().expect("an empty batch is a valid batch");
    assert!(b.entries.is_empty());
    assert_eq!((b.len, b.chain, s.end()), (bytes.len(), chain, bytes.len()));
    assert!(s.next().is_none());
    assert!(s.stop_reason().is_none());
}

// ---------------------------------------------------------------------------------------------
// Index: EntryPtr words, buckets, table headers
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(cfg(256))]

    #[test]
    fn entry_ptr_roundtrip(units in 1u64..(1 << 45), len in prop_oneof![0usize..4096, 0usize..(1 << 20)]) {
        let offset = units * 8;
        let p = EntryPtr::new(offset, len);
        prop_assert_eq!(p.offset, offset);
        if len.div_ceil(8) <= usize::from(u16::MAX) {
            prop_assert_eq!(p.len as usize, align8(len));
        } else {
            prop_assert_eq!(p.len, 0, "too long for 16 bits of 8-byte units: fetch the header first");
        }
        let w = p.to_word();
        prop_assert_ne!(w, 0);
        prop_assert_eq!(w & ((1 << 48) - 1), offset);
        prop_assert_eq!(w >> 48, u64::from(p.len / 8));
        prop_assert_eq!(EntryPtr::from_word(w), Some(p));
    }

    #[test]
    fn entry_ptr_word_roundtrip(w in any::<u64>()) {
        match EntryPtr::from_word(w) {
            None => prop_assert_eq!(w, 0),
            Some(p) => prop_assert_eq!(p.to_word(), w),
        }
    }

    #[test]
    fn bucket_roundtrip(
        next in any::<u64>(),
        slots in prop::array::uniform3((any::<u64>(), any::<u64>())),
        state in prop_oneof![Just(0u64), (0u32..64).prop_map(depth_word), any::<u64>()],
    ) {
        let b = Bucket { next, slots, state };
        let enc = b.encode();
        prop_assert_eq!(enc.len(), BUCKET_SIZE);
        prop_assert_eq!(&enc[0..8], &next.to_le_bytes());
        for (i, (h, e)) in slots.iter().enumerate() {
            prop_assert_eq!(&enc[slot_hash_offset(i)..slot_hash_offset(i) + 8], &h.to_le_bytes());
            prop_assert_eq!(&enc[slot_entry_offset(i)..slot_entry_offset(i) + 8], &e.to_le_bytes());
            prop_assert_eq!(slot_hash_offset(i) % 8, 0);
        }
        prop_assert_eq!(&enc[STATE_OFFSET..], &state.to_le_bytes());
        prop_assert_eq!(Bucket::decode(&enc), Ok(b));
        let tagged = state >> 8 == depth_word(0) >> 8 && (state & 0xff) <= 63;
        prop_assert_eq!(b.depth().is_some(), tagged);
    }

    #[test]
    fn bucket_decode_never_panics_and_is_total(bytes in prop::collection::vec(any::<u8>(), 0..140)) {
        match Bucket::decode(&bytes) {
            Ok(b) => {
                prop_assert!(bytes.len() >= BUCKET_SIZE);
                prop_assert_eq!(&b.encode()[..], &bytes[..BUCKET_SIZE]);
            }
            Err(e) => {
                prop_assert!(bytes.len() < BUCKET_SIZE);
                let is_truncated = matches!(e, LayoutError::Truncated { .. });
                prop_assert!(is_truncated);
            }
        }
    }

    /// `candidates` yields exactly the non-empty slots whose hash matches, in slot order.
    #[test]
    fn bucket_candidates(
        key in prop::collection::vec(any::<u8>(), 0..32),
        slots in prop::array::uniform3((0u8..3, prop_oneof![Just(0u64), any::<u64>()])),
        other in any::<u64>(),
    ) {
        let h = key_hash(&key);
        let slots: [(u64, u64); SLOTS] = slots.map(|(which, e)| {
            let hash = match which { 0 => h, 1 => h ^ 1, _ => other };
            (hash, e)
        });
        let b = Bucket { next: 0, slots, state: 0 };
        let got: Vec<_> = b.candidates(h).collect();
        let want: Vec<_> = slots
            .iter()
            .enumerate()
            .filter(|(_, (sh, e))| *sh == h && *e != 0)
            .map(|(i, (_, e))| (i, EntryPtr::from_word(*e).unwrap()))
            .collect();
        prop_assert_eq!(got, want);
    }

    #[test]
    fn index_header_roundtrip(
        chunk_shift in 0u32..40,
        dir in any::<u64>(),
        max_chunks in 1u64..1 << 20,
        min_level in 0u32..63,
    ) {
        let h = IndexHeader {
            chunk_buckets: 1 << chunk_shift,
            directory_off: (dir % (1 << 48)) & !7,
            max_chunks,
            min_level,
        };
        let enc = h.encode();
        prop_assert_eq!(&enc[0..8], &INDEX_MAGIC.to_le_bytes());
        prop_assert_eq!(IndexHeader::decode(&enc), Ok(h));
        let (chunk, within) = h.locate(dir);
        prop_assert_eq!(chunk * h.chunk_buckets + within / BUCKET_SIZE as u64, dir);
        prop_assert_eq!(within % 64, 0);
    }

    #[test]
    fn index_header_any_bit_flip_is_refused(chunk_shift in 0u32..40, max_chunks in 1u64..4096) {
        let h = IndexHeader { chunk_buckets: 1 << chunk_shift, directory_off: 4096, max_chunks, min_level: 6 };
        let mut enc = h.encode();
        for bit in 0..64 * 8 {
            flip_bit(&mut enc, bit);
            let r = IndexHeader::decode(&enc);
            prop_assert!(r.is_err(), "bit {} flipped was accepted: {:?}", bit, r);
            flip_bit(&mut enc, bit);
        }
    }

    #[test]
    fn index_header_and_shape_decode_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let _ = IndexHeader::decode(&bytes);
        let _ = IndexHeader::decode_with_shape(&bytes);
    }

    /// Any shape decode accepts maps every hash to an existing bucket of the right depth, and a
    /// reader with a stale shape reaches the same bucket by following depths.
    #[test]
    fn shapes_and_stale_readers_agree(level in 0u32..20, split_pick in any::<u64>(), grow in 0u32..64, hash in any::<u64>()) {
        let old = Shape { level, split: split_pick % (1 << level) };
        prop_assert_eq!(Shape::from_word(old.word()), Ok(old));
        let mut new = old;
        for _ in 0..grow {
            new = new.grown();
        }
        // The depth of bucket b in `new`: level+1 if already split this round, else level;
        // buckets at or past 2^level were made by this round's splits.
        let depth_of = |b: u64| -> u32 {
            let low = b & ((1 << new.level) - 1);
            if b >= 1 << new.level || low < new.split { new.level + 1 } else { new.level }
        };
        let (want, want_depth) = new.home(hash);
        prop_assert!(want < new.buckets());
        prop_assert_eq!(depth_of(want), want_depth);
        let (mut b, mut d) = old.home(hash);
        for _ in 0..64 {
            let bd = depth_of(b);
            prop_assert!(bd >= d);
            match next_home(hash, b, d, bd) {
                Some((nb, nd)) => { prop_assert!(nb < new.buckets()); b = nb; d = nd; }
                None => break,
            }
        }
        prop_assert_eq!(b, want);
    }

    /// Chain walks over arbitrary bytes end (or refuse) without panicking.
    #[test]
    fn walk_chain_over_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..2048), start in any::<u64>()) {
        let mut n = 0;
        let _ = walk_chain(&bytes, start % 4096, 100, |_, _| { n += 1; true });
        prop_assert!(n <= 100);
    }
}

#[test]
fn entry_ptr_refuses_unusable_offsets() {
    for offset in [0u64, 12, 1 << 48, !7] {
        let r = std::panic::catch_unwind(|| EntryPtr::new(offset, 8));
        assert!(r.is_err(), "offset {offset} accepted");
    }
    assert_eq!(EntryPtr::from_word(0), None);
    // The largest length that still fits: 65535 units of 8 bytes.
    assert_eq!(EntryPtr::new(8, 65535 * 8).len, 65535 * 8);
    assert_eq!(EntryPtr::new(8, 65535 * 8 + 1).len, 0);
}

// ---------------------------------------------------------------------------------------------
// Metadata slots and roots
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(cfg(256))]

    #[test]
    fn metadata_slot_roundtrip(
        seq in any::<u64>(),
        data in prop::collection::vec(any::<u8>(), 0..2000),
        slack in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let img = encode_slot(seq, &data);
        prop_assert_eq!(img.len(), SLOT_HEADER + data.len());
        prop_assert_eq!(&img[0..8], &seq.to_le_bytes());
        prop_assert_eq!(&img[8..12], &(data.len() as u32).to_le_bytes());
        // The slot's area is usually larger than the image: whatever follows is ignored.
        let mut area = img.clone();
        area.extend_from_slice(&slack);
        prop_assert_eq!(decode_slot(&area), Ok(Some((seq, &data[..]))));
        prop_assert_eq!(decode_slot(&img), Ok(Some((seq, &data[..]))));
        let is_truncated = matches!(decode_slot(&img[..img.len() - 1]), Err(LayoutError::Truncated { .. }));
        prop_assert!(is_truncated);
    }

    #[test]
    fn never_written_slot_is_none(len in SLOT_HEADER..512, tail in any::<u8>()) {
        let mut area = vec![0u8; len];
        prop_assert_eq!(decode_slot(&area), Ok(None));
        // Only the header decides: bytes after a zero header are not looked at.
        if len > SLOT_HEADER {
            area[len - 1] = tail;
            prop_assert_eq!(decode_slot(&area), Ok(None));
        }
    }

    #[test]
    fn metadata_slot_bit_flips_are_detected(
        seq in 1u64..,
        data in prop::collection::vec(any::<u8>(), 0..256),
    ) {
        let mut img = encode_slot(seq, &data);
        img.extend_from_slice(&[0u8; 64]);
        for bit in 0..(SLOT_HEADER + data.len()) * 8 {
            flip_bit(&mut img, bit);
            let r = decode_slot(&img);
            prop_assert!(r.is_err(), "bit {} flipped was accepted: {:?}", bit, r);
            flip_bit(&mut img, bit);
        }
    }

    /// A slot image written over an older one and torn after k bytes reads as the old copy, the
    /// new copy, or an error; never as a mixture.
    #[test]
    fn metadata_slot_torn_over_old_copy(
        old_seq in 1u64..1000,
        old in prop::collection::vec(any::<u8>(), 0..300),
        new in prop::collection::vec(any::<u8>(), 0..300),
        k in any::<Index>(),
    ) {
        let old_img = encode_slot(old_seq, &old);
        let new_img = encode_slot(old_seq + 2, &new);
        let mut area = vec![0u8; 700];
        area[..old_img.len()].copy_from_slice(&old_img);
        let k = k.index(new_img.len() + 1);
        area[..k].copy_from_slice(&new_img[..k]);
        match decode_slot(&area) {
            Ok(Some((s, d))) => {
                let is_old = s == old_seq && d == &old[..];
                // The new copy only when every one of its bytes is on PM (the unwritten rest
                // may happen to hold the same bytes already).
                let is_new = s == old_seq + 2 && d == &new[..] && area[..new_img.len()] == new_img[..];
                prop_assert!(is_old || is_new, "torn after {} bytes read as seq {}", k, s);
            }
            Ok(None) => prop_assert!(false, "a torn slot read as never written"),
            Err(_) => {}
        }
    }

    #[test]
    fn decode_slot_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        if let Ok(Some((_, d))) = decode_slot(&bytes) {
            prop_assert!(SLOT_HEADER + d.len() <= bytes.len());
        }
    }
}

#[test]
fn roots_words_are_aligned_and_inside_the_area() {
    for w in [
        Roots::INDEX_TABLE,
        Roots::SEGMENT_GENERATION,
        Roots::KN_EPOCH,
    ] {
        assert_eq!(w % 8, 0);
        assert!(
            w + 8 <= Roots::KN_FENCE,
            "fixed roots lie before the fence table"
        );
    }
    let last_fence = Roots::KN_FENCE + 8 * (u64::from(Roots::MAX_KNS) - 1);
    assert!(last_fence + 8 <= ROOTS_SIZE);
    assert_eq!(Roots::MAX_KNS, 448);
}
