//! Application Auto Scaling, emulated and time compressed: target tracking on a per-copy signal
//! (the copies serving x the signal's average / the target; scale out as soon as that exceeds
//! what was asked, in only after a cooldown), scheduled floors, copies asked of the simulator
//! (which brings them `scale_delay_ms` later). The signal is read against the copies serving,
//! so copies asked for and not arrived yet are not counted twice. The signal is what each side can scale
//! on: straight at the endpoint, SageMaker's own concurrency per copy; through tokengate, its
//! demand per copy (in flight plus queued).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokengate::simulator::Simulator;

use super::scenario::{ENDPOINT, EndpointScenario, POOL};
use crate::stack::{http, http_get};

/// One reading.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Sample {
    /// Seconds from the start of the run.
    pub t: f64,
    /// The signal, per copy.
    pub signal: f64,
    /// Copies serving, and asked for.
    pub copies: u32,
    pub desired: u32,
    /// Calls on the copies.
    pub in_flight: u32,
}

/// What the scaler tracks.
#[derive(Debug, Clone, Copy)]
pub enum Signal {
    /// SageMaker's `ConcurrentRequestsPerCopy`: calls on the copies, per copy.
    Concurrency,
    /// tokengate's `demand_per_copy` at this proxy.
    Demand(SocketAddr),
}

impl Signal {
    async fn read(self, in_flight: u32, copies: u32) -> Option<f64> {
        match self {
            Signal::Concurrency => Some(f64::from(in_flight) / f64::from(copies.max(1))),
            Signal::Demand(proxy) => {
                let body = http_get(proxy, "/v1/pools").await.ok()?;
                let v: serde_json::Value = serde_json::from_str(&body).ok()?;
                v["pools"]
                    .as_array()?
                    .iter()
                    .find(|p| p["name"] == POOL)?["endpoint"]["demand_per_copy"]
                    .as_f64()
            }
        }
    }
}

/// Scales the simulator's endpoint on `signal` until `until`; returns the readings.
pub async fn run(
    s: &EndpointScenario,
    sim: &Simulator,
    sim_addr: SocketAddr,
    signal: Signal,
    epoch: Instant,
    until: Instant,
) -> Vec<Sample> {
    let sc = &s.scaling;
    let mut samples = Vec::new();
    let mut desired = s.endpoint.copies;
    let mut last_scaled = f64::NEG_INFINITY;
    let (mut sum, mut n) = (0.0, 0u32);
    let mut next_evaluation = sc.evaluate_secs;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(sc.sample_secs));
    while Instant::now() < until {
        tick.tick().await;
        let t = epoch.elapsed().as_secs_f64();
        let Some(fleet) = sim
            .endpoint_stats()
            .into_iter()
            .find(|f| f.endpoint == ENDPOINT)
        else {
            break;
        };
        let serving = fleet.copies;
        if let Some(value) = signal.read(fleet.in_flight, fleet.copies).await {
            sum += value;
            n += 1;
            samples.push(Sample {
                t,
                signal: value,
                copies: fleet.copies,
                desired: fleet.desired_copies,
                in_flight: fleet.in_flight,
            });
        }
        if t < next_evaluation || n == 0 {
            continue;
        }
        next_evaluation += sc.evaluate_secs;
        let average = sum / f64::from(n);
        (sum, n) = (0.0, 0);
        let floor = s.floor_at(t);
        let tracked = (f64::from(serving.max(1)) * average / sc.target).ceil() as u32;
        let wanted = tracked.clamp(floor, s.endpoint.max_copies.max(floor));
        let scale_in_allowed = t - last_scaled >= sc.scale_in_cooldown_secs;
        if wanted > desired || (wanted < desired && scale_in_allowed) {
            let body = serde_json::json!({"endpoint": ENDPOINT, "copies": wanted}).to_string();
            if http(sim_addr, "POST", "/_sim/sagemaker", &body)
                .await
                .is_ok()
            {
                desired = wanted;
                last_scaled = t;
            }
        }
    }
    samples
}
