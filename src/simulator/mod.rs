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

mod apis;
mod auth;
mod bidi;
mod charge;
pub mod config;
mod control;
pub mod generate;
mod handlers;
pub mod model_id;
pub mod models;
pub mod quota;
pub mod region;
pub mod request;
mod reset;
pub mod shapes;
pub mod sonic;
pub mod stats;
pub mod stream;
pub mod tier;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::routing::{get, post};
use bytes::Bytes;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::bedrock::Operation;

pub use config::{QuotaOverride, SigV4Key, SimulatorConfig};
pub use stats::{BucketStats, CallStats, RegionStats, SigV4Stats, SimStats};

/// The simulator: its settings and live state. Cheap to clone.
#[derive(Clone)]
pub struct Simulator {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    config: SimulatorConfig,
    buckets: quota::Buckets,
    tallies: stats::Tallies,
    sigv4: stats::SigV4Counters,
    api_keys: auth::ApiKeyCounters,
    arrivals: AtomicU64,
    operations: [AtomicU64; Operation::ALL.len()],
    /// Calls of the body-model APIs, in the order of [`apis::Api::ALL`].
    api_calls: [AtomicU64; apis::Api::ALL.len()],
    /// Bytes of streaming bodies handed to connections.
    stream_bytes: Arc<AtomicU64>,
    /// Faults injected, in the order of [`generate::Fault::ALL`].
    faults: [AtomicU64; generate::Fault::ALL.len()],
    /// Days started by `POST /_sim/daily`, added to the clock's day number.
    new_days: AtomicU64,
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
        self.operations[op.index()].fetch_add(1, Relaxed);
    }

    fn count_api(&self, api: apis::Api) {
        if let Some(i) = apis::Api::ALL.iter().position(|a| *a == api) {
            self.api_calls[i].fetch_add(1, Relaxed);
        }
    }

    fn unix_secs() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    }

    /// The quota day's number: Unix time / `day_secs`, plus the days started by hand.
    fn day(&self) -> u64 {
        Self::unix_secs() / self.config.day_secs + self.new_days.load(Relaxed)
    }

    fn start_new_day(&self) {
        self.new_days.fetch_add(1, Relaxed);
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
                tallies: stats::Tallies::default(),
                sigv4: stats::SigV4Counters::default(),
                api_keys: auth::ApiKeyCounters::default(),
                arrivals: AtomicU64::new(0),
                operations: std::array::from_fn(|_| AtomicU64::new(0)),
                api_calls: std::array::from_fn(|_| AtomicU64::new(0)),
                stream_bytes: Arc::new(AtomicU64::new(0)),
                faults: std::array::from_fn(|_| AtomicU64::new(0)),
                new_days: AtomicU64::new(0),
            }),
        }
    }

    pub fn config(&self) -> &SimulatorConfig {
        &self.inner.config
    }

    /// Every `bedrock-runtime` operation and body-model API, plus `GET /_sim/stats` and
    /// `POST /_sim/daily`.
    pub fn router(&self) -> Router {
        let (stats, daily) = (self.clone(), self.clone());
        Router::new()
            .route(
                "/_sim/stats",
                get(move || {
                    let sim = stats.clone();
                    async move { axum::Json(sim.stats()) }
                }),
            )
            .route(
                "/_sim/daily",
                post(move |body: Bytes| {
                    let sim = daily.clone();
                    async move { control::daily(&sim, &body) }
                }),
            )
            .fallback(handlers::handle)
            .with_state(Arc::clone(&self.inner))
    }

    /// Starts a new quota day for every bucket and Region (as `POST /_sim/daily` does).
    pub fn start_new_day(&self) {
        self.inner.start_new_day();
    }

    /// A snapshot of every bucket, SigV4 checks, operation counts and the breakdowns by API,
    /// tier and Region.
    pub fn stats(&self) -> SimStats {
        let inner = &self.inner;
        let day = inner.day();
        let buckets = inner.buckets.snapshot(Instant::now(), day);
        let native = Operation::ALL
            .iter()
            .zip(&inner.operations)
            .map(|(op, n)| (op.name(), n.load(Relaxed)));
        let other = apis::Api::ALL
            .iter()
            .zip(&inner.api_calls)
            .map(|(api, n)| (api.label(), n.load(Relaxed)));
        SimStats {
            regions: stats::regions(
                &buckets,
                inner.tallies.regions(),
                inner.buckets.account_use(day),
            ),
            buckets,
            sigv4: inner.sigv4.snapshot(),
            operations: native
                .chain(other)
                .filter(|(_, n)| *n > 0)
                .map(|(name, n)| (name.to_string(), n))
                .collect(),
            stream_bytes_sent: inner.stream_bytes.load(Relaxed),
            faults: generate::Fault::ALL
                .iter()
                .zip(&inner.faults)
                .map(|(f, n)| (f.label().to_string(), n.load(Relaxed)))
                .collect(),
            apis: inner.tallies.apis(),
            tiers: inner.tallies.tiers(),
            day: stats::DayStats {
                day_secs: inner.config.day_secs,
                day,
                secs_left: inner.config.day_secs - Inner::unix_secs() % inner.config.day_secs,
            },
            api_keys: inner.api_keys.snapshot(),
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
