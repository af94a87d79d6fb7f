//! Driving one side of a scenario: every client group against one address (the simulator or
//! the proxy), open or closed loop, until the run ends; then a bounded drain, after which calls
//! still running are cut off and recorded as `unfinished`.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aws_sdk_bedrockruntime::Client;
use tokio::task::JoinSet;

use crate::arrivals::{Call, CallSource, schedule};
use crate::client::{Record, execute, sdk_client};
use crate::scenario::{Arrival, Group, Scenario};

/// Where records go; shared by every call of a side.
#[derive(Debug, Clone, Default)]
pub struct Sink(Arc<Mutex<Vec<Record>>>);

impl Sink {
    fn push(&self, r: Record) {
        if let Ok(mut v) = self.0.lock() {
            v.push(r);
        }
    }

    pub fn take(&self) -> Vec<Record> {
        self.0
            .lock()
            .map(|mut v| std::mem::take(&mut *v))
            .unwrap_or_default()
    }
}

/// What every call of a side shares.
#[derive(Debug, Clone)]
pub struct Ctx {
    pub model: Arc<str>,
    pub burndown: u64,
    pub epoch: Instant,
    pub sink: Sink,
}

/// Records a call as `unfinished` if it is dropped (cut off at the end of the drain).
struct InFlight {
    sink: Sink,
    pending: Option<Record>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(r) = self.pending.take() {
            self.sink.push(r);
        }
    }
}

/// Sends one call and records it, or records it `unfinished` if cut off.
pub async fn run_call(ctx: &Ctx, client: &Client, call: &Call, team: &str) -> Record {
    let sent = execute(client, &ctx.model, call, team, ctx.burndown, ctx.epoch);
    record_call(ctx, call, team, sent).await
}

/// Records what `sent` (one call's execution) returns, or the call as `unfinished` if it is
/// cut off before it returns.
pub async fn record_call(
    ctx: &Ctx,
    call: &Call,
    team: &str,
    sent: impl std::future::Future<Output = Record>,
) -> Record {
    let start_ms = ctx.epoch.elapsed().as_secs_f64() * 1000.0;
    let mut guard = InFlight {
        sink: ctx.sink.clone(),
        pending: Some(Record {
            team: team.to_string(),
            op: call.op,
            start_ms,
            end_ms: f64::NAN,
            ttft_ms: None,
            outcome: "unfinished".into(),
            attempts: 0,
            max_tokens: call.max_tokens,
            input_tokens: 0,
            output_tokens: 0,
            charged: 0,
            cut_short: false,
        }),
    };
    let record = sent.await;
    guard.pending = None;
    ctx.sink.push(record.clone());
    record
}

/// Runs every group of `scenario` against `addrs` (the simulator, or the proxy's replicas: each
/// group's callers spread over them round robin); `side` names the SDK retry partitions.
pub async fn drive(scenario: &Scenario, addrs: &[SocketAddr], side: &str) -> Vec<Record> {
    let ctx = Ctx {
        model: scenario.model.as_str().into(),
        burndown: scenario.burndown,
        epoch: Instant::now(),
        sink: Sink::default(),
    };
    let end = ctx.epoch + Duration::from_secs_f64(scenario.duration_secs);
    let mut set = JoinSet::new();
    for (i, group) in scenario.groups.iter().enumerate() {
        // One retry partition per team, whichever replica its callers reach.
        let partition = format!("{side}-{}", group.team);
        let key = scenario.route_key(&group.team);
        let clients = addrs
            .iter()
            .map(|addr| sdk_client(*addr, group.max_attempts, &partition, key.as_ref()))
            .collect();
        let seed = scenario.seed.wrapping_mul(1_000_003).wrapping_add(i as u64);
        start_group(
            &mut set,
            &ctx,
            clients,
            group,
            seed,
            scenario.duration_secs,
            end,
        );
    }
    let drain_end = end + Duration::from_secs_f64(scenario.drain_secs);
    finish(set, drain_end).await;
    ctx.sink.take()
}

/// Spawns a group's callers into `set`: one task per arrival (open loop) or per caller, the
/// `i`-th on `clients[i mod clients.len()]`.
fn start_group(
    set: &mut JoinSet<()>,
    ctx: &Ctx,
    clients: Vec<Client>,
    group: &Group,
    seed: u64,
    duration: f64,
    end: Instant,
) {
    let team: Arc<str> = group.team.as_str().into();
    let pause = Duration::from_millis(group.pause_after_failure_ms);
    match group.arrival {
        Arrival::Poisson { .. } => {
            for (i, call) in schedule(group, seed, duration).into_iter().enumerate() {
                let client = clients[i % clients.len()].clone();
                let (ctx, team) = (ctx.clone(), team.clone());
                let at = ctx.epoch + Duration::from_secs_f64(call.at);
                set.spawn(async move {
                    tokio::time::sleep_until(at.into()).await;
                    run_call(&ctx, &client, &call, &team).await;
                });
            }
        }
        Arrival::Closed { clients: callers } => {
            for c in 0..callers {
                let client = clients[c as usize % clients.len()].clone();
                let (ctx, team) = (ctx.clone(), team.clone());
                let mut source =
                    CallSource::new(group, seed.wrapping_mul(31).wrapping_add(c as u64));
                set.spawn(async move {
                    while Instant::now() < end {
                        let record = run_call(&ctx, &client, &source.next_call(), &team).await;
                        if record.outcome != "ok" {
                            tokio::time::sleep(pause).await;
                        }
                    }
                });
            }
        }
    }
}

/// Waits for every task until `deadline`, then cuts off the rest.
pub async fn finish(mut set: JoinSet<()>, deadline: Instant) {
    let _ = tokio::time::timeout_at(deadline.into(), async {
        while set.join_next().await.is_some() {}
    })
    .await;
    set.abort_all();
    while set.join_next().await.is_some() {}
}
