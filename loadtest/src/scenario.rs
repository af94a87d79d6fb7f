//! Scenario files (`loadtest/scenarios/<name>.toml`): the quota, the simulator's behaviour, the
//! proxy's pool, and the client groups that make the load. `--quick` shrinks a scenario to a
//! few seconds with a fast simulator, for CI.
//! (Over 500 lines: the file format, its checks and the proxy config it writes, beside their tests.)

use std::path::Path;

use anyhow::{Context, bail};
use serde::Deserialize;
use tokengate::simulator::SimulatorConfig;

/// One scenario, as written in its file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub name: String,
    pub description: String,
    #[serde(default)]
    pub seed: u64,
    pub model: String,
    /// Output burndown of `model` (5 for Claude 4): charged = input + output x burndown.
    pub burndown: u64,
    /// Tokens per minute, the same for the simulator's bucket and the proxy's pool.
    pub quota_tpm: u64,
    /// 1: the proxy's pool spills to a second pool of the same quota, the model's `global.`
    /// profile (the simulator gives every bucket `quota_tpm`); the callers still call `model`,
    /// so the direct side has one bucket. 0 (the default): one pool.
    #[serde(default)]
    pub spill_pools: u32,
    pub duration_secs: f64,
    /// Goodput counts completions after this point (the bucket starts full).
    #[serde(default)]
    pub warmup_secs: f64,
    /// After the last arrival, how long running calls may finish before they are cut off.
    #[serde(default = "default_drain")]
    pub drain_secs: f64,
    /// Extra `[simulator]` keys (latency, faults); quota and seed come from above.
    #[serde(default)]
    pub simulator: toml::Table,
    pub pool: PoolSettings,
    #[serde(default)]
    pub groups: Vec<Group>,
    /// The proxy's `[[routes]]`, one per team (`name` = a group's `team`): passed into the
    /// proxy's config as written, with a key pair added to each, and the proxy run in
    /// `auth.mode = "sigv4"`; each team's SDK client signs with its route's keys. None: the
    /// proxy has its implicit route and every team is one route.
    #[serde(default)]
    pub routes: Vec<toml::Table>,
    /// Proxy replicas sharing the ledger (1: one proxy). Each group's callers are spread over
    /// them round robin (a caller, or an arrival, to replica `i mod replicas`).
    #[serde(default = "one_replica")]
    pub replicas: u32,
    /// The proxies' ledger: `memory` (each its own), `redis` (one `redis-server`) or
    /// `redis-cluster` (a three-master Redis Cluster), started by loadgen.
    #[serde(default)]
    pub ledger: LedgerKind,
    /// The proxy's `upstream.http` (`auto`, `http1`, `http2`: HTTP/2 by prior knowledge to the
    /// simulator). Absent: the proxy's default, `auto`, which speaks HTTP/1.1 to the plain-http
    /// simulator.
    pub upstream_http: Option<String>,
    /// Present only in the overhead scenario, which runs its own steps instead of `groups`.
    pub overhead: Option<Overhead>,
    /// Present only in a soak: the proxy side alone, faults injected, checked at the end.
    pub soak: Option<Soak>,
    #[serde(default)]
    pub quick: Quick,
}

fn default_drain() -> f64 {
    30.0
}

fn one_replica() -> u32 {
    1
}

/// `ledger`: what the proxies keep their reservations in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LedgerKind {
    #[default]
    Memory,
    Redis,
    RedisCluster,
}

/// The proxy's `[[pools]]` entry, apart from the quota.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSettings {
    pub max_concurrency: u32,
    pub default_max_tokens: u64,
    #[serde(default)]
    pub headroom: f64,
    /// The admission queue's wait (the proxy's default when absent; 0 turns queueing off).
    #[serde(default)]
    pub max_wait_ms: Option<u64>,
    /// What a call that names no maxTokens reserves (`reserve_model_max`, `inject`, `reject`;
    /// the proxy's default when absent).
    #[serde(default)]
    pub when_max_tokens_missing: Option<String>,
}

/// A client group: one application (one SDK client) with its own arrivals and request shapes.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Group {
    pub team: String,
    pub arrival: Arrival,
    /// The SDK's standard-mode attempts (3 is the SDK default).
    #[serde(default = "default_attempts")]
    pub max_attempts: u32,
    /// Closed loop: how long a caller waits after a call failed (the SDK gave up) before its
    /// next call, as application code does. Without it a caller whose SDK retry quota is spent
    /// fails instantly and spins.
    #[serde(default = "default_pause")]
    pub pause_after_failure_ms: u64,
    pub mix: OpMix,
    pub shapes: Vec<Shape>,
    /// Client faults: the fraction of streams the caller drops after their first content event.
    #[serde(default)]
    pub hang_up_rate: f64,
}

fn default_attempts() -> u32 {
    3
}

fn default_pause() -> u64 {
    1000
}

/// How calls arrive.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Arrival {
    /// Open loop: Poisson arrivals whose rate moves linearly from `start_per_min` to
    /// `end_per_min` over `ramp_secs` (default: the whole run), then stays.
    Poisson {
        start_per_min: f64,
        end_per_min: f64,
        ramp_secs: Option<f64>,
    },
    /// Closed loop: `clients` callers, each starting its next call when the last one ends.
    Closed { clients: u32 },
}

/// Weights of the operations.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpMix {
    #[serde(default)]
    pub converse: f64,
    #[serde(default)]
    pub converse_stream: f64,
    #[serde(default)]
    pub invoke: f64,
}

/// A request class: prompt and output length ranges (uniform, inclusive) and `maxTokens`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Shape {
    pub weight: f64,
    pub prompt_words: [u32; 2],
    pub output_tokens: [u32; 2],
    /// Absent: the request sends no `maxTokens` (Bedrock reserves the model's maximum).
    pub max_tokens: Option<u32>,
}

/// The overhead scenario's steps.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Overhead {
    /// Fixed Converse rates, requests per second.
    pub rates: Vec<f64>,
    pub step_secs: f64,
    /// ConverseStream rate for the time-to-first-token comparison.
    pub stream_rate: f64,
    /// Closed-loop callers for the max-throughput step.
    pub max_clients: u32,
    /// Concurrent open streams for the memory measurement (each stalls for the simulator's
    /// `stall_ms`, so it stays open).
    pub open_streams: u32,
}

/// A soak: the proxy side only, for minutes, with faults injected (the `[simulator]` rates and
/// the groups' `hang_up_rate`); at the end the ledger must be at zero, every call answered, the
/// proxy's memory flat, and its shutdown clean.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Soak {
    /// The proxy's `upstream.idle_timeout_secs`: stalls longer than it end in exception frames.
    pub idle_timeout_secs: Option<u64>,
    /// How often the proxy's RSS is sampled.
    #[serde(default = "default_sample_secs")]
    pub sample_secs: f64,
    /// The most RSS may grow from the first sample after warm-up to the last under load, as a
    /// fraction (plus 4 MiB for allocator noise).
    #[serde(default = "default_rss_growth")]
    pub max_rss_growth: f64,
}

fn default_sample_secs() -> f64 {
    5.0
}

fn default_rss_growth() -> f64 {
    0.10
}

/// What `--quick` changes.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Quick {
    pub duration_secs: f64,
    pub drain_secs: f64,
    /// Multiplies arrival rates and client counts.
    pub load_scale: f64,
    /// `[simulator]` keys replaced in quick runs (e.g. higher fault rates, so that a few seconds
    /// of load still draw each fault).
    pub simulator: toml::Table,
}

impl Default for Quick {
    fn default() -> Self {
        Quick {
            duration_secs: 3.0,
            drain_secs: 5.0,
            load_scale: 1.0,
            simulator: toml::Table::new(),
        }
    }
}

impl Scenario {
    /// Reads and checks a scenario file; with `quick`, shrinks it.
    pub fn load(path: &Path, quick: bool) -> anyhow::Result<Scenario> {
        let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
        let mut s: Scenario =
            toml::from_str(&text).with_context(|| format!("{}", path.display()))?;
        s.check()?;
        if quick {
            s.shrink();
        }
        s.simulator_config()?;
        Ok(s)
    }

    fn check(&self) -> anyhow::Result<()> {
        if self.groups.is_empty() == self.overhead.is_none() {
            bail!("{}: give either [[groups]] or [overhead]", self.name);
        }
        if self.soak.is_some() && self.overhead.is_some() {
            bail!("{}: a soak runs [[groups]], not [overhead]", self.name);
        }
        self.check_routes()?;
        self.check_replicas()?;
        for g in &self.groups {
            if g.shapes.is_empty() || g.shapes.iter().all(|s| s.weight <= 0.0) {
                bail!(
                    "{}: group {} needs a shape with weight > 0",
                    self.name,
                    g.team
                );
            }
            let m = g.mix;
            if m.converse + m.converse_stream + m.invoke <= 0.0 {
                bail!("{}: group {} needs a mix weight > 0", self.name, g.team);
            }
            if !(0.0..=1.0).contains(&g.hang_up_rate) {
                bail!(
                    "{}: group {} hang_up_rate must be in [0, 1]",
                    self.name,
                    g.team
                );
            }
        }
        Ok(())
    }

    /// Several replicas need a shared ledger (with their own memory ledgers each would admit
    /// the whole quota); the overhead scenario and the soak measure one proxy.
    fn check_replicas(&self) -> anyhow::Result<()> {
        if self.replicas == 0 {
            bail!("{}: replicas must be at least 1", self.name);
        }
        if self.replicas > 1 && self.ledger == LedgerKind::Memory {
            bail!(
                "{}: replicas = {} need a shared ledger: set ledger = \"redis\" or \"redis-cluster\"",
                self.name,
                self.replicas
            );
        }
        if (self.replicas > 1 || self.ledger != LedgerKind::Memory)
            && (self.overhead.is_some() || self.soak.is_some())
        {
            bail!(
                "{}: the overhead scenario and the soak run one proxy on the memory ledger",
                self.name
            );
        }
        Ok(())
    }

    /// `--quick`: a few seconds, a fast simulator, scaled load.
    fn shrink(&mut self) {
        let q = self.quick.clone();
        self.duration_secs = q.duration_secs;
        self.warmup_secs = 0.0;
        self.drain_secs = q.drain_secs;
        let ttft = self.sim_u64("time_to_first_token_ms", 200).min(20);
        self.simulator
            .insert("time_to_first_token_ms".into(), (ttft as i64).into());
        let tps = self.sim_f64("tokens_per_second", 150.0);
        if tps != 0.0 {
            self.simulator
                .insert("tokens_per_second".into(), tps.max(5000.0).into());
        }
        // A soak's stalls outlast the proxy's idle timeout in quick runs too, so that CI runs the
        // idle-timeout path; elsewhere (the overhead scenario's open streams) a short stall keeps
        // a quick run quick.
        let stall_ms = match self.soak.as_ref().and_then(|s| s.idle_timeout_secs) {
            Some(idle) => idle * 1000 + 500,
            None => 1000,
        };
        self.simulator
            .insert("stall_ms".into(), (stall_ms as i64).into());
        for (key, value) in &q.simulator {
            self.simulator.insert(key.clone(), value.clone());
        }
        for g in &mut self.groups {
            g.arrival = match g.arrival.clone() {
                Arrival::Poisson {
                    start_per_min,
                    end_per_min,
                    ..
                } => Arrival::Poisson {
                    start_per_min: start_per_min * q.load_scale,
                    end_per_min: end_per_min * q.load_scale,
                    ramp_secs: None,
                },
                Arrival::Closed { clients } => Arrival::Closed {
                    clients: ((clients as f64 * q.load_scale).ceil() as u32).max(1),
                },
            };
        }
        if let Some(o) = &mut self.overhead {
            o.rates = vec![50.0];
            o.step_secs = 1.0;
            o.stream_rate = 50.0;
            o.max_clients = 8;
            o.open_streams = 50;
        }
    }

    fn sim_u64(&self, key: &str, default: u64) -> u64 {
        self.simulator
            .get(key)
            .and_then(|v| v.as_integer())
            .map_or(default, |v| v.max(0) as u64)
    }

    fn sim_f64(&self, key: &str, default: f64) -> f64 {
        let v = self.simulator.get(key);
        v.and_then(|v| v.as_float().or(v.as_integer().map(|i| i as f64)))
            .unwrap_or(default)
    }

    /// The simulator's settings: the `[simulator]` table plus the quota and seed.
    pub fn simulator_config(&self) -> anyhow::Result<SimulatorConfig> {
        let mut t = self.simulator.clone();
        t.insert(
            "default_tokens_per_minute".into(),
            (self.quota_tpm as i64).into(),
        );
        t.insert("seed".into(), (self.seed as i64).into());
        let c: SimulatorConfig = toml::Value::Table(t)
            .try_into()
            .with_context(|| format!("{}: [simulator]", self.name))?;
        c.validate()
            .map_err(|e| anyhow::anyhow!("{}: {e}", self.name))?;
        Ok(c)
    }

    /// The quota the proxy side may use: its pool's, plus the pools of its spill chain.
    pub fn proxy_quota_tpm(&self) -> u64 {
        self.quota_tpm * (1 + u64::from(self.spill_pools.min(1)))
    }

    /// A `[[pools]]` entry of the scenario's quota and `[pool]` settings, for `model`.
    fn pool_entry(&self, name: &str, model: &str, extra: &str) -> String {
        let p = &self.pool;
        format!(
            "\n[[pools]]\nname = \"{name}\"\nmodels = [\"{model}\"]\ntokens_per_minute = {}\n\
             max_concurrency = {}\noutput_burndown = {}\ndefault_max_tokens = {}\nheadroom = {}\n{}{}{extra}",
            self.quota_tpm,
            p.max_concurrency,
            self.burndown,
            p.default_max_tokens,
            p.headroom,
            p.max_wait_ms
                .map_or(String::new(), |ms| format!("max_wait_ms = {ms}\n")),
            p.when_max_tokens_missing
                .as_ref()
                .map_or(String::new(), |w| format!(
                    "when_max_tokens_missing = {w:?}\n"
                )),
        )
    }

    /// The proxy's pools: `pool` for `model` and, with `spill_pools = 1`, `spill` for the
    /// `global.` profile of `model`'s base model, in `pool`'s chain.
    fn pools(&self) -> String {
        if self.spill_pools == 0 {
            return self.pool_entry("pool", &self.model, "");
        }
        let base = self
            .model
            .split_once('.')
            .filter(|(prefix, rest)| prefix.len() <= 6 && rest.contains('.'))
            .map_or(self.model.as_str(), |(_, base)| base);
        let home = self.pool_entry("pool", &self.model, "spill_to = [\"spill\"]\n");
        home + &self.pool_entry("spill", &format!("global.{base}"), "")
    }

    /// The proxy's configuration file, in front of `upstream` (over `upstream_http` if set). A
    /// soak sets the idle timeout and
    /// logs tokengate's own info lines (the last one reports the ledger at shutdown), not the
    /// access log.
    /// With `redis_url`, the ledger is that Redis (or Redis Cluster), shared by the replicas.
    pub fn proxy_config(&self, upstream: std::net::SocketAddr, redis_url: Option<&str>) -> String {
        let (mut upstream_keys, level) = match &self.soak {
            Some(soak) => (
                soak.idle_timeout_secs
                    .map_or(String::new(), |s| format!("idle_timeout_secs = {s}\n")),
                "warn,tokengate=info,tokengate::access=off",
            ),
            None => (String::new(), "warn"),
        };
        if let Some(http) = &self.upstream_http {
            upstream_keys.push_str(&format!("http = \"{http}\"\n"));
        }
        let ledger = redis_url.map_or("backend = \"memory\"".to_string(), |url| {
            format!("backend = \"redis\"\nurl = \"{url}\"")
        });
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n\n[upstream]\nregion = \"us-east-1\"\n\
             endpoint = \"http://{upstream}\"\n{upstream_keys}\n[ledger]\n{ledger}\n\n\
             [log]\nlevel = \"{level}\"\n{}{}",
            self.pools(),
            self.routes_config()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shipped scenario's proxy config (and its variants', `variants/`) is one tokengate
    /// accepts; with `spill_pools = 1`, its pool spills to the `global.` profile of the same
    /// model, of the same quota.
    #[test]
    fn every_scenario_s_proxy_config_parses() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let (mut spilling, mut with_routes) = (0, 0);
        let mut shared = Vec::new();
        let entries = ["scenarios", "variants"]
            .into_iter()
            .flat_map(|dir| std::fs::read_dir(root.join(dir)).unwrap());
        for entry in entries {
            let path = entry.unwrap().path();
            if crate::endpoint::scenario::EndpointScenario::is_one(&path) {
                continue;
            }
            let s = Scenario::load(&path, false).unwrap();
            let redis = (s.ledger != LedgerKind::Memory).then_some("redis+cluster://127.0.0.1:9");
            let text = s.proxy_config("127.0.0.1:9".parse().unwrap(), redis);
            let config = tokengate::config::Config::parse(&text)
                .unwrap_or_else(|e| panic!("{}: {e}\n{text}", path.display()));
            if s.ledger != LedgerKind::Memory {
                shared.push(s.ledger);
                assert!(s.replicas > 1, "{}", path.display());
                assert!(matches!(
                    config.process.ledger,
                    tokengate::config::LedgerConfig::Redis(_)
                ));
            }
            let pools = &config.policy.pools;
            if s.spill_pools == 1 {
                spilling += 1;
                assert_eq!(pools[0].spill_to, ["spill"]);
                assert_eq!(
                    pools[1].models,
                    ["global.anthropic.claude-sonnet-4-20250514-v1:0"]
                );
                assert_eq!(pools[1].tokens_per_minute, s.quota_tpm);
                assert_eq!(s.proxy_quota_tpm(), 2 * s.quota_tpm);
            } else {
                assert_eq!(pools.len(), 1, "{}", path.display());
            }
            if !s.routes.is_empty() {
                with_routes += 1;
                check_routes(&s, &config);
            }
            // An adaptive pair differs in the route's adaptive_max_tokens alone.
            let learns = config
                .policy
                .routes
                .iter()
                .any(|r| r.adaptive_max_tokens.is_some());
            assert_eq!(learns, s.name.ends_with("-adaptive"), "{}", path.display());
        }
        assert_eq!(spilling, 2);
        // 14 and 15: three replicas on Redis, and on a Redis Cluster.
        assert_eq!(shared.len(), 2, "{shared:?}");
        assert!(shared.contains(&LedgerKind::Redis) && shared.contains(&LedgerKind::RedisCluster));
        // 10-two-teams-routes, the adaptive maxTokens scenarios 11, 13, 17 and 19, and their
        // counterparts 12, 16 and 18 on the same route.
        assert_eq!(with_routes, 8);
    }

    /// Several replicas each on its own memory ledger would each admit the whole quota: refused,
    /// naming the fix.
    #[test]
    fn replicas_need_a_shared_ledger() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/14-three-replicas-redis.toml");
        let text = std::fs::read_to_string(path).unwrap();
        let mut s: Scenario = toml::from_str(&text).unwrap();
        s.ledger = LedgerKind::Memory;
        let e = s.check().unwrap_err().to_string();
        assert!(e.contains("replicas = 3 need a shared ledger"), "{e}");
        s.replicas = 0;
        assert!(s.check().unwrap_err().to_string().contains("at least 1"));
    }

    /// A scenario with `[[routes]]`: the proxy checks SigV4, every team is a route of its own
    /// with the scenario's settings, and the key pair its client signs with.
    fn check_routes(s: &Scenario, config: &tokengate::config::Config) {
        assert_eq!(config.policy.auth.mode, tokengate::config::AuthMode::SigV4);
        assert_eq!(config.policy.routes.len(), s.routes.len());
        for group in &s.groups {
            let route = config
                .policy
                .routes
                .iter()
                .find(|r| r.name == group.team)
                .unwrap();
            let key = s.route_key(&group.team).unwrap();
            assert_eq!(
                route.access_key_id.as_deref(),
                Some(key.access_key_id.as_str())
            );
            let written = s
                .routes
                .iter()
                .find(|r| r["name"].as_str() == Some(&group.team));
            let written = written.unwrap();
            let priority = written.get("priority").and_then(|p| p.as_integer());
            assert_eq!(i64::from(route.priority), priority.unwrap_or(0));
            let cap = written.get("max_concurrency").and_then(|c| c.as_integer());
            assert_eq!(route.max_concurrency.map(i64::from), cap);
        }
        let keys: std::collections::BTreeSet<_> = config
            .policy
            .routes
            .iter()
            .map(|r| r.access_key_id.clone())
            .collect();
        assert_eq!(
            keys.len(),
            config.policy.routes.len(),
            "a key pair per route"
        );
    }
}
