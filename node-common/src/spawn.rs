//! Starting a node process and waiting until it is ready: the one place that knows how a Dinomo
//! node announces itself. A node started with `--print-ready` prints one line starting with
//! `READY` on stdout once every listener is bound (e.g. `READY addr=127.0.0.1:7801`); `dinomo
//! up`, the monitor's local orchestrator and the test harnesses all wait for that line.
//!
//! What the helpers guarantee: the child's stdout is piped and drained for the whole life of the
//! child (a node that keeps printing never blocks on a full pipe), its stderr is appended to a
//! log file, and a child that exits or does not get ready in time is reported with the path of
//! that log. [`spawn_until_ready`] and [`spawn_until_ready_async`] also kill (and reap) a child
//! that did not get ready; [`wait_for_line`] leaves that to its caller (e.g. a harness that must
//! kill a whole process group).

use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

/// How a node's ready line starts.
pub const READY_PREFIX: &str = "READY";

/// Whether `line` is a node's ready line.
pub fn is_ready_line(line: &str) -> bool {
    line.starts_with(READY_PREFIX)
}

/// The value of the field `name` (given with its `=`, e.g. `"addr="`) in a whitespace-separated
/// line such as `READY addr=127.0.0.1:7801 grpc=...`; `None` if the line has no such field.
pub fn ready_field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|w| w.strip_prefix(name))
}

/// Why a node did not get ready. Every variant names the node; those after it started also name
/// its log, where the node says why.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("{name}: opening its log {}: {source}", log.display())]
    Log {
        name: String,
        log: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("starting {name}: {source}")]
    Start {
        name: String,
        #[source]
        source: io::Error,
    },
    #[error("{name} exited ({status}) before it was ready; see {}", log.display())]
    Exited {
        name: String,
        status: ExitStatus,
        log: PathBuf,
    },
    #[error("{name} was not ready after {}; see {}", secs(*after), log.display())]
    TimedOut {
        name: String,
        after: Duration,
        log: PathBuf,
    },
    #[error("waiting for {name}: {source}; see {}", log.display())]
    Wait {
        name: String,
        log: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl SpawnError {
    /// The log the node was writing to, if it got as far as starting.
    pub fn log(&self) -> Option<&Path> {
        match self {
            SpawnError::Start { .. } => None,
            SpawnError::Log { log, .. }
            | SpawnError::Exited { log, .. }
            | SpawnError::TimedOut { log, .. }
            | SpawnError::Wait { log, .. } => Some(log),
        }
    }
}

/// "60 s", or "1.5 s" when not a whole number of seconds.
fn secs(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}

/// Opens `log` for appending (created if missing): where a node's stderr goes.
fn open_log(name: &str, log: &Path) -> Result<File, SpawnError> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|source| SpawnError::Log {
            name: name.to_string(),
            log: log.to_path_buf(),
            source,
        })
}

/// Runs `cmd` (which should make the node print its ready line, e.g. with `--print-ready`) with
/// stdout piped and stderr appended to `log`, and waits up to `timeout` for its READY line.
/// Returns the child and that line. A child that exits first, or is not ready in time, is killed
/// and reaped, and the error names `name` and `log`.
pub fn spawn_until_ready(
    name: &str,
    mut cmd: Command,
    log: &Path,
    timeout: Duration,
) -> Result<(Child, String), SpawnError> {
    let stderr = open_log(name, log)?;
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .map_err(|source| SpawnError::Start {
            name: name.to_string(),
            source,
        })?;
    match wait_for_line(&mut child, name, log, timeout, is_ready_line) {
        Ok(line) => Ok((child, line)),
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(e)
        }
    }
}

/// Waits up to `timeout` for `child` (spawned with stdout piped; `log` is where its stderr goes,
/// for the error) to print a line for which `is_ready` holds, and returns that line. Its stdout
/// is drained on a thread from then on. On an error the child is left as it is: still running
/// if it timed out, reaped if it exited.
///
/// # Panics
/// If the child's stdout was not piped (or was taken already).
pub fn wait_for_line(
    child: &mut Child,
    name: &str,
    log: &Path,
    timeout: Duration,
    is_ready: impl Fn(&str) -> bool + Send + 'static,
) -> Result<String, SpawnError> {
    let stdout = child
        .stdout
        .take()
        .expect("wait_for_line needs a child whose stdout is piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        // Reads to the end even after the ready line, so the child never blocks on the pipe.
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.is_some() && is_ready(&line) {
                let _ = tx.take().expect("checked").send(line);
            }
        }
    });
    let start = Instant::now();
    let mut stdout_open = true;
    loop {
        if stdout_open {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(line) => return Ok(line),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => stdout_open = false,
            }
        } else {
            std::thread::sleep(Duration::from_millis(20));
        }
        match child.try_wait() {
            Ok(Some(status)) => {
                // It may have printed the line just before it exited.
                if let Ok(line) = rx.recv_timeout(Duration::from_millis(100)) {
                    return Ok(line);
                }
                return Err(SpawnError::Exited {
                    name: name.to_string(),
                    status,
                    log: log.to_path_buf(),
                });
            }
            Ok(None) => {}
            Err(source) => {
                return Err(SpawnError::Wait {
                    name: name.to_string(),
                    log: log.to_path_buf(),
                    source,
                })
            }
        }
        if start.elapsed() > timeout {
            return Err(SpawnError::TimedOut {
                name: name.to_string(),
                after: timeout,
                log: log.to_path_buf(),
            });
        }
    }
}

/// [`spawn_until_ready`] for a tokio command (whatever else the caller set on `cmd`, such as
/// `kill_on_drop` or a `pre_exec` hook, is kept). Stdout is drained by a task on the current
/// runtime after the ready line.
pub async fn spawn_until_ready_async(
    name: &str,
    mut cmd: tokio::process::Command,
    log: &Path,
    timeout: Duration,
) -> Result<(tokio::process::Child, String), SpawnError> {
    use tokio::io::AsyncBufReadExt;

    let stderr = open_log(name, log)?;
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .map_err(|source| SpawnError::Start {
            name: name.to_string(),
            source,
        })?;
    let stdout = child.stdout.take().expect("piped above");
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let start = Instant::now();
    let ready = tokio::time::timeout(timeout, async {
        while let Ok(Some(line)) = lines.next_line().await {
            if is_ready_line(&line) {
                return Some(line);
            }
        }
        None
    })
    .await;
    let err = match ready {
        Ok(Some(line)) => {
            // Keep draining stdout so the child never blocks on a full pipe.
            tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
            return Ok((child, line));
        }
        // Stdout closed: the child is exiting (or closed it, and is waited for until the
        // deadline).
        Ok(None) => {
            let left = timeout.saturating_sub(start.elapsed());
            match tokio::time::timeout(left, child.wait()).await {
                Ok(Ok(status)) => SpawnError::Exited {
                    name: name.to_string(),
                    status,
                    log: log.to_path_buf(),
                },
                Ok(Err(source)) => SpawnError::Wait {
                    name: name.to_string(),
                    log: log.to_path_buf(),
                    source,
                },
                Err(_) => SpawnError::TimedOut {
                    name: name.to_string(),
                    after: timeout,
                    log: log.to_path_buf(),
                },
            }
        }
        Err(_) => SpawnError::TimedOut {
            name: name.to_string(),
            after: timeout,
            log: log.to_path_buf(),
        },
    };
    let _ = child.start_kill();
    let _ = child.wait().await;
    Err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Command {
        let mut c = Command::new("sh");
        c.args(["-c", script]);
        c
    }

    fn sh_async(script: &str) -> tokio::process::Command {
        let mut c = tokio::process::Command::new("sh");
        c.args(["-c", script]);
        c
    }

    #[test]
    fn fields() {
        let l = "READY addr=127.0.0.1:7801 grpc=127.0.0.1:7700 fabric=shm:/tmp/p";
        assert_eq!(ready_field(l, "addr="), Some("127.0.0.1:7801"));
        assert_eq!(ready_field(l, "fabric="), Some("shm:/tmp/p"));
        assert_eq!(ready_field(l, "metrics="), None);
        assert!(is_ready_line(l));
        assert!(!is_ready_line("not READY"));
    }

    #[test]
    fn ready_after_other_output_and_stderr_goes_to_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("n.log");
        let (mut child, line) = spawn_until_ready(
            "node",
            sh("echo starting; echo oops >&2; echo READY addr=1.2.3.4:5; echo more; sleep 5"),
            &log,
            Duration::from_secs(10),
        )
        .unwrap();
        assert_eq!(ready_field(&line, "addr="), Some("1.2.3.4:5"));
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(std::fs::read_to_string(&log).unwrap(), "oops\n");
    }

    #[test]
    fn exit_before_ready_names_the_status_and_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("n.log");
        let e = spawn_until_ready("node", sh("echo hi; exit 3"), &log, Duration::from_secs(10))
            .unwrap_err();
        assert!(matches!(e, SpawnError::Exited { .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.starts_with("node exited ("), "{msg}");
        assert!(msg.contains(&log.display().to_string()), "{msg}");
    }

    #[test]
    fn timeout_kills_the_child() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("n.log");
        let start = Instant::now();
        let e = spawn_until_ready("node", sh("sleep 30"), &log, Duration::from_millis(300))
            .unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(10));
        assert!(matches!(e, SpawnError::TimedOut { .. }), "{e}");
        assert!(e.to_string().contains("was not ready after 0.3 s"), "{e}");
        assert_eq!(e.log(), Some(log.as_path()));
    }

    #[test]
    fn a_custom_line_and_a_missing_program() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("n.log");
        let mut child = sh("echo a; echo Press Ctrl-C to stop.; sleep 5")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let line = wait_for_line(&mut child, "up", &log, Duration::from_secs(10), |l| {
            l.starts_with("Press Ctrl-C")
        })
        .unwrap();
        assert_eq!(line, "Press Ctrl-C to stop.");
        child.kill().unwrap();
        child.wait().unwrap();

        let e = spawn_until_ready(
            "ghost",
            Command::new("/nonexistent/dinomo-ghost"),
            &log,
            Duration::from_secs(1),
        )
        .unwrap_err();
        assert!(matches!(e, SpawnError::Start { .. }), "{e}");
        assert!(e.to_string().starts_with("starting ghost: "), "{e}");
    }

    #[tokio::test]
    async fn async_ready_exit_and_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("n.log");
        let (mut child, line) = spawn_until_ready_async(
            "kn",
            sh_async("echo x; echo READY addr=a:1; yes | head -c 1000000; sleep 5"),
            &log,
            Duration::from_secs(10),
        )
        .await
        .unwrap();
        assert_eq!(ready_field(&line, "addr="), Some("a:1"));
        child.start_kill().unwrap();
        child.wait().await.unwrap();

        let e = spawn_until_ready_async("kn", sh_async("exit 4"), &log, Duration::from_secs(10))
            .await
            .unwrap_err();
        assert!(matches!(e, SpawnError::Exited { .. }), "{e}");

        let e =
            spawn_until_ready_async("kn", sh_async("sleep 30"), &log, Duration::from_millis(300))
                .await
                .unwrap_err();
        assert!(matches!(e, SpawnError::TimedOut { .. }), "{e}");
    }
}
