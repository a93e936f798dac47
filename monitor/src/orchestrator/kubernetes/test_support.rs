//! A mock API server for the tests of the `kubernetes` orchestrator and of its Lease
//! ([`super::lease`]): a `tower_test` service behind a real `kube::Client`, with a task that
//! checks every request in order (method, path, query, body) and answers it, then checks that no
//! request follows the script.

use std::time::Duration;

use http::{Request, Response};
use k8s_openapi::jiff::Timestamp;
use kube::client::Body;
use kube::Client;
use serde_json::{json, Value};
use tokio::task::JoinHandle;

use super::{KubernetesConfig, KubernetesOrchestrator};

pub(super) type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

fn fixed_now() -> Timestamp {
    Timestamp::from_second(1_700_000_000).expect("valid timestamp")
}

pub(super) fn config() -> KubernetesConfig {
    KubernetesConfig {
        namespace: "dinomo".into(),
        identity: "monitor-a".into(),
        ready_timeout_ms: 30_000,
        stop_timeout_ms: 30_000,
        poll_interval_ms: 1,
        ..KubernetesConfig::default()
    }
}

/// One expected request and the answer to it.
pub(super) struct Exchange {
    method: &'static str,
    /// Path and query, e.g. `/api/v1/namespaces/dinomo/pods?labelSelector=...`.
    uri: String,
    /// The exact JSON body expected; `None` means an empty body.
    body: Option<Value>,
    status: u16,
    reply: Value,
}

pub(super) fn expect(method: &'static str, uri: impl Into<String>) -> Exchange {
    Exchange {
        method,
        uri: uri.into(),
        body: None,
        status: 200,
        reply: json!({}),
    }
}

impl Exchange {
    pub(super) fn body(mut self, body: Value) -> Self {
        self.body = Some(body);
        self
    }
    pub(super) fn reply(mut self, status: u16, reply: Value) -> Self {
        self.status = status;
        self.reply = reply;
        self
    }
}

/// Checks one request against `ex` and answers it.
pub(super) async fn answer(
    i: usize,
    req: Request<Body>,
    send: tower_test::mock::SendResponse<Response<Body>>,
    ex: Exchange,
) {
    // kube may leave empty components in the query ("?&labelSelector=..."), which the API
    // server ignores; drop them so the assertion compares the parameters themselves.
    let query = req
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("&");
    let uri = if query.is_empty() {
        req.uri().path().to_string()
    } else {
        format!("{}?{query}", req.uri().path())
    };
    assert_eq!(
        (req.method().as_str(), uri.as_str()),
        (ex.method, ex.uri.as_str()),
        "request {i}"
    );
    let content_type = req
        .headers()
        .get(http::header::CONTENT_TYPE)
        .map(|v| v.to_str().expect("ascii content type").to_string());
    let bytes = req.into_body().collect_bytes().await.expect("request body");
    match ex.body {
        None => assert!(bytes.is_empty(), "request {i}: unexpected body {bytes:?}"),
        Some(expected) => {
            let got: Value = serde_json::from_slice(&bytes).expect("JSON request body");
            assert_eq!(got, expected, "request {i} ({} {}) body", ex.method, ex.uri);
            let want_type = if ex.method == "PATCH" {
                "application/merge-patch+json"
            } else {
                "application/json"
            };
            assert_eq!(content_type.as_deref(), Some(want_type), "request {i}");
        }
    }
    let response = Response::builder()
        .status(ex.status)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Body::from(serde_json::to_vec(&ex.reply).expect("JSON")))
        .expect("response");
    send.send_response(response);
}

/// Plays `script` in order, then insists that no further request comes.
async fn serve(mut handle: Handle, script: Vec<Exchange>) {
    for (i, ex) in script.into_iter().enumerate() {
        let Some((req, send)) = handle.next_request().await else {
            panic!("request {i} ({} {}) never came", ex.method, ex.uri);
        };
        answer(i, req, send, ex).await;
    }
    if let Some((req, _)) = handle.next_request().await {
        panic!("unexpected request {} {}", req.method(), req.uri());
    }
}

pub(super) fn orchestrator_with(config: KubernetesConfig) -> (KubernetesOrchestrator, Handle) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(service, "default");
    let orch = KubernetesOrchestrator::with_clock(client, config, fixed_now);
    (orch, handle)
}

pub(super) fn with_script(script: Vec<Exchange>) -> (KubernetesOrchestrator, JoinHandle<()>) {
    let (orch, handle) = orchestrator_with(config());
    (orch, tokio::spawn(serve(handle, script)))
}

/// Drops the client (which ends the mock service) and waits for the server's verdict.
pub(super) async fn finish(orch: KubernetesOrchestrator, server: JoinHandle<()>) {
    drop(orch);
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("mock API server did not finish")
        .expect("mock API server assertion failed");
}

pub(super) fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Status",
        "metadata": {},
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    })
}
