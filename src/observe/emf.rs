//! CloudWatch Embedded Metric Format output (`[metrics] cloudwatch_emf`): every interval, one
//! JSON line per pool and one per route of each pool, which the CloudWatch agent, or the Lambda
//! and ECS (`awslogs`) log drivers, turn into CloudWatch metrics, without any AWS call from the
//! proxy.
//!
//! Each line follows the EMF specification: an `_aws` member with `Timestamp` (milliseconds since
//! the Unix epoch) and one `CloudWatchMetrics` directive (`Namespace`, `Dimensions`: `[["Pool"]]`
//! or `[["Pool", "Route"]]`, `Metrics` with `Name` and `Unit`), and every dimension and metric as
//! a top-level member. Counts cover the interval since the previous line (the observer's
//! [`Event`]s, the same the quota report counts); `InFlight`, `QueueDepth`, `QueuedTokens` and
//! `ReservedInFlight` are read from live state when the line is written, as are an endpoint
//! pool's `Copies` and `DemandPerCopy`.
//!
//! Failure semantics: a line that cannot be written (a full disk, a closed stdout) is logged and
//! dropped, and its counts are lost; the proxy never waits on it beyond the write itself. At
//! shutdown the last, partial interval is written.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard},
    time::{SystemTime, UNIX_EPOCH},
};

use serde_json::{Map, Value, json};
use tokio::{io::AsyncWriteExt, task::JoinHandle};
use tokio_util::sync::CancellationToken;

use super::tally::{Event, Tally};
use crate::{
    admission::Pool,
    config::{EmfConfig, EmfTarget},
};

/// The interval's counts, name and unit, first in every line (pool and route).
const COUNTS: [(&str, &str); 8] = [
    ("Requests", "Count"),
    ("Admitted", "Count"),
    ("Throttles", "Count"),
    ("UpstreamThrottles", "Count"),
    ("TokensReserved", "Count"),
    ("TokensCharged", "Count"),
    ("TokensDemanded", "Count"),
    ("SpilledIn", "Count"),
];

/// The rest of a pool's line: the interval's peaks, then the gauges read from live state.
const POOL_GAUGES: [(&str, &str); 5] = [
    ("PeakInFlight", "Count"),
    ("QueueWaitMaxMs", "Milliseconds"),
    ("InFlight", "Count"),
    ("QueueDepth", "Count"),
    ("QueuedTokens", "Count"),
];

/// An endpoint pool's line ends with its copies serving and its scaling signal, demand per copy
/// ((in flight + queued) / copies: [`Pool::demand_per_copy`]), the metric to scale it on.
const ENDPOINT_GAUGES: [(&str, &str); 2] = [("Copies", "Count"), ("DemandPerCopy", "None")];

/// The rest of a route's line.
const ROUTE_GAUGES: [(&str, &str); 1] = [("ReservedInFlight", "Count")];

/// One pool's interval counts, and its routes' by name (both outlive reloads).
#[derive(Debug, Default)]
pub struct PoolTallies {
    pool: Mutex<Tally>,
    routes: Mutex<HashMap<String, Arc<Mutex<Tally>>>>,
}

impl PoolTallies {
    /// The tally of route `name`, created on first use.
    pub fn route(&self, name: &str) -> Arc<Mutex<Tally>> {
        lock(&self.routes)
            .entry(name.to_string())
            .or_default()
            .clone()
    }

    /// Counts `event` for the pool and, if known, the request's route.
    pub fn record(&self, route: Option<&Mutex<Tally>>, event: &Event) {
        lock(&self.pool).record(event);
        if let Some(route) = route {
            lock(route).record(event);
        }
    }
}

/// The EMF output: the interval counts of every pool, and the task that writes them.
#[derive(Debug)]
pub struct Emf {
    config: EmfConfig,
    pools: Mutex<HashMap<String, Arc<PoolTallies>>>,
    stop: CancellationToken,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl Emf {
    pub fn new(config: EmfConfig) -> Emf {
        Emf {
            config,
            pools: Mutex::new(HashMap::new()),
            stop: CancellationToken::new(),
            task: Mutex::new(None),
        }
    }

    /// Pool `name`'s tallies, created on first use.
    pub fn pool(&self, name: &str) -> Arc<PoolTallies> {
        lock(&self.pools)
            .entry(name.to_string())
            .or_default()
            .clone()
    }

    /// Starts writing a line per pool and route every interval, for the pools `pools` returns
    /// (those of the policy in force; `None` once the proxy is gone).
    pub fn start(
        self: &Arc<Self>,
        pools: impl Fn() -> Option<Vec<Arc<Pool>>> + Send + Sync + 'static,
    ) {
        let emf = self.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(emf.config.interval);
            tick.tick().await;
            loop {
                let last = tokio::select! {
                    _ = tick.tick() => false,
                    () = emf.stop.cancelled() => true,
                };
                if let Some(pools) = pools() {
                    let lines = emf.lines(&pools);
                    emf.write(&lines).await;
                }
                if last {
                    return;
                }
            }
        });
        *lock(&self.task) = Some(task);
    }

    /// Writes the last interval and stops.
    pub async fn shutdown(&self) {
        self.stop.cancel();
        let task = lock(&self.task).take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }

    /// The lines of the interval that ends now, its counts taken (and reset).
    pub fn lines(&self, pools: &[Arc<Pool>]) -> String {
        let timestamp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let mut out = String::new();
        for pool in pools {
            let tallies = self.pool(&pool.name);
            let t = std::mem::take(&mut *lock(&tallies.pool));
            let gauges = [
                pool.load.in_flight(),
                pool.queue.depth() as u64,
                pool.queue.queued_tokens(),
            ];
            let endpoint = pool.copies().zip(pool.demand_per_copy());
            let values = counts(&t)
                .into_iter()
                .chain([t.peak_in_flight, t.queue_wait_max_ms])
                .chain(gauges)
                .map(Value::from)
                .chain(
                    endpoint
                        .into_iter()
                        .flat_map(|(copies, demand)| [Value::from(copies), Value::from(demand)]),
                );
            let metrics: &[&[(&str, &str)]] = match endpoint {
                Some(_) => &[&COUNTS, &POOL_GAUGES, &ENDPOINT_GAUGES],
                None => &[&COUNTS, &POOL_GAUGES],
            };
            let line = self.line(timestamp, &[("Pool", &pool.name)], metrics, values);
            out.push_str(&line);
            for route in pool.shares.views() {
                let t = std::mem::take(&mut *lock(&tallies.route(&route.name)));
                let reserved = u64::try_from(route.reserved_tokens).unwrap_or(0);
                let values = counts(&t).into_iter().chain([reserved]).map(Value::from);
                let dims = [("Pool", &*pool.name), ("Route", route.name.as_str())];
                let metrics = [&COUNTS[..], &ROUTE_GAUGES];
                out.push_str(&self.line(timestamp, &dims, &metrics, values));
            }
        }
        out
    }

    /// One EMF line (with its newline).
    fn line(
        &self,
        timestamp: u64,
        dimensions: &[(&str, &str)],
        metrics: &[&[(&str, &str)]],
        values: impl Iterator<Item = Value>,
    ) -> String {
        let metrics = || metrics.iter().flat_map(|m| m.iter());
        let mut root = Map::new();
        root.insert(
            "_aws".into(),
            json!({
                "Timestamp": timestamp,
                "CloudWatchMetrics": [{
                    "Namespace": self.config.namespace,
                    "Dimensions": [dimensions.iter().map(|(k, _)| *k).collect::<Vec<_>>()],
                    "Metrics": metrics().map(|(name, unit)| json!({"Name": name, "Unit": unit})).collect::<Vec<_>>(),
                }],
            }),
        );
        for (k, v) in dimensions {
            root.insert((*k).into(), Value::from(*v));
        }
        for ((name, _), value) in metrics().zip(values) {
            root.insert((*name).into(), value);
        }
        let mut line = Value::Object(root).to_string();
        line.push('\n');
        line
    }

    async fn write(&self, lines: &str) {
        if lines.is_empty() {
            return;
        }
        let written = match &self.config.target {
            EmfTarget::Stdout => {
                let mut out = tokio::io::stdout();
                match out.write_all(lines.as_bytes()).await {
                    Ok(()) => out.flush().await,
                    Err(e) => Err(e),
                }
            }
            EmfTarget::File(path) => append(path, lines).await,
        };
        if let Err(e) = written {
            tracing::warn!(error = %e, target = ?self.config.target, "cannot write CloudWatch EMF lines; this interval's are lost");
        }
    }
}

/// The interval counts common to pool and route lines, in the order of the metric tables.
fn counts(t: &Tally) -> [u64; 8] {
    [
        t.requests,
        t.admitted,
        t.throttled,
        t.upstream_throttles,
        t.reserved_tokens,
        t.charged_tokens,
        t.demand_tokens,
        t.spilled_in,
    ]
}

async fn append(path: &std::path::Path, lines: &str) -> std::io::Result<()> {
    let mut file = tokio::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .await?;
    file.write_all(lines.as_bytes()).await?;
    file.flush().await
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
