//! The DPM as a library: opens (or formats) the pool, rebuilds DRAM state, runs the merge
//! workers and the garbage collector, and offers the control operations the gRPC service
//! exposes. It never serves client requests; KNs reach the pool with one-sided operations.
//!
//! KN identity and fencing: each registration of a KN id gets a new epoch (from a persistent
//! counter) and a fresh fabric grant; the previous incarnation's grant is revoked and its epoch
//! refused from then on. The fence table lives in the pool's roots, so a restarted DPM still
//! refuses a fenced KN. Every revocation, and every window range closed (SealSegment), goes
//! through the DPM's [`KeyFence`]: the grant table (enough for shm and tcp), or the verbs NIC
//! the server installs with [`Dpm::set_key_fence`] (a grant-table change alone does not stop
//! RDMA operations under a registered MR).
//!
//! Write windows: a KN's grant may write only its open log segments (and CAS the indirect-cell
//! space, opened at registration). [`Dpm::allocate_segment`] opens the segment in the window
//! before it answers; [`Dpm::seal_segment`] closes it before marking the segment sealed, and
//! fencing (FenceKn, MergeAll with `seal_open`, a new registration) revokes the key, which
//! empties the window, before sealing. Closing and revoking hold the grant slot exclusively,
//! so every fabric WRITE checked against the old window is in place before the segment is
//! sealed and merged (see the fabric's grants.rs for shm, where a late WRITE fails instead).
//!
//! Monitors are fenced the same way, by term: [`Dpm::new_monitor_term`] starts a newer term
//! and [`Dpm::with_monitor_term`] refuses an older one, so a deposed monitor can no longer
//! fence, merge, change cells or publish; the cluster map is published by compare-and-swap
//! ([`Dpm::compare_and_put_metadata`]). Both live in the metadata store.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dinomo_fabric::grants::{GrantTable, KeyFence, WindowRange};
use dinomo_fabric::AccessKey;
use dinomo_layout::index::{EntryPtr, IndexArea, CELL_SIZE};
use dinomo_layout::log::{decode_entry, LogOp};
use dinomo_layout::meta::Roots;
use dinomo_layout::segment::SegState;
use dinomo_placement::ClusterMap;
use parking_lot::Mutex;

use crate::cells::Cells;
use crate::config::{DpmConfig, FabricKind};
use crate::error::{DpmError, Result};
use crate::fenced_procs::{FencedProcs, ProcessRef};
use crate::gc::Gc;
use crate::index::{Index, IndexSpace};
use crate::limits;
use crate::merge::{MergeMode, MergeReport, Merger};
use crate::metastore::MetaStore;
use crate::pool::Pool;
use crate::replication::image::ImageId;
use crate::segments::{LogId, SegmentGrant, Segments, Tier, CLEANER_KN};

/// The cluster map's name in the metadata (KNs, routing nodes and monitors read it there).
pub const CLUSTER_MAP_KEY: &str = "cluster/map";

/// Where the pool's replica term is kept (written only by [`Dpm::next_replica_term`]).
const REPLICA_TERM_KEY: &str = "dpm/replica-term";

/// The term and primary instance taken at the last start (16 bytes, little-endian words).
const REPLICA_TAKEN_KEY: &str = "dpm/replica-taken";

/// The identity of this pool's image ([`ImageId`]: the replica term under which it last served
/// as a primary's, the start that took it, the replica set's generation): written by
/// [`Dpm::record_replica_image`] once a backup accepted the term (only from then on may the
/// primary acknowledge anything) and whenever a counted backup leaves the set, and copied to
/// the backups with the rest of the pool. (The key's name is older than the instance and the
/// generation: an 8-byte value is a term alone.)
const REPLICA_IMAGE_TERM_KEY: &str = "dpm/replica-image-term";

/// Where the map a KN was fenced under is kept (see [`Dpm::confirm_serving`]).
fn fenced_under_key(kn: u32) -> String {
    format!("dpm/fenced-under/{kn}")
}

/// Longest a KN's segment allocation waits for merges that would make room. Short: the KN's
/// shard waits meanwhile, and a reconfiguration gives a KN 5 s to prepare.
const ALLOCATION_WAIT: Duration = Duration::from_secs(2);

/// What a KN learns when it registers.
#[derive(Debug, Clone)]
pub struct Registration {
    pub kn_id: u32,
    pub epoch: u64,
    pub key: AccessKey,
    pub pool_len: u64,
    pub segment_size: u64,
    /// Pool offset of the root word holding the current index table header's offset.
    pub index_root: u64,
}

/// A value read through the index (tests and tools).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub ptr: EntryPtr,
    pub version: u64,
    pub value: Vec<u8>,
}

/// Counters for the Stats RPC and /metrics.
#[derive(Debug, Clone, Default)]
pub struct DpmStats {
    pub segments_total: u64,
    pub segments_free: u64,
    pub index_items: u64,
    pub index_buckets: u64,
    pub index_resizes: u64,
    pub index_space: IndexSpace,
    /// Free segments kept back for the cleaner, index growth and deletes.
    pub segments_reserved: u64,
    /// Bytes of log entries the index points at (headers included).
    pub live_log_bytes: u64,
    pub entries_merged: u64,
    pub pending_segments: HashMap<u32, u64>,
}

/// Metadata records of the shm KN processes that registered (see [`FencedProcs`]).
const KN_PROC_PREFIX: &str = "dpm/kn-proc/";

fn kn_proc_key(kn: u32, p: ProcessRef) -> String {
    format!("{KN_PROC_PREFIX}{kn}/{}", p.encode())
}

fn parse_kn_proc_key(name: &str) -> Option<(u32, ProcessRef)> {
    let (kn, p) = name.strip_prefix(KN_PROC_PREFIX)?.split_once('/')?;
    Some((kn.parse().ok()?, ProcessRef::decode(p)?))
}

#[derive(Debug)]
struct KnSession {
    epoch: u64,
    key: AccessKey,
    /// The KN's process, watched once it is fenced (shm only, see [`FencedProcs`]).
    process: Option<ProcessRef>,
}

#[derive(Debug)]
pub struct Dpm {
    pub config: DpmConfig,
    pool: Arc<Pool>,
    index: Arc<Index>,
    segments: Arc<Segments>,
    merger: Arc<Merger>,
    gc: Arc<Gc>,
    cells: Arc<Cells>,
    meta: MetaStore,
    grants: Arc<GrantTable>,
    /// How keys are revoked: the grant table, or the fabric NIC that needs more (verbs).
    key_fence: parking_lot::RwLock<Arc<dyn KeyFence>>,
    /// Held across a registration's or a MergeAll's whole merge (see [`Dpm::merge_all`]), which
    /// with backups on a one-sided fabric waits for them: never take it on a runtime worker.
    sessions: Mutex<HashMap<u32, KnSession>>,
    /// Each registered KN's session epoch, as in `sessions` (changed only with it held), for
    /// checks on the request path ([`Dpm::check_session`]): this lock is never held across
    /// anything that waits, so a ForwardWrites handler on a runtime worker never stalls
    /// behind a merge.
    granted: parking_lot::RwLock<HashMap<u32, u64>>,
    /// Fenced shm KN processes that may still write (their segments are not reused).
    fenced_procs: Arc<FencedProcs>,
    stop: Arc<AtomicBool>,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// The process's lock of the pool ([`crate::pool_lock`]), when a server runs it: released
    /// with the last holder of this DPM (a handler still running past the server's stop).
    pool_lock: std::sync::OnceLock<Arc<crate::pool_lock::PoolLock>>,
}

impl Dpm {
    /// Keeps `lock` until this DPM is dropped (see the field).
    pub fn hold_pool_lock(&self, lock: Arc<crate::pool_lock::PoolLock>) {
        let _ = self.pool_lock.set(lock);
    }

    /// Opens the pool (formatting it when absent and allowed) and starts the background
    /// threads.
    ///
    /// A pool that was a backup's carries a copy marker (`<pool>.copy`, see
    /// [`crate::replication::backup`]): one that says `incomplete` is refused
    /// ([`DpmError::IncompleteCopy`]) unless `config.accept_incomplete_copy`; once the pool is
    /// open, the marker is removed (the pool is a primary's own from then on). A pool without
    /// a marker opens as any other.
    pub fn open(config: DpmConfig) -> Result<Arc<Self>> {
        let path = &config.pool_path;
        // A backup's pool carries a copy marker (replication/copy_marker.rs): an unfinished copy is
        // not a pool to serve from, unless the operator accepts the loss.
        // Set when an unreadable marker was overridden: removed like a readable one.
        let mut overridden_unreadable_marker = false;
        let marker = match crate::replication::copy_marker::read_copy_marker(path) {
            Ok(m) => m,
            // A marker this dpm-node cannot make sense of (damaged, or written by a newer one)
            // may say anything: with the override, it counts as incomplete; without, the error
            // says what the override would do. A marker that cannot be read at all (an I/O
            // error, a permission) is never overridden: it may say complete, and opening the
            // pool would remove it.
            Err(DpmError::BadPool { path, detail }) if config.accept_incomplete_copy => {
                tracing::warn!(marker = %path, error = %detail, "the copy marker cannot be understood: treating the pool as an unfinished copy (--accept-incomplete-copy): chunks that were not copied are zeroes or an older image's, and what recovery makes of them is data lost or stale data back");
                overridden_unreadable_marker = true;
                None
            }
            Err(DpmError::BadPool { path, detail }) => {
                return Err(DpmError::BadPool {
                    path,
                    detail: format!(
                        "{detail}. As a last resort that may lose data, \
                         --accept-incomplete-copy opens the pool as an unfinished copy"
                    ),
                })
            }
            Err(e) => return Err(e),
        };
        if let Some(m) = marker {
            let marker_path = crate::replication::copy_marker::copy_marker_path(path);
            match m.state {
                crate::replication::CopyState::Complete => {
                    tracing::info!(marker = %marker_path.display(), term = m.term, "opening a backup's pool as a primary: its copy was complete (a consistent image, possibly older than its primary's last)");
                }
                crate::replication::CopyState::Incomplete if !config.accept_incomplete_copy => {
                    return Err(DpmError::IncompleteCopy {
                        pool: path.display().to_string(),
                        marker: marker_path.display().to_string(),
                        term: m.term,
                    });
                }
                crate::replication::CopyState::Incomplete => {
                    tracing::warn!(marker = %marker_path.display(), term = m.term, "opening an UNFINISHED copy of a primary's pool as a primary (--accept-incomplete-copy): chunks that were not copied are zeroes or an older image's, and what recovery makes of them is data lost or stale data back");
                }
            }
        }
        let device = dinomo_fabric::pm::DaxDevice::probe(path)?;
        let pool = if let Some(dev) = device {
            // A device always exists: it is formatted only when it holds no pool and the
            // operator said the device may be erased.
            if Pool::holds_pool(path)? {
                Pool::open(path, config.durability)?
            } else if config.format_device {
                tracing::info!(path = %path.display(), size = dev.len, "formatting a new pool on the device-DAX device (pool_size does not apply: the pool is the whole device)");
                Pool::format(path, &config.format, config.durability)?
            } else {
                return Err(DpmError::BadPool {
                    path: path.display().to_string(),
                    detail: "is a device-DAX device that holds no Dinomo pool; to format it \
                             (erasing the device) set format_device = true or pass \
                             --format-device"
                        .into(),
                });
            }
        } else if path.exists() {
            Pool::open(path, config.durability)?
        } else if config.create {
            tracing::info!(path = %path.display(), size = config.format.pool_len, "formatting a new pool");
            Pool::format(path, &config.format, config.durability)?
        } else {
            return Err(DpmError::BadPool {
                path: path.display().to_string(),
                detail: "does not exist (and create = false)".into(),
            });
        };
        let pool = Arc::new(pool);
        tracing::info!(
            path = %path.display(),
            durability = %pool.durability(),
            segments = pool.superblock().segment_count,
            segment_size = pool.superblock().segment_size,
            "pool open"
        );
        let mut segments = Segments::open(pool.clone())?;
        if config.verify_accounting {
            tracing::warn!("verify_accounting is on: every merge recounts the index (slow)");
            segments.enable_verification();
        }
        let segments = Arc::new(segments);
        let index = Arc::new(Index::open(
            pool.clone(),
            segments.clone(),
            config.initial_index_buckets,
        )?);
        // The cleaner's open segment of a previous run is finished as it is.
        for (_, chain) in segments.chains_of(CLEANER_KN) {
            let mut c = chain.state.lock();
            for (_, id) in std::mem::take(&mut c.pending) {
                segments.set_state(id, SegState::Merged)?;
            }
        }
        index.for_each(|_, p| segments.add_live(p, 1))?;
        let merger = Arc::new(Merger::new(pool.clone(), index.clone(), segments.clone()));
        let meta = MetaStore::open(pool.clone())?;
        // A backup's copy carries the start record of the primary it was copied from. That
        // primary's own pool, started again, may be taken back by a backup whatever its image
        // (see [`Dpm::next_replica_term`]); a copy must not be (a backup removed from the set
        // would pass as that pool), so a copy opened as a primary's forgets it, before
        // anything else runs and before its marker goes.
        if marker.is_some() || overridden_unreadable_marker {
            meta.update(&[(REPLICA_TAKEN_KEY, None)])?;
        }
        let cells = Arc::new(Cells::new(IndexArea::of(pool.superblock())));
        for (name, v) in meta.scan("cell/") {
            let key = unhex(&name["cell/".len()..]);
            let off = v.try_into().ok().map(u64::from_le_bytes);
            match (key, off) {
                (Some(key), Some(off)) if cells.claim(&key, off) => {}
                _ => tracing::warn!(%name, "ignoring a corrupt indirect-cell record"),
            }
        }
        // KN processes that registered with an earlier run: their grants died with it, so
        // each one still running is a fenced process (held until it exits or registers).
        let fenced_procs = Arc::new(FencedProcs::default());
        for (name, _) in meta.scan(KN_PROC_PREFIX) {
            match parse_kn_proc_key(&name) {
                Some((kn, p)) if p.alive() => fenced_procs.watch(kn, p),
                _ => meta.update(&[(&name, None)])?,
            }
        }
        let gc = Arc::new(Gc::new(
            pool.clone(),
            index.clone(),
            segments.clone(),
            cells.clone(),
            fenced_procs.clone(),
            config.clean_threshold,
        ));
        // Grants do not survive a restart: KNs re-register (and get new epochs).
        let grants = Arc::new(GrantTable::create(
            &GrantTable::path_for(path),
            config.max_grants,
        )?);
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = merger.spawn_workers(config.merge_workers, stop.clone());
        if config.prefault {
            threads.extend(crate::prefault::spawn(path, pool.clone(), stop.clone()));
        }
        {
            let (gc, stop, every) = (
                gc.clone(),
                stop.clone(),
                Duration::from_millis(config.gc_interval_ms),
            );
            threads.push(
                std::thread::Builder::new()
                    .name("gc".into())
                    .spawn(move || {
                        let mut last = std::time::Instant::now();
                        // A pass that needs the backups fails every interval while they do
                        // not answer: said once, and again when passes run again.
                        let mut unreplicated = false;
                        while !stop.load(Ordering::Acquire) {
                            // Short naps so that shutdown is prompt whatever the interval.
                            std::thread::sleep(every.min(Duration::from_millis(20)));
                            if last.elapsed() < every {
                                continue;
                            }
                            last = std::time::Instant::now();
                            match gc.run_once() {
                                Err(e @ DpmError::Replication(_)) => {
                                    if !unreplicated {
                                        tracing::warn!(error = %e, "garbage collection waits for the backups");
                                    }
                                    unreplicated = true;
                                }
                                Err(e @ DpmError::CellsChurning { .. }) => {
                                    tracing::info!(error = %e, "garbage collection pass skipped")
                                }
                                Err(e) => {
                                    tracing::error!(error = %e, "garbage collection pass failed")
                                }
                                Ok(_) => {
                                    if unreplicated {
                                        tracing::info!("garbage collection runs again");
                                    }
                                    unreplicated = false;
                                }
                            }
                        }
                    })
                    .expect("spawning the gc thread"),
            );
        }
        // Opened (recovered) as a primary's pool: from now on it is one, and it diverges from
        // whatever the marker described. Removed only now: a crash before this leaves the
        // marker, so the next open decides again (a complete copy opens; an incomplete one
        // needs the override again), which errs on the side of refusing. For the same reason a
        // failure to remove it is only logged: the workers run already.
        if marker.is_some() || overridden_unreadable_marker {
            if let Err(e) = crate::replication::copy_marker::remove_copy_marker(path) {
                tracing::warn!(pool = %path.display(), error = %e, "could not remove the copy marker of a pool opened as a primary; the next open will read it again");
            }
        }
        tracing::info!(
            items = index.items(),
            free_segments = segments.free_count(),
            "DPM ready"
        );
        Ok(Arc::new(Dpm {
            config,
            pool,
            index,
            segments,
            merger,
            gc,
            cells,
            meta,
            key_fence: parking_lot::RwLock::new(grants.clone()),
            grants,
            sessions: Mutex::new(HashMap::new()),
            granted: parking_lot::RwLock::new(HashMap::new()),
            fenced_procs,
            stop,
            threads: Mutex::new(threads),
            pool_lock: std::sync::OnceLock::new(),
        }))
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    pub fn grants(&self) -> &Arc<GrantTable> {
        &self.grants
    }

    /// Makes `fence` the way KN keys are revoked, and their window ranges closed, from now on:
    /// a fabric NIC that needs more than the grant table for that (the verbs NIC deregisters
    /// the KN's memory regions).
    /// `None` restores the grant table alone (shm and tcp). The server installs its verbs NIC
    /// before it serves and removes it when it stops.
    pub fn set_key_fence(&self, fence: Option<Arc<dyn KeyFence>>) {
        *self.key_fence.write() = fence.unwrap_or_else(|| self.grants.clone());
    }

    /// Revokes a KN's key through the key fence.
    fn revoke_key(&self, key: AccessKey) -> Result<()> {
        let fence = self.key_fence.read().clone();
        fence.fence(key)?;
        Ok(())
    }

    pub fn index(&self) -> &Arc<Index> {
        &self.index
    }

    /// The background merge workers (tests wait on their passes).
    pub fn merger(&self) -> &Arc<Merger> {
        &self.merger
    }

    pub fn gc(&self) -> &Arc<Gc> {
        &self.gc
    }

    fn fence_word(&self, kn: u32) -> Result<&std::sync::atomic::AtomicU64> {
        if kn >= Roots::MAX_KNS {
            return Err(DpmError::KnOutOfRange {
                kn,
                max: Roots::MAX_KNS,
            });
        }
        Ok(self.pool.root(Roots::KN_FENCE + 8 * u64::from(kn)))
    }

    /// Registers a KN (a new incarnation of `kn_id`, or the lowest unused id), fencing any
    /// previous incarnation and merging whatever it logged (its open segments are sealed: no
    /// one will append to them again), so the new incarnation finds every acknowledged write
    /// through the index.
    pub fn register_kn(&self, kn_id: Option<u32>, endpoint: &str) -> Result<Registration> {
        self.register_kn_process(kn_id, endpoint, None)
    }

    /// [`Dpm::register_kn`] for the KN process `pid` (on this host): on the shm fabric, its
    /// segments are not reused while it runs after being fenced (see [`FencedProcs`]).
    pub fn register_kn_process(
        &self,
        kn_id: Option<u32>,
        endpoint: &str,
        pid: Option<u32>,
    ) -> Result<Registration> {
        let process = match pid {
            Some(pid) if self.config.fabric == FabricKind::Shm => {
                let p = ProcessRef::of(pid);
                if p.is_none() {
                    tracing::warn!(
                        pid,
                        endpoint,
                        "cannot see the KN's process in /proc (another host or pid namespace?): \
                         if it is fenced while still running, its segments may be reused under it"
                    );
                }
                p
            }
            _ => None,
        };
        let mut sessions = self.sessions.lock();
        let kn = match kn_id {
            Some(k) => k,
            None => self.id_for_endpoint(&sessions, endpoint)?,
        };
        let fence = self.fence_word(kn)?;
        let epoch = self
            .pool
            .root(Roots::KN_EPOCH)
            .fetch_add(1, Ordering::AcqRel)
            + 1;
        self.pool.persist_root(Roots::KN_EPOCH);
        fence.store(epoch, Ordering::Release);
        self.pool.persist_root(Roots::KN_FENCE + 8 * u64::from(kn));
        if let Some(old) = sessions.remove(&kn) {
            self.granted.write().remove(&kn);
            self.revoke_key(old.key)?;
            if let Some(p) = old.process.filter(|p| Some(*p) != process) {
                self.fenced_procs.watch(kn, p);
            }
        }
        if let Some(p) = process {
            self.fenced_procs.registered(kn, p);
            // Recorded so that a restarted dpm-node holds it too (see `open`); records of
            // this KN's processes that have exited go.
            let mut changes: Vec<(String, bool)> = vec![(kn_proc_key(kn, p), true)];
            for (name, _) in self.meta.scan(&format!("{KN_PROC_PREFIX}{kn}/")) {
                if parse_kn_proc_key(&name).is_none_or(|(_, q)| q != p && !q.alive()) {
                    changes.push((name, false));
                }
            }
            let changes: Vec<(&str, Option<&[u8]>)> = changes
                .iter()
                .map(|(n, keep)| (n.as_str(), keep.then_some(&b""[..])))
                .collect();
            self.meta.update(&changes)?;
        }
        if self.pending_segments(kn) > 0 {
            let r = self.merger.merge_all(kn, MergeMode::AllAndSeal)?;
            tracing::info!(
                kn,
                entries = r.entries,
                segments = r.segments,
                "merged the logs of the previous incarnation"
            );
        }
        let key = self.grants.grant()?;
        // The KN swings the indirect cells of replicated keys with CAS: the cell space is in
        // every KN's window, for CAS only.
        let area = IndexArea::of(self.pool.superblock());
        if area.cells > 0 {
            let cells = WindowRange::atomic(area.cells_off, area.cells * CELL_SIZE);
            if let Err(e) = self.grants.open_window(key, cells) {
                let _ = self.grants.revoke(key);
                return Err(e.into());
            }
        }
        self.meta
            .update(&[(&format!("dpm/kn/{kn}"), Some(endpoint.as_bytes()))])?;
        sessions.insert(
            kn,
            KnSession {
                epoch,
                key,
                process,
            },
        );
        self.granted.write().insert(kn, epoch);
        metrics::counter!("dinomo_dpm_kn_registrations_total").increment(1);
        tracing::info!(kn, epoch, endpoint, "KN registered");
        let sb = self.pool.superblock();
        Ok(Registration {
            kn_id: kn,
            epoch,
            key,
            pool_len: sb.pool_len,
            segment_size: sb.segment_size,
            index_root: sb.roots_off + Roots::INDEX_TABLE,
        })
    }

    /// The id of a KN that registers without one. A KN that registered from `endpoint` before
    /// is the same KN restarted: it gets that id back, so this registration merges what its
    /// previous incarnation logged (under a new id, its open segments would never be merged and
    /// it would serve without its own acknowledged writes). Otherwise the lowest id never
    /// registered. Ids are stable only as long as the address is: orchestrators pass an id.
    fn id_for_endpoint(&self, sessions: &HashMap<u32, KnSession>, endpoint: &str) -> Result<u32> {
        // An unspecified address (0.0.0.0, port 0) names no one: several KNs may send it.
        let specific = endpoint
            .parse::<std::net::SocketAddr>()
            .map_or(!endpoint.is_empty(), |a| {
                !a.ip().is_unspecified() && a.port() != 0
            });
        let previous = specific
            .then(|| {
                self.meta
                    .scan("dpm/kn/")
                    .into_iter()
                    .filter(|(_, v)| v.as_slice() == endpoint.as_bytes())
                    .find_map(|(name, _)| name["dpm/kn/".len()..].parse::<u32>().ok())
            })
            .flatten();
        if let Some(kn) = previous {
            tracing::info!(
                kn,
                endpoint,
                "a KN without an id registers from a known address: same id"
            );
            return Ok(kn);
        }
        (0..Roots::MAX_KNS)
            .find(|k| !sessions.contains_key(k) && self.meta.get(&format!("dpm/kn/{k}")).is_none())
            .ok_or(DpmError::KnOutOfRange {
                kn: Roots::MAX_KNS,
                max: Roots::MAX_KNS,
            })
    }

    /// Refuses a KN epoch that has been fenced.
    pub fn check_epoch(&self, kn: u32, epoch: u64) -> Result<()> {
        let fence = self.fence_word(kn)?.load(Ordering::Acquire);
        if fence == 0 {
            return Err(DpmError::UnknownKn { kn });
        }
        if epoch < fence {
            return Err(DpmError::Fenced { kn, epoch, fence });
        }
        Ok(())
    }

    /// [`Dpm::check_epoch`], and `epoch` is `kn`'s session registered with this process
    /// ([`DpmError::NoSession`] otherwise: a session of a process before a restart or a
    /// failover, whose grant this one never gave).
    /// Takes no lock a merge holds: ForwardWrites calls it on a runtime worker.
    pub fn check_session(&self, kn: u32, epoch: u64) -> Result<()> {
        self.check_epoch(kn, epoch)?;
        match self.granted.read().get(&kn) {
            Some(&granted) if granted == epoch => Ok(()),
            _ => Err(DpmError::NoSession { kn, epoch }),
        }
    }

    /// Fences a KN: its fabric access is revoked, its epoch refused and its open segments
    /// sealed. Its logs stay; call [`Dpm::merge_all`] to make them readable by others.
    ///
    /// When this returns, no fabric post of the KN can still be acknowledged as done without
    /// being in place: the tcp NIC has finished every post that passed the grant check (the
    /// revoke waits for them), the verbs NIC has deregistered the KN's memory regions (the
    /// device refuses its later operations; see the fabric's verbs/mod.rs), and an shm post that the KN's own CPU applies after the revoke
    /// fails with an outcome-unknown error (see the fabric's grants.rs). Such a late shm batch
    /// can still land in the KN's segments; sealing them here means the merge that follows
    /// retires them (Merged, never scanned again) instead of leaving them open and pending for
    /// a later merge to index the late batch over newer writes of the keys' next owner.
    pub fn fence_kn(&self, kn: u32) -> Result<()> {
        self.fence_kn_locked(&mut self.sessions.lock(), kn, true)
    }

    /// [`Dpm::fence_kn`] with the sessions already locked by the caller. `under_map`: record
    /// the map it was fenced under, so that it serves again only under a later one (a fence
    /// that comes with a reconfiguration); without it, the KN may serve again as soon as it
    /// registers.
    fn fence_kn_locked(
        &self,
        sessions: &mut HashMap<u32, KnSession>,
        kn: u32,
        under_map: bool,
    ) -> Result<()> {
        let fence = self.fence_word(kn)?;
        let next = self
            .pool
            .root(Roots::KN_EPOCH)
            .fetch_add(1, Ordering::AcqRel)
            + 1;
        self.pool.persist_root(Roots::KN_EPOCH);
        // Never backwards: a registration running at the same time may have stored a newer
        // epoch already.
        fence.fetch_max(next, Ordering::AcqRel);
        self.pool.persist_root(Roots::KN_FENCE + 8 * u64::from(kn));
        // Its serving lease is renewed again only under a later map (see confirm_serving).
        if under_map {
            let under = self.meta.get(CLUSTER_MAP_KEY).unwrap_or_default();
            self.meta
                .update(&[(&fenced_under_key(kn), Some(under.as_slice()))])?;
        }
        if let Some(s) = sessions.remove(&kn) {
            self.granted.write().remove(&kn);
            self.revoke_key(s.key)?;
            if let Some(p) = s.process {
                self.fenced_procs.watch(kn, p);
            }
            tracing::info!(kn, epoch = s.epoch, "KN fenced");
        }
        // The KN can never append again (its epoch is refused, its key revoked), so its open
        // segments are finished: sealing is idempotent and only touches open ones.
        let pending = self.pending_segment_ids(kn);
        for &id in &pending {
            self.segments.seal(kn, id)?;
        }
        if !pending.is_empty() {
            self.merger.notify();
        }
        metrics::counter!("dinomo_dpm_kn_fenced_total").increment(1);
        Ok(())
    }

    /// A KN's serving-lease renewal: the published map (if any), for a KN whose epoch is not
    /// fenced and that was not fenced under the map published now. A fenced KN that
    /// registered again (with a new epoch) still waits for the map that the fencing
    /// reconfiguration publishes: under the old one it would serve keys that reconfiguration
    /// is moving, from caches that may be stale by then.
    pub fn confirm_serving(&self, kn: u32, epoch: u64) -> Result<Option<Vec<u8>>> {
        self.check_epoch(kn, epoch)?;
        self.check_not_fenced_under_map(kn)?;
        Ok(self.meta.get(CLUSTER_MAP_KEY))
    }

    /// Refuses a KN fenced under the map published now (FencedUnderMap), even under a newer
    /// epoch: it registered again after the fence, but the reconfiguration that fenced it has
    /// merged its log already, so what it wrote now would be lost to the keys' next owner.
    ///
    /// The record is only compared, never deleted here: every publish changes the map's bytes
    /// (its version rises), and a delete racing a newer fence's record could erase it.
    fn check_not_fenced_under_map(&self, kn: u32) -> Result<()> {
        if let Some(under) = self.meta.get(&fenced_under_key(kn)) {
            let map = self.meta.get(CLUSTER_MAP_KEY).unwrap_or_default();
            if map == under {
                return Err(DpmError::FencedUnderMap { kn });
            }
        }
        Ok(())
    }

    /// Allocates the next segment of one of the KN's logs (`stream`: one per shard).
    /// `deletes_only`: the KN will write only deletes into it, which may use the delete reserve
    /// of a full pool (deletes are how space comes back).
    pub fn allocate_segment(
        &self,
        kn: u32,
        stream: u16,
        epoch: u64,
        deletes_only: bool,
    ) -> Result<SegmentGrant> {
        let grant = self.allocate_segment_checked(kn, stream, epoch, deletes_only)?;
        // A fence or a new registration may have run while this allocation waited (it may
        // wait seconds on a full pool): they sealed every segment of the KN they saw, but not
        // this one. Left open, it would stop the merge of its log for good. Then the segment
        // enters the KN's write window, before the KN learns of it (refused past
        // MAX_WINDOW_RANGES ranges, or if a fence revoked the key meanwhile).
        if let Err(e) = self
            .check_epoch(kn, epoch)
            .and_then(|()| self.check_not_fenced_under_map(kn))
            .and_then(|()| {
                let key = self
                    .session_key(kn, epoch)
                    .ok_or(DpmError::UnknownKn { kn })?;
                self.grants
                    .open_window(key, WindowRange::write(grant.offset, grant.len))
                    .map_err(DpmError::from)
            })
        {
            self.segments.seal(kn, grant.segment_id)?;
            self.merger.notify();
            return Err(e);
        }
        Ok(grant)
    }

    fn allocate_segment_checked(
        &self,
        kn: u32,
        stream: u16,
        epoch: u64,
        deletes_only: bool,
    ) -> Result<SegmentGrant> {
        self.check_epoch(kn, epoch)?;
        self.check_not_fenced_under_map(kn)?;
        if kn == CLEANER_KN {
            return Err(DpmError::KnOutOfRange {
                kn,
                max: Roots::MAX_KNS,
            });
        }
        let tier = if deletes_only {
            Tier::Deletes
        } else {
            Tier::Log
        };
        // Before refusing, get back what merging and collecting would: index space set aside
        // for sealed segments is needed only until they are merged (wait for the workers), and
        // deletes or overwrites sitting in open segments free space only once merged (merge
        // what every log holds so far, then collect). Bounded in time.
        // Other logs' deletes may free whole segments meanwhile, so reclaiming is retried.
        let started = std::time::Instant::now();
        let deadline = started + ALLOCATION_WAIT;
        loop {
            self.segments
                .set_index_need(self.index_need_segments(!deletes_only));
            match self.segments.allocate(LogId { kn, stream }, epoch, tier) {
                Err(DpmError::PoolFull { .. }) if std::time::Instant::now() < deadline => {
                    // Sealed segments are normally merged within milliseconds; one whose merge
                    // is stuck must not keep this call from reclaiming.
                    let patient = started.elapsed() < Duration::from_millis(500);
                    if patient && self.segments.sealed_log_segments() > 0 {
                        self.merger.notify();
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                    let before = self.segments.free_count();
                    let unreplicated = self.reclaim_for_allocation();
                    // Puts are refused at once when nothing came back; deletes wait for the
                    // other logs' deletes to free space (they are how a full pool drains).
                    if !deletes_only && self.segments.free_count() <= before {
                        if let Some(e) = unreplicated {
                            // Collection could not run because the backups did not answer
                            // (or cells kept changing under their copies): unavailability,
                            // for the caller to retry, not a full pool (which a client takes
                            // as final).
                            return Err(e);
                        }
                        return self.segments.allocate(LogId { kn, stream }, epoch, tier);
                    }
                    if deletes_only {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
                other => return other,
            }
        }
    }

    /// A full pool's last resort before refusing a KN a segment: merge what every KN log holds
    /// so far (open segments stay open; the merge stops at each log's valid end, so KNs go on
    /// appending), then run garbage collection, so the deletes and overwrites just logged give
    /// their space back. Returns the error that stopped collection when it needed the
    /// backups and they did not answer ([`DpmError::Replication`], see [`Gc::run_once`]), or
    /// KNs kept swinging a cell under its copies ([`DpmError::CellsChurning`]).
    fn reclaim_for_allocation(&self) -> Option<DpmError> {
        let mut unreplicated = None;
        for (log, chain) in self.segments.chains() {
            if log.kn == CLEANER_KN {
                continue;
            }
            let _merging = chain.merging.lock();
            if let Err(e) = self.merger.merge_chain(log, &chain, MergeMode::All) {
                tracing::warn!(kn = log.kn, error = %e, "merging to make room failed");
            }
        }
        for _ in 0..3 {
            match self.gc.run_once() {
                Ok(r) if r.freed > 0 || r.cleaned > 0 => continue,
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "collecting to make room failed");
                    if matches!(e, DpmError::Replication(_) | DpmError::CellsChurning { .. }) {
                        unreplicated = Some(e);
                    }
                    break;
                }
            }
        }
        metrics::counter!("dinomo_dpm_full_pool_reclaims_total").increment(1);
        unreplicated
    }

    /// Segments the index may need to index every log segment not merged yet (and the one
    /// being allocated, if it will hold puts): their bytes times the index bytes per live log
    /// byte seen so far (bounded, see below), less the index space allocated but
    /// unused, plus one for chunk granularity (0 when the unused space covers it). Log admission keeps that many free, so merges
    /// never stall on a full pool.
    fn index_need_segments(&self, with_new_puts: bool) -> u64 {
        let seg = self.pool.superblock().segment_size;
        let (used, spare) = self.index.usage();
        let live = self.segments.total_live_bytes();
        // The ratio seen so far, but never below 0.5 (a workload that turns to small entries
        // after large ones needs far more index per log byte than its history says; small
        // entries cost about 0.75) and never above 1.25 (the smallest entries).
        let ratio = if live < seg {
            0.75
        } else {
            (used as f64 / live as f64).clamp(0.5, 1.25)
        };
        let pending = self.segments.unmerged_log_segments() + u64::from(with_new_puts);
        if pending == 0 {
            return 0;
        }
        let need = (pending as f64 * seg as f64 * ratio) as u64;
        if need <= spare {
            return 0;
        }
        (need - spare).div_ceil(seg) + 1
    }

    /// The segment of `kn` that `[offset, offset + len)` lies in, with its use's generation and
    /// the range's end: `(segment, generation, offset, end)` (`None`: not inside one segment of
    /// `kn`, e.g. an indirect cell).
    pub fn forwarded_segment(
        &self,
        kn: u32,
        offset: u64,
        len: u64,
    ) -> Option<(u64, u64, u64, u64)> {
        let sb = self.pool.superblock();
        let id = sb.segment_of(offset)?;
        let end = offset.checked_add(len)?;
        if end > sb.segment_offset(id) + sb.segment_size {
            return None;
        }
        let entry = self.segments.entry_of(kn, id).ok()?;
        Some((id, entry.generation, offset, end))
    }

    /// Marks a segment sealed and wakes the merge workers; returns how many segments of this
    /// KN are still unmerged.
    ///
    /// The segment leaves the KN's write window first: when that returns, every WRITE the
    /// fabric checked against the old window is in place (tcp), or fails (shm), so the merge
    /// of the sealed segment sees all that was acknowledged.
    ///
    /// The window closed is the KN's current session's, whatever epoch the caller gave: a
    /// seal in any other name (a bogus epoch above the current one passes the fence check)
    /// must still stop the KN writing into the sealed segment, or its later writes would be
    /// acknowledged and never merged. An epoch above the current session's is refused.
    pub fn seal_segment(&self, kn: u32, epoch: u64, segment: u64) -> Result<u64> {
        self.check_epoch(kn, epoch)?;
        self.segments.entry_of(kn, segment)?;
        let current = self.sessions.lock().get(&kn).map(|s| (s.epoch, s.key));
        if let Some((current_epoch, key)) = current {
            if epoch > current_epoch {
                return Err(DpmError::InvalidArgument(format!(
                    "epoch {epoch} is not a session of KN {kn} (its session is epoch \
                     {current_epoch})"
                )));
            }
            let offset = self.pool.superblock().segment_offset(segment);
            // Through the key fence: on verbs the segment's write regions are deregistered
            // before this returns (closing it in the grant table alone would leave them live
            // until the NIC's watcher noticed).
            let fence = self.key_fence.read().clone();
            fence.fence_window(key, offset)?;
        }
        self.segments.seal(kn, segment)?;
        self.merger.notify();
        Ok(self.pending_segments(kn))
    }

    /// The fabric key of `kn`'s session of `epoch`, if that session is the current one.
    fn session_key(&self, kn: u32, epoch: u64) -> Option<AccessKey> {
        self.sessions
            .lock()
            .get(&kn)
            .filter(|s| s.epoch == epoch)
            .map(|s| s.key)
    }

    /// Segments of `kn` not yet fully merged (open ones included).
    pub fn pending_segments(&self, kn: u32) -> u64 {
        self.pending_segment_ids(kn).len() as u64
    }

    /// Ids of the segments of `kn` not yet fully merged, in chain order.
    pub fn pending_segment_ids(&self, kn: u32) -> Vec<u64> {
        self.segments
            .chains_of(kn)
            .into_iter()
            .flat_map(|(_, c)| c.state.lock().pending.values().copied().collect::<Vec<_>>())
            .collect()
    }

    /// Merges every pending log entry of `kn` into the index before returning. `seal_open`
    /// also seals its open segments, which only a KN that can no longer append may have: if
    /// `kn` is registered and not fenced, its session is ended first (grant revoked, epoch
    /// refused). Otherwise it would go on appending, and acknowledging writes, into segments
    /// already merged and retired, which no merge ever scans again (issue 13: 50 acknowledged
    /// writes gone after a restart). No map change comes with this, so the map it was fenced
    /// under is not recorded: the KN registers again and serves on. The sessions stay locked
    /// until the merge is done, as a registration's own merge does, so that no new
    /// incarnation of `kn` opens a segment this merge would seal.
    pub fn merge_all(&self, kn: u32, seal_open: bool) -> Result<MergeReport> {
        let mode = if seal_open {
            MergeMode::AllAndSeal
        } else {
            MergeMode::All
        };
        let r = if seal_open {
            let mut sessions = self.sessions.lock();
            if sessions.contains_key(&kn) {
                tracing::warn!(
                    kn,
                    "MergeAll with seal_open for a KN that is registered and not fenced: \
                     ending its session first (it would keep appending to segments sealed \
                     under it); it registers again"
                );
                self.fence_kn_locked(&mut sessions, kn, false)?;
            }
            self.merger.merge_all(kn, mode)?
        } else {
            self.merger.merge_all(kn, mode)?
        };
        tracing::info!(
            kn,
            seal_open,
            segments = r.segments,
            entries = r.entries,
            invalid_tails = r.invalid_tails,
            "MergeAll done"
        );
        Ok(r)
    }

    /// The current value of `key`: its indirect cell's if it is replicated, else the index's
    /// (merged data only).
    pub fn lookup(&self, key: &[u8]) -> Result<Option<Found>> {
        let ptr = match self.cells.get(key) {
            Some(off) => Cells::current(&self.pool, off),
            None => self.index.lookup(key, dinomo_layout::key_hash(key))?,
        };
        let Some(ptr) = ptr else {
            return Ok(None);
        };
        let len = self.segments.entry_len(ptr)?;
        let bytes = self.pool.view(ptr.offset, len)?;
        let (e, _) = decode_entry(bytes).map_err(|source| DpmError::Layout {
            path: self.pool.path(),
            source,
        })?;
        if e.op != LogOp::Put {
            // Only a cell can point at a delete.
            return Ok(None);
        }
        Ok(Some(Found {
            ptr,
            version: e.version,
            value: e.value.to_vec(),
        }))
    }

    /// Creates the indirect cell of a replicated key (or re-initialises the one a failed
    /// reconfiguration left): an 8-byte word, in its own cache line of the index heap, holding
    /// an entry pointer that the key's owners CAS. It is set to the key's indexed value, so the
    /// caller must have paused the key's owners and merged every log that may hold a write of
    /// the key first (the reconfiguration does: prepare, MergeAll).
    pub fn install_cell(&self, key: &[u8]) -> Result<u64> {
        if key.is_empty() {
            return Err(DpmError::InvalidArgument("the key is empty".into()));
        }
        let name = format!("cell/{}", hex(key));
        let current = self
            .index
            .lookup(key, dinomo_layout::key_hash(key))?
            .map_or(0, |p| p.to_word());
        if let Some(off) = self.cells.get(key) {
            // Left by a reconfiguration that failed after installing it: the index, merged
            // just now, is newer than whatever the cell holds.
            self.pool
                .region()
                .word(off)?
                .store(current, Ordering::Release);
            self.pool.region().persist(off, 8)?;
            return Ok(off);
        }
        let off = self.cells.allocate(key)?;
        self.pool
            .region()
            .word(off)?
            .store(current, Ordering::Release);
        self.pool.region().persist(off, 8)?;
        if let Err(e) = self.meta.update(&[(&name, Some(&off.to_le_bytes()))]) {
            self.cells.remove(key);
            return Err(e);
        }
        metrics::gauge!("dinomo_dpm_indirect_cells").set(self.cells.len() as f64);
        tracing::info!(key = %hex(key), offset = off, "indirect cell installed");
        Ok(off)
    }

    /// The offset of a key's cell, if it has one.
    pub fn cell_of(&self, key: &[u8]) -> Option<u64> {
        self.cells.get(key)
    }

    /// De-replication: writes the cell's value back into the index, then frees the cell for
    /// reuse. The caller must have stopped the key's owners and
    /// merged their logs first, so no later merge can put an older write of the key over it.
    pub fn remove_cell(&self, key: &[u8]) -> Result<bool> {
        let name = format!("cell/{}", hex(key));
        let Some(off) = self.cells.get(key) else {
            return Ok(false);
        };
        let hash = dinomo_layout::key_hash(key);
        let _accounting = self.segments.accounting_guard();
        let target = Cells::current(&self.pool, off);
        let is_put = match target {
            Some(ptr) => {
                let len = self.segments.entry_len(ptr)?;
                let bytes = self.pool.view(ptr.offset, len)?;
                let (e, _) = decode_entry(bytes).map_err(|source| DpmError::Layout {
                    path: self.pool.path(),
                    source,
                })?;
                if e.key != key {
                    return Err(DpmError::InvalidArgument(format!(
                        "the cell of key {} points at an entry of another key",
                        hex(key)
                    )));
                }
                e.op == LogOp::Put
            }
            None => false,
        };
        let old = match target {
            Some(ptr) if is_put => {
                if self.index.lookup(key, hash)? == Some(ptr) {
                    None
                } else {
                    let old = self.index.upsert(key, hash, ptr)?;
                    self.segments.add_live(ptr, 1);
                    old
                }
            }
            _ => self.index.remove(key, hash)?,
        };
        if let Some(old) = old {
            self.segments.add_live(old, -1);
        }
        self.segments.verify(&self.index, "a cell removal")?;
        // The index now holds the value (and pins its segment through the live bytes).
        self.meta.update(&[(&name, None)])?;
        self.cells.remove(key);
        metrics::gauge!("dinomo_dpm_indirect_cells").set(self.cells.len() as f64);
        tracing::info!(key = %hex(key), exists = is_put, "indirect cell removed; value written back to the index");
        Ok(true)
    }

    /// Sets (`Some`) or deletes (`None`) a metadata entry, unconditionally (last writer wins).
    /// Refuses the cluster map, which only [`Dpm::compare_and_put_metadata`] may write.
    pub fn put_metadata(&self, name: &str, value: Option<&[u8]>) -> Result<()> {
        Self::check_metadata_name(name)?;
        limits::check_metadata_write(name, value, None)?;
        if name == CLUSTER_MAP_KEY {
            return Err(DpmError::MapNotByCas(
                "PutMetadata cannot write or delete it",
            ));
        }
        self.meta.update_if(
            |map| limits::check_room(map.len(), map.contains_key(name), name, value.is_some()),
            &[(name, value)],
        )
    }

    /// Compare-and-swap of one metadata entry: sets (or deletes) it only if it holds `expected`
    /// now (`None`: only if it does not exist), atomically with the comparison; otherwise
    /// [`DpmError::MetadataChanged`] and nothing changes. The cluster map is published this
    /// way, so two maps of the same version cannot both become the map of record.
    ///
    /// The cluster map ([`CLUSTER_MAP_KEY`]) is checked further: the value must decode as a
    /// [`ClusterMap`] of exactly the next version after the one it replaces (1 over no map),
    /// and it cannot be deleted. Both maps are decoded before the lock: once the comparison
    /// passes, `expected` is the published map, so its version is the published version.
    pub fn compare_and_put_metadata(
        &self,
        name: &str,
        expected: Option<&[u8]>,
        value: Option<&[u8]>,
    ) -> Result<()> {
        Self::check_metadata_name(name)?;
        limits::check_metadata_write(name, value, expected)?;
        let map_versions = if name == CLUSTER_MAP_KEY {
            Some(Self::map_versions(expected, value)?)
        } else {
            None
        };
        let describe = |v: Option<&[u8]>| match v {
            None => "absent".to_string(),
            Some(v) => format!("a value of {} bytes", v.len()),
        };
        self.meta.update_if(
            |map| {
                let found = map.get(name).map(Vec::as_slice);
                if found != expected {
                    return Err(DpmError::MetadataChanged {
                        name: name.to_string(),
                        expected: describe(expected),
                        found: describe(found),
                    });
                }
                if let Some((published, offered)) = map_versions {
                    if published.checked_add(1) != Some(offered) {
                        return Err(DpmError::MapVersion { published, offered });
                    }
                }
                limits::check_room(map.len(), map.contains_key(name), name, value.is_some())
            },
            &[(name, value)],
        )
    }

    /// The versions of a cluster map publish: (the replaced map's, 0 for none; the new one's).
    fn map_versions(expected: Option<&[u8]>, value: Option<&[u8]>) -> Result<(u64, u64)> {
        let Some(value) = value else {
            return Err(DpmError::MapNotByCas(
                "CompareAndPutMetadata cannot delete it",
            ));
        };
        let decode = |b: &[u8], what: &str| {
            ClusterMap::decode(b).map(|m| m.version).map_err(|e| {
                DpmError::InvalidArgument(format!(
                    "metadata {CLUSTER_MAP_KEY:?}: the {what} is not a cluster map: {e}"
                ))
            })
        };
        let offered = decode(value, "value")?;
        let published = expected.map_or(Ok(0), |e| decode(e, "expected value"))?;
        Ok((published, offered))
    }

    /// Starts a new monitor term (persisted): calls carrying an older one are refused from
    /// now on, and none of them is still running when this returns.
    pub fn new_monitor_term(&self) -> Result<u64> {
        let term = self.meta.new_monitor_term()?;
        metrics::gauge!("dinomo_dpm_monitor_term").set(term as f64);
        tracing::info!(term, "a new monitor term started");
        Ok(term)
    }

    /// Starts the next replica term of this pool (docs/decisions/0007): one more than the
    /// newest of `at_least` and the term recorded in the pool, persisted before it is
    /// returned. A primary takes one at start; backups refuse older ones from then on.
    ///
    /// Also records the term with `instance` (the primary process taking it) and returns the
    /// term and instance recorded at the previous start, if any: a backup that accepted that
    /// start, and nothing since, takes this one back although its image is older (see
    /// [`crate::replication::backup`]).
    pub fn next_replica_term(
        &self,
        at_least: u64,
        instance: u64,
    ) -> Result<(u64, Option<(u64, u64)>)> {
        let recorded = self
            .meta
            .get(REPLICA_TERM_KEY)
            .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
            .map_or(0, u64::from_le_bytes);
        let previous = self.meta.get(REPLICA_TAKEN_KEY).and_then(|v| {
            let v = <[u8; 16]>::try_from(v.as_slice()).ok()?;
            let word = |i: usize| u64::from_le_bytes(v[i..i + 8].try_into().unwrap());
            Some((word(0), word(8)))
        });
        let term = recorded.max(at_least) + 1;
        let mut taken = [0u8; 16];
        taken[..8].copy_from_slice(&term.to_le_bytes());
        taken[8..].copy_from_slice(&instance.to_le_bytes());
        self.meta.update(&[
            (REPLICA_TERM_KEY, Some(&term.to_le_bytes()[..])),
            (REPLICA_TAKEN_KEY, Some(&taken[..])),
        ])?;
        tracing::info!(term, "a new replica term started");
        Ok((term, previous))
    }

    /// The identity of this pool's image (see [`REPLICA_IMAGE_TERM_KEY`] and
    /// [`crate::replication::image`]), recorded first if the pool has none: term 0 for a pool
    /// that never took a term, else (a pool written before the key existed) the newest term it
    /// took. Read before [`Dpm::next_replica_term`], so that terms taken at starts no backup
    /// accepted never count as the image's.
    pub fn init_replica_image(&self) -> Result<ImageId> {
        if let Some(v) = self.meta.get(REPLICA_IMAGE_TERM_KEY) {
            return ImageId::from_bytes(&v).ok_or_else(|| DpmError::BadPool {
                path: self.config.pool_path.display().to_string(),
                detail: format!(
                    "its {REPLICA_IMAGE_TERM_KEY} metadata holds {} bytes, not 8 or {}",
                    v.len(),
                    ImageId::BYTES
                ),
            });
        }
        let term = self
            .meta
            .get(REPLICA_TERM_KEY)
            .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
            .map_or(0, u64::from_le_bytes);
        let image = ImageId {
            term,
            ..ImageId::default()
        };
        self.record_replica_image(image)?;
        Ok(image)
    }

    /// Records the identity of this pool's image: the term a backup accepted (with the start
    /// that took it), or the replica set's new generation.
    pub fn record_replica_image(&self, image: ImageId) -> Result<()> {
        self.meta
            .update(&[(REPLICA_IMAGE_TERM_KEY, Some(&image.to_bytes()[..]))])?;
        Ok(())
    }

    /// The newest monitor term started (0: none).
    pub fn monitor_term(&self) -> Result<u64> {
        self.meta.monitor_term()
    }

    /// Runs `f` as a call of monitor term `term`: refused with
    /// [`DpmError::StaleMonitorTerm`] if a newer term was started, and a new term waits until
    /// `f` returns. `None` (KNs, tests, the CLI bootstrap) is not checked.
    pub fn with_monitor_term<T>(
        &self,
        term: Option<u64>,
        f: impl FnOnce(&Self) -> Result<T>,
    ) -> Result<T> {
        let _admitted = self.meta.check_monitor_term(term)?;
        f(self)
    }

    pub fn get_metadata(&self, name: &str) -> Option<Vec<u8>> {
        self.meta.get(name)
    }

    /// The metadata entries whose names start with `prefix`, in name order.
    pub fn list_metadata(&self, prefix: &str) -> Vec<(String, Vec<u8>)> {
        self.meta.scan(prefix)
    }

    /// [`Dpm::list_metadata`] up to `max_bytes` of names and values: the entries in name
    /// order up to the first that would pass the bound, and that entry's name if one was left
    /// out (everything after it is left out too).
    pub fn list_metadata_bounded(
        &self,
        prefix: &str,
        max_bytes: usize,
    ) -> (Vec<(String, Vec<u8>)>, Option<String>) {
        self.meta.scan_bounded(prefix, max_bytes)
    }

    /// Metadata names callers may write: "dpm/" and "cell/" belong to the DPM itself.
    fn check_metadata_name(name: &str) -> Result<()> {
        if name.is_empty() || name.starts_with("dpm/") || name.starts_with("cell/") {
            return Err(DpmError::InvalidArgument(format!(
                "metadata name {name:?} is empty or reserved (dpm/, cell/)"
            )));
        }
        Ok(())
    }

    pub fn stats(&self) -> DpmStats {
        DpmStats {
            segments_total: self.segments.count(),
            segments_free: self.segments.free_count() as u64,
            index_items: self.index.items(),
            index_buckets: self.index.bucket_count(),
            index_resizes: self.index.resizes(),
            index_space: self.index.space(),
            segments_reserved: self.segments.reserves().total(),
            live_log_bytes: self.segments.total_live_bytes(),
            entries_merged: self.merger.entries_merged(),
            pending_segments: self
                .segments
                .chains()
                .into_iter()
                .filter(|(k, _)| k.kn != CLEANER_KN)
                .fold(HashMap::new(), |mut m, (k, c)| {
                    *m.entry(k.kn).or_insert(0) += c.state.lock().pending.len() as u64;
                    m
                }),
        }
    }

    /// Recounts the live bytes of every segment from the index and compares them with the
    /// counters the merges, the cleaner and cell removal keep. Exact only while no merge, GC
    /// pass or cell removal runs, unless `verify_accounting` is on (then it takes their lock). `Err` names the first segments
    /// that differ. Tests call it after merges; `verify_accounting` makes every merge call it.
    pub fn check_accounting(&self) -> std::result::Result<(), String> {
        let _guard = self.segments.accounting_guard();
        match self.segments.diff(&self.index) {
            Ok(None) => Ok(()),
            Ok(Some(diff)) => Err(diff),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Mismatches the `verify_accounting` check has found (tests assert 0).
    pub fn accounting_mismatches(&self) -> u64 {
        self.segments.accounting_mismatches()
    }

    /// Stops the background threads (the pool stays consistent whether or not this runs).
    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        self.merger.notify();
        for t in self.threads.lock().drain(..) {
            let _ = t.join();
        }
        if let Err(e) = self.gc.close() {
            tracing::warn!(error = %e, "closing the cleaner segment");
        }
    }
}

impl Drop for Dpm {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DpmConfigFile;

    /// ForwardWrites checks the caller's session on a runtime worker, while a registration's
    /// or a MergeAll's merge holds the sessions lock for as long as the backups take to
    /// acknowledge what it ships: the check must not wait for that lock (with every worker
    /// waiting there, nothing else the node serves would be answered until the merge ended).
    #[test]
    fn a_session_check_does_not_wait_for_a_merge_holding_the_sessions() {
        let dir = tempfile::tempdir().unwrap();
        let config = DpmConfigFile {
            pool_size: "64MiB".parse().unwrap(),
            segment_size: "256KiB".parse().unwrap(),
            initial_index_buckets: 64,
            ..DpmConfigFile::in_process(dir.path().join("pool"))
        };
        let dpm = Dpm::open(config.validate().unwrap()).unwrap();
        let epoch = dpm.register_kn(Some(1), "test").unwrap().epoch;

        let merging = dpm.sessions.lock();
        let (tx, rx) = std::sync::mpsc::channel();
        let d = dpm.clone();
        let checker = std::thread::spawn(move || {
            let _ = tx.send(d.check_session(1, epoch));
        });
        let answered = rx.recv_timeout(Duration::from_secs(5));
        drop(merging);
        checker.join().unwrap();
        assert!(
            matches!(answered, Ok(Ok(()))),
            "the check waited for the sessions lock (or refused): {answered:?}"
        );

        assert!(matches!(
            dpm.check_session(1, epoch + 1),
            Err(DpmError::NoSession { .. })
        ));
        dpm.fence_kn(1).unwrap();
        assert!(dpm.check_session(1, epoch).is_err(), "a fenced session");
        let again = dpm.register_kn(Some(1), "test").unwrap().epoch;
        dpm.check_session(1, again).unwrap();
        dpm.shutdown();
    }
}
