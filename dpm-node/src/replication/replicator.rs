//! The primary's side of replication: a [`PersistMirror`] that ships every persisted line of
//! the pool to each backup, in one order, with one-sided WRITEs over the tcp fabric.
//!
//! Invariants:
//! - Records are numbered under one lock, and their bytes are copied from the live pool under
//!   that lock, so a later record of a line never carries older bytes than an earlier one.
//! - Each backup has one sender (a task on the node's multi-threaded runtime, so that a record
//!   made on a runtime thread wakes no other thread; a thread of its own where the backup was
//!   added outside such a runtime), one fabric connection, and one post in flight; the
//!   backup's NIC applies a connection's posts in order, and the ops of a post in order. So a
//!   backup holds, at every moment, the bytes of a prefix of its records (the last post maybe
//!   in part): a state the primary's pool went through, with some lines newer, which is what a
//!   power failure of the primary may leave; recovery handles it.
//! - Since the senders run on the runtime, no runtime worker may block on anything that waits
//!   for replication progress (a barrier, room in a queue, a lock held by a thread that
//!   waits for either): merges, GC and control calls wait on their own or blocking-pool
//!   threads, and the NIC and forwards await their barriers.
//! - A backup joins `Syncing`: it gets every record from the moment it is added, and the sender
//!   copies the whole pool to it through the same queue, chunk by chunk, each MiB read under
//!   the state lock (so at one place in the record order). A chunk the backup already holds
//!   is skipped: one whose digest equals the
//!   one the backup answered at its attach ([`BackupChunks`], taken when only this primary
//!   could write it any more), or, from a backup that started from a zero-filled pool, one
//!   that is all zeroes. Skipping is copying the same bytes: the backup holds the chunk as the
//!   primary's read found it, then applies every later record. (The records queued before the
//!   read also reach it, before that point; each carries a line as it was persisted, so a line
//!   differs from the read only by stores not persisted then, which a power failure could have
//!   lost as well.) Once the last chunk is acknowledged it is
//!   `CatchingUp`: barriers wait for it from then on. Once it also acknowledged every record
//!   queued before that, it holds a consistent image; the replicator then has the backup record
//!   its copy complete ([`ConfirmCopy`]: the CopyComplete call, durable in its `<pool>.copy`)
//!   and only after that succeeded reports it `InSync` (a call that does not get through is
//!   retried until it does; a backup that refuses it is failed). So `InSync` is only ever
//!   reported after the marker became complete. It is not a promise that the marker still says
//!   so: an AddBackup of the same address, or a newer primary's attach, rewrites it to
//!   incomplete before this replicator notices; whoever promotes must read the marker again
//!   (`dinomo up` does, and a primary refuses to open an incomplete pool).
//! - A backup whose WRITE fails or times out becomes `Failed` and stays so: every barrier fails
//!   (nothing more is acknowledged as durable) until someone with the authority to shrink the
//!   replica set removes it ([`Replicator::remove`]) or adds it again. The primary never drops
//!   a backup by itself: a primary cut off from its backups must stop, not go on alone.
//! - A backup being removed leaves first ([`Replicator::leave`]): no record is queued for it
//!   from then on, and every barrier waits until it is removed (or fails), so nothing is
//!   acknowledged without it before its primary told the others the set's new generation.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dinomo_fabric::mirror::{BarrierFuture, PersistMirror};
use dinomo_fabric::tcp::TcpFabric;
use dinomo_fabric::{AccessKey, Fabric, FabricError, Op, PmRegion};
use parking_lot::{Condvar, Mutex};
use tokio::sync::watch;

use super::digest::{is_zero, BackupChunks};

/// Bytes of one WRITE of the copy, and the chunk of a copy to a backup that gave no digests.
const CHUNK: u64 = super::digest::MIN_CHUNK_BYTES;
/// Most bytes queued for one backup before recording waits (backpressure).
const MAX_QUEUED_BYTES: u64 = 64 << 20;
/// Most bytes and operations in one post to a backup.
const MAX_POST_BYTES: u64 = 16 << 20;
const MAX_POST_OPS: usize = 1024;

/// The bytes of the pool a copy covers: all but a tail shorter than a word, in a pool whose
/// length is not a multiple of 8 (a config may ask for one). The copy reads whole words, and
/// that tail is past the last segment, where nothing is ever written.
fn copied_len(region: &PmRegion) -> u64 {
    region.len() & !7
}

/// Has a backup record, durably, that its copy is complete and the replica set's generation
/// (the argument: see [`Replicator::generation`]) then (the CopyComplete call of
/// [`super::Primary`]); `Err` says why it did not.
pub type ConfirmCopy = Box<
    dyn FnOnce(
            u64,
        )
            -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), String>> + Send>>
        + Send,
>;

/// Where telling a backup that its copy is complete stands.
enum Confirm {
    /// Not asked yet: run this on that runtime once the backup caught up.
    Needed(ConfirmCopy, tokio::runtime::Handle),
    Pending,
    /// Recorded by the backup (or nothing to tell: a backup added without a confirmation).
    Done,
    Refused(String),
}

/// How long a backup may take to acknowledge before it is marked failed.
#[derive(Debug, Clone, Copy)]
pub struct ReplicatorOptions {
    pub ack_timeout: Duration,
}

impl Default for ReplicatorOptions {
    fn default() -> Self {
        ReplicatorOptions {
            ack_timeout: Duration::from_secs(5),
        }
    }
}

/// Where a backup stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// Getting the whole pool; not waited for, holds nothing anyone was told is durable.
    Syncing,
    /// The whole pool is copied; every barrier begun from now on waits for it, and once it
    /// acknowledges `until` (every record queued before this phase began, so also those that
    /// barriers which did not wait for it acknowledged) and recorded its copy complete, it is
    /// in sync.
    CatchingUp { until: u64 },
    /// Holds every acknowledged byte and recorded its copy complete: every barrier waits for
    /// it, and it may be promoted.
    InSync,
    /// A WRITE failed. If barriers waited for it (`counted`), they fail until it is removed
    /// or added again; a backup that failed while syncing held nothing and blocks nothing.
    Failed { why: String, counted: bool },
}

impl Phase {
    pub fn name(&self) -> &'static str {
        match self {
            Phase::Syncing => "syncing",
            Phase::CatchingUp { .. } => "catching-up",
            Phase::InSync => "in-sync",
            Phase::Failed { .. } => "failed",
        }
    }

    /// Whether barriers wait for (or fail because of) this backup.
    fn counted(&self) -> bool {
        match self {
            Phase::Syncing => false,
            Phase::CatchingUp { .. } | Phase::InSync => true,
            Phase::Failed { counted, .. } => *counted,
        }
    }

    fn failed(&self) -> bool {
        matches!(self, Phase::Failed { .. })
    }
}

/// One backup's state, as [`Replicator::status`] reports it.
#[derive(Debug, Clone)]
pub struct BackupStatus {
    /// The backup's gRPC address (its name in the replica set).
    pub address: String,
    pub phase: Phase,
    /// Records queued or in flight (how far behind it is).
    pub behind_records: u64,
    pub behind_bytes: u64,
    /// Bytes written to it since it was added (records and resync chunks).
    pub bytes_sent: u64,
    /// Bytes of the pool's copy (the chunks sent) and how long it took until in sync.
    pub resync_bytes: u64,
    pub resync_ms: Option<u64>,
    /// Bytes of the chunks not sent because the backup held them already.
    pub resync_skipped_bytes: u64,
    /// Caught up, and the primary is telling it that its copy is complete (CopyComplete, tried
    /// until it gets through): not in sync until the backup recorded that.
    pub awaiting_copy_complete: bool,
    /// Being removed ([`Replicator::leave`]).
    pub leaving: bool,
}

struct Record {
    seq: u64,
    offset: u64,
    data: Bytes,
}

#[derive(Default)]
struct Queue {
    records: VecDeque<Record>,
    bytes: u64,
    /// Seq of the last record queued for this backup.
    last_queued: u64,
}

struct Backup {
    address: String,
    queue: Mutex<Queue>,
    /// Signalled when records are taken or the backup stops or fails, to recorders that wait
    /// for room ([`Backup::wake_recorders`]).
    queue_cv: Condvar,
    /// Wakes the sender, which waits for records asynchronously (a permit is kept when it is
    /// not waiting, so a record queued between its check and its wait is not missed).
    queued: tokio::sync::Notify,
    acked: AtomicU64,
    phase: Mutex<Phase>,
    stop: AtomicBool,
    bytes_sent: AtomicU64,
    resync_bytes: AtomicU64,
    resync_skipped_bytes: AtomicU64,
    resync_ms: Mutex<Option<u64>>,
    /// What the backup held when it was attached (its chunks' digests); `None`: it started
    /// from a zero-filled pool.
    held: Option<BackupChunks>,
    /// Whether a failure counts even while syncing: this backup replaced one of the same
    /// address that counted (it failed and is attached anew), so if its copy fails too, the
    /// set must not go on smaller without anyone deciding so.
    fails_counted: bool,
    /// Telling the backup its copy is complete, which comes before `InSync`.
    confirm: Mutex<Confirm>,
    /// Leaving the set ([`Replicator::leave`]): gets no more records, and barriers wait
    /// until it is removed.
    leaving: AtomicBool,
}

impl Backup {
    /// The records of the next post, oldest first (none when nothing is queued).
    fn take_post(&self) -> Vec<Record> {
        let mut q = self.queue.lock();
        let mut out = Vec::new();
        let mut bytes = 0;
        while let Some(r) = q.records.front() {
            if !out.is_empty()
                && (out.len() >= MAX_POST_OPS || bytes + r.data.len() as u64 > MAX_POST_BYTES)
            {
                break;
            }
            bytes += r.data.len() as u64;
            out.push(q.records.pop_front().expect("front exists"));
        }
        out
    }

    /// Wakes the sender: records were queued, or it must stop or move on.
    fn wake_sender(&self) {
        self.queued.notify_one();
    }

    /// Wakes recorders waiting for room ([`Replicator::wait_below`]): records were taken, or
    /// the backup stopped or failed.
    fn wake_recorders(&self) {
        self.queue_cv.notify_all();
    }

    /// Wakes both (the backup stopped or failed).
    fn wake(&self) {
        self.wake_sender();
        self.wake_recorders();
    }

    fn fail(&self, why: String, changes: &watch::Sender<u64>) {
        let mut p = self.phase.lock();
        if !p.failed() {
            let counted = p.counted() || self.fails_counted;
            if counted {
                tracing::error!(backup = %self.address, reason = %why, "backup failed: nothing is acknowledged as durable until it is removed from the replica set or added again");
            } else {
                tracing::warn!(backup = %self.address, reason = %why, "backup failed while its copy was being made; acknowledgements never waited for it");
            }
            *p = Phase::Failed { why, counted };
        }
        drop(p);
        let mut q = self.queue.lock();
        q.records.clear();
        q.bytes = 0;
        drop(q);
        self.wake();
        changes.send_modify(|v| *v += 1);
    }
}

/// The primary's replicator: install it on the pool's region with
/// [`PmRegion::set_mirror`], then [`Replicator::add`] backups.
pub struct Replicator {
    region: Arc<PmRegion>,
    opts: ReplicatorOptions,
    /// Next record's seq and the backups, under one lock (see the invariants).
    state: Mutex<State>,
    /// Bumped at every acknowledgement and phase change; barriers wait on it.
    changes: watch::Sender<u64>,
    /// Why barriers fail from now on, whatever the backups: this node stops acknowledging
    /// (it is stopping, or a newer primary took over).
    ended: Arc<Mutex<Option<String>>>,
    /// Whether a backup has accepted this primary's term: until then nothing is acknowledged
    /// (a primary that serves before it fenced the others could be an old one).
    term_confirmed: AtomicBool,
    /// The replica set's generation (see `super::image`), changed only under the state lock
    /// ([`Replicator::set_generation`]) and read there when a backup is told its copy is
    /// complete: a backup leaving the set is never told a generation that counts without it.
    generation: AtomicU64,
}

struct State {
    next_seq: u64,
    backups: Vec<Arc<Backup>>,
}

impl std::fmt::Debug for Replicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replicator")
            .field("backups", &self.status().len())
            .finish()
    }
}

impl Replicator {
    pub fn new(region: Arc<PmRegion>, opts: ReplicatorOptions) -> Arc<Self> {
        Arc::new(Replicator {
            region,
            opts,
            state: Mutex::new(State {
                next_seq: 1,
                backups: Vec::new(),
            }),
            changes: watch::channel(0).0,
            ended: Arc::new(Mutex::new(None)),
            term_confirmed: AtomicBool::new(false),
            generation: AtomicU64::new(0),
        })
    }

    /// The replica set's generation (0 until [`Replicator::set_generation`]).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Sets the replica set's generation: what a backup whose copy completes from now on is
    /// told. Under the state lock, so that it is ordered with [`Replicator::leave`].
    pub fn set_generation(&self, generation: u64) {
        let _st = self.state.lock();
        self.generation.store(generation, Ordering::Release);
    }

    /// From now on every barrier fails with `why` (the node stops, or was deposed); senders
    /// stop. Posts already waiting get the error too.
    pub fn end(&self, why: &str) {
        self.ended.lock().get_or_insert_with(|| why.to_string());
        self.stop_senders();
    }

    /// Why barriers fail for good, if they do.
    pub fn ended(&self) -> Option<String> {
        self.ended.lock().clone()
    }

    /// Starts replicating to the backup at `address` whose NIC is `nic` and which granted
    /// `key`: from now on every record is queued for it, and its sender copies the pool to it
    /// in the background: the chunks that differ from what it `held` at its attach (`None`:
    /// it started from zeroes, so every non-zero chunk). A backup of the same address is
    /// replaced. `confirm` is run
    /// (on the caller's tokio runtime) once the backup caught up, and it becomes `InSync` only
    /// once that succeeded; `None`: nothing to tell (tests of the replicator alone).
    pub fn add(
        self: &Arc<Self>,
        address: &str,
        nic: SocketAddr,
        key: AccessKey,
        held: Option<BackupChunks>,
        confirm: Option<ConfirmCopy>,
    ) {
        let confirm = match (confirm, tokio::runtime::Handle::try_current()) {
            (None, _) => Confirm::Done,
            (Some(f), Ok(rt)) => Confirm::Needed(f, rt),
            (Some(_), Err(_)) => {
                Confirm::Refused("no tokio runtime to tell the backup its copy is complete".into())
            }
        };
        self.term_confirmed.store(true, Ordering::Release);
        let mut st = self.state.lock();
        let replaces_counted = st
            .backups
            .iter()
            .any(|b| b.address == address && b.phase.lock().counted());
        let backup = Arc::new(Backup {
            address: address.to_string(),
            queue: Mutex::new(Queue::default()),
            queue_cv: Condvar::new(),
            queued: tokio::sync::Notify::new(),
            acked: AtomicU64::new(0),
            phase: Mutex::new(Phase::Syncing),
            stop: AtomicBool::new(false),
            bytes_sent: AtomicU64::new(0),
            resync_bytes: AtomicU64::new(0),
            resync_skipped_bytes: AtomicU64::new(0),
            resync_ms: Mutex::new(None),
            held,
            fails_counted: replaces_counted,
            confirm: Mutex::new(confirm),
            leaving: AtomicBool::new(false),
        });
        if let Some(i) = st.backups.iter().position(|b| b.address == address) {
            let old = st.backups.remove(i);
            old.stop.store(true, Ordering::Release);
            old.wake();
        }
        st.backups.push(backup.clone());
        drop(st);
        self.changes.send_modify(|v| *v += 1);
        let me = self.clone();
        match tokio::runtime::Handle::try_current() {
            // A task on the node's runtime: a record made on a worker (a forward, a NIC
            // post) schedules it there instead of waking another thread. Records made on
            // other threads (merges, GC, control calls on the blocking pool) wake a worker.
            Ok(rt) if rt.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                rt.spawn(me.sender(backup, nic, key));
            }
            _ => {
                std::thread::Builder::new()
                    .name(format!("replicate {address}"))
                    .spawn(move || me.run_sender(backup, nic, key))
                    .expect("spawning a replication thread");
            }
        }
        tracing::info!(backup = %address, %nic, "backup added: copying the pool to it (the chunks it does not hold)");
    }

    /// Starts removing `address`: from now on it gets no record, and every barrier waits
    /// (neither passes nor fails because of it) until [`Replicator::remove`] removes it, or it
    /// fails. Between the two, its primary makes the set's new generation durable at the
    /// other backups (see `super::image`), so that nothing acknowledged without this backup
    /// is acknowledged before they know it. Returns whether barriers counted it (`None`: not
    /// in the set).
    pub fn leave(&self, address: &str) -> Option<bool> {
        let st = self.state.lock();
        let b = st.backups.iter().find(|b| b.address == address)?;
        let counted = b.phase.lock().counted();
        b.leaving.store(true, Ordering::Release);
        drop(st);
        self.changes.send_modify(|v| *v += 1);
        Some(counted)
    }

    /// Takes back [`Replicator::leave`]: the backup is in the set again (its removal failed).
    /// It got no records meanwhile: fail it first.
    pub fn stay(&self, address: &str) {
        let st = self.state.lock();
        if let Some(b) = st.backups.iter().find(|b| b.address == address) {
            b.leaving.store(false, Ordering::Release);
            b.wake_sender();
        }
        drop(st);
        self.changes.send_modify(|v| *v += 1);
    }

    /// Marks `address` failed with `why` (see [`Phase::Failed`]); false if it is not in the set.
    pub fn fail(&self, address: &str, why: String) -> bool {
        let b = {
            let st = self.state.lock();
            st.backups.iter().find(|b| b.address == address).cloned()
        };
        let Some(b) = b else { return false };
        b.fail(why, &self.changes);
        true
    }

    /// Stops replicating to `address` (it failed, or is being replaced). True if it was there.
    pub fn remove(&self, address: &str) -> bool {
        let removed = {
            let mut st = self.state.lock();
            st.backups
                .iter()
                .position(|b| b.address == address)
                .map(|i| st.backups.remove(i))
        };
        let Some(b) = removed else { return false };
        b.stop.store(true, Ordering::Release);
        b.wake();
        self.changes.send_modify(|v| *v += 1);
        tracing::warn!(backup = %address, "backup removed from the replica set");
        true
    }

    /// Stops every sender. Only through [`Replicator::end`]: with no backup left, a barrier
    /// that did not fail first would pass.
    fn stop_senders(&self) {
        let backups = std::mem::take(&mut self.state.lock().backups);
        for b in backups {
            b.stop.store(true, Ordering::Release);
            b.wake();
        }
        self.changes.send_modify(|v| *v += 1);
    }

    pub fn status(&self) -> Vec<BackupStatus> {
        let backups = self.state.lock().backups.clone();
        backups
            .iter()
            .map(|b| {
                // The phase first and on its own: `advance` holds the phase lock while it
                // takes the queue lock, so taking them the other way round here deadlocks.
                let phase = b.phase.lock().clone();
                let awaiting_copy_complete = matches!(phase, Phase::CatchingUp { .. })
                    && matches!(*b.confirm.lock(), Confirm::Pending);
                let q = b.queue.lock();
                BackupStatus {
                    leaving: b.leaving.load(Ordering::Acquire),
                    address: b.address.clone(),
                    phase,
                    behind_records: q
                        .last_queued
                        .saturating_sub(b.acked.load(Ordering::Acquire)),
                    behind_bytes: q.bytes,
                    bytes_sent: b.bytes_sent.load(Ordering::Relaxed),
                    resync_bytes: b.resync_bytes.load(Ordering::Relaxed),
                    resync_ms: *b.resync_ms.lock(),
                    resync_skipped_bytes: b.resync_skipped_bytes.load(Ordering::Relaxed),
                    awaiting_copy_complete,
                }
            })
            .collect()
    }

    /// Queues `data` at `offset` for `targets` under the state lock (the caller holds it).
    fn enqueue(st: &mut State, targets: &[Arc<Backup>], offset: u64, data: Bytes) {
        let seq = st.next_seq;
        st.next_seq += 1;
        for b in targets {
            let mut q = b.queue.lock();
            q.bytes += data.len() as u64;
            q.last_queued = seq;
            q.records.push_back(Record {
                seq,
                offset,
                data: data.clone(),
            });
            drop(q);
            b.wake_sender();
        }
    }

    fn live(st: &State) -> Vec<Arc<Backup>> {
        st.backups
            .iter()
            .filter(|b| !b.phase.lock().failed() && !b.leaving.load(Ordering::Acquire))
            .cloned()
            .collect()
    }

    /// Copies `[offset, offset + len)` of the live pool (64-byte lines, whole).
    fn copy_lines(region: &PmRegion, offset: u64, len: u64) -> dinomo_fabric::Result<(u64, Bytes)> {
        let start = offset & !63;
        let end = (offset + len).div_ceil(64) * 64;
        let end = end.min(copied_len(region));
        let mut buf = vec![0u8; (end - start) as usize];
        region.read_words(start, &mut buf)?;
        Ok((start, Bytes::from(buf)))
    }

    /// Waits while `b`'s queue holds more than `limit` bytes (its sender is behind).
    fn wait_below(&self, b: &Backup, limit: u64) {
        let deadline = Instant::now() + self.opts.ack_timeout;
        let mut q = b.queue.lock();
        while q.bytes > limit && !b.stop.load(Ordering::Acquire) {
            if b.queue_cv.wait_until(&mut q, deadline).timed_out() {
                drop(q);
                b.fail(
                    format!(
                        "{} bytes stayed queued for {:?}: the backup does not keep up",
                        limit, self.opts.ack_timeout
                    ),
                    &self.changes,
                );
                return;
            }
        }
    }

    /// The sender on a thread of its own (when the caller of [`Replicator::add`] runs on no
    /// multi-threaded runtime).
    fn run_sender(self: Arc<Self>, b: Arc<Backup>, nic: SocketAddr, key: AccessKey) {
        let rt = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => return b.fail(format!("runtime: {e}"), &self.changes),
        };
        rt.block_on(self.sender(b, nic, key));
    }

    /// Copies the pool to `b`, then sends it every record, until it stops or fails. A sender
    /// that ends otherwise (its task dropped with its runtime, or a panic) fails its backup,
    /// so barriers say why instead of timing out.
    async fn sender(self: Arc<Self>, b: Arc<Backup>, nic: SocketAddr, key: AccessKey) {
        struct Ended<'a>(&'a Replicator, &'a Backup);
        impl Drop for Ended<'_> {
            fn drop(&mut self) {
                if !self.1.stop.load(Ordering::Acquire) {
                    self.1.fail("its sender ended".into(), &self.0.changes);
                }
            }
        }
        let _ended = Ended(&self, &b);
        if let Err(e) = self.send_all(&b, nic, key).await {
            if !b.stop.load(Ordering::Acquire) {
                b.fail(e.to_string(), &self.changes);
            }
        }
    }

    async fn send_all(
        &self,
        b: &Arc<Backup>,
        nic: SocketAddr,
        key: AccessKey,
    ) -> dinomo_fabric::Result<()> {
        let fabric = tokio::time::timeout(self.opts.ack_timeout, TcpFabric::connect(nic, key))
            .await
            .map_err(|_| FabricError::TimedOut {
                after_ms: self.opts.ack_timeout.as_millis() as u64,
            })??;
        // The pool, chunk by chunk, through the queue (ordered with the records), skipping the
        // chunks the backup holds (see the module doc). Each MiB is read under the state lock,
        // which orders the read with the records; the comparison runs outside it (a chunk may
        // be 16 MiB, and every persist waits for that lock). A chunk that differs is read again
        // and queued, a MiB at a time, each at its own place in the order.
        let started = Instant::now();
        let chunk_bytes = b.held.as_ref().map_or(CHUNK, |h| h.chunk_bytes);
        let mut sync_until = 0;
        let mut off = 0;
        let mut index = 0;
        let copied = copied_len(&self.region);
        let mut chunk = vec![0u8; chunk_bytes.min(copied) as usize];
        while off < copied {
            if b.stop.load(Ordering::Acquire) || b.phase.lock().failed() {
                return Ok(());
            }
            let len = chunk_bytes.min(copied - off);
            let chunk = &mut chunk[..len as usize];
            // Reading and comparing a chunk (up to 16 MiB) must not hold up the runtime's
            // other tasks (see `outside_the_runtime`).
            outside_the_runtime(|| self.copy_chunk(b, off, index, chunk, &mut sync_until))?;
            off += len;
            index += 1;
            // Keep the copy a few chunks ahead of the sender, not the whole pool.
            while b.queue.lock().bytes > 8 * CHUNK {
                self.send_some(b, &fabric).await?;
            }
        }
        loop {
            if b.stop.load(Ordering::Acquire) || b.phase.lock().failed() {
                return Ok(());
            }
            let before = std::mem::discriminant(&*b.phase.lock());
            self.advance(b, sync_until, started);
            if std::mem::discriminant(&*b.phase.lock()) != before {
                // The next step may be due at once (CatchingUp -> InSync once the copy is
                // acknowledged): the sender must not wait for a record first.
                b.wake_sender();
            }
            self.send_some(b, &fabric).await?;
        }
    }

    /// Queues for `b` the chunk at `off` (its `index`-th) unless it holds it; `chunk` is the
    /// buffer of the chunk's length. `sync_until` becomes the last record queued for `b` when
    /// the chunk was read.
    fn copy_chunk(
        &self,
        b: &Arc<Backup>,
        off: u64,
        index: u64,
        chunk: &mut [u8],
        sync_until: &mut u64,
    ) -> dinomo_fabric::Result<()> {
        let len = chunk.len() as u64;
        for (i, piece) in chunk.chunks_mut(CHUNK as usize).enumerate() {
            let _st = self.state.lock();
            self.region.read_words(off + i as u64 * CHUNK, piece)?;
            // Everything queued for it so far (seqs are shared by all backups: another
            // backup's chunks take seqs this one never acknowledges).
            *sync_until = b.queue.lock().last_queued;
        }
        let held = match &b.held {
            Some(h) => h.holds(index, chunk),
            None => is_zero(chunk),
        };
        if held {
            b.resync_skipped_bytes.fetch_add(len, Ordering::Relaxed);
            return Ok(());
        }
        b.resync_bytes.fetch_add(len, Ordering::Relaxed);
        for (i, piece) in chunk.chunks_mut(CHUNK as usize).enumerate() {
            let at = off + i as u64 * CHUNK;
            let mut st = self.state.lock();
            self.region.read_words(at, piece)?;
            let data = Bytes::copy_from_slice(piece);
            Self::enqueue(&mut st, std::slice::from_ref(b), at, data);
            *sync_until = b.queue.lock().last_queued;
        }
        Ok(())
    }

    /// Moves `b` on once the copy is acknowledged: Syncing -> CatchingUp (barriers wait for it
    /// from the moment the phase changes, under the state lock, so every record queued later
    /// is waited for) -> InSync once it holds everything queued before that and recorded its
    /// copy complete (asked here, answered in the background: see [`ConfirmCopy`]).
    fn advance(&self, b: &Arc<Backup>, sync_until: u64, started: Instant) {
        let acked = b.acked.load(Ordering::Acquire);
        let mut refused = None;
        let changed = {
            let _st = self.state.lock();
            let mut p = b.phase.lock();
            match *p {
                Phase::Syncing if acked >= sync_until => {
                    *p = Phase::CatchingUp {
                        until: b.queue.lock().last_queued,
                    };
                    true
                }
                // A backup leaving the set is not told its copy is complete: it would be told a
                // generation that counts without it, and promoted, pass for a backup that
                // stayed.
                Phase::CatchingUp { until }
                    if acked >= until && !b.leaving.load(Ordering::Acquire) =>
                {
                    // It holds a consistent image now (and goes on holding one: later records
                    // arrive in order). It must say so durably before anyone sees it in sync.
                    let generation = self.generation.load(Ordering::Acquire);
                    let mut c = b.confirm.lock();
                    match std::mem::replace(&mut *c, Confirm::Pending) {
                        Confirm::Done => {
                            *c = Confirm::Done;
                            *p = Phase::InSync;
                            true
                        }
                        Confirm::Needed(f, rt) => {
                            let b = b.clone();
                            rt.spawn(async move {
                                // The call retries until it gets an answer; stop waiting once
                                // the backup is stopped or failed (nothing then needs it).
                                let call = f(generation);
                                tokio::pin!(call);
                                let r = loop {
                                    tokio::select! {
                                        r = &mut call => break r,
                                        _ = tokio::time::sleep(Duration::from_millis(500)) => {
                                            if b.stop.load(Ordering::Acquire)
                                                || b.phase.lock().failed()
                                            {
                                                return;
                                            }
                                        }
                                    }
                                };
                                *b.confirm.lock() = match r {
                                    Ok(()) => Confirm::Done,
                                    Err(why) => Confirm::Refused(why),
                                };
                                // Wakes the sender if it waits for records.
                                b.wake_sender();
                            });
                            false
                        }
                        Confirm::Pending => false,
                        Confirm::Refused(why) => {
                            refused = Some(why.clone());
                            *c = Confirm::Refused(why);
                            false
                        }
                    }
                }
                _ => false,
            }
        };
        if let Some(why) = refused {
            b.fail(
                format!("it did not record its copy complete: {why}"),
                &self.changes,
            );
            return;
        }
        if !changed {
            return;
        }
        if *b.phase.lock() == Phase::InSync {
            let ms = started.elapsed().as_millis() as u64;
            *b.resync_ms.lock() = Some(ms.max(1));
            tracing::info!(backup = %b.address, resync_bytes = b.resync_bytes.load(Ordering::Relaxed), resync_skipped_bytes = b.resync_skipped_bytes.load(Ordering::Relaxed), resync_ms = ms, "backup in sync: it holds every acknowledged byte and may be promoted");
        }
        self.changes.send_modify(|v| *v += 1);
    }

    /// Posts what is queued for `b` (waiting up to 100 ms for something), one post, and
    /// records its acknowledgement.
    async fn send_some(&self, b: &Backup, fabric: &TcpFabric) -> dinomo_fabric::Result<()> {
        let mut batch = b.take_post();
        if batch.is_empty() && !b.stop.load(Ordering::Acquire) {
            // Asynchronously: on the node's runtime a record wakes this task, not a thread.
            let _ = tokio::time::timeout(Duration::from_millis(100), b.queued.notified()).await;
            batch = b.take_post();
        }
        let Some(last) = batch.last().map(|r| r.seq) else {
            return Ok(());
        };
        let bytes: u64 = batch.iter().map(|r| r.data.len() as u64).sum();
        let ops: Vec<Op> = batch
            .into_iter()
            .map(|r| Op::Write {
                offset: r.offset,
                data: r.data,
            })
            .collect();
        tokio::time::timeout(self.opts.ack_timeout, fabric.post(&ops))
            .await
            .map_err(|_| FabricError::TimedOut {
                after_ms: self.opts.ack_timeout.as_millis() as u64,
            })??;
        b.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
        b.acked.store(last, Ordering::Release);
        {
            let mut q = b.queue.lock();
            q.bytes = q.bytes.saturating_sub(bytes);
        }
        // Not the sender: it is the caller (a permit left for itself would cost it an empty
        // round before its next wait).
        b.wake_recorders();
        self.changes.send_modify(|v| *v += 1);
        Ok(())
    }
}

impl Replicator {
    /// A check of [`Replicator::ended`] a barrier future can own.
    fn ended_flag(&self) -> impl Fn() -> Option<String> + Send + 'static {
        let ended = self.ended.clone();
        move || ended.lock().clone()
    }
}

impl PersistMirror for Replicator {
    fn record(&self, region: &PmRegion, offset: u64, len: u64) -> dinomo_fabric::Result<()> {
        let targets = {
            let mut st = self.state.lock();
            let targets = Self::live(&st);
            if targets.is_empty() {
                return Ok(());
            }
            let (start, data) = Self::copy_lines(region, offset, len)?;
            Self::enqueue(&mut st, &targets, start, data);
            targets
        };
        // Backpressure for the node's own threads (merge, GC). A runtime thread (the NIC, a
        // control call) never blocks here: it waits for the barrier next, asynchronously, so
        // what it can queue is bounded by the posts in flight (a NIC connection holds at most
        // 8 MiB of posts unanswered: `MAX_UNANSWERED_BYTES` in the fabric's tcp module; so the
        // bound grows with the connections and control calls in progress).
        if tokio::runtime::Handle::try_current().is_err() {
            for b in &targets {
                if b.queue.lock().bytes > MAX_QUEUED_BYTES {
                    self.wait_below(b, MAX_QUEUED_BYTES);
                }
            }
        }
        Ok(())
    }

    fn barrier(&self) -> BarrierFuture {
        if let Some(why) = self.ended() {
            return Box::pin(std::future::ready(Err(FabricError::Transport(why))));
        }
        if !self.term_confirmed.load(Ordering::Acquire) {
            return Box::pin(std::future::ready(Err(FabricError::Transport(
                "no backup has accepted this primary's term yet: nothing is acknowledged \
                 until one has (it fences older primaries)"
                    .into(),
            ))));
        }
        // What each backup that must acknowledge has been given so far.
        let targets: Vec<(Arc<Backup>, u64)> = {
            let st = self.state.lock();
            st.backups
                .iter()
                .filter(|b| b.phase.lock().counted())
                .map(|b| (b.clone(), b.queue.lock().last_queued))
                .collect()
        };
        let ended = self.ended_flag();
        let mut changes = self.changes.subscribe();
        let timeout = self.opts.ack_timeout;
        Box::pin(async move {
            let wait = async {
                loop {
                    // First: ending stops every sender (sets `stop`), which must not read as
                    // "removed from the set, no longer waited for" below.
                    if let Some(why) = ended() {
                        return Err(FabricError::Transport(why));
                    }
                    let mut done = true;
                    for (b, target) in &targets {
                        if b.stop.load(Ordering::Acquire) {
                            continue; // removed from the set: no longer waited for
                        }
                        if let Phase::Failed { why, .. } = &*b.phase.lock() {
                            return Err(FabricError::Transport(format!(
                                "backup {} failed ({why}): not acknowledged as durable",
                                b.address
                            )));
                        }
                        if b.acked.load(Ordering::Acquire) < *target
                            || b.leaving.load(Ordering::Acquire)
                        {
                            done = false;
                        }
                    }
                    if done {
                        // Again: `end` sets the reason before it stops the senders, so a stop
                        // seen above while ending is seen here as the reason.
                        if let Some(why) = ended() {
                            return Err(FabricError::Transport(why));
                        }
                        return Ok(());
                    }
                    if changes.changed().await.is_err() {
                        return Err(FabricError::Transport("the replicator stopped".into()));
                    }
                }
            };
            tokio::time::timeout(timeout, wait)
                .await
                .map_err(|_| FabricError::TimedOut {
                    after_ms: timeout.as_millis() as u64,
                })?
        })
    }
}

/// Runs `f`, which may take long without awaiting, so that the runtime's other tasks do not
/// wait for it: on a multi-threaded runtime's worker the worker hands its tasks over first
/// (`block_in_place`); elsewhere (a sender's own thread) it just runs.
fn outside_the_runtime<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current() {
        Ok(rt) if rt.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dinomo_fabric::DurabilityRequest;

    fn replicator(dir: &std::path::Path) -> (Arc<PmRegion>, Arc<Replicator>) {
        let region = Arc::new(
            PmRegion::create(&dir.join("pool"), 1 << 20, DurabilityRequest::ProcessCrash).unwrap(),
        );
        let r = Replicator::new(
            region.clone(),
            ReplicatorOptions {
                ack_timeout: Duration::from_millis(200),
            },
        );
        (region, r)
    }

    /// A pool whose length is not a multiple of 8 is copied up to its last whole word: the
    /// copy reads words, and the tail lies past every segment.
    #[test]
    fn a_pool_of_a_ragged_length_is_copied_to_its_last_whole_word() {
        let dir = tempfile::tempdir().unwrap();
        let len = (1 << 20) + 12;
        let region = PmRegion::create(
            &dir.path().join("pool"),
            len,
            DurabilityRequest::ProcessCrash,
        )
        .unwrap();
        region.write(len - 12, &[9u8; 12]).unwrap();
        let (start, data) = Replicator::copy_lines(&region, len - 20, 16).unwrap();
        assert_eq!(start, (1 << 20) - 64);
        assert_eq!(
            data.len(),
            72,
            "64 bytes of the last line, then one whole word"
        );
        assert_eq!(&data[64..], &[9u8; 8]);
        assert_eq!(copied_len(&region), (1 << 20) + 8);
    }

    /// An address nothing listens on: a sender's connect fails at once.
    fn closed_port() -> SocketAddr {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
    }

    fn key() -> AccessKey {
        AccessKey {
            slot: 0,
            generation: 1,
            secret: [7; 16],
        }
    }

    async fn wait_failed(r: &Replicator, address: &str) -> Phase {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let s = r.status();
            let b = s.iter().find(|b| b.address == address).unwrap();
            if b.phase.failed() {
                return b.phase.clone();
            }
            assert!(Instant::now() < deadline, "{:?}", b.phase);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A backup attached anew in place of one that counted (what `reattach_failed_backups`
    /// does) and whose copy fails too holds acknowledgements: the set does not go on smaller
    /// by itself. A first copy that fails blocks nothing (it never held anything).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_copy_in_place_of_a_counted_backup_blocks_acknowledgements() {
        let dir = tempfile::tempdir().unwrap();
        let (region, r) = replicator(dir.path());
        r.add("b:1", closed_port(), key(), None, None);
        let first = wait_failed(&r, "b:1").await;
        assert!(!first.counted(), "{first:?}");
        r.record(&region, 0, 64).unwrap();
        r.barrier()
            .await
            .expect("a failed first copy blocks nothing");

        // The backup was in sync and failed (counted); it is attached anew, and that copy fails.
        r.state.lock().backups[0]
            .phase
            .lock()
            .clone_from(&Phase::Failed {
                why: "test".into(),
                counted: true,
            });
        r.add("b:1", closed_port(), key(), None, None);
        let again = wait_failed(&r, "b:1").await;
        assert!(again.counted(), "{again:?}");
        r.record(&region, 0, 64).unwrap();
        assert!(r.barrier().await.is_err());
    }
}
