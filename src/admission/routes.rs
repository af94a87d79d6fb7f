//! Application routes at run time: the caller's route, what it may call, and its share of each
//! pool as the ledger sees it ([`crate::ledger::shares`] has the rules).

use foldhash::HashMap;
use std::sync::{
    Arc,
    atomic::{AtomicI64, AtomicU64, Ordering},
};

use crate::{
    config::{AdmissionConfig, PoolConfig, RouteConfig},
    ledger::{RouteShare, ShareRequest},
};

/// A configured route.
#[derive(Debug)]
pub struct Route {
    pub name: Arc<str>,
    pub config: RouteConfig,
    /// Its `budgets`, if it has any ([`super::budgets`]).
    pub budget: Option<Arc<super::budgets::Budget>>,
    /// The ledger "pool" its `max_concurrency` is counted in (`route:NAME`, its own keys).
    pub concurrency_key: Arc<str>,
    /// What its `adaptive_max_tokens` learned, per model; `None` when it does not opt in.
    pub adaptive: Option<super::adaptive::RouteLearners>,
}

impl Route {
    /// Whether the route may call `model` (the model id as the pool's config lists it).
    pub fn allows(&self, model: &str) -> bool {
        self.config
            .models
            .as_ref()
            .is_none_or(|models| models.iter().any(|m| m == model))
    }
}

/// Every route, by name.
#[derive(Debug)]
pub struct RouteTable {
    routes: Vec<Arc<Route>>,
    by_name: HashMap<Arc<str>, usize>,
}

impl RouteTable {
    /// The routes, with their adaptive maxTokens learners over `pools`' models.
    pub fn new(routes: &[RouteConfig], pools: &[PoolConfig]) -> RouteTable {
        let routes: Vec<Arc<Route>> = routes
            .iter()
            .map(|r| {
                Arc::new(Route {
                    name: Arc::from(r.name.as_str()),
                    config: r.clone(),
                    budget: super::budgets::Budget::route(&r.name, r.budgets.windows())
                        .map(Arc::new),
                    concurrency_key: Arc::from(format!("route:{}", r.name)),
                    adaptive: super::adaptive::RouteLearners::new(r, pools),
                })
            })
            .collect();
        let by_name = routes
            .iter()
            .enumerate()
            .map(|(i, r)| (r.name.clone(), i))
            .collect();
        RouteTable { routes, by_name }
    }

    pub fn get(&self, name: &str) -> Option<&Arc<Route>> {
        self.by_name.get(name).map(|&i| &self.routes[i])
    }

    pub fn routes(&self) -> &[Arc<Route>] {
        &self.routes
    }
}

/// A route's position among the routes of one pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteSlot(usize);

impl RouteSlot {
    pub fn index(self) -> usize {
        self.0
    }
}

/// What one route did in one pool since start.
#[derive(Debug, Default)]
pub struct RouteCounts {
    admitted: AtomicU64,
    rejected: AtomicU64,
    recovery_admissions: AtomicU64,
    reserved_tokens: AtomicI64,
    charged_tokens: AtomicU64,
}

impl RouteCounts {
    pub(crate) fn admitted(&self, tokens: u64) {
        self.admitted.fetch_add(1, Ordering::Relaxed);
        self.reserved_tokens
            .fetch_add(i64::try_from(tokens).unwrap_or(i64::MAX), Ordering::Relaxed);
    }

    pub(crate) fn recovered(&self) {
        self.recovery_admissions.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn rejected(&self) {
        self.rejected.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn settled(&self, reserved: u64, charged: u64) {
        self.reserved_tokens.fetch_sub(
            i64::try_from(reserved).unwrap_or(i64::MAX),
            Ordering::Relaxed,
        );
        self.charged_tokens.fetch_add(charged, Ordering::Relaxed);
    }

    /// Tokens reserved by the route's requests in flight.
    pub fn reserved_tokens(&self) -> i64 {
        self.reserved_tokens.load(Ordering::Relaxed)
    }
}

/// The routes' shares of one pool, in the order the ledger receives them.
#[derive(Debug)]
pub struct PoolShares {
    shares: Arc<[RouteShare]>,
    /// Each route's counts in this pool, in the order of `shares`.
    counts: Vec<RouteCounts>,
    index: HashMap<Arc<str>, usize>,
    retry_reserve: f64,
    priority_margin: f64,
    idle: std::time::Duration,
}

impl PoolShares {
    pub fn new(pool: &PoolConfig, routes: &[RouteConfig], admission: &AdmissionConfig) -> Self {
        let shares: Arc<[RouteShare]> = routes
            .iter()
            .map(|r| {
                let share = r.shares.get(&pool.name);
                RouteShare {
                    route: Arc::from(r.name.as_str()),
                    priority: r.priority,
                    min_share: share.map_or(0.0, |s| s.min),
                    max_share: share.and_then(|s| s.max),
                    recovery_share: r
                        .recovery_budget
                        .unwrap_or(pool.retry_reserve)
                        .min(pool.retry_reserve),
                }
            })
            .collect();
        let index = shares
            .iter()
            .enumerate()
            .map(|(i, s)| (s.route.clone(), i))
            .collect();
        let counts = shares.iter().map(|_| RouteCounts::default()).collect();
        PoolShares {
            shares,
            counts,
            index,
            retry_reserve: pool.retry_reserve,
            priority_margin: admission.priority_margin,
            idle: admission.share_idle,
        }
    }

    pub fn shares(&self) -> &[RouteShare] {
        &self.shares
    }

    /// The route's place in this pool.
    pub fn slot(&self, route: &str) -> Option<RouteSlot> {
        self.index.get(route).map(|&i| RouteSlot(i))
    }

    /// The route's counts in this pool.
    pub fn counts(&self, slot: RouteSlot) -> &RouteCounts {
        &self.counts[slot.0]
    }

    /// Every route's share and counts, for `/v1/pools`, in slot order.
    pub fn views(&self) -> Vec<RouteView> {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        self.shares
            .iter()
            .zip(&self.counts)
            .map(|(share, c)| RouteView {
                name: share.route.to_string(),
                priority: share.priority,
                min_share: share.min_share,
                max_share: share.max_share,
                recovery_share: share.recovery_share,
                admitted: load(&c.admitted),
                rejected: load(&c.rejected),
                recovery_admissions: load(&c.recovery_admissions),
                reserved_tokens: c.reserved_tokens(),
                charged_tokens: load(&c.charged_tokens),
            })
            .collect()
    }

    /// The ledger request for `route` (retrying if `retry`); `None` for a route not in the pool.
    pub fn request(&self, route: &str, retry: bool) -> Option<ShareRequest> {
        let caller = *self.index.get(route)?;
        Some(ShareRequest {
            routes: self.shares.clone(),
            caller,
            retry,
            retry_reserve: self.retry_reserve,
            priority_margin: self.priority_margin,
            idle: self.idle,
        })
    }
}

/// One route in one pool, in `GET /v1/pools`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RouteView {
    pub name: String,
    pub priority: i32,
    pub min_share: f64,
    pub max_share: Option<f64>,
    pub recovery_share: f64,
    pub admitted: u64,
    pub rejected: u64,
    pub recovery_admissions: u64,
    /// Tokens reserved by the route's requests in flight.
    pub reserved_tokens: i64,
    pub charged_tokens: u64,
}

/// Who is asking: the route the caller identified as, and whether this is a retry of a call the
/// proxy turned away (which may use the pool's retry reserve).
#[derive(Debug, Clone)]
pub struct Caller {
    pub route: Arc<Route>,
    pub retry: bool,
}
