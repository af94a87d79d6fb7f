//! An endpoint scenario file: the simulated SageMaker endpoint (copies, per-copy cap, speed, how
//! late new copies arrive), the scaling that follows a signal (target tracking and scheduled
//! floors, emulating Application Auto Scaling), and the client groups.

use std::path::Path;

use anyhow::{Context, bail};
use serde::Deserialize;
use tokengate::simulator::{SimulatorConfig, sagemaker::EndpointSimConfig};

use crate::scenario::{Arrival, Group, OpMix, Quick, Shape};

/// The endpoint's name in the simulator, and the proxy's pool for it.
pub const ENDPOINT: &str = "llm-prod";
pub const POOL: &str = "llm";

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointScenario {
    pub name: String,
    pub description: String,
    #[serde(default)]
    pub seed: u64,
    pub duration_secs: f64,
    /// After the last arrival, how long running calls may finish.
    pub drain_secs: f64,
    pub endpoint: EndpointSettings,
    pub scaling: Scaling,
    pub groups: Vec<EndpointGroup>,
    #[serde(default)]
    pub quick: Quick,
}

/// The simulated endpoint, and the proxy's view of it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointSettings {
    /// Copies at the start (and the scaling floor without a schedule).
    pub copies: u32,
    pub max_copies: u32,
    pub max_concurrency_per_copy: u32,
    pub time_to_first_token_ms: u64,
    /// Per request.
    pub tokens_per_second: f64,
    /// How long new copies take to arrive (and leaving ones to go).
    pub scale_delay_ms: u64,
    /// The proxy's admission queue.
    pub max_wait_ms: u64,
    /// How often the proxy reads the copies from the control plane.
    pub refresh_secs: u64,
}

/// Target tracking on a per-copy signal, with scheduled floors, as Application Auto Scaling
/// does it (time compressed).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scaling {
    /// How often the signal is read.
    pub sample_secs: f64,
    /// How often target tracking decides, on the signal's average since the last decision.
    pub evaluate_secs: f64,
    /// The signal per copy to hold.
    pub target: f64,
    /// No scale-in within this long of any scaling.
    pub scale_in_cooldown_secs: f64,
    #[serde(default)]
    pub scheduled: Vec<Scheduled>,
}

/// A scheduled action: from `at_secs` on, at least `min_copies`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scheduled {
    pub at_secs: f64,
    pub min_copies: u32,
}

/// One kind of call: its arrivals, its route's priority, its lengths.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointGroup {
    pub team: String,
    /// The route's priority in the proxy's queue.
    #[serde(default)]
    pub priority: i32,
    pub arrival: Arrival,
    #[serde(default = "three")]
    pub max_attempts: u32,
    /// Fraction of calls made with InvokeEndpointWithResponseStream.
    pub stream: f64,
    pub prompt_words: [u32; 2],
    pub output_tokens: [u32; 2],
    pub max_new_tokens: u32,
}

fn three() -> u32 {
    3
}

impl EndpointScenario {
    /// Whether the file at `path` is an endpoint scenario (it has an `[endpoint]` table).
    pub fn is_one(path: &Path) -> bool {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|t| toml::from_str::<toml::Table>(&t).ok())
            .is_some_and(|t| t.contains_key("endpoint"))
    }

    pub fn load(path: &Path, quick: bool) -> anyhow::Result<EndpointScenario> {
        let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
        let mut s: EndpointScenario =
            toml::from_str(&text).with_context(|| format!("{}", path.display()))?;
        if s.groups.is_empty() || s.scaling.target <= 0.0 || s.scaling.evaluate_secs <= 0.0 {
            bail!(
                "{}: needs [[groups]], and a positive scaling target and evaluate_secs",
                s.name
            );
        }
        if quick {
            s.shrink();
        }
        s.simulator_config()
            .validate()
            .map_err(|e| anyhow::anyhow!("{}: {e}", s.name))?;
        Ok(s)
    }

    /// `--quick`: a few seconds, fast generation, copies that arrive at once.
    fn shrink(&mut self) {
        let q = self.quick.clone();
        let scale = q.duration_secs / self.duration_secs;
        self.duration_secs = q.duration_secs;
        self.drain_secs = q.drain_secs;
        let e = &mut self.endpoint;
        e.tokens_per_second = e.tokens_per_second.max(5000.0);
        e.time_to_first_token_ms = e.time_to_first_token_ms.min(20);
        e.scale_delay_ms = (e.scale_delay_ms as f64 * scale) as u64;
        e.refresh_secs = 1;
        let s = &mut self.scaling;
        s.sample_secs = s.sample_secs.min(0.2);
        s.evaluate_secs = s.evaluate_secs.min(0.5);
        s.scale_in_cooldown_secs *= scale;
        for action in &mut s.scheduled {
            action.at_secs *= scale;
        }
        for g in &mut self.groups {
            if let Arrival::Poisson {
                start_per_min,
                end_per_min,
                ..
            } = g.arrival
            {
                g.arrival = Arrival::Poisson {
                    start_per_min: start_per_min * q.load_scale,
                    end_per_min: end_per_min * q.load_scale,
                    ramp_secs: None,
                };
            }
        }
    }

    /// The simulator: one endpoint of `copies`.
    pub fn simulator_config(&self) -> SimulatorConfig {
        let e = &self.endpoint;
        SimulatorConfig {
            seed: self.seed,
            endpoints: vec![EndpointSimConfig {
                name: ENDPOINT.into(),
                inference_component: None,
                copies: e.copies,
                max_concurrency_per_copy: e.max_concurrency_per_copy,
                time_to_first_token_ms: e.time_to_first_token_ms,
                tokens_per_second: e.tokens_per_second,
                scale_delay_ms: e.scale_delay_ms,
                default_max_new_tokens: 1024,
            }],
            ..SimulatorConfig::default()
        }
    }

    /// The proxy in front of the simulator at `sim`: the endpoint pool following the control
    /// plane, one route per group (SigV4 keys from [`EndpointScenario::key`]) with its priority.
    pub fn proxy_config(&self, sim: std::net::SocketAddr) -> String {
        let e = &self.endpoint;
        let mut out = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n\n[upstream]\nregion = \"us-east-1\"\nendpoint = \"http://{sim}\"\n\n\
             [log]\nlevel = \"warn\"\n\n[auth]\nmode = \"sigv4\"\n\n[[endpoints]]\nname = \"{POOL}\"\nendpoint = \"{ENDPOINT}\"\n\
             copies = {}\nmax_concurrency_per_copy = {}\nrefresh_secs = {}\nmax_wait_ms = {}\n\
             runtime_url = \"http://{sim}\"\ncontrol_url = \"http://{sim}\"\n",
            e.copies, e.max_concurrency_per_copy, e.refresh_secs, e.max_wait_ms,
        );
        for (i, g) in self.groups.iter().enumerate() {
            let (id, secret) = Self::key(i);
            out.push_str(&format!(
                "\n[[routes]]\nname = \"{}\"\npriority = {}\naccess_key_id = \"{id}\"\nsecret_access_key = \"{secret}\"\n",
                g.team, g.priority
            ));
        }
        out
    }

    /// The SigV4 key pair of group `i`'s route.
    pub fn key(i: usize) -> (String, String) {
        (
            format!("AKIALOADGENROUTE{i:04}"),
            format!("loadgen-route-{i}"),
        )
    }

    /// Group `i` in the shape the arrival schedule reads: InvokeEndpoint where a Bedrock
    /// group says Converse, the stream where it says ConverseStream.
    pub fn arrival_group(&self, i: usize) -> Group {
        let g = &self.groups[i];
        Group {
            team: g.team.clone(),
            arrival: g.arrival.clone(),
            max_attempts: g.max_attempts,
            pause_after_failure_ms: 1000,
            mix: OpMix {
                converse: 1.0 - g.stream,
                converse_stream: g.stream,
                invoke: 0.0,
            },
            shapes: vec![Shape {
                weight: 1.0,
                prompt_words: g.prompt_words,
                output_tokens: g.output_tokens,
                max_tokens: Some(g.max_new_tokens),
            }],
            hang_up_rate: 0.0,
        }
    }

    /// The scaling floor at `t` seconds: set by the last scheduled action due, else the start's
    /// copies.
    pub fn floor_at(&self, t: f64) -> u32 {
        self.scaling
            .scheduled
            .iter()
            .filter(|a| a.at_secs <= t)
            .max_by(|a, b| a.at_secs.total_cmp(&b.at_secs))
            .map_or(self.endpoint.copies, |a| a.min_copies)
    }
}
