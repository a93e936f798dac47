//! Property tests of the tcp fabric's wire codec: every request and response round-trips, and
//! no byte string (truncated, corrupted or random) makes a decoder panic.

use bytes::Bytes;
use dinomo_fabric::tcp::{
    decode_hello, decode_request, decode_response, encode_hello, encode_request, encode_response,
    MAX_REPLY,
};
use dinomo_fabric::{AccessKey, Completion, FabricError, Op};
use proptest::prelude::*;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        // At most 20 ops of 1 MiB: well inside the reply limit (tested below on its own).
        (any::<u64>(), 0..=1u32 << 20).prop_map(|(offset, len)| Op::Read { offset, len }),
        (any::<u64>(), proptest::collection::vec(any::<u8>(), 0..300)).prop_map(|(offset, d)| {
            Op::Write {
                offset,
                data: Bytes::from(d),
            }
        }),
        (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(offset, expected, new)| Op::Cas {
            offset,
            expected,
            new
        }),
        (any::<u64>(), any::<u64>()).prop_map(|(offset, add)| Op::Faa { offset, add }),
    ]
}

fn completion() -> impl Strategy<Value = Completion> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..300)
            .prop_map(|d| Completion::Read(Bytes::from(d))),
        Just(Completion::Written),
        any::<u64>().prop_map(|old| Completion::Cas { old }),
        any::<u64>().prop_map(|old| Completion::Faa { old }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn requests_roundtrip(id in any::<u64>(), ops in proptest::collection::vec(op(), 0..20)) {
        let frame = encode_request(id, &ops).unwrap();
        let len = u32::from_le_bytes(frame[..4].try_into().unwrap()) as usize;
        prop_assert_eq!(len, frame.len() - 4);
        let (id2, ops2) = decode_request(frame.slice(4..)).unwrap();
        prop_assert_eq!((id2, ops2), (id, ops));
    }

    #[test]
    fn hellos_roundtrip(slot in any::<u32>(), generation in any::<u32>(), secret in any::<[u8; 16]>()) {
        let key = AccessKey { slot, generation, secret };
        prop_assert_eq!(decode_hello(&encode_hello(key)), Ok(key));
    }

    #[test]
    fn responses_roundtrip(id in any::<u64>(), cs in proptest::collection::vec(completion(), 0..20)) {
        let frame = encode_response(id, &Ok(cs.clone()));
        let (id2, r) = decode_response(frame.slice(4..)).unwrap();
        prop_assert_eq!(id2, id);
        prop_assert_eq!(r.unwrap(), cs);
    }

    #[test]
    fn error_responses_roundtrip(id in any::<u64>(), slot in any::<u32>(), a in any::<u64>(), b in any::<u64>(), c in any::<u64>()) {
        for e in [
            FabricError::AccessDenied { slot },
            FabricError::OutOfBounds { offset: a, len: b, region_len: c },
            FabricError::Misaligned { offset: a },
        ] {
            let want = e.to_string();
            let (_, r) = decode_response(encode_response(id, &Err(e)).slice(4..)).unwrap();
            prop_assert_eq!(r.unwrap_err().to_string(), want);
        }
    }

    #[test]
    fn truncated_requests_are_errors(ops in proptest::collection::vec(op(), 1..8), cut in any::<prop::sample::Index>()) {
        let frame = encode_request(1, &ops).unwrap();
        let body = frame.slice(4..);
        let at = cut.index(body.len());
        prop_assert!(decode_request(body.slice(..at)).is_err());
    }

    #[test]
    fn reads_are_refused_by_encode_exactly_when_the_reply_exceeds_the_limit(
        lens in proptest::collection::vec(prop_oneof![0..=MAX_REPLY as u32, any::<u32>()], 1..4)
    ) {
        let ops: Vec<Op> = lens.iter().map(|&len| Op::Read { offset: 0, len }).collect();
        // Response: id, status, count, then per READ its kind, length and data.
        let reply: u64 = 11 + lens.iter().map(|&l| 5 + u64::from(l)).sum::<u64>();
        match encode_request(1, &ops) {
            Ok(frame) => {
                prop_assert!(reply <= MAX_REPLY as u64);
                prop_assert_eq!(decode_request(frame.slice(4..)).unwrap().1, ops);
            }
            Err(_) => prop_assert!(reply > MAX_REPLY as u64),
        }
    }

    #[test]
    fn random_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = decode_request(Bytes::from(b.clone()));
        let _ = decode_response(Bytes::from(b));
    }
}
