//! The `local` orchestrator: KV nodes are child processes of the monitor (the embedded default,
//! used by `dinomo up` and the integration tests).
//!
//! KN `i` listens on `host:(port_base + i)` (and serves metrics on `metrics_port_base + i` when
//! set); its log goes to `log_dir/kn-<i>.log`. A KN counts as started when it prints its READY
//! line (after registering with the DPM and binding its port). A child that exits without the
//! monitor asking is reported once by [`Orchestrator::failed_kns`] and forgotten. Children are
//! killed if the orchestrator is dropped; [`LocalOrchestrator::stop_all`] stops them gracefully.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use async_trait::async_trait;
use dinomo_node_common::SpawnError;
use dinomo_placement::{KnId, KnInfo};
use tokio::process::{Child, Command};

use super::{Orchestrator, OrchestratorError, Result};

/// How to run KV nodes locally.
#[derive(Debug, Clone)]
pub struct LocalConfig {
    /// The program and leading arguments that run a KV node, e.g. `["dinomo", "kv-node"]`.
    pub command: Vec<String>,
    /// The dpm-node's control endpoint, passed as `--dpm`.
    pub dpm: String,
    /// The address KNs listen on and advertise.
    pub host: String,
    /// KN `i` listens on `port_base + i`.
    pub port_base: u16,
    /// KN `i` serves /metrics on `metrics_port_base + i`; `None`: none (disabled).
    pub metrics_port_base: Option<u16>,
    /// Where each KN's log (stderr) goes.
    pub log_dir: PathBuf,
    /// Further arguments for every KN (e.g. `--shards 2 --cache-size 64MiB`).
    pub extra_args: Vec<String>,
    /// How long a KN may take to print READY.
    pub ready_timeout: Duration,
    /// How long a KN may take to stop after SIGTERM before it is killed.
    pub stop_timeout: Duration,
}

#[derive(Debug, Default)]
struct State {
    children: BTreeMap<KnId, Child>,
    /// KNs being started (their READY line not seen yet).
    starting: std::collections::BTreeSet<KnId>,
    /// The highest id ever started or reserved (ids are not reused within a run).
    last_id: KnId,
}

/// KV nodes as child processes.
#[derive(Debug)]
pub struct LocalOrchestrator {
    cfg: LocalConfig,
    state: tokio::sync::Mutex<State>,
}

impl LocalOrchestrator {
    pub fn new(cfg: LocalConfig) -> Result<Self> {
        if cfg.command.is_empty() {
            return Err(OrchestratorError::Refused(
                "the local orchestrator needs a command that runs a KV node".into(),
            ));
        }
        std::fs::create_dir_all(&cfg.log_dir).map_err(|e| {
            OrchestratorError::Platform(format!("creating {}: {e}", cfg.log_dir.display()))
        })?;
        Ok(LocalOrchestrator {
            cfg,
            state: tokio::sync::Mutex::new(State::default()),
        })
    }

    fn port(&self, base: u16, kn: KnId) -> Result<u16> {
        u16::try_from(u32::from(base) + kn).map_err(|_| {
            OrchestratorError::Refused(format!("KN {kn} would need a port above 65535"))
        })
    }

    /// Starts KN `kn` (a specific id: `dinomo up` restarts the KNs of the published map).
    pub async fn start_kn(&self, kn: KnId) -> Result<KnInfo> {
        {
            let mut st = self.state.lock().await;
            if st.children.contains_key(&kn) || !st.starting.insert(kn) {
                return Err(OrchestratorError::Refused(format!(
                    "KN {kn} is already running"
                )));
            }
            st.last_id = st.last_id.max(kn);
        }
        // Not under the state lock: failure checks go on while a KN starts.
        let r = self.spawn_kn(kn).await;
        let mut st = self.state.lock().await;
        st.starting.remove(&kn);
        let (info, child) = r?;
        st.children.insert(kn, child);
        Ok(info)
    }

    async fn spawn_kn(&self, kn: KnId) -> Result<(KnInfo, Child)> {
        let endpoint = format!("{}:{}", self.cfg.host, self.port(self.cfg.port_base, kn)?);
        let log_path = self.cfg.log_dir.join(format!("kn-{kn}.log"));
        let mut cmd = Command::new(&self.cfg.command[0]);
        cmd.args(&self.cfg.command[1..])
            .args(["--kn-id", &kn.to_string(), "--listen", &endpoint])
            .args(["--dpm", &self.cfg.dpm, "--print-ready"]);
        let metrics = match self.cfg.metrics_port_base {
            Some(m) => format!("{}:{}", self.cfg.host, self.port(m, kn)?),
            // Disabled: KNs would otherwise all try the same default port.
            None => String::new(),
        };
        cmd.args(["--metrics-listen", &metrics]);
        cmd.args(&self.cfg.extra_args)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        // If the monitor dies without stopping its KNs (SIGKILL, a crash), they get SIGTERM
        // (and seal their logs) instead of running on as orphans nobody manages.
        // SAFETY: prctl is async-signal-safe and touches only the child being set up.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        // Stdout piped and drained, stderr to the log; killed and reaped if not ready in time.
        let (child, _) = dinomo_node_common::spawn_until_ready_async(
            &format!("KN {kn}"),
            cmd,
            &log_path,
            self.cfg.ready_timeout,
        )
        .await
        .map_err(|e| match e {
            SpawnError::Start { source, .. } => {
                OrchestratorError::Platform(format!("starting {:?}: {source}", self.cfg.command))
            }
            e => OrchestratorError::Platform(e.to_string()),
        })?;
        tracing::info!(kn, %endpoint, "KV node started");
        Ok((KnInfo { id: kn, endpoint }, child))
    }

    /// Ids not to hand out again (KNs of an earlier run that the published map still names).
    pub async fn reserve_ids_up_to(&self, kn: KnId) {
        let mut st = self.state.lock().await;
        st.last_id = st.last_id.max(kn);
    }

    /// The KNs running now.
    pub async fn running(&self) -> Vec<KnId> {
        self.state.lock().await.children.keys().copied().collect()
    }

    /// Stops every KN gracefully (SIGTERM, then SIGKILL after `stop_timeout`).
    pub async fn stop_all(&self) {
        let ids = self.running().await;
        for kn in ids {
            let _ = self.remove_kn(kn).await;
        }
    }
}

#[async_trait]
impl Orchestrator for LocalOrchestrator {
    fn name(&self) -> &'static str {
        "local"
    }

    async fn add_kn(&self) -> Result<KnInfo> {
        let next = {
            let mut st = self.state.lock().await;
            st.last_id += 1;
            st.last_id
        };
        self.start_kn(next).await
    }

    async fn remove_kn(&self, kn: KnId) -> Result<()> {
        let Some(mut child) = self.state.lock().await.children.remove(&kn) else {
            return Err(OrchestratorError::UnknownKn(kn));
        };
        if let Some(pid) = child.id() {
            // SAFETY: signalling our own child, which has not been reaped yet.
            unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        }
        match tokio::time::timeout(self.cfg.stop_timeout, child.wait()).await {
            Ok(_) => tracing::info!(kn, "KV node stopped"),
            Err(_) => {
                tracing::warn!(kn, "KV node did not stop after SIGTERM; killing it");
                let _ = child.start_kill();
                let _ = child.wait().await;
            }
        }
        Ok(())
    }

    async fn fail_kn(&self, kn: KnId) -> Result<()> {
        let mut st = self.state.lock().await;
        let child = st
            .children
            .get_mut(&kn)
            .ok_or(OrchestratorError::UnknownKn(kn))?;
        child
            .start_kill()
            .map_err(|e| OrchestratorError::Platform(format!("killing KN {kn}: {e}")))?;
        tracing::warn!(kn, "KV node killed on request (SIGKILL)");
        // Left in place: failed_kns reports it, as it would report a crash.
        Ok(())
    }

    async fn failed_kns(&self) -> Result<Vec<KnId>> {
        let mut st = self.state.lock().await;
        let mut dead = Vec::new();
        for (&kn, child) in st.children.iter_mut() {
            if let Ok(Some(status)) = child.try_wait() {
                tracing::warn!(kn, %status, "KV node process exited");
                dead.push(kn);
            }
        }
        for kn in &dead {
            st.children.remove(kn);
        }
        Ok(dead)
    }
}
