//! One-way network faults between the processes of a local cluster on loopback (the
//! partitions of the nemesis): iptables rules that DROP packets, in a chain of this harness's
//! own that OUTPUT jumps to for loopback traffic.
//!
//! Two kinds of cut:
//! - by port ([`NetFaults::cut_to_port`], [`NetFaults::cut_from_port`]): every packet sent to
//!   (or from) a node's listening port, so nobody reaches that server, or nobody hears its
//!   answers;
//! - by process ([`NetFaults::cut_process_to`]): every packet one process sends to a set of
//!   ports, on the connections it has now (matched by their 4-tuples, read with `ss`) and on
//!   those it opens later (the process is moved into a cgroup v2 group of its own, which new
//!   sockets belong to; an existing socket keeps the group it was created in, hence the
//!   tuples).
//!
//! Invariants: every rule lives in this harness's chain, and a [`Cut`] deletes its own rules
//! when dropped (a heal, an aborted timer or a panic alike); dropping [`NetFaults`] removes the
//! chain, the OUTPUT jump and the cgroups, so nothing outlives the test. Needs root, iptables
//! and a cgroup2 mount; [`NetFaults::new`] says which is missing.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

fn iptables(args: &[String]) -> Result<(), String> {
    let out = Command::new("iptables")
        .arg("-w")
        .args(args)
        .output()
        .map_err(|e| format!("iptables: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "iptables {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// Where cgroup v2 is mounted (the unified hierarchy).
fn cgroup2_mount() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.len() > 2 && f[2] == "cgroup2").then(|| PathBuf::from(f[1]))
    })
}

/// The established TCP connections of process `pid` to one of `ports` on loopback:
/// (local port, remote port).
fn connections_of(pid: i32, ports: &[u16]) -> Result<Vec<(u16, u16)>, String> {
    let out = Command::new("ss")
        .args(["-tnpH", "state", "established"])
        .output()
        .map_err(|e| format!("ss: {e}"))?;
    let needle = format!("pid={pid},");
    let port_of = |a: &str| a.rsplit(':').next().and_then(|p| p.parse::<u16>().ok());
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&needle))
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // Recv-Q Send-Q Local Peer Process
            let (local, peer) = (port_of(f.get(2)?)?, port_of(f.get(3)?)?);
            ports.contains(&peer).then_some((local, peer))
        })
        .collect())
}

/// The rules of one fault; dropping it deletes them (the fault heals).
pub(crate) struct Cut {
    chain: String,
    rules: Vec<Vec<String>>,
}

impl Drop for Cut {
    fn drop(&mut self) {
        for r in self.rules.drain(..) {
            let mut args = vec!["-D".to_string(), self.chain.clone()];
            args.extend(r);
            if let Err(e) = iptables(&args) {
                eprintln!("netfault: healing: {e}");
            }
        }
    }
}

/// This harness's chain and cgroups.
pub(crate) struct NetFaults {
    chain: String,
    /// The cgroup holding this harness's per-process groups, and its path relative to the
    /// cgroup2 root (what iptables' cgroup match takes).
    cgroup: PathBuf,
    cgroup_rel: String,
    root: PathBuf,
}

static NEXT: AtomicU32 = AtomicU32::new(0);

impl NetFaults {
    /// Sets up a chain and a cgroup of this harness's own, or says why it cannot.
    pub fn new() -> Result<NetFaults, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("network faults need root (iptables, cgroups)".into());
        }
        let root = cgroup2_mount().ok_or("no cgroup2 mount")?;
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let name = format!("DNM{}-{n}", std::process::id());
        let cgroup_rel = format!("dinomo-netfault-{}-{n}", std::process::id());
        let cgroup = root.join(&cgroup_rel);
        std::fs::create_dir_all(&cgroup)
            .map_err(|e| format!("creating cgroup {}: {e}", cgroup.display()))?;
        let nf = NetFaults {
            chain: name,
            cgroup,
            cgroup_rel,
            root,
        };
        iptables(&strings(&["-N", &nf.chain]))?;
        iptables(&strings(&[
            "-I", "OUTPUT", "1", "-o", "lo", "-j", &nf.chain,
        ]))?;
        Ok(nf)
    }

    fn cut(&self, rules: Vec<Vec<String>>) -> Result<Cut, String> {
        let mut cut = Cut {
            chain: self.chain.clone(),
            rules: Vec::new(),
        };
        for r in rules {
            let mut args = vec!["-A".to_string(), self.chain.clone()];
            args.extend(r.iter().cloned());
            // On an error, `cut` is dropped and deletes the rules added so far.
            iptables(&args)?;
            cut.rules.push(r);
        }
        Ok(cut)
    }

    /// Nobody reaches the server on `port`: packets to it are dropped.
    pub fn cut_to_port(&self, port: u16) -> Result<Cut, String> {
        let p = port.to_string();
        self.cut(vec![strings(&["-p", "tcp", "--dport", &p, "-j", "DROP"])])
    }

    /// The server on `port` is heard by nobody: the packets it sends are dropped.
    pub fn cut_from_port(&self, port: u16) -> Result<Cut, String> {
        let p = port.to_string();
        self.cut(vec![strings(&["-p", "tcp", "--sport", &p, "-j", "DROP"])])
    }

    /// Process `pid` reaches none of `ports`: the packets it sends there are dropped, on its
    /// connections of now and of later.
    pub fn cut_process_to(&self, pid: i32, ports: &[u16]) -> Result<Cut, String> {
        let group = self.cgroup.join(format!("p{pid}"));
        std::fs::create_dir_all(&group)
            .map_err(|e| format!("creating cgroup {}: {e}", group.display()))?;
        std::fs::write(group.join("cgroup.procs"), pid.to_string())
            .map_err(|e| format!("moving {pid} into {}: {e}", group.display()))?;
        let list = ports
            .iter()
            .map(u16::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let rel = format!("{}/p{pid}", self.cgroup_rel);
        let mut rules = vec![strings(&[
            "-p",
            "tcp",
            "-m",
            "cgroup",
            "--path",
            &rel,
            "-m",
            "multiport",
            "--dports",
            &list,
            "-j",
            "DROP",
        ])];
        for (local, peer) in connections_of(pid, ports)? {
            rules.push(strings(&[
                "-p",
                "tcp",
                "--sport",
                &local.to_string(),
                "--dport",
                &peer.to_string(),
                "-j",
                "DROP",
            ]));
        }
        self.cut(rules)
    }
}

impl Drop for NetFaults {
    fn drop(&mut self) {
        let _ = iptables(&strings(&["-D", "OUTPUT", "-o", "lo", "-j", &self.chain]));
        let _ = iptables(&strings(&["-F", &self.chain]));
        let _ = iptables(&strings(&["-X", &self.chain]));
        // Processes still in a group (a cluster outliving this harness) go back to the root.
        if let Ok(d) = std::fs::read_dir(&self.cgroup) {
            for g in d.flatten().filter(|e| e.path().is_dir()) {
                let procs =
                    std::fs::read_to_string(g.path().join("cgroup.procs")).unwrap_or_default();
                for pid in procs.lines() {
                    let _ = std::fs::write(self.root.join("cgroup.procs"), pid);
                }
                let _ = std::fs::remove_dir(g.path());
            }
        }
        let _ = std::fs::remove_dir(&self.cgroup);
    }
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::TcpListener;
    use std::process::{Command, Stdio};
    use std::time::Duration;

    use super::NetFaults;

    /// What arrives on an accepted connection within `wait`.
    fn read_within(s: &mut std::net::TcpStream, wait: Duration) -> String {
        s.set_read_timeout(Some(wait)).unwrap();
        let mut buf = [0u8; 64];
        match s.read(&mut buf) {
            Ok(n) => String::from_utf8_lossy(&buf[..n]).into_owned(),
            Err(_) => String::new(),
        }
    }

    /// A cut process's packets are dropped on the connection it had and on a new one, and flow
    /// again (retransmitted) once the cut heals; other processes are not affected.
    #[test]
    fn a_process_cut_from_a_port_is_cut_on_old_and_new_connections_until_healed() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: network faults need root");
            return;
        }
        let nf = NetFaults::new().expect("root with iptables and cgroup2 (.ci/run installs them)");
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        // The process to cut: connects, then per stdin line sends it on the connection, or
        // ("new") tries a new connection and prints whether it got through.
        let script = format!(
            "import socket,sys\n\
             s=socket.create_connection(('127.0.0.1',{port}))\n\
             print('connected',flush=True)\n\
             for l in sys.stdin:\n\
             \x20 l=l.strip()\n\
             \x20 if l=='new':\n\
             \x20   try:\n\
             \x20     t=socket.create_connection(('127.0.0.1',{port}),timeout=1); t.sendall(b'n'); print('new ok',flush=True)\n\
             \x20   except OSError as e: print('new failed',flush=True)\n\
             \x20 else: s.sendall(l.encode())\n"
        );
        let mut child = Command::new("python3")
            .args(["-c", &script])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3");
        let mut input = child.stdin.take().unwrap();
        let mut output = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        output.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "connected");
        let (mut conn, _) = l.accept().unwrap();

        let cut = nf.cut_process_to(child.id() as i32, &[port]).unwrap();
        writeln!(input, "a").unwrap();
        assert_eq!(read_within(&mut conn, Duration::from_millis(800)), "");
        // Another process still gets through.
        let mut other = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        other.write_all(b"o").unwrap();
        let (mut oc, _) = l.accept().unwrap();
        assert_eq!(read_within(&mut oc, Duration::from_secs(2)), "o");
        writeln!(input, "new").unwrap();
        line.clear();
        output.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "new failed");

        drop(cut);
        // TCP retransmits the dropped byte within its backoff (at most a few seconds here).
        assert_eq!(read_within(&mut conn, Duration::from_secs(10)), "a");
        writeln!(input, "new").unwrap();
        line.clear();
        output.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "new ok");
        let _ = child.kill();
        let _ = child.wait();
    }

    /// A port cut drops requests to the server; a cut from the port drops its answers.
    #[test]
    fn port_cuts_drop_one_direction() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: network faults need root");
            return;
        }
        let nf = NetFaults::new().expect("root with iptables and cgroup2 (.ci/run installs them)");
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (mut s, _) = l.accept().unwrap();

        let to = nf.cut_to_port(port).unwrap();
        c.write_all(b"q").unwrap();
        assert_eq!(read_within(&mut s, Duration::from_millis(800)), "");
        drop(to);
        assert_eq!(read_within(&mut s, Duration::from_secs(10)), "q");

        let from = nf.cut_from_port(port).unwrap();
        s.write_all(b"r").unwrap();
        assert_eq!(read_within(&mut c, Duration::from_millis(800)), "");
        // The other direction still flows.
        c.write_all(b"x").unwrap();
        assert_eq!(read_within(&mut s, Duration::from_secs(2)), "x");
        drop(from);
        assert_eq!(read_within(&mut c, Duration::from_secs(10)), "r");
    }
}
