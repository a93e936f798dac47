//! The backup's side of replication: a pool that only the primary writes, through a tcp fabric
//! NIC, and the term that fences primaries.
//!
//! A backup runs no merge, no GC, no metadata: its CPU does nothing per write but the NIC task
//! applying the primary's WRITEs (on RDMA that would be the NIC itself). Its pool is a byte
//! mirror of the primary's (same layout, same offsets), so promoting it is opening it as a
//! primary: the recovery that runs after a power failure.
//!
//! Invariants:
//! - The term only grows, and is durable (`<pool>.term`, with the primary instance that took
//!   it) before an attach is answered: a primary of an older term, or of the same term but
//!   another instance, is refused, even after a restart of the backup.
//! - An attach revokes every key of the backup's grant table before anything else, so once it
//!   returns, no WRITE of the previous primary lands any more (the revoke waits for posts in
//!   progress, as for KNs).
//! - Each attach starts from a fresh, zero-filled pool (a new file renamed over the old one, so
//!   a connection of the previous primary still mapping the old file never sees it shrink);
//!   the primary then copies its whole pool, skipping zero chunks.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dinomo_fabric::grants::{GrantTable, WindowRange};
use dinomo_fabric::tcp::TcpNic;
use dinomo_fabric::{AccessKey, DurabilityRequest, PmRegion};

use crate::error::{DpmError, Result};

/// The largest pool a primary may ask a backup to hold (1 TiB).
const MAX_POOL_BYTES: u64 = 1 << 40;

/// A running backup.
#[derive(Debug)]
pub struct Backup {
    pool_path: PathBuf,
    durability: DurabilityRequest,
    fabric_listen: SocketAddr,
    fabric_advertise: String,
    grants: Arc<GrantTable>,
    state: tokio::sync::Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    term: u64,
    /// The primary instance that attached with `term`.
    instance: u64,
    primary: String,
    nic: Option<TcpNic>,
    region: Option<Arc<PmRegion>>,
}

/// What an attach answers: where the primary writes, and with which key.
#[derive(Debug, Clone)]
pub struct Attached {
    pub fabric: String,
    pub key: AccessKey,
}

fn term_path(pool: &Path) -> PathBuf {
    let mut p = pool.as_os_str().to_owned();
    p.push(".term");
    PathBuf::from(p)
}

/// The term a backup of `pool` accepted last (0 if none).
pub fn read_term(pool: &Path) -> Result<u64> {
    read_term_instance(pool).map(|(t, _)| t)
}

/// The term a backup of `pool` accepted last and the primary instance it came from.
fn read_term_instance(pool: &Path) -> Result<(u64, u64)> {
    let bad = |s: &str| DpmError::BadPool {
        path: term_path(pool).display().to_string(),
        detail: format!("holds {s:?}, not \"TERM INSTANCE\""),
    };
    match std::fs::read_to_string(term_path(pool)) {
        Ok(s) => {
            let mut it = s.split_whitespace().map(str::parse::<u64>);
            match (it.next(), it.next()) {
                (Some(Ok(t)), Some(Ok(i))) => Ok((t, i)),
                (Some(Ok(t)), None) => Ok((t, 0)),
                _ => Err(bad(&s)),
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok((0, 0)),
        Err(e) => Err(e.into()),
    }
}

fn write_term(pool: &Path, term: u64, instance: u64) -> Result<()> {
    let path = term_path(pool);
    let tmp = path.with_extension("term.new");
    {
        use std::io::Write as _;
        let mut f = std::fs::File::create(&tmp)?;
        writeln!(f, "{term} {instance}")?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, &path)?;
    if let Some(dir) = path.parent() {
        if let Ok(d) = std::fs::File::open(if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        }) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

impl Backup {
    /// A backup keeping its pool at `pool_path` (created at the first attach) and serving the
    /// primary's WRITEs on `fabric_listen`.
    pub fn new(
        pool_path: PathBuf,
        durability: DurabilityRequest,
        fabric_listen: SocketAddr,
        fabric_advertise: String,
    ) -> Result<Self> {
        let (term, instance) = read_term_instance(&pool_path)?;
        let grants = Arc::new(GrantTable::create(&GrantTable::path_for(&pool_path), 4)?);
        tracing::info!(pool = %pool_path.display(), term, "backup ready: waiting for a primary to attach");
        Ok(Backup {
            pool_path,
            durability,
            fabric_listen,
            fabric_advertise,
            grants,
            state: tokio::sync::Mutex::new(State {
                term,
                instance,
                ..State::default()
            }),
        })
    }

    pub async fn term(&self) -> u64 {
        self.state.lock().await.term
    }

    pub async fn primary(&self) -> String {
        self.state.lock().await.primary.clone()
    }

    /// Becomes the backup of `primary` (instance `instance`) for `term` (see the module doc).
    pub async fn attach(
        &self,
        term: u64,
        instance: u64,
        pool_bytes: u64,
        primary: &str,
    ) -> Result<Attached> {
        let mut st = self.state.lock().await;
        if term < st.term || (term == st.term && instance != st.instance) {
            return Err(DpmError::StaleTerm {
                given: term,
                current: st.term,
            });
        }
        if pool_bytes == 0 || pool_bytes > MAX_POOL_BYTES || !pool_bytes.is_multiple_of(4096) {
            return Err(DpmError::Config(format!(
                "a backup pool of {pool_bytes} bytes: expected a multiple of 4096 up to {MAX_POOL_BYTES}"
            )));
        }
        write_term(&self.pool_path, term, instance)?;
        st.term = term;
        st.instance = instance;
        // The previous primary's WRITEs end here (the revoke waits for posts in progress).
        self.grants.revoke_all()?;
        st.nic = None;
        st.region = None;
        let region = Arc::new(fresh_pool(&self.pool_path, pool_bytes, self.durability)?);
        let key = self
            .grants
            .grant_with_window(&[WindowRange::write(0, pool_bytes)])?;
        let nic = bind_nic(self.fabric_listen, region.clone(), self.grants.clone()).await?;
        let fabric = dinomo_node_common::address::advertise_address(
            "fabric_advertise",
            nic.local_addr(),
            &self.fabric_advertise,
        )
        .map_err(DpmError::Config)?;
        tracing::info!(term, %primary, %fabric, pool_bytes, "attached to a primary: the pool starts over and is copied from it");
        st.primary = primary.to_string();
        st.nic = Some(nic);
        st.region = Some(region);
        Ok(Attached { fabric, key })
    }
}

/// A zero-filled pool of `len` bytes at `path`: a new file renamed over the old one, or the
/// device-DAX device zeroed in place.
fn fresh_pool(path: &Path, len: u64, durability: DurabilityRequest) -> Result<PmRegion> {
    if dinomo_fabric::pm::DaxDevice::probe(path)?.is_some() {
        return Ok(PmRegion::create(path, len, durability)?);
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".new");
    let tmp = PathBuf::from(tmp);
    let region = PmRegion::create(&tmp, len, durability)?;
    std::fs::rename(&tmp, path)?;
    Ok(region)
}

/// Starts the NIC, retrying for a moment while the previous one's listener is being dropped.
async fn bind_nic(
    addr: SocketAddr,
    region: Arc<PmRegion>,
    grants: Arc<GrantTable>,
) -> Result<TcpNic> {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        match TcpNic::start(addr, region.clone(), grants.clone()).await {
            Ok(nic) => return Ok(nic),
            Err(e) if Instant::now() < deadline && addr.port() != 0 => {
                tracing::debug!(error = %e, "fabric NIC port still busy; retrying");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}
