//! Pools at run time: resolving a modelId to its pool, and each pool's live feedback state
//! (effective limit after upstream throttles, input-estimate calibration, typical duration).
//! (Over 500 lines: one pool type and one table for Bedrock and endpoint pools alike.)

use foldhash::{HashMap, HashMapExt as _};
use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use serde::Serialize;
use tokio::time::Instant;

use super::{
    advice::PoolAdvice,
    endpoint::{self, EndpointCopies, EndpointIndex},
    hint::PoolHistory,
    queue::AdmissionQueue,
    routes::PoolShares,
};
use crate::{
    bedrock::{Api, ModelRef, model_id::application_profile_id},
    config::{AdmissionConfig, PoolConfig, PoolTier, RouteConfig},
    ledger::{Limit, Limits},
};

/// Safety margin over the calibrated input estimate: Bedrock reserves the real input, so an
/// estimate below it admits what upstream would throttle.
const CALIBRATION_MARGIN: f64 = 1.1;
/// Bounds of the calibration multiplier. The floor is 1: calibration only ever raises the raw
/// estimate (which is conservative by construction), never lowers it, so the reservation errs
/// high. A raw estimate that runs 30% high costs some idle quota; one that runs low admits what
/// upstream throttles.
const RATIO_BOUNDS: (f64, f64) = (1.0, 4.0);
/// Weight of each new sample in the moving averages.
const EWMA_ALPHA: f64 = 0.1;
/// The quantile of actual/estimate ratios the input multiplier tracks, and the tracker's step.
const INPUT_QUANTILE: f64 = 0.99;
const QUANTILE_STEP: f64 = 0.05;
/// Multiplicative decrease on an upstream throttle, and the floor.
const AIMD_DECREASE: f64 = 0.8;
const AIMD_FLOOR: f64 = 0.3;
/// Additive regrowth: fraction of the usable limit regained per second without throttles.
const AIMD_REGROW_PER_SEC: f64 = 0.01;
/// Throttles closer together than this count as one congestion event.
const AIMD_HOLD: Duration = Duration::from_secs(2);

/// A configured pool and its live state.
#[derive(Debug)]
pub struct Pool {
    pub config: PoolConfig,
    pub name: Arc<str>,
    /// Its position in the policy's pool table (observers index their series by it).
    pub id: usize,
    /// What the pool carries now: reservations and requests in flight.
    pub load: PoolLoad,
    /// Where requests that do not fit wait (disabled when `max_wait` is zero).
    pub queue: Arc<AdmissionQueue>,
    /// Output lengths against maxTokens, per model ([`super::advice`]).
    pub advice: PoolAdvice,
    /// The routes' shares of this pool.
    pub shares: PoolShares,
    feedback: Mutex<Feedback>,
    learned: Mutex<Learned>,
    /// Counts since start (carried over by reloads), for `/v1/pools`.
    pub counts: PoolCounts,
    /// Burndown excess of streams in flight: what their output so far will cost beyond their
    /// reservations (see [`Pool::pending_excess`]).
    pending_excess: AtomicU64,
    /// An endpoint pool's copies serving now ([`super::endpoint`]); `None` for Bedrock pools.
    pub(super) copies: Option<EndpointCopies>,
}

#[derive(Debug)]
struct Feedback {
    /// Factor right after the last decrease, and when that was.
    factor: f64,
    since: Option<Instant>,
}

#[derive(Debug, Clone, Copy)]
struct Learned {
    /// The multiplier applied to raw input estimates: a high quantile of actual / raw, times the
    /// safety margin, never below 1 ([`RATIO_BOUNDS`]). Starts at 1 (the raw estimate is already
    /// conservative).
    input_multiplier: f64,
    /// Charged / reserved.
    charge_ratio: f64,
    /// Typical admission-to-settlement time.
    duration_secs: f64,
}

/// What a pool has admitted and turned away since start.
#[derive(Debug, Default)]
pub struct PoolCounts {
    pub admitted: AtomicU64,
    pub rejected_tokens: AtomicU64,
    pub rejected_requests: AtomicU64,
    pub rejected_concurrency: AtomicU64,
    pub rejected_share: AtomicU64,
    pub rejected_daily: AtomicU64,
    pub rejected_budget: AtomicU64,
    pub rejected_route_concurrency: AtomicU64,
    pub never_fits: AtomicU64,
    pub upstream_throttles: AtomicU64,
    /// Admitted and throttled requests by API family, in the order of [`Api::ALL`].
    pub apis: [ApiCounts; Api::ALL.len()],
}

/// One API family's requests in a pool.
#[derive(Debug, Default)]
pub struct ApiCounts {
    pub admitted: AtomicU64,
    pub rejected: AtomicU64,
}

impl PoolCounts {
    pub fn rejected(&self, limit: Limit) {
        let c = match limit {
            Limit::Tokens => &self.rejected_tokens,
            Limit::Requests => &self.rejected_requests,
            Limit::Concurrency => &self.rejected_concurrency,
            Limit::Share => &self.rejected_share,
            Limit::DailyQuota => &self.rejected_daily,
            Limit::Budget => &self.rejected_budget,
            Limit::RouteConcurrency => &self.rejected_route_concurrency,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts an admitted (or throttled) request of `api`.
    pub fn api_decided(&self, api: Api, admitted: bool) {
        let counts = &self.apis[api.index()];
        let c = if admitted {
            &counts.admitted
        } else {
            &counts.rejected
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    fn all(&self) -> Vec<&AtomicU64> {
        let mut all = vec![
            &self.admitted,
            &self.rejected_tokens,
            &self.rejected_requests,
            &self.rejected_concurrency,
            &self.rejected_share,
            &self.rejected_daily,
            &self.rejected_budget,
            &self.rejected_route_concurrency,
            &self.never_fits,
            &self.upstream_throttles,
        ];
        for api in &self.apis {
            all.extend([&api.admitted, &api.rejected]);
        }
        all
    }
}

/// What a pool carries now, from this replica: the requests it admitted and has not settled.
#[derive(Debug, Default)]
pub struct PoolLoad {
    reserved_tokens: AtomicU64,
    in_flight: AtomicU64,
}

impl PoolLoad {
    pub(crate) fn admitted(&self, tokens: u64) {
        self.reserved_tokens.fetch_add(tokens, Ordering::Relaxed);
        self.in_flight.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn settled(&self, tokens: u64) {
        self.reserved_tokens.fetch_sub(tokens, Ordering::Relaxed);
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }

    /// Tokens reserved by requests in flight.
    pub fn reserved_tokens(&self) -> u64 {
        self.reserved_tokens.load(Ordering::Relaxed)
    }

    /// Requests admitted and not settled.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }
}

/// What the pool has learned, for `/v1/pools`.
#[derive(Debug, Clone, Serialize)]
pub struct LearnedView {
    pub input_calibration_ratio: f64,
    pub charge_to_reservation_ratio: f64,
    pub typical_duration_secs: f64,
    pub effective_limit_factor: f64,
}

impl Pool {
    pub fn new(
        id: usize,
        config: PoolConfig,
        routes: &[RouteConfig],
        admission: &AdmissionConfig,
    ) -> Pool {
        let copies = config
            .endpoint
            .as_ref()
            .map(|e| EndpointCopies::new(e.copies));
        Pool {
            name: Arc::from(config.name.as_str()),
            id,
            load: PoolLoad::default(),
            queue: Arc::new(AdmissionQueue::new(config.max_wait, config.max_queue)),
            advice: PoolAdvice::new(&config.models),
            shares: PoolShares::new(&config, routes, admission),
            config,
            feedback: Mutex::new(Feedback {
                factor: 1.0,
                since: None,
            }),
            learned: Mutex::new(Learned {
                input_multiplier: 1.0,
                charge_ratio: 1.0,
                duration_secs: 1.0,
            }),
            counts: PoolCounts::default(),
            pending_excess: AtomicU64::new(0),
            copies,
        }
    }

    /// Tokens the pool's streams in flight will be charged beyond their reservations, from the
    /// output seen so far (`input + output x burndown` above `input + maxTokens`). Upstream
    /// deducts that excess when a stream ends, a moment before its usage reaches the proxy;
    /// admission keeps it in the bucket meanwhile, so that moment admits nothing upstream would
    /// throttle.
    pub fn pending_excess(&self) -> u64 {
        self.pending_excess.load(Ordering::Relaxed)
    }

    pub(crate) fn add_pending_excess(&self, tokens: u64) {
        self.pending_excess.fetch_add(tokens, Ordering::Relaxed);
    }

    pub(crate) fn release_pending_excess(&self, tokens: u64) {
        let _ = self
            .pending_excess
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_sub(tokens))
            });
    }

    /// Takes over what `previous` (this pool before a config reload) learned and counted.
    pub fn inherit(&self, previous: &Pool) {
        {
            let old = lock(&previous.feedback);
            let mut fb = lock(&self.feedback);
            fb.factor = old.factor;
            fb.since = old.since;
        }
        *lock(&self.learned) = *lock(&previous.learned);
        for (to, from) in self.counts.all().into_iter().zip(previous.counts.all()) {
            to.store(from.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        self.inherit_copies(previous);
    }

    /// The limit factor now: 1.0, or less while regrowing after upstream throttles.
    pub fn limit_factor(&self) -> f64 {
        let fb = lock(&self.feedback);
        match fb.since {
            None => fb.factor,
            Some(t) => (fb.factor + AIMD_REGROW_PER_SEC * t.elapsed().as_secs_f64()).min(1.0),
        }
    }

    /// The limits admission applies now. An endpoint pool's follow its copies; throttle
    /// feedback shrinks its concurrency as well as its tokens.
    pub fn limits(&self) -> Limits {
        let factor = self.limit_factor();
        let tokens = ((self.capacity() as f64) * factor).floor() as u64;
        Limits {
            tokens_per_minute: tokens.max(1),
            requests_per_minute: self.config.requests_per_minute,
            max_concurrency: self.concurrency(factor),
            tokens_per_day: self.config.tokens_per_day,
        }
    }

    /// Upstream throttled a request we admitted: other traffic shares the account quota, so
    /// shrink (at most once per [`AIMD_HOLD`]) and regrow gradually.
    pub fn upstream_throttled(&self) {
        self.counts
            .upstream_throttles
            .fetch_add(1, Ordering::Relaxed);
        let current = self.limit_factor();
        let mut fb = lock(&self.feedback);
        if fb.since.is_some_and(|t| t.elapsed() < AIMD_HOLD) {
            return;
        }
        fb.factor = (current * AIMD_DECREASE).max(AIMD_FLOOR);
        fb.since = Some(Instant::now());
    }

    /// The input estimate after calibration.
    pub fn calibrated_input(&self, raw_estimate: u64) -> u64 {
        let multiplier = lock(&self.learned).input_multiplier;
        ((raw_estimate as f64) * multiplier).ceil().max(1.0) as u64
    }

    /// Learns from a settled request whose usage upstream reported.
    pub fn learn(
        &self,
        raw_estimate: u64,
        actual_input: u64,
        reserved: u64,
        charged: u64,
        duration: Duration,
    ) {
        let mut l = lock(&self.learned);
        if raw_estimate > 0 && actual_input > 0 {
            let sample = (actual_input as f64 / raw_estimate as f64).clamp(0.1, 10.0);
            l.input_multiplier =
                track_quantile(l.input_multiplier, sample).clamp(RATIO_BOUNDS.0, RATIO_BOUNDS.1);
        }
        if reserved > 0 {
            l.charge_ratio = ewma(l.charge_ratio, (charged as f64 / reserved as f64).min(10.0));
        }
        l.duration_secs = ewma(l.duration_secs, duration.as_secs_f64());
    }

    /// Typical admission-to-settlement time, and the typical charged / reserved ratio.
    pub fn history(&self) -> PoolHistory {
        let l = *lock(&self.learned);
        PoolHistory {
            typical_duration: Duration::from_secs_f64(l.duration_secs.max(0.0)),
            charge_ratio: l.charge_ratio,
        }
    }

    /// Learns a typical duration from a request settled without usage: an endpoint's container
    /// may report none, and concurrency hints need the duration all the same.
    pub fn learn_duration(&self, duration: Duration) {
        if self.config.endpoint.is_some() {
            let mut l = lock(&self.learned);
            l.duration_secs = ewma(l.duration_secs, duration.as_secs_f64());
        }
    }

    pub fn calibration_ratio(&self) -> f64 {
        lock(&self.learned).input_multiplier
    }

    pub fn learned_view(&self) -> LearnedView {
        let l = *lock(&self.learned);
        LearnedView {
            input_calibration_ratio: l.input_multiplier,
            charge_to_reservation_ratio: l.charge_ratio,
            typical_duration_secs: l.duration_secs,
            effective_limit_factor: self.limit_factor(),
        }
    }
}

fn ewma(old: f64, sample: f64) -> f64 {
    old + EWMA_ALPHA * (sample - old)
}

/// One step of a streaming quantile tracker over the ratios `actual / raw estimate`, returning
/// the new multiplier (the tracked quantile times the margin).
///
/// The multiplier must cover the requests whose estimate errs lowest, not the average one: an
/// estimate below Bedrock's count admits what upstream would then throttle. The tracker moves up
/// by `step x q` when a sample lies above the quantile and down by `step x (1 - q)` otherwise, so
/// it settles where a fraction `q` of samples lie below it (Robbins-Monro). A sample above the
/// multiplier itself (a real under-estimate) lifts it at once.
fn track_quantile(multiplier: f64, sample: f64) -> f64 {
    let quantile = multiplier / CALIBRATION_MARGIN;
    if sample * CALIBRATION_MARGIN > multiplier * (1.0 + QUANTILE_STEP) {
        return sample * CALIBRATION_MARGIN;
    }
    let next = if sample > quantile {
        quantile * (1.0 + QUANTILE_STEP * INPUT_QUANTILE)
    } else {
        quantile * (1.0 - QUANTILE_STEP * (1.0 - INPUT_QUANTILE))
    };
    next * CALIBRATION_MARGIN
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Every pool, and the map from model ids to them.
#[derive(Debug)]
pub struct PoolTable {
    pub(super) pools: Vec<Arc<Pool>>,
    by_model: HashMap<String, usize>,
    /// Pools of reserved capacity (`tier = "reserved"`), by model.
    reserved_by_model: HashMap<String, usize>,
    /// Endpoint pools by endpoint and inference component ([`super::endpoint`]).
    pub(super) by_endpoint: EndpointIndex,
    /// Application inference profile (ARN or id) -> model id.
    profiles: HashMap<String, String>,
    /// Each pool's spill chain, as indexes into `pools` ([`crate::config::spill::chain`]).
    chains: Vec<Vec<usize>>,
}

impl PoolTable {
    pub fn new(
        configs: &[PoolConfig],
        routes: &[RouteConfig],
        admission: &AdmissionConfig,
    ) -> PoolTable {
        let mut by_model = HashMap::new();
        let mut reserved_by_model = HashMap::new();
        let mut by_endpoint = EndpointIndex::new();
        let pools: Vec<Arc<Pool>> = configs
            .iter()
            .enumerate()
            .map(|(i, p)| {
                match endpoint::index_key(p) {
                    Some(key) => {
                        by_endpoint.insert(key, i);
                    }
                    None => {
                        let table = match p.tier {
                            PoolTier::OnDemand => &mut by_model,
                            PoolTier::Reserved => &mut reserved_by_model,
                        };
                        for m in &p.models {
                            table.insert(m.clone(), i);
                        }
                    }
                }
                Arc::new(Pool::new(i, p.clone(), routes, admission))
            })
            .collect();
        let profiles = admission
            .application_profiles
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        PoolTable {
            chains: (0..configs.len())
                .map(|i| crate::config::spill::chain(configs, i))
                .collect(),
            pools,
            by_model,
            reserved_by_model,
            by_endpoint,
            profiles,
        }
    }

    pub fn pools(&self) -> &[Arc<Pool>] {
        &self.pools
    }

    /// Pool `id`'s spill chain, in order (empty for none).
    pub fn chain(&self, id: usize) -> &[usize] {
        self.chains.get(id).map_or(&[], Vec::as_slice)
    }

    /// The pool a modelId draws on, if any, with the model id from the pool's config it draws
    /// as (its resource id, or the model an application inference profile maps to): the key of
    /// route allow-lists and of the maxTokens-advice slot.
    /// The reserved-capacity pool of `configured_model` (as a pool lists it), if there is one.
    pub fn reserved_for(&self, configured_model: &str) -> Option<&Arc<Pool>> {
        let &index = self.reserved_by_model.get(configured_model)?;
        self.pools.get(index)
    }

    ///
    /// A pool that lists the id exactly as sent (an ARN, say) comes first. An ARN names its
    /// Region: it draws on the pool of its resource id only if that pool is in the same Region
    /// (Bedrock keeps each Region's buckets apart, and the call goes to the ARN's Region).
    pub fn resolve<'a>(&'a self, model: &ModelRef<'a>) -> Option<(&'a Arc<Pool>, &'a str)> {
        if model.raw != model.resource_id
            && let Some(&index) = self.by_model.get(model.raw)
        {
            return Some((self.pools.get(index)?, model.raw));
        }
        if let Some(&index) = self.by_model.get(model.resource_id) {
            let pool = self.pools.get(index)?;
            let elsewhere = model.arn_region.is_some_and(|r| r != pool.config.region);
            return (!elsewhere).then_some((pool, model.resource_id));
        }
        let mapped = self
            .profiles
            .get(model.raw)
            .or_else(|| application_profile_id(model.raw).and_then(|id| self.profiles.get(id)))?;
        let &index = self.by_model.get(mapped)?;
        Some((self.pools.get(index)?, mapped))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_input_multiplier_covers_the_lowest_estimates_not_the_average() {
        // Ratios spread evenly over [0.5, 0.7]: the multiplier settles near the 99th percentile
        // (0.698) times the margin, whatever the order of the samples.
        let mut m = 1.0;
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut uncovered = 0;
        for i in 0..20_000 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let sample = 0.5 + 0.2 * (rng % 10_000) as f64 / 10_000.0;
            if i > 2_000 && sample > m {
                uncovered += 1;
            }
            m = track_quantile(m, sample);
        }
        assert!(
            uncovered == 0,
            "{uncovered} estimates fell below the actual count"
        );
        assert!(
            (0.69 * CALIBRATION_MARGIN..=0.72 * CALIBRATION_MARGIN).contains(&m),
            "multiplier {m}"
        );
    }

    fn pool() -> Pool {
        let config = crate::config::Config::parse(
            "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nregion = \"us-east-1\"\nendpoint = \"simulated\"\n\
             [[pools]]\nname = \"p\"\nmodels = [\"m.x\"]\ntokens_per_minute = 1000\nmax_concurrency = 1\n\
             output_burndown = 1\nmax_output_tokens = 10\ndefault_max_tokens = 10\n",
        )
        .expect("config");
        Pool::new(
            0,
            config.policy.pools[0].clone(),
            &config.policy.routes,
            &config.policy.admission,
        )
    }

    #[test]
    fn calibration_never_lowers_the_raw_estimate() {
        let pool = pool();
        // Upstream counts half the raw estimate, request after request.
        for _ in 0..10_000 {
            pool.learn(1_000, 500, 1_100, 600, Duration::from_secs(1));
        }
        assert_eq!(pool.calibration_ratio(), 1.0);
        assert_eq!(pool.calibrated_input(1_000), 1_000, "errs high, never low");
        // One that counts more than the raw estimate lifts it, with the margin, at once.
        pool.learn(1_000, 1_500, 1_100, 1_600, Duration::from_secs(1));
        assert!(pool.calibrated_input(1_000) >= 1_650);
    }

    #[test]
    fn an_under_estimate_lifts_the_multiplier_at_once() {
        let m = track_quantile(0.8, 1.5);
        assert!((m - 1.5 * CALIBRATION_MARGIN).abs() < 1e-9);
    }
}
