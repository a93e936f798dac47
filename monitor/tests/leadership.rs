//! The monitor's side of leadership: it takes a DPM monitor term when it becomes leader,
//! sends it with every DPM call of a reconfiguration, re-checks leadership before each step
//! and aborts when it lost it; a monitor deposed at the DPM publishes nothing.
//!
//! The DPM here is a recording fake of DpmService (the monitor crate cannot start the real
//! one): it keeps the map with compare-and-swap and refuses older terms the way the dpm-node
//! does (dpm-node/tests/integration/publication.rs tests the real one), and records each call
//! with the term it carried, so the test can say which steps ran.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use dinomo_client::admin;
use dinomo_monitor::config::MonitorConfig;
use dinomo_monitor::orchestrator::{Orchestrator, OrchestratorError, Result as OrchResult};
use dinomo_monitor::{Monitor, MonitorOptions};
use dinomo_placement::{ClusterMap, KnId, KnInfo};
use dinomo_proto::dpm as pb;
use dinomo_proto::dpm::dpm_service_server::{DpmService, DpmServiceServer};
use parking_lot::Mutex;
use tonic::{Request, Response, Status};

#[derive(Debug, Default)]
struct FakeState {
    map: Option<Vec<u8>>,
    term: u64,
    /// "fence 2 @1", "merge 2 @1", "publish v2 @1" ("@-": no term).
    calls: Vec<String>,
    /// Other metadata (the reconfiguration record), compare-and-swapped but not recorded.
    other: std::collections::HashMap<String, Vec<u8>>,
}

#[derive(Debug, Clone, Default)]
struct FakeDpm(Arc<Mutex<FakeState>>);

impl FakeDpm {
    /// Admits a call: its term (if any) must be the newest.
    fn admit<T>(&self, req: &Request<T>) -> Result<String, Status> {
        let Some(v) = req.metadata().get(admin::MONITOR_TERM_HEADER) else {
            return Ok("@-".into());
        };
        let t: u64 = v.to_str().unwrap().parse().unwrap();
        let newest = self.0.lock().term;
        if t < newest {
            return Err(Status::permission_denied(format!(
                "monitor term {t} is stale: term {newest} was started since"
            )));
        }
        Ok(format!("@{t}"))
    }

    fn calls(&self) -> Vec<String> {
        self.0.lock().calls.clone()
    }
}

fn unused() -> Status {
    Status::unimplemented("not used by these tests")
}

#[tonic::async_trait]
impl DpmService for FakeDpm {
    async fn register_kn(
        &self,
        _: Request<pb::RegisterKnRequest>,
    ) -> Result<Response<pb::RegisterKnResponse>, Status> {
        Err(unused())
    }
    async fn forward_writes(
        &self,
        _: Request<pb::ForwardWritesRequest>,
    ) -> Result<Response<pb::ForwardWritesResponse>, Status> {
        Err(unused())
    }
    async fn allocate_segment(
        &self,
        _: Request<pb::AllocateSegmentRequest>,
    ) -> Result<Response<pb::AllocateSegmentResponse>, Status> {
        Err(unused())
    }
    async fn seal_segment(
        &self,
        _: Request<pb::SealSegmentRequest>,
    ) -> Result<Response<pb::SealSegmentResponse>, Status> {
        Err(unused())
    }
    async fn pending_segments(
        &self,
        _: Request<pb::PendingSegmentsRequest>,
    ) -> Result<Response<pb::PendingSegmentsResponse>, Status> {
        Err(unused())
    }
    async fn confirm_serving(
        &self,
        _: Request<pb::ConfirmServingRequest>,
    ) -> Result<Response<pb::GetMetadataResponse>, Status> {
        Err(unused())
    }
    async fn merge_all(
        &self,
        req: Request<pb::MergeAllRequest>,
    ) -> Result<Response<pb::MergeAllResponse>, Status> {
        let t = self.admit(&req)?;
        let kn = req.into_inner().kn_id;
        self.0.lock().calls.push(format!("merge {kn} {t}"));
        Ok(Response::new(pb::MergeAllResponse::default()))
    }
    async fn fence_kn(
        &self,
        req: Request<pb::FenceKnRequest>,
    ) -> Result<Response<pb::FenceKnResponse>, Status> {
        let t = self.admit(&req)?;
        let kn = req.into_inner().kn_id;
        self.0.lock().calls.push(format!("fence {kn} {t}"));
        Ok(Response::new(pb::FenceKnResponse {}))
    }
    async fn install_indirect_cell(
        &self,
        _: Request<pb::IndirectCellRequest>,
    ) -> Result<Response<pb::IndirectCellResponse>, Status> {
        Err(unused())
    }
    async fn remove_indirect_cell(
        &self,
        _: Request<pb::IndirectCellRequest>,
    ) -> Result<Response<pb::RemoveIndirectCellResponse>, Status> {
        Err(unused())
    }
    async fn put_metadata(
        &self,
        req: Request<pb::PutMetadataRequest>,
    ) -> Result<Response<pb::PutMetadataResponse>, Status> {
        let t = self.admit(&req)?;
        let r = req.into_inner();
        if r.name != dinomo_proto::MONITOR_ENDPOINT_KEY {
            return Err(Status::unimplemented(
                "the cluster map is published with CompareAndPutMetadata only",
            ));
        }
        let value = r.value.unwrap_or_default();
        let mut st = self.0.lock();
        st.calls.push(format!(
            "monitor at {} {t}",
            String::from_utf8_lossy(&value)
        ));
        st.other.insert(r.name, value);
        Ok(Response::new(pb::PutMetadataResponse {}))
    }
    async fn compare_and_put_metadata(
        &self,
        req: Request<pb::CompareAndPutMetadataRequest>,
    ) -> Result<Response<pb::PutMetadataResponse>, Status> {
        let t = self.admit(&req)?;
        let r = req.into_inner();
        let mut st = self.0.lock();
        if r.name != admin::CLUSTER_MAP_KEY {
            if st.other.get(&r.name) != r.expected.as_ref() {
                return Err(Status::failed_precondition("the entry changed; re-read it"));
            }
            match r.value {
                Some(v) => st.other.insert(r.name, v),
                None => st.other.remove(&r.name),
            };
            return Ok(Response::new(pb::PutMetadataResponse {}));
        }
        if st.map != r.expected {
            return Err(Status::failed_precondition("the map changed; re-read it"));
        }
        let v = ClusterMap::decode(r.value.as_deref().unwrap())
            .unwrap()
            .version;
        st.map = r.value;
        st.calls.push(format!("publish v{v} {t}"));
        Ok(Response::new(pb::PutMetadataResponse {}))
    }
    async fn get_metadata(
        &self,
        req: Request<pb::GetMetadataRequest>,
    ) -> Result<Response<pb::GetMetadataResponse>, Status> {
        let name = req.into_inner().name;
        let st = self.0.lock();
        let value = if name == admin::CLUSTER_MAP_KEY {
            st.map.clone()
        } else {
            st.other.get(&name).cloned()
        };
        Ok(Response::new(pb::GetMetadataResponse { value }))
    }
    async fn list_metadata(
        &self,
        _: Request<pb::ListMetadataRequest>,
    ) -> Result<Response<pb::ListMetadataResponse>, Status> {
        Err(unused())
    }
    async fn new_monitor_term(
        &self,
        _: Request<pb::NewMonitorTermRequest>,
    ) -> Result<Response<pb::NewMonitorTermResponse>, Status> {
        let mut st = self.0.lock();
        st.term += 1;
        let term = st.term;
        st.calls.push(format!("term {term}"));
        Ok(Response::new(pb::NewMonitorTermResponse { term }))
    }
    async fn stats(
        &self,
        _: Request<pb::StatsRequest>,
    ) -> Result<Response<pb::StatsResponse>, Status> {
        Err(unused())
    }
}

async fn serve(dpm: FakeDpm) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DpmServiceServer::new(dpm))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    addr.to_string()
}

/// Answers `is_leader` from a script (then "not leader"); runs no KN.
#[derive(Debug)]
struct Scripted(Mutex<VecDeque<bool>>);

impl Scripted {
    fn new(answers: &[bool]) -> Arc<Self> {
        Arc::new(Scripted(Mutex::new(answers.iter().copied().collect())))
    }
}

#[async_trait]
impl Orchestrator for Scripted {
    fn name(&self) -> &'static str {
        "scripted"
    }
    async fn add_kn(&self) -> OrchResult<KnInfo> {
        Err(OrchestratorError::Refused("no KNs here".into()))
    }
    async fn remove_kn(&self, kn: KnId) -> OrchResult<()> {
        Err(OrchestratorError::UnknownKn(kn))
    }
    async fn fail_kn(&self, kn: KnId) -> OrchResult<()> {
        Err(OrchestratorError::UnknownKn(kn))
    }
    async fn failed_kns(&self) -> OrchResult<Vec<KnId>> {
        Ok(Vec::new())
    }
    async fn is_leader(&self) -> OrchResult<bool> {
        Ok(self.0.lock().pop_front().unwrap_or(false))
    }
}

/// A fake DPM holding a two-KN map (version 1), and a monitor on it.
async fn setup(leader: &[bool]) -> (FakeDpm, Arc<Monitor>, ClusterMap) {
    let dpm = FakeDpm::default();
    let addr = serve(dpm.clone()).await;
    let kns = (1..=2)
        .map(|id| KnInfo {
            id,
            // Nothing listens there: the test never asks a KN anything.
            endpoint: format!("127.0.0.1:{}", 9 + id),
        })
        .collect();
    let map = ClusterMap::new(kns, 16, 1).unwrap();
    admin::publish_map(&addr, &map).await.unwrap();
    let mut cfg = MonitorConfig::default();
    cfg.server.dpm = addr;
    let m = Monitor::new(cfg, MonitorOptions::default(), Scripted::new(leader));
    (dpm, m, map)
}

#[tokio::test]
async fn a_leading_monitor_sends_its_term_with_every_step() {
    let (dpm, m, map) = setup(&[true; 16]).await;
    let rec = m
        .recover_failed(2, Instant::now(), "test")
        .await
        .unwrap()
        .expect("KN 2 is in the map");
    assert_eq!(rec.report.to_version, map.version + 1);
    assert_eq!(
        dpm.calls(),
        [
            "publish v1 @-",
            "term 1",
            // KN 1 takes over KN 2's ranges; nothing serves at its endpoint, so it is fenced.
            "fence 1 @1",
            "fence 2 @1",
            "merge 1 @1",
            "merge 2 @1",
            "publish v2 @1"
        ]
    );
    // The term is kept while the monitor leads: the next change takes no new one.
    assert_eq!(m.lead().await.unwrap(), Some(1));
}

#[tokio::test]
async fn a_reconfiguration_that_loses_leadership_aborts_at_the_next_step() {
    // Leader for: the start, the prepare check, the fence-and-merge check; then not.
    let (dpm, m, map) = setup(&[true, true, true]).await;
    let e = m
        .recover_failed(2, Instant::now(), "test")
        .await
        .unwrap_err();
    assert!(
        format!("{e:#}").contains("aborted before its indirect cells step"),
        "{e:#}"
    );
    assert_eq!(
        dpm.calls(),
        [
            "publish v1 @-",
            "term 1",
            "fence 1 @1",
            "fence 2 @1",
            "merge 1 @1",
            "merge 2 @1"
        ],
        "nothing after the lost check"
    );
    assert_eq!(
        admin::published_map(&m.cfg.server.dpm)
            .await
            .unwrap()
            .unwrap()
            .version,
        map.version
    );
    // Not leading any more: the monitor does not act at all.
    assert_eq!(m.lead().await.unwrap(), None);
    assert!(m.recover_failed(2, Instant::now(), "test").await.is_err());
    assert_eq!(dpm.calls().len(), 6);
}

#[tokio::test]
async fn a_monitor_deposed_at_the_dpm_publishes_nothing() {
    // Both believe they lead (e.g. two local monitors on one DPM): the later term wins.
    let (dpm, old, map) = setup(&[true; 16]).await;
    assert_eq!(old.lead().await.unwrap(), Some(1));
    let mut cfg = MonitorConfig::default();
    cfg.server.dpm = old.cfg.server.dpm.clone();
    let new = Monitor::new(cfg, MonitorOptions::default(), Scripted::new(&[true; 16]));
    assert_eq!(new.lead().await.unwrap(), Some(2));

    let e = old
        .recover_failed(2, Instant::now(), "test")
        .await
        .unwrap_err();
    assert!(format!("{e:#}").contains("stale"), "{e:#}");
    assert!(
        !dpm.calls()
            .iter()
            .any(|c| c.ends_with("@1") && c != "term 1"),
        "the deposed monitor changed nothing: {:?}",
        dpm.calls()
    );
    // The new leader reconfigures; the old one, still working from version 1, cannot publish
    // a second version 2 even if it reached the publish step.
    new.recover_failed(2, Instant::now(), "test").await.unwrap();
    let next = map.with_kn_removed(1).unwrap();
    let e = admin::reconfigure_without(&old.cfg.server.dpm, &map, &next, &[1])
        .await
        .unwrap_err();
    assert!(format!("{e}").contains("not version 1"), "{e}");
    assert_eq!(
        admin::published_map(&new.cfg.server.dpm)
            .await
            .unwrap()
            .unwrap()
            .kn_ids()
            .collect::<Vec<_>>(),
        [1]
    );
}

/// The leader publishes where clients reach it, once per term and under that term, so that
/// routing nodes can hand it to clients (issue 12: clients did not report latencies unless
/// told where the monitor was).
#[tokio::test]
async fn a_leading_monitor_publishes_its_address_once_per_term() {
    let (dpm, m, _) = setup(&[true, true, false, true]).await;
    m.advertise("127.0.0.1:7601".parse().unwrap());
    assert_eq!(m.lead().await.unwrap(), Some(1));
    assert_eq!(m.lead().await.unwrap(), Some(1));
    assert_eq!(
        dpm.calls(),
        ["publish v1 @-", "term 1", "monitor at 127.0.0.1:7601 @1"]
    );
    // Leadership lost and taken again: a new term, published again.
    assert_eq!(m.lead().await.unwrap(), None);
    assert_eq!(m.lead().await.unwrap(), Some(2));
    assert_eq!(dpm.calls()[3..], ["term 2", "monitor at 127.0.0.1:7601 @2"]);
    let got = dpm
        .0
        .lock()
        .other
        .get(dinomo_proto::MONITOR_ENDPOINT_KEY)
        .cloned();
    assert_eq!(got.as_deref(), Some(&b"127.0.0.1:7601"[..]));

    // Listening on every address with no server.advertise: nothing to publish.
    let (dpm, m, _) = setup(&[true; 4]).await;
    m.advertise("0.0.0.0:7600".parse().unwrap());
    m.lead().await.unwrap();
    assert_eq!(dpm.calls(), ["publish v1 @-", "term 1"]);
}

/// Decision 0005: SetPolicy is an admin action like AddKn: a standby refuses it (and keeps its
/// policy), while Status stays answerable there.
#[tokio::test]
async fn a_standby_refuses_set_policy_but_answers_status() {
    use dinomo_monitor::service::Service;
    use dinomo_proto::monitor::monitor_service_server::MonitorService;
    use dinomo_proto::monitor::{PolicyRequest, StatusRequest};

    let (dpm, m, map) = setup(&[false; 8]).await;
    let before = m.policy_config();
    let svc = Service::new(m.clone());
    let e = svc
        .set_policy(Request::new(PolicyRequest {
            toml: "min_kns = 3\n".into(),
        }))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains("does not hold the lease"),
        "{}",
        e.message()
    );
    assert_eq!(
        m.policy_config(),
        before,
        "the standby's policy is unchanged"
    );

    let s = svc
        .status(Request::new(StatusRequest {}))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(s.map_version, map.version);
    assert_eq!(dpm.calls(), ["publish v1 @-"], "a standby takes no term");

    // The leader takes it.
    let (_, m, _) = setup(&[true; 8]).await;
    let r = Service::new(m.clone())
        .set_policy(Request::new(PolicyRequest {
            toml: "min_kns = 3\n".into(),
        }))
        .await
        .unwrap();
    assert!(r.into_inner().toml.contains("min_kns = 3"));
    assert_eq!(m.policy_config().min_kns, 3);
}
