//! Mutual TLS and roles on a `dinomo up` cluster started as a new user starts it (TLS by
//! default): every RPC of every service called as every kind of caller, against a matrix
//! written here (independent of the table the servers enforce); what `up` leaves in its
//! credentials folder; and the README's commands, unchanged, from the user's directory.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use dinomo_proto::dpm::dpm_service_client::DpmServiceClient;
use dinomo_proto::dpm::ListMetadataRequest;
use dinomo_security::{Identity, Security, Service};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::Code;

use crate::cluster::UpCluster;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Unary,
    ServerStream,
    Bidi,
}

/// Every RPC: its service, its path, how it streams, and who may call it (`c`lient, `n`ode,
/// `m`onitor, `a`dmin), from docs/decisions/0005-security.md.
#[rustfmt::skip]
const RPCS: &[(Service, &str, Kind, &str)] = &[
    (Service::Kv, "/dinomo.kv.v1.KvService/Get", Kind::Unary, "c"),
    (Service::Kv, "/dinomo.kv.v1.KvService/Put", Kind::Unary, "c"),
    (Service::Kv, "/dinomo.kv.v1.KvService/Delete", Kind::Unary, "c"),
    (Service::Kv, "/dinomo.kv.v1.KvService/Batch", Kind::Unary, "c"),
    (Service::Kv, "/dinomo.kv.v1.KvService/Pipeline", Kind::Bidi, "c"),
    (Service::Kv, "/dinomo.kv.v1.KvService/Stats", Kind::Unary, "cma"),
    (Service::Kv, "/dinomo.kv.v1.KvService/PrepareMap", Kind::Unary, "m"),
    (Service::Kv, "/dinomo.kv.v1.KvService/CommitMap", Kind::Unary, "m"),
    (Service::Routing, "/dinomo.routing.v1.RoutingService/GetClusterMap", Kind::Unary, "cma"),
    (Service::Routing, "/dinomo.routing.v1.RoutingService/WatchClusterMap", Kind::ServerStream, "cma"),
    (Service::Monitor, "/dinomo.monitor.v1.MonitorService/ReportLatency", Kind::Unary, "c"),
    (Service::Monitor, "/dinomo.monitor.v1.MonitorService/Status", Kind::Unary, "a"),
    (Service::Monitor, "/dinomo.monitor.v1.MonitorService/SetPolicy", Kind::Unary, "a"),
    (Service::Monitor, "/dinomo.monitor.v1.MonitorService/RemoveKn", Kind::Unary, "a"),
    (Service::Monitor, "/dinomo.monitor.v1.MonitorService/FailKn", Kind::Unary, "a"),
    (Service::Monitor, "/dinomo.monitor.v1.MonitorService/AddKn", Kind::Unary, "a"),
    (Service::Dpm, "/dinomo.dpm.v1.DpmService/RegisterKn", Kind::Unary, "n"),
    (Service::Dpm, "/dinomo.dpm.v1.DpmService/AllocateSegment", Kind::Unary, "n"),
    (Service::Dpm, "/dinomo.dpm.v1.DpmService/SealSegment", Kind::Unary, "n"),
    (Service::Dpm, "/dinomo.dpm.v1.DpmService/ConfirmServing", Kind::Unary, "n"),
    (Service::Dpm, "/dinomo.dpm.v1.DpmService/PendingSegments", Kind::Unary, "nma"),
    (Service::Dpm, "/dinomo.dpm.v1.DpmService/MergeAll", Kind::Unary, "m"),
    (Service::Dpm, "/dinomo.dpm.v1.DpmService/FenceKn", Kind::Unary, "m"),
    (Service::Dpm, "/dinomo.dpm.v1.DpmService/InstallIndirectCell", Kind::Unary, "m"), // node: field rules, below
    (Service::Dpm, "/dinomo.dpm.v1.DpmService/RemoveIndirectCell", Kind::Unary, "m"),
    (Service::Dpm, "/dinomo.dpm.v1.DpmService/PutMetadata", Kind::Unary, "m"),
    (Service::Dpm, "/dinomo.dpm.v1.DpmService/CompareAndPutMetadata", Kind::Unary, "m"), // node: field rules, below
    (Service::Dpm, "/dinomo.dpm.v1.DpmService/GetMetadata", Kind::Unary, "nma"),
    (Service::Dpm, "/dinomo.dpm.v1.DpmService/ListMetadata", Kind::Unary, "ma"),
    (Service::Dpm, "/dinomo.dpm.v1.DpmService/Stats", Kind::Unary, "ma"),
    // A dpm-node without backups: the calls a node or the admin may make reach the handler,
    // which answers FAILED_PRECONDITION (replication is off).
    (Service::Dpm, "/dinomo.dpm.v1.ReplicaService/Attach", Kind::Unary, "n"),
    (Service::Dpm, "/dinomo.dpm.v1.ReplicaService/Status", Kind::Unary, "nma"),
    (Service::Dpm, "/dinomo.dpm.v1.ReplicaService/AddBackup", Kind::Unary, "ma"),
    (Service::Dpm, "/dinomo.dpm.v1.ReplicaService/RemoveBackup", Kind::Unary, "ma"),
    (Service::Dpm, "/grpc.health.v1.Health/Check", Kind::Unary, "cnma"),
    (Service::Dpm, "/grpc.health.v1.Health/Watch", Kind::ServerStream, "cnma"),
    // Last: it takes the monitor's leadership away.
    (Service::Dpm, "/dinomo.dpm.v1.DpmService/NewMonitorTerm", Kind::Unary, "m"),
];

/// Who calls: no TLS, TLS without a certificate, a certificate of another CA (claiming the
/// monitor), or one of the cluster's identities (file stem, role letter).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Who {
    Plain,
    NoCert,
    ForeignCa,
    Role(&'static str, char),
}

const WHO: [Who; 7] = [
    Who::Plain,
    Who::NoCert,
    Who::ForeignCa,
    Who::Role("client", 'c'),
    Who::Role("kn", 'n'),
    Who::Role("monitor", 'm'),
    Who::Role("admin", 'a'),
];

fn label(who: Who) -> String {
    match who {
        Who::Plain => "plain text".into(),
        Who::NoCert => "TLS, no cert".into(),
        Who::ForeignCa => "other CA".into(),
        Who::Role(f, _) => f.into(),
    }
}

struct Callers {
    creds: std::path::PathBuf,
    foreign: std::path::PathBuf,
}

impl Callers {
    fn endpoint(&self, who: Who, addr: &str, service: Service) -> tonic::transport::Endpoint {
        let load =
            |dir: &Path, name| Security::Mutual(Arc::new(Identity::load(dir, name).unwrap()));
        let ep = match who {
            Who::Plain => Security::Insecure.endpoint(addr, service).unwrap(),
            Who::ForeignCa => load(&self.foreign, "monitor")
                .endpoint(addr, service)
                .unwrap(),
            Who::Role(file, _) => load(&self.creds, file).endpoint(addr, service).unwrap(),
            Who::NoCert => {
                let ca = std::fs::read(self.creds.join("ca.pem")).unwrap();
                let tls = tonic::transport::ClientTlsConfig::new()
                    .ca_certificate(tonic::transport::Certificate::from_pem(ca))
                    .domain_name(service.domain());
                tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
                    .unwrap()
                    .tls_config(tls)
                    .unwrap()
            }
        };
        ep.connect_timeout(Duration::from_secs(3))
            .timeout(Duration::from_secs(5))
    }

    /// The status `who` gets for an empty request to `path`: `Ok` when the service took the
    /// call (whatever it then answered but an access refusal) is not distinguished here; the
    /// caller compares codes.
    async fn call(
        &self,
        who: Who,
        addr: &str,
        service: Service,
        path: &'static str,
        kind: Kind,
    ) -> Code {
        let channel = match self.endpoint(who, addr, service).connect().await {
            Ok(c) => c,
            Err(_) => return Code::Unavailable,
        };
        let mut grpc = tonic::client::Grpc::new(channel);
        if grpc.ready().await.is_err() {
            return Code::Unavailable;
        }
        let path = PathAndQuery::from_static(path);
        let codec = tonic_prost::ProstCodec::<(), ()>::default();
        let r = match kind {
            Kind::Unary => grpc
                .unary(tonic::Request::new(()), path, codec)
                .await
                .map(|_| ()),
            Kind::ServerStream => grpc
                .server_streaming(tonic::Request::new(()), path, codec)
                .await
                .map(|_| ()),
            Kind::Bidi => grpc
                .streaming(tonic::Request::new(tokio_stream::once(())), path, codec)
                .await
                .map(|_| ()),
        };
        match r {
            Ok(()) => Code::Ok,
            Err(s) => s.code(),
        }
    }
}

impl Callers {
    /// The hello `who` gets from a KV wire connection to the KV node at `addr` (the Pipeline
    /// RPC's twin, `dinomo_proto::wire`); a connection that fails before a hello (a failed
    /// handshake, plain text against TLS) reads as `Unavailable`.
    async fn wire(&self, who: Who, addr: &str) -> Code {
        use dinomo_proto::wire;
        use dinomo_security::tokio_rustls::rustls;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let tls = match who {
            Who::Plain => None,
            Who::ForeignCa => Some(
                Security::Mutual(Arc::new(Identity::load(&self.foreign, "monitor").unwrap()))
                    .rustls_client(Service::Kv, wire::ALPN)
                    .unwrap()
                    .unwrap(),
            ),
            Who::Role(file, _) => Some(
                Security::Mutual(Arc::new(Identity::load(&self.creds, file).unwrap()))
                    .rustls_client(Service::Kv, wire::ALPN)
                    .unwrap()
                    .unwrap(),
            ),
            Who::NoCert => {
                use rustls::pki_types::pem::PemObject;
                let mut roots = rustls::RootCertStore::empty();
                let ca = std::fs::read(self.creds.join("ca.pem")).unwrap();
                for c in rustls::pki_types::CertificateDer::pem_slice_iter(&ca) {
                    roots.add(c.unwrap()).unwrap();
                }
                let provider = Arc::new(rustls::crypto::ring::default_provider());
                let mut config = rustls::ClientConfig::builder_with_provider(provider)
                    .with_safe_default_protocol_versions()
                    .unwrap()
                    .with_root_certificates(roots)
                    .with_no_client_auth();
                config.alpn_protocols = vec![wire::ALPN.to_vec()];
                let name = rustls::pki_types::ServerName::try_from("kv.dinomo").unwrap();
                Some((Arc::new(config), name))
            }
        };
        let hello = async {
            let tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
            let mut io: Box<dyn Io> = match tls {
                None => Box::new(tcp),
                Some((config, name)) => Box::new(
                    dinomo_security::tokio_rustls::TlsConnector::from(config)
                        .connect(name, tcp)
                        .await
                        .ok()?,
                ),
            };
            io.write_all(&wire::PREFACE).await.ok()?;
            let mut buf = bytes::BytesMut::new();
            loop {
                if let Some(r) = wire::decode::<dinomo_proto::kv::KvResponse>(&mut buf).ok()? {
                    return Some(r);
                }
                if io.read_buf(&mut buf).await.ok()? == 0 {
                    return None;
                }
            }
        };
        match tokio::time::timeout(Duration::from_secs(5), hello).await {
            Ok(Some(r)) => Code::from_i32(r.code),
            _ => Code::Unavailable,
        }
    }
}

trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> Io for T {}

/// The row of the KV wire in the matrix: who may open one (the Pipeline RPC's roles).
const WIRE_ROW: (&str, &str) = ("KV wire (hello)", "c");

/// Every metadata entry, read as the admin (the map, the monitor's term and endpoint, the
/// reconfiguration record, the KNs' records): what a refused call must not change.
async fn metadata(callers: &Callers, dpm: &str) -> Vec<(String, Vec<u8>)> {
    let ch = callers
        .endpoint(Who::Role("admin", 'a'), dpm, Service::Dpm)
        .connect()
        .await
        .unwrap();
    let mut v: Vec<_> = DpmServiceClient::new(ch)
        .list_metadata(ListMetadataRequest {
            prefix: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .entries
        .into_iter()
        .map(|e| (e.name, e.value))
        .collect();
    v.sort();
    v
}

fn refused_without_service(code: Code) -> bool {
    // A failed handshake surfaces as a transport error: no service saw the call.
    matches!(
        code,
        Code::Unavailable | Code::Unknown | Code::Internal | Code::Cancelled
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rpc_admits_exactly_the_roles_of_its_row() {
    let up = tokio::task::spawn_blocking(|| UpCluster::start_tls(1))
        .await
        .unwrap();
    let creds = up.data_dir().join("credentials");
    let foreign = up.dir.path().join("foreign");
    dinomo_security::issue::init(&foreign).unwrap();
    let callers = Callers { creds, foreign };
    let addr = |service| match service {
        Service::Dpm => up.dpm_addr(),
        Service::Kv => format!("127.0.0.1:{}", up.kn_port(1)),
        Service::Routing => up.routing_addr(),
        Service::Monitor => up.monitor_addr(),
    };

    let mut table = vec![vec![String::new(); WHO.len()]; RPCS.len()];
    let mut wire_row = vec![String::new(); WHO.len()];
    // Refused calls first, and the metadata must not change through them.
    // The monitor publishes its endpoint once it serves, which may be just after `up` is
    // ready: wait for it, so that the cluster's own writes are done before the comparison.
    let mut before = metadata(&callers, &up.dpm_addr()).await;
    for _ in 0..100 {
        if before.iter().any(|(name, _)| name == "monitor/endpoint") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        before = metadata(&callers, &up.dpm_addr()).await;
    }
    for allowed_phase in [false, true] {
        for (i, &(service, path, kind, roles)) in RPCS.iter().enumerate() {
            for (j, &who) in WHO.iter().enumerate() {
                let allowed = matches!(who, Who::Role(_, r) if roles.contains(r));
                if allowed != allowed_phase {
                    continue;
                }
                let code = callers.call(who, &addr(service), service, path, kind).await;
                table[i][j] = format!("{code:?}");
                let ok = match who {
                    Who::Plain | Who::ForeignCa => refused_without_service(code),
                    Who::NoCert => code == Code::Unauthenticated,
                    Who::Role(..) if allowed => {
                        !matches!(code, Code::Unauthenticated | Code::PermissionDenied)
                            && !refused_without_service(code)
                    }
                    Who::Role(..) => code == Code::PermissionDenied,
                };
                assert!(ok, "{path} as {}: {code:?}", label(who));
            }
        }
        for (j, &who) in WHO.iter().enumerate() {
            let allowed = matches!(who, Who::Role(_, r) if WIRE_ROW.1.contains(r));
            if allowed != allowed_phase {
                continue;
            }
            let code = callers.wire(who, &addr(Service::Kv)).await;
            wire_row[j] = format!("{code:?}");
            let ok = match who {
                Who::Plain | Who::ForeignCa => code == Code::Unavailable,
                Who::NoCert => code == Code::Unauthenticated,
                Who::Role(..) if allowed => code == Code::Ok,
                Who::Role(..) => code == Code::PermissionDenied,
            };
            assert!(ok, "the KV wire as {}: {code:?}", label(who));
        }
        if !allowed_phase {
            let after = metadata(&callers, &up.dpm_addr()).await;
            assert_eq!(
                before, after,
                "a refused call changed the cluster's metadata"
            );
        }
    }
    println!("| RPC | {} |", WHO.map(label).join(" | "));
    println!("|---|{}", "---|".repeat(WHO.len()));
    for (i, (_, path, _, _)) in RPCS.iter().enumerate() {
        println!(
            "| {} | {} |",
            path.rsplit('/')
                .take(2)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("/"),
            table[i].join(" | ")
        );
    }
    println!("| {} | {} |", WIRE_ROW.0, wire_row.join(" | "));
}

/// Runs `dinomo <args>` from `cwd` with no credentials flag or variable; (success, output).
fn dinomo(cwd: &Path, args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dinomo"))
        .current_dir(cwd)
        .env_remove("DINOMO_CREDENTIALS")
        .env_remove("DINOMO_INSECURE")
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_user_runs_the_readme_commands_unchanged_over_tls() {
    let up = tokio::task::spawn_blocking(|| UpCluster::start_tls(1))
        .await
        .unwrap();
    let home = up.dir.path().to_path_buf();
    let routing = up.routing_addr();
    let monitor = up.monitor_addr();

    // What `up` made, with private keys and a private folder.
    let creds = up.data_dir().join("credentials");
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&creds), 0o700);
    let mut files: Vec<String> = std::fs::read_dir(&creds)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    println!("{}: {}", creds.display(), files.join(" "));
    for f in &files {
        if f.ends_with("-key.pem") {
            assert_eq!(mode(&creds.join(f)), 0o600, "{f}");
        }
    }
    assert_eq!(files.len(), 15, "{files:?}");
    // Each node is started with a folder holding only the CA certificate and its own key.
    for node in ["dpm", "kn", "monitor", "routing"] {
        let own = creds.join("nodes").join(node);
        let mut held: Vec<String> = std::fs::read_dir(&own)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        held.sort();
        assert_eq!(
            held,
            [
                "ca.pem".to_string(),
                format!("{node}-key.pem"),
                format!("{node}.pem")
            ],
            "{node}"
        );
        assert_eq!(mode(&own.join(format!("{node}-key.pem"))), 0o600);
    }

    // The README's commands, from the directory `up` ran in: credentials found by default.
    let (ok, out) = tokio::task::spawn_blocking({
        let (home, routing) = (home.clone(), routing.clone());
        move || {
            dinomo(
                &home,
                &["kv", "--routing", &routing, "put", "greeting", "hello"],
            )
        }
    })
    .await
    .unwrap();
    assert!(ok, "{out}");
    let (ok, out) = dinomo(&home, &["kv", "--routing", &routing, "get", "greeting"]);
    assert!(ok && out.contains("hello"), "{out}");
    // An answer about the key is one line and exit status 1, as "not found" is, even with
    // backtraces on (an error of the tool would print one).
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_dinomo"))
        .current_dir(&home)
        .env_remove("DINOMO_CREDENTIALS")
        .env_remove("DINOMO_INSECURE")
        .env("RUST_BACKTRACE", "1")
        .args(["kv", "--routing", &routing, "insert", "greeting", "again"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{err}");
    assert!(refused.stdout.is_empty(), "{err}");
    assert_eq!(
        err.lines()
            .filter(|l| l.contains("greeting") || l.contains("acktrace") || l.contains("Error"))
            .collect::<Vec<_>>(),
        ["greeting: already exists"],
        "{err}"
    );
    // A command that fails exits 2, apart from an answer about the key.
    let failed = std::process::Command::new(env!("CARGO_BIN_EXE_dinomo"))
        .current_dir(&home)
        .args(["kv", "--routing", "127.0.0.1:1", "get", "greeting"])
        .output()
        .unwrap();
    assert_eq!(
        failed.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&failed.stderr)
    );
    let (ok, out) = dinomo(
        &home,
        &["status", "--routing", &routing, "--dpm", &up.dpm_addr()],
    );
    assert!(ok, "{out}");
    let (ok, out) = dinomo(&home, &["admin", "--monitor", &monitor, "status"]);
    assert!(ok, "{out}");

    // The SDK, told the folder, reads what the CLI wrote; in plain text it cannot connect.
    let cfg = dinomo_client::ClientConfig::new(&[&routing])
        .with_credentials(&creds)
        .unwrap();
    let client = dinomo_client::Client::connect_with(cfg).await.unwrap();
    assert_eq!(
        client.get("greeting").await.unwrap().as_deref(),
        Some(&b"hello"[..])
    );
    // The admin identity may read the map but not call the KV service: the SDK says so at
    // once (PermissionDenied, nothing applied), not "outcome unknown" after retries.
    let mut admin = dinomo_client::ClientConfig::new(&[&routing]);
    admin.security = Security::Mutual(std::sync::Arc::new(
        Identity::load(&creds, "admin").unwrap(),
    ));
    admin.report_latency = false;
    let as_admin = dinomo_client::Client::connect_with(admin).await.unwrap();
    match as_admin.put("greeting", "overwritten").await {
        Err(dinomo_client::ClientError::PermissionDenied(m)) => {
            assert!(m.contains("needs role client"), "{m}")
        }
        other => panic!("expected PermissionDenied, got {other:?}"),
    }
    assert_eq!(
        client.get("greeting").await.unwrap().as_deref(),
        Some(&b"hello"[..])
    );
    let mut plain = dinomo_client::ClientConfig::new(&[&routing]);
    plain.security = Security::Insecure;
    plain.deadline = Duration::from_secs(2);
    assert!(dinomo_client::Client::connect_with(plain).await.is_err());

    // Elsewhere, with no credentials: told where they are looked for.
    let elsewhere = tempfile::tempdir().unwrap();
    let (ok, out) = dinomo(
        elsewhere.path(),
        &["kv", "--routing", &routing, "get", "greeting"],
    );
    assert!(!ok && out.contains("--credentials"), "{out}");
    // Plain text against the TLS cluster: refused.
    let (ok, out) = dinomo(
        elsewhere.path(),
        &["kv", "--insecure", "--routing", &routing, "get", "greeting"],
    );
    assert!(!ok && !out.contains("hello"), "{out}");
}

/// The two field-level rules: a node may look cells up but not install them, and may delete
/// the reconfiguration record but write no other metadata.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_may_only_look_cells_up_and_withdraw_a_reconfiguration() {
    use dinomo_proto::dpm::{CompareAndPutMetadataRequest, IndirectCellRequest};
    let up = tokio::task::spawn_blocking(|| UpCluster::start_tls(1))
        .await
        .unwrap();
    let creds = up.data_dir().join("credentials");
    let kn = Security::Mutual(Arc::new(Identity::load(&creds, "kn").unwrap()));
    let channel = kn
        .endpoint(&up.dpm_addr(), Service::Dpm)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut dpm = DpmServiceClient::new(channel);
    let cell = |lookup_only| IndirectCellRequest {
        key: b"some-key".to_vec(),
        lookup_only,
    };
    let e = dpm.install_indirect_cell(cell(false)).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let looked = dpm.install_indirect_cell(cell(true)).await;
    assert!(
        !matches!(&looked, Err(e) if e.code() == Code::PermissionDenied),
        "{looked:?}"
    );
    let write = |name: &str, value: Option<Vec<u8>>, expected: Option<Vec<u8>>| {
        CompareAndPutMetadataRequest {
            name: name.into(),
            value,
            expected,
        }
    };
    // Reconfiguration records as the monitor writes them, in each phase.
    let record = |phase| {
        let map = dinomo_placement::ClusterMap::new(
            vec![dinomo_placement::KnInfo {
                id: 1,
                endpoint: "127.0.0.1:1".into(),
            }],
            16,
            1,
        )
        .unwrap();
        dinomo_client::admin::Intent {
            phase,
            term: None,
            nonce: 7,
            dead: vec![],
            current: map.clone(),
            next: map,
        }
        .encode()
    };
    use dinomo_client::admin::IntentPhase::{Commit, Prepare};
    let recon = "cluster/reconfiguration";
    for (name, value, expected) in [
        ("cluster/map", Some(b"forged".to_vec()), None),
        ("cluster/map", None, None),
        (recon, Some(b"forged".to_vec()), None),
        ("anything", Some(b"x".to_vec()), None),
        // Deleting a record past its point of no return, or without naming it.
        (recon, None, Some(record(Commit))),
        (recon, None, None),
    ] {
        let e = dpm
            .compare_and_put_metadata(write(name, value, expected))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{name}: {e:?}");
    }
    // Withdrawing a Prepare-phase record passes the rule (here no such record is stored, so
    // the compare-and-swap itself fails).
    let withdraw = dpm
        .compare_and_put_metadata(write(recon, None, Some(record(Prepare))))
        .await;
    assert!(
        !matches!(&withdraw, Err(e) if e.code() == Code::PermissionDenied),
        "{withdraw:?}"
    );
}
