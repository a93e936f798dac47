//! Runs a whole dpm-node: opens the DPM, starts the fabric NIC (the tcp NIC, or the verbs NIC
//! in a build with the `rdma` feature; none for shm), the gRPC service and the metrics
//! endpoint, and stops cleanly on a shutdown signal.
//!
//! The node owns its NIC ([`Nic`]). A verbs NIC is also installed as the DPM's key fence
//! ([`Dpm::set_key_fence`]) for as long as it runs: revoking a key in the grant table does not
//! stop RDMA operations under a memory region already registered for it, so FenceKn, a KN's
//! re-registration and SealSegment must go through `VerbsNic`'s revoke and close_window
//! (fabric/src/verbs/mod.rs, "Fencing" and "Write windows").

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dinomo_fabric::tcp::TcpNic;
#[cfg(feature = "rdma")]
use dinomo_fabric::verbs::VerbsNic;
use dinomo_proto::dpm::dpm_service_server::DpmServiceServer;
use dinomo_proto::dpm::replica_service_server::ReplicaServiceServer;

use crate::config::{DpmConfig, FabricKind, ReplicaRole};
use crate::dpm::Dpm;
use crate::error::{DpmError, Result};
use crate::pool_lock::PoolLock;
use crate::replication::backup::Promotion;
use crate::replication::role_file::{read_role, role_path, RecordedRole};
use crate::replication::{Backup, Primary, ReplicaGrpc, ReplicatorOptions};
use crate::service::DpmGrpc;
use dinomo_node_common::health::Health;

/// A running node's addresses (ports resolved when the config asked for port 0).
#[derive(Debug, Clone)]
pub struct Running {
    pub grpc: SocketAddr,
    /// Where KNs reach the fabric this node serves.
    pub fabric: FabricEndpoint,
}

/// The fabric a node serves, as KNs are told to reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FabricEndpoint {
    /// KNs map the pool file at this path themselves; no NIC runs.
    Shm(PathBuf),
    /// The address of the tcp fabric NIC.
    Tcp(SocketAddr),
    /// The address of the verbs NIC's side channel (the RDMA connection handshake).
    Verbs(SocketAddr),
}

impl FabricEndpoint {
    /// The NIC's address, if this node serves the tcp fabric.
    pub fn tcp(&self) -> Option<SocketAddr> {
        match self {
            FabricEndpoint::Tcp(a) => Some(*a),
            FabricEndpoint::Shm(_) | FabricEndpoint::Verbs(_) => None,
        }
    }

    /// The address KNs connect to (tcp NIC or verbs side channel); none for shm.
    pub fn nic(&self) -> Option<SocketAddr> {
        match self {
            FabricEndpoint::Tcp(a) | FabricEndpoint::Verbs(a) => Some(*a),
            FabricEndpoint::Shm(_) => None,
        }
    }
}

/// `shm:<pool path>`, the tcp NIC's `host:port` or `verbs:<host:port>` (what the READY line
/// prints after `fabric=`).
impl fmt::Display for FabricEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FabricEndpoint::Shm(p) => write!(f, "shm:{}", p.display()),
            FabricEndpoint::Tcp(a) => write!(f, "{a}"),
            FabricEndpoint::Verbs(a) => write!(f, "verbs:{a}"),
        }
    }
}

/// The fabric NIC a node runs for its KNs.
#[derive(Debug, Clone)]
pub enum Nic {
    /// shm: KNs map the pool; nothing listens.
    None,
    Tcp(Arc<TcpNic>),
    #[cfg(feature = "rdma")]
    Verbs(Arc<VerbsNic>),
}

impl Nic {
    /// Starts the NIC `dpm.config.fabric` asks for, and says where KNs reach it.
    pub async fn start(dpm: &Arc<Dpm>) -> Result<(Nic, FabricEndpoint)> {
        match dpm.config.fabric {
            // With shm, KNs map the pool and a listening NIC would be an unused door into it.
            FabricKind::Shm => {
                let pool = dpm.config.pool_path.canonicalize()?;
                tracing::info!(pool = %pool.display(), "fabric: shm (KNs map the pool); no NIC is started");
                Ok((Nic::None, FabricEndpoint::Shm(pool)))
            }
            FabricKind::Tcp => {
                let nic = TcpNic::start(
                    dpm.config.fabric_listen,
                    dpm.pool().region().clone(),
                    dpm.grants().clone(),
                )
                .await?;
                tracing::info!(nic = %nic.local_addr(), "fabric: tcp (the NIC serves the pool)");
                let addr = nic.local_addr();
                Ok((Nic::Tcp(Arc::new(nic)), FabricEndpoint::Tcp(addr)))
            }
            FabricKind::Verbs => Self::start_verbs(dpm).await,
        }
    }

    #[cfg(feature = "rdma")]
    async fn start_verbs(dpm: &Arc<Dpm>) -> Result<(Nic, FabricEndpoint)> {
        let region = dpm.pool().region().clone();
        // The kernel refuses long-term pins of fsdax pages: every KN's connection would fail
        // to register the pool (docs/decisions/0001-rdma-binding.md). Say so now, once.
        if matches!(region.durability(), dinomo_fabric::Durability::Dax(_))
            && dinomo_fabric::pm::DaxDevice::probe(region.path())?.is_none()
        {
            return Err(DpmError::Config(format!(
                "fabric = \"verbs\" cannot serve {}: it is a file on a DAX filesystem, whose \
                 pages the kernel does not let RDMA register; put the pool on a device-DAX \
                 device (/dev/daxX.Y) for persistent memory, or on a non-DAX filesystem",
                region.path().display()
            )));
        }
        // Every KN connection registers the pool again: a process that may not pin that
        // would start and then fail each KN's registration with ENOMEM.
        let capacity = crate::verbs_pins::check_this_process(dpm.pool().superblock())
            .map_err(|e| DpmError::Config(format!("fabric = \"verbs\": {e}")))?;
        crate::verbs_pins::log_capacity("this process", capacity);
        // From Linux 6.5 on the kernel refuses RDMA's long-term pins of file pages that it
        // tracks dirty (a pool file on an ordinary disk filesystem): every KN's write window
        // would fail to register. The kernel decides per mapping, and the pool is one: its
        // first page (the superblock), registered for writes as a window is, finds that now.
        let checked = {
            let (device, region) = (dpm.config.rdma_device.clone(), region.clone());
            let page = dinomo_layout::superblock::SUPERBLOCK_SIZE;
            tokio::task::spawn_blocking(move || {
                dinomo_fabric::verbs::check_registration(device.as_deref(), &region, page)
            })
            .await
            .map_err(|e| DpmError::Io(std::io::Error::other(e)))?
        };
        if let Err(e) = checked {
            // EFAULT is that refusal; any other error says what it is by itself.
            let hint = match e.to_string().contains("(os error 14)") {
                true => {
                    ". Linux 6.5 and later do not let RDMA pin, for writing, the pages of a \
                     file on an ordinary disk filesystem (ext4 or xfs without DAX); put the \
                     pool on a device-DAX device (/dev/daxX.Y) for persistent memory, or on \
                     tmpfs (which does not survive a reboot)"
                }
                false => "",
            };
            return Err(DpmError::Config(format!(
                "fabric = \"verbs\" cannot serve {}: {e}{hint}",
                region.path().display()
            )));
        }
        let nic = VerbsNic::start_on(
            dpm.config.rdma_device.as_deref(),
            dpm.config.fabric_listen,
            region,
            dpm.grants().clone(),
        )
        .await?;
        let addr = nic.local_addr();
        tracing::info!(side_channel = %addr, device = nic.device(), "fabric: verbs (one-sided RDMA; KNs connect through the side channel)");
        let nic = Arc::new(nic);
        // From now on a revoked KN key also loses its memory regions at the device.
        dpm.set_key_fence(Some(nic.clone()));
        Ok((Nic::Verbs(nic), FabricEndpoint::Verbs(addr)))
    }

    #[cfg(not(feature = "rdma"))]
    async fn start_verbs(_dpm: &Arc<Dpm>) -> Result<(Nic, FabricEndpoint)> {
        Err(DpmError::Config(
            "fabric = \"verbs\": this binary was built without the `rdma` cargo feature".into(),
        ))
    }

    /// Uninstalls the NIC from `dpm` (before it is dropped).
    fn detach(&self, dpm: &Dpm) {
        #[cfg(feature = "rdma")]
        if let Nic::Verbs(_) = self {
            dpm.set_key_fence(None);
        }
        #[cfg(not(feature = "rdma"))]
        let _ = dpm;
    }
}

/// Serves until `shutdown` completes. `ready` is called once every listener is bound.
///
/// A backup that is promoted (`ReplicaService.Promote`) stops serving as a backup and serves
/// on as the primary, on the same pool and at the same addresses, in this same call. A role
/// recorded beside the pool at run time (`<pool>.role`: promoted, or deposed) wins over
/// `config.role`.
pub async fn run(
    mut config: DpmConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
    ready: impl FnOnce(&Running) + Send,
) -> Result<()> {
    // While it serves, no other process serves the pool: held until this function returns
    // and the last user of the pool (the DPM, the backup's state: work still running past
    // the server's stop) is gone.
    let lock = Arc::new(PoolLock::acquire(&config.pool_path)?);
    tracing::debug!(lock = %lock.path().display(), "holding the pool's lock");
    // The backup's server and then, if promoted, the primary's wait for the same signal.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let stop_now = stop_rx.clone();
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            // An error: the signal's task is gone (the runtime stops): stop too.
            let _ = rx.wait_for(|stop| *stop).await;
        }
    };
    // A role taken at run time before this start (promoted, or deposed) wins over the command
    // line: a restarted process comes back in the role it last had.
    let recorded = read_role(&config.pool_path)?;
    let file = role_path(&config.pool_path);
    match (&recorded, config.role) {
        (Some(RecordedRole::Primary { backups }), ReplicaRole::Backup) => {
            let promotion = Promotion {
                backups: backups.clone(),
                fabric: None,
            };
            let listen = config.listen;
            promotion.apply(&mut config, listen);
            tracing::warn!(file = %file.display(), backups = ?config.backups, "this backup was promoted before: starting as the primary on its pool (delete the file to let the command line decide)");
        }
        (Some(RecordedRole::Backup), ReplicaRole::Primary) => {
            config.role = ReplicaRole::Backup;
            tracing::warn!(file = %file.display(), "this primary was deposed before: starting as a backup on its pool, for the newer primary to attach (delete the file to let the command line decide)");
        }
        _ => {}
    }
    // One health reporter for the process: the plain-text probe listener (`--health-addr`)
    // follows the backup and then, if promoted, the primary.
    let (health, _) = dinomo_node_common::health::Health::new().await;
    if config.role == ReplicaRole::Backup {
        let Some((promotion, grpc)) = run_backup(
            config.clone(),
            lock.clone(),
            health.clone(),
            stopped(),
            ready,
        )
        .await?
        else {
            return Ok(());
        };
        health.set(false).await;
        if *stop_now.borrow() {
            tracing::info!("stopping as the promotion completes: the next start is the primary's (its role is recorded)");
            return Ok(());
        }
        promotion.apply(&mut config, grpc);
        tracing::warn!(grpc = %config.listen, fabric = %config.fabric_listen, backups = ?config.backups, "promoted: serving as the primary on this backup's pool from now on");
        return run_primary(config, lock, health, stopped(), |r: &Running| {
            tracing::info!(grpc = %r.grpc, fabric = %r.fabric, "the promoted primary serves");
        })
        .await;
    }
    run_primary(config, lock, health, stopped(), ready).await
}

/// Serves as the primary (or the only dpm-node) until `shutdown` completes.
async fn run_primary(
    config: DpmConfig,
    lock: Arc<PoolLock>,
    health: Health,
    shutdown: impl Future<Output = ()> + Send + 'static,
    ready: impl FnOnce(&Running) + Send,
) -> Result<()> {
    let dpm = tokio::task::spawn_blocking(move || Dpm::open(config))
        .await
        .map_err(|e| DpmError::Config(format!("opening the DPM panicked: {e}")))??;
    dpm.hold_pool_lock(lock);
    let (nic, fabric) = Nic::start(&dpm).await?;
    // The NIC is detached from the DPM however this function returns.
    struct Detach<'a>(&'a Nic, &'a Dpm);
    impl Drop for Detach<'_> {
        fn drop(&mut self) {
            self.0.detach(self.1);
        }
    }
    let detach = Detach(&nic, &dpm);
    let fabric_address = match &fabric {
        FabricEndpoint::Shm(pool) => pool.display().to_string(),
        FabricEndpoint::Tcp(addr) | FabricEndpoint::Verbs(addr) => {
            dinomo_node_common::address::advertise_address(
                "fabric_advertise",
                *addr,
                &dpm.config.fabric_advertise,
            )
            .map_err(DpmError::Config)?
        }
    };
    tracing::info!(fabric = %fabric_address, "KNs are told to reach the fabric here");
    let listener = tokio::net::TcpListener::bind(dpm.config.listen)
        .await
        .map_err(|e| DpmError::Config(format!("cannot listen on {}: {e}", dpm.config.listen)))?;
    let running = Running {
        grpc: listener.local_addr()?,
        fabric,
    };
    let replica = start_replication(&dpm, running.grpc).await?;
    tracing::info!(grpc = %running.grpc, fabric = %running.fabric, kind = ?dpm.config.fabric, "dpm-node serving");
    ready(&running);

    let gauges = tokio::spawn(export_gauges(dpm.clone(), nic.clone()));
    let svc = DpmServiceServer::new(DpmGrpc::new(dpm.clone(), dpm.config.fabric, fabric_address))
        .max_decoding_message_size(16 << 20);
    // Graceful shutdown waits for open connections; clients that keep theirs open get a short
    // grace period, then the server stops anyway.
    // The pool is open and every listener bound: the node can do its job from now on.
    let health_service = health.service();
    health.set(true).await;
    let deposed_by = replica.clone();
    let shutdown = health.on_shutdown(async move {
        // Another primary took over: stop (nothing is acknowledged any more anyway).
        let deposed = async {
            match &deposed_by {
                ReplicaGrpc::Primary(p) => {
                    let why = p.deposed().await;
                    tracing::error!(reason = %why, "stopping: deposed");
                }
                _ => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = shutdown => {}
            _ = deposed => {}
        }
    });
    let (stopping_tx, stopping_rx) = tokio::sync::oneshot::channel::<()>();
    let signal = async move {
        shutdown.await;
        let _ = stopping_tx.send(());
    };
    let security = &dpm.config.security;
    security.warn_if_insecure("dpm-node", running.grpc);
    let serve = security
        .server_builder()
        .map_err(|e| DpmError::Config(format!("TLS: {e}")))?
        .add_service(health_service)
        .add_service(svc)
        .add_service(ReplicaServiceServer::new(replica.clone()))
        .serve_with_incoming_shutdown(dinomo_proto::nodelay_incoming(listener), signal);
    let served = with_grace(serve, stopping_rx).await;
    gauges.abort();
    let _ = gauges.await; // releases its handle on the NIC
    drop(detach);
    drop(nic);
    if let ReplicaGrpc::Primary(p) = &replica {
        p.shutdown();
    }
    let d = dpm.clone();
    tokio::task::spawn_blocking(move || d.shutdown()).await.ok();
    served.map_err(|e| DpmError::Config(format!("gRPC server failed: {e}")))?;
    tracing::info!("dpm-node stopped");
    Ok(())
}

/// Starts replication when the config names backups: takes the next replica term, then
/// attaches each backup in the background ([`Primary::attach_named`]: retrying every second
/// while it cannot be reached; nothing is acknowledged before one has accepted the term).
async fn start_replication(dpm: &Arc<Dpm>, grpc: SocketAddr) -> Result<ReplicaGrpc> {
    if dpm.config.backups.is_empty() {
        return Ok(ReplicaGrpc::Standalone);
    }
    let address = dinomo_node_common::address::advertise_address("listen", grpc, "")
        .map_err(DpmError::Config)?;
    let opts = ReplicatorOptions {
        ack_timeout: dpm.config.replica_ack_timeout,
    };
    if dpm.config.fabric != FabricKind::Tcp {
        // KNs store into the pool themselves: they forward their writes (ForwardWrites),
        // merges ship what they index first, and GC passes ship the indirect cells
        // (docs/decisions/0007, "One-sided fabrics").
        dpm.merger().forward(tokio::runtime::Handle::current());
        dpm.gc().forward(tokio::runtime::Handle::current());
    }
    let (d, security) = (dpm.clone(), dpm.config.security.clone());
    let primary = tokio::task::spawn_blocking(move || Primary::start(d, address, security, opts))
        .await
        .map_err(|e| DpmError::Config(format!("starting replication panicked: {e}")))??;
    tracing::info!(term = primary.term(), backups = ?dpm.config.backups, "replication on: attaching the backups");
    for backup in dpm.config.backups.clone() {
        primary.attach_named(backup);
    }
    Ok(ReplicaGrpc::Primary(primary))
}

/// Runs a backup (see [`crate::replication::backup`]): the ReplicaService and health on the
/// gRPC port; the fabric NIC starts when a primary attaches. Returns when `shutdown`
/// completes (`None`) or once promoted: the promotion and the gRPC address it served on.
async fn run_backup(
    config: DpmConfig,
    lock: Arc<PoolLock>,
    health: Health,
    shutdown: impl Future<Output = ()> + Send + 'static,
    ready: impl FnOnce(&Running) + Send,
) -> Result<Option<(Promotion, SocketAddr)>> {
    let verbs = config.fabric == FabricKind::Verbs;
    let backup = Arc::new(
        Backup::new(
            config.pool_path.clone(),
            config.durability,
            config.fabric_listen,
            config.fabric_advertise.clone(),
        )?
        .serving_verbs_once_promoted(verbs),
    );
    if verbs {
        check_backup_can_serve_verbs(&config)?;
    }
    backup.hold_pool_lock(lock).await;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| DpmError::Config(format!("cannot listen on {}: {e}", config.listen)))?;
    let running = Running {
        grpc: listener.local_addr()?,
        fabric: FabricEndpoint::Tcp(config.fabric_listen),
    };
    tracing::info!(grpc = %running.grpc, "dpm-node serving as a backup");
    ready(&running);
    let health_service = health.service();
    health.set(true).await;
    let mut promoted = backup.promotion();
    // Only a real shutdown is "stopping" for the health status: a promotion goes on serving.
    let shutdown = health.on_shutdown(shutdown);
    let shutdown = async move {
        tokio::select! {
            _ = shutdown => {}
            _ = promoted.wait_for(Option::is_some) => {}
        }
    };
    // As the primary's: callers that keep their connections open (the old primary's) get a
    // short grace period, then the server stops anyway.
    let (stopping_tx, stopping_rx) = tokio::sync::oneshot::channel::<()>();
    let signal = async move {
        shutdown.await;
        let _ = stopping_tx.send(());
    };
    let security = &config.security;
    security.warn_if_insecure("dpm-node (backup)", running.grpc);
    let serve = security
        .server_builder()
        .map_err(|e| DpmError::Config(format!("TLS: {e}")))?
        .add_service(health_service)
        .add_service(ReplicaServiceServer::new(ReplicaGrpc::Backup(
            backup.clone(),
        )))
        .serve_with_incoming_shutdown(dinomo_proto::nodelay_incoming(listener), signal);
    let served = with_grace(serve, stopping_rx).await;
    served.map_err(|e| DpmError::Config(format!("gRPC server failed: {e}")))?;
    let promotion = backup.promotion().borrow().clone();
    match promotion {
        Some(p) => Ok(Some((p, running.grpc))),
        None => {
            tracing::info!("backup stopped");
            Ok(None)
        }
    }
}

/// A backup configured for verbs serves verbs once promoted (see
/// [`crate::replication::backup::fabric_once_promoted`]), on the pool file it creates beside
/// its pool path when a primary attaches. What would stop that whatever the pool's size (no
/// RDMA device, a kernel that does not let RDMA pin that filesystem's file pages, a durability
/// that filesystem cannot give) is found now, at the backup's start, by a 4 KiB probe file
/// beside the pool mapped as the pool will be and registered as the NIC will, instead of at
/// the failover. A locked-memory limit below what the pool needs is not (the probe is one
/// page): the backup learns the pool when a copy of it completes, warns then and refuses a
/// Promote ([`Backup::serving_verbs_once_promoted`]).
fn check_backup_can_serve_verbs(config: &DpmConfig) -> Result<()> {
    let mut probe = config.pool_path.as_os_str().to_owned();
    probe.push(".verbs-probe");
    let probe = PathBuf::from(probe);
    let refused = |why: String| {
        DpmError::Config(format!(
            "fabric = \"verbs\" on a backup: {why}, so it could not serve its KNs once \
             promoted; fix that, or run the backup with fabric = \"tcp\""
        ))
    };
    // A probe left by a crash (possibly another user's) is not this start's business.
    let _ = std::fs::remove_file(&probe);
    let region = dinomo_fabric::pm::PmRegion::create(&probe, 4096, config.durability);
    let checked = region
        .map_err(|e| {
            refused(format!(
                "a probe file beside its pool ({}) cannot be created and mapped with the \
                 configured durability: {e}",
                probe.display()
            ))
        })
        .and_then(|region| {
            if matches!(region.durability(), dinomo_fabric::Durability::Dax(_)) {
                return Err(refused(format!(
                    "its pool {} would be a file on a DAX filesystem, whose pages the kernel \
                     does not let RDMA register; put the backup's pool on a filesystem \
                     without DAX (tmpfs always works)",
                    config.pool_path.display()
                )));
            }
            registrable(config, Arc::new(region)).map_err(refused)
        });
    let _ = std::fs::remove_file(&probe);
    checked
}

#[cfg(feature = "rdma")]
fn registrable(
    config: &DpmConfig,
    region: Arc<dinomo_fabric::PmRegion>,
) -> std::result::Result<(), String> {
    let whole = region.len();
    let device =
        dinomo_fabric::verbs::check_registration(config.rdma_device.as_deref(), &region, whole)
            .map_err(|e| format!("{e}"))?;
    tracing::info!(device, "checked: this backup's RDMA device registers pool files beside its pool (it serves verbs once promoted)");
    Ok(())
}

/// Without `rdma` the config refuses verbs before this runs.
#[cfg(not(feature = "rdma"))]
fn registrable(
    _config: &DpmConfig,
    _region: Arc<dinomo_fabric::PmRegion>,
) -> std::result::Result<(), String> {
    Err("this binary was built without the `rdma` cargo feature".into())
}

/// Runs `serve` (a gRPC server with graceful shutdown) until it ends, or until
/// [`SHUTDOWN_GRACE`] after `stopping` fired: clients that keep their connections open (KNs, a
/// primary's calls to its backup) do not hold the stop.
async fn with_grace<E>(
    serve: impl Future<Output = std::result::Result<(), E>>,
    stopping: tokio::sync::oneshot::Receiver<()>,
) -> std::result::Result<(), E> {
    tokio::select! {
        r = serve => r,
        _ = async {
            let _ = stopping.await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        } => {
            tracing::info!("connections still open after the grace period; stopping anyway");
            Ok(())
        }
    }
}

/// How long a stopping server waits for open connections (see [`with_grace`]).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

async fn export_gauges(dpm: Arc<Dpm>, nic: Nic) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        if let Nic::Tcp(n) = &nic {
            metrics::counter!("dinomo_fabric_tcp_bad_frames_total").absolute(n.bad_frames());
            metrics::counter!("dinomo_fabric_tcp_denied_total").absolute(n.denied());
        }
        let s = dpm.stats();
        metrics::gauge!("dinomo_dpm_segments_total").set(s.segments_total as f64);
        metrics::gauge!("dinomo_dpm_segments_free").set(s.segments_free as f64);
        metrics::gauge!("dinomo_dpm_index_items").set(s.index_items as f64);
        metrics::gauge!("dinomo_dpm_index_buckets").set(s.index_buckets as f64);
        metrics::gauge!("dinomo_dpm_index_bytes").set(s.index_space.bytes as f64);
        metrics::gauge!("dinomo_dpm_live_log_bytes").set(s.live_log_bytes as f64);
        metrics::gauge!("dinomo_dpm_segments_reserved").set(s.segments_reserved as f64);
        metrics::gauge!("dinomo_dpm_pending_segments")
            .set(s.pending_segments.values().sum::<u64>() as f64);
    }
}
