//! Serves one KV-wire connection (the framing is `dinomo_proto::wire`): the Pipeline RPC's
//! work without HTTP/2. A reader task decodes whatever requests have arrived and hands them to
//! the node as one submission ([`KvNode::submit`], the same path as the Pipeline stream); the
//! shards answer into the connection's queue, and the writer encodes every answer waiting there
//! and writes them with one vectored call, the values straight from the cache ([`wire::Frames`]).
//!
//! Invariants:
//! - nothing is read after the preface until the hello is written, and a caller the access
//!   table refuses gets only the refusing hello: no request of a refused caller reaches a shard;
//! - at most [`PIPELINE_MAX_IN_FLIGHT`] requests of a connection are worked on or waiting to be
//!   written: a slot is taken before a request is submitted and given back when its answer has
//!   been written, so a client that sends faster than the shards answer, or does not read its
//!   answers, is left unread (TCP flow control stops it) instead of buffered;
//! - every request read is answered on the connection: run, or (once the server stops)
//!   UNAVAILABLE without running it. On a stop the node says goodbye (an answer with id 0) and
//!   reads on until the client ends its side (a client stops writing on the goodbye) or
//!   [`DRAIN_LIMIT`]; the writer writes every answer before it ends the node's side, so a
//!   client sees every request it wrote answered;
//! - a refused caller, or any caller once the server stops, gets only the refusing hello.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use dinomo_proto::kv as pb;
use dinomo_proto::wire;
use futures::FutureExt;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, watch, Semaphore};

use crate::error::KvError;
use crate::node::KvNode;
use crate::service::{op_of, response, stopped, PIPELINE_MAX_IN_FLIGHT, PIPELINE_MAX_SUBMIT};
use crate::shard::{Answer, AnswerSink, Tag};

/// How long a client may take to send the preface after connecting.
const PREFACE_TIMEOUT: Duration = Duration::from_secs(10);

/// Most answers taken from the queue at once.
const MAX_ANSWERS_PER_WRITE: usize = 256;

/// A write call carries at most this many bytes of answers (more only for one larger answer).
const MAX_WRITE_BYTES: usize = 1 << 20;

/// A write buffer that grew beyond this (for a large value) is given back after its write.
const KEEP_BUFFER_BYTES: usize = 4 << 20;

/// How long a stopping node keeps reading a connection after its goodbye, waiting for the
/// client to end its side.
const DRAIN_LIMIT: Duration = Duration::from_secs(2);

/// Spare room kept in the read buffer, so that one read takes whatever a client's write put on
/// the wire (the client writes everything it has queued at once).
const READ_ROOM: usize = 64 << 10;

/// Serves a connection whose transport (plain TCP, or TLS with the wire's ALPN) is set up:
/// reads the preface, answers the hello (`admitted`: whether the access table lets this caller
/// call the Pipeline RPC), then runs requests until the client or the server ends it.
/// A connection that splits into a read and a write half, so that reading and writing go on at
/// once. A TCP stream splits without a lock; a TLS stream, whose state both halves share,
/// through tokio's locking split.
pub(crate) trait Split {
    type Read: AsyncRead + Send + Unpin + 'static;
    type Write: AsyncWrite + Send + Unpin + 'static;
    fn split_halves(self) -> (Self::Read, Self::Write);
}

impl Split for tokio::net::TcpStream {
    type Read = tokio::net::tcp::OwnedReadHalf;
    type Write = tokio::net::tcp::OwnedWriteHalf;
    fn split_halves(self) -> (Self::Read, Self::Write) {
        self.into_split()
    }
}

type TlsStream = dinomo_security::tokio_rustls::server::TlsStream<tokio::net::TcpStream>;

impl Split for TlsStream {
    type Read = tokio::io::ReadHalf<TlsStream>;
    type Write = tokio::io::WriteHalf<TlsStream>;
    fn split_halves(self) -> (Self::Read, Self::Write) {
        tokio::io::split(self)
    }
}

pub(crate) async fn serve<IO>(
    io: IO,
    node: Arc<KvNode>,
    admitted: Result<(), tonic::Status>,
    stopping: watch::Receiver<bool>,
) where
    IO: Split,
{
    let (mut rd, mut wr) = io.split_halves();
    let mut preface = [0u8; wire::PREFACE.len()];
    match tokio::time::timeout(PREFACE_TIMEOUT, rd.read_exact(&mut preface)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "a KV wire client left before its preface");
            return;
        }
        Err(_) => {
            tracing::debug!("a KV wire client sent no preface within {PREFACE_TIMEOUT:?}");
            return;
        }
    }
    let admitted = if *stopping.borrow() {
        Err(tonic::Status::unavailable("the KV node is stopping"))
    } else if preface == wire::PREFACE {
        admitted
    } else if preface[..8] == wire::PREFACE[..8] {
        Err(tonic::Status::failed_precondition(format!(
            "KV wire version {} is not served here; this KV node speaks version {}",
            u32::from_le_bytes(preface[8..].try_into().expect("4 bytes")),
            wire::VERSION
        )))
    } else {
        Err(tonic::Status::invalid_argument(
            "not a KV wire preface (expected DINOMOKV and a version)",
        ))
    };
    let hello = match &admitted {
        Ok(()) => pb::KvResponse::default(),
        Err(status) => pb::KvResponse {
            code: status.code() as i32,
            message: status.message().to_string(),
            ..Default::default()
        },
    };
    let mut hello_frame = BytesMut::new();
    wire::encode(&hello, &mut hello_frame);
    if wr.write_all(&hello_frame).await.is_err() {
        return;
    }
    if let Err(status) = admitted {
        tracing::debug!(%status, "KV wire caller refused");
        let _ = wr.shutdown().await;
        return;
    }

    let slots = Arc::new(Semaphore::new(PIPELINE_MAX_IN_FLIGHT));
    let (to, mut answers) = mpsc::unbounded_channel::<Answer>();
    let reader = tokio::spawn(read_requests(rd, node.clone(), to, slots.clone(), stopping));
    let mut batch = Vec::with_capacity(MAX_ANSWERS_PER_WRITE);
    let mut out = wire::Frames::default();
    // Ends when every sender of the queue is gone: the reader's (it stopped reading) and the
    // shards' (every request submitted has been answered).
    while answers.recv_many(&mut batch, MAX_ANSWERS_PER_WRITE).await > 0 {
        if batch.len() < MAX_ANSWERS_PER_WRITE {
            // Shards answering the rest of a submission run next: let them, so that one write
            // carries their answers too (nothing else runnable: no wait).
            tokio::task::yield_now().await;
            let room = MAX_ANSWERS_PER_WRITE - batch.len();
            answers.recv_many(&mut batch, room).now_or_never();
        }
        let mut encoded = 0;
        for a in batch.drain(..) {
            if let Some(kind) = a.tag.kind {
                node.record(kind, a.tag.started, a.answered, &a.result);
            }
            out.push_response(response(a.tag.id, a.result));
            encoded += 1;
            if out.len() >= MAX_WRITE_BYTES {
                if !write(&mut wr, &out, &reader).await {
                    return;
                }
                slots.add_permits(encoded);
                encoded = 0;
                out.clear(KEEP_BUFFER_BYTES);
            }
        }
        if !out.is_empty() && !write(&mut wr, &out, &reader).await {
            return;
        }
        slots.add_permits(encoded);
        out.clear(KEEP_BUFFER_BYTES);
    }
    let _ = wr.shutdown().await;
}

/// Writes `out`; on failure (the client is gone) stops the reader and says false.
async fn write<W: AsyncWrite + Unpin>(
    wr: &mut W,
    out: &wire::Frames,
    reader: &tokio::task::JoinHandle<()>,
) -> bool {
    match write_all_vectored(wr, out).await {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!(error = %e, "a KV wire client is gone");
            reader.abort();
            false
        }
    }
}

/// Writes every byte of `frames`, in as few vectored writes as the transport takes.
async fn write_all_vectored<W: AsyncWrite + Unpin>(
    wr: &mut W,
    frames: &wire::Frames,
) -> std::io::Result<()> {
    let mut slices = frames.io_slices();
    let mut rest: &mut [std::io::IoSlice<'_>] = &mut slices;
    while !rest.is_empty() {
        let n = wr.write_vectored(rest).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        std::io::IoSlice::advance_slices(&mut rest, n);
    }
    Ok(())
}

/// Reads requests until the client ends its side or the connection fails, submitting what
/// arrived together as one group (at most [`PIPELINE_MAX_SUBMIT`]).
///
/// When the server stops, it says goodbye (an answer with id 0, UNAVAILABLE) and from then on
/// answers every request UNAVAILABLE without running it (the client sent them before it saw
/// the goodbye), until the client ends its side or [`DRAIN_LIMIT`] has passed.
async fn read_requests<R: AsyncRead + Unpin>(
    mut rd: R,
    node: Arc<KvNode>,
    to: AnswerSink,
    slots: Arc<Semaphore>,
    stopping: watch::Receiver<bool>,
) {
    let mut buf = BytesMut::with_capacity(READ_ROOM);
    let stopping = &mut Some(stopping);
    // When the stop began, once it has.
    let mut draining: Option<Instant> = None;
    let goodbye = |to: &AnswerSink| {
        answer_now(to, 0, Instant::now(), stopping_error());
        Some(Instant::now())
    };
    loop {
        if buf.capacity() - buf.len() < READ_ROOM / 4 {
            buf.reserve(READ_ROOM);
        }
        let read = match draining {
            Some(since) => {
                match tokio::time::timeout_at((since + DRAIN_LIMIT).into(), rd.read_buf(&mut buf))
                    .await
                {
                    Ok(r) => r,
                    Err(_) => return, // the client did not end its side in time
                }
            }
            None => tokio::select! {
                biased;
                _ = stopped(stopping) => {
                    draining = goodbye(&to);
                    continue;
                }
                r = rd.read_buf(&mut buf) => r,
            },
        };
        match read {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(error = %e, "KV wire read failed");
                return;
            }
        }
        let started = Instant::now();
        let mut group = Vec::new();
        loop {
            let request = match wire::decode::<pb::KvRequest>(&mut buf) {
                Ok(Some(r)) => r,
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "KV wire client sent a bad frame; closing");
                    if !group.is_empty() {
                        node.submit(group, &to).await;
                    }
                    return;
                }
            };
            if draining.is_some() {
                answer_now(&to, request.id, started, stopping_error());
                continue;
            }
            let full = group.len() >= PIPELINE_MAX_SUBMIT;
            match slots.clone().try_acquire_owned() {
                Ok(slot) if !full => slot.forget(),
                taken => {
                    // A full group, or at the bound: what is gathered goes first (its answers
                    // give slots back).
                    if !group.is_empty() {
                        node.submit(std::mem::take(&mut group), &to).await;
                    }
                    match taken {
                        Ok(slot) => slot.forget(),
                        Err(_) => tokio::select! {
                            biased;
                            _ = stopped(stopping) => {
                                draining = goodbye(&to);
                                answer_now(&to, request.id, started, stopping_error());
                                continue;
                            }
                            slot = slots.acquire() => match slot {
                                Ok(slot) => slot.forget(),
                                Err(_) => return, // never closed
                            },
                        },
                    }
                }
            }
            let id = request.id;
            match op_of(request) {
                Ok(op) => {
                    let kind = Some(op.kind());
                    group.push((Tag { id, kind, started }, op));
                }
                Err(e) => answer_now(&to, id, started, e),
            }
        }
        if !group.is_empty() {
            node.submit(group, &to).await;
        }
    }
}

/// What a stopping node answers.
fn stopping_error() -> KvError {
    KvError::Unavailable("the KV node is stopping; send nothing more on this connection".into())
}

/// Answers a request that never reaches a shard (it named no operation).
fn answer_now(to: &AnswerSink, id: u64, started: Instant, e: KvError) {
    let _ = to.send(Answer {
        tag: Tag {
            id,
            kind: None,
            started,
        },
        answered: started,
        result: Err(e),
    });
}
