//! `grpc.health.v1` for every node, so Kubernetes gRPC probes (and load balancers) can ask a
//! node whether it can do its job, not just whether its port is open.
//!
//! A node adds [`Health::service`] to its gRPC server and hands [`Health::follow`] a check
//! that says whether it can serve now (a KV node: registered with a healthy DPM session and
//! holding a map; a routing node: holding a map; ...). The overall status (service name "")
//! follows that check, polled every [`POLL`]; it starts NOT_SERVING (tonic-health's own
//! default is SERVING), so a probe never sees SERVING before the first check passed. Once the
//! node's shutdown signal fires ([`Health::on_shutdown`]) it is NOT_SERVING for good, so load
//! balancers stop sending while the node drains its connections.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tonic_health::pb::health_server::{Health as HealthApi, HealthServer};
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

/// How often [`Health::follow`] re-evaluates its check.
pub const POLL: Duration = Duration::from_millis(250);

/// The node's health reporter.
#[derive(Clone)]
pub struct Health {
    reporter: HealthReporter,
    /// Set once the node is stopping: nothing sets SERVING again.
    stopping: Arc<AtomicBool>,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Health")
    }
}

impl Health {
    /// A reporter (overall status NOT_SERVING) and the gRPC service that serves it.
    pub async fn new() -> (Health, HealthServer<impl HealthApi>) {
        let (reporter, service) = tonic_health::server::health_reporter();
        let h = Health {
            reporter,
            stopping: Arc::new(AtomicBool::new(false)),
        };
        h.set(false).await;
        (h, service)
    }

    /// `shutdown`, after which the status is NOT_SERVING for good: pass the result to the
    /// server as its shutdown signal.
    pub fn on_shutdown(
        &self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> impl Future<Output = ()> + Send + 'static {
        let h = self.clone();
        async move {
            shutdown.await;
            h.stopping.store(true, Ordering::Release);
            h.set(false).await;
        }
    }

    /// Sets the overall status (never SERVING once stopping).
    pub async fn set(&self, serving: bool) {
        let serving = serving && !self.stopping.load(Ordering::Acquire);
        let status = if serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        self.reporter.set_service_status("", status).await;
    }

    /// Keeps the overall status equal to `can_serve()` (checked now, then every [`POLL`])
    /// until the returned task is aborted or the runtime stops. Changes are logged.
    pub fn follow(
        self,
        node: &'static str,
        mut can_serve: impl FnMut() -> bool + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut last = None;
            loop {
                let now = can_serve();
                if last != Some(now) {
                    self.set(now).await;
                    tracing::info!(
                        node,
                        status = if now { "SERVING" } else { "NOT_SERVING" },
                        "grpc.health.v1 status"
                    );
                    last = Some(now);
                }
                tokio::time::sleep(POLL).await;
            }
        })
    }
}

/// What a node's `grpc.health.v1` answered for its overall status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probed {
    Serving,
    /// It answers, so it runs, but cannot do its job yet (or any more).
    NotServing,
}

/// Asks the node at `endpoint` (`host:port`) for its overall status. `Err` says why it could
/// not be asked: unreachable, no answer within `timeout`, or no health service.
pub async fn check(endpoint: &str, timeout: Duration) -> Result<Probed, String> {
    use tonic_health::pb::health_check_response::ServingStatus as Answer;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{endpoint}"))
        .map_err(|e| format!("{endpoint:?} is not an address: {e}"))?
        .connect_timeout(timeout)
        .timeout(timeout)
        .connect()
        .await
        .map_err(|e| format!("cannot reach {endpoint}: {e}"))?;
    let answer = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .map_err(|s| format!("{endpoint} answered the health check with {s}"))?
        .into_inner();
    Ok(if answer.status == Answer::Serving as i32 {
        Probed::Serving
    } else {
        Probed::NotServing
    })
}
