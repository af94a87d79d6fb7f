//! Assembling a running proxy from a [`Config`]: the simulator (if asked for), credentials, the
//! ledger, metrics, admission, the upstream client and the listener.
//!
//! Tests and `main` share this: the caller owns the listener (bind `127.0.0.1:0` in tests) and
//! the shutdown. The admin listener (`server.admin_listen`), when configured, is bound here.

use std::{
    io,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use aws_credential_types::{Credentials, provider::SharedCredentialsProvider};
use prometheus::Registry;
use tokio::{net::TcpListener, sync::oneshot, task::JoinHandle};

use crate::{
    admission::Admission,
    app::{AppState, admin_router, router},
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
    #[error("cannot listen on {addr} (server.admin_listen): {source}")]
    AdminListener { addr: SocketAddr, source: io::Error },
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
        drain: std::time::Duration,
    ) -> Served {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(server::serve(
            listener,
            app,
            tls,
            async {
                let _ = stopped.await;
            },
            drain,
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
        let upstream = Upstream::new(
            base,
            signer,
            up.connect_timeout,
            up.response_timeout,
            up.idle_timeout,
        )
        .map_err(|e| StartError::Upstream(e.to_string()))?;

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
                &config.routes,
                config.admission.clone(),
                ledger,
                metrics.clone(),
            )
            .with_input_counter(upstream.clone()),
        );
        let auth = Arc::new(crate::auth::Authenticator::new(
            &config.auth,
            &config.routes,
            metrics.clone(),
        ));
        let ready = Arc::new(AtomicBool::new(false));
        let state = Arc::new(AppState {
            admission,
            auth,
            upstream,
            metrics,
            registry,
            max_body_bytes: config.server.max_body_bytes,
            ready: ready.clone(),
        });
        let addr = listener.local_addr()?;
        // Probes and scrapes over plain HTTP, whether or not the proxy listener has TLS.
        let admin = match config.server.admin_listen {
            Some(admin_addr) => {
                let admin_listener = TcpListener::bind(admin_addr).await.map_err(|source| {
                    StartError::AdminListener {
                        addr: admin_addr,
                        source,
                    }
                })?;
                Some((admin_listener.local_addr()?, admin_listener))
            }
            None => None,
        };
        let admin_addr = admin.as_ref().map(|(a, _)| *a);
        let admin = admin
            .map(|(_, l)| Served::spawn(l, admin_router(state.clone()), None, config.server.drain));
        let proxy = Served::spawn(listener, router(state.clone()), tls, config.server.drain);
        ready.store(true, Ordering::Release);
        tracing::info!(%addr, ?admin_addr, pools = config.pools.len(), "tokengate listening");
        Ok(Gateway {
            addr,
            admin_addr,
            state,
            simulator,
            proxy,
            admin,
        })
    }

    pub fn admission(&self) -> &Admission {
        &self.state.admission
    }

    /// Readiness goes false, the listener closes, in-flight requests finish (up to the drain
    /// deadline), then the admin listener (which answered "not ready" throughout the drain) and
    /// the in-process simulator stop.
    pub async fn shutdown(mut self) -> io::Result<()> {
        self.state.ready.store(false, Ordering::Release);
        // Queued requests are answered at once with a retryable error; admitted ones drain.
        self.state.admission.close_queues();
        let result = self.proxy.stop().await;
        if let Some(admin) = self.admin.take() {
            admin.stop().await?;
        }
        if let Some(sim) = self.simulator.take() {
            sim.shutdown().await;
        }
        result
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
