//! dinomo-client: the Rust SDK of Dinomo.
//!
//! A [`Client`] fetches the cluster map from a routing node, caches it, and sends each request
//! straight to the KV node that owns the key (computed with the same ring code the KV nodes
//! use). When a KV node answers WRONG_OWNER, or is unavailable while the cluster reconfigures,
//! the client refreshes its map and retries with a bounded, jittered backoff until the request's
//! deadline. A write whose outcome cannot be known (the node or the connection died while it
//! was in flight) is never retried blindly: it fails with [`ClientError::OutcomeUnknown`].
//! A caller the cluster's access layer refuses (no certificate, or a role that may not call
//! the KV service) gets [`ClientError::PermissionDenied`] at once: nothing was applied.
//! Clones share the map and the connection pool: one HTTP/2 channel per node, and on it one
//! long-lived `Pipeline` stream (`stream`) that carries every operation of this client to that
//! node, so that operations in flight together share frames and system calls instead of each
//! paying for an RPC of its own. What an operation does besides that is kept small: it reads
//! its owner and that KN's stream under one read lock (no copy of the map, no lookup by
//! endpoint, no allocation), and records its latency into a per-thread shard of the recorder.
//!
//! Every client reports its latencies to the cluster's monitor (the SLO policy's input) unless
//! [`ClientConfig::report_latency`] is false: to [`ClientConfig::monitor`] when set, else to
//! the monitor the routing nodes name with the map. A cluster without a monitor names none,
//! and nothing is sent.
//!
//! ```no_run
//! # async fn demo() -> Result<(), dinomo_client::ClientError> {
//! use dinomo_client::Client;
//! let client = Client::connect(&["127.0.0.1:7900"]).await?;
//! client.put("greeting", "hello").await?;
//! assert_eq!(client.get("greeting").await?.as_deref(), Some(&b"hello"[..]));
//! client.insert("counter", "0").await?; // AlreadyExists if it is there
//! client.update("counter", "1").await?; // NotFound if it is not
//! assert!(client.delete("counter").await?);
//! let results = client
//!     .batch(vec![dinomo_client::Op::get("greeting"), dinomo_client::Op::put("k", "v")])
//!     .await?;
//! assert_eq!(results.len(), 2);
//! # Ok(()) }
//! ```

pub mod admin;
mod error;
mod latency;
mod stream;
mod wire;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dinomo_placement::ClusterMap;
use dinomo_proto::kv as pb;
use dinomo_proto::kv::kv_service_client::KvServiceClient;
use dinomo_proto::routing::routing_service_client::RoutingServiceClient;
use dinomo_proto::routing::GetClusterMapRequest;
use parking_lot::{Mutex, RwLock};
use tonic::transport::Channel;
use tonic::Code;

pub use error::{ClientError, Result};

/// Settings of a client.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Routing nodes (host:port); tried in turn.
    pub routing: Vec<String>,
    /// How long one call may keep retrying.
    pub deadline: Duration,
    /// First retry delay; doubles up to `max_backoff`, with jitter.
    pub min_backoff: Duration,
    pub max_backoff: Duration,
    /// Per-attempt RPC timeout.
    pub rpc_timeout: Duration,
    /// The monitor (host:port) to report latencies to; `None`: the one the routing nodes
    /// name (the leading monitor), if any.
    pub monitor: Option<String>,
    /// Report latencies to the monitor (on by default: without them the monitor cannot tell a
    /// loaded cluster from an idle one). False: never, whatever `monitor` says.
    pub report_latency: bool,
    /// How often latencies are reported.
    pub report_every: Duration,
    /// TLS identity for every channel. [`ClientConfig::new`] finds one as
    /// [`Security::for_sdk`] says (the process's, else `$DINOMO_INSECURE`, else the `client`
    /// identity in `$DINOMO_CREDENTIALS` or `.dinomo/credentials`, else plain text);
    /// [`ClientConfig::with_credentials`] names a folder. A cluster with TLS refuses plain-text
    /// callers.
    ///
    /// [`Security::for_sdk`]: dinomo_security::Security::for_sdk
    pub security: dinomo_security::Security,
    /// How operations reach the KV nodes: the KV wire by default, or gRPC's Pipeline stream.
    /// [`ClientConfig::new`] reads `$DINOMO_KV_TRANSPORT` (`wire` or `grpc`).
    pub transport: KvTransport,
}

/// How a client's operations reach the KV nodes. Both carry the same messages (kv.proto) to
/// the same port and mean the same; they differ in cost (docs/perf/kv-wire.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvTransport {
    /// `dinomo_proto::wire`: length-framed messages on a TCP or TLS connection.
    #[default]
    Wire,
    /// gRPC's `KvService.Pipeline` stream (HTTP/2): for KV nodes behind an HTTP/2 proxy.
    Grpc,
}

impl std::str::FromStr for KvTransport {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "wire" => Ok(KvTransport::Wire),
            "grpc" => Ok(KvTransport::Grpc),
            _ => Err(format!("unknown KV transport {s:?}: wire or grpc")),
        }
    }
}

/// The environment variable that picks a client's [`KvTransport`].
pub const KV_TRANSPORT_ENV: &str = "DINOMO_KV_TRANSPORT";

impl KvTransport {
    /// `wire` or `grpc`, as [`std::str::FromStr`] reads it.
    pub fn name(self) -> &'static str {
        match self {
            KvTransport::Wire => "wire",
            KvTransport::Grpc => "grpc",
        }
    }

    /// `$DINOMO_KV_TRANSPORT`, else the wire; an unknown value is logged and ignored.
    pub fn from_env() -> Self {
        match std::env::var(KV_TRANSPORT_ENV) {
            Ok(v) => v.parse().unwrap_or_else(|e| {
                tracing::warn!("{KV_TRANSPORT_ENV}: {e}; using the KV wire");
                KvTransport::Wire
            }),
            Err(_) => KvTransport::Wire,
        }
    }
}

impl ClientConfig {
    pub fn new(routing: &[impl AsRef<str>]) -> Self {
        ClientConfig {
            routing: routing.iter().map(|r| r.as_ref().to_string()).collect(),
            deadline: Duration::from_secs(10),
            min_backoff: Duration::from_millis(2),
            max_backoff: Duration::from_millis(200),
            rpc_timeout: Duration::from_secs(5),
            monitor: None,
            report_latency: true,
            report_every: Duration::from_secs(1),
            security: dinomo_security::Security::for_sdk(),
            transport: KvTransport::from_env(),
        }
    }

    /// Uses the `client` identity in credentials folder `dir` (as made by `dinomo up` under
    /// `<data-dir>/credentials`, or a Kubernetes TLS Secret's files).
    pub fn with_credentials(mut self, dir: impl AsRef<std::path::Path>) -> Result<Self> {
        let id = dinomo_security::Identity::load(dir.as_ref(), "client")
            .map_err(|e| ClientError::InvalidArgument(e.to_string()))?;
        self.security = dinomo_security::Security::Mutual(std::sync::Arc::new(id));
        Ok(self)
    }
}

/// One operation of a [`Client::batch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Get(Bytes),
    Put(Bytes, Bytes),
    Insert(Bytes, Bytes),
    Update(Bytes, Bytes),
    Delete(Bytes),
}

impl Op {
    pub fn get(k: impl Into<Bytes>) -> Op {
        Op::Get(k.into())
    }
    pub fn put(k: impl Into<Bytes>, v: impl Into<Bytes>) -> Op {
        Op::Put(k.into(), v.into())
    }
    pub fn key(&self) -> &Bytes {
        match self {
            Op::Get(k) | Op::Put(k, _) | Op::Insert(k, _) | Op::Update(k, _) | Op::Delete(k) => k,
        }
    }
    /// The key's and value's bytes together.
    fn bytes(&self) -> usize {
        match self {
            Op::Get(k) | Op::Delete(k) => k.len(),
            Op::Put(k, v) | Op::Insert(k, v) | Op::Update(k, v) => k.len() + v.len(),
        }
    }
    fn idempotent(&self) -> bool {
        matches!(self, Op::Get(_))
    }
    fn to_request(&self, id: u64) -> pb::KvRequest {
        use pb::kv_request::Op as R;
        let put = |k: &Bytes, v: &Bytes, mode: pb::PutMode| {
            R::Put(pb::PutRequest {
                key: k.clone(),
                value: v.clone(),
                mode: mode as i32,
            })
        };
        let op = match self {
            Op::Get(k) => R::Get(pb::GetRequest { key: k.clone() }),
            Op::Put(k, v) => put(k, v, pb::PutMode::Upsert),
            Op::Insert(k, v) => put(k, v, pb::PutMode::Insert),
            Op::Update(k, v) => put(k, v, pb::PutMode::Update),
            Op::Delete(k) => R::Delete(pb::DeleteRequest { key: k.clone() }),
        };
        pb::KvRequest { id, op: Some(op) }
    }
}

/// The most key and value bytes one operation may carry: a request's frame (KV wire) or
/// message (gRPC) is at most 64 MiB, less room for the rest of the message. KV nodes refuse
/// far smaller keys and values by their own limits (`max_key_bytes`, `max_value_bytes`).
pub const MAX_OP_BYTES: usize = dinomo_proto::wire::MAX_FRAME - 1024;

/// What an operation returned: a value for Get (None = not found), `true`/`false` for Delete
/// (whether it existed) as `Some(empty)`/`None`, and `None` for writes.
pub type OpResult = Result<Option<Bytes>>;

/// The map in use and the stream to each of its KNs: what every operation reads, under one
/// read lock, without a lookup by endpoint or a clone of the map.
#[derive(Debug)]
struct Route {
    map: Arc<ClusterMap>,
    /// `nodes[i]` is the stream to `map.kns[i]`, or why there is none (an endpoint that is not
    /// an address: the operations routed to it fail with that error).
    nodes: Vec<Result<stream::NodeStream>>,
}

#[derive(Debug)]
struct Shared {
    cfg: ClientConfig,
    /// None only until `connect` has fetched the first map.
    route: RwLock<Option<Route>>,
    routing: Mutex<(usize, HashMap<String, RoutingServiceClient<Channel>>)>,
    /// One Pipeline stream per KV node endpoint ([`stream`]), kept across maps so that a new
    /// map reuses the streams of the KNs it keeps.
    nodes: Mutex<HashMap<String, stream::NodeStream>>,
    latency: Arc<latency::Recorder>,
    /// Where latencies go now: `cfg.monitor`, else the monitor the routing nodes named last.
    monitor: Arc<RwLock<Option<String>>>,
}

/// A Dinomo client. Cheap to clone; clones share the map and the connections.
#[derive(Debug, Clone)]
pub struct Client {
    shared: Arc<Shared>,
}

fn channel(
    security: &dinomo_security::Security,
    endpoint: &str,
    service: dinomo_security::Service,
    timeout: Duration,
) -> Result<Channel> {
    Ok(security
        .endpoint(endpoint, service)
        .map_err(|e| ClientError::InvalidArgument(format!("bad endpoint {endpoint:?}: {e}")))?
        .connect_timeout(Duration::from_secs(2))
        .timeout(timeout)
        .tcp_nodelay(true)
        .connect_lazy())
}

/// Whether `s` is the access layer's refusal of this caller (no identity, or a role that may
/// not make the call). Dinomo's nodes answer these codes only before any request runs: the
/// KV wire in its hello, gRPC in the interceptor that admits a call.
fn refused(s: &tonic::Status) -> bool {
    matches!(s.code(), Code::PermissionDenied | Code::Unauthenticated)
}

/// Was this status produced by a KV node (not by the transport)?
fn from_kn(s: &tonic::Status) -> bool {
    s.metadata().get(dinomo_proto::KN_ANSWER_TRAILER).is_some()
}

/// A transport failure that happened before the request could reach the node, so a
/// non-idempotent op may be retried without risking a duplicate write.
///
/// Decided from the error's type, never from its text: a server's message may contain any
/// words, and tonic/hyper may reword their Debug output in any release. tonic wraps every
/// failure of its connector (TCP connect, including refusal and `connect_timeout`, and the TLS
/// handshake) in [`tonic::ConnectError`]; no request is written on a connection that was never
/// established, and a lazy channel reports a failed connect to the next call without sending
/// it. The KV wire marks its failures before the node's hello with `stream::NeverSent` (the
/// node reads no request before it says hello). Anything else (a reset, a GOAWAY, a timeout, an error of unknown type) may have reached
/// the node after the request did, so it counts as maybe-sent.
fn never_sent(s: &tonic::Status) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(s);
    while let Some(e) = cause {
        if e.is::<tonic::ConnectError>() || e.is::<stream::NeverSent>() {
            return true;
        }
        cause = e.source();
    }
    false
}

impl Client {
    /// Connects through the routing nodes at `routing` (host:port) with default settings.
    pub async fn connect(routing: &[impl AsRef<str>]) -> Result<Client> {
        Self::connect_with(ClientConfig::new(routing)).await
    }

    pub async fn connect_with(cfg: ClientConfig) -> Result<Client> {
        if cfg.routing.is_empty() {
            return Err(ClientError::InvalidArgument("no routing node given".into()));
        }
        let mut routing = HashMap::new();
        for r in &cfg.routing {
            routing.insert(
                r.clone(),
                RoutingServiceClient::new(channel(
                    &cfg.security,
                    r,
                    dinomo_security::Service::Routing,
                    cfg.rpc_timeout,
                )?),
            );
        }
        let client = Client {
            shared: Arc::new(Shared {
                route: RwLock::new(None),
                routing: Mutex::new((0, routing)),
                nodes: Mutex::new(HashMap::new()),
                latency: Arc::new(latency::Recorder::new()),
                monitor: Arc::new(RwLock::new(cfg.monitor.clone())),
                cfg,
            }),
        };
        if client.shared.cfg.report_latency {
            tokio::spawn(latency::report_loop(
                client.shared.cfg.security.clone(),
                client.shared.monitor.clone(),
                client.shared.cfg.report_every,
                client.shared.latency.clone(),
                Arc::downgrade(&client.shared),
                |shared| async move {
                    // Errors are the next operation's to report; this only learns the monitor.
                    let _ = Client { shared }.refresh_map(None).await;
                },
            ));
        }
        let start = Instant::now();
        let mut last = String::new();
        while start.elapsed() < client.shared.cfg.deadline {
            match client.refresh_map(None).await {
                Ok(()) => return Ok(client),
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(ClientError::NoMap(last))
    }

    /// The cluster map in use.
    pub fn map(&self) -> Arc<ClusterMap> {
        self.shared
            .route
            .read()
            .as_ref()
            .expect("connect fetched a map")
            .map
            .clone()
    }

    /// Fetches the map from a routing node (waiting briefly for one newer than `newer_than`).
    pub async fn refresh_map(&self, newer_than: Option<u64>) -> Result<()> {
        let n = self.shared.cfg.routing.len();
        let mut last = String::new();
        for _ in 0..n {
            let (name, mut rc) = {
                let g = self.shared.routing.lock();
                let i = g.0 % n;
                let name = self.shared.cfg.routing[i].clone();
                (name.clone(), g.1.get(&name).expect("registered").clone())
            };
            match rc
                .get_cluster_map(GetClusterMapRequest { newer_than })
                .await
            {
                Ok(r) => {
                    let r = r.into_inner();
                    let map = ClusterMap::decode(&r.map)
                        .map_err(|e| ClientError::NoMap(format!("{name}: {e}")))?;
                    self.learn_monitor(r.monitor);
                    let mut cur = self.shared.route.write();
                    if cur.as_ref().is_none_or(|c| map.version > c.map.version) {
                        let nodes = map.kns.iter().map(|k| self.node(&k.endpoint)).collect();
                        *cur = Some(Route {
                            map: Arc::new(map),
                            nodes,
                        });
                    }
                    return Ok(());
                }
                Err(e) => {
                    last = format!("{name}: {}", e.message());
                    self.shared.routing.lock().0 += 1;
                }
            }
        }
        Err(ClientError::NoMap(last))
    }

    /// The monitor address a routing node named (empty: none, or a routing node that predates
    /// the field). A configured `monitor` wins; an empty answer keeps the last one known, as
    /// routing nodes of two versions may answer in turn.
    fn learn_monitor(&self, named: String) {
        if self.shared.cfg.monitor.is_some() || named.is_empty() {
            return;
        }
        let mut m = self.shared.monitor.write();
        if m.as_deref() != Some(named.as_str()) {
            *m = Some(named);
        }
    }

    /// The monitor latencies are reported to, if any.
    pub fn monitor(&self) -> Option<String> {
        self.shared.monitor.read().clone()
    }

    /// The stream to `endpoint`, from the pool or new (it opens on its first operation).
    fn node(&self, endpoint: &str) -> Result<stream::NodeStream> {
        let mut nodes = self.shared.nodes.lock();
        if let Some(c) = nodes.get(endpoint) {
            return Ok(c.clone());
        }
        let cfg = &self.shared.cfg;
        let transport: Arc<dyn stream::Transport> = match cfg.transport {
            KvTransport::Wire => {
                Arc::new(wire::Wire::new(&cfg.security, endpoint).map_err(|e| {
                    ClientError::InvalidArgument(format!("bad endpoint {endpoint:?}: {e}"))
                })?)
            }
            KvTransport::Grpc => Arc::new(stream::Grpc(
                KvServiceClient::new(channel(
                    &cfg.security,
                    endpoint,
                    dinomo_security::Service::Kv,
                    cfg.rpc_timeout,
                )?)
                .max_decoding_message_size(64 << 20),
            )),
        };
        let c = stream::NodeStream::new(transport, endpoint, cfg.rpc_timeout);
        nodes.insert(endpoint.to_string(), c.clone());
        Ok(c)
    }

    /// Runs one operation at the key's owner, retrying as the module doc says, and records
    /// its latency for the monitor.
    async fn execute(&self, op: Op) -> OpResult {
        if op.bytes() > MAX_OP_BYTES {
            // Refused here: a frame over the limit would end the connection that every other
            // operation to this KV node shares.
            return Err(ClientError::InvalidArgument(format!(
                "key and value of {} bytes together; at most {MAX_OP_BYTES} fit a request",
                op.bytes()
            )));
        }
        let start = Instant::now();
        let mut last_kn = None;
        let r = self.execute_at_owner(op, start, &mut last_kn).await;
        // Without reporting nothing ever reads the recorder, so nothing is recorded.
        if self.shared.cfg.report_latency && !matches!(r, Err(ClientError::InvalidArgument(_))) {
            self.shared.latency.record(last_kn, start.elapsed());
        }
        r
    }

    /// The KN to send `key` to: its owner, or for a replicated (hot) key one of its owners at
    /// random, which spreads the key's load over them (DINOMO 3.4).
    ///
    /// The same choice as picking from [`ClusterMap::owners`], which allocates a `Vec` per
    /// call (placement has no borrowing variant), so this applies its rule itself: the key's
    /// list if it is replicated, otherwise its ring owner.
    fn pick_owner(map: &ClusterMap, key: &[u8]) -> Option<dinomo_placement::KnId> {
        match map.replicated.get(key) {
            None => map.owner(key),
            Some(owners) => match owners.len() {
                0 => None,
                1 => Some(owners[0]),
                n => Some(owners[rand::random_range(0..n)]),
            },
        }
    }

    /// The KN to send `key` to (see [`Self::pick_owner`]), the version of the map that chose
    /// it, and its stream if the map names it. Holds the read lock only for this, and clones
    /// one `Arc` (the stream's); nothing is allocated.
    fn route(
        &self,
        key: &[u8],
    ) -> (
        Option<dinomo_placement::KnId>,
        u64,
        Option<Result<stream::NodeStream>>,
    ) {
        let g = self.shared.route.read();
        let route = g.as_ref().expect("connect fetched a map");
        let owner = Self::pick_owner(&route.map, key);
        let node = owner
            .and_then(|kn| route.map.kns.iter().position(|k| k.id == kn))
            .map(|i| route.nodes[i].clone());
        (owner, route.map.version, node)
    }

    /// `start` is when the operation began: its deadline counts from there.
    async fn execute_at_owner(
        &self,
        op: Op,
        start: Instant,
        last_kn: &mut Option<dinomo_placement::KnId>,
    ) -> OpResult {
        let cfg = &self.shared.cfg;
        let mut backoff = cfg.min_backoff;
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let (owner, version, node) = self.route(op.key());
            *last_kn = owner;
            let last = match node {
                None => {
                    // No owner in this map (between the removal of a cluster's last KN and the
                    // start of its replacement): only a newer map helps.
                    let _ = self.refresh_map(Some(version)).await;
                    format!("no KV node owns the key under map version {version}")
                }
                Some(node) => {
                    let node = node?;
                    let endpoint = node.endpoint();
                    // Sent on the node's stream, in the same frames as whatever else this client
                    // has queued for the node.
                    let r = node.call(op.to_request(0)).await;
                    match r {
                        Ok(x) => {
                            match Code::from_i32(x.code) {
                                Code::Ok => {
                                    return Ok(match op {
                                        Op::Get(_) => Some(x.value),
                                        Op::Delete(_) => Some(Bytes::new()),
                                        _ => None,
                                    })
                                }
                                Code::NotFound => {
                                    return match op {
                                        Op::Get(_) | Op::Delete(_) => Ok(None),
                                        _ => Err(ClientError::NotFound),
                                    }
                                }
                                Code::AlreadyExists => return Err(ClientError::AlreadyExists),
                                Code::InvalidArgument => {
                                    return Err(ClientError::InvalidArgument(x.message))
                                }
                                // Refused before anything was written: final, not retried.
                                Code::ResourceExhausted => {
                                    return Err(ClientError::ResourceExhausted(x.message))
                                }
                                Code::Unknown if !op.idempotent() => {
                                    return Err(ClientError::OutcomeUnknown(x.message))
                                }
                                Code::FailedPrecondition => {
                                    let _ = self.refresh_map(Some(version)).await;
                                    x.message
                                }
                                _ => x.message,
                            }
                        }
                        // The access layer refused this caller before any handler ran (the
                        // KV wire's hello, or gRPC's interceptor): nothing was applied, and
                        // the same credentials will be refused again.
                        Err(s) if refused(&s) => {
                            let m = s.message();
                            return Err(ClientError::PermissionDenied(
                                if m.starts_with(endpoint) {
                                    m.to_string()
                                } else {
                                    format!("{endpoint}: {m}")
                                },
                            ));
                        }
                        Err(s) if from_kn(&s) => match s.code() {
                            Code::InvalidArgument
                            | Code::NotFound
                            | Code::AlreadyExists
                            | Code::ResourceExhausted => {
                                return Err(ClientError::from_final_status(&s))
                            }
                            _ => s.message().to_string(),
                        },
                        Err(s) => {
                            // Transport failure: a write may or may not have been applied,
                            // unless it never left this process.
                            if !op.idempotent() && !never_sent(&s) {
                                return Err(ClientError::OutcomeUnknown(format!(
                                    "{endpoint}: {}",
                                    s.message()
                                )));
                            }
                            let _ = self.refresh_map(None).await;
                            format!("{endpoint}: {}", s.message())
                        }
                    }
                }
            };
            if start.elapsed() >= cfg.deadline {
                return Err(ClientError::DeadlineExceeded { attempts, last });
            }
            let jitter = rand::random::<f64>() * 0.5 + 0.75;
            tokio::time::sleep(
                backoff
                    .mul_f64(jitter)
                    .min(cfg.deadline.saturating_sub(start.elapsed())),
            )
            .await;
            backoff = (backoff * 2).min(cfg.max_backoff);
        }
    }

    /// The value of `key`, or `None` if it does not exist.
    pub async fn get(&self, key: impl Into<Bytes>) -> Result<Option<Bytes>> {
        self.execute(Op::Get(key.into())).await
    }

    /// Creates or replaces.
    pub async fn put(&self, key: impl Into<Bytes>, value: impl Into<Bytes>) -> Result<()> {
        self.execute(Op::Put(key.into(), value.into()))
            .await
            .map(|_| ())
    }

    /// Creates; [`ClientError::AlreadyExists`] if the key exists.
    pub async fn insert(&self, key: impl Into<Bytes>, value: impl Into<Bytes>) -> Result<()> {
        self.execute(Op::Insert(key.into(), value.into()))
            .await
            .map(|_| ())
    }

    /// Replaces; [`ClientError::NotFound`] if the key does not exist.
    pub async fn update(&self, key: impl Into<Bytes>, value: impl Into<Bytes>) -> Result<()> {
        self.execute(Op::Update(key.into(), value.into()))
            .await
            .map(|_| ())
    }

    /// Deletes; returns whether the key existed.
    pub async fn delete(&self, key: impl Into<Bytes>) -> Result<bool> {
        self.execute(Op::Delete(key.into()))
            .await
            .map(|r| r.is_some())
    }

    /// Runs several operations, concurrently across keys (each with the retry rules of a single
    /// call); results come back in order. Operations on the same key run in the order given.
    pub async fn batch(&self, ops: Vec<Op>) -> Result<Vec<OpResult>> {
        let mut seen = std::collections::HashSet::new();
        if ops.iter().all(|o| seen.insert(o.key().clone())) {
            Ok(futures::future::join_all(ops.into_iter().map(|op| self.execute(op))).await)
        } else {
            let mut out = Vec::with_capacity(ops.len());
            for op in ops {
                out.push(self.execute(op).await);
            }
            Ok(out)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `pick_owner` applies `ClusterMap::owners`' rule without its `Vec`: the ring owner for a
    /// plain key, any of a replicated key's owners (each of them, over enough picks).
    #[test]
    fn pick_owner_chooses_among_the_maps_owners() {
        let kns = (1..=3)
            .map(|id| dinomo_placement::KnInfo {
                id,
                endpoint: format!("127.0.0.1:{}", 7000 + id),
            })
            .collect();
        let map = ClusterMap::new(kns, 64, 2)
            .unwrap()
            .with_replicated(b"hot".to_vec(), vec![3, 1])
            .unwrap();
        for i in 0..200 {
            let key = format!("key-{i}");
            assert_eq!(
                Client::pick_owner(&map, key.as_bytes()),
                Some(map.owners(key.as_bytes())[0]),
                "{key}"
            );
        }
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..200 {
            seen.insert(Client::pick_owner(&map, b"hot").unwrap());
        }
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![1, 3]);
        let empty = ClusterMap::new(Vec::new(), 64, 2).unwrap();
        assert_eq!(Client::pick_owner(&empty, b"k"), None);
    }

    /// A status whose message (and Debug) contains the words the old substring check looked
    /// for, but which is not a connect failure: the request may have been applied.
    #[test]
    fn connect_words_in_a_message_do_not_make_it_never_sent() {
        let s = tonic::Status::unavailable("ConnectError: connection refused while connecting");
        assert!(!never_sent(&s), "a bare message proves nothing: {s:?}");

        let io = std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "peer reset after connect (connection refused by ConnectError)",
        );
        let s = tonic::Status::from_error(Box::new(io));
        assert!(std::error::Error::source(&s).is_some());
        assert!(
            !never_sent(&s),
            "a reset after sending is maybe-sent: {s:?}"
        );
    }

    /// A loopback port with nobody listening.
    fn closed_port() -> std::net::SocketAddr {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
        // dropped here: connecting to it is refused
    }

    fn kv_client(addr: std::net::SocketAddr) -> KvServiceClient<Channel> {
        KvServiceClient::new(
            channel(
                &dinomo_security::Security::Insecure,
                &addr.to_string(),
                dinomo_security::Service::Kv,
                Duration::from_secs(2),
            )
            .unwrap(),
        )
    }

    const PROBE_KEY: &str = "never-sent-probe-key";

    fn one_put() -> pb::BatchRequest {
        pb::BatchRequest {
            requests: vec![Op::put(PROBE_KEY, "v").to_request(0)],
        }
    }

    #[tokio::test]
    async fn refused_connection_is_never_sent() {
        let s = kv_client(closed_port()).batch(one_put()).await.unwrap_err();
        assert!(
            never_sent(&s),
            "connection refused must be never-sent: {s:?}"
        );
    }

    /// The request reached a peer that read it and then dropped the connection without an
    /// answer: it may have been applied, so the status must not count as never sent.
    #[tokio::test]
    async fn dropped_after_receiving_is_maybe_sent() {
        use tokio::io::AsyncReadExt;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let peer = tokio::spawn(async move {
            let (mut sock, _) = l.accept().await.unwrap();
            // Read until the request's body (which carries the key verbatim) has arrived,
            // then drop the connection without answering.
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            while !got
                .windows(PROBE_KEY.len())
                .any(|w| w == PROBE_KEY.as_bytes())
            {
                let n = sock.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..n]);
            }
            drop(sock);
            got.windows(PROBE_KEY.len())
                .any(|w| w == PROBE_KEY.as_bytes())
        });
        let s = kv_client(addr).batch(one_put()).await.unwrap_err();
        assert!(
            peer.await.unwrap(),
            "the peer should have received the request"
        );
        assert!(
            !never_sent(&s),
            "a request the peer received is maybe-sent: {s:?}"
        );
    }
}
