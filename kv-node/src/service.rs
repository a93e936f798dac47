//! KvService over gRPC: requests become [`ShardOp`]s, [`KvError`]s become statuses (error.rs).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use dinomo_proto::kv as pb;
use dinomo_proto::kv::kv_service_server::KvService;
use futures::FutureExt;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use crate::error::{KvError, KvResult};
use crate::node::KvNode;
use crate::shard::{Answer, AnswerSink, PutMode, ShardOp, Tag};

#[derive(Debug, Clone)]
pub struct KvGrpc {
    node: Arc<KvNode>,
    /// Turns true when the server starts shutting down: Pipeline streams then stop reading
    /// and end once their requests in flight are answered (clients keep one stream per KN
    /// open for good, so a graceful shutdown would otherwise wait for them forever).
    stopping: Option<tokio::sync::watch::Receiver<bool>>,
}

impl KvGrpc {
    /// A service whose streams end only when their clients end them.
    pub fn new(node: Arc<KvNode>) -> Self {
        KvGrpc {
            node,
            stopping: None,
        }
    }

    /// A service whose Pipeline streams end when `stopping` turns true (or its sender is
    /// dropped).
    pub fn with_shutdown(node: Arc<KvNode>, stopping: tokio::sync::watch::Receiver<bool>) -> Self {
        KvGrpc {
            node,
            stopping: Some(stopping),
        }
    }
}

/// Resolves when `stopping` turns true or its sender is gone; never without one.
pub(crate) async fn stopped(stopping: &mut Option<tokio::sync::watch::Receiver<bool>>) {
    match stopping {
        Some(rx) => {
            let _ = rx.wait_for(|s| *s).await;
        }
        None => std::future::pending().await,
    }
}

fn put_mode(m: i32) -> KvResult<PutMode> {
    match pb::PutMode::try_from(m) {
        Ok(pb::PutMode::Upsert) => Ok(PutMode::Upsert),
        Ok(pb::PutMode::Insert) => Ok(PutMode::Insert),
        Ok(pb::PutMode::Update) => Ok(PutMode::Update),
        Err(_) => Err(KvError::InvalidArgument(format!(
            "unknown put mode {m} (0 upsert, 1 insert, 2 update)"
        ))),
    }
}

/// A key or value of a request, in a buffer of its own. Decoded `Bytes` are views into the
/// buffer the request arrived in (8 KiB and more, shared with its neighbours); a key or value
/// that the KN keeps (cache, unmerged log, pending writes) would keep that whole buffer alive
/// while the cache budget counts only its own length. One copy here, as prost's `Vec` decoding
/// made before.
fn owned(b: Bytes) -> Bytes {
    Bytes::copy_from_slice(&b)
}

/// Decodes one pipelined/batched request.
pub(crate) fn op_of(req: pb::KvRequest) -> KvResult<ShardOp> {
    match req.op {
        Some(pb::kv_request::Op::Get(g)) => Ok(ShardOp::Get { key: owned(g.key) }),
        Some(pb::kv_request::Op::Put(p)) => Ok(ShardOp::Put {
            mode: put_mode(p.mode)?,
            key: owned(p.key),
            value: owned(p.value),
        }),
        Some(pb::kv_request::Op::Delete(d)) => Ok(ShardOp::Delete { key: owned(d.key) }),
        None => Err(KvError::InvalidArgument(
            "request without an operation (get, put or delete)".into(),
        )),
    }
}

pub(crate) fn response(id: u64, r: KvResult<Option<Bytes>>) -> pb::KvResponse {
    match r {
        Ok(v) => pb::KvResponse {
            id,
            code: 0,
            value: v.unwrap_or_default(),
            ..Default::default()
        },
        Err(e) => pb::KvResponse {
            id,
            code: e.code() as i32,
            message: e.to_string(),
            map_version: e.map_version(),
            value: Bytes::new(),
        },
    }
}

fn decode_map(b: &[u8]) -> KvResult<dinomo_placement::ClusterMap> {
    dinomo_placement::ClusterMap::decode(b)
        .map_err(|e| KvError::InvalidArgument(format!("cluster map: {e}")))
}

fn key_of(r: &pb::KvRequest) -> Option<&[u8]> {
    match &r.op {
        Some(pb::kv_request::Op::Get(g)) => Some(&g.key),
        Some(pb::kv_request::Op::Put(p)) => Some(&p.key),
        Some(pb::kv_request::Op::Delete(d)) => Some(&d.key),
        None => None,
    }
}

async fn run_one(node: &KvNode, req: pb::KvRequest) -> pb::KvResponse {
    let id = req.id;
    let r = match op_of(req) {
        Ok(op) => node.execute(op).await,
        Err(e) => Err(e),
    };
    response(id, r)
}

/// Runs the requests of one Batch: those on distinct keys concurrently, those naming the same
/// key one at a time in the order given (a client coalesces concurrent operations into one
/// batch, and a hot key may well appear in it more than once; only its own operations wait
/// for each other). Responses come back in the requests' order.
async fn run_batch(node: &KvNode, reqs: Vec<pb::KvRequest>) -> Vec<pb::KvResponse> {
    // The group (the run of one key's operations) of each request, numbered in order of
    // first appearance; a request without an operation is a group of its own.
    let group_of: Vec<usize> = {
        let mut first: HashMap<&[u8], usize> = HashMap::with_capacity(reqs.len());
        let mut groups = 0;
        reqs.iter()
            .map(|r| {
                let new = groups;
                let g = match key_of(r) {
                    Some(k) => *first.entry(k).or_insert(new),
                    None => new,
                };
                if g == new {
                    groups += 1;
                }
                g
            })
            .collect()
    };
    let n = reqs.len();
    let groups = group_of.iter().max().map_or(0, |g| g + 1);
    if groups == n {
        // Every key distinct (the usual case): all at once.
        return futures::future::join_all(reqs.into_iter().map(|r| run_one(node, r))).await;
    }
    let mut runs: Vec<Vec<(usize, pb::KvRequest)>> = (0..groups).map(|_| Vec::new()).collect();
    for (i, (r, g)) in reqs.into_iter().zip(group_of).enumerate() {
        runs[g].push((i, r));
    }
    let done = futures::future::join_all(runs.into_iter().map(|run| async move {
        let mut out = Vec::with_capacity(run.len());
        for (i, r) in run {
            out.push((i, run_one(node, r).await));
        }
        out
    }))
    .await;
    let mut responses: Vec<Option<pb::KvResponse>> = (0..n).map(|_| None).collect();
    for (i, r) in done.into_iter().flatten() {
        responses[i] = Some(r);
    }
    responses
        .into_iter()
        .map(|r| r.expect("every request of a batch is in one run"))
        .collect()
}

/// Most requests of one Pipeline stream that the KN works on at once (running, or answered and
/// not yet taken by the response encoder). Without a bound, a client that streams faster than
/// the shards answer makes the KN accept and hold every request it sends. With it, a stream
/// holds at most this many requests and answers, each at most `max_key_bytes +
/// max_value_bytes`. 1024 keeps the concurrency the unbounded version had for any client with
/// fewer than 1024 requests outstanding; no benchmark has tuned it.
pub(crate) const PIPELINE_MAX_IN_FLIGHT: usize = 1024;

/// Most requests handed to the node as one submission: those already received when the first
/// is read. Bounds how long one stream's submission holds the gate and the shards' queues.
pub(crate) const PIPELINE_MAX_SUBMIT: usize = 256;

/// Reads the requests of one Pipeline stream and hands them to `submit` in groups (every
/// request already received when the first of a group arrives), at most `max_in_flight` not
/// yet answered; the answers come out of the returned stream in completion order, each passed
/// to `on_answer` first.
///
/// Backpressure, not buffering: a slot is taken before a request is read, so at the bound the
/// stream is left unread and HTTP/2 flow control stops the client. A slot is given back only
/// when the response encoder takes its answer, so a client that does not read its answers is
/// stopped the same way.
fn drive_pipeline<S, F, Fut, A>(
    mut incoming: S,
    max_in_flight: usize,
    mut stopping: Option<tokio::sync::watch::Receiver<bool>>,
    submit: F,
    on_answer: A,
) -> impl Stream<Item = Result<pb::KvResponse, Status>> + Send + 'static
where
    S: Stream<Item = Result<pb::KvRequest, Status>> + Send + Unpin + 'static,
    F: Fn(Vec<(Tag, ShardOp)>, AnswerSink) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
    A: Fn(&Answer) + Send + 'static,
{
    let slots = Arc::new(tokio::sync::Semaphore::new(max_in_flight));
    let (to, answers) = tokio::sync::mpsc::unbounded_channel::<Answer>();
    let reader_slots = slots.clone();
    // The reader: its own task, so that reading goes on while the encoder writes answers.
    tokio::spawn(async move {
        let slots = reader_slots;
        let mut more = true;
        while more {
            // A slot first; but not forever: when the client is gone (tonic dropped the
            // answer stream) or the server stops, nobody will give slots back.
            let first_slot = tokio::select! {
                biased;
                _ = to.closed() => break,
                _ = stopped(&mut stopping) => break,
                slot = slots.acquire() => match slot {
                    Ok(slot) => slot,
                    Err(_) => break, // never closed
                },
            };
            let Some(first) = next_request(&mut incoming, &mut stopping).await else {
                break;
            };
            first_slot.forget();
            let started = Instant::now();
            let mut group = Vec::with_capacity(8);
            let mut take = |r: pb::KvRequest| {
                let id = r.id;
                match op_of(r) {
                    Ok(op) => {
                        let kind = Some(op.kind());
                        group.push((Tag { id, kind, started }, op));
                    }
                    Err(e) => {
                        let tag = Tag {
                            id,
                            kind: None,
                            started,
                        };
                        let _ = to.send(Answer {
                            tag,
                            answered: started,
                            result: Err(e),
                        });
                    }
                }
            };
            take(first);
            for _ in 1..PIPELINE_MAX_SUBMIT {
                let Ok(slot) = slots.try_acquire() else {
                    break;
                };
                match incoming.next().now_or_never() {
                    Some(Some(Ok(r))) => {
                        slot.forget();
                        take(r);
                    }
                    Some(_) => {
                        more = false; // the stream ended or failed
                        break;
                    }
                    None => break, // nothing more received yet
                }
            }
            if !group.is_empty() {
                submit(group, to.clone()).await;
            }
        }
    });
    tokio_stream::wrappers::UnboundedReceiverStream::new(answers).map(move |a| {
        slots.add_permits(1);
        on_answer(&a);
        Ok(response(a.tag.id, a.result))
    })
}

/// The next request of a stream; `None` when it ends or fails, or the server is stopping.
async fn next_request<S>(
    incoming: &mut S,
    stopping: &mut Option<tokio::sync::watch::Receiver<bool>>,
) -> Option<pb::KvRequest>
where
    S: Stream<Item = Result<pb::KvRequest, Status>> + Unpin,
{
    tokio::select! {
        biased;
        _ = stopped(stopping) => None,
        r = incoming.next() => r.and_then(Result::ok),
    }
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<pb::KvResponse, Status>> + Send>>;

#[tonic::async_trait]
impl KvService for KvGrpc {
    async fn get(&self, req: Request<pb::GetRequest>) -> Result<Response<pb::GetResponse>, Status> {
        let key = owned(req.into_inner().key);
        let v = self.node.execute(ShardOp::Get { key }).await?;
        Ok(Response::new(pb::GetResponse {
            value: v.unwrap_or_default(),
        }))
    }

    async fn put(&self, req: Request<pb::PutRequest>) -> Result<Response<pb::PutResponse>, Status> {
        let r = req.into_inner();
        let op = ShardOp::Put {
            mode: put_mode(r.mode)?,
            key: owned(r.key),
            value: owned(r.value),
        };
        self.node.execute(op).await?;
        Ok(Response::new(pb::PutResponse {}))
    }

    async fn delete(
        &self,
        req: Request<pb::DeleteRequest>,
    ) -> Result<Response<pb::DeleteResponse>, Status> {
        let key = owned(req.into_inner().key);
        self.node.execute(ShardOp::Delete { key }).await?;
        Ok(Response::new(pb::DeleteResponse {}))
    }

    async fn batch(
        &self,
        req: Request<pb::BatchRequest>,
    ) -> Result<Response<pb::BatchResponse>, Status> {
        let reqs = req.into_inner().requests;
        if reqs.is_empty() {
            return Err(KvError::InvalidArgument("an empty batch".into()).into());
        }
        let responses = run_batch(&self.node, reqs).await;
        Ok(Response::new(pb::BatchResponse { responses }))
    }

    type PipelineStream = ResponseStream;

    async fn pipeline(
        &self,
        req: Request<Streaming<pb::KvRequest>>,
    ) -> Result<Response<Self::PipelineStream>, Status> {
        let node = self.node.clone();
        let recorder = self.node.clone();
        let answers = drive_pipeline(
            req.into_inner(),
            PIPELINE_MAX_IN_FLIGHT,
            self.stopping.clone(),
            move |reqs, to| {
                let node = node.clone();
                async move { node.submit(reqs, &to).await }
            },
            move |a: &Answer| {
                if let Some(kind) = a.tag.kind {
                    recorder.record(kind, a.tag.started, a.answered, &a.result);
                }
            },
        );
        Ok(Response::new(Box::pin(answers)))
    }

    async fn prepare_map(
        &self,
        req: Request<pb::MapRequest>,
    ) -> Result<Response<pb::MapReply>, Status> {
        let map = decode_map(&req.into_inner().map)?;
        let v = self.node.prepare_map(map).await?;
        Ok(Response::new(pb::MapReply { map_version: v }))
    }

    async fn commit_map(
        &self,
        req: Request<pb::MapRequest>,
    ) -> Result<Response<pb::MapReply>, Status> {
        let map = decode_map(&req.into_inner().map)?;
        let v = self.node.commit_map(map).await?;
        Ok(Response::new(pb::MapReply { map_version: v }))
    }

    async fn stats(
        &self,
        req: Request<pb::KnStatsRequest>,
    ) -> Result<Response<pb::KnStatsResponse>, Status> {
        // The heartbeat the monitor relies on: a KN that cannot write (its DPM session has
        // been broken for a while and registering again fails) must not look alive.
        if !self.node.session_healthy() {
            return Err(KvError::Unavailable(
                "this KN's session with the DPM has been broken for seconds; it cannot write"
                    .into(),
            )
            .into());
        }
        let top = req.into_inner().top_keys.min(1000) as usize;
        let s = self.node.stats(top);
        Ok(Response::new(pb::KnStatsResponse {
            kn_id: self.node.kn_id(),
            map_version: self.node.map().version,
            gets: s.gets,
            puts: s.puts,
            deletes: s.deletes,
            value_hits: s.value_hits,
            shortcut_hits: s.shortcut_hits,
            unmerged_hits: s.unmerged_hits,
            misses: s.misses,
            wrong_owner: s.wrong_owner,
            round_trips: s.round_trips,
            bytes_read: s.bytes_read,
            bytes_written: s.bytes_written,
            occupancy: s.occupancy,
            top_keys: s
                .top_keys
                .into_iter()
                .map(|(k, c)| pb::KeyCount { key: k, count: c })
                .collect(),
            batches: s.batches,
            cache_values: s.cache_values,
            cache_shortcuts: s.cache_shortcuts,
            promotions: s.promotions,
            demotions: s.demotions,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    fn get(id: u64) -> Result<pb::KvRequest, Status> {
        Ok(pb::KvRequest {
            id,
            op: Some(pb::kv_request::Op::Get(pb::GetRequest {
                key: id.to_be_bytes().to_vec().into(),
            })),
        })
    }

    fn answer(tag: Tag) -> Answer {
        Answer {
            tag,
            answered: Instant::now(),
            result: Ok(None),
        }
    }

    /// A client streams far more requests than a stuck shard can answer: the KN must work on
    /// at most `max_in_flight` of them and leave the rest unread in the stream (HTTP/2 flow
    /// control then pushes back on the client), not accept and buffer them all.
    #[tokio::test]
    async fn pipeline_bounds_in_flight_requests_and_stops_reading() {
        const SENT: u64 = 10_000;
        const LIMIT: usize = 8;
        let read = Arc::new(AtomicUsize::new(0));
        let in_flight = Arc::new(AtomicUsize::new(0));
        let max_seen = Arc::new(AtomicUsize::new(0));
        // The shard: stuck until the test opens the gate.
        let gate = Arc::new(tokio::sync::Semaphore::new(0));

        let counted = read.clone();
        let incoming = tokio_stream::iter((0..SENT).map(get)).map(move |r| {
            counted.fetch_add(1, Ordering::SeqCst);
            r
        });
        let (inf, max, g) = (in_flight.clone(), max_seen.clone(), gate.clone());
        let answers = drive_pipeline(
            Box::pin(incoming),
            LIMIT,
            None,
            move |reqs: Vec<(Tag, ShardOp)>, to: AnswerSink| {
                for (tag, _) in reqs {
                    let now = inf.fetch_add(1, Ordering::SeqCst) + 1;
                    max.fetch_max(now, Ordering::SeqCst);
                    let (inf, g, to) = (inf.clone(), g.clone(), to.clone());
                    tokio::spawn(async move {
                        g.acquire().await.unwrap().forget();
                        inf.fetch_sub(1, Ordering::SeqCst);
                        let _ = to.send(answer(tag));
                    });
                }
                async {}
            },
            |_: &Answer| {},
        );
        let mut answers = Box::pin(answers);

        // Let the driver read as far as it will.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (r, m) = (read.load(Ordering::SeqCst), max_seen.load(Ordering::SeqCst));
        assert!(
            m <= LIMIT && r <= LIMIT + 1,
            "with a stuck shard the KN read {r} of {SENT} requests and ran {m} at once; \
             the bound is {LIMIT}"
        );

        // Unstick the shard: every request is still answered, once.
        gate.add_permits(SENT as usize);
        let mut ids = std::collections::HashSet::new();
        while let Some(resp) = answers.next().await {
            assert!(ids.insert(resp.unwrap().id));
        }
        assert_eq!(ids.len(), SENT as usize);
        assert!(max_seen.load(Ordering::SeqCst) <= LIMIT);
    }

    /// A client that streams requests but never reads the answers is stopped too: the slots
    /// stay taken until the encoder takes the answers, and the stream is left unread.
    #[tokio::test]
    async fn pipeline_stops_reading_when_answers_are_not_read() {
        const SENT: u64 = 10_000;
        const LIMIT: usize = 8;
        let read = Arc::new(AtomicUsize::new(0));
        let counted = read.clone();
        let incoming = tokio_stream::iter((0..SENT).map(get)).map(move |r| {
            counted.fetch_add(1, Ordering::SeqCst);
            r
        });
        let answers = drive_pipeline(
            Box::pin(incoming),
            LIMIT,
            None,
            |reqs: Vec<(Tag, ShardOp)>, to: AnswerSink| {
                for (tag, _) in reqs {
                    let _ = to.send(answer(tag));
                }
                async {}
            },
            |_: &Answer| {},
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        let r = read.load(Ordering::SeqCst);
        assert!(
            r <= LIMIT + 1,
            "the KN read {r} of {SENT} requests while its answers went unread (bound {LIMIT})"
        );

        // The client goes away with every slot taken: the reader must end (dropping the
        // request stream) instead of waiting for slots nobody will give back.
        drop(answers);
        for _ in 0..100 {
            if Arc::strong_count(&read) == 1 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the stream's reader still runs after its client went away");
    }

    /// Requests received together reach the node as one submission, in the order sent, and a
    /// request without an operation is answered without reaching it.
    #[tokio::test]
    async fn pipeline_submits_what_arrived_together_as_one_group() {
        let mut reqs: Vec<Result<pb::KvRequest, Status>> = (0..5).map(get).collect();
        reqs.push(Ok(pb::KvRequest { id: 99, op: None }));
        let groups = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let seen = groups.clone();
        let answers = drive_pipeline(
            Box::pin(tokio_stream::iter(reqs)),
            64,
            None,
            move |reqs: Vec<(Tag, ShardOp)>, to: AnswerSink| {
                seen.lock()
                    .push(reqs.iter().map(|(t, _)| t.id).collect::<Vec<_>>());
                for (tag, _) in reqs {
                    let _ = to.send(answer(tag));
                }
                async {}
            },
            |_: &Answer| {},
        );
        let answers: Vec<_> = answers.collect().await;
        assert_eq!(*groups.lock(), vec![vec![0, 1, 2, 3, 4]]);
        assert_eq!(answers.len(), 6);
        let invalid = answers
            .iter()
            .find(|a| a.as_ref().unwrap().id == 99)
            .unwrap();
        assert_eq!(
            invalid.as_ref().unwrap().code,
            KvError::InvalidArgument(String::new()).code() as i32
        );
    }
}
