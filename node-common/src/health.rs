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
//!
//! With mutual TLS on the node's port, a prober without a client certificate (kubelet) cannot
//! ask there: a node started with `--health-addr` ([`HealthArgs`]) also serves the same
//! statuses, and nothing else, in plain text on that address.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tonic_health::pb::health_server::{Health as HealthApi, HealthServer};
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

/// How often [`Health::follow`] re-evaluates its check.
pub const POLL: Duration = Duration::from_millis(250);

/// `--health-addr`: the plain-text, health-only listener of a node process.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct HealthArgs {
    /// Also serve grpc.health.v1, and nothing else, in plain text on this address: for probes
    /// that cannot present a client certificate, such as kubelet's gRPC probes.
    #[arg(long, env = "DINOMO_HEALTH_ADDR")]
    pub health_addr: Option<std::net::SocketAddr>,
}

impl HealthArgs {
    /// Binds the listener now (so that a taken port fails the start); the node's
    /// [`Health::new`] serves on it.
    pub fn install(&self) -> std::io::Result<()> {
        if let Some(addr) = self.health_addr {
            let l = std::net::TcpListener::bind(addr)?;
            l.set_nonblocking(true)?;
            tracing::info!(%addr, "plain-text health listener");
            *PLAIN_LISTENER.lock().unwrap_or_else(|e| e.into_inner()) = Some(l);
        }
        Ok(())
    }
}

/// The listener [`HealthArgs::install`] bound, taken by the first [`Health::new`].
static PLAIN_LISTENER: std::sync::Mutex<Option<std::net::TcpListener>> =
    std::sync::Mutex::new(None);

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
        let plain = PLAIN_LISTENER
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(l) = plain {
            let service = service.clone();
            tokio::spawn(async move {
                let served = match tokio::net::TcpListener::from_std(l) {
                    Ok(l) => {
                        tonic::transport::Server::builder()
                            .add_service(service)
                            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l))
                            .await
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "the plain-text health listener");
                        return;
                    }
                };
                if let Err(e) = served {
                    tracing::error!(error = %e, "the plain-text health listener stopped");
                }
            });
        }
        (h, service)
    }

    /// Another gRPC service serving this reporter's statuses: a node that replaces its gRPC
    /// server (a promoted backup starting as the primary) adds it to the new one, and the
    /// plain-text listener ([`HealthArgs`]) goes on serving the same statuses.
    pub fn service(&self) -> HealthServer<tonic_health::server::HealthService> {
        HealthServer::new(tonic_health::server::HealthService::from_health_reporter(
            self.reporter.clone(),
        ))
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

/// Asks the `service` node at `endpoint` (`host:port`) for its overall status, as this
/// process's identity ([`dinomo_security::Security::of_process`]). `Err` says why it could
/// not be asked: unreachable, no answer within `timeout`, or no health service.
pub async fn check(
    endpoint: &str,
    service: dinomo_security::Service,
    timeout: Duration,
) -> Result<Probed, String> {
    use tonic_health::pb::health_check_response::ServingStatus as Answer;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let channel = dinomo_security::Security::of_process()
        .endpoint(endpoint, service)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `--health-addr` serves the node's own statuses in plain text, and nothing else.
    #[tokio::test]
    async fn the_plain_health_listener_follows_the_node() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        HealthArgs {
            health_addr: Some(addr),
        }
        .install()
        .unwrap();
        let (health, _service) = Health::new().await;
        let target = addr.to_string();
        let probe = || {
            check(
                &target,
                dinomo_security::Service::Kv,
                Duration::from_secs(2),
            )
        };
        assert_eq!(probe().await.unwrap(), Probed::NotServing);
        health.set(true).await;
        assert_eq!(probe().await.unwrap(), Probed::Serving);
        // Only health is served there.
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut grpc = tonic::client::Grpc::new(channel);
        grpc.ready().await.unwrap();
        let other = grpc
            .unary(
                tonic::Request::new(()),
                tonic::codegen::http::uri::PathAndQuery::from_static(
                    "/dinomo.dpm.v1.DpmService/FenceKn",
                ),
                tonic_prost::ProstCodec::<(), ()>::default(),
            )
            .await
            .unwrap_err();
        assert_eq!(other.code(), tonic::Code::Unimplemented);
    }
}
