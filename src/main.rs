//! The `tokengate` command: `serve`, `simulate`, `check-config`, `healthcheck`, and the operator
//! tools `report` and `top`.

use std::{net::SocketAddr, num::NonZeroUsize, path::PathBuf, process::ExitCode, time::Duration};

use anyhow::Context;
use clap::{Parser, Subcommand};
use tokengate::{
    config::{Config, LogFormat},
    gateway::{Gateway, GatewayOptions},
    healthcheck,
    observe::{log_fields::TextFields, log_writer::LogWriter},
    simulator::{self, SimulatorConfig},
};

/// mimalloc rather than glibc malloc: measured against glibc and jemalloc in loadtest/RESULTS.md
/// (fewer instructions per proxied call, less memory per open stream).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "tokengate",
    version,
    about = "Admission-control proxy for Amazon Bedrock"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy.
    Serve {
        #[arg(long, short)]
        config: PathBuf,
        /// Threads that run requests; by default one per CPU this process may use. One suits a
        /// sidecar on a few cores shared with its application: fewer threads to wake and switch
        /// between (README, "Sizing").
        #[arg(long)]
        worker_threads: Option<NonZeroUsize>,
    },
    /// Run the simulated bedrock-runtime on its own.
    Simulate {
        #[arg(long, default_value = "127.0.0.1:9000")]
        listen: SocketAddr,
        /// A config file whose [simulator] table to use.
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// Validate a config file; exits non-zero with a message naming the key.
    CheckConfig { file: PathBuf },
    /// Probe a running proxy's readiness over plain HTTP: exit 0 on a 2xx answer, 1 otherwise
    /// (the container image's HEALTHCHECK; the image has no shell or curl).
    Healthcheck {
        #[arg(long, default_value = healthcheck::DEFAULT_URL)]
        url: String,
        #[arg(long, default_value_t = 2)]
        timeout_secs: u64,
    },
    /// Print a running proxy's quota report (GET /v1/quota-report): per pool, the steady and
    /// peak tokens per minute, peak concurrency, tokens per call, throttles, and what quota to
    /// request.
    Report {
        /// The proxy's admin address (its listener, or server.admin_listen), plain HTTP.
        #[arg(long, default_value = "http://127.0.0.1:8080")]
        url: String,
        #[arg(long, value_enum, default_value_t = ReportFormat::Markdown)]
        format: ReportFormat,
    },
    /// Watch a running proxy's pools in the terminal (q, Esc or Ctrl-C quits).
    Top {
        /// The proxy's admin address (its listener, or server.admin_listen), plain HTTP.
        #[arg(long, default_value = "http://127.0.0.1:8080")]
        url: String,
        /// How often to read /v1/pools, in milliseconds.
        #[arg(long, default_value_t = 1000)]
        interval_ms: u64,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ReportFormat {
    Markdown,
    Json,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::CheckConfig { file } = &cli.command {
        return match Config::load(file) {
            Ok(config) => {
                for note in config.notes() {
                    eprintln!("{}: note: {note}", file.display());
                }
                println!(
                    "{}: ok ({} pools, {} endpoints)",
                    file.display(),
                    config.policy.pools.len(),
                    config.policy.endpoints.len()
                );
                for pool in &config.policy.pools {
                    println!("  {}", pool.in_force());
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{}: {e}", file.display());
                ExitCode::from(2)
            }
        };
    }
    if let Command::Healthcheck { url, timeout_secs } = &cli.command {
        return match healthcheck::check(url, Duration::from_secs(*timeout_secs)) {
            Ok(status) => {
                println!("{url}: {status}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{url}: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if let Command::Report { url, format } = &cli.command {
        return report(url, *format);
    }
    if let Command::Top { url, interval_ms } = &cli.command {
        return match tokengate::top::run(url, Duration::from_millis((*interval_ms).max(100))) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("tokengate top: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let runtime = match runtime(&cli.command) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tokengate: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        LogWriter::flush_stderr();
        default_hook(info);
    }));
    let outcome = runtime.block_on(run(cli.command));
    drop(runtime);
    LogWriter::flush_stderr();
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tokengate: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The runtime `command` runs on: one request thread per CPU, or `serve --worker-threads`, or
/// tokio's own `TOKIO_WORKER_THREADS`.
fn runtime(command: &Command) -> std::io::Result<tokio::runtime::Runtime> {
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    let threads = match command {
        Command::Serve {
            worker_threads: Some(threads),
            ..
        } => Some(*threads),
        _ => tokio_worker_threads()?,
    };
    if let Some(threads) = threads {
        runtime.worker_threads(threads.get());
    }
    runtime.build()
}

/// `TOKIO_WORKER_THREADS`, if set, checked here: tokio would panic on a value that is not a
/// positive number.
fn tokio_worker_threads() -> std::io::Result<Option<NonZeroUsize>> {
    let Some(value) = std::env::var_os("TOKIO_WORKER_THREADS") else {
        return Ok(None);
    };
    match value.to_str().and_then(|v| v.parse().ok()) {
        Some(threads) => Ok(Some(threads)),
        None => Err(std::io::Error::other(format!(
            "TOKIO_WORKER_THREADS={}: not a positive number of threads \
             (unset it, or use serve --worker-threads)",
            value.to_string_lossy()
        ))),
    }
}

async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Serve { config, .. } => serve(config).await,
        Command::Simulate { listen, config } => simulate(listen, config).await,
        Command::CheckConfig { .. }
        | Command::Healthcheck { .. }
        | Command::Report { .. }
        | Command::Top { .. } => Ok(()),
    }
}

/// `tokengate report`: the quota report of the proxy at `url`, on stdout.
fn report(url: &str, format: ReportFormat) -> ExitCode {
    let format = match format {
        ReportFormat::Markdown => "markdown",
        ReportFormat::Json => "json",
    };
    let endpoint = format!(
        "{}/v1/quota-report?format={format}",
        url.trim_end_matches('/')
    );
    match healthcheck::get(&endpoint, Duration::from_secs(10)) {
        Ok(answer) if answer.status == 200 => {
            print!("{}", String::from_utf8_lossy(&answer.body));
            ExitCode::SUCCESS
        }
        Ok(answer) => {
            eprintln!(
                "{endpoint}: {} {}",
                answer.status,
                String::from_utf8_lossy(&answer.body).trim()
            );
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("{endpoint}: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(path: PathBuf) -> anyhow::Result<()> {
    let config = Config::load(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    init_logging(config.process.log.format, &config.process.log.level);
    let listener = tokio::net::TcpListener::bind(config.process.server.listen)
        .await
        .with_context(|| {
            format!(
                "cannot listen on {} (server.listen)",
                config.process.server.listen
            )
        })?;
    let scheme = if config.process.server.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let gateway = Gateway::start(config, listener, GatewayOptions::default()).await?;
    tokio::spawn(timer_heartbeat());
    // One machine-readable line on stdout, for scripts that start the proxy on port 0.
    println!("tokengate listening on {scheme}://{}", gateway.addr);
    if let Some(admin) = gateway.admin_addr {
        println!("admin listening on http://{admin}");
    }
    if let Some(sim) = &gateway.simulator {
        println!("simulator listening on http://{}", sim.addr);
    }
    tracing::info!(
        worker_threads = tokio::runtime::Handle::current().metrics().num_workers(),
        "serving"
    );
    reload_until_shutdown(&gateway, &path).await;
    tracing::info!("shutting down: draining in-flight requests");
    let report = gateway.shutdown().await?;
    if report.is_clean() {
        tracing::info!(
            reserved_tokens = report.reserved_tokens,
            in_flight = report.in_flight,
            "stopped: every reservation settled"
        );
    } else {
        tracing::error!(
            reserved_tokens = report.reserved_tokens,
            in_flight = report.in_flight,
            pending_settlements = report.pending_settlements,
            unsettled_drops = report.unsettled_drops,
            "stopped with reservations unsettled"
        );
    }
    Ok(())
}

async fn simulate(listen: SocketAddr, path: Option<PathBuf>) -> anyhow::Result<()> {
    let sim_config = match &path {
        Some(p) => {
            let config = Config::load(p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
            init_logging(config.process.log.format, &config.process.log.level);
            let mut sim = config.process.simulator;
            sim.region = config.process.upstream.region;
            sim
        }
        None => {
            init_logging(LogFormat::Text, "info");
            SimulatorConfig {
                region: "us-east-1".into(),
                ..SimulatorConfig::default()
            }
        }
    };
    let handle = simulator::spawn(sim_config, listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    println!("simulator listening on http://{}", handle.addr);
    shutdown_signal().await;
    handle.shutdown().await;
    Ok(())
}

fn init_logging(format: LogFormat, level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(LogWriter::stderr());
    let _ = match format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.fmt_fields(TextFields).try_init(),
    };
}

/// Keeps a timer due within [`HEARTBEAT`] at all times, so that the runtime's timer driver
/// always parks with a deadline that near. Without one, an idle proxy's driver parks with no
/// deadline, and every timer registered before it parks again (each request registers several:
/// its body read, response and idle timeouts) wakes it through its eventfd: a write and a
/// thread wake-up per timer (tokio's `reregister` unparks for a timer due before the driver's
/// next wake, or when it has none). Timers due later than the heartbeat register silently.
async fn timer_heartbeat() {
    let mut ticks = tokio::time::interval(HEARTBEAT);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
    }
}

/// See [`timer_heartbeat`].
const HEARTBEAT: Duration = Duration::from_millis(100);

/// Waits for SIGTERM or Ctrl-C; each SIGHUP meanwhile reloads the config file at `path`
/// (refused, logged and counted if invalid; the running config stays).
async fn reload_until_shutdown(gateway: &Gateway, path: &std::path::Path) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut hangup) = signal(SignalKind::hangup()) {
            let stop = shutdown_signal();
            tokio::pin!(stop);
            loop {
                tokio::select! {
                    () = &mut stop => return,
                    _ = hangup.recv() => {
                        tracing::info!(path = %path.display(), "SIGHUP: reloading the config");
                        let _ = gateway.reload_from(path);
                    }
                }
            }
        }
    }
    shutdown_signal().await;
}

/// SIGTERM (Kubernetes, Docker) or Ctrl-C.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
