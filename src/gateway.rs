//! Assembling a running proxy from a [`Config`]: the simulator (if asked for), credentials, the
//! ledger, metrics, admission, the upstream client and the listener.
//!
//! Tests and `main` share this: the caller owns the listener (bind `127.0.0.1:0` in tests) and
//! the shutdown. The admin listener (`server.admin_listen`), when configured, is bound here.
//!
//! (Long: start, reload and shutdown of one value, and the assembly they share.)

use std::{
    io,
    net::SocketAddr,
    sync::{
        Arc, Mutex, Weak,
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
    admission::InputCounter,
    app::{Admin, admin_router, router},
    config::{Config, Endpoint, LedgerConfig, OnLedgerError, ProcessConfig, RedisLedgerConfig},
    ledger::{
        Clock, FallbackLedger, LeaseOptions, LeasedLedger, Ledger, MemoryLedger, RedisLedger,
        RedisOptions,
    },
    metrics::Metrics,
    observe::{Telemetry, timed::TimedLedger},
    proxy::count_tokens::UpstreamCounter,
    server,
    simulator::{self, SimulatorHandle},
    state::{AppState, Policy},
    upstream::{
        Signer, Upstream,
        sagemaker::{SageMakerUpstreams, Service, Timeouts},
    },
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
    #[error("tracing: {0}")]
    Tracing(String),
    #[error("listener: {0}")]
    Listener(#[from] io::Error),
    #[error("cannot listen on {addr} (server.admin_listen): {source}")]
    AdminListener { addr: SocketAddr, source: io::Error },
    #[error("endpoint pool {pool:?}: {error}")]
    Endpoint { pool: String, error: String },
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
    /// The admin listener's address, with `server.admin_listen`.
    pub admin_addr: Option<SocketAddr>,
    pub state: Arc<AppState>,
    /// The in-process simulator, with `endpoint = "simulated"`.
    pub simulator: Option<SimulatorHandle>,
    proxy: Served,
    admin: Option<Served>,
    accept_grace: Duration,
    /// The config in force, for reloads to compare with.
    config: Mutex<Config>,
    /// Admission controllers replaced by reloads, whose queues may still hold waiters: closed at
    /// shutdown like the current one.
    retired: Mutex<Vec<Weak<Admission>>>,
    /// Stops the endpoint copies refreshers ([`crate::copies`]).
    refreshers: CancellationToken,
}

/// Why a config reload was refused (the running config stays).
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("{0}")]
    Invalid(#[from] crate::config::ConfigError),
    #[error("{0}")]
    Endpoint(String),
}

/// The sections a reload cannot change in a running process: listeners, the upstream client,
/// the ledger backend, logging, the simulator, traces and the other telemetry outputs. Changes
/// there are logged and wait for a restart.
fn restart_only_changes(old: &ProcessConfig, new: &ProcessConfig) -> Vec<&'static str> {
    [
        ("[server]", old.server != new.server),
        ("[upstream]", old.upstream != new.upstream),
        ("[ledger]", old.ledger != new.ledger),
        ("[log]", old.log != new.log),
        ("[simulator]", old.simulator != new.simulator),
        ("[tracing]", old.tracing != new.tracing),
        ("[metrics]", old.metrics != new.metrics),
    ]
    .into_iter()
    .filter_map(|(section, changed)| changed.then_some(section))
    .collect()
}

/// One listener's serving task and the signal that stops it.
#[derive(Debug)]
struct Served {
    stop: oneshot::Sender<()>,
    task: JoinHandle<io::Result<()>>,
}

impl Served {
    fn spawn(
        listener: TcpListener,
        app: axum::Router,
        tls: Option<tokio_rustls::TlsAcceptor>,
        options: server::ServeOptions,
    ) -> Served {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(server::serve(
            listener,
            app,
            tls,
            async {
                let _ = stopped.await;
            },
            options,
        ));
        Served { stop, task }
    }

    /// Stops accepting and waits for the drain.
    async fn stop(self) -> io::Result<()> {
        let _ = self.stop.send(());
        self.task.await.map_err(io::Error::other)?
    }
}

impl Gateway {
    /// Builds everything from `config` and serves on `listener` until [`Gateway::shutdown`].
    pub async fn start(
        config: Config,
        listener: TcpListener,
        options: GatewayOptions,
    ) -> Result<Gateway, StartError> {
        let tls = match &config.process.server.tls {
            Some(files) => Some(server::tls_acceptor(&files.cert, &files.key)?),
            None => None,
        };
        let Assembled {
            state,
            simulator,
            deadline,
        } = assemble(&config, options).await?;
        let addr = listener.local_addr()?;
        // Probes and scrapes over plain HTTP, whether or not the proxy listener has TLS.
        let admin = match config.process.server.admin_listen {
            Some(admin_addr) => Some(bind_admin(admin_addr).await?),
            None => None,
        };
        let admin_addr = admin.as_ref().map(|(a, _)| *a);
        let serve_options = serve_options(&config.process.server, deadline, &state);
        let admin = admin.map(|(_, l)| {
            let options = server::ServeOptions {
                max_connections: server::ADMIN_MAX_CONNECTIONS,
                metrics: Some(state.metrics.listener("admin")),
                ..serve_options.clone()
            };
            Served::spawn(l, admin_router(state.clone()), None, options)
        });
        let admin_here = if admin.is_some() {
            Admin::Elsewhere
        } else {
            Admin::Here
        };
        let proxy = Served::spawn(
            listener,
            router(state.clone(), admin_here),
            tls,
            serve_options,
        );
        let refreshers = CancellationToken::new();
        crate::copies::follow(&state.policy().admission, &state.sagemaker, &refreshers);
        state.ready.store(true, Ordering::Release);
        tracing::info!(%addr, ?admin_addr, pools = config.policy.pools.len(), "tokengate listening");
        Ok(Gateway {
            addr,
            admin_addr,
            state,
            simulator,
            proxy,
            admin,
            accept_grace: config.process.server.accept_grace,
            config: Mutex::new(config),
            retired: Mutex::new(Vec::new()),
            refreshers,
        })
    }

    /// The admission controller in force now.
    pub fn admission(&self) -> Arc<Admission> {
        self.state.policy().admission.clone()
    }

    /// Applies a new config's pools, routes, admission settings and auth, atomically: requests
    /// that started before keep the policy they started with and settle in the same ledger;
    /// requests from now on use the new one. Each pool carries over what it learned (input
    /// calibration, throttle feedback, durations, counts) to its successor of the same name.
    /// Changes to sections that need a restart are logged and not applied.
    pub fn reload(&self, new: Config) -> Result<(), ReloadError> {
        let metrics = self.state.metrics.clone();
        let mut current = self.config.lock().unwrap_or_else(|p| p.into_inner());
        let pending = restart_only_changes(&current.process, &new.process);
        if !pending.is_empty() {
            tracing::warn!(sections = ?pending, "config reload: these sections changed and take effect at the next restart");
        }
        let old = self.state.policy();
        if let Err(e) = endpoint_clients(&new, &self.state.sagemaker) {
            return Err(ReloadError::Endpoint(e.to_string()));
        }
        let policy = Policy::build(
            &new.policy,
            old.admission.ledger().clone(),
            self.input_counter(),
            &metrics,
            &self.state.telemetry,
        );
        policy.admission.inherit(&old.admission);
        crate::copies::follow(&policy.admission, &self.state.sagemaker, &self.refreshers);
        self.state.policy.store(Arc::new(policy));
        let mut retired = self.retired.lock().unwrap_or_else(|p| p.into_inner());
        retired.retain(|w| w.strong_count() > 0);
        retired.push(Arc::downgrade(&old.admission));
        tracing::info!(
            pools = new.policy.pools.len(),
            routes = new.policy.routes.len(),
            auth = new.policy.auth.mode.label(),
            "config reloaded"
        );
        // The process keeps running as it was built, so the next reload compares with that.
        current.policy = new.policy;
        metrics.config_reloads.with_label_values(&["ok"]).inc();
        Ok(())
    }

    /// Exact input counts for `count_tokens` pools, through this gateway's upstream.
    fn input_counter(&self) -> Arc<dyn InputCounter> {
        Arc::new(UpstreamCounter(self.state.upstream.clone()))
    }

    /// Reads `path` and [`Gateway::reload`]s it; an unreadable or invalid file is refused,
    /// logged and counted (`tokengate_config_reloads_total{result="error"}`), and the running
    /// config stays.
    pub fn reload_from(&self, path: &std::path::Path) -> Result<(), ReloadError> {
        let result = Config::load(path)
            .map_err(ReloadError::from)
            .and_then(|config| self.reload(config));
        if let Err(e) = &result {
            // Logged before it is counted: whoever sees the count finds the line.
            tracing::error!(path = %path.display(), error = %e, "config reload refused; the running config stays");
            self.state
                .metrics
                .config_reloads
                .with_label_values(&["error"])
                .inc();
        }
        result
    }

    /// Shuts down in order: readiness goes false (the listener keeps accepting for
    /// `server.accept_grace_secs`, so load balancers stop sending first); queued requests are
    /// answered with a retryable error; the listener closes; in-flight requests and streams
    /// finish, until `server.drain_secs`, after which what is left is ended and settled;
    /// settlements still on their way to the ledger complete; capacity slices go back
    /// (`[ledger.local_leases]`); the telemetry outputs write what
    /// they hold; then the admin listener (which answered "not ready" throughout) and the
    /// in-process simulator stop.
    pub async fn shutdown(mut self) -> io::Result<ShutdownReport> {
        self.state.ready.store(false, Ordering::Release);
        self.refreshers.cancel();
        if !self.accept_grace.is_zero() {
            tracing::info!(
                accept_grace_secs = self.accept_grace.as_secs_f64(),
                "readiness is false; still accepting during the grace period"
            );
            tokio::time::sleep(self.accept_grace).await;
        }
        // Queued requests are answered at once with a retryable error; admitted ones drain.
        let admission = self.state.policy().admission.clone();
        admission.close_queues();
        let retired = std::mem::take(&mut *self.retired.lock().unwrap_or_else(|p| p.into_inner()));
        for old in retired.iter().filter_map(Weak::upgrade) {
            old.close_queues();
        }
        let result = self.proxy.stop().await;
        let settled_by = tokio::time::Instant::now() + SETTLEMENT_WAIT;
        while admission.ledger().stats().settlements_in_flight() > 0
            && tokio::time::Instant::now() < settled_by
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Capacity slices go back last, once nothing more can be admitted from them.
        admission.ledger().close().await;
        let report = ShutdownReport::of(&admission);
        // Every request is answered and settled: the outputs' last figures are complete.
        self.state.telemetry.shutdown().await;
        if let Some(admin) = self.admin.take() {
            admin.stop().await?;
        }
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
    pub pending_settlements: u64,
    /// Reservations the ledger issued that were dropped unsettled (a bug if non-zero).
    pub unsettled_drops: u64,
}

impl ShutdownReport {
    fn of(admission: &Admission) -> ShutdownReport {
        let pools = admission.pools();
        let sum = |f: fn(&crate::admission::Pool) -> u64| {
            pools
                .iter()
                .map(|p| i64::try_from(f(p)).unwrap_or(i64::MAX))
                .sum()
        };
        ShutdownReport {
            reserved_tokens: sum(|p| p.load.reserved_tokens()),
            in_flight: sum(|p| p.load.in_flight()),
            pending_settlements: admission.ledger().stats().settlements_in_flight(),
            unsettled_drops: admission.ledger().stats().unsettled_drops(),
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

/// What the proxy serves from, assembled from a config without binding a listener: the shared
/// state (policy, upstream client, metrics, ledger), the in-process simulator when the endpoint
/// is `"simulated"`, and the drain deadline responses in flight watch. Not ready until started.
#[derive(Debug)]
pub struct Assembled {
    pub state: Arc<AppState>,
    pub simulator: Option<SimulatorHandle>,
    pub deadline: CancellationToken,
}

/// Assembles everything but the listeners (see [`Assembled`]); tests drive its router directly.
pub async fn assemble(config: &Config, options: GatewayOptions) -> Result<Assembled, StartError> {
    let deadline = CancellationToken::new();
    let connected = connect_upstream(config, options.credentials).await?;
    let (upstream, simulator) = (connected.upstream, connected.simulator);
    let upstream = Arc::new(upstream.with_deadline(deadline.clone()));
    let up = &config.process.upstream;
    let sagemaker = Arc::new(SageMakerUpstreams::new(
        connected.credentials,
        connected.simulated,
        up.region.clone(),
        Timeouts {
            connect: up.connect_timeout,
            response: up.response_timeout,
            idle: up.idle_timeout,
        },
        deadline.clone(),
    ));
    endpoint_clients(config, &sagemaker)?;
    let registry = options.registry.unwrap_or_default();
    let metrics = Arc::new(Metrics::new(&registry)?);
    let clock = options.clock.unwrap_or_default();
    let telemetry = Telemetry::for_config(&config.process, clock.clone(), &metrics)
        .map_err(|e| StartError::Tracing(e.to_string()))?;
    let telemetry = Arc::new(telemetry);
    let ledger: Arc<dyn Ledger> = match &config.process.ledger {
        LedgerConfig::Memory => Arc::new(MemoryLedger::new(clock)),
        LedgerConfig::Redis(redis) => redis_ledger(redis, clock).await?,
    };
    let ledger = Arc::new(TimedLedger::new(ledger, metrics.ledger_seconds.clone()));
    let counter = Arc::new(UpstreamCounter(upstream.clone()));
    let policy = Policy::build(&config.policy, ledger, counter, &metrics, &telemetry);
    let server = &config.process.server;
    let body_budget = crate::body_budget::BodyBudget::new(server.max_buffered_body_bytes, &metrics);
    let state = Arc::new(AppState {
        policy: arc_swap::ArcSwap::from_pointee(policy),
        upstream,
        sagemaker,
        metrics,
        registry,
        telemetry,
        ledger_publications: Default::default(),
        max_body_bytes: server.max_body_bytes,
        body_budget,
        body_read_timeout: server.body_read_timeout,
        ready: Arc::new(AtomicBool::new(false)),
        rejections: Default::default(),
    });
    if let Some(emf) = &state.telemetry.emf {
        let state = Arc::downgrade(&state);
        emf.start(move || Some(state.upgrade()?.policy().admission.pools().to_vec()));
    }
    Ok(Assembled {
        state,
        simulator,
        deadline,
    })
}

/// How the proxy listener treats connections, from `[server]`.
fn serve_options(
    s: &crate::config::ServerConfig,
    deadline: CancellationToken,
    state: &AppState,
) -> server::ServeOptions {
    server::ServeOptions {
        header_read_timeout: s.header_read_timeout,
        idle_timeout: s.idle_timeout,
        max_connections: server::fd_limit::connection_cap(s.max_connections),
        h2_max_concurrent_streams: s.h2_max_concurrent_streams,
        h2_keep_alive_interval: s.h2_keep_alive_interval,
        h2_keep_alive_timeout: s.h2_keep_alive_timeout,
        drain: s.drain,
        deadline,
        metrics: Some(state.metrics.listener("proxy")),
    }
}

/// The bedrock-runtime client, what it signs with, and the simulator it may talk to.
struct Connected {
    upstream: Upstream,
    simulator: Option<SimulatorHandle>,
    credentials: SharedCredentialsProvider,
    /// The in-process simulator's base URL.
    simulated: Option<http::Uri>,
}

/// The upstream client of `config`, signing with `credentials` (else the AWS default chain), and
/// the in-process simulator when the endpoint is `"simulated"`.
async fn connect_upstream(
    config: &Config,
    credentials: Option<SharedCredentialsProvider>,
) -> Result<Connected, StartError> {
    let up = &config.process.upstream;
    let (base, simulator, default_credentials) = match &up.endpoint {
        Endpoint::Simulated => {
            let (base, handle, credentials) = start_simulator(config).await?;
            (base, Some(handle), Some(credentials))
        }
        Endpoint::Url(uri) => (uri.clone(), None, None),
        Endpoint::Aws => (
            Upstream::aws_endpoint(&up.region).map_err(|e| StartError::Upstream(e.to_string()))?,
            None,
            None,
        ),
    };
    let provider = match credentials.or(default_credentials) {
        Some(p) => p,
        None => default_chain(&up.region).await?,
    };
    let signer = Signer::new(provider.clone(), &up.region);
    if let Err(e) = signer.credentials().await {
        let e = format!(
            "{e}. tokengate signs upstream requests with its own AWS credentials from the default chain \
             (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, web identity, container or instance role)"
        );
        match &up.api_key {
            None if up.region_api_keys.is_empty() => return Err(StartError::Credentials(e)),
            // Only InvokeModelWithBidirectionalStream and endpoint pools need them then.
            Some(key) => tracing::warn!(
                error = %e,
                "no AWS credentials: every operation goes upstream with the API key of {} (or its \
                 Region's own) but InvokeModelWithBidirectionalStream (SigV4 only) and SageMaker \
                 endpoint calls, which will fail",
                key.env
            ),
            None => tracing::warn!(
                error = %e,
                "no AWS credentials: calls to {} go upstream with their Region's API key; calls to \
                 any other Region, InvokeModelWithBidirectionalStream (SigV4 only) and SageMaker \
                 endpoint calls will fail",
                up.region_api_keys.keys().cloned().collect::<Vec<_>>().join(", ")
            ),
        }
    }
    let simulated = simulator.as_ref().map(|_| base.clone());
    let mut upstream = Upstream::new(
        base,
        signer,
        up.connect_timeout,
        up.response_timeout,
        up.idle_timeout,
    )
    .and_then(|u| u.with_http(up.http, up.h2_streams_per_connection))
    .map_err(|e| StartError::Upstream(e.to_string()))?;
    if up.endpoint == Endpoint::Aws {
        // Each pool's Region has its own endpoint.
        upstream = upstream.with_aws_endpoints();
    }
    if let Some(key) = &up.api_key {
        upstream = upstream
            .with_api_key(&key.key.0)
            .map_err(|e| StartError::Upstream(e.to_string()))?;
    }
    for (region, key) in &up.region_api_keys {
        upstream = upstream
            .with_region_api_key(region, &key.key.0)
            .map_err(|e| StartError::Upstream(e.to_string()))?;
    }
    Ok(Connected {
        upstream,
        simulator,
        credentials: provider,
        simulated,
    })
}

/// Makes the sagemaker-runtime and control plane clients of every endpoint pool now, so that a
/// destination that cannot be reached (no simulator to be `"simulated"`) fails the start, or the
/// reload, rather than a request.
fn endpoint_clients(config: &Config, upstreams: &SageMakerUpstreams) -> Result<(), StartError> {
    for e in &config.policy.endpoints {
        for (service, endpoint) in [
            (Service::Runtime, &e.runtime),
            (Service::Control, &e.control),
        ] {
            upstreams
                .client(service, endpoint, &e.region)
                .map_err(|error| StartError::Endpoint {
                    pool: e.name.clone(),
                    error: error.to_string(),
                })?;
        }
    }
    Ok(())
}

/// The built-in simulator on loopback, its URL, and the credentials it expects.
async fn start_simulator(
    config: &Config,
) -> Result<(http::Uri, SimulatorHandle, SharedCredentialsProvider), StartError> {
    let mut sim_config = config.process.simulator.clone();
    sim_config.region = config.process.upstream.region.clone();
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
    Ok((base, handle, SharedCredentialsProvider::new(creds)))
}

/// Binds the admin listener (`server.admin_listen`).
async fn bind_admin(addr: SocketAddr) -> Result<(SocketAddr, TcpListener), StartError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::AdminListener { addr, source })?;
    Ok((listener.local_addr()?, listener))
}

/// The shared ledger, alone (fail-closed) or with a local share behind it.
async fn redis_ledger(
    config: &RedisLedgerConfig,
    clock: Clock,
) -> Result<Arc<dyn Ledger>, StartError> {
    let options = RedisOptions {
        url: config.url.clone(),
        timeout: config.timeout,
        lease: config.lease,
    };
    let shared = RedisLedger::connect(options)
        .await
        .map_err(|e| StartError::Ledger(e.message))?;
    if !shared.is_healthy() {
        tracing::warn!("redis ledger unreachable at start; retrying every second");
    }
    let leases = config.local_leases.map(|l| LeaseOptions {
        horizon: l.horizon,
        max_fraction: l.max_fraction,
        max_age: l.max_age,
    });
    Ok(match (config.on_error, leases) {
        (OnLedgerError::FailClosed, None) => Arc::new(shared),
        (OnLedgerError::FailClosed, Some(leases)) => Arc::new(LeasedLedger::new(shared, leases)),
        (OnLedgerError::Local { expected_replicas }, None) => {
            Arc::new(FallbackLedger::new(shared, clock, expected_replicas))
        }
        (OnLedgerError::Local { expected_replicas }, Some(leases)) => Arc::new(
            FallbackLedger::new(LeasedLedger::new(shared, leases), clock, expected_replicas),
        ),
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
