//! The KV node's one port, shared by gRPC (every service of the node) and the KV wire (the
//! data path of SDK clients, `dinomo_proto::wire`). Accepts connections, sets TCP_NODELAY,
//! does the TLS handshake itself when the node has credentials, and hands each connection to
//! gRPC (through the stream tonic serves) or to [`crate::wire::serve`].
//!
//! How a connection is told apart:
//! - TLS: by the protocol ALPN negotiated: the wire's, or anything else (`h2`, or none) for
//!   gRPC. The wire caller is checked against the access table as a caller of
//!   `KvService/Pipeline`; gRPC calls are checked per call by the access layer as before, which
//!   reads the peer's certificate from the TLS stream tonic is given;
//! - plain text: by the first byte the client sends (`D` for the wire's preface, `P` for
//!   HTTP/2's), peeked, so gRPC sees the connection from its first byte.
//!
//! Invariants: a handshake or a first byte that does not come within [`CLASSIFY_TIMEOUT`]
//! drops the connection; the accept loop never waits on one connection (each is classified in a
//! task of its own); once the server stops, nothing more is accepted or handed to gRPC; every
//! connection task holds an [`Alive`] clone, so the server can wait for the wire connections
//! to finish before it stops the node.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use dinomo_proto::wire;
use dinomo_security::access::{admit, CallerCache};
use dinomo_security::tokio_rustls::server::TlsStream;
use dinomo_security::tokio_rustls::TlsAcceptor;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

use crate::node::KvNode;

/// How long a new connection may take to finish its TLS handshake or send its first byte.
const CLASSIFY_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections classified as gRPC and not yet taken by tonic.
const GRPC_BACKLOG: usize = 128;

/// The RPC a wire caller must be allowed to call: the wire is its twin.
const PIPELINE_PATH: &str = "/dinomo.kv.v1.KvService/Pipeline";

/// Held by the accept loop and by every connection being classified or served on the wire:
/// when the last clone is gone, the receiver of the channel it came from sees it closed.
pub(crate) type Alive = mpsc::Sender<()>;

/// Accepts plain-text connections until `stopping`; returns the gRPC ones.
pub(crate) fn plain(
    listener: TcpListener,
    node: Arc<KvNode>,
    stopping: watch::Receiver<bool>,
    alive: Alive,
) -> ReceiverStream<io::Result<TcpStream>> {
    let (grpc, incoming) = mpsc::channel(GRPC_BACKLOG);
    tokio::spawn(accept_loop(listener, stopping.clone(), move |stream| {
        let (grpc, node, stopping) = (grpc.clone(), node.clone(), stopping.clone());
        let alive = alive.clone();
        async move {
            let _alive = alive;
            let mut first = [0u8; 1];
            match tokio::time::timeout(CLASSIFY_TIMEOUT, stream.peek(&mut first)).await {
                Ok(Ok(1)) if first[0] == wire::PREFACE[0] => {
                    crate::wire::serve(stream, node, Ok(()), stopping).await
                }
                Ok(Ok(1)) => {
                    let _ = grpc.send(Ok(stream)).await;
                }
                _ => {}
            }
        }
    }));
    ReceiverStream::new(incoming)
}

/// Accepts TLS connections with `tls` (which must offer the wire's ALPN) until `stopping`;
/// returns the gRPC ones.
pub(crate) fn tls(
    listener: TcpListener,
    tls: Arc<dinomo_security::tokio_rustls::rustls::ServerConfig>,
    node: Arc<KvNode>,
    stopping: watch::Receiver<bool>,
    alive: Alive,
) -> ReceiverStream<io::Result<TlsStream<TcpStream>>> {
    let (grpc, incoming) = mpsc::channel(GRPC_BACKLOG);
    let acceptor = TlsAcceptor::from(tls);
    let callers = Arc::new(CallerCache::default());
    tokio::spawn(accept_loop(listener, stopping.clone(), move |stream| {
        let (grpc, node, stopping) = (grpc.clone(), node.clone(), stopping.clone());
        let (acceptor, callers) = (acceptor.clone(), callers.clone());
        let alive = alive.clone();
        async move {
            let _alive = alive;
            let conn = match tokio::time::timeout(CLASSIFY_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(conn)) => conn,
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => return,
            };
            let session = conn.get_ref().1;
            if session.alpn_protocol() == Some(wire::ALPN) {
                let leaf = session
                    .peer_certificates()
                    .and_then(|c| c.first())
                    .map(|c| c.as_ref());
                let admitted = admit(PIPELINE_PATH, leaf, &callers).map(|_| ());
                crate::wire::serve(conn, node, admitted, stopping).await
            } else {
                let _ = grpc.send(Ok(conn)).await;
            }
        }
    }));
    ReceiverStream::new(incoming)
}

/// Accepts until `stopping` turns true (or its sender is gone), running `classify` on each
/// connection in a task of its own.
async fn accept_loop<F, Fut>(
    listener: TcpListener,
    mut stopping: watch::Receiver<bool>,
    classify: F,
) where
    F: Fn(TcpStream) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    loop {
        let accepted = tokio::select! {
            biased;
            _ = stopping.wait_for(|s| *s) => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, _)) => {
                let _ = stream.set_nodelay(true);
                tokio::spawn(classify(stream));
            }
            Err(e) => {
                // Out of descriptors and the like: back off instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}
