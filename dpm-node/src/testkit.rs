//! A minimal KN-side log writer over any fabric, used by this crate's tests, the crash test and
//! the merge benchmark to produce logs exactly as a KN does: one checksummed batch per WRITE,
//! at most one WRITE in flight, a new segment (and a seal of the old one) when a batch does not
//! fit. The kv-node has its own writer with group commit and caching. Also a whole dpm-node in
//! this process ([`InProcessDpm`]) for the kv-node tests and the benchmarks.

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use dinomo_fabric::{Fabric, FabricExt};
use dinomo_layout::index::EntryPtr;
use dinomo_layout::log::{entry_len, BatchBuilder, LogOp};

use crate::dpm::Dpm;
use crate::error::{DpmError, Result};
use crate::segments::SegmentGrant;

/// Where a writer gets segments and tells about sealing them.
#[async_trait]
pub trait SegmentSource: Send + Sync {
    async fn allocate(&self) -> Result<SegmentGrant>;
    async fn seal(&self, segment: u64) -> Result<u64>;
    /// Called after every WRITE of a batch, before it counts as done: a source whose
    /// registration said `forward_writes` calls ForwardWrites here. Nothing by default.
    async fn forward(&self, _offset: u64, _len: u64) -> Result<()> {
        Ok(())
    }
}

/// In-process source: a KN registered with a local [`Dpm`].
#[derive(Debug)]
pub struct LocalSource {
    pub dpm: Arc<Dpm>,
    pub kn: u32,
    pub epoch: u64,
}

#[async_trait]
impl SegmentSource for LocalSource {
    async fn allocate(&self) -> Result<SegmentGrant> {
        self.dpm.allocate_segment(self.kn, 0, self.epoch, false)
    }
    async fn seal(&self, segment: u64) -> Result<u64> {
        self.dpm.seal_segment(self.kn, self.epoch, segment)
    }
}

/// One entry to log.
#[derive(Debug, Clone)]
pub struct LogRecord {
    pub op: LogOp,
    pub version: u64,
    pub key: Vec<u8>,
    pub value: Vec<u8>,
}

#[derive(Debug)]
pub struct LogWriter<F, S> {
    fabric: F,
    source: S,
    current: Option<(SegmentGrant, u64, u32)>,
}

impl<F: Fabric, S: SegmentSource> LogWriter<F, S> {
    pub fn new(fabric: F, source: S) -> Self {
        LogWriter {
            fabric,
            source,
            current: None,
        }
    }

    /// The segment source (a test changes how it behaves midway).
    pub fn source_mut(&mut self) -> &mut S {
        &mut self.source
    }

    pub fn fabric(&self) -> &F {
        &self.fabric
    }

    /// Writes `records` as one batch (one WRITE); returns where each entry landed. When this
    /// returns Ok the batch is durable at the DPM.
    pub async fn append(&mut self, records: &[LogRecord]) -> Result<Vec<EntryPtr>> {
        let mut b = BatchBuilder::new();
        let offs: Vec<usize> = records
            .iter()
            .map(|r| b.push(r.op, r.version, &r.key, &r.value))
            .collect();
        let need = b.encoded_len() as u64;
        let fits = self
            .current
            .as_ref()
            .is_some_and(|(g, pos, _)| pos + need <= g.len);
        if !fits {
            if let Some((g, _, _)) = self.current.take() {
                self.source.seal(g.segment_id).await?;
            }
            let g = self.source.allocate().await?;
            if g.first_batch + need > g.len {
                return Err(DpmError::InvalidArgument(format!(
                    "a batch of {need} bytes does not fit a segment of {}",
                    g.len
                )));
            }
            self.current = Some((g, g.first_batch, g.chain_seed));
        }
        let (g, pos, chain) = self.current.as_mut().expect("set above");
        let (bytes, next_chain) = b.finish(*chain);
        let base = g.offset + *pos;
        self.fabric.write(base, Bytes::from(bytes)).await?;
        self.source.forward(base, need).await?;
        *pos += need;
        *chain = next_chain;
        Ok(records
            .iter()
            .zip(offs)
            .map(|(r, o)| EntryPtr::new(base + o as u64, entry_len(r.key.len(), r.value.len())))
            .collect())
    }

    /// Seals the current segment, if any.
    pub async fn seal(&mut self) -> Result<()> {
        if let Some((g, _, _)) = self.current.take() {
            self.source.seal(g.segment_id).await?;
        }
        Ok(())
    }
}

/// Source over gRPC: a KN talking to a dpm-node process.
#[derive(Debug, Clone)]
pub struct GrpcSource {
    pub client: dinomo_proto::dpm::dpm_service_client::DpmServiceClient<tonic::transport::Channel>,
    pub kn: u32,
    pub epoch: u64,
}

fn status(s: tonic::Status) -> DpmError {
    DpmError::Config(format!("DPM call failed: {} ({})", s.message(), s.code()))
}

#[async_trait]
impl SegmentSource for GrpcSource {
    async fn allocate(&self) -> Result<SegmentGrant> {
        let r = self
            .client
            .clone()
            .allocate_segment(dinomo_proto::dpm::AllocateSegmentRequest {
                kn_id: self.kn,
                epoch: self.epoch,
                stream: 0,
                deletes_only: false,
            })
            .await
            .map_err(status)?
            .into_inner();
        Ok(SegmentGrant {
            segment_id: r.segment_id,
            offset: r.offset,
            len: r.len,
            chain_seq: r.chain_seq,
            first_batch: r.first_batch,
            chain_seed: r.chain_seed,
        })
    }

    async fn seal(&self, segment: u64) -> Result<u64> {
        let r = self
            .client
            .clone()
            .seal_segment(dinomo_proto::dpm::SealSegmentRequest {
                kn_id: self.kn,
                epoch: self.epoch,
                segment_id: segment,
            })
            .await
            .map_err(status)?
            .into_inner();
        Ok(r.pending_segments)
    }
}

impl<F: Fabric, S: SegmentSource> LogWriter<F, S> {
    /// Forgets the current segment without sealing it (after a failed WRITE the segment's log
    /// may end in a torn batch, so nothing more may be appended to it). Returns its id.
    pub fn abandon(&mut self) -> Option<u64> {
        self.current.take().map(|(g, _, _)| g.segment_id)
    }

    pub fn source(&self) -> &S {
        &self.source
    }
}

/// A whole dpm-node ([`crate::server::run`]) in this process, for tests and benchmarks that
/// want a DPM without a child process. It serves until [`InProcessDpm::stop`] or until dropped
/// (dropping signals shutdown; the server then stops on its own).
#[derive(Debug)]
pub struct InProcessDpm {
    running: crate::server::Running,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<()>>>,
}

impl InProcessDpm {
    /// Starts the node on the current tokio runtime and returns once its listeners are bound,
    /// or with the error that stopped it before that (a bad pool, a port in use).
    pub async fn start(config: crate::config::DpmConfig) -> Result<Self> {
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let mut task = tokio::spawn(async move {
            crate::server::run(
                config,
                async move {
                    // Sent or dropped: either way, stop.
                    let _ = stop_rx.await;
                },
                move |r| {
                    let _ = ready_tx.send(r.clone());
                },
            )
            .await
        });
        match ready_rx.await {
            Ok(running) => Ok(InProcessDpm {
                running,
                stop: Some(stop_tx),
                task: Some(task),
            }),
            // The server returned before it was ready: its result says why.
            Err(_) => match (&mut task).await {
                Ok(Err(e)) => Err(e),
                Ok(Ok(())) => Err(DpmError::Io(std::io::Error::other(
                    "the in-process dpm-node stopped before it was ready",
                ))),
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Err(e) => Err(DpmError::Io(std::io::Error::other(format!(
                    "the in-process dpm-node did not start: {e}"
                )))),
            },
        }
    }

    /// The node's addresses.
    pub fn running(&self) -> &crate::server::Running {
        &self.running
    }

    /// The gRPC endpoint.
    pub fn grpc(&self) -> std::net::SocketAddr {
        self.running.grpc
    }

    /// `http://<grpc endpoint>`, as gRPC clients and KV nodes are given it.
    pub fn url(&self) -> String {
        format!("http://{}", self.running.grpc)
    }

    /// Signals shutdown and waits for the node to stop; returns what the server returned.
    pub async fn stop(mut self) -> Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        match self.task.take() {
            Some(t) => match t.await {
                Ok(r) => r,
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Err(_) => Ok(()),
            },
            None => Ok(()),
        }
    }
}
