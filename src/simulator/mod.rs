//! A faithful stand-in for `bedrock-runtime`, with Bedrock's own quota arithmetic, for local
//! development, tests and load tests.
//!
//! It shares the wire types of [`crate::bedrock`] (paths, model ids, error shapes, event-stream
//! frames) but never the proxy's ledger or admission code: it does Bedrock's arithmetic on its
//! own, so that tests of the proxy cannot agree with themselves.
//!
//! # Rules
//! - **Operations**: Converse, ConverseStream, InvokeModel and InvokeModelWithResponseStream
//!   (Anthropic, Nova, Titan, Llama and a generic `max_tokens` family) answer in their exact wire
//!   shapes and are quota-counted; CountTokens is free; guardrails and async invocations answer
//!   plausible JSON; InvokeModelWithBidirectionalStream answers 400; unknown paths 404.
//! - **Input tokens**: see [`request`] (`ceil(text bytes / 4) + 3 per message`).
//! - **Quota**: see [`quota`]. One bucket per (base model, route): `{base}@{region}` on demand,
//!   `{base}@geo:us` for `us.` profiles, `{base}@global`; ARNs land in the bucket of what they
//!   name. Reserve `input + maxTokens` (absent: the model's maximum, [`models`]), 429
//!   `ThrottlingException` if it does not fit; settle to `input + output x burndown`.
//! - **Output**: see [`generate`]: deterministic per request body and `seed`; `[sim:output=N]`,
//!   `[sim:fault=503|cut|stall]` in a prompt force a length or a fault.
//! - **Faults**: 503, 500 and a reset (the connection closes before any response byte, see
//!   `reset`) come before any quota is taken; a cut stream aborts the connection and settles at
//!   `input + generated x burndown`; a stall pauses a stream half-way.
//! - **SigV4**: with `verify_sigv4` set every request must be signed with that key (403
//!   otherwise); key ids seen are recorded either way. `GET /_sim/stats` is never checked.
//!
//! # Layout
//! [`config`] settings · [`models`] per-model facts · [`request`] reading bodies ·
//! [`generate`] output and faults · [`quota`] buckets · [`shapes`] response bodies and frames ·
//! [`stream`] the paced streaming body · `handlers` the HTTP edge · [`stats`] counters.

pub mod config;
pub mod generate;
mod handlers;
pub mod models;
pub mod quota;
pub mod request;
mod reset;
pub mod shapes;
pub mod stats;
pub mod stream;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::bedrock::Operation;

pub use config::{QuotaOverride, SigV4Key, SimulatorConfig};
pub use stats::{BucketStats, SigV4Stats, SimStats};

/// The simulator: its settings and live state. Cheap to clone.
#[derive(Clone)]
pub struct Simulator {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    config: SimulatorConfig,
    buckets: quota::Buckets,
    sigv4: stats::SigV4Counters,
    arrivals: AtomicU64,
    operations: [AtomicU64; Operation::ALL.len()],
    /// Bytes of streaming bodies handed to connections.
    stream_bytes: Arc<AtomicU64>,
    /// Faults injected, in the order of [`generate::Fault::ALL`].
    faults: [AtomicU64; generate::Fault::ALL.len()],
}

impl Inner {
    fn next_arrival(&self) -> u64 {
        self.arrivals.fetch_add(1, Relaxed)
    }

    fn count_fault(&self, fault: generate::Fault) {
        if let Some(i) = generate::Fault::ALL.iter().position(|f| *f == fault) {
            self.faults[i].fetch_add(1, Relaxed);
        }
    }

    fn count_operation(&self, op: Operation) {
        if let Some(i) = Operation::ALL.iter().position(|o| *o == op) {
            self.operations[i].fetch_add(1, Relaxed);
        }
    }
}

impl std::fmt::Debug for Simulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Simulator")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Simulator {
    /// A simulator with `config` (validate it first with [`SimulatorConfig::validate`]).
    pub fn new(config: SimulatorConfig) -> Simulator {
        Simulator {
            inner: Arc::new(Inner {
                config,
                buckets: quota::Buckets::default(),
                sigv4: stats::SigV4Counters::default(),
                arrivals: AtomicU64::new(0),
                operations: std::array::from_fn(|_| AtomicU64::new(0)),
                stream_bytes: Arc::new(AtomicU64::new(0)),
                faults: std::array::from_fn(|_| AtomicU64::new(0)),
            }),
        }
    }

    pub fn config(&self) -> &SimulatorConfig {
        &self.inner.config
    }

    /// Every `bedrock-runtime` operation, plus `GET /_sim/stats`.
    pub fn router(&self) -> Router {
        let sim = self.clone();
        Router::new()
            .route(
                "/_sim/stats",
                get(move || {
                    let sim = sim.clone();
                    async move { axum::Json(sim.stats()) }
                }),
            )
            .fallback(handlers::handle)
            .with_state(Arc::clone(&self.inner))
    }

    /// A snapshot of every bucket, SigV4 checks and operation counts.
    pub fn stats(&self) -> SimStats {
        let inner = &self.inner;
        SimStats {
            buckets: inner.buckets.snapshot(Instant::now()),
            sigv4: inner.sigv4.snapshot(),
            operations: Operation::ALL
                .iter()
                .zip(&inner.operations)
                .map(|(op, n)| (op.name().to_string(), n.load(Relaxed)))
                .filter(|(_, n)| *n > 0)
                .collect(),
            stream_bytes_sent: inner.stream_bytes.load(Relaxed),
            faults: generate::Fault::ALL
                .iter()
                .zip(&inner.faults)
                .map(|(f, n)| (f.label().to_string(), n.load(Relaxed)))
                .collect(),
        }
    }
}

/// A simulator serving in the background. Dropping it shuts the server down.
#[derive(Debug)]
pub struct SimulatorHandle {
    pub addr: SocketAddr,
    pub simulator: Simulator,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl SimulatorHandle {
    /// Stops accepting, lets open calls finish for up to a second, and waits for the server.
    pub async fn shutdown(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for SimulatorHandle {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// Validates `config`, binds `addr` (HTTP/1.1 and h2c) and serves in the background.
pub async fn spawn(config: SimulatorConfig, addr: SocketAddr) -> std::io::Result<SimulatorHandle> {
    config
        .validate()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let listener = TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let simulator = Simulator::new(config);
    let (tx, rx) = oneshot::channel::<()>();
    let router = simulator.router();
    let task = tokio::spawn(async move {
        let shutdown = async move {
            let _ = rx.await;
        };
        let options = crate::server::ServeOptions {
            drain: Duration::from_secs(1),
            ..Default::default()
        };
        crate::server::serve(listener, reset::Resetting(router), None, shutdown, options).await
    });
    Ok(SimulatorHandle {
        addr,
        simulator,
        shutdown: Some(tx),
        task: Some(task),
    })
}
