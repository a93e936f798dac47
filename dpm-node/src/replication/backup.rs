//! The backup's side of replication: a pool that only the primary writes, through a tcp fabric
//! NIC, and the term that fences primaries.
//!
//! A backup runs no merge, no GC, no metadata: its CPU does nothing per write but the NIC task
//! applying the primary's WRITEs (on RDMA that would be the NIC itself). Its pool is a byte
//! mirror of the primary's (same layout, same offsets), so promoting it is opening it as a
//! primary: the recovery that runs after a power failure.
//!
//! Invariants:
//! - The term only grows, and is durable (`<pool>.term`, [`super::term_file`], with the primary instance that took
//!   it and the replica-set generation it told) before an attach is answered: a primary of an
//!   older term, or of the same term but another instance, is refused, even after a restart
//!   of the backup. The generation never goes down for the start it belongs to.
//! - A primary whose pool image ([`super::image`]: the term under which its pool last served,
//!   the start that took it and the set's generation, recorded in the pool and copied with
//!   it) is older than what was accepted here is refused (`StaleImage`, `SupersededImage`),
//!   unless it is the primary accepted here or that pool started again (`previous`): another
//!   primary served since its image, or its pool left the set before writes this backup holds
//!   were acknowledged, and copying it over this pool would lose them.
//! - A promotion ([`Backup::promote`]) needs a complete copy; it records the term and the role
//!   (`<pool>.role`, [`RecordedRole`], [`super::role_file`]) durably before it revokes the old primary's key, all
//!   under the state lock in one blocking task, and no primary attaches a promoted backup.
//! - An attach revokes every key of the backup's grant table before anything else, so once it
//!   returns, no WRITE of the previous primary lands any more (the revoke waits for posts in
//!   progress, as for KNs).
//! - An attach that asks for an incremental copy keeps the pool the backup holds, if it has
//!   the asked size, and answers the digest of each chunk ([`super::digest`]), taken after the
//!   revoke: from then on only the attaching primary writes the pool, so the digests describe
//!   what its copy starts from. Any other attach (an older primary, another size, no pool yet)
//!   starts from a fresh, zero-filled pool (a new file renamed over the old one, so a
//!   connection of the previous primary still mapping the old file never sees it shrink).
//!   The primary then copies the chunks that differ (or every non-zero chunk).
//! - The copy marker `<pool>.copy` ([`CopyMarker`], [`super::copy_marker`]) says whether the pool holds a consistent
//!   image. An attach makes it durably say `incomplete` (with the term, the primary instance
//!   and a copy number drawn for this attach) before it revokes, zeroes or replaces anything;
//!   only the CopyComplete call of that same copy (term, instance and copy number all current)
//!   turns it into `complete`, durably, before it is answered. The primary makes that call when
//!   the backup has caught up, and reports the backup in sync only once it succeeded. The
//!   marker can turn `incomplete` again afterwards (a new attach), before the primary notices:
//!   whoever promotes a backup reads its marker again.
//! - `complete` means "a consistent image": one a power failure of the primary could have left
//!   at some past moment (every chunk copied, then a prefix of the primary's later records). It
//!   does not mean up to date: a backup that failed, or stopped, after its copy was complete
//!   holds an older image, still consistent, and its marker still says `complete`. A primary
//!   refuses to open a pool whose marker says `incomplete` (a mix of copied chunks with
//!   zeroed ones, or with chunks of an older image the incremental copy had not replaced yet)
//!   unless told to accept the loss ([`crate::dpm::Dpm::open`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dinomo_fabric::grants::{GrantTable, WindowRange};
use dinomo_fabric::tcp::TcpNic;
use dinomo_fabric::{AccessKey, Durability, DurabilityRequest, PmRegion};

use super::copy_marker::{
    copy_marker_path, read_copy_marker, write_copy_marker, CopyMarker, CopyState,
};
use super::digest;
use super::image::{refusal, Accepted, Claim, ImageId, Refusal};
use super::role_file::{role_path, write_role, RecordedRole};
use super::term_file::{read_accepted, write_accepted};
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
    /// Shared so that an attach's blocking work can own the lock (see `attach`).
    state: Arc<tokio::sync::Mutex<State>>,
    /// Set once by [`Backup::promote`]: the process then serves as the primary.
    promotion: Arc<tokio::sync::watch::Sender<Option<Promotion>>>,
    /// Configured for verbs ([`fabric_once_promoted`]): a copy it could not serve over verbs
    /// once promoted is warned about, and its promotion refused
    /// ([`Backup::serving_verbs_once_promoted`]).
    serves_verbs: bool,
}

/// What a promoted backup's process starts the primary with (see [`Backup::promote`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Promotion {
    /// The gRPC addresses of the new primary's backups.
    pub backups: Vec<String>,
    /// Where the backup's fabric NIC listened, if a primary attached it in this process's
    /// life: the new primary's NIC serves KNs there (its advertised address is the backup's).
    pub fabric: Option<SocketAddr>,
}

impl Promotion {
    /// The backup's `config` turned into its primary's: same pool, gRPC at `grpc` (the address
    /// the backup served on, port 0 resolved), the fabric the promoted primary serves
    /// ([`fabric_once_promoted`]) at the backup's NIC address, replicating to the promotion's
    /// backups. The pool exists: never formatted.
    pub fn apply(&self, config: &mut crate::config::DpmConfig, grpc: SocketAddr) {
        config.role = crate::config::ReplicaRole::Primary;
        config.listen = grpc;
        if let Some(fabric) = self.fabric {
            config.fabric_listen = fabric;
        }
        config.fabric = fabric_once_promoted(config.fabric);
        config.backups = self.backups.clone();
        config.create = false;
    }
}

/// The fabric a backup configured with `configured` serves its KNs once promoted. The mirror
/// link from its primary is the tcp NIC whatever the setting, so the setting says only what
/// comes after: `verbs` (the backup has an RDMA device, as its primary's KNs do) serves
/// verbs; anything else serves tcp, which reaches KNs on any host (a backup's pool is its own
/// file, so shm KNs, which map the primary's pool, could not follow it there).
pub fn fabric_once_promoted(configured: crate::config::FabricKind) -> crate::config::FabricKind {
    use crate::config::FabricKind;
    match configured {
        FabricKind::Verbs => FabricKind::Verbs,
        FabricKind::Shm | FabricKind::Tcp => FabricKind::Tcp,
    }
}

#[derive(Debug, Default)]
struct State {
    term: u64,
    /// The primary instance that attached with `term`.
    instance: u64,
    /// The newest replica-set generation that primary told this backup (see [`super::image`]).
    generation: u64,
    /// The oldest image it takes, when not that start's ([`Accepted::floor`]).
    floor: Option<ImageId>,
    /// The number of the copy the current attach started (0: none since this process
    /// started; see [`CopyMarker::copy`]).
    copy: u64,
    primary: String,
    nic: Option<TcpNic>,
    region: Option<Arc<PmRegion>>,
    /// Promoted: no primary attaches it any more.
    promoted: bool,
    /// The process's lock of the pool ([`crate::pool_lock`]), when a server runs this backup:
    /// here so that an attach's blocking work, which owns this state, keeps it.
    pool_lock: Option<Arc<crate::pool_lock::PoolLock>>,
}

impl State {
    fn accepted(&self) -> Accepted {
        Accepted {
            term: self.term,
            instance: self.instance,
            generation: self.generation,
            floor: self.floor,
        }
    }
}

/// What an attach answers: where the primary writes, and with which key.
#[derive(Debug, Clone)]
pub struct Attached {
    pub fabric: String,
    pub key: AccessKey,
    /// The number of the copy this attach started (its CopyComplete names it).
    pub copy: u64,
    /// The digests of the pool's chunks, when the attach asked for them ([`Incremental`]).
    pub chunk_digests: Vec<u8>,
}

/// An attach's request for an incremental copy: keep the pool, answer its chunks' digests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Incremental {
    pub chunk_bytes: u64,
    pub key: digest::Key,
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
        // The term and the copy marker are files beside the pool; beside a device that is
        // /dev, which a reboot empties: the backup would then accept a primary it had fenced,
        // and a half-finished copy would open as a primary's pool without the refusal.
        if dinomo_fabric::pm::DaxDevice::probe(&pool_path)?.is_some() {
            return Err(DpmError::Config(format!(
                "{} is a device-DAX device: a backup keeps its term and copy marker in files \
                 beside its pool, and beside a device they would be in /dev, which a reboot \
                 empties; give the backup a pool file instead",
                pool_path.display()
            )));
        }
        let accepted = read_accepted(&pool_path)?;
        let grants = Arc::new(GrantTable::create(&GrantTable::path_for(&pool_path), 4)?);
        tracing::info!(pool = %pool_path.display(), term = accepted.term, generation = accepted.generation, "backup ready: waiting for a primary to attach");
        Ok(Backup {
            pool_path,
            durability,
            fabric_listen,
            fabric_advertise,
            grants,
            state: Arc::new(tokio::sync::Mutex::new(State {
                term: accepted.term,
                instance: accepted.instance,
                generation: accepted.generation,
                floor: accepted.floor,
                ..State::default()
            })),
            promotion: Arc::new(tokio::sync::watch::channel(None).0),
            serves_verbs: false,
        })
    }

    pub async fn term(&self) -> u64 {
        self.state.lock().await.term
    }

    /// The primary start this backup follows and the newest generation it was told.
    pub async fn accepted(&self) -> Accepted {
        self.state.lock().await.accepted()
    }

    pub async fn primary(&self) -> String {
        self.state.lock().await.primary.clone()
    }

    /// What this backup's copy marker says now (read from the file, as whoever promotes the
    /// backup reads it).
    pub async fn copy_marker(&self) -> Result<Option<CopyMarker>> {
        let pool = self.pool_path.clone();
        tokio::task::spawn_blocking(move || read_copy_marker(&pool))
            .await
            .map_err(|e| DpmError::Io(std::io::Error::other(e)))?
    }

    /// Makes this backup one that serves verbs once promoted. It then checks that this process
    /// may pin its pool for the primary's KNs ([`crate::verbs_pins`]): when a copy completes
    /// it warns if not (keeping the copy: a complete image is durability), and a Promote is
    /// refused if not (NotPromotable, so whoever promotes tries another backup), instead of
    /// promoting a node whose start would then refuse. The start-up probe cannot find this:
    /// it is one page.
    pub fn serving_verbs_once_promoted(mut self, verbs: bool) -> Self {
        self.serves_verbs = verbs;
        self
    }

    /// Why a Promote would be refused for the pin budget now (see
    /// [`Backup::serving_verbs_once_promoted`]), for its status; `None` when it would not be
    /// (or the backup is not configured for verbs).
    pub async fn pin_refusal(&self) -> Option<String> {
        if !self.serves_verbs {
            return None;
        }
        let pool = self.pool_path.clone();
        tokio::task::spawn_blocking(move || crate::verbs_pins::check_pool(&pool).err())
            .await
            .ok()
            .flatten()
            .map(|why| cannot_serve_verbs(&why))
    }

    /// Becomes the backup of `primary` (instance `instance`) for `term` (see the module doc);
    /// with `incremental`, keeps a pool of `pool_bytes` it holds and answers its digests.
    // The attaching primary's identity (term, instance, image, previous start) and the copy
    // it asks for: each is checked on its own.
    #[allow(clippy::too_many_arguments)]
    pub async fn attach(
        &self,
        term: u64,
        instance: u64,
        image: Claim,
        previous: Option<(u64, u64)>,
        pool_bytes: u64,
        primary: &str,
        incremental: Option<Incremental>,
    ) -> Result<Attached> {
        let mut st = self.state.clone().lock_owned().await;
        // Promoted: this process is becoming a primary of a later term.
        if st.promoted || term < st.term || (term == st.term && instance != st.instance) {
            return Err(DpmError::StaleTerm {
                given: term,
                current: st.term,
            });
        }
        // The primary this backup accepted may attach it again whatever its image's term (it
        // is older than its own term until a backup accepted that), and so may that primary's
        // pool started again (its previous start is the one accepted here, and nothing since:
        // nobody acknowledged anything under a later term here).
        let accepted_here = (st.term, st.instance);
        let same_start = (term, instance) == accepted_here;
        let current_primary = same_start || previous == Some(accepted_here);
        if let Some(why) = refusal(st.accepted(), image).filter(|_| !current_primary) {
            return Err(match why {
                Refusal::OlderTerm { image, accepted } => DpmError::StaleImage {
                    image,
                    current: accepted,
                },
                why => DpmError::SupersededImage {
                    detail: why.to_string(),
                },
            });
        }
        if pool_bytes == 0 || pool_bytes > MAX_POOL_BYTES || !pool_bytes.is_multiple_of(4096) {
            return Err(DpmError::Config(format!(
                "a backup pool of {pool_bytes} bytes: expected a multiple of 4096 up to {MAX_POOL_BYTES}"
            )));
        }
        if let Some(inc) = incremental {
            if !digest::valid_chunk_bytes(pool_bytes, inc.chunk_bytes) {
                return Err(DpmError::Config(format!(
                    "an incremental copy in chunks of {} bytes: expected a power of two of at \
                     least {} bytes, cutting the pool of {pool_bytes} bytes in at most {} chunks",
                    inc.chunk_bytes,
                    digest::MIN_CHUNK_BYTES,
                    digest::MAX_CHUNKS
                )));
            }
        }
        // Durably "incomplete" before anything of the previous image is touched: from here
        // until CopyComplete of this copy, the pool is not a consistent image.
        let copy = rand::random::<u64>() | 1;
        write_copy_marker(
            &self.pool_path,
            CopyMarker {
                state: CopyState::Incomplete,
                term,
                instance,
                copy,
            },
        )?;
        // Only now (the state lock is held throughout, so no CopyComplete comes between): a
        // failed marker write leaves the previous copy and its pending confirmation alone.
        st.copy = 0;
        // The generation this primary's image has (a re-attach by the same start never lowers
        // what it told before; a new start's history is the caller's image).
        let generation = match image.generation {
            Some(g) if same_start => g.max(st.generation),
            Some(g) => g,
            None if same_start => st.generation,
            None => 0,
        };
        // Following this primary from now on: the oldest image taken is its start's.
        write_accepted(
            &self.pool_path,
            Accepted {
                term,
                instance,
                generation,
                floor: None,
            },
        )?;
        st.term = term;
        st.instance = instance;
        st.generation = generation;
        st.floor = None;
        // The previous primary's WRITEs end here (the revoke waits for posts in progress).
        self.grants.revoke_all()?;
        st.nic = None;
        st.region = None;
        let (region, chunk_digests) = match incremental {
            None => (
                fresh_pool(&self.pool_path, pool_bytes, self.durability)?,
                Vec::new(),
            ),
            Some(inc) => {
                let (path, durability) = (self.pool_path.clone(), self.durability);
                // The state lock goes with the work: if this call is dropped (the primary's
                // deadline passed), the work goes on, and the next attach waits for it
                // instead of digesting (or replacing) the same pool at the same time.
                let (guard, kept) = tokio::task::spawn_blocking(move || {
                    let kept = kept_pool(&path, pool_bytes, durability, inc);
                    (st, kept)
                })
                .await
                .map_err(|e| DpmError::Io(std::io::Error::other(e)))?;
                st = guard;
                kept?
            }
        };
        let region = Arc::new(region);
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
        if incremental.is_some() {
            tracing::info!(term, %primary, %fabric, pool_bytes, "attached to a primary: it copies the chunks of the pool that differ from its own");
        } else {
            tracing::info!(term, %primary, %fabric, pool_bytes, "attached to a primary: the pool starts over and is copied from it");
        }
        st.primary = primary.to_string();
        st.nic = Some(nic);
        st.region = Some(region);
        st.copy = copy;
        Ok(Attached {
            fabric,
            key,
            copy,
            chunk_digests,
        })
    }

    /// Keeps `lock` until the last user of this backup's state is done with it.
    pub async fn hold_pool_lock(&self, lock: Arc<crate::pool_lock::PoolLock>) {
        self.state.lock().await.pool_lock = Some(lock);
    }

    /// The promotion, once [`Backup::promote`] succeeded (`None` before).
    pub fn promotion(&self) -> tokio::sync::watch::Receiver<Option<Promotion>> {
        self.promotion.subscribe()
    }

    /// Makes this backup the primary (a failover its caller decided; see `Promote` in
    /// proto/dpm.proto): refused unless its copy marker says `complete` (a consistent image)
    /// and, configured for verbs, this process may pin the pool for a KN
    /// ([`Backup::serving_verbs_once_promoted`]).
    /// Records a term after both the accepted one and `min_term` durably (a primary of an
    /// older term, such as the old primary restarted meanwhile, is refused
    /// from now on, here and, once the new primary attached them, at the other backups),
    /// revokes the old primary's key (the revoke waits for its posts in progress) and stops
    /// the NIC; then publishes the [`Promotion`], on which the process stops serving as a
    /// backup and starts the primary on this pool, which takes a later term still.
    /// Returns the term recorded and the term of the primary whose copy the pool holds.
    pub async fn promote(&self, backups: Vec<String>, min_term: u64) -> Result<(u64, u64)> {
        let st = self.state.clone().lock_owned().await;
        let (pool, grants, promotion, serves_verbs) = (
            self.pool_path.clone(),
            self.grants.clone(),
            self.promotion.clone(),
            self.serves_verbs,
        );
        // All of it in one blocking task that owns the state: a call dropped on the way (its
        // caller's deadline passed) cannot leave the term and role written but the old
        // primary's key alive, nor the process a backup.
        tokio::task::spawn_blocking(move || {
            promote_locked(
                st,
                &pool,
                &grants,
                &promotion,
                backups,
                min_term,
                serves_verbs,
            )
        })
        .await
        .map_err(|e| DpmError::Io(std::io::Error::other(e)))?
    }

    /// Records durably that the replica set of the primary `term`/`instance`, which this
    /// backup follows, reached `generation` (a counted backup left it: see [`super::image`]). Its
    /// primary waits for this before the removal takes effect, so a write acknowledged after
    /// the removal is on a backup that knows the generation. Refused
    /// ([`DpmError::StaleTerm`]) from any other primary; never lowers what was recorded.
    pub async fn record_generation(&self, term: u64, instance: u64, generation: u64) -> Result<()> {
        let mut st = self.state.clone().lock_owned().await;
        if st.promoted || (term, instance) != (st.term, st.instance) {
            return Err(DpmError::StaleTerm {
                given: term,
                current: st.term,
            });
        }
        if generation <= st.generation {
            return Ok(());
        }
        let mut accepted = st.accepted();
        accepted.generation = generation;
        let pool = self.pool_path.clone();
        // Off the runtime's threads (see `copy_complete`), the state lock going with the work.
        let st = tokio::task::spawn_blocking(move || {
            write_accepted(&pool, accepted).map(|()| {
                st.generation = generation;
                st
            })
        })
        .await
        .map_err(|e| DpmError::Io(std::io::Error::other(e)))??;
        drop(st);
        tracing::info!(term, generation, "the replica set's generation grew (a backup left it): images of an older generation of this term are refused from now on");
        Ok(())
    }

    /// Records durably that the copy `copy` of `term`/`instance` is complete (the primary saw
    /// this backup catch up; see the module doc), and the replica set's `generation` then (the
    /// `.term` first). Refused ([`DpmError::StaleCopy`]) unless all three name the current
    /// attach: a deposed primary, or a late call about an earlier copy, must not mark a newer
    /// copy complete.
    pub async fn copy_complete(
        &self,
        term: u64,
        instance: u64,
        copy: u64,
        generation: Option<u64>,
    ) -> Result<()> {
        let mut st = self.state.lock().await;
        if (term, instance, copy) != (st.term, st.instance, st.copy) || st.nic.is_none() {
            return Err(DpmError::StaleCopy {
                detail: format!(
                    "asked to mark copy {copy} of term {term} (primary instance {instance}) \
                     complete, but the copy in progress here is {} of term {} (instance {})",
                    st.copy, st.term, st.instance
                ),
            });
        }
        // Files and fsyncs off the runtime's threads: the NIC tasks applying the primary's
        // WRITEs share them, and a slow fsync must not delay their answers.
        let pool = self.pool_path.clone();
        let marker = CopyMarker {
            state: CopyState::Complete,
            term,
            instance,
            copy,
        };
        let raised = generation
            .filter(|&g| g > st.generation)
            .map(|generation| Accepted {
                generation,
                ..st.accepted()
            });
        let serves_verbs = self.serves_verbs;
        tokio::task::spawn_blocking(move || {
            if let Some(a) = raised {
                write_accepted(&pool, a)?;
            }
            write_copy_marker(&pool, marker)?;
            if serves_verbs {
                if let Some(why) = crate::verbs_pins::refusal_for_pool(&pool, "once promoted, this backup") {
                    tracing::warn!(error = %why, "this backup holds a complete copy, but once promoted it could not serve it over verbs: a promotion is refused until that is fixed (it keeps the copy, which a promotion with fabric = \"tcp\" serves)");
                }
            }
            Ok::<_, DpmError>(())
        })
        .await
        .map_err(|e| DpmError::Io(std::io::Error::other(e)))??;
        if let Some(a) = raised {
            st.generation = a.generation;
        }
        tracing::info!(term, copy, "the copy of the primary's pool is complete: this pool holds a consistent image from now on");
        Ok(())
    }
}

/// Why a backup configured for verbs is not promoted when its process could not pin its pool
/// (`why`): for the Promote refusal and the backup's status alike.
fn cannot_serve_verbs(why: &str) -> String {
    format!(
        "configured for verbs, it could not serve its pool over verbs once promoted: {why} (or \
         run it with fabric = \"tcp\")"
    )
}

/// [`Backup::promote`]'s work, under the backup's state lock.
fn promote_locked(
    mut st: tokio::sync::OwnedMutexGuard<State>,
    pool: &Path,
    grants: &GrantTable,
    promotion: &tokio::sync::watch::Sender<Option<Promotion>>,
    backups: Vec<String>,
    min_term: u64,
    serves_verbs: bool,
) -> Result<(u64, u64)> {
    if st.promoted {
        return Err(DpmError::BeingPromoted);
    }
    let marker_path = copy_marker_path(pool);
    let copy_term = match read_copy_marker(pool) {
        // A marker of another copy than the one in progress here was written by a late
        // CopyComplete of an earlier copy: it says nothing of what the pool holds now.
        Ok(Some(m)) if m.state == CopyState::Complete && st.copy != 0 && m.copy != st.copy => {
            return Err(DpmError::NotPromotable {
                detail: format!(
                    "its copy marker {} says copy {} is complete, but the copy in progress \
                     here is {}: its pool is not known to be a consistent image",
                    marker_path.display(),
                    m.copy,
                    st.copy
                ),
            })
        }
        Ok(Some(m)) if m.state == CopyState::Complete => m.term,
        Ok(Some(m)) => {
            return Err(DpmError::NotPromotable {
                detail: format!(
                    "its copy marker {} says {} (a copy started under term {} that never \
                     finished): its pool is not a consistent image, and serving it would lose \
                     acknowledged writes; promote a backup whose copy is complete (`dinomo \
                     status` shows each backup's)",
                    marker_path.display(),
                    m.state.as_str(),
                    m.term
                ),
            })
        }
        Ok(None) => {
            return Err(DpmError::NotPromotable {
                detail: format!(
                    "it has no copy marker ({}): no primary copied its pool since it was made \
                     or last opened as a primary's",
                    marker_path.display()
                ),
            })
        }
        Err(e) => {
            return Err(DpmError::NotPromotable {
                detail: format!("its copy marker cannot be read: {e}"),
            })
        }
    };
    // Configured for verbs, it would serve the pool over verbs: a node that could not pin it
    // would record the role and then refuse to start, again at every restart.
    if serves_verbs {
        if let Some(why) = crate::verbs_pins::refusal_for_pool(pool, "once promoted, this backup") {
            return Err(DpmError::NotPromotable {
                detail: cannot_serve_verbs(&why),
            });
        }
    }
    if backups.is_empty() {
        return Err(DpmError::NotPromotable {
            detail: "name at least one backup for it: a primary takes a term, which fences the \
                     old one, only at the backups it attaches (to run a pool alone, stop this \
                     node and start a dpm-node without --backup on its pool)"
                .into(),
        });
    }
    // Strictly after the old primary's: that one, restarted meanwhile on its pool, takes the
    // next term after its own and is then older than this promotion's primary, so the two
    // never tie (a tie deposed both; see `Primary::add_backup`).
    let term = st.term.max(min_term) + 1;
    // The term first: from then on no primary older than the promotion attaches it. Then the
    // role, so that a restart (of the process, of its pod) comes back as the primary even if
    // it happens before the answer. A later failure takes the role back (the node stays a
    // backup, of the newer term).
    // The image it takes as a floor stays its copy's (should the promotion fail, or this node
    // be deposed before a backup accepts its primary, a backup promoted from a copy of the same
    // image still attaches it).
    let floor = Some(st.accepted().image_floor());
    write_accepted(
        pool,
        Accepted {
            term,
            floor,
            ..st.accepted()
        },
    )?;
    st.floor = floor;
    st.term = term;
    write_role(
        pool,
        &RecordedRole::Primary {
            backups: backups.clone(),
        },
    )?;
    // The old primary's WRITEs end here (the revoke waits for posts in progress).
    if let Err(e) = grants.revoke_all() {
        // Durably a backup again (the raised term stays: it only refuses older primaries).
        if let Err(undo) = write_role(pool, &RecordedRole::Backup) {
            tracing::error!(error = %undo, file = %role_path(pool).display(), "cannot take the promotion back: delete the file before this node starts again, or it starts as the primary");
        }
        return Err(e.into());
    }
    st.promoted = true;
    let fabric = st.nic.take().map(|nic| nic.local_addr());
    st.region = None;
    st.primary.clear();
    tracing::warn!(
        term,
        copy_term,
        ?backups,
        "promoted: this backup stops serving as one and starts as the primary on its pool"
    );
    promotion.send_replace(Some(Promotion { backups, fabric }));
    Ok((term, copy_term))
}

/// A zero-filled pool of `len` bytes at `path`: a new file renamed over the old one (a backup's
/// pool is never a device: see [`Backup::new`]).
fn fresh_pool(path: &Path, len: u64, durability: DurabilityRequest) -> Result<PmRegion> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".new");
    let tmp = PathBuf::from(tmp);
    let region = PmRegion::create(&tmp, len, durability)?;
    std::fs::rename(&tmp, path)?;
    Ok(region)
}

/// The pool for an incremental copy and its chunks' digests: the pool file as it is, if it has
/// `len` bytes (what an earlier copy, or an earlier life as a primary, left there: the
/// primary compares before it skips anything); else a fresh one, whose digests need no read.
/// A kept pool that cannot be read whole (an I/O error) is replaced by a fresh one: a full
/// copy instead of a backup that cannot attach.
fn kept_pool(
    path: &Path,
    len: u64,
    durability: DurabilityRequest,
    inc: Incremental,
) -> Result<(PmRegion, Vec<u8>)> {
    let existing = std::fs::metadata(path)
        .ok()
        .filter(|m| m.is_file() && m.len() == len);
    if existing.is_some() {
        let started = Instant::now();
        let region = PmRegion::open(path, durability)?;
        // A pool that only promises to survive a process crash is never synced, for its
        // copied chunks either: syncing it here (all the dirty pages an earlier life left)
        // would buy nothing it promises.
        let sync = !matches!(
            region.durability(),
            Durability::ProcessCrash | Durability::SimulatedPowerLoss
        );
        let digests = std::fs::File::open(path)
            .and_then(|f| digest::file_digests(&f, len, inc.chunk_bytes, &inc.key, sync));
        // On DAX the sync flushes no CPU cache line (a MAP_SYNC mapping's stores are not
        // tracked as dirty): what an earlier life stored and did not flush is flushed here.
        if digests.is_ok() && matches!(region.durability(), Durability::Dax(_)) {
            region.persist(0, len)?;
        }
        match digests {
            Ok(digests) => {
                tracing::info!(pool = %path.display(), took_ms = started.elapsed().as_millis() as u64, "kept the pool for an incremental copy and digested its chunks");
                return Ok((region, digests));
            }
            Err(e) => {
                drop(region);
                tracing::warn!(pool = %path.display(), error = %e, "the pool could not be read to keep it: starting from zeroes (the primary copies all of it)");
            }
        }
    }
    let region = fresh_pool(path, len, durability)?;
    Ok((region, digest::zero_digests(len, inc.chunk_bytes, &inc.key)))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replication::copy_marker::remove_copy_marker;
    use crate::replication::role_file::{demote, read_role};
    use crate::replication::term_file::{note_own_image, term_path};

    fn backup(dir: &Path) -> Backup {
        Backup::new(
            dir.join("pool"),
            DurabilityRequest::ProcessCrash,
            "127.0.0.1:0".parse().unwrap(),
            String::new(),
        )
        .unwrap()
    }

    /// The image claim of a primary that sends only its image's term.
    fn term_claim(term: u64) -> Claim {
        Claim {
            term: Some(term),
            ..Claim::default()
        }
    }

    fn term_image(term: u64) -> ImageId {
        ImageId {
            term,
            ..ImageId::default()
        }
    }

    fn marker(dir: &Path) -> CopyMarker {
        read_copy_marker(&dir.join("pool")).unwrap().unwrap()
    }

    /// An attach marks the copy incomplete before it answers; only a CopyComplete naming the
    /// current term, instance and copy turns it complete, and a restarted backup (whose pool
    /// no primary writes any more) refuses every one.
    #[tokio::test]
    async fn only_the_current_copy_is_marked_complete() {
        let dir = tempfile::tempdir().unwrap();
        let b = backup(dir.path());
        assert_eq!(read_copy_marker(&dir.path().join("pool")).unwrap(), None);
        let a = b
            .attach(3, 11, Claim::default(), None, 1 << 20, "p:1", None)
            .await
            .unwrap();
        let m = marker(dir.path());
        assert_eq!(
            (m.state, m.term, m.instance, m.copy),
            (CopyState::Incomplete, 3, 11, a.copy)
        );
        for (term, instance, copy) in [(2, 11, a.copy), (3, 12, a.copy), (3, 11, a.copy ^ 2)] {
            let e = b
                .copy_complete(term, instance, copy, None)
                .await
                .unwrap_err();
            assert!(matches!(e, DpmError::StaleCopy { .. }), "{e}");
            assert_eq!(marker(dir.path()).state, CopyState::Incomplete);
        }
        b.copy_complete(3, 11, a.copy, None).await.unwrap();
        assert_eq!(marker(dir.path()).state, CopyState::Complete);

        // A new attach (even of the same primary) starts a new copy: incomplete again, and
        // the earlier copy's CopyComplete no longer counts.
        let again = b
            .attach(3, 11, Claim::default(), None, 1 << 20, "p:1", None)
            .await
            .unwrap();
        assert_ne!(again.copy, a.copy);
        assert_eq!(marker(dir.path()).state, CopyState::Incomplete);
        assert!(b.copy_complete(3, 11, a.copy, None).await.is_err());
        assert_eq!(marker(dir.path()).state, CopyState::Incomplete);
        drop(b);

        let restarted = backup(dir.path());
        assert!(restarted
            .copy_complete(3, 11, again.copy, None)
            .await
            .is_err());
        assert_eq!(marker(dir.path()).state, CopyState::Incomplete);
    }

    /// A primary whose pool image is older than the term the backup accepted is refused (a
    /// deposed primary back on its old pool, a new empty one), unless it is the primary the
    /// backup accepted; one whose image is as new is attached; an older primary (no image
    /// term) is not checked.
    #[tokio::test]
    async fn a_primary_with_an_older_image_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let b = backup(dir.path());
        let len = 1 << 20;
        b.attach(3, 11, term_claim(0), None, len, "p:1", None)
            .await
            .unwrap();
        for (term, instance, image) in [(4, 12, 2), (4, 12, 0)] {
            let e = b
                .attach(term, instance, term_claim(image), None, len, "p:2", None)
                .await
                .unwrap_err();
            assert!(
                matches!(e, DpmError::StaleImage { image: i, current: 3 } if i == image),
                "{e}"
            );
        }
        assert_eq!(b.term().await, 3, "a refused attach changes nothing");
        // The accepted primary again, its image still older than its term.
        b.attach(3, 11, term_claim(2), None, len, "p:1", None)
            .await
            .unwrap();
        // A primary promoted from a copy of term 3's image.
        b.attach(4, 12, term_claim(3), None, len, "p:2", None)
            .await
            .unwrap();
        // Term 4's primary served: term 3's image is stale now, whatever term it takes.
        assert!(matches!(
            b.attach(5, 13, term_claim(3), None, len, "p:1", None).await,
            Err(DpmError::StaleImage {
                image: 3,
                current: 4
            })
        ));
        assert!(b
            .attach(6, 14, Claim::default(), None, len, "p:3", None)
            .await
            .is_ok());
        assert!(matches!(
            b.attach(7, 15, term_claim(5), None, len, "p:4", None).await,
            Err(DpmError::StaleImage { .. })
        ));
        // The pool of term 6's primary started again before it recorded its image term: its
        // previous start is the one accepted here, so it is taken back; once a later one was
        // accepted, no longer.
        b.attach(7, 15, term_claim(5), Some((6, 14)), len, "p:3", None)
            .await
            .unwrap();
        assert!(matches!(
            b.attach(8, 17, term_claim(5), Some((6, 14)), len, "p:3", None)
                .await,
            Err(DpmError::StaleImage { .. })
        ));
    }

    /// A backup told that a counted backup left the set (a new generation) refuses the image
    /// of the removed one (same term and start, older generation), and that of another start
    /// of the term it accepted; the generation is durable and never lowered; only the primary
    /// it follows may raise it.
    #[tokio::test]
    async fn a_removed_backups_older_generation_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let b = backup(dir.path());
        let len = 1 << 20;
        let claim = |term, instance, generation| Claim {
            term: Some(term),
            instance: Some(instance),
            generation: Some(generation),
        };
        let a = b
            .attach(3, 11, claim(2, 9, 0), None, len, "p:1", None)
            .await
            .unwrap();
        b.copy_complete(3, 11, a.copy, Some(1)).await.unwrap();
        assert_eq!(b.accepted().await.generation, 1);
        assert!(matches!(
            b.record_generation(3, 13, 5).await,
            Err(DpmError::StaleTerm { .. })
        ));
        b.record_generation(3, 11, 2).await.unwrap();
        b.record_generation(3, 11, 1).await.unwrap();
        let want = Accepted {
            term: 3,
            instance: 11,
            generation: 2,
            floor: None,
        };
        assert_eq!(b.accepted().await, want, "never lowered");
        drop(b);
        let b = backup(dir.path());
        assert_eq!(b.accepted().await, want, "durable");

        // A backup removed at generation 1, promoted: its image is term 3's, start 11's,
        // generation 1.
        let e = b
            .attach(4, 15, claim(3, 11, 1), None, len, "removed", None)
            .await
            .unwrap_err();
        assert!(
            matches!(&e, DpmError::SupersededImage { detail } if detail.contains("generation 1 of term 3")),
            "{e}"
        );
        let e = b
            .attach(4, 15, claim(3, 17, 2), None, len, "rival", None)
            .await
            .unwrap_err();
        assert!(
            matches!(&e, DpmError::SupersededImage { detail } if detail.contains("another start of term 3")),
            "{e}"
        );
        assert_eq!(b.accepted().await, want, "a refused attach changes nothing");
        // The primary it follows, re-attaching with an older claim, lowers nothing.
        b.attach(3, 11, claim(2, 9, 0), None, len, "p:1", None)
            .await
            .unwrap();
        assert_eq!(b.accepted().await, want);
        // A backup that stayed: accepted, and its generation carries on under the new term.
        b.attach(4, 15, claim(3, 11, 2), None, len, "stayed", None)
            .await
            .unwrap();
        assert_eq!(
            b.accepted().await,
            Accepted {
                term: 4,
                instance: 15,
                generation: 2,
                floor: None,
            }
        );
    }

    /// A promotion records a term after the old primary's, but keeps the image of its copy as
    /// the oldest it takes: started again as a backup (the promotion failed, or the node was
    /// deposed before a backup accepted its primary), a backup promoted from a copy of the same
    /// image attaches it; an older image is still refused. Once it served, its own image is
    /// the floor.
    #[tokio::test]
    async fn a_promoted_backup_keeps_its_copys_image_as_its_floor() {
        let dir = tempfile::tempdir().unwrap();
        let len = 1 << 20;
        let image = |term, instance, generation| Claim {
            term: Some(term),
            instance: Some(instance),
            generation: Some(generation),
        };
        let b = backup(dir.path());
        let a = b
            .attach(3, 11, image(2, 9, 0), None, len, "p:1", None)
            .await
            .unwrap();
        b.copy_complete(3, 11, a.copy, Some(1)).await.unwrap();
        let (term, copy_term) = b.promote(vec!["b:2".into()], 3).await.unwrap();
        assert_eq!((term, copy_term), (4, 3));
        drop(b);
        let floor = ImageId {
            term: 3,
            instance: 11,
            generation: 1,
        };
        assert_eq!(
            read_accepted(&dir.path().join("pool")).unwrap().floor,
            Some(floor)
        );
        let b = backup(dir.path());
        assert!(matches!(
            b.attach(4, 13, image(3, 11, 1), None, len, "rival", None)
                .await,
            Err(DpmError::StaleTerm { .. })
        ));
        assert!(matches!(
            b.attach(6, 13, image(3, 11, 0), None, len, "removed", None)
                .await,
            Err(DpmError::SupersededImage { .. })
        ));
        b.attach(6, 13, image(3, 11, 1), None, len, "promoted", None)
            .await
            .unwrap();
        assert_eq!(b.accepted().await.floor, None, "following the new primary");
        drop(b);

        // Once the promoted node serves as the primary (a backup accepted its term 5), its own
        // image is what it follows: run as a backup again, it refuses the term-3 images.
        let pool = dir.path().join("pool");
        let own = ImageId {
            term: 7,
            instance: 21,
            generation: 1,
        };
        note_own_image(&pool, own).unwrap();
        let b = backup(dir.path());
        assert_eq!(b.accepted().await.image_floor(), own);
        assert!(matches!(
            b.attach(8, 23, image(3, 11, 1), None, len, "old", None)
                .await,
            Err(DpmError::StaleImage { .. })
        ));
        // A pool that never was a backup's gets no file.
        let other = tempfile::tempdir().unwrap();
        note_own_image(&other.path().join("pool"), own).unwrap();
        assert!(!term_path(&other.path().join("pool")).exists());
    }

    /// A deposed primary recorded as a backup refuses every primary up to the deposing term
    /// minus one, and every image older than its own (an older term, another start of its
    /// term, an older generation), so nothing it acknowledged is overwritten; a later primary
    /// whose image is at least its own (one promoted from a copy of it) attaches it.
    #[tokio::test]
    async fn a_demoted_primary_refuses_older_images_than_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let pool = dir.path().join("pool");
        let len = 1 << 20;
        let own = ImageId {
            term: 5,
            instance: 7,
            generation: 1,
        };
        let claim = |term, instance, generation| Claim {
            term: Some(term),
            instance: Some(instance),
            generation: Some(generation),
        };
        demote(&pool, 5, own).unwrap();
        assert_eq!(read_role(&pool).unwrap(), Some(RecordedRole::Backup));
        let b = backup(dir.path());
        assert_eq!(b.term().await, 5);
        assert!(matches!(
            b.attach(5, 9, claim(5, 7, 1), None, len, "rival", None)
                .await,
            Err(DpmError::StaleTerm { .. })
        ));
        assert!(matches!(
            b.attach(8, 9, claim(4, 3, 5), None, len, "older", None)
                .await,
            Err(DpmError::StaleImage {
                image: 4,
                current: 5
            })
        ));
        for (instance, generation) in [(11, 1), (7, 0)] {
            assert!(matches!(
                b.attach(
                    8,
                    9,
                    claim(5, instance, generation),
                    None,
                    len,
                    "older",
                    None
                )
                .await,
                Err(DpmError::SupersededImage { .. })
            ));
        }
        // Promoted from a copy of its own image, or of a later one.
        b.attach(8, 11, claim(5, 7, 1), None, len, "promoted", None)
            .await
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let pool = dir.path().join("pool");
        // Deposed by term 9: primaries up to term 8 are refused, whatever their image.
        demote(&pool, 9, term_image(2)).unwrap();
        let b = backup(dir.path());
        assert_eq!(b.term().await, 8);
        assert!(matches!(
            b.attach(8, 13, term_claim(8), None, len, "older", None)
                .await,
            Err(DpmError::StaleTerm { .. })
        ));
        b.attach(9, 13, term_claim(8), None, len, "newer", None)
            .await
            .unwrap();
    }

    /// An attach asking for an incremental copy keeps the pool it finds (of the asked size)
    /// and answers its chunks' digests; one of another size starts from zeroes (and says so
    /// in its digests); an attach without it zeroes the pool, as older primaries expect; a
    /// chunk size that is not a power of two is refused.
    #[tokio::test]
    async fn an_incremental_attach_keeps_the_pool_and_digests_it() {
        let dir = tempfile::tempdir().unwrap();
        let pool = dir.path().join("pool");
        let b = backup(dir.path());
        let len = 2 << 20;
        let inc = Incremental {
            chunk_bytes: digest::chunk_bytes_for(len),
            key: [42; digest::KEY_BYTES],
        };
        b.attach(3, 11, Claim::default(), None, len, "p:1", None)
            .await
            .unwrap();
        // What the primary wrote through the NIC, as another mapping of the same file sees it.
        PmRegion::open(&pool, DurabilityRequest::ProcessCrash)
            .unwrap()
            .write_durable((1 << 20) + 64, b"held")
            .unwrap();
        let read_back = |at: u64| {
            let r = PmRegion::open(&pool, DurabilityRequest::ProcessCrash).unwrap();
            let mut got = [0u8; 4];
            r.read(at, &mut got).unwrap();
            got
        };

        let a = b
            .attach(4, 12, Claim::default(), None, len, "p:2", Some(inc))
            .await
            .unwrap();
        assert_eq!(read_back((1 << 20) + 64), *b"held", "the pool was not kept");
        let want = {
            let f = std::fs::File::open(&pool).unwrap();
            digest::file_digests(&f, len, inc.chunk_bytes, &inc.key, false).unwrap()
        };
        assert_eq!(a.chunk_digests, want);
        assert_ne!(
            a.chunk_digests,
            digest::zero_digests(len, inc.chunk_bytes, &inc.key)
        );

        let bad = Incremental {
            chunk_bytes: 3 << 20,
            ..inc
        };
        assert!(b
            .attach(4, 12, Claim::default(), None, len, "p:2", Some(bad))
            .await
            .is_err());

        let bigger = 4 << 20;
        let inc4 = Incremental {
            chunk_bytes: digest::chunk_bytes_for(bigger),
            key: inc.key,
        };
        let a = b
            .attach(4, 12, Claim::default(), None, bigger, "p:2", Some(inc4))
            .await
            .unwrap();
        assert_eq!(
            a.chunk_digests,
            digest::zero_digests(bigger, inc4.chunk_bytes, &inc.key)
        );
        assert_eq!(read_back((1 << 20) + 64), [0; 4]);

        PmRegion::open(&pool, DurabilityRequest::ProcessCrash)
            .unwrap()
            .write_durable(64, b"gone")
            .unwrap();
        let a = b
            .attach(4, 12, Claim::default(), None, bigger, "p:2", None)
            .await
            .unwrap();
        assert!(a.chunk_digests.is_empty());
        assert_eq!(
            read_back(64),
            [0; 4],
            "an attach without digests starts from zeroes"
        );
    }

    #[test]
    fn the_marker_format_is_versioned_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let pool = dir.path().join("pool");
        let m = CopyMarker {
            state: CopyState::Complete,
            term: 9,
            instance: 77,
            copy: 5,
        };
        write_copy_marker(&pool, m).unwrap();
        assert_eq!(read_copy_marker(&pool).unwrap(), Some(m));
        for (text, want) in [
            (
                "format 2\nstate complete\nterm 1\ninstance 1\ncopy 1\n",
                "format 2",
            ),
            (
                "state complete\nterm 1\ninstance 1\ncopy 1\n",
                "no \"format\"",
            ),
            (
                "format 1\nstate done\nterm 1\ninstance 1\ncopy 1\n",
                "\"done\"",
            ),
            ("format 1\nstate complete\ninstance 1\ncopy 1\n", "\"term\""),
        ] {
            std::fs::write(copy_marker_path(&pool), text).unwrap();
            let e = read_copy_marker(&pool).unwrap_err().to_string();
            assert!(e.contains(want) && e.contains("pool.copy"), "{text:?}: {e}");
        }
        remove_copy_marker(&pool).unwrap();
        remove_copy_marker(&pool).unwrap();
        assert_eq!(read_copy_marker(&pool).unwrap(), None);
    }

    /// A promoted backup serves verbs when it was configured for verbs (its KNs are on RDMA,
    /// and a Kubernetes backup pod gets the device), and tcp otherwise, at the address its
    /// fabric NIC had, with the promotion's backups.
    #[test]
    fn a_promotion_keeps_verbs_and_turns_every_other_fabric_into_tcp() {
        use crate::config::{DpmConfigFile, FabricKind, ReplicaRole};
        for (configured, served) in [
            (FabricKind::Shm, FabricKind::Tcp),
            (FabricKind::Tcp, FabricKind::Tcp),
            (FabricKind::Verbs, FabricKind::Verbs),
        ] {
            // Validated as tcp: a build without `rdma` refuses a verbs config.
            let file = DpmConfigFile::from_toml("role = \"backup\"\nfabric = \"tcp\"", "t");
            let mut config = file.unwrap().validate().unwrap();
            config.fabric = configured;
            let promotion = Promotion {
                backups: vec!["b2:7000".into()],
                fabric: Some("10.0.0.5:7101".parse().unwrap()),
            };
            promotion.apply(&mut config, "10.0.0.5:7100".parse().unwrap());
            assert_eq!(config.fabric, served, "configured {configured:?}");
            assert_eq!(config.role, ReplicaRole::Primary);
            assert_eq!(config.fabric_listen, "10.0.0.5:7101".parse().unwrap());
            assert_eq!(config.listen, "10.0.0.5:7100".parse().unwrap());
            assert_eq!(config.backups, vec!["b2:7000".to_string()]);
            assert!(!config.create);
        }
    }
}
