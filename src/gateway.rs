//! Assembling a running proxy from a [`Config`]: the simulator (if asked for), credentials, the
//! ledger, metrics, admission, the upstream client and the listener.
//!
//! Tests and `main` share this: the caller owns the listener (bind `127.0.0.1:0` in tests) and
//! the shutdown.

use std::{
    io,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use aws_credential_types::{Credentials, provider::SharedCredentialsProvider};
use prometheus::Registry;
use tokio::{net::TcpListener, sync::oneshot, task::JoinHandle};
use tokio_util::sync::CancellationToken;

use crate::{
    admission::Admission,
    app::{AppState, router},
    config::{Config, Endpoint, LedgerConfig, OnLedgerError, RedisLedgerConfig},
    ledger::{Clock, FallbackLedger, Ledger, MemoryLedger, RedisLedger, RedisOptions},
    metrics::Metrics,
    server,
    simulator::{self, SimulatorHandle},
    upstream::{Signer, Upstream},
};

/// Why the proxy could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Tls(#[from] server::TlsError),
    #[error("{0}")]
    Credentials(String),
    #[error("upstream: {0}")]
    Upstream(String),
    #[error("simulator: {0}")]
    Simulator(String),
    #[error("ledger: {0}")]
    Ledger(String),
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("listener: {0}")]
    Listener(#[from] io::Error),
}

/// Overrides for embedding and tests.
#[derive(Debug, Default)]
pub struct GatewayOptions {
    /// Credentials for signing upstream requests, instead of the AWS default chain.
    pub credentials: Option<SharedCredentialsProvider>,
    /// A registry to register metrics in, instead of a fresh one.
    pub registry: Option<Registry>,
    /// The ledger's clock.
    pub clock: Option<Clock>,
}

/// A running proxy.
#[derive(Debug)]
pub struct Gateway {
    pub addr: SocketAddr,
    pub state: Arc<AppState>,
    /// The in-process simulator, with `endpoint = "simulated"`.
    pub simulator: Option<SimulatorHandle>,
    accept_grace: Duration,
    shutdown: Option<oneshot::Sender<()>>,
    task: JoinHandle<io::Result<()>>,
}

impl Gateway {
    /// Builds everything from `config` and serves on `listener` until [`Gateway::shutdown`].
    pub async fn start(
        config: Config,
        listener: TcpListener,
        options: GatewayOptions,
    ) -> Result<Gateway, StartError> {
        let tls = match &config.server.tls {
            Some(files) => Some(server::tls_acceptor(&files.cert, &files.key)?),
            None => None,
        };
        let (base, simulator, default_credentials) = match &config.upstream.endpoint {
            Endpoint::Simulated => {
                let mut sim_config = config.simulator.clone();
                sim_config.region = config.upstream.region.clone();
                let handle = simulator::spawn(sim_config, SocketAddr::from(([127, 0, 0, 1], 0)))
                    .await
                    .map_err(|e| StartError::Simulator(e.to_string()))?;
                let base = format!("http://{}", handle.addr)
                    .parse()
                    .map_err(|e| StartError::Simulator(format!("{e}")))?;
                let creds = Credentials::new(
                    "TOKENGATESIMULATED",
                    "simulated",
                    None,
                    None,
                    "tokengate-simulated",
                );
                (
                    base,
                    Some(handle),
                    Some(SharedCredentialsProvider::new(creds)),
                )
            }
            Endpoint::Url(uri) => (uri.clone(), None, None),
            Endpoint::Aws => (
                Upstream::aws_endpoint(&config.upstream.region)
                    .map_err(|e| StartError::Upstream(e.to_string()))?,
                None,
                None,
            ),
        };
        let provider = match options.credentials.or(default_credentials) {
            Some(p) => p,
            None => default_chain(&config.upstream.region).await?,
        };
        let signer = Signer::new(provider, &config.upstream.region);
        signer.credentials().await.map_err(|e| {
            StartError::Credentials(format!(
                "{e}. tokengate signs upstream requests with its own AWS credentials from the default chain \
                 (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, web identity, container or instance role)"
            ))
        })?;
        let up = &config.upstream;
        let deadline = CancellationToken::new();
        let upstream = Upstream::new(
            base,
            signer,
            up.connect_timeout,
            up.response_timeout,
            up.idle_timeout,
        )
        .map_err(|e| StartError::Upstream(e.to_string()))?
        .with_deadline(deadline.clone());

        let registry = options.registry.unwrap_or_default();
        let metrics = Arc::new(Metrics::new(&registry)?);
        let clock = options.clock.unwrap_or_default();
        let ledger: Arc<dyn Ledger> = match &config.ledger {
            LedgerConfig::Memory => Arc::new(MemoryLedger::new(clock)),
            LedgerConfig::Redis(redis) => redis_ledger(redis, clock, metrics.clone()).await?,
        };
        let upstream = Arc::new(upstream);
        let admission = Arc::new(
            Admission::new(
                &config.pools,
                config.admission.clone(),
                ledger,
                metrics.clone(),
            )
            .with_input_counter(upstream.clone()),
        );
        let ready = Arc::new(AtomicBool::new(false));
        let state = Arc::new(AppState {
            admission,
            upstream,
            metrics,
            registry,
            max_body_bytes: config.server.max_body_bytes,
            ready: ready.clone(),
        });
        let addr = listener.local_addr()?;
        let (tx, rx) = oneshot::channel::<()>();
        let app = router(state.clone());
        let options = server::ServeOptions {
            header_read_timeout: config.server.header_read_timeout,
            drain: config.server.drain,
            deadline,
        };
        let task = tokio::spawn(async move {
            server::serve(
                listener,
                app,
                tls,
                async {
                    let _ = rx.await;
                },
                options,
            )
            .await
        });
        ready.store(true, Ordering::Release);
        tracing::info!(%addr, pools = config.pools.len(), "tokengate listening");
        Ok(Gateway {
            addr,
            state,
            simulator,
            accept_grace: config.server.accept_grace,
            shutdown: Some(tx),
            task,
        })
    }

    pub fn admission(&self) -> &Admission {
        &self.state.admission
    }

    /// Shuts down in order: readiness goes false (the listener keeps accepting for
    /// `server.accept_grace_secs`, so load balancers stop sending first); queued requests are
    /// answered with a retryable error; the listener closes; in-flight requests and streams
    /// finish, until `server.drain_secs`, after which what is left is ended and settled;
    /// settlements still on their way to the ledger complete; the in-process simulator stops.
    pub async fn shutdown(mut self) -> io::Result<ShutdownReport> {
        self.state.ready.store(false, Ordering::Release);
        if !self.accept_grace.is_zero() {
            tracing::info!(
                accept_grace_secs = self.accept_grace.as_secs_f64(),
                "readiness is false; still accepting during the grace period"
            );
            tokio::time::sleep(self.accept_grace).await;
        }
        self.state.admission.close_queues();
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let result = (&mut self.task).await.map_err(io::Error::other)?;
        let settled_by = tokio::time::Instant::now() + SETTLEMENT_WAIT;
        while crate::admission::settle::pending_settlements() > 0
            && tokio::time::Instant::now() < settled_by
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let report = ShutdownReport::of(&self.state.admission);
        if let Some(sim) = self.simulator.take() {
            sim.shutdown().await;
        }
        result.map(|()| report)
    }
}

/// How long shutdown waits for settlements still on their way to the ledger (Redis).
const SETTLEMENT_WAIT: Duration = Duration::from_secs(5);

/// What this replica still held when it stopped: all zero after a clean shutdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Tokens reserved by requests this replica admitted and did not settle.
    pub reserved_tokens: i64,
    /// Requests this replica admitted and did not settle.
    pub in_flight: i64,
    /// Settlements handed to the ledger that did not complete.
    pub pending_settlements: usize,
    /// Reservations dropped unsettled since the process started (a bug if non-zero).
    pub unsettled_drops: u64,
}

impl ShutdownReport {
    fn of(admission: &Admission) -> ShutdownReport {
        let pools = admission.pools();
        ShutdownReport {
            reserved_tokens: pools.iter().map(|p| p.metrics.reserved_tokens.get()).sum(),
            in_flight: pools
                .iter()
                .map(|p| p.metrics.inflight_requests.get())
                .sum(),
            pending_settlements: crate::admission::settle::pending_settlements(),
            unsettled_drops: crate::ledger::unsettled_drops(),
        }
    }

    /// Nothing was left unsettled.
    pub fn is_clean(&self) -> bool {
        *self
            == ShutdownReport {
                reserved_tokens: 0,
                in_flight: 0,
                pending_settlements: 0,
                unsettled_drops: 0,
            }
    }
}

/// The shared ledger, alone (fail-closed) or with a local share behind it.
async fn redis_ledger(
    config: &RedisLedgerConfig,
    clock: Clock,
    metrics: Arc<Metrics>,
) -> Result<Arc<dyn Ledger>, StartError> {
    let options = RedisOptions {
        url: config.url.clone(),
        timeout: config.timeout,
        lease: config.lease,
    };
    let shared = RedisLedger::connect(options, metrics.clone())
        .await
        .map_err(|e| StartError::Ledger(e.message))?;
    if !shared.is_healthy() {
        tracing::warn!("redis ledger unreachable at start; retrying every second");
    }
    Ok(match config.on_error {
        OnLedgerError::FailClosed => Arc::new(shared),
        OnLedgerError::Local { expected_replicas } => Arc::new(FallbackLedger::new(
            shared,
            MemoryLedger::new(clock),
            expected_replicas,
            metrics,
        )),
    })
}

async fn default_chain(region: &str) -> Result<SharedCredentialsProvider, StartError> {
    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .region(aws_config::Region::new(region.to_string()))
        .load()
        .await;
    config
        .credentials_provider()
        .ok_or_else(|| StartError::Credentials("no AWS credentials provider is configured".into()))
}
