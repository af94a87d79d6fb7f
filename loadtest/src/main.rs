//! `loadgen`: runs tokengate's load scenarios twice, straight at the simulator and through the
//! proxy, with aws-sdk-bedrockruntime clients (aws-sdk-sagemakerruntime for the endpoint
//! scenario), and reports the difference.
//!
//! # Layout
//! [`scenario`] the scenario files · [`arrivals`] what is sent and when · [`client`] the SDK
//! caller and per-call records · [`drive`] one side's load · [`proxy`] tokengate as a child
//! process · [`redis`] the replicas' shared Redis or Redis Cluster · [`run`] both sides and the
//! outputs · [`overhead`] the overhead scenario ·
//! [`report`] the numbers · [`plot`] the PNGs · [`soak`] minutes of faults, checked at the end ·
//! [`endpoint`] a SageMaker endpoint scaled on a signal · [`pace`] one address at a fixed rate
//! (`loadgen pace`), for `nginx_compare.py --rate`.

mod arrivals;
mod client;
mod drive;
mod endpoint;
mod overhead;
mod pace;
mod plot;
mod proxy;
mod redis;
mod report;
mod routes;
mod run;
mod scenario;
mod soak;
mod stack;

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(name = "loadgen", about = "Direct vs through-tokengate load scenarios")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Run every scenario small (a few seconds each), for CI.
    #[arg(long, global = true)]
    quick: bool,
    /// Reports and per-call records.
    #[arg(long, global = true, default_value = "loadtest/out")]
    out: PathBuf,
    /// Where PNG plots go (default: the --out directory).
    #[arg(long, global = true)]
    plots: Option<PathBuf>,
    /// The tokengate binary (default: `tokengate` beside this binary).
    #[arg(long, global = true)]
    tokengate_bin: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Runs one scenario file.
    Run { scenario: PathBuf },
    /// Runs every `*.toml` in a directory, in name order.
    All {
        #[arg(default_value = "loadtest/scenarios")]
        dir: PathBuf,
    },
    /// Sends one request at a fixed rate to one address and prints its latencies as JSON.
    Pace(pace::PaceArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let options = stack::Options {
        quick: cli.quick,
        plots: cli.plots.unwrap_or_else(|| cli.out.clone()),
        out: cli.out,
        tokengate_bin: cli.tokengate_bin.unwrap_or_else(proxy::default_binary),
    };
    let files = match cli.command {
        Command::Run { scenario } => vec![scenario],
        Command::All { dir } => scenario_files(&dir)?,
        // On a thread and runtime of its own: nothing else runs meanwhile.
        Command::Pace(args) => return pace::run(args),
    };
    for file in files {
        if endpoint::scenario::EndpointScenario::is_one(&file) {
            endpoint::run(&file, &options)
                .await
                .with_context(|| format!("scenario {}", file.display()))?;
            continue;
        }
        let s = scenario::Scenario::load(&file, options.quick)?;
        run::run_scenario(&s, &options)
            .await
            .with_context(|| format!("scenario {}", s.name))?;
    }
    Ok(())
}

fn scenario_files(dir: &std::path::Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| dir.display().to_string())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    Ok(files)
}
