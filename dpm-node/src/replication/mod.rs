//! Replication of the memory node (docs/decisions/0007-dpm-replication.md): a primary and
//! backups whose pools are byte mirrors of its own.
//!
//! The primary ships every persisted line of its pool to every backup, in one order, with
//! one-sided WRITEs over the tcp fabric ([`replicator`]); a backup's CPU applies nothing itself
//! ([`backup`]). KNs write their log batches to the primary's NIC as before; the NIC answers
//! a post only once its lines are at every backup in sync (on shm and verbs the KN forwards
//! them, see below), and so does every control answer:
//! an acknowledged batch, metadata write or segment state is on every live replica. A backup's
//! pool is always a state a power failure of the primary could have left once its copy is
//! complete, so promoting it is opening it as a primary (the recovery that runs after a power
//! failure).
//!
//! Copies are marked on disk: a backup's `<pool>.copy` says `incomplete` from the moment an
//! attach starts a copy until the primary, having seen the backup catch up, has it record
//! `complete` (the CopyComplete call); only then does the primary report the backup in sync.
//! A primary refuses to open a pool whose marker says `incomplete` (unless started with
//! `--accept-incomplete-copy`), and removes the marker once it opened the pool
//! ([`crate::dpm::Dpm::open`]). `complete` means consistent, not current: a backup that
//! failed later holds an older image, still one its primary went through.
//!
//! Terms fence primaries: a primary takes the next term at start ([`Primary::start`]) and
//! attaches each backup with it; a backup refuses a term older than one it accepted, or the
//! same term from another primary instance. A primary acknowledges nothing before a backup
//! accepted its term, and stops (deposed) when a backup refuses it, or when a backup it
//! writes to turns out to belong to a newer primary (its key revoked by that primary's
//! attach): it cannot go on alone, even if asked to drop that backup.
//!
//! Images are named ([`image`]): a pool records the term and start it last served under and
//! the replica set's generation, which grows whenever a backup that counted for
//! acknowledgements is removed ([`Primary::remove_backup`]); a backup refuses to be
//! overwritten by an image older than what it accepted.
//!
//! On shm and verbs the KNs store into the pool without this node's CPU (the pool file, the
//! RNIC), so the primary never sees their WRITEs to ship them: such a primary tells its KNs to
//! forward each store (`forward_writes` in RegisterKn; the ForwardWrites call records the
//! ranges and answers after the barrier), and its merges ship the batches they index before
//! indexing them ([`crate::merge::Merger::forward`]). docs/decisions/0007, "One-sided fabrics".

pub mod backup;
mod confirm;
pub mod copy_marker;
pub mod digest;
mod durable;
pub mod image;
pub mod replicator;
pub mod role_file;
mod service;
pub mod term_file;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use dinomo_fabric::mirror::Ended;
use dinomo_fabric::AccessKey;
use dinomo_proto::dpm as pb;
use dinomo_proto::dpm::replica_service_client::ReplicaServiceClient;
use dinomo_security::Security;

pub use backup::Backup;
pub use copy_marker::{CopyMarker, CopyState};
pub use replicator::{BackupStatus, ConfirmCopy, Phase, Replicator, ReplicatorOptions};
pub use service::ReplicaGrpc;

use crate::dpm::Dpm;
use crate::error::{DpmError, Result};
use image::ImageId;

/// A primary's replica set: its term and the replicator installed on its pool.
#[derive(Debug)]
pub struct Primary {
    dpm: Arc<Dpm>,
    term: u64,
    /// Drawn at start: tells this process from another primary that took the same term.
    instance: u64,
    /// Set (with the reason) once another primary is known to have taken over.
    deposed: tokio::sync::watch::Sender<Option<String>>,
    /// This node's gRPC address, as backups are told.
    address: String,
    security: Security,
    replicator: Arc<Replicator>,
    /// The identity of the pool's image when this primary started ([`Dpm::init_replica_image`]):
    /// a backup that accepted a newer one refuses this primary, whose image may lack what
    /// that one's primary acknowledged ([`image`](super::image)).
    started_image: ImageId,
    /// Whether this primary's term was recorded as the image's (once a backup accepted it).
    image_term_recorded: std::sync::atomic::AtomicBool,
    /// Held while the set changes (a backup added, or removed with the generation it takes):
    /// one change at a time, so a re-attach cannot bring back a backup being removed. (The
    /// set's generation is the replicator's: [`Replicator::generation`].)
    membership: tokio::sync::Mutex<()>,
    /// The term and instance the pool's previous start took (sent with Attach: a backup that
    /// accepted that start and nothing since takes this one back, image older or not).
    previous: Option<(u64, u64)>,
    /// Backups named at start that have not been attached yet, with why the last try failed,
    /// and backups an AddBackup is attaching: reported by Status (state "attaching"), so that
    /// whoever watches the set (an operator, the monitor) does not add them a second time,
    /// which would start their copy again.
    attaching: parking_lot::Mutex<std::collections::BTreeMap<String, String>>,
}

/// An attach reported as "attaching" ([`Primary::attaching`]) for as long as this lives,
/// unless a retry loop of [`Primary::attach_named`] reports it already (and removes it when it
/// is done). Removed on drop: an AddBackup whose caller went away is dropped mid-attach.
struct ReportedAttaching<'a> {
    map: &'a parking_lot::Mutex<std::collections::BTreeMap<String, String>>,
    address: Option<String>,
}

impl<'a> ReportedAttaching<'a> {
    fn mark(
        map: &'a parking_lot::Mutex<std::collections::BTreeMap<String, String>>,
        address: &str,
    ) -> Self {
        let mut m = map.lock();
        let fresh = !m.contains_key(address);
        if fresh {
            m.insert(address.to_string(), "attaching now".into());
        }
        Self {
            map,
            address: fresh.then(|| address.to_string()),
        }
    }
}

impl Drop for ReportedAttaching<'_> {
    fn drop(&mut self) {
        if let Some(a) = self.address.take() {
            self.map.lock().remove(&a);
        }
    }
}

impl Primary {
    /// Takes the next replica term and installs a replicator on `dpm`'s pool (no backup yet:
    /// [`Primary::add_backup`]).
    pub fn start(
        dpm: Arc<Dpm>,
        address: String,
        security: Security,
        opts: ReplicatorOptions,
    ) -> Result<Arc<Self>> {
        let on_file = term_file::read_accepted(&dpm.config.pool_path)?;
        let mut started_image = dpm.init_replica_image()?;
        // A promoted backup: its primary may have told it a newer generation than the copy of
        // the image record its pool holds (the told one is durable when told; the record's
        // copy arrives with the other WRITEs).
        if on_file.instance != 0 && on_file.instance == started_image.instance {
            started_image.generation = started_image.generation.max(on_file.generation);
        }
        let instance = rand::random::<u64>() | 1;
        let (term, previous) = dpm.next_replica_term(on_file.term, instance)?;
        let region = dpm.pool().region().clone();
        let replicator = Replicator::new(region.clone(), opts);
        replicator.set_generation(started_image.generation);
        region.set_mirror(Some(replicator.clone()));
        let primary = Arc::new(Primary {
            dpm,
            term,
            instance,
            previous,
            deposed: tokio::sync::watch::channel(None).0,
            address,
            security,
            replicator,
            started_image,
            image_term_recorded: std::sync::atomic::AtomicBool::new(false),
            membership: tokio::sync::Mutex::new(()),
            attaching: parking_lot::Mutex::new(std::collections::BTreeMap::new()),
        });
        tokio::spawn(watch_failed_backups(Arc::downgrade(&primary)));
        Ok(primary)
    }

    /// Resolves with the reason once this primary is deposed (see the module doc).
    pub async fn deposed(&self) -> String {
        let mut rx = self.deposed.subscribe();
        let why = match rx.wait_for(Option::is_some).await {
            Ok(v) => v.clone(),
            Err(_) => None,
        };
        match why {
            Some(why) => why,
            // The sender lives as long as `self`.
            None => std::future::pending().await,
        }
    }

    /// Stops acknowledging for good: another primary has taken over. With `newer_term` (a
    /// replica showed a newer image than this pool's: see [`Primary::newer_primary`]), this
    /// node also records that it is a backup now (see `role_file::RecordedRole`), fencing every
    /// primary up to `newer_term - 1` and refusing from then on every image older than its own
    /// (`role_file::demote`: fence and floor), so that started again it serves as a backup the
    /// new primary can attach without anything this pool acknowledged being overwritten by an
    /// older image.
    /// Without (no evidence of a newer image: a backup that only accepted a later term, a
    /// rival of the same term), its role stays the command line's: its pool may be the only
    /// up-to-date one.
    fn depose(&self, why: String, newer_term: Option<u64>) {
        tracing::error!(reason = %why, "deposed: another primary has taken over; this dpm-node acknowledges nothing more and stops");
        self.replicator.end(&format!("deposed: {why}"));
        if let Some(term) = newer_term {
            let pool = &self.dpm.config.pool_path;
            let file = role_file::role_path(pool);
            match role_file::demote(pool, term, self.image()) {
                Ok(()) => {
                    tracing::warn!(file = %file.display(), term, "recorded this node's role as backup (a replica showed an image of term {term}): started again, it serves as one");
                }
                Err(e) => {
                    tracing::error!(file = %file.display(), error = %e, "cannot record this node's role as backup: started again as a primary, it will be refused and stop");
                }
            }
        }
        self.deposed.send_if_modified(|d| {
            let first = d.is_none();
            if first {
                *d = Some(why.clone());
            }
            first
        });
    }

    pub fn term(&self) -> u64 {
        self.term
    }

    /// Whether this primary stopped acknowledging for good (stopping or deposed).
    pub fn ended(&self) -> bool {
        self.replicator.ended().is_some()
    }

    /// Attaches the backup at `address` (its gRPC address) with this primary's term and starts
    /// copying the pool to it. Refused (FAILED_PRECONDITION from the backup) when a newer
    /// primary attached it.
    pub async fn add_backup(&self, address: &str) -> Result<()> {
        let _one_change_at_a_time = self.membership.lock().await;
        self.add_backup_now(address).await
    }

    /// Attaches `address` unless it is a backup of the set already (added by an AddBackup
    /// while [`Primary::attach_named`] retried: attaching it again would start its copy again).
    async fn add_backup_unless_member(&self, address: &str) -> Result<()> {
        let _one_change_at_a_time = self.membership.lock().await;
        if self.backups().iter().any(|b| b.address == address) {
            return Ok(());
        }
        self.add_backup_now(address).await
    }

    /// Attaches `address` anew if it is still a failed backup of the set, not being removed
    /// (what [`watch_failed_backups`] saw may have changed while it asked).
    async fn reattach(&self, address: &str) -> Result<()> {
        let _one_change_at_a_time = self.membership.lock().await;
        let still_failed =
            self.replicator.status().into_iter().any(|b| {
                b.address == address && !b.leaving && matches!(b.phase, Phase::Failed { .. })
            });
        if !still_failed {
            return Ok(());
        }
        self.add_backup_now(address).await
    }

    async fn add_backup_now(&self, address: &str) -> Result<()> {
        if let Some(why) = self.replicator.ended() {
            return Err(DpmError::Replication(why));
        }
        // Reported as "attaching" while the backup digests its pool (it is in no list
        // meanwhile), so that a watcher does not add it again; unless a retry loop of
        // [`Primary::attach_named`] reports it already (and removes it when done).
        let _reported = ReportedAttaching::mark(&self.attaching, address);
        self.attach_now(address).await
    }

    async fn attach_now(&self, address: &str) -> Result<()> {
        let pool_bytes = self.dpm.pool().region().len();
        // The attach of a kept pool reads what it holds (syncs and digests it): allow for a
        // cold read of the whole pool, 4 s per GiB, beside the usual 30 s.
        let attach_timeout = Duration::from_secs(30 + 4 * pool_bytes.div_ceil(1 << 30));
        let mut client = self.client(address, attach_timeout).await?;
        // Incremental: the backup keeps what it holds and the copy skips the chunks it holds
        // already (a backup restarted, re-attached, or one of the old primary's after a
        // failover holds most of the pool). A fresh key each time (see `digest`).
        let chunk_bytes = digest::chunk_bytes_for(pool_bytes);
        let digest_key: digest::Key = rand::random();
        let image = self.image();
        let r = client
            .attach(pb::AttachRequest {
                term: self.term,
                instance: self.instance,
                pool_bytes,
                primary: self.address.clone(),
                chunk_bytes,
                digest_key: digest_key.to_vec(),
                image_term: Some(image.term),
                image_instance: Some(image.instance),
                image_generation: Some(image.generation),
                previous_term: self.previous.map(|(t, _)| t),
                previous_instance: self.previous.map(|(_, i)| i),
            })
            .await;
        let r = match r {
            Ok(r) => r.into_inner(),
            // A newer primary attached it, or it is a primary itself (promoted).
            Err(s) if s.code() == tonic::Code::FailedPrecondition => {
                let why = format!(
                    "the backup at {address} refused term {}: {}",
                    self.term,
                    s.message()
                );
                let status = self.ask_status(address).await;
                if let Some(older) = status.as_ref().filter(|st| self.older_primary(st)) {
                    return Err(DpmError::Replication(format!(
                        "the backup at {address} answers as a primary of term {}, older than \
                         this one's ({}): a replaced primary started again there, which stops \
                         once this primary's backups refuse it",
                        older.term, self.term
                    )));
                }
                let newer = status.and_then(|st| self.newer_primary(&st));
                self.depose(why.clone(), newer);
                return Err(DpmError::StaleTerm {
                    given: self.term,
                    current: 0,
                });
            }
            Err(s) => {
                return Err(DpmError::Replication(format!(
                    "the backup at {address} did not attach: {}",
                    s.message()
                )))
            }
        };
        let nic: SocketAddr = tokio::net::lookup_host(&r.fabric)
            .await
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| {
                DpmError::Replication(format!(
                    "the backup at {address} gave a fabric address that does not resolve: {:?}",
                    r.fabric
                ))
            })?;
        let secret: [u8; 16] = r.secret.as_slice().try_into().map_err(|_| {
            DpmError::Replication(format!(
                "the backup at {address} gave a key of {} bytes, not 16",
                r.secret.len()
            ))
        })?;
        let key = AccessKey {
            slot: r.slot,
            generation: r.generation,
            secret,
        };
        // A backup that does not know the incremental copy answers no digests: it started
        // from zeroes, and the copy skips the zero chunks.
        let held = if r.chunk_digests.is_empty() {
            None
        } else {
            Some(
                digest::BackupChunks::from_wire(
                    pool_bytes,
                    chunk_bytes,
                    digest_key,
                    &r.chunk_digests,
                )
                .map_err(|e| {
                    DpmError::Replication(format!("the backup at {address} answered {e}"))
                })?,
            )
        };
        // Once the backup caught up, it records this copy complete before it is reported in
        // sync (the copy marker, see `backup`); the call is tried until the backup answers
        // (`confirm`), and the replicator stops waiting once the backup is removed or failed.
        let (security, backup, term, instance, copy) = (
            self.security.clone(),
            address.to_string(),
            self.term,
            self.instance,
            r.copy,
        );
        // The generation is the replicator's when it asks (a removal while this backup was
        // being copied raised it; one that removes this backup means it is never asked).
        let confirm: replicator::ConfirmCopy = Box::new(move |generation| {
            Box::pin(async move {
                let request = pb::CopyCompleteRequest {
                    term,
                    instance,
                    copy,
                    generation: Some(generation),
                };
                confirm::until_heard(&backup, || async {
                    let mut c = connect(&security, &backup, Duration::from_secs(30))
                        .await
                        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
                    c.copy_complete(request).await.map(|_| ())
                })
                .await
            })
        });
        // A backup accepted the term, and once it is added this primary may acknowledge: the
        // pool's image is this term's from now on, recorded before (a restart after an
        // acknowledgement must find it) and copied to the backup with the pool. Without the
        // record, no add: nothing is acknowledged, and the next attach tries again.
        if !self.image_term_recorded.load(Ordering::Acquire) {
            let dpm = self.dpm.clone();
            let image = ImageId {
                term: self.term,
                instance: self.instance,
                generation: self.replicator.generation(),
            };
            tokio::task::spawn_blocking(move || {
                dpm.record_replica_image(image)?;
                term_file::note_own_image(&dpm.config.pool_path, image)
            })
            .await
            .map_err(|e| DpmError::Io(std::io::Error::other(e)))??;
            self.image_term_recorded.store(true, Ordering::Release);
            tracing::info!(term, "the pool's image serves under this term from now on");
        }
        self.replicator.add(address, nic, key, held, Some(confirm));
        Ok(())
    }

    async fn client(
        &self,
        address: &str,
        timeout: Duration,
    ) -> Result<ReplicaServiceClient<tonic::transport::Channel>> {
        connect(&self.security, address, timeout).await
    }

    /// What the backup at `address` says it is. `None`: it cannot be asked.
    async fn ask_status(&self, address: &str) -> Option<pb::ReplicaStatusResponse> {
        Some(
            self.client(address, Duration::from_secs(2))
                .await
                .ok()?
                .status(pb::ReplicaStatusRequest {})
                .await
                .ok()?
                .into_inner(),
        )
    }

    /// Whether `s` is the status of a primary of an older term than this one: a replaced
    /// primary started again at a backup's address (a pod restarted before it learned it
    /// was replaced). Its backups refuse it and it stops: no reason to stop here. (Two
    /// primaries of one term both stop: neither can tell which is the newer.)
    fn older_primary(&self, s: &pb::ReplicaStatusResponse) -> bool {
        // Term 0: a primary without replication (a pool started alone), not an older one.
        s.role == "primary" && s.term > 0 && s.term < self.term
    }

    /// Why `s` (the status of the backup at `address`) shows another primary took it over (a
    /// newer term, or it was promoted), if it does.
    fn taken_over(&self, address: &str, s: &pb::ReplicaStatusResponse) -> Option<String> {
        let took_over = if s.role == "backup" {
            s.term > self.term
        } else {
            !self.older_primary(s)
        };
        took_over.then(|| {
            format!(
                "the backup at {address} is now a {} of term {} (this primary's term is {})",
                s.role, s.term, self.term
            )
        })
    }

    /// The term of a newer image that a replica's status `s` shows, if it shows one: it is a
    /// primary of a term after this pool's image, or a backup holding a complete copy made
    /// under such a term. Then a newer primary served, and this pool is the older image. A
    /// backup that merely accepted a later term proves nothing (this pool's own earlier start
    /// may have taken it and died before anything was acknowledged), nor does a primary of
    /// this same term (both may have acknowledged).
    fn newer_primary(&self, s: &pb::ReplicaStatusResponse) -> Option<u64> {
        let own = self.image().term;
        let newer_primary = s.role == "primary" && s.term > own;
        let newer_copy = s.copy_state == "complete" && s.copy_term > own;
        (newer_primary || newer_copy).then_some(s.term)
    }

    /// The identity of this pool's image now: of this primary's term once a backup accepted
    /// it, else the one it started with; with the set's current generation.
    pub fn image(&self) -> ImageId {
        let generation = self.replicator.generation();
        if self.image_term_recorded.load(Ordering::Acquire) {
            ImageId {
                term: self.term,
                instance: self.instance,
                generation,
            }
        } else {
            ImageId {
                generation,
                ..self.started_image
            }
        }
    }

    /// Removes the backup at `address` from the replica set (false: it is not in it). A
    /// backup that counted for acknowledgements holds a consistent image, maybe marked
    /// complete, that lacks every write acknowledged after its removal; promoted, it must
    /// not be copied over the backups that stayed. So, while barriers wait
    /// ([`Replicator::leave`]), the set's generation grows: first durably at every other
    /// backup (RecordGeneration), which refuse the removed one's image from then on
    /// ([`image`]), then in this pool (and so in the copies). A backup that does not record it
    /// is failed (it holds acknowledgements until removed or added again); only then is the
    /// backup removed and barriers go on without it.
    ///
    /// Runs as a task of its own: a caller that gives up (its deadline passed) cannot leave
    /// the backup leaving, with every barrier waiting for it.
    pub async fn remove_backup(self: &Arc<Self>, address: &str) -> Result<bool> {
        let (me, address) = (self.clone(), address.to_string());
        tokio::spawn(async move { me.remove_backup_now(&address).await })
            .await
            .map_err(|e| DpmError::Io(std::io::Error::other(e)))?
    }

    async fn remove_backup_now(&self, address: &str) -> Result<bool> {
        let _one_change_at_a_time = self.membership.lock().await;
        let Some(counted) = self.replicator.leave(address) else {
            return Ok(false);
        };
        // Nothing was acknowledged under this term without it unless a backup accepted the
        // term (and the image is this term's): before that, the generation has nothing to
        // tell apart.
        if counted && self.image_term_recorded.load(Ordering::Acquire) {
            if let Err(e) = self.next_generation(address).await {
                // It missed records while leaving: failed (barriers fail, `up` and operators
                // see it so and try again), no longer leaving.
                self.replicator
                    .fail(address, format!("removing it failed: {e}"));
                self.replicator.stay(address);
                return Err(e);
            }
        }
        Ok(self.replicator.remove(address))
    }

    /// [`Primary::remove_backup`]'s new generation, made durable at every backup but
    /// `leaving`, then here. Those that do not record it are failed. When none of them
    /// recorded it, the removal fails and nothing changes (a generation that only this pool
    /// knows would, deposed, refuse the promotion of every backup; one that nobody knows
    /// would let a backup re-attached later start from the old one).
    async fn next_generation(&self, leaving: &str) -> Result<()> {
        let generation = self.replicator.generation() + 1;
        let others: Vec<String> = self
            .replicator
            .status()
            .into_iter()
            .filter(|b| b.address != leaving && !matches!(b.phase, Phase::Failed { .. }))
            .map(|b| b.address)
            .collect();
        // Half a barrier's wait (which times out after `replica_ack_timeout`; at least 500 ms):
        // KN posts during a removal mostly wait rather than fail.
        let deadline = (self.dpm.config.replica_ack_timeout / 2).max(Duration::from_millis(500));
        let mut tells = tokio::task::JoinSet::new();
        for address in others.clone() {
            let (security, term, instance) = (self.security.clone(), self.term, self.instance);
            tells.spawn(async move {
                let told = async {
                    connect(&security, &address, deadline)
                        .await?
                        .record_generation(pb::RecordGenerationRequest {
                            term,
                            instance,
                            generation,
                        })
                        .await
                        .map_err(|s| DpmError::Replication(s.message().to_string()))
                };
                let told = tokio::time::timeout(deadline, told)
                    .await
                    .unwrap_or_else(|_| {
                        Err(DpmError::Replication(format!(
                            "no answer within {deadline:?}"
                        )))
                    });
                (address, told)
            });
        }
        let mut recorded = std::collections::HashSet::new();
        while let Some(told) = tells.join_next().await {
            match told {
                Ok((address, Ok(_))) => {
                    recorded.insert(address);
                }
                Ok((address, Err(e))) => {
                    tracing::error!(backup = %address, generation, error = %e, "a backup did not record the replica set's new generation: failing it");
                }
                Err(e) => tracing::error!(error = %e, "telling a backup the set's generation"),
            }
        }
        for address in others.iter().filter(|a| !recorded.contains(*a)) {
            self.replicator.fail(
                address,
                format!("it did not record the replica set's generation {generation}"),
            );
        }
        if recorded.is_empty() && !others.is_empty() {
            return Err(DpmError::Replication(format!(
                "no other backup recorded the replica set's generation {generation} (they \
                 are failed now): {leaving} stays in the set, failed; remove or add again \
                 the others first"
            )));
        }
        let image = ImageId {
            term: self.term,
            instance: self.instance,
            generation,
        };
        let dpm = self.dpm.clone();
        tokio::task::spawn_blocking(move || {
            dpm.record_replica_image(image)?;
            term_file::note_own_image(&dpm.config.pool_path, image)
        })
        .await
        .map_err(|e| DpmError::Io(std::io::Error::other(e)))??;
        self.replicator.set_generation(generation);
        tracing::warn!(backup = %leaving, generation, "a backup leaves the replica set: the set's generation is {generation}, recorded at the other backups (they refuse its image from now on)");
        Ok(())
    }

    pub fn backups(&self) -> Vec<BackupStatus> {
        self.replicator.status()
    }

    /// Backups being attached (an AddBackup in progress), or named at start and not attached
    /// yet, with why the last try failed (see [`Primary::attach_named`]); none of them is in
    /// [`Primary::backups`].
    pub fn attaching(&self) -> Vec<(String, String)> {
        let members: Vec<String> = self.backups().into_iter().map(|b| b.address).collect();
        self.attaching
            .lock()
            .iter()
            .filter(|(a, _)| !members.contains(a))
            .map(|(a, why)| (a.clone(), why.clone()))
            .collect()
    }

    /// Attaches a backup named at start in the background, retrying every second while it
    /// cannot be reached, until it is attached (by this task or by an AddBackup meanwhile), or
    /// replication ends. Reported as "attaching" from this call on.
    pub fn attach_named(self: &Arc<Self>, backup: String) {
        self.attaching
            .lock()
            .insert(backup.clone(), "not tried yet".into());
        tokio::spawn(self.clone().keep_attaching(backup));
    }

    async fn keep_attaching(self: Arc<Self>, backup: String) {
        loop {
            match self.add_backup_unless_member(&backup).await {
                Ok(()) => break,
                // Deposed (the primary stops) or stopping.
                Err(DpmError::StaleTerm { .. }) => break,
                Err(e) if self.ended() => {
                    tracing::debug!(%backup, error = %e, "not attaching: replication ended");
                    break;
                }
                Err(e) => {
                    tracing::warn!(%backup, error = %e, "cannot attach the backup yet; retrying in 1 s");
                    self.attaching.lock().insert(backup.clone(), e.to_string());
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
        self.attaching.lock().remove(&backup);
    }

    /// Stops for good (the node is stopping): barriers fail from now on, so nothing more is
    /// acknowledged; the KNs' grants are revoked (which waits for their posts in progress:
    /// answered with an error), and the replicator is replaced by a mirror whose barriers
    /// all fail ([`Ended`]), not removed: a control call still in progress (gRPC's shutdown
    /// does not wait for every call) that takes its barrier after this must not pass it.
    pub fn shutdown(&self) {
        const WHY: &str = "this dpm-node is stopping";
        self.replicator.end(WHY);
        if let Err(e) = self.dpm.grants().revoke_all() {
            tracing::warn!(error = %e, "revoking the KNs' grants at stop");
        }
        self.dpm
            .pool()
            .region()
            .set_mirror(Some(Arc::new(Ended(WHY.to_string()))));
    }
}

/// A ReplicaService client of the backup at `address`.
async fn connect(
    security: &Security,
    address: &str,
    timeout: Duration,
) -> Result<ReplicaServiceClient<tonic::transport::Channel>> {
    let channel = security
        .endpoint(address, dinomo_security::Service::Dpm)
        .map_err(|e| DpmError::InvalidArgument(format!("backup address {address:?}: {e}")))?
        .connect_timeout(Duration::from_secs(2))
        .timeout(timeout)
        .connect()
        .await
        .map_err(|e| DpmError::Replication(format!("cannot reach the backup at {address}: {e}")))?;
    Ok(ReplicaServiceClient::new(channel))
}

/// Asks every backup that failed whether another primary took it over (its key refused):
/// then this primary is deposed. A backup that crashed or restarted is not (its term is not
/// newer); it stays failed until removed or added again, or, with `reattach_failed_backups`,
/// until it answers again: then this primary attaches it anew (at most every
/// [`REATTACH_EVERY`] per backup), unless it is itself such a fresh copy that failed before
/// it was in sync.
async fn watch_failed_backups(primary: std::sync::Weak<Primary>) {
    let mut last_attach: std::collections::HashMap<String, std::time::Instant> =
        std::collections::HashMap::new();
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let Some(p) = primary.upgrade() else { return };
        if p.replicator.ended().is_some() {
            return;
        }
        // Asked all at once: an unreachable backup (2 s to give up on) must not delay
        // noticing that another one was taken over.
        let mut asks = tokio::task::JoinSet::new();
        for b in p.replicator.status() {
            let Phase::Failed { counted, .. } = b.phase else {
                continue;
            };
            let p = p.clone();
            asks.spawn(async move {
                let s = p.ask_status(&b.address).await;
                (b, counted, s)
            });
        }
        // Every answer first: a takeover is acted on before any re-attach (which may take
        // tens of seconds) is tried.
        let mut answered = Vec::new();
        while let Some(answer) = asks.join_next().await {
            match answer {
                Ok((b, counted, Some(s))) => answered.push((b, counted, s)),
                Ok((_, _, None)) => {} // unreachable: stays failed
                Err(e) => tracing::warn!(error = %e, "asking a failed backup for its status"),
            }
        }
        for (b, _, s) in &answered {
            if let Some(why) = p.taken_over(&b.address, s) {
                p.depose(why, p.newer_primary(s));
                return;
            }
        }
        for (b, counted, _) in answered {
            // A counted backup that failed before it was in sync is a copy made by an earlier
            // re-attach that failed too (the fabric unreachable, the disk full...): attached
            // again, it would let acknowledgements go on with fewer copies over and over. It
            // holds them until someone removes it or adds it again.
            let copy_failed_again = counted && b.resync_ms.is_none();
            if !p.dpm.config.reattach_failed_backups
                || copy_failed_again
                || last_attach
                    .get(&b.address)
                    .is_some_and(|t| t.elapsed() < REATTACH_EVERY)
            {
                continue;
            }
            last_attach.insert(b.address.clone(), std::time::Instant::now());
            tracing::warn!(backup = %b.address, "a failed backup answers again: attaching it anew (reattach_failed_backups); until its copy is in sync, acknowledgements do not wait for it");
            if let Err(e) = p.reattach(&b.address).await {
                tracing::warn!(backup = %b.address, error = %e, "attaching the failed backup anew");
            }
        }
    }
}

/// Least time between two attaches of the same failed backup (a backup that keeps failing is
/// not copied in a loop).
const REATTACH_EVERY: Duration = Duration::from_secs(5);
