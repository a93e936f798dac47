//! MonitorService (gRPC): client latency reports, Status, and the admin actions.
//!
//! Whoever calls: latency reports are checked ([`crate::monitor::check_report`]) before they
//! count, and the admin actions (SetPolicy included) are taken only by the leading monitor.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dinomo_proto::monitor as pb;
use dinomo_proto::monitor::monitor_service_server::MonitorService;
use tonic::{Request, Response, Status};

use crate::monitor::{unix_ms, Monitor};

#[derive(Debug, Clone)]
pub struct Service {
    monitor: Arc<Monitor>,
}

impl Service {
    pub fn new(monitor: Arc<Monitor>) -> Self {
        Service { monitor }
    }
}

/// Admin actions change the map or the policy: only the leading monitor may take them (and
/// the reconfiguration re-checks leadership before each of its steps). Status does not ask:
/// a standby answers it too.
async fn must_lead(m: &Monitor) -> Result<(), Status> {
    match m.lead().await {
        Ok(Some(_)) => Ok(()),
        Ok(None) => Err(Status::failed_precondition(
            "this monitor does not hold the lease; ask the active monitor",
        )),
        Err(e) => Err(Status::unavailable(format!(
            "cannot tell whether this monitor leads: {e:#}"
        ))),
    }
}

fn failed(e: anyhow::Error) -> Status {
    Status::failed_precondition(format!("{e:#}"))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[tonic::async_trait]
impl MonitorService for Service {
    async fn report_latency(
        &self,
        req: Request<pb::LatencyReport>,
    ) -> Result<Response<pb::LatencyReply>, Status> {
        let r = req.into_inner();
        self.monitor.report(&r).map_err(Status::invalid_argument)?;
        Ok(Response::new(pb::LatencyReply {
            report_every_ms: self.monitor.cfg.stats.report_every_ms,
        }))
    }

    async fn status(
        &self,
        _req: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusReply>, Status> {
        let s = self.monitor.snapshot();
        // Membership from the map of record (it changes between epochs); load figures from the
        // last epoch's statistics.
        let (map_version, members) = match self.monitor.current_map().await {
            Ok(m) => (
                m.version,
                m.kns
                    .iter()
                    .map(|k| (k.id, k.endpoint.clone()))
                    .collect::<Vec<_>>(),
            ),
            Err(_) => (
                s.map_version,
                s.kns
                    .iter()
                    .map(|(&id, v)| (id, v.endpoint.clone()))
                    .collect(),
            ),
        };
        Ok(Response::new(pb::StatusReply {
            map_version,
            kns: members
                .into_iter()
                .map(|(kn_id, endpoint)| {
                    // A member not sampled by an epoch yet (just added) is presumed alive: the
                    // probe loop removes dead members from the map.
                    let v = s
                        .kns
                        .get(&kn_id)
                        .cloned()
                        .unwrap_or(crate::monitor::KnView {
                            alive: true,
                            ..Default::default()
                        });
                    pb::KnStatus {
                        kn_id,
                        endpoint,
                        occupancy: v.occupancy,
                        ops: v.ops,
                        alive: v.alive,
                    }
                })
                .collect(),
            avg_latency_us: s.avg_latency_us,
            p99_latency_us: s.p99_latency_us,
            epoch: s.epoch,
            recent: self
                .monitor
                .decisions()
                .into_iter()
                .map(|d| pb::Decision {
                    at_ms: unix_ms(d.at),
                    action: d.action,
                    reason: d.reason,
                    map_version: d.map_version,
                })
                .collect(),
            replicated: s.replicated.iter().map(|(k, r)| (hex(k), *r)).collect(),
            orchestrator: self.monitor.orchestrator().name().to_string(),
        }))
    }

    async fn set_policy(
        &self,
        req: Request<pb::PolicyRequest>,
    ) -> Result<Response<pb::PolicyReply>, Status> {
        must_lead(&self.monitor).await?;
        let text = req.into_inner().toml;
        let p = crate::config::PolicyConfig::from_toml_str(&text)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        self.monitor
            .set_policy(p)
            .map_err(|e| Status::invalid_argument(format!("{e:#}")))?;
        Ok(Response::new(pb::PolicyReply {
            toml: self.monitor.policy_config().to_toml_string(),
        }))
    }

    async fn add_kn(
        &self,
        _req: Request<pb::AddKnRequest>,
    ) -> Result<Response<pb::ActionReply>, Status> {
        must_lead(&self.monitor).await?;
        let (kn, v) = self
            .monitor
            .add_kn("requested by an operator")
            .await
            .map_err(failed)?;
        Ok(Response::new(pb::ActionReply {
            map_version: v,
            message: format!("KN {kn} added"),
            kn_id: kn,
            recovery_us: 0,
        }))
    }

    async fn remove_kn(
        &self,
        req: Request<pb::KnRequest>,
    ) -> Result<Response<pb::ActionReply>, Status> {
        must_lead(&self.monitor).await?;
        let kn = req.into_inner().kn_id;
        let v = self
            .monitor
            .remove_kn(kn, "requested by an operator")
            .await
            .map_err(failed)?;
        Ok(Response::new(pb::ActionReply {
            map_version: v,
            message: format!("KN {kn} removed"),
            kn_id: kn,
            recovery_us: 0,
        }))
    }

    async fn fail_kn(
        &self,
        req: Request<pb::KnRequest>,
    ) -> Result<Response<pb::ActionReply>, Status> {
        must_lead(&self.monitor).await?;
        let kn = req.into_inner().kn_id;
        let map = self.monitor.current_map().await.map_err(failed)?;
        if !map.contains(kn) {
            return Err(Status::invalid_argument(crate::monitor::not_in_map(
                kn, &map,
            )));
        }
        let before = self.monitor.recoveries().len();
        self.monitor
            .orchestrator()
            .fail_kn(kn)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        // The monitor detects the failure like any other; wait for its recovery.
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Some(r) = self.monitor.recoveries()[before..]
                .iter()
                .find(|r| r.kn == kn)
            {
                return Ok(Response::new(pb::ActionReply {
                    map_version: r.report.to_version,
                    message: format!(
                        "KN {kn} killed; recovered {:.1} ms after detection",
                        r.to_published.as_secs_f64() * 1e3
                    ),
                    kn_id: kn,
                    recovery_us: r.to_published.as_micros() as u64,
                }));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Err(Status::deadline_exceeded(format!(
            "KN {kn} was killed but its recovery was not seen within 30 s"
        )))
    }
}
