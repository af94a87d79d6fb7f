//! A faithful stand-in for `bedrock-runtime`, with Bedrock's own quota arithmetic, for local
//! development, tests and load tests.
//!
//! It shares pure wire encodings with [`crate::bedrock`] (the `Operation` paths, the restJson1
//! error shape, event-stream frames) and the SigV4 verifier, but never the proxy's model-id
//! parsing, `maxTokens` reading, usage parsing, ledger or admission code: it does Bedrock's side
//! on its own, so that tests of the proxy cannot agree with themselves.
//!
//! # Rules
//! - **Operations**: Converse, ConverseStream, InvokeModel and InvokeModelWithResponseStream
//!   (Anthropic, Nova, Titan, Llama and a generic `max_tokens` family) answer in their exact wire
//!   shapes and are quota-counted; CountTokens is free; guardrails and async invocations answer
//!   plausible JSON; unknown paths 404.
//! - **Body-model APIs** (`apis`): OpenAI Chat Completions (`/openai/v1/chat/completions`,
//!   `/v1/chat/completions`), OpenAI Responses (`/openai/v1/responses`) and Anthropic Messages
//!   (`/anthropic/v1/messages`), JSON and SSE, usage and errors in each API's own shape, charged
//!   to the same bucket as the native operations for the body's `model`.
//! - **InvokeModelWithBidirectionalStream** (`bidi`, [`sonic`]): HTTP/2 full duplex, Nova Sonic
//!   events in and out, answered turn by turn as input arrives, `usageEvent` running totals,
//!   charged from them; closed at `bidirectional_session_secs` (8 minutes).
//! - **Model ids and Regions**: [`model_id`] (the simulator's own parser) puts every id form in
//!   its bucket; [`region`] says which Region a request is made in (SigV4 scope, else Host, else
//!   `region`); every Region has its own buckets.
//! - **Input tokens**: see [`request`] (`ceil(text bytes / 4) + 3 per message`).
//! - **Quota**: see [`quota`] and `charge`. Reserve `input + maxTokens` (absent: the model's
//!   maximum, [`models`]) in the minute bucket and in the day (the bucket's `tokens_per_day`,
//!   default the minute's quota x 1,440, and the Region's `account_tokens_per_day` if set); 429
//!   `ThrottlingException` `Too many tokens per day, please wait before trying again.` if the day
//!   does not fit, else `Too many tokens, please wait before trying again.` if the minute does
//!   not; settle to `input + output x burndown`. Days are `day_secs` long; `POST /_sim/daily`
//!   (`control`) starts a new one or sets a day's use.
//! - **Service tiers** ([`tier`]): `priority`, `default`, `flex` draw on the on-demand bucket;
//!   `reserved` on the model's reserved capacity, overflowing to on-demand; echoed as each API
//!   echoes them.
//! - **Output**: see [`generate`]: deterministic per request body and `seed`; `[sim:output=N]`,
//!   `[sim:fault=503|500|reset|cut|stall]` in a prompt force a length or a fault.
//! - **Faults**: 503, 500 and a reset (the connection closes before any response byte, see
//!   `reset`) come before any quota is taken; a cut stream aborts the connection and settles at
//!   `input + generated x burndown`; a stall pauses a stream half-way. The body-model APIs get
//!   their 503s and 500s in their own error shapes.
//! - **Credentials** (`auth`): with `verify_sigv4` set every request must be signed with that
//!   key, with `api_keys` set a Bearer or `x-api-key` must be one of them (403 otherwise); the
//!   bidirectional stream takes SigV4 only, and with `verify_sigv4` each of its events' chained
//!   signatures is checked too. Key ids seen are recorded either way. `/_sim/*` is
//!   never checked.
//! - **Stats**: `GET /_sim/stats` ([`stats`]): every bucket (Region, model, route, tier
//!   capacity, minute and day), quota-counted calls by API, by requested tier and by Region.
//! - **SageMaker endpoints** ([`sagemaker`]): fleets of copies with a per-copy concurrency cap
//!   behind InvokeEndpoint and InvokeEndpointWithResponseStream, scaled with a delay through
//!   `/_sim/sagemaker`, described by the control plane's DescribeEndpoint and
//!   DescribeInferenceComponent.
//!
//! Readings of uncertain facts (U in BEDROCK-APIS.md) are stated where they are taken: the body
//! of a 429 on the body-model APIs (`apis`), the daily count's reservation ([`quota`]), the
//! account-wide day being per Region, refusing `reserved` without capacity ([`tier`]), when and
//! how a bidirectional session is throttled or timed out (`bidi`).
//!
//! # Layout
//! [`config`] settings · [`model_id`] ids to buckets · [`region`] the request's Region ·
//! [`models`] per-model facts · [`tier`] service tiers · [`request`] reading native bodies ·
//! [`generate`] output and faults · [`quota`] buckets and days · `charge` one call's charge ·
//! [`shapes`] native response bodies and frames · [`stream`] the paced streaming body ·
//! `handlers` the HTTP edge · `apis` the body-model APIs · `bidi`/[`sonic`] the
//! bidirectional stream · `auth` credentials · `control` `/_sim/daily` · [`stats`] counters ·
//! [`sagemaker`] endpoints.

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
pub mod sagemaker;
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
    /// SageMaker endpoints' copies ([`sagemaker`]).
    fleets: sagemaker::Fleets,
    traceparents: stats::TraceParents,
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
                fleets: sagemaker::Fleets::new(&config.endpoints),
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
                traceparents: stats::TraceParents::default(),
            }),
        }
    }

    pub fn config(&self) -> &SimulatorConfig {
        &self.inner.config
    }

    /// Every `bedrock-runtime` operation and body-model API, plus `GET /_sim/stats` and
    /// `POST /_sim/daily`; SageMaker endpoints and their control plane ([`sagemaker`]).
    pub fn router(&self) -> Router {
        let (stats, daily) = (self.clone(), self.clone());
        sagemaker::routes(Router::new())
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

    /// Every SageMaker fleet's figures (as `GET /_sim/sagemaker` reports them).
    pub fn endpoint_stats(&self) -> Vec<sagemaker::FleetStats> {
        self.inner.fleets.stats()
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
            traceparents: inner.traceparents.snapshot(),
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
    let h2_max_concurrent_streams = simulator.config().h2_max_concurrent_streams;
    let task = tokio::spawn(async move {
        let shutdown = async move {
            let _ = rx.await;
        };
        let options = crate::server::ServeOptions {
            drain: Duration::from_secs(1),
            h2_max_concurrent_streams,
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
