//! `dinomo up --dpm-replicas N`: the memory node as a replica set of local processes, a primary
//! and N-1 backups (docs/decisions/0007-dpm-replication.md), and what `up` does when one dies.
//!
//! Layout: the primary always serves at the dpm-node's addresses (BASE, fabric BASE+1) from
//! `<data>/dinomo.pool`, so KNs, the routing node and the monitor find the new primary where
//! the old one was, as they find a restarted dpm-node (on Kubernetes, a Service selecting the
//! primary does the same). Backup i (1-based) serves gRPC at BASE+20+2(i-1) and its fabric NIC
//! at the next port, from `<data>/dpm-backup-i.pool`.
//!
//! Supervision, every round:
//! - the primary's ReplicaStatus is read, and the backups it reports in sync are remembered;
//! - a backup whose process exited, or that the primary reports failed, is removed from the
//!   set (so the primary acknowledges again), started again on its pool, and added back: the
//!   primary copies the chunks that differ from what the pool holds (incremental copy);
//! - a primary whose process exited is replaced by a backup that was in sync at the last
//!   round (failover) and whose copy marker (`<pool>.copy`) says complete: that backup is
//!   stopped, its pool and the dead primary's swap names (with their `.term` and `.copy`
//!   files), a new primary starts on it at the primary's addresses (taking the next term, which
//!   fences the old one at every backup; it removes the marker once it opened the pool) and a
//!   new backup takes the promoted one's place, on the dead primary's old pool file. That pool
//!   is never opened as a primary's again; as a backup's, the new primary compares it chunk by
//!   chunk with its own and copies what differs (as for a machine that came back). With no such
//!   backup (all were still copying), the primary is restarted on its own pool.
//!
//! A primary reports a backup in sync only after the backup recorded its copy complete, so a
//! backup seen in sync has a complete marker; `up` checks the marker anyway before it swaps,
//! and a primary refuses to open a pool whose marker says incomplete, so a half-copied pool is
//! never promoted.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;

use super::{spawn, Node};

/// Most replicas `up` starts (the ports BASE+20.. hold 2 per backup below BASE+100).
pub const MAX_REPLICAS: u32 = 5;

/// In-place restarts of the primary allowed per minute before `up` gives up (a primary that
/// keeps dying on its own pool). Promotions are not counted: each needs a backup in sync at
/// the last check, whose copy (what differs, since the incremental copy: half a second here)
/// bounds their rate, and `scripts/dpm-failover.sh` kills the primary 50 times in a row.
const MAX_PRIMARY_RESTARTS: usize = 8;

struct BackupSlot {
    index: u32,
    addr: String,
    args: Vec<String>,
    pool: PathBuf,
    log: PathBuf,
    node: Node,
}

/// The dpm-node replica set `up` runs.
pub(crate) struct ReplicaSet {
    primary: Node,
    pool: PathBuf,
    dpm_addr: String,
    backups: Vec<BackupSlot>,
    /// Backups the primary reported in sync at the last round.
    in_sync: BTreeSet<String>,
    primary_restarts: Vec<Instant>,
}

/// How `up` starts the set.
pub(crate) struct SetSpec<'a> {
    pub replicas: u32,
    pub port_base: u16,
    pub data_dir: &'a Path,
    pub logs: &'a Path,
    /// The primary's arguments (without `--backup`).
    pub primary_args: Vec<String>,
    /// The pool of the primary.
    pub pool: PathBuf,
    /// Credentials flags for a dpm-node.
    pub node_args: Vec<String>,
}

fn port(base: u16, off: u16) -> anyhow::Result<String> {
    Ok(format!(
        "127.0.0.1:{}",
        base.checked_add(off).context("--port-base too high")?
    ))
}

fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(suffix);
    PathBuf::from(p)
}

/// Whether the copy marker of the backup pool `pool` says its copy is complete (it holds a
/// consistent image a primary may open).
fn copy_complete(pool: &Path) -> bool {
    use dinomo_dpm_node::replication::CopyState;
    match dinomo_dpm_node::replication::copy_marker::read_copy_marker(pool) {
        Ok(Some(m)) => m.state == CopyState::Complete,
        Ok(None) => false,
        Err(e) => {
            eprintln!("reading the copy marker of {}: {e}", pool.display());
            false
        }
    }
}

/// Deletes the role a dpm-node recorded beside `pool` at run time (`<pool>.role`: promoted,
/// or deposed): `up` decides each node's role by the file it runs on (the primary's pool is
/// always the primary's), and a leftover record (`dinomo admin promote-backup` on an `up`
/// cluster, a copied data directory) would start a backup at the primary's address.
fn forget_role(pool: &Path) {
    let role = dinomo_dpm_node::replication::role_file::role_path(pool);
    match std::fs::remove_file(&role) {
        Ok(()) => eprintln!(
            "removed {} (a role recorded at run time): `up` decides the dpm-nodes' roles",
            role.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => eprintln!("removing {}: {e}", role.display()),
    }
}

/// Swaps the names of two pools and of their term files, copy markers and role records (each
/// describes the pool beside it, so it moves with it).
fn swap_pools(a: &Path, b: &Path) -> anyhow::Result<()> {
    for suffix in ["", ".term", ".copy", ".role"] {
        let (a, b) = (sibling(a, suffix), sibling(b, suffix));
        let tmp = sibling(&a, ".swap");
        let rename = |from: &Path, to: &Path| match std::fs::rename(from, to) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            r => r.with_context(|| format!("renaming {} to {}", from.display(), to.display())),
        };
        rename(&a, &tmp)?;
        rename(&b, &a)?;
        rename(&tmp, &b)?;
    }
    Ok(())
}

async fn change_set(dpm: &str, backup: &str, add: bool) -> anyhow::Result<()> {
    // Short: `up` supervises every node from one loop, and its pools attach within seconds.
    crate::backup_set::change(dpm, backup, add, Duration::from_secs(40))
        .await
        .map(|_| ())
}

impl ReplicaSet {
    /// Starts the backups, then the primary, and waits until every backup is in sync.
    pub async fn start(spec: SetSpec<'_>) -> anyhow::Result<Self> {
        let mut backups = Vec::new();
        for i in 1..spec.replicas {
            let off = 20 + 2 * (i as u16 - 1);
            let addr = port(spec.port_base, off)?;
            let pool = spec.data_dir.join(format!("dpm-backup-{i}.pool"));
            let mut args: Vec<String> = vec![
                "dpm-node".into(),
                "--role".into(),
                "backup".into(),
                "--pool".into(),
                pool.display().to_string(),
                "--listen".into(),
                addr.clone(),
                "--fabric-listen".into(),
                port(spec.port_base, off + 1)?,
                "--metrics-listen".into(),
                port(spec.port_base, 2000 + off)?,
            ];
            args.extend(spec.node_args.iter().cloned());
            let log = spec.logs.join(format!("dpm-backup-{i}.log"));
            forget_role(&pool);
            let (node, _) = spawn(&format!("dpm-node backup {i}"), &args, &log)?;
            backups.push(BackupSlot {
                index: i,
                addr,
                args,
                pool,
                log,
                node,
            });
        }
        let mut args = spec.primary_args;
        for b in &backups {
            args.extend(["--backup".into(), b.addr.clone()]);
        }
        let log = spec.logs.join("dpm-node.log");
        forget_role(&spec.pool);
        let (primary, _) = spawn("dpm-node", &args, &log)?;
        let dpm_addr = port(spec.port_base, 0)?;
        let mut set = ReplicaSet {
            primary,
            pool: spec.pool,
            dpm_addr,
            backups,
            in_sync: BTreeSet::new(),
            primary_restarts: Vec::new(),
        };
        set.wait_in_sync(Duration::from_secs(120)).await?;
        Ok(set)
    }

    /// Waits until the primary reports every backup in sync.
    pub async fn wait_in_sync(&mut self, within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        loop {
            let last = crate::status::replica_status(&self.dpm_addr).await;
            if let Ok(s) = &last {
                if s.backups.len() == self.backups.len()
                    && s.backups.iter().all(|b| b.state == "in-sync")
                {
                    self.in_sync = s.backups.iter().map(|b| b.address.clone()).collect();
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                anyhow::bail!(
                    "the dpm-node backups are not in sync after {} s: {last:?}",
                    within.as_secs()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// One supervision round (see the module doc). `Err`: the set cannot be kept up.
    pub async fn supervise(&mut self) -> anyhow::Result<()> {
        if let Ok(Some(status)) = self.primary.child.try_wait() {
            return self.replace_primary(&format!("{status}")).await;
        }
        let Ok(s) = crate::status::replica_status(&self.dpm_addr).await else {
            return Ok(()); // starting or stopping: the next round sees
        };
        self.in_sync = s
            .backups
            .iter()
            .filter(|b| b.state == "in-sync")
            .map(|b| b.address.clone())
            .collect();
        let listed = |addr: &str| s.backups.iter().find(|b| b.address == addr);
        for i in 0..self.backups.len() {
            let exited = matches!(self.backups[i].node.child.try_wait(), Ok(Some(_)));
            match listed(&self.backups[i].addr) {
                _ if exited => self.replace_backup(i, true).await?,
                Some(b) if b.state == "failed" => self.replace_backup(i, false).await?,
                // Running but not in the set (its attach failed, or the primary restarted
                // without it being reachable): the primary retries attaching the backups of
                // its command line; one added later is added again here.
                None if !self.primary_lists_at_start(&self.backups[i].addr) => {
                    if let Err(e) = change_set(&self.dpm_addr, &self.backups[i].addr, true).await {
                        eprintln!("adding dpm-node backup {}: {e:#}", self.backups[i].index);
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Whether the primary was started with `addr` as a backup (it attaches those itself,
    /// retrying until it can).
    fn primary_lists_at_start(&self, addr: &str) -> bool {
        self.primary.args.iter().any(|a| a == addr)
    }

    async fn replace_backup(&mut self, i: usize, exited: bool) -> anyhow::Result<()> {
        let b = &mut self.backups[i];
        eprintln!(
            "dpm-node backup {} {}: removing it from the replica set, starting it again and \
             copying the pool to it (see {})",
            b.index,
            if exited { "exited" } else { "failed" },
            b.log.display()
        );
        self.in_sync.remove(&b.addr);
        if let Err(e) = change_set(&self.dpm_addr, &b.addr, false).await {
            eprintln!("  (removing it: {e:#})");
        }
        if !exited {
            let _ = b.node.child.kill();
        }
        let _ = b.node.child.wait();
        forget_role(&b.pool);
        match spawn(&b.node.name, &b.args, &b.log) {
            Ok((node, _)) => b.node = node,
            Err(e) => {
                eprintln!("  (starting it: {e:#}; retrying)");
                return Ok(());
            }
        }
        if let Err(e) = change_set(&self.dpm_addr, &b.addr, true).await {
            // The next rounds add it once the primary can (see `supervise`).
            eprintln!("  (adding it again: {e:#}; retrying)");
        }
        Ok(())
    }

    async fn replace_primary(&mut self, exit: &str) -> anyhow::Result<()> {
        let t0 = Instant::now();
        let in_sync = &self.in_sync;
        let candidate = self.backups.iter_mut().position(|b| {
            in_sync.contains(&b.addr)
                && matches!(b.node.child.try_wait(), Ok(None))
                && copy_complete(&b.pool)
        });
        let Some(i) = candidate else {
            self.primary_restarts
                .retain(|t| t0.duration_since(*t) < Duration::from_secs(60));
            if self.primary_restarts.len() >= MAX_PRIMARY_RESTARTS {
                anyhow::bail!(
                    "the dpm-node primary died {MAX_PRIMARY_RESTARTS} times within a minute with \
                     no backup in sync to take its place"
                );
            }
            self.primary_restarts.push(t0);
            eprintln!(
                "dpm-node primary exited ({exit}) while no backup was in sync: restarting it \
                 on its own pool"
            );
            forget_role(&self.pool);
            self.primary.restart()?;
            return Ok(());
        };
        let b = &mut self.backups[i];
        eprintln!(
            "dpm-node primary exited ({exit}): promoting backup {} ({}), in sync at the last \
             check",
            b.index, b.addr
        );
        let _ = b.node.child.kill();
        let _ = b.node.child.wait();
        swap_pools(&self.pool, &b.pool)?;
        self.in_sync.clear();
        // From here the primary's pool is the promoted one: if its start fails, the next
        // round restarts it in place (no backup is in sync any more).
        forget_role(&self.pool);
        forget_role(&b.pool);
        let (fresh, _) = spawn(&self.primary.name, &self.primary.args, &self.primary.log)?;
        self.primary.child = fresh.child;
        // The promoted backup's place: a new backup on the dead primary's old file, which the
        // new primary's attach compares with its own pool (only differing chunks are copied).
        // If it does not start, the next round sees it exited and tries again.
        match spawn(&b.node.name, &b.args, &b.log) {
            Ok((node, _)) => b.node = node,
            Err(e) => eprintln!("starting a new backup {}: {e:#}; retrying", b.index),
        }
        let term = crate::status::replica_status(&self.dpm_addr)
            .await
            .map(|s| s.term)
            .unwrap_or(0);
        eprintln!(
            "dpm-node failover done in {} ms: the new primary (term {term}) serves at {}; its \
             backups are being copied in the background",
            t0.elapsed().as_millis(),
            self.dpm_addr
        );
        Ok(())
    }

    /// Stops the primary, then the backups.
    pub fn stop(self) {
        let mut nodes = vec![];
        for b in self.backups {
            nodes.push(b.node);
        }
        nodes.push(self.primary);
        super::stop(&mut nodes);
    }

    /// The backups' addresses, for `up`'s banner.
    pub fn backup_addrs(&self) -> Vec<String> {
        self.backups.iter().map(|b| b.addr.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn marker(state: &str) -> String {
        format!("format 1\nstate {state}\nterm 2\ninstance 7\ncopy 9\n")
    }

    #[test]
    fn only_a_complete_copy_marker_makes_a_backup_promotable() {
        let dir = tempfile::tempdir().unwrap();
        let pool = dir.path().join("dpm-backup-1.pool");
        std::fs::write(&pool, b"pool").unwrap();
        assert!(!copy_complete(&pool), "no marker: never copied");
        for (text, promotable) in [
            (marker("complete"), true),
            (marker("incomplete"), false),
            ("format 2\nstate complete\n".to_string(), false),
            ("garbage".to_string(), false),
        ] {
            std::fs::write(sibling(&pool, ".copy"), &text).unwrap();
            assert_eq!(copy_complete(&pool), promotable, "{text:?}");
        }
    }

    #[test]
    fn swapping_pools_moves_their_term_files_and_copy_markers_with_them() {
        let dir = tempfile::tempdir().unwrap();
        let (primary, backup) = (dir.path().join("p.pool"), dir.path().join("b.pool"));
        std::fs::write(&primary, "primary pool").unwrap();
        std::fs::write(sibling(&primary, ".term"), "primary term").unwrap();
        // A primary's pool has no marker (removed once opened); its backup's says complete.
        std::fs::write(&backup, "backup pool").unwrap();
        std::fs::write(sibling(&backup, ".term"), "backup term").unwrap();
        std::fs::write(sibling(&backup, ".copy"), marker("complete")).unwrap();
        swap_pools(&primary, &backup).unwrap();
        let read = |p: &Path, suffix: &str| std::fs::read_to_string(sibling(p, suffix)).ok();
        assert_eq!(read(&primary, "").as_deref(), Some("backup pool"));
        assert_eq!(read(&primary, ".term").as_deref(), Some("backup term"));
        assert_eq!(read(&primary, ".copy"), Some(marker("complete")));
        assert_eq!(read(&backup, "").as_deref(), Some("primary pool"));
        assert_eq!(read(&backup, ".term").as_deref(), Some("primary term"));
        assert_eq!(
            read(&backup, ".copy"),
            None,
            "the dead primary's pool has no marker"
        );
        assert!(
            !sibling(&primary, ".swap").exists() && !sibling(&primary, ".copy.swap").exists(),
            "no temporary name is left behind"
        );
    }
}
