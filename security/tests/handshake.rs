//! A real TLS server with the access layer: who gets through, and what the refused are told.

use std::sync::Arc;
use std::time::Duration;

use dinomo_security::issue::{init, load_issuer, new_ca, new_leaf, Leaf};
use dinomo_security::{Caller, Identity, Role, Security, Service};
use tonic::codegen::http::uri::PathAndQuery;

/// Serves health (any role) on a TLS port with the access layer; returns its address.
async fn serve(security: &Security) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (_reporter, health) = tonic_health::server::health_reporter();
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = security.server_tls() {
        builder = builder.tls_config(tls).unwrap();
    }
    let router = builder.layer(security.access_layer()).add_service(health);
    tokio::spawn(router.serve_with_incoming(dinomo_proto::nodelay_incoming(listener)));
    addr
}

/// Calls `path` with an empty message; the status code the caller sees.
async fn call(security: &Security, addr: std::net::SocketAddr, path: &'static str) -> tonic::Code {
    let ep = security
        .endpoint(&addr.to_string(), Service::Dpm)
        .unwrap()
        .connect_timeout(Duration::from_secs(5));
    let channel = match ep.connect().await {
        Ok(c) => c,
        Err(_) => return tonic::Code::Unavailable,
    };
    let mut grpc = tonic::client::Grpc::new(channel);
    if grpc.ready().await.is_err() {
        return tonic::Code::Unavailable;
    }
    let codec = tonic_prost::ProstCodec::<(), ()>::default();
    match grpc
        .unary(
            tonic::Request::new(()),
            PathAndQuery::from_static(path),
            codec,
        )
        .await
    {
        Ok(_) => tonic::Code::Ok,
        Err(s) => s.code(),
    }
}

const FENCE: &str = "/dinomo.dpm.v1.DpmService/FenceKn";
const HEALTH: &str = "/grpc.health.v1.Health/Check";

#[tokio::test]
async fn mutual_tls_admits_by_role_and_refuses_the_rest() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("credentials");
    init(&dir).unwrap();
    let as_ = |name: &str| Security::Mutual(Arc::new(Identity::load(&dir, name).unwrap()));
    let server = as_("dpm");
    let addr = serve(&server).await;

    // Right role: admitted (no such route on this test server: UNIMPLEMENTED, past the layer).
    assert_eq!(
        call(&as_("monitor"), addr, FENCE).await,
        tonic::Code::Unimplemented
    );
    // Wrong role: refused before any handler.
    assert_eq!(
        call(&as_("client"), addr, FENCE).await,
        tonic::Code::PermissionDenied
    );
    assert_eq!(
        call(&as_("kn"), addr, FENCE).await,
        tonic::Code::PermissionDenied
    );
    // A path nobody may call.
    assert_eq!(
        call(&as_("admin"), addr, "/dinomo.dpm.v1.DpmService/Format").await,
        tonic::Code::PermissionDenied
    );
    // Health: any identity.
    assert_eq!(call(&as_("client"), addr, HEALTH).await, tonic::Code::Ok);
    // Plain text: no handshake, so no answer from any service (the transport error surfaces as
    // UNKNOWN or UNAVAILABLE).
    let plain = call(&Security::Insecure, addr, HEALTH).await;
    assert!(
        matches!(plain, tonic::Code::Unknown | tonic::Code::Unavailable),
        "{plain:?}"
    );

    // TLS without a client certificate: told what is needed.
    let no_cert = {
        let ca = std::fs::read(dir.join("ca.pem")).unwrap();
        let tls = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(ca))
            .domain_name("dpm.dinomo");
        let channel = tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut grpc = tonic::client::Grpc::new(channel);
        grpc.ready().await.unwrap();
        grpc.unary(
            tonic::Request::new(()),
            PathAndQuery::from_static(FENCE),
            tonic_prost::ProstCodec::<(), ()>::default(),
        )
        .await
        .unwrap_err()
    };
    assert_eq!(no_cert.code(), tonic::Code::Unauthenticated);
    assert!(
        no_cert.message().contains("role monitor"),
        "{}",
        no_cert.message()
    );

    // A certificate of another CA with a valid-looking identity fails the handshake.
    let other = tmp.path().join("other");
    init(&other).unwrap();
    let forged = Security::Mutual(Arc::new(Identity::load(&other, "monitor").unwrap()));
    assert_ne!(call(&forged, addr, FENCE).await, tonic::Code::Unimplemented);
    assert_ne!(call(&forged, addr, HEALTH).await, tonic::Code::Ok);
}

#[tokio::test]
async fn a_server_certificate_for_another_service_is_not_trusted() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("credentials");
    init(&dir).unwrap();
    // The client certificate's server serves as "kv.dinomo"; dialling it as the DPM fails.
    let kn = Security::Mutual(Arc::new(Identity::load(&dir, "kn").unwrap()));
    let addr = serve(&kn).await;
    let monitor = Security::Mutual(Arc::new(Identity::load(&dir, "monitor").unwrap()));
    assert_ne!(call(&monitor, addr, HEALTH).await, tonic::Code::Ok);
    let ep = monitor.endpoint(&addr.to_string(), Service::Kv).unwrap();
    assert!(ep.connect().await.is_ok());
}

#[test]
fn a_certificate_without_exactly_one_dinomo_uri_is_no_identity() {
    let (ca, key) = new_ca().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("ca.pem"), &ca).unwrap();
    std::fs::write(tmp.path().join("ca-key.pem"), &key).unwrap();
    let issuer = load_issuer(tmp.path()).unwrap();
    let leaf = Leaf {
        file: "x".into(),
        caller: Caller::new(Role::Client, "x"),
        dns: None,
    };
    let (pem, _) = new_leaf(&leaf, &issuer).unwrap();
    let der = pem_der(&pem);
    assert_eq!(Caller::from_certificate(&der).unwrap(), leaf.caller);
    // The CA certificate itself names no URI.
    assert!(Caller::from_certificate(&pem_der(&ca)).is_err());
}

fn pem_der(pem: &str) -> Vec<u8> {
    x509_parser::pem::parse_x509_pem(pem.as_bytes())
        .unwrap()
        .1
        .contents
}
