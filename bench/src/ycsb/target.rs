//! The systems a benchmark drives: Dinomo (through `dinomo-client`) and Redis (through the
//! `redis` crate, async on tokio, one multiplexed connection per benchmark client).
//!
//! Both run the same operations with the same semantics, chosen by [`WriteMode`]:
//!
//! | operation | `upsert` (default)             | `strict`                                  |
//! |-----------|--------------------------------|-------------------------------------------|
//! | read      | Dinomo `get` / Redis `GET`     | same                                      |
//! | update    | Dinomo `put` / Redis `SET`     | Dinomo `update` / Redis `SET XX` (NotFound) |
//! | insert    | Dinomo `put` / Redis `SET`     | Dinomo `insert` / Redis `SET NX` (AlreadyExists) |
//!
//! YCSB treats an insert as a plain write of a new key, which is what `SET` does, so `upsert`
//! is the default; `strict` also measures the existence checks Dinomo makes for insert and
//! update.

use std::fmt;
use std::time::Duration;

use anyhow::{bail, Context as _};
use async_trait::async_trait;
use bytes::Bytes;
use dinomo_client::{Client, ClientConfig, ClientError};
use dinomo_proto::kv::kv_service_client::KvServiceClient;
use dinomo_proto::kv::{KnStatsRequest, KnStatsResponse};

/// Why an operation failed; `kind` is the short name errors are counted under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpError {
    /// "not_found", "already_exists", "deadline_exceeded", "outcome_unknown", "io", ...
    pub kind: String,
    pub message: String,
}

impl OpError {
    /// The kind of a write refused because the cluster's pool is full.
    pub const RESOURCE_EXHAUSTED: &'static str = "resource_exhausted";

    pub fn new(kind: impl Into<String>, message: impl Into<String>) -> Self {
        OpError {
            kind: kind.into(),
            message: message.into(),
        }
    }

    /// A read of a key that does not exist (YCSB's NOT_FOUND).
    pub fn not_found() -> Self {
        OpError::new("not_found", "the key does not exist")
    }
}

impl fmt::Display for OpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)
    }
}

impl std::error::Error for OpError {}

impl From<ClientError> for OpError {
    fn from(e: ClientError) -> Self {
        let kind = match &e {
            ClientError::AlreadyExists => "already_exists",
            ClientError::NotFound => "not_found",
            ClientError::InvalidArgument(_) => "invalid_argument",
            ClientError::ResourceExhausted(_) => OpError::RESOURCE_EXHAUSTED,
            ClientError::OutcomeUnknown(_) => "outcome_unknown",
            ClientError::PermissionDenied(_) => "permission_denied",
            ClientError::DeadlineExceeded { .. } => "deadline_exceeded",
            ClientError::NoMap(_) => "no_map",
            ClientError::Other(_) => "other",
        };
        OpError::new(kind, e.to_string())
    }
}

impl From<redis::RedisError> for OpError {
    fn from(e: redis::RedisError) -> Self {
        let kind = if e.is_timeout() {
            "timeout".to_string()
        } else if e.is_connection_dropped() || e.is_connection_refusal() {
            "connection".to_string()
        } else if e.is_io_error() {
            "io".to_string()
        } else {
            format!("redis_{:?}", e.kind()).to_ascii_lowercase()
        };
        OpError::new(kind, e.to_string())
    }
}

/// Semantics of updates and inserts (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WriteMode {
    /// Updates and inserts both create or replace.
    #[default]
    Upsert,
    /// Updates need the key, inserts need it absent.
    Strict,
}

impl WriteMode {
    /// "upsert" or "strict".
    pub fn name(self) -> &'static str {
        match self {
            WriteMode::Upsert => "upsert",
            WriteMode::Strict => "strict",
        }
    }
}

/// A key-value system under test. One value is used by one benchmark client; its operations
/// may be called concurrently (several requests in flight).
#[async_trait]
pub trait Target: Send + Sync + fmt::Debug {
    /// The value of `key`, or `None` if it does not exist.
    async fn get(&self, key: Bytes) -> Result<Option<Bytes>, OpError>;

    /// Writes the value of an existing key (see [`WriteMode`]).
    async fn update(&self, key: Bytes, value: Bytes) -> Result<(), OpError>;

    /// Writes the value of a new key (see [`WriteMode`]).
    async fn insert(&self, key: Bytes, value: Bytes) -> Result<(), OpError>;

    /// Deletes `key` (a missing key is not an error).
    async fn delete(&self, key: Bytes) -> Result<(), OpError>;

    /// Reads `key`, then writes `value` to it (YCSB F). A missing key fails with `not_found`
    /// and is not written.
    async fn read_modify_write(&self, key: Bytes, value: Bytes) -> Result<(), OpError> {
        if self.get(key.clone()).await?.is_none() {
            return Err(OpError::not_found());
        }
        self.update(key, value).await
    }
}

/// Dinomo through its Rust SDK.
#[derive(Debug, Clone)]
pub struct DinomoTarget {
    client: Client,
    mode: WriteMode,
}

impl DinomoTarget {
    /// Connects through the routing nodes `routing` (host:port each); `report_latency`: see
    /// [`ClientConfig::report_latency`]; `transport`: the SDK's default if `None`.
    pub async fn connect(
        routing: &[String],
        mode: WriteMode,
        report_latency: bool,
        transport: Option<dinomo_client::KvTransport>,
    ) -> anyhow::Result<Self> {
        let mut cfg = ClientConfig::new(routing);
        cfg.report_latency = report_latency;
        if let Some(t) = transport {
            cfg.transport = t;
        }
        let client = Client::connect_with(cfg).await.with_context(|| {
            format!("connecting to Dinomo routing node(s) {}", routing.join(","))
        })?;
        Ok(DinomoTarget { client, mode })
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    /// A snapshot of every KV node's counters (`KvService.Stats`), in cluster-map order.
    pub async fn kn_stats(&self) -> anyhow::Result<Vec<KnStatsResponse>> {
        let map = self.client.map();
        let calls = map.kns.iter().map(|kn| {
            let endpoint = kn.endpoint.clone();
            async move {
                let fut = async {
                    let channel = dinomo_security::Security::of_process()
                        .endpoint(&endpoint, dinomo_security::Service::Kv)?
                        .connect()
                        .await?;
                    let mut c = KvServiceClient::new(channel);
                    let r = c.stats(KnStatsRequest { top_keys: 0 }).await?;
                    anyhow::Ok(r.into_inner())
                };
                tokio::time::timeout(Duration::from_secs(10), fut)
                    .await
                    .map_err(|_| anyhow::anyhow!("timed out"))
                    .and_then(|r| r)
                    .with_context(|| format!("KvService.Stats at {endpoint}"))
            }
        });
        futures::future::try_join_all(calls).await
    }
}

#[async_trait]
impl Target for DinomoTarget {
    async fn get(&self, key: Bytes) -> Result<Option<Bytes>, OpError> {
        Ok(self.client.get(key).await?)
    }

    async fn update(&self, key: Bytes, value: Bytes) -> Result<(), OpError> {
        match self.mode {
            WriteMode::Upsert => self.client.put(key, value).await?,
            WriteMode::Strict => self.client.update(key, value).await?,
        }
        Ok(())
    }

    async fn insert(&self, key: Bytes, value: Bytes) -> Result<(), OpError> {
        match self.mode {
            WriteMode::Upsert => self.client.put(key, value).await?,
            WriteMode::Strict => self.client.insert(key, value).await?,
        }
        Ok(())
    }

    async fn delete(&self, key: Bytes) -> Result<(), OpError> {
        self.client.delete(key).await?;
        Ok(())
    }
}

/// Redis (or anything that speaks its protocol) over one multiplexed connection.
#[derive(Clone)]
pub struct RedisTarget {
    con: redis::aio::MultiplexedConnection,
    mode: WriteMode,
}

impl fmt::Debug for RedisTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisTarget")
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl RedisTarget {
    /// Opens a multiplexed connection to `url` (`redis://HOST:PORT[/DB]`).
    pub async fn connect(url: &str, mode: WriteMode) -> anyhow::Result<Self> {
        let client = redis::Client::open(url).with_context(|| format!("bad Redis URL {url:?}"))?;
        // The default 500 ms response timeout is too short for deep pipelines on a busy machine.
        let cfg = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(5)))
            .set_response_timeout(Some(Duration::from_secs(10)));
        let con = client
            .get_multiplexed_async_connection_with_config(&cfg)
            .await
            .with_context(|| format!("connecting to Redis at {url}"))?;
        Ok(RedisTarget { con, mode })
    }

    /// Runs `SET key value [flag]`; `Ok(false)` when NX/XX prevented the write.
    async fn set(&self, key: Bytes, value: Bytes, flag: Option<&str>) -> Result<bool, OpError> {
        let mut cmd = redis::cmd("SET");
        cmd.arg(key.as_ref()).arg(value.as_ref());
        if let Some(flag) = flag {
            cmd.arg(flag);
        }
        let mut con = self.con.clone();
        let reply: redis::Value = cmd.query_async(&mut con).await?;
        Ok(!matches!(reply, redis::Value::Nil))
    }
}

#[async_trait]
impl Target for RedisTarget {
    async fn get(&self, key: Bytes) -> Result<Option<Bytes>, OpError> {
        let mut con = self.con.clone();
        let v: Option<Vec<u8>> = redis::cmd("GET")
            .arg(key.as_ref())
            .query_async(&mut con)
            .await?;
        Ok(v.map(Bytes::from))
    }

    async fn update(&self, key: Bytes, value: Bytes) -> Result<(), OpError> {
        match self.mode {
            WriteMode::Upsert => self.set(key, value, None).await.map(|_| ()),
            WriteMode::Strict => match self.set(key, value, Some("XX")).await? {
                true => Ok(()),
                false => Err(OpError::not_found()),
            },
        }
    }

    async fn insert(&self, key: Bytes, value: Bytes) -> Result<(), OpError> {
        match self.mode {
            WriteMode::Upsert => self.set(key, value, None).await.map(|_| ()),
            WriteMode::Strict => match self.set(key, value, Some("NX")).await? {
                true => Ok(()),
                false => Err(OpError::new("already_exists", "the key already exists")),
            },
        }
    }

    async fn delete(&self, key: Bytes) -> Result<(), OpError> {
        let mut con = self.con.clone();
        redis::cmd("DEL")
            .arg(&key[..])
            .query_async::<i64>(&mut con)
            .await?;
        Ok(())
    }
}

/// A parsed `--target`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetSpec {
    /// `dinomo://HOST:PORT[,HOST:PORT...]`: routing node addresses.
    Dinomo(Vec<String>),
    /// `redis://HOST:PORT[/DB]`: the URL as given.
    Redis(String),
}

impl TargetSpec {
    pub fn parse(s: &str) -> anyhow::Result<Self> {
        if let Some(rest) = s.strip_prefix("dinomo://") {
            let addrs: Vec<String> = rest
                .trim_end_matches('/')
                .split(',')
                .map(str::trim)
                .filter(|a| !a.is_empty())
                .map(str::to_string)
                .collect();
            if addrs.is_empty() {
                bail!("--target {s:?} names no routing node: use dinomo://HOST:PORT");
            }
            Ok(TargetSpec::Dinomo(addrs))
        } else if s.starts_with("redis://") {
            if s.len() == "redis://".len() {
                bail!("--target {s:?} names no server: use redis://HOST:PORT");
            }
            Ok(TargetSpec::Redis(s.to_string()))
        } else {
            bail!("--target {s:?}: expected dinomo://HOST:PORT or redis://HOST:PORT")
        }
    }

    /// "dinomo" or "redis".
    pub fn system(&self) -> &'static str {
        match self {
            TargetSpec::Dinomo(_) => "dinomo",
            TargetSpec::Redis(_) => "redis",
        }
    }
}

impl fmt::Display for TargetSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TargetSpec::Dinomo(a) => write!(f, "dinomo://{}", a.join(",")),
            TargetSpec::Redis(u) => f.write_str(u),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_specs() {
        assert_eq!(
            TargetSpec::parse("dinomo://127.0.0.1:7900").unwrap(),
            TargetSpec::Dinomo(vec!["127.0.0.1:7900".into()])
        );
        assert_eq!(
            TargetSpec::parse("dinomo://a:1,b:2").unwrap(),
            TargetSpec::Dinomo(vec!["a:1".into(), "b:2".into()])
        );
        assert_eq!(
            TargetSpec::parse("redis://127.0.0.1:6379")
                .unwrap()
                .to_string(),
            "redis://127.0.0.1:6379"
        );
        assert!(TargetSpec::parse("dinomo://").is_err());
        assert!(TargetSpec::parse("redis://").is_err());
        assert!(TargetSpec::parse("http://x:1").is_err());
    }

    #[test]
    fn client_errors_map_to_kinds() {
        assert_eq!(
            OpError::from(ClientError::AlreadyExists).kind,
            "already_exists"
        );
        assert_eq!(OpError::from(ClientError::NotFound).kind, "not_found");
        let e = ClientError::DeadlineExceeded {
            attempts: 3,
            last: "x".into(),
        };
        assert_eq!(OpError::from(e).kind, "deadline_exceeded");
    }
}
