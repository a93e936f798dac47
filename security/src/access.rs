//! The role table, and the tower layer every server installs to enforce it before any
//! handler runs.
//!
//! Invariants: a gRPC path that is not in [`TABLE`] is refused for everyone (fail closed); a
//! refused call never reaches its handler, so it changes nothing; an admitted call carries its
//! [`Caller`] in the request extensions, where handlers with field-level rules find it
//! ([`caller_of`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::task::{Context, Poll};

use parking_lot::Mutex;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
use tonic::Status;

use crate::caller::{Caller, Role};

/// One row of the role table: a gRPC path and the roles that may call it.
#[derive(Debug)]
pub struct Rule {
    pub path: &'static str,
    pub roles: &'static [Role],
}

const CLIENT: &[Role] = &[Role::Client];
const NODE: &[Role] = &[Role::Node];
const MONITOR: &[Role] = &[Role::Monitor];
const ADMIN: &[Role] = &[Role::Admin];
const MONITOR_ADMIN: &[Role] = &[Role::Monitor, Role::Admin];
const NODE_MONITOR: &[Role] = &[Role::Node, Role::Monitor];
const NODE_MONITOR_ADMIN: &[Role] = &[Role::Node, Role::Monitor, Role::Admin];
const CLIENT_MONITOR_ADMIN: &[Role] = &[Role::Client, Role::Monitor, Role::Admin];
const ANY: &[Role] = &[Role::Client, Role::Node, Role::Monitor, Role::Admin];

macro_rules! rules {
    ($($service:literal { $($method:literal: $roles:expr),* $(,)? })*) => {
        &[$($(Rule { path: concat!("/", $service, "/", $method), roles: $roles },)*)*]
    };
}

/// What each role may call (docs/decisions/0005-security.md, Decision 2). Rows marked there
/// with * (InstallIndirectCell and CompareAndPutMetadata for `node`) have a further field-level
/// check in the DPM's handler.
pub static TABLE: &[Rule] = rules! {
    "dinomo.kv.v1.KvService" {
        "Get": CLIENT, "Put": CLIENT, "Delete": CLIENT, "Batch": CLIENT, "Pipeline": CLIENT,
        // Clients too: `dinomo bench` reads hit ratios and round trips per operation from it,
        // and a client may read every key anyway.
        "Stats": CLIENT_MONITOR_ADMIN,
        "PrepareMap": MONITOR, "CommitMap": MONITOR,
    }
    "dinomo.routing.v1.RoutingService" {
        "GetClusterMap": CLIENT_MONITOR_ADMIN, "WatchClusterMap": CLIENT_MONITOR_ADMIN,
    }
    "dinomo.monitor.v1.MonitorService" {
        "ReportLatency": CLIENT,
        "Status": ADMIN,
        "AddKn": ADMIN, "RemoveKn": ADMIN, "FailKn": ADMIN, "SetPolicy": ADMIN,
    }
    "dinomo.dpm.v1.DpmService" {
        "RegisterKn": NODE, "AllocateSegment": NODE, "SealSegment": NODE, "ConfirmServing": NODE,
        "ForwardWrites": NODE,
        "PendingSegments": NODE_MONITOR_ADMIN,
        "MergeAll": MONITOR, "FenceKn": MONITOR, "RemoveIndirectCell": MONITOR,
        "PutMetadata": MONITOR, "NewMonitorTerm": MONITOR,
        "InstallIndirectCell": NODE_MONITOR,
        "CompareAndPutMetadata": NODE_MONITOR,
        "GetMetadata": NODE_MONITOR_ADMIN,
        "ListMetadata": MONITOR_ADMIN, "Stats": MONITOR_ADMIN,
    }
    "dinomo.dpm.v1.ReplicaService" {
        // The primary dpm-node attaches its backups with its node identity.
        "Attach": NODE, "CopyComplete": NODE, "RecordGeneration": NODE,
        "Status": NODE_MONITOR_ADMIN,
        "AddBackup": MONITOR_ADMIN, "RemoveBackup": MONITOR_ADMIN, "Promote": MONITOR_ADMIN,
    }
    "grpc.health.v1.Health" {
        "Check": ANY, "Watch": ANY,
    }
};

/// The roles that may call `path`, or `None` if it is not in the table.
pub fn allowed(path: &str) -> Option<&'static [Role]> {
    TABLE.iter().find(|r| r.path == path).map(|r| r.roles)
}

/// The caller an admitted request carries (none under `--insecure`).
pub fn caller_of<T>(request: &tonic::Request<T>) -> Option<&Caller> {
    request.extensions().get::<Caller>()
}

/// A field-level rule in a handler: refuses (PERMISSION_DENIED, naming `rule`) unless the
/// server runs without access checks or the caller has one of `roles`.
pub fn require<T>(request: &tonic::Request<T>, roles: &[Role], rule: &str) -> Result<(), Status> {
    match caller_of(request) {
        None => Ok(()),
        Some(c) if roles.contains(&c.role) => Ok(()),
        Some(c) => Err(Status::permission_denied(format!(
            "{rule} needs role {}; this caller is {c}",
            names(roles)
        ))),
    }
}

fn names(roles: &[Role]) -> String {
    roles
        .iter()
        .map(|r| r.as_str())
        .collect::<Vec<_>>()
        .join(" or ")
}

/// Decides one call: `Ok(caller)` to admit it, or the status to answer instead.
pub fn admit(path: &str, peer_leaf: Option<&[u8]>, cache: &CallerCache) -> Result<Caller, Status> {
    let Some(roles) = allowed(path) else {
        return Err(Status::permission_denied(format!(
            "{path} is not in the access table: no role may call it"
        )));
    };
    let Some(leaf) = peer_leaf else {
        return Err(Status::unauthenticated(format!(
            "{path} needs a client certificate with role {}; pass --credentials DIR or set {}",
            names(roles),
            crate::CREDENTIALS_ENV
        )));
    };
    let caller = cache.caller(leaf).map_err(|reason| {
        Status::unauthenticated(format!(
            "{path}: the client certificate is no identity: {reason}"
        ))
    })?;
    if !roles.contains(&caller.role) {
        return Err(Status::permission_denied(format!(
            "{path} needs role {}; this caller is {caller}",
            names(roles)
        )));
    }
    Ok(caller)
}

/// Identities parsed from leaf certificates, so that a connection's requests do not parse its
/// certificate each time. Bounded: cleared when full (a cluster has a handful of identities).
#[derive(Debug, Default)]
pub struct CallerCache {
    known: Mutex<HashMap<Vec<u8>, Result<Caller, String>>>,
}

const CACHE_LIMIT: usize = 1024;

impl CallerCache {
    fn caller(&self, leaf: &[u8]) -> Result<Caller, String> {
        if let Some(c) = self.known.lock().get(leaf) {
            return c.clone();
        }
        let parsed = Caller::from_certificate(leaf);
        let mut known = self.known.lock();
        if known.len() >= CACHE_LIMIT {
            known.clear();
        }
        known.insert(leaf.to_vec(), parsed.clone());
        parsed
    }
}

/// Enforces [`TABLE`] in front of a server's services (or, disabled, admits everything).
#[derive(Clone, Debug)]
pub struct AccessLayer {
    cache: Option<Arc<CallerCache>>,
}

impl AccessLayer {
    pub fn enforcing() -> Self {
        AccessLayer {
            cache: Some(Arc::default()),
        }
    }

    /// `--insecure`: every call is admitted, with no caller.
    pub fn disabled() -> Self {
        AccessLayer { cache: None }
    }
}

impl<S> tower_layer::Layer<S> for AccessLayer {
    type Service = AccessService<S>;
    fn layer(&self, inner: S) -> AccessService<S> {
        AccessService {
            inner,
            cache: self.cache.clone(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct AccessService<S> {
    inner: S,
    cache: Option<Arc<CallerCache>>,
}

impl<S, B, R> tower_service::Service<http::Request<B>> for AccessService<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<R>>,
    R: Default,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = futures::future::Either<
        S::Future,
        futures::future::Ready<Result<http::Response<R>, S::Error>>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let Some(cache) = &self.cache else {
            return futures::future::Either::Left(self.inner.call(req));
        };
        let certs = req
            .extensions()
            .get::<TlsConnectInfo<TcpConnectInfo>>()
            .and_then(|i| i.peer_certs());
        let leaf = certs.as_ref().and_then(|c| c.first()).map(|c| c.as_ref());
        match admit(req.uri().path(), leaf, cache) {
            Ok(caller) => {
                req.extensions_mut().insert(caller);
                futures::future::Either::Left(self.inner.call(req))
            }
            Err(status) => {
                tracing::debug!(path = req.uri().path(), %status, "call refused");
                futures::future::Either::Right(futures::future::ready(Ok(status.into_http())))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `rpc` in proto/ has a row, and every row names an rpc (or the health service).
    #[test]
    fn the_table_covers_exactly_the_protos_rpcs() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../proto/proto");
        let mut rpcs = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
            let package = text
                .lines()
                .find_map(|l| l.trim().strip_prefix("package "))
                .map(|p| p.trim_end_matches(';').to_string());
            let mut service = None;
            for line in text.lines().map(str::trim) {
                if let Some(s) = line.strip_prefix("service ") {
                    service = s.split_whitespace().next().map(str::to_string);
                }
                if let Some(r) = line.strip_prefix("rpc ") {
                    let method = r.split('(').next().unwrap().trim();
                    rpcs.push(format!(
                        "/{}.{}/{method}",
                        package.as_ref().unwrap(),
                        service.as_ref().unwrap()
                    ));
                }
            }
        }
        assert!(rpcs.len() > 20, "found only {rpcs:?}");
        for rpc in &rpcs {
            assert!(
                allowed(rpc).is_some(),
                "{rpc} has no row in the access table"
            );
        }
        for rule in TABLE {
            assert!(
                rule.path.starts_with("/grpc.health.v1.") || rpcs.iter().any(|r| r == rule.path),
                "{} names no rpc",
                rule.path
            );
        }
    }

    #[test]
    fn unknown_paths_and_missing_certificates_are_refused_with_what_is_needed() {
        let cache = CallerCache::default();
        let e = admit("/dinomo.dpm.v1.DpmService/Nope", Some(b"x"), &cache).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        let e = admit("/dinomo.dpm.v1.DpmService/FenceKn", None, &cache).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(e.message().contains("role monitor"), "{}", e.message());
        let e = admit(
            "/dinomo.dpm.v1.DpmService/FenceKn",
            Some(b"not der"),
            &cache,
        )
        .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
    }
}
