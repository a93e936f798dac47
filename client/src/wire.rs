//! The KV wire transport of a [`crate::stream::NodeStream`]: one TCP (or TLS) connection to
//! the KV node's port, speaking `dinomo_proto::wire`. A writer task encodes every request
//! queued into one buffer and writes it with one call; the reader decodes every answer one
//! read brought and delivers them under one lock.
//!
//! Invariants:
//! - the stream counts as opened only once the KV node's hello said OK; every failure before
//!   that (connect, TLS handshake, a refusing hello) is reported as never sent, because the
//!   node reads no request before it sends the hello;
//! - requests are written in id order, and a request never handed to a write call is reported
//!   as never sent when the stream ends (`Ended::first_unsent`): whatever ended it, the node
//!   cannot have applied it;
//! - on the node's goodbye (it is stopping) the writer stops and ends its side; the node answers
//!   everything it read before it ends its own, so a clean stop leaves only never-sent
//!   operations to retry;
//! - a value handed to the caller is a copy, not a view into the read buffer, so that a value
//!   kept by the application does not keep the buffer it arrived in alive.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use dinomo_proto::kv as pb;
use dinomo_proto::wire;
use dinomo_security::tokio_rustls::rustls::pki_types::ServerName;
use dinomo_security::tokio_rustls::rustls::ClientConfig;
use dinomo_security::tokio_rustls::TlsConnector;
use futures::future::BoxFuture;
use futures::FutureExt;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Notify};
use tonic::{Code, Status};

use crate::stream::{never_sent, Answers, Ended, Transport};

/// How long connecting, the TLS handshake and the hello may take together.
const OPEN_TIMEOUT: Duration = Duration::from_secs(2);

/// Most requests encoded into one write.
const MAX_REQUESTS_PER_WRITE: usize = 256;

/// A write call carries at most this many bytes of requests (more only for one larger request).
const MAX_WRITE_BYTES: usize = 1 << 20;

/// A write buffer that grew beyond this (for a large value) is given back after its write.
const KEEP_BUFFER_BYTES: usize = 4 << 20;

/// Spare room kept in the read buffer for one read.
const READ_ROOM: usize = 64 << 10;

type ReadHalf = Box<dyn AsyncRead + Send + Unpin>;
type WriteHalf = Box<dyn AsyncWrite + Send + Unpin>;

/// Opens KV-wire connections to one KV node.
#[derive(Clone)]
pub(crate) struct Wire {
    /// `host:port`.
    authority: String,
    /// The TLS client configuration and the name the node's certificate must carry; `None`
    /// under `--insecure`.
    tls: Option<(Arc<ClientConfig>, ServerName<'static>)>,
}

impl std::fmt::Debug for Wire {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wire")
            .field("authority", &self.authority)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl Wire {
    /// The wire to the KV node at `endpoint` (`host:port`, a scheme is ignored).
    pub(crate) fn new(
        security: &dinomo_security::Security,
        endpoint: &str,
    ) -> Result<Self, dinomo_security::SecurityError> {
        let authority = endpoint
            .strip_prefix("http://")
            .or_else(|| endpoint.strip_prefix("https://"))
            .unwrap_or(endpoint)
            .trim_end_matches('/')
            .to_string();
        if authority.is_empty() || authority.contains('/') || !authority.contains(':') {
            return Err(dinomo_security::SecurityError::BadAddress {
                addr: endpoint.to_string(),
                reason: "expected host:port".into(),
            });
        }
        let tls = security.rustls_client(dinomo_security::Service::Kv, wire::ALPN)?;
        Ok(Wire { authority, tls })
    }

    /// Connects, sends the preface and waits for an OK hello; the connection's halves.
    async fn open(&self) -> Result<(ReadHalf, WriteHalf, BytesMut), Status> {
        let tcp = TcpStream::connect(&self.authority)
            .await
            .map_err(|e| self.unavailable("cannot connect", &e))?;
        let _ = tcp.set_nodelay(true);
        match &self.tls {
            None => {
                let mut tcp = tcp;
                let rest = self.hello(&mut tcp).await?;
                // A TCP stream splits without a lock (tokio's split of a TLS stream locks on
                // every poll, and the reader then waits for the writer's lock).
                let (rd, wr) = tcp.into_split();
                Ok((Box::new(rd), Box::new(wr), rest))
            }
            Some((config, name)) => {
                let mut tls = TlsConnector::from(config.clone())
                    .connect(name.clone(), tcp)
                    .await
                    .map_err(|e| self.unavailable("TLS handshake", &e))?;
                let rest = self.hello(&mut tls).await?;
                let (rd, wr) = tokio::io::split(tls);
                Ok((Box::new(rd), Box::new(wr), rest))
            }
        }
    }

    /// A failure to open, which never sent anything.
    fn unavailable(&self, what: &str, e: &dyn std::fmt::Display) -> Status {
        never_sent(Status::unavailable(format!(
            "{}: {what}: {e}",
            self.authority
        )))
    }

    /// Sends the preface and reads the node's hello: OK, or its refusal. Returns what was read
    /// after the hello (a goodbye may follow it at once).
    async fn hello<IO: AsyncRead + AsyncWrite + Unpin>(
        &self,
        io: &mut IO,
    ) -> Result<BytesMut, Status> {
        io.write_all(&wire::PREFACE)
            .await
            .map_err(|e| self.unavailable("sending the preface", &e))?;
        let mut buf = BytesMut::with_capacity(256);
        let hello = loop {
            match wire::decode::<pb::KvResponse>(&mut buf) {
                Ok(Some(hello)) => break hello,
                Ok(None) => {}
                Err(e) => return Err(self.unavailable("the hello", &e)),
            }
            match io.read_buf(&mut buf).await {
                Ok(0) => {
                    return Err(self.unavailable(
                        "the hello",
                        &"the KV node closed the connection (does it speak the KV wire?)",
                    ))
                }
                Ok(_) => {}
                Err(e) => return Err(self.unavailable("the hello", &e)),
            }
        };
        if hello.code != 0 {
            return Err(never_sent(Status::new(
                Code::from_i32(hello.code),
                format!("{}: {}", self.authority, hello.message),
            )));
        }
        Ok(buf)
    }
}

impl Transport for Wire {
    fn run(
        &self,
        outbound: mpsc::UnboundedReceiver<pb::KvRequest>,
        answers: Answers,
    ) -> BoxFuture<'static, Ended> {
        let wire = self.clone();
        Box::pin(async move {
            let (rd, wr, rest) = match tokio::time::timeout(OPEN_TIMEOUT, wire.open()).await {
                Ok(Ok(opened)) => opened,
                Ok(Err(status)) => return status.into(),
                Err(_) => {
                    return never_sent(Status::unavailable(format!(
                        "{}: no connection within {OPEN_TIMEOUT:?}",
                        wire.authority
                    )))
                    .into()
                }
            };
            let goodbye = Arc::new(Notify::new());
            let last_attempted = Arc::new(AtomicU64::new(0));
            let writer = tokio::spawn(write_requests(
                wr,
                outbound,
                goodbye.clone(),
                last_attempted.clone(),
            ));
            let status = read_answers(rd, rest, &answers, &wire.authority, &goodbye).await;
            writer.abort();
            // The writer is gone: nothing after the last id it tried to write left this
            // process.
            let first_unsent = last_attempted.load(Ordering::Acquire) + 1;
            Ended {
                status,
                first_unsent: Some(first_unsent),
            }
        })
    }
}

/// Writes what is queued, in order, as few writes as it takes (each at most
/// [`MAX_WRITE_BYTES`] unless one request is larger), until the queue closes or the node says
/// goodbye (then ends this side of the connection, so the node knows nothing more comes) or a
/// write fails. `last_attempted` is the highest id handed to a write call: every id after it
/// was never sent.
async fn write_requests(
    mut wr: WriteHalf,
    mut outbound: mpsc::UnboundedReceiver<pb::KvRequest>,
    goodbye: Arc<Notify>,
    last_attempted: Arc<AtomicU64>,
) {
    let mut buf = BytesMut::new();
    let mut batch = Vec::with_capacity(MAX_REQUESTS_PER_WRITE);
    loop {
        let n = tokio::select! {
            biased;
            _ = goodbye.notified() => break,
            n = outbound.recv_many(&mut batch, MAX_REQUESTS_PER_WRITE) => n,
        };
        if n == 0 {
            break; // the last NodeStream is gone
        }
        if n < MAX_REQUESTS_PER_WRITE {
            // Callers just woken by answers are about to queue their next requests: let them
            // run first, so that one write carries them all (nothing else runnable: no wait).
            tokio::task::yield_now().await;
            outbound
                .recv_many(&mut batch, MAX_REQUESTS_PER_WRITE - n)
                .now_or_never();
        }
        let mut requests = batch.drain(..).peekable();
        while requests.peek().is_some() {
            buf.clear();
            let mut last = 0;
            while let Some(r) = requests.next_if(|_| buf.len() < MAX_WRITE_BYTES) {
                last = r.id;
                wire::encode(&r, &mut buf);
            }
            last_attempted.store(last, Ordering::Release);
            if wr.write_all(&buf).await.is_err() {
                return; // the reader sees the connection fail
            }
        }
        if buf.capacity() > KEEP_BUFFER_BYTES {
            buf = BytesMut::new();
        }
    }
    let _ = wr.shutdown().await;
}

/// Reads answers until the connection ends; returns why. On the node's goodbye (an answer
/// with id 0) it tells the writer to stop and reads on: the node answers everything it read
/// and then ends the connection.
async fn read_answers(
    mut rd: ReadHalf,
    mut buf: BytesMut,
    answers: &Answers,
    authority: &str,
    goodbye: &Notify,
) -> Status {
    let mut done = Vec::new();
    let mut stopping = false;
    loop {
        // Whatever the buffer holds first: the hello's read may have brought more.
        loop {
            match wire::decode::<pb::KvResponse>(&mut buf) {
                Ok(Some(r)) if r.id == 0 => {
                    stopping = true;
                    goodbye.notify_one();
                }
                Ok(Some(mut r)) => {
                    if !r.value.is_empty() {
                        r.value = Bytes::copy_from_slice(&r.value);
                    }
                    done.push(r);
                }
                Ok(None) => break,
                Err(e) => {
                    answers.deliver(done.drain(..));
                    return Status::internal(format!("{authority}: {e}"));
                }
            }
        }
        answers.deliver(done.drain(..));
        if buf.capacity() - buf.len() < READ_ROOM / 4 {
            buf.reserve(READ_ROOM);
        }
        match rd.read_buf(&mut buf).await {
            Ok(0) if stopping => {
                return Status::unavailable(format!("{authority}: the KV node stopped"))
            }
            Ok(0) => {
                return Status::unavailable(format!(
                    "{authority}: the KV node closed the connection"
                ))
            }
            Ok(_) => {}
            Err(e) => return Status::unavailable(format!("{authority}: {e}")),
        }
    }
}
