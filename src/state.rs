//! What every request handler shares: the reloadable [`Policy`] and the process-wide parts that
//! outlive reloads (the upstream client, metrics, readiness).

use std::sync::{Arc, atomic::AtomicBool};

use arc_swap::ArcSwap;
use prometheus::Registry;

use crate::{
    admission::{Admission, InputCounter},
    auth::Authenticator,
    config::PolicyConfig,
    ledger::Ledger,
    metrics::Metrics,
    observe::{Observer, Telemetry, publish::LedgerPublications},
    upstream::{Upstream, sagemaker::SageMakerUpstreams},
};

/// What a config reload replaces: pools, routes, who may call, and the metric series that go
/// with them. A request loads it once, at its start, and keeps that generation to the end (its
/// reservation settles in the same ledger whatever was reloaded meanwhile).
#[derive(Debug)]
pub struct Policy {
    pub admission: Arc<Admission>,
    pub auth: Arc<Authenticator>,
    pub observer: Arc<Observer>,
}

impl Policy {
    /// The policy of `config`: admission over `ledger` (counting input exactly with `counter`
    /// for pools that ask), who may call, and the observer of both (with their places in the
    /// process-wide `telemetry`). Used at start and by every reload.
    pub fn build(
        config: &PolicyConfig,
        ledger: Arc<dyn Ledger>,
        counter: Arc<dyn InputCounter>,
        metrics: &Arc<Metrics>,
        telemetry: &Arc<Telemetry>,
    ) -> Policy {
        let admission = Admission::new(
            &config.admission_pools(),
            &config.routes,
            config.admission.clone(),
            ledger,
        )
        .with_input_counter(counter);
        let auth = Authenticator::new(&config.auth, &config.routes, metrics.clone());
        let observer = Observer::new(metrics.clone(), &admission, telemetry.clone());
        Policy {
            admission: Arc::new(admission),
            auth: Arc::new(auth),
            observer: Arc::new(observer),
        }
    }
}

/// Everything a request handler needs.
#[derive(Debug)]
pub struct AppState {
    pub policy: ArcSwap<Policy>,
    pub upstream: Arc<Upstream>,
    /// The sagemaker-runtime and control plane clients of endpoint pools.
    pub sagemaker: Arc<SageMakerUpstreams>,
    pub metrics: Arc<Metrics>,
    pub registry: Registry,
    /// The quota report and the other outputs that outlive reloads.
    pub telemetry: Arc<Telemetry>,
    /// Counts the ledger keeps, published at each scrape.
    pub ledger_publications: LedgerPublications,
    pub max_body_bytes: usize,
    /// Request-body bytes held in memory by all requests (`server.max_buffered_body_bytes`).
    pub body_budget: Arc<crate::body_budget::BodyBudget>,
    /// How long a request body may take to arrive (`server.body_read_timeout_secs`).
    pub body_read_timeout: std::time::Duration,
    /// False until started, and again once draining.
    pub ready: Arc<AtomicBool>,
    /// The calls turned away recently, whose SDK retries may use the retry reserve. Kept across
    /// reloads.
    pub rejections: crate::admission::retries::RecentRejections,
}

impl AppState {
    /// The policy in force now.
    pub fn policy(&self) -> Arc<Policy> {
        self.policy.load_full()
    }
}
