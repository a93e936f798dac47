//! The KV wire: `KvService.Pipeline` without HTTP/2. The same `KvRequest`/`KvResponse`
//! messages (kv.proto), each framed by its length, on a plain TCP or TLS connection to the KV
//! node's one port. gRPC costs a KV node and a client several microseconds of CPU per
//! operation in HTTP/2 framing, stream bookkeeping and task wakeups (docs/perf/); here a
//! connection is two byte streams, and whatever requests (or answers) are ready go out in one
//! write.
//!
//! Telling it from gRPC on the shared port:
//! - with TLS, by ALPN: the client offers only [`ALPN`]; gRPC clients offer `h2`;
//! - in plain text, by the first byte: a client sends [`PREFACE`] first, which begins with `D`,
//!   where an HTTP/2 connection begins with `PRI * HTTP/2.0`.
//!
//! A connection, byte by byte:
//! 1. client: [`PREFACE`] (`DINOMOKV` and the version, `u32` little-endian, now 1);
//! 2. KV node: one frame holding the hello, a `KvResponse` with id 0: code 0 (OK) to go on, or
//!    the reason it will not serve this caller (a gRPC code and message; e.g. UNAUTHENTICATED
//!    or PERMISSION_DENIED, by the same access table as the Pipeline RPC), after which it
//!    closes the connection. No request is read before the hello is sent, so a client that did
//!    not get an OK hello knows none of its requests was applied;
//! 3. then, both ways, frames: `[u32 little-endian length][message]`, `KvRequest`s from the
//!    client, `KvResponse`s from the node, each answering the request with the same id, in the
//!    order the node finishes them. Clients number requests from 1: id 0 is the node's own. A
//!    frame longer than [`MAX_FRAME`] or a message that does not decode ends the connection;
//! 4. the goodbye: when the node stops, it sends a `KvResponse` with id 0 and code UNAVAILABLE.
//!    The client then sends nothing more and ends its side (TCP FIN, or TLS close_notify);
//!    the node answers every request it read (those that arrive after the goodbye with
//!    UNAVAILABLE, not run) and ends its own side. A client that does not end its side within
//!    a few seconds is cut off.

use std::io::IoSlice;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use prost::Message;

use crate::kv as pb;

/// The ALPN protocol name of the KV wire over TLS.
pub const ALPN: &[u8] = b"dinomo-kv/1";

/// The wire's version, sent in the preface.
pub const VERSION: u32 = 1;

/// What a client sends first: magic and version.
pub const PREFACE: [u8; 12] = *b"DINOMOKV\x01\x00\x00\x00";

/// The longest frame either side accepts: a request or answer with a key and a value at their
/// largest (the same bound as the KV node's gRPC messages).
pub const MAX_FRAME: usize = 64 << 20;

/// Most room [`decode`] reserves at once for the rest of a frame.
const RESERVE_STEP: usize = 64 << 10;

/// A frame that cannot be taken.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("a frame of {0} bytes, over the limit of {MAX_FRAME}")]
    TooLong(usize),
    #[error("a frame that does not decode: {0}")]
    Decode(#[from] prost::DecodeError),
}

/// Appends `message` to `buf` as one frame.
pub fn encode<M: Message>(message: &M, buf: &mut BytesMut) {
    let len = message.encoded_len();
    buf.reserve(4 + len);
    buf.put_u32_le(u32::try_from(len).expect("a message fits the u32 length of a frame"));
    message
        .encode(buf)
        .expect("the buffer was reserved for the whole message");
}

/// The field number of `KvResponse.value` (kv.proto), which [`Frames`] encodes by hand.
const RESPONSE_VALUE_FIELD: u32 = 4;

/// Answers at least this long are written from where they are instead of being copied into
/// the frames' buffer: below it, one more I/O vector costs more than the copy saves.
pub const VECTORED_VALUE_MIN: usize = 512;

/// `KvResponse` frames to write with one vectored write: everything but large values is
/// encoded into one buffer, and values of at least [`VECTORED_VALUE_MIN`] bytes stay where
/// they are (a KV node's cache), so the process copies them into no buffer of its own: the
/// kernel (or TLS) copies them once. A 1 KB value copied into the answer buffer was the
/// largest single cost left in a KV node's read path (issue 12, docs/perf/kv-wire.md).
///
/// The bytes, in order, are exactly those of [`encode`] for each response, except that the
/// value field is placed last in each message (protobuf readers accept fields in any order).
#[derive(Debug, Default)]
pub struct Frames {
    /// Everything but the large values.
    head: BytesMut,
    /// The large values, each with the length `head` had when it was pushed: it goes there.
    values: Vec<(usize, Bytes)>,
    /// Bytes of the large values.
    value_bytes: usize,
}

impl Frames {
    /// Appends `response` as one frame.
    pub fn push_response(&mut self, mut response: pb::KvResponse) {
        let len = response.encoded_len();
        let value = std::mem::take(&mut response.value);
        let copied = if value.len() >= VECTORED_VALUE_MIN {
            0
        } else {
            value.len()
        };
        self.head.reserve(4 + len - value.len() + copied);
        self.head
            .put_u32_le(u32::try_from(len).expect("a message fits the u32 length of a frame"));
        response
            .encode(&mut self.head)
            .expect("the buffer was reserved for the whole message");
        if value.is_empty() {
            return;
        }
        prost::encoding::encode_key(
            RESPONSE_VALUE_FIELD,
            prost::encoding::WireType::LengthDelimited,
            &mut self.head,
        );
        prost::encoding::encode_varint(value.len() as u64, &mut self.head);
        if copied == 0 {
            self.value_bytes += value.len();
            self.values.push((self.head.len(), value));
        } else {
            self.head.put_slice(&value);
        }
    }

    /// Bytes of all the frames.
    pub fn len(&self) -> usize {
        self.head.len() + self.value_bytes
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets the frames (keeping the buffer, unless it grew beyond `keep` bytes).
    pub fn clear(&mut self, keep: usize) {
        if self.head.capacity() > keep {
            self.head = BytesMut::new();
        }
        self.head.clear();
        self.values.clear();
        self.value_bytes = 0;
    }

    /// The frames as I/O vectors, in order.
    pub fn io_slices(&self) -> Vec<IoSlice<'_>> {
        let mut slices = Vec::with_capacity(2 * self.values.len() + 1);
        let mut from = 0;
        for (at, value) in &self.values {
            if *at > from {
                slices.push(IoSlice::new(&self.head[from..*at]));
            }
            slices.push(IoSlice::new(value));
            from = *at;
        }
        if self.head.len() > from {
            slices.push(IoSlice::new(&self.head[from..]));
        }
        slices
    }
}

/// Takes the first whole frame out of `buf` and decodes it; `None` when `buf` does not hold a
/// whole frame yet (it then has room reserved for more of it).
pub fn decode<M: Message + Default>(buf: &mut BytesMut) -> Result<Option<M>, WireError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
    if len > MAX_FRAME {
        return Err(WireError::TooLong(len));
    }
    if buf.len() < 4 + len {
        // Room for the rest, but no more than RESERVE_STEP ahead of the bytes that arrived:
        // a frame header alone must not make a connection hold 64 MiB.
        buf.reserve((4 + len - buf.len()).min(RESERVE_STEP));
        return Ok(None);
    }
    buf.advance(4);
    let frame = buf.split_to(len).freeze();
    Ok(Some(M::decode(frame)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(id: u64, key: &'static [u8]) -> pb::KvRequest {
        pb::KvRequest {
            id,
            op: Some(pb::kv_request::Op::Get(pb::GetRequest { key: key.into() })),
        }
    }

    #[test]
    fn frames_decode_one_by_one_whatever_the_bytes_arrive_in() {
        let mut all = BytesMut::new();
        encode(&get(1, b"a"), &mut all);
        encode(&get(2, b""), &mut all);
        encode(&get(3, &[7; 300]), &mut all);
        let all = all.freeze();
        // Fed in pieces of every size from 1 byte to all of it at once.
        for piece in 1..=all.len() {
            let mut buf = BytesMut::new();
            let mut got = Vec::new();
            for chunk in all.chunks(piece) {
                buf.extend_from_slice(chunk);
                while let Some(r) = decode::<pb::KvRequest>(&mut buf).unwrap() {
                    got.push(r);
                }
            }
            assert_eq!(got, vec![get(1, b"a"), get(2, b""), get(3, &[7; 300])]);
            assert!(buf.is_empty());
        }
    }

    #[test]
    fn a_frame_over_the_limit_or_not_a_message_is_refused() {
        let mut buf = BytesMut::new();
        buf.put_u32_le(MAX_FRAME as u32 + 1);
        assert!(matches!(
            decode::<pb::KvRequest>(&mut buf),
            Err(WireError::TooLong(_))
        ));
        let mut buf = BytesMut::new();
        buf.put_u32_le(2);
        buf.put_slice(&[0xff, 0xff]);
        assert!(matches!(
            decode::<pb::KvRequest>(&mut buf),
            Err(WireError::Decode(_))
        ));
    }

    fn answer(id: u64, code: i32, value: Vec<u8>) -> pb::KvResponse {
        pb::KvResponse {
            id,
            code,
            message: if code == 0 {
                String::new()
            } else {
                "why".into()
            },
            value: value.into(),
            map_version: id % 3,
        }
    }

    #[test]
    fn frames_hold_the_same_messages_as_encode_with_large_values_left_in_place() {
        let answers = vec![
            answer(1, 0, vec![]),
            answer(2, 0, vec![9; VECTORED_VALUE_MIN - 1]),
            answer(3, 0, vec![8; VECTORED_VALUE_MIN]),
            answer(4, 5, vec![]),
            answer(5, 0, vec![7; 70_000]),
            answer(6, 0, vec![6; 3]),
        ];
        let mut frames = Frames::default();
        let mut expected = BytesMut::new();
        for a in &answers {
            frames.push_response(a.clone());
            encode(a, &mut expected);
        }
        assert_eq!(frames.len(), expected.len(), "the same frame lengths");
        assert_eq!(
            frames.values.len(),
            2,
            "two values written from where they are"
        );
        let slices = frames.io_slices();
        let mut written = BytesMut::new();
        for s in &slices {
            written.extend_from_slice(s);
        }
        assert_eq!(written.len(), expected.len());
        let mut got = Vec::new();
        while let Some(r) = decode::<pb::KvResponse>(&mut written).unwrap() {
            got.push(r);
        }
        assert_eq!(got, answers);
        frames.clear(usize::MAX);
        assert!(frames.is_empty() && frames.io_slices().is_empty());
    }

    #[test]
    fn the_preface_starts_unlike_http2() {
        assert_eq!(&PREFACE[..8], b"DINOMOKV");
        assert_eq!(
            u32::from_le_bytes(PREFACE[8..].try_into().unwrap()),
            VERSION
        );
        assert_ne!(PREFACE[0], b"PRI * HTTP/2.0"[0]);
    }
}
