//! One long-lived `KvService.Pipeline` stream per KV node, shared by every operation a client
//! sends to that node: one HTTP/2 stream for all of them instead of one unary RPC each (a
//! HEADERS/DATA/trailers exchange, a timer, a tower buffer hop and a spawned body task per
//! operation). Profiling (docs/perf/request-path-profile.md) found that per-call machinery to be
//! nearly all of the SDK's and the KV node's CPU per in-memory read.
//!
//! A caller takes an id, registers where its answer goes, and pushes its request into the
//! stream's queue; tonic's encoder drains whatever is queued into one DATA frame, so a lone
//! operation leaves at once and those that arrive meanwhile leave together, with no timer and
//! no batch size to tune. One reader task per stream hands each answer to its caller by id.
//!
//! Invariants:
//! - every registered operation gets exactly one answer: the KV node's response, the stream's
//!   failure, or (from [`NodeStream::call`] itself) its own timeout;
//! - a stream that failed or ended is never used again: the next call opens a new one. Its
//!   failure status goes to every operation still waiting on it, and the SDK's usual rule
//!   decides from that status whether a write may have been applied (a stream that could not
//!   be opened fails with the connector's error, which says "never sent"); a request is only
//!   queued on a stream that is still open, checked under the same lock the failure takes;
//! - operations of one caller keep their order, because a caller waits for each answer before
//!   sending its next operation; concurrent operations have no order to keep (the KV node runs
//!   a stream's requests concurrently).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dinomo_proto::kv as pb;
use dinomo_proto::kv::kv_service_client::KvServiceClient;
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};
use tonic::transport::Channel;
use tonic::Status;

/// What a caller of [`NodeStream::call`] gets: the KV node's response, or why there is none.
pub type Answer = Result<pb::KvResponse, Status>;

/// The operations waiting on one stream, and whether the stream is still usable.
#[derive(Debug, Default)]
struct Waiting {
    /// `None` once the stream failed or ended: nothing more may be registered.
    open: Option<HashMap<u64, oneshot::Sender<Answer>>>,
}

/// One open stream: its request queue and its waiting operations.
#[derive(Debug)]
struct Open {
    requests: mpsc::UnboundedSender<pb::KvRequest>,
    waiting: Arc<Mutex<Waiting>>,
    next_id: AtomicU64,
}

/// The Pipeline stream to one KV node, (re)opened on demand. Cheap to clone.
#[derive(Debug, Clone)]
pub struct NodeStream {
    client: KvServiceClient<Channel>,
    /// How long one operation waits for its answer.
    timeout: Duration,
    current: Arc<Mutex<Option<Arc<Open>>>>,
}

impl NodeStream {
    pub fn new(client: KvServiceClient<Channel>, timeout: Duration) -> Self {
        NodeStream {
            client,
            timeout,
            current: Arc::default(),
        }
    }

    /// Sends `request` on the node's stream and waits for its answer (at most the timeout).
    pub async fn call(&self, mut request: pb::KvRequest) -> Answer {
        let (answer, rx) = oneshot::channel();
        let (open, id) = self.register(answer);
        request.id = id;
        // The reader may already have failed the stream, and with it this operation: its
        // answer is then waiting in `rx` and the request goes nowhere.
        let _ = open.requests.send(request);
        match tokio::time::timeout(self.timeout, rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(Status::unknown("the KV node stream dropped the operation")),
            Err(_) => {
                if let Some(w) = open.waiting.lock().open.as_mut() {
                    w.remove(&id);
                }
                Err(Status::deadline_exceeded(format!(
                    "no answer from the KV node within {:?}",
                    self.timeout
                )))
            }
        }
    }

    /// Registers an operation on the open stream, opening one if there is none (or the last
    /// one failed), and returns the stream and the operation's id.
    fn register(&self, answer: oneshot::Sender<Answer>) -> (Arc<Open>, u64) {
        let mut current = self.current.lock();
        if let Some(open) = current.as_ref() {
            let id = open.next_id.fetch_add(1, Ordering::Relaxed);
            if let Some(w) = open.waiting.lock().open.as_mut() {
                w.insert(id, answer);
                return (open.clone(), id);
            }
        }
        let open = self.open();
        let id = open.next_id.fetch_add(1, Ordering::Relaxed);
        open.waiting
            .lock()
            .open
            .as_mut()
            .expect("a new stream is open")
            .insert(id, answer);
        *current = Some(open.clone());
        (open, id)
    }

    /// Opens a stream: its reader task starts the RPC and answers the waiting operations.
    fn open(&self) -> Arc<Open> {
        let (requests, outbound) = mpsc::unbounded_channel();
        let waiting = Arc::new(Mutex::new(Waiting {
            open: Some(HashMap::new()),
        }));
        tokio::spawn(read_answers(self.client.clone(), outbound, waiting.clone()));
        Arc::new(Open {
            requests,
            waiting,
            next_id: AtomicU64::new(0),
        })
    }
}

/// Runs one stream: opens the RPC, hands each answer to its operation, and when the stream
/// fails or ends, closes it and fails every operation still waiting. Ends when the stream
/// does (after the last [`NodeStream`] clone is dropped, the request queue closes, the KV node
/// finishes the stream, and the answers run out).
async fn read_answers(
    mut client: KvServiceClient<Channel>,
    outbound: mpsc::UnboundedReceiver<pb::KvRequest>,
    waiting: Arc<Mutex<Waiting>>,
) {
    let outbound = tokio_stream::wrappers::UnboundedReceiverStream::new(outbound);
    let failure = match client.pipeline(outbound).await {
        Err(status) => status,
        Ok(reply) => {
            let mut answers = reply.into_inner();
            loop {
                match answers.message().await {
                    Ok(Some(r)) => {
                        let to = waiting.lock().open.as_mut().and_then(|w| w.remove(&r.id));
                        if let Some(to) = to {
                            let _ = to.send(Ok(r));
                        }
                    }
                    Ok(None) => break Status::unavailable("the KV node ended the stream"),
                    Err(status) => break status,
                }
            }
        }
    };
    let failed = waiting.lock().open.take().unwrap_or_default();
    for (_, to) in failed {
        let _ = to.send(Err(failure.clone()));
    }
}
