//! Spawns the real dpm-node binary on loopback ports chosen by the OS.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use dinomo_proto::dpm::dpm_service_client::DpmServiceClient;

#[derive(Debug)]
pub struct DpmProcess {
    child: Child,
    pub grpc: SocketAddr,
    /// The tcp fabric NIC's address; `None` when the node serves shm (it prints `shm:PATH`).
    pub fabric: Option<SocketAddr>,
    /// Its stderr: the tail is printed when a test panics with the node alive (the tempdir
    /// holding it goes with the test).
    log: PathBuf,
}

/// Writes a config for a small test pool and returns its path.
pub fn write_config(dir: &Path, extra: &str) -> PathBuf {
    let cfg = dir.join("dpm.toml");
    let text = format!(
        "pool_path = {:?}\npool_size = \"64MiB\"\nsegment_size = \"128KiB\"\nlisten = \"127.0.0.1:0\"\n\
         fabric_listen = \"127.0.0.1:0\"\nmetrics_listen = \"\"\ninitial_index_buckets = 256\n\
         gc_interval_ms = 5\n{extra}\n",
        dir.join("pool")
    );
    std::fs::write(&cfg, text).unwrap();
    cfg
}

impl DpmProcess {
    pub fn start(config: &Path, log: &Path) -> Self {
        Self::start_with_args(config, log, &[])
    }

    /// As [`DpmProcess::start`], with more command-line arguments.
    pub fn start_with_args(config: &Path, log: &Path, args: &[&str]) -> Self {
        Self::try_start(config, log, args).unwrap_or_else(|e| {
            panic!(
                "{e}; log: {}",
                std::fs::read_to_string(log).unwrap_or_default()
            )
        })
    }

    /// Starts the node, or says why it did not become ready (it exited, or timed out: then it
    /// is killed); its stderr is in `log` either way.
    pub fn try_start(config: &Path, log: &Path, args: &[&str]) -> Result<Self, String> {
        Self::try_start_with(config, log, args, |_| {})
    }

    /// As [`DpmProcess::try_start`], with `prepare` applied to the command first (limits,
    /// capabilities).
    pub fn try_start_with(
        config: &Path,
        log: &Path,
        args: &[&str],
        prepare: impl FnOnce(&mut Command),
    ) -> Result<Self, String> {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_dpm-node"));
        prepare(&mut cmd);
        // Plain text: these tests are about the node, not TLS (cli's security tests are).
        cmd.env("DINOMO_INSECURE", "1");
        cmd.arg("--config")
            .arg(config)
            .arg("--print-ready")
            .args(args)
            .env("DINOMO_LOG", "info");
        let (child, line) =
            dinomo_node_common::spawn_until_ready("dpm-node", cmd, log, Duration::from_secs(30))
                .map_err(|e| e.to_string())?;
        let field = |name: &str| -> Option<SocketAddr> {
            dinomo_node_common::ready_field(&line, name).and_then(|v| v.parse().ok())
        };
        Ok(DpmProcess {
            grpc: field("grpc=").unwrap_or_else(|| panic!("bad READY line {line:?}")),
            fabric: field("fabric="),
            child,
            log: log.to_path_buf(),
        })
    }

    pub async fn client(&self) -> DpmServiceClient<tonic::transport::Channel> {
        DpmServiceClient::connect(format!("http://{}", self.grpc))
            .await
            .expect("connecting to dpm-node")
    }

    /// Whether the process exits (by itself) within `t`.
    pub fn exits_within(&mut self, t: Duration) -> bool {
        let deadline = std::time::Instant::now() + t;
        while std::time::Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL: no shutdown code runs.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM and wait for a clean exit.
    pub fn stop(&mut self) {
        // SAFETY: sending a signal to our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let status = self.child.wait().unwrap();
        assert!(status.success(), "dpm-node exited with {status}");
    }
}

impl Drop for DpmProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let bytes = std::fs::read(&self.log).unwrap_or_default();
            let text = String::from_utf8_lossy(&bytes);
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(LOG_TAIL_LINES)..];
            // Not eprintln!: a failed write while unwinding must not panic again (abort).
            let _ = writeln!(
                std::io::stderr(),
                "--- last {} lines of {} ---\n{}",
                tail.len(),
                self.log.display(),
                tail.join("\n")
            );
        }
    }
}

/// Lines of a node's log shown when a test fails.
const LOG_TAIL_LINES: usize = 40;
