//! One long-lived stream of operations per KV node, shared by every operation a client sends to
//! that node, over one of two transports: the KV wire (`wire`, the default: length-framed
//! `KvRequest`/`KvResponse` messages on a TCP or TLS connection) or gRPC's
//! `KvService.Pipeline` (one HTTP/2 stream, for KV nodes reached through an HTTP/2 proxy, and
//! for comparison). Either way one stream carries all of them instead of one unary RPC each (a
//! HEADERS/DATA/trailers exchange, a timer, a tower buffer hop and a spawned body task per
//! operation). Profiling (docs/perf/request-path-profile.md) found that per-call machinery to
//! be nearly all of the SDK's and the KV node's CPU per in-memory read.
//!
//! A caller takes an id, registers where its answer goes, and pushes its request into the
//! stream's queue; the transport writes whatever is queued at once, so a lone operation leaves
//! at once and those that arrive meanwhile leave together, with no timer and no batch size to
//! tune. One reader per stream hands each answer to its caller by id ([`Answers::deliver`]).
//!
//! An operation's timeout is no timer of its own: the stream's task sweeps its waiting
//! operations [`SWEEPS_PER_TIMEOUT`] times per timeout and fails those that have waited through
//! more than that many sweeps. Registering and cancelling a tokio timer per operation (and the
//! clock read it takes) was a measurable part of the SDK's CPU per read (issue 12); a sweep
//! costs one timer per stream.
//!
//! Invariants:
//! - every registered operation gets exactly one answer: the KV node's response, the stream's
//!   failure, or its timeout from the sweep, which comes after at least the timeout and at most
//!   `1 + 1 / SWEEPS_PER_TIMEOUT` times it;
//! - a stream that failed or ended is never used again: the next call opens a new one. Its
//!   failure status goes to every operation still waiting on it, and the SDK's usual rule
//!   decides from that status whether a write may have been applied (a stream that could not
//!   be opened fails with an error that says "never sent"); a request is only queued on a
//!   stream that is still open, checked under the same lock the failure takes;
//! - operations of one caller keep their order, because a caller waits for each answer before
//!   sending its next operation; concurrent operations have no order to keep (the KV node runs
//!   a stream's requests concurrently).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::time::Duration;

use dinomo_proto::kv as pb;
use dinomo_proto::kv::kv_service_client::KvServiceClient;
use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};
use tonic::transport::Channel;
use tonic::Status;

/// What a caller of [`NodeStream::call`] gets: the KV node's response, or why there is none.
pub type Answer = Result<pb::KvResponse, Status>;

/// Hashes an operation id with one multiplication. The ids are a counter, so they need no
/// protection against chosen keys, and SipHash would be most of the cost of a map probe; the
/// Fibonacci multiplier spreads consecutive ids over both the low bits (the bucket) and the
/// high bits (hashbrown's tag).
#[derive(Debug, Default, Clone, Copy)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// How many times per timeout a stream's task looks for operations that waited too long.
const SWEEPS_PER_TIMEOUT: u32 = 4;

/// An operation waiting for its answer.
#[derive(Debug)]
struct Waiter {
    to: oneshot::Sender<Answer>,
    /// [`State::sweeps`] when it was registered.
    since_sweep: u64,
}

type Waiters = HashMap<u64, Waiter, BuildHasherDefault<IdHasher>>;

/// The node's stream and the operations waiting on it, under one lock: an operation takes it
/// once to get an id, register and queue its request, and the reader once per answer.
#[derive(Debug, Default)]
struct State {
    /// The open stream's request queue; `None` before the first call, after the stream failed
    /// or ended (the next call opens a new one), and once the last [`NodeStream`] is dropped.
    requests: Option<mpsc::UnboundedSender<pb::KvRequest>>,
    /// The operations waiting on the open stream (only one stream is open at a time: a new
    /// one opens only after the last one's reader took the waiters it failed).
    waiting: Waiters,
    /// The last id taken. Ids are never reused on this node, not even across streams, so the
    /// answer or the timeout of an earlier operation can never reach a later one; they are
    /// taken and queued under this lock, so a stream's queue holds them in increasing order.
    next_id: u64,
    /// Timeout sweeps done so far (see the module doc); an operation registered after sweep
    /// `s` has waited at least the timeout once sweep `s + SWEEPS_PER_TIMEOUT + 1` runs.
    sweeps: u64,
}

/// How a stream reaches its KV node.
pub(crate) trait Transport: Send + Sync + std::fmt::Debug + 'static {
    /// Runs one stream: sends every request `outbound` yields, hands each answer to
    /// `answers`, and returns why the stream ended (it is never used again).
    fn run(
        &self,
        outbound: mpsc::UnboundedReceiver<pb::KvRequest>,
        answers: Answers,
    ) -> BoxFuture<'static, Ended>;
}

/// Why a stream ended, and what of it was never sent.
#[derive(Debug)]
pub(crate) struct Ended {
    /// What every operation still waiting gets. A stream that could not be opened ends with a
    /// status whose source is [`NeverSent`].
    pub status: Status,
    /// The lowest id that was never handed to the connection, if the transport knows: waiting
    /// operations from this id on get `status` marked [`NeverSent`] (the queue holds ids in
    /// increasing order, and the transport writes them in that order).
    pub first_unsent: Option<u64>,
}

impl From<Status> for Ended {
    fn from(status: Status) -> Self {
        Ended {
            status,
            first_unsent: None,
        }
    }
}

/// The source of a status for operations that were never sent: the stream to the KV node
/// could not be opened (no connection, a failed handshake, a refusing hello).
#[derive(Debug)]
pub(crate) struct NeverSent;

impl std::fmt::Display for NeverSent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the stream to the KV node was never opened; nothing was sent")
    }
}

impl std::error::Error for NeverSent {}

/// `status`, marked as failing operations that were never sent.
pub(crate) fn never_sent(mut status: Status) -> Status {
    status.set_source(Arc::new(NeverSent));
    status
}

/// Where a stream's reader hands the answers it decoded.
#[derive(Debug, Clone)]
pub(crate) struct Answers(Arc<Mutex<State>>);

impl Answers {
    /// Gives each answer to the operation waiting for it (an answer nobody waits for, after
    /// its operation timed out, is dropped); takes the lock once for all of them.
    pub(crate) fn deliver(&self, answers: impl IntoIterator<Item = pb::KvResponse>) {
        let mut to: Vec<(oneshot::Sender<Answer>, pb::KvResponse)> = Vec::new();
        {
            let mut state = self.0.lock();
            for r in answers {
                if let Some(waiter) = state.waiting.remove(&r.id) {
                    to.push((waiter.to, r));
                }
            }
        }
        for (waiter, r) in to {
            let _ = waiter.send(Ok(r));
        }
    }
}

#[derive(Debug)]
struct Node {
    transport: Arc<dyn Transport>,
    endpoint: String,
    /// How long one operation waits for its answer.
    timeout: Duration,
    /// Shared with the stream's reader task. The reader holds no reference to `Node`, so that
    /// dropping the last [`NodeStream`] closes the request queue (see `Drop`).
    state: Arc<Mutex<State>>,
}

impl Drop for Node {
    /// Closes the request queue: the KV node then finishes the stream, and its reader ends.
    fn drop(&mut self) {
        self.state.lock().requests = None;
    }
}

/// The Pipeline stream to one KV node, (re)opened on demand. Cheap to clone (one `Arc`).
#[derive(Debug, Clone)]
pub struct NodeStream(Arc<Node>);

impl NodeStream {
    pub(crate) fn new(transport: Arc<dyn Transport>, endpoint: &str, timeout: Duration) -> Self {
        NodeStream(Arc::new(Node {
            transport,
            endpoint: endpoint.to_string(),
            timeout,
            state: Arc::default(),
        }))
    }

    /// The node's address, as the cluster map gives it.
    pub fn endpoint(&self) -> &str {
        &self.0.endpoint
    }

    /// Sends `request` on the node's stream and waits for its answer (at most the timeout,
    /// and a quarter more: see the module doc).
    pub async fn call(&self, request: pb::KvRequest) -> Answer {
        let (answer, rx) = oneshot::channel();
        self.send(request, answer);
        rx.await
            .unwrap_or_else(|_| Err(Status::unknown("the KV node stream dropped the operation")))
    }

    /// Registers an operation and queues its request on the open stream, opening one if there
    /// is none (or the last one failed).
    fn send(&self, mut request: pb::KvRequest, to: oneshot::Sender<Answer>) {
        let mut state = self.0.state.lock();
        // Ids start at 1: 0 is the KV wire node's own (its hello and goodbye).
        state.next_id += 1;
        let id = state.next_id;
        request.id = id;
        let since_sweep = state.sweeps;
        state.waiting.insert(id, Waiter { to, since_sweep });
        let requests = state.requests.get_or_insert_with(|| {
            let (requests, outbound) = mpsc::unbounded_channel();
            tokio::spawn(run_stream(
                self.0.transport.clone(),
                outbound,
                self.0.state.clone(),
                self.0.timeout,
            ));
            requests
        });
        // Queued under the lock the reader takes to fail the stream: a request is only queued
        // on a stream that has not failed yet. If tonic has already dropped the queue, the
        // request goes nowhere and the reader, which is about to see the stream end, answers
        // the operation.
        let _ = requests.send(request);
    }
}

/// Runs one stream on `transport`, failing the operations that wait longer than `timeout`
/// meanwhile, and when it fails or ends, closes it and fails every operation still waiting.
/// Ends when the stream does (after the last [`NodeStream`] clone is dropped, the request
/// queue closes, the KV node finishes the stream, and the answers run out).
async fn run_stream(
    transport: Arc<dyn Transport>,
    outbound: mpsc::UnboundedReceiver<pb::KvRequest>,
    state: Arc<Mutex<State>>,
    timeout: Duration,
) {
    let run = transport.run(outbound, Answers(state.clone()));
    tokio::pin!(run);
    let period = (timeout / SWEEPS_PER_TIMEOUT).max(Duration::from_millis(1));
    let mut sweeps = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    sweeps.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let ended = loop {
        tokio::select! {
            biased;
            ended = &mut run => break ended,
            _ = sweeps.tick() => expire(&state, timeout),
        }
    };
    let failed = {
        let mut state = state.lock();
        state.requests = None;
        std::mem::take(&mut state.waiting)
    };
    let unsent = ended.first_unsent.map(|_| never_sent(ended.status.clone()));
    for (id, waiter) in failed {
        let status = match (&unsent, ended.first_unsent) {
            (Some(unsent), Some(first)) if id >= first => unsent.clone(),
            _ => ended.status.clone(),
        };
        let _ = waiter.to.send(Err(status));
    }
}

/// One timeout sweep: fails the operations registered more than [`SWEEPS_PER_TIMEOUT`] sweeps
/// ago, which have waited at least `timeout` (the answer may still come; nobody waits for it
/// then, and [`Answers::deliver`] drops it).
fn expire(state: &Mutex<State>, timeout: Duration) {
    let expired: Vec<Waiter> = {
        let mut state = state.lock();
        state.sweeps += 1;
        let now = state.sweeps;
        state
            .waiting
            .extract_if(|_, w| now - w.since_sweep > u64::from(SWEEPS_PER_TIMEOUT))
            .map(|(_, w)| w)
            .collect()
    };
    for waiter in expired {
        let _ = waiter.to.send(Err(Status::deadline_exceeded(format!(
            "no answer from the KV node within {timeout:?}"
        ))));
    }
}

/// The stream as gRPC's `KvService.Pipeline` on a channel; tonic's encoder drains whatever is
/// queued into one DATA frame.
#[derive(Debug, Clone)]
pub(crate) struct Grpc(pub KvServiceClient<Channel>);

impl Transport for Grpc {
    fn run(
        &self,
        outbound: mpsc::UnboundedReceiver<pb::KvRequest>,
        answers: Answers,
    ) -> BoxFuture<'static, Ended> {
        let mut client = self.0.clone();
        Box::pin(async move {
            let outbound = tokio_stream::wrappers::UnboundedReceiverStream::new(outbound);
            let status = match client.pipeline(outbound).await {
                // tonic wraps connector failures in ConnectError, which lib.rs reads as
                // never sent.
                Err(status) => status,
                Ok(reply) => {
                    let mut replies = reply.into_inner();
                    loop {
                        match replies.message().await {
                            Ok(Some(r)) => answers.deliver([r]),
                            Ok(None) => break Status::unavailable("the KV node ended the stream"),
                            Err(status) => break status,
                        }
                    }
                }
            };
            // tonic does not say what it sent: everything waiting is maybe-sent (unless the
            // status says the stream never opened).
            Ended::from(status)
        })
    }
}
