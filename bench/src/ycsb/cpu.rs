//! CPU time per operation, from /proc: of the benchmark's own process (the client side) and of
//! every Dinomo node process running on this machine (a `dinomo up` cluster, or nodes started
//! by hand), so that every run shows what an operation costs in CPU, not only how fast it went
//! on a shared machine (issue 12).
//!
//! A [`CpuSnapshot`] reads `utime + stime` of each process (`/proc/PID/stat`, fields 14 and 15,
//! in clock ticks); [`CpuSnapshot::per_op`] turns two snapshots and the operations done between
//! them into microseconds of CPU per operation for each process seen in both. The resolution is
//! one clock tick (10 ms at the usual 100 Hz), so a figure is meaningful for runs of a second or
//! more. A Redis server on this machine (the peer `dinomo bench` compares against) is reported
//! too, as "redis-server"; on a machine without /proc (not Linux) the snapshot is empty and
//! nothing is reported.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde::Serialize;

/// The node roles a Dinomo process can have, as the `dinomo` subcommand or the binary's name.
const ROLES: [&str; 4] = ["dpm-node", "kv-node", "routing-node", "monitor"];

/// A process's CPU time at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessCpu {
    pub pid: u32,
    /// "client", "dpm-node", "kv-node 2", "routing-node", "monitor".
    pub name: String,
    pub cpu: Duration,
}

/// The CPU time of this process and of the Dinomo nodes on this machine.
#[derive(Debug, Clone, Default)]
pub struct CpuSnapshot {
    pub processes: Vec<ProcessCpu>,
}

/// One process's CPU over a measured interval.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CpuUse {
    pub name: String,
    pub pid: u32,
    /// CPU seconds (user + system) spent in the interval.
    pub cpu_s: f64,
    /// Microseconds of CPU per operation of the interval.
    pub us_per_op: f64,
}

impl CpuSnapshot {
    /// Reads /proc now.
    pub fn take() -> Self {
        let me = std::process::id();
        let mut processes = Vec::new();
        if let Some(cpu) = process_cpu(me) {
            processes.push(ProcessCpu {
                pid: me,
                name: "client".into(),
                cpu,
            });
        }
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return CpuSnapshot { processes };
        };
        for entry in dir.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            if pid == me {
                continue;
            }
            let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
                continue;
            };
            let Some(name) = node_name(&cmdline) else {
                continue;
            };
            if let Some(cpu) = process_cpu(pid) {
                processes.push(ProcessCpu { pid, name, cpu });
            }
        }
        processes.sort_by(|a, b| {
            (order(&a.name), &a.name, a.pid).cmp(&(order(&b.name), &b.name, b.pid))
        });
        CpuSnapshot { processes }
    }

    /// CPU per operation of each process present in both snapshots (same pid), `ops`
    /// operations having been done between `self` (before) and `after`. Empty when `ops` is 0.
    pub fn per_op(&self, after: &CpuSnapshot, ops: u64) -> Vec<CpuUse> {
        if ops == 0 {
            return Vec::new();
        }
        let before: BTreeMap<u32, &ProcessCpu> =
            self.processes.iter().map(|p| (p.pid, p)).collect();
        after
            .processes
            .iter()
            .filter_map(|a| {
                let b = before.get(&a.pid)?;
                let spent = a.cpu.saturating_sub(b.cpu);
                Some(CpuUse {
                    name: a.name.clone(),
                    pid: a.pid,
                    cpu_s: spent.as_secs_f64(),
                    us_per_op: spent.as_secs_f64() * 1e6 / ops as f64,
                })
            })
            .collect()
    }
}

/// Client first, then the nodes in the order a request meets them.
fn order(name: &str) -> u8 {
    match name.split(' ').next() {
        Some("client") => 0,
        Some("routing-node") => 1,
        Some("kv-node") => 2,
        Some("dpm-node") => 3,
        Some("redis-server") => 4,
        _ => 5,
    }
}

/// The name of a Dinomo node process (or of a Redis server) from its NUL-separated command
/// line, `None` for any other process: `dinomo kv-node --kn-id 2 ...` or `kv-node --kn-id=2` is "kv-node 2",
/// `dinomo dpm-node ...` or `dpm-node` is "dpm-node" ("dpm-node backup" with `--role backup`);
/// `dinomo up`, `dinomo bench` and the
/// like are not nodes.
pub fn node_name(cmdline: &[u8]) -> Option<String> {
    let args: Vec<&str> = cmdline
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| std::str::from_utf8(a).unwrap_or(""))
        .collect();
    let exe = Path::new(args.first()?.split(' ').next()?)
        .file_name()?
        .to_str()?;
    if exe == "redis-server" {
        // The peer. Redis rewrites its argv[0] to "redis-server *:6379", spaces included.
        return Some(exe.to_string());
    }
    // The `dinomo` binary under any name that begins so (a copy kept as `dinomo-v1` to compare
    // builds, say), or a node binary of its own.
    let (role, rest) = if exe.starts_with("dinomo") {
        (*args.get(1)?, &args[2..])
    } else {
        (exe, &args[1..])
    };
    if !ROLES.contains(&role) {
        return None;
    }
    if role == "dpm-node" && rest.windows(2).any(|w| w == ["--role", "backup"]) {
        // A backup of a replicated memory node (`dinomo up --dpm-replicas`).
        return Some("dpm-node backup".to_string());
    }
    if role != "kv-node" {
        return Some(role.to_string());
    }
    let id = rest
        .iter()
        .enumerate()
        .find_map(|(i, a)| match a.strip_prefix("--kn-id") {
            Some("") => rest.get(i + 1).copied(),
            Some(v) => v.strip_prefix('='),
            None => None,
        });
    Some(match id {
        Some(id) => format!("kv-node {id}"),
        None => "kv-node".to_string(),
    })
}

/// utime + stime of `pid`, `None` if it is gone or unreadable.
fn process_cpu(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    cpu_of_stat(&stat, ticks_per_second())
}

/// utime + stime from the text of /proc/PID/stat. The command name (field 2) is in
/// parentheses and may itself contain spaces and parentheses, so fields are counted from the
/// last ')'.
fn cpu_of_stat(stat: &str, ticks_per_second: u64) -> Option<Duration> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    // Fields from 3 (state) on: utime is field 14, stime field 15.
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(Duration::from_secs_f64(
        (utime + stime) as f64 / ticks_per_second as f64,
    ))
}

fn ticks_per_second() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as u64
    } else {
        100
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_are_named_from_their_command_lines() {
        let cases: [(&[u8], Option<&str>); 10] = [
            (
                b"/usr/bin/dinomo\0kv-node\0--kn-id\x002\0--listen\0x\0",
                Some("kv-node 2"),
            ),
            (b"kv-node\0--kn-id=7\0", Some("kv-node 7")),
            (
                b"./target/release/dinomo\0dpm-node\0--pool\0p\0",
                Some("dpm-node"),
            ),
            (b"/opt/dpm-node\0", Some("dpm-node")),
            (
                b"dinomo\0dpm-node\0--role\0backup\0--pool\0b\0",
                Some("dpm-node backup"),
            ),
            (b"dinomo\0routing-node\0", Some("routing-node")),
            (
                b"/tmp/dinomo-before\0kv-node\0--kn-id\x003\0",
                Some("kv-node 3"),
            ),
            (b"dinomo\0up\0--kns\x002\0", None),
            (b"dinomo\0bench\0", None),
            (
                b"/usr/bin/redis-server 127.0.0.1:26700\0\0",
                Some("redis-server"),
            ),
        ];
        for (cmdline, want) in cases {
            assert_eq!(node_name(cmdline).as_deref(), want, "{cmdline:?}");
        }
        assert_eq!(node_name(b""), None);
    }

    #[test]
    fn stat_times_are_read_past_a_name_with_spaces_and_parentheses() {
        let stat = "1234 (tokio (rt) 1) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 \
                    5 0 100 1000 10 18446744073709551615";
        assert_eq!(cpu_of_stat(stat, 100), Some(Duration::from_secs(3)));
        assert_eq!(cpu_of_stat("garbage", 100), None);
    }

    #[test]
    fn per_op_uses_processes_seen_twice() {
        let p = |pid, name: &str, ms| ProcessCpu {
            pid,
            name: name.into(),
            cpu: Duration::from_millis(ms),
        };
        let before = CpuSnapshot {
            processes: vec![
                p(1, "client", 100),
                p(2, "kv-node 1", 0),
                p(3, "kv-node 2", 0),
            ],
        };
        let after = CpuSnapshot {
            processes: vec![
                p(1, "client", 1100),
                p(2, "kv-node 1", 500),
                p(4, "kv-node 3", 9),
            ],
        };
        let used = before.per_op(&after, 100_000);
        assert_eq!(used.len(), 2, "{used:?}");
        assert_eq!(used[0].name, "client");
        assert!((used[0].us_per_op - 10.0).abs() < 1e-9);
        assert!((used[1].us_per_op - 5.0).abs() < 1e-9);
        assert!(before.per_op(&after, 0).is_empty());
    }

    /// This process is always found, and its CPU time only grows.
    #[test]
    fn the_client_is_always_in_a_snapshot() {
        let a = CpuSnapshot::take();
        let mut x = 0u64;
        for i in 0..3_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let b = CpuSnapshot::take();
        assert_eq!(a.processes[0].name, "client");
        assert!(b.processes[0].cpu >= a.processes[0].cpu);
    }
}
