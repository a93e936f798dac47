//! KvService over gRPC: requests become [`ShardOp`]s, [`KvError`]s become statuses (error.rs).

use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use dinomo_proto::kv as pb;
use dinomo_proto::kv::kv_service_server::KvService;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use crate::error::{KvError, KvResult};
use crate::node::KvNode;
use crate::shard::{PutMode, ShardOp};

#[derive(Debug, Clone)]
pub struct KvGrpc {
    node: Arc<KvNode>,
}

impl KvGrpc {
    pub fn new(node: Arc<KvNode>) -> Self {
        KvGrpc { node }
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

/// Decodes one pipelined/batched request.
fn op_of(req: pb::KvRequest) -> KvResult<ShardOp> {
    match req.op {
        Some(pb::kv_request::Op::Get(g)) => Ok(ShardOp::Get {
            key: Bytes::from(g.key),
        }),
        Some(pb::kv_request::Op::Put(p)) => Ok(ShardOp::Put {
            mode: put_mode(p.mode)?,
            key: Bytes::from(p.key),
            value: Bytes::from(p.value),
        }),
        Some(pb::kv_request::Op::Delete(d)) => Ok(ShardOp::Delete {
            key: Bytes::from(d.key),
        }),
        None => Err(KvError::InvalidArgument(
            "request without an operation (get, put or delete)".into(),
        )),
    }
}

fn response(id: u64, r: KvResult<Option<Bytes>>) -> pb::KvResponse {
    match r {
        Ok(v) => pb::KvResponse {
            id,
            code: 0,
            value: v.map(|b| b.to_vec()).unwrap_or_default(),
            ..Default::default()
        },
        Err(e) => pb::KvResponse {
            id,
            code: e.code() as i32,
            message: e.to_string(),
            map_version: e.map_version(),
            value: Vec::new(),
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

type ResponseStream = Pin<Box<dyn Stream<Item = Result<pb::KvResponse, Status>> + Send>>;

#[tonic::async_trait]
impl KvService for KvGrpc {
    async fn get(&self, req: Request<pb::GetRequest>) -> Result<Response<pb::GetResponse>, Status> {
        let key = Bytes::from(req.into_inner().key);
        let v = self.node.execute(ShardOp::Get { key }).await?;
        Ok(Response::new(pb::GetResponse {
            value: v.map(|b| b.to_vec()).unwrap_or_default(),
        }))
    }

    async fn put(&self, req: Request<pb::PutRequest>) -> Result<Response<pb::PutResponse>, Status> {
        let r = req.into_inner();
        let op = ShardOp::Put {
            mode: put_mode(r.mode)?,
            key: Bytes::from(r.key),
            value: Bytes::from(r.value),
        };
        self.node.execute(op).await?;
        Ok(Response::new(pb::PutResponse {}))
    }

    async fn delete(
        &self,
        req: Request<pb::DeleteRequest>,
    ) -> Result<Response<pb::DeleteResponse>, Status> {
        let key = Bytes::from(req.into_inner().key);
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
        // Operations on distinct keys run concurrently; a batch that names a key twice runs in
        // the order given, one operation at a time.
        let mut seen = std::collections::HashSet::new();
        let distinct = reqs.iter().all(|r| seen.insert(key_of(r)));
        let responses = if distinct {
            futures::future::join_all(reqs.into_iter().map(|r| run_one(&self.node, r))).await
        } else {
            let mut out = Vec::with_capacity(reqs.len());
            for r in reqs {
                out.push(run_one(&self.node, r).await);
            }
            out
        };
        Ok(Response::new(pb::BatchResponse { responses }))
    }

    type PipelineStream = ResponseStream;

    async fn pipeline(
        &self,
        req: Request<Streaming<pb::KvRequest>>,
    ) -> Result<Response<Self::PipelineStream>, Status> {
        let mut incoming = req.into_inner();
        let node = self.node.clone();
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<pb::KvResponse, Status>>(1024);
        tokio::spawn(async move {
            while let Some(msg) = incoming.next().await {
                let Ok(r) = msg else { break };
                let (node, tx) = (node.clone(), tx.clone());
                tokio::spawn(async move {
                    let _ = tx.send(Ok(run_one(&node, r).await)).await;
                });
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
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
                .map(|(k, c)| pb::KeyCount {
                    key: k.to_vec(),
                    count: c,
                })
                .collect(),
            batches: s.batches,
            cache_values: s.cache_values,
            cache_shortcuts: s.cache_shortcuts,
            promotions: s.promotions,
            demotions: s.demotions,
        }))
    }
}
