//! A reconfiguration interrupted by its monitor (it lost leadership, or crashed) after KNs
//! were prepared is resolved by the next leader: the moving keys are served again well before
//! the KNs' own prepare bound, and the published map is one of the two maps of the change.
//!
//! Real dpm-node and KV nodes (the `dinomo` binary); the monitors are in this process: the
//! interrupted one is `admin::reconfigure_led` with a [`Leadership`] that says "no" at a given
//! step, the next one a [`Monitor`] whose orchestrator always says "leader".

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dinomo_client::admin::{self, Leadership};
use dinomo_client::{Client, ClientConfig, ClientError};
use dinomo_monitor::config::MonitorConfig;
use dinomo_monitor::orchestrator::{Orchestrator, OrchestratorError, Result as OrchResult};
use dinomo_monitor::{Monitor, MonitorOptions};
use dinomo_placement::{KnId, KnInfo};
use dinomo_proto::dpm::dpm_service_client::DpmServiceClient;
use dinomo_proto::dpm::GetMetadataRequest;

use crate::cluster::Cluster;

/// Leads (no term) until the step named `stop_at`, where it finds it lost leadership.
struct LosesAt(&'static str);

impl Leadership for LosesAt {
    fn term(&self) -> Option<u64> {
        None
    }

    async fn check(&self, step: &'static str) -> dinomo_client::Result<()> {
        if step == self.0 {
            Err(ClientError::Other(format!(
                "test: leadership lost before {step}"
            )))
        } else {
            Ok(())
        }
    }
}

/// Always the leader; runs no KN (the cluster's KNs are the harness's processes).
#[derive(Debug)]
struct AlwaysLeader;

type Fut<'a, T> = Pin<Box<dyn Future<Output = OrchResult<T>> + Send + 'a>>;

// The trait is `#[async_trait]`; this package does not depend on that crate, so its expansion
// is written out.
impl Orchestrator for AlwaysLeader {
    fn name(&self) -> &'static str {
        "test"
    }
    fn add_kn<'life0, 'async_trait>(&'life0 self) -> Fut<'async_trait, KnInfo>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(async { Err(OrchestratorError::Refused("no KNs here".into())) })
    }
    fn remove_kn<'life0, 'async_trait>(&'life0 self, kn: KnId) -> Fut<'async_trait, ()>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(async move { Err(OrchestratorError::UnknownKn(kn)) })
    }
    fn fail_kn<'life0, 'async_trait>(&'life0 self, kn: KnId) -> Fut<'async_trait, ()>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(async move { Err(OrchestratorError::UnknownKn(kn)) })
    }
    fn failed_kns<'life0, 'async_trait>(&'life0 self) -> Fut<'async_trait, Vec<KnId>>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(async { Ok(Vec::new()) })
    }
}

const KEYS: usize = 64;

fn key(i: usize) -> String {
    format!("resume-key-{i}")
}

async fn client(c: &Cluster, deadline: Duration) -> Client {
    let mut cfg = ClientConfig::new(&[&c.routing.addr]);
    cfg.deadline = deadline;
    Client::connect_with(cfg).await.unwrap()
}

/// Interrupts a move of KN 1's keys to KN 0 at `step`, then starts a new leader and checks
/// that every key is served again (with its value) within `within`. Returns the published
/// map's version and the version the change started from.
async fn interrupted_then_resolved(step: &'static str) -> (Cluster, u64, u64) {
    let c = Cluster::start(2).await;
    let cl = client(&c, Duration::from_secs(20)).await;
    for i in 0..KEYS {
        cl.put(key(i), format!("v{i}")).await.unwrap();
    }
    let cur = c.map().await;
    let next = cur.with_kn_removed(1).unwrap();
    let e = admin::reconfigure_led(&c.dpm.addr, &cur, &next, &[], &LosesAt(step))
        .await
        .unwrap_err();
    assert!(format!("{e}").contains("leadership lost"), "{e}");

    // The keys that move are paused now (the monitor that paused them is gone).
    let quick = client(&c, Duration::from_millis(300)).await;
    let mut paused = 0;
    for i in 0..KEYS {
        if quick.get(key(i)).await.is_err() {
            paused += 1;
        }
    }
    assert!(paused > 0, "no key was paused by the interrupted change");

    // The next leader.
    let mut cfg = MonitorConfig::default();
    cfg.server.dpm = c.dpm.addr.clone();
    let m = Monitor::new(cfg, MonitorOptions::default(), Arc::new(AlwaysLeader));
    m.spawn_loops();
    // Well below the KNs' own bound on a prepared state (kv-node `prepare_timeout_ms`): it is
    // the leader that resumes the change, not the KNs timing out.
    let within = Duration::from_millis(2500);
    let start = Instant::now();
    let check = client(&c, within).await;
    for i in 0..KEYS {
        match check.get(key(i)).await {
            Ok(Some(v)) => assert_eq!(v.as_ref(), format!("v{i}").as_bytes()),
            other => panic!(
                "key {i} not served {:?} after the new leader started: {other:?}",
                start.elapsed()
            ),
        }
    }
    let published = c.map().await;
    assert!(
        published.encode() == cur.encode() || published.encode() == next.encode(),
        "published map version {} is neither the change's start nor its end",
        published.version
    );
    // The record of the unfinished change is gone.
    let mut d = DpmServiceClient::connect(format!("http://{}", c.dpm.addr))
        .await
        .unwrap();
    let intent = d
        .get_metadata(GetMetadataRequest {
            name: "cluster/reconfiguration".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .value;
    assert!(intent.is_none(), "the intent record is still there");
    drop(m);
    (c, published.version, cur.version)
}

/// Interrupted between its prepare and its fences and merges: nothing irreversible happened,
/// so the change is rolled back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn change_interrupted_after_prepare_is_resolved_by_the_next_leader() {
    let (_c, published, from) = interrupted_then_resolved("fence and merge").await;
    // Rolled back (admin::resolve_unfinished): exact, since nothing at the DPM changed.
    assert_eq!(published, from, "the change was not rolled back");
}

/// Interrupted after its merges, before the publish: the next leader must finish it (cells may
/// already have changed), so the published map is the change's end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn change_interrupted_before_publish_is_finished_by_the_next_leader() {
    let (_c, published, from) = interrupted_then_resolved("publish").await;
    assert_eq!(published, from + 1, "the change was not finished");
}
