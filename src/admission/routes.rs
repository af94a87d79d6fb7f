//! Application routes at run time: the caller's route, what it may call, and its share of each
//! pool as the ledger sees it ([`crate::ledger::shares`] has the rules).

use std::{collections::HashMap, sync::Arc};

use crate::{
    config::{AdmissionConfig, PoolConfig, RouteConfig},
    ledger::{RouteDemand, RouteShare, ShareRequest},
    metrics::{Metrics, RouteMetrics},
};

/// A configured route.
#[derive(Debug)]
pub struct Route {
    pub name: Arc<str>,
    pub config: RouteConfig,
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
    pub fn new(routes: &[RouteConfig]) -> RouteTable {
        let routes: Vec<Arc<Route>> = routes
            .iter()
            .map(|r| {
                Arc::new(Route {
                    name: Arc::from(r.name.as_str()),
                    config: r.clone(),
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

/// The routes' shares of one pool, in the order the ledger receives them.
#[derive(Debug)]
pub struct PoolShares {
    shares: Arc<[RouteShare]>,
    /// Each route's series in this pool, in the order of `shares`. Shared: every admitted
    /// request holds its route's until it settles, and a clone is one count, not five.
    metrics: Vec<Arc<RouteMetrics>>,
    index: HashMap<Arc<str>, usize>,
    retry_reserve: f64,
    priority_margin: f64,
    idle: std::time::Duration,
}

impl PoolShares {
    pub fn new(
        pool: &PoolConfig,
        routes: &[RouteConfig],
        admission: &AdmissionConfig,
        metrics: &Metrics,
    ) -> Self {
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
        let metrics = shares
            .iter()
            .map(|s| Arc::new(RouteMetrics::new(metrics, &pool.name, &s.route)))
            .collect();
        PoolShares {
            shares,
            metrics,
            index,
            retry_reserve: pool.retry_reserve,
            priority_margin: admission.priority_margin,
            idle: admission.share_idle,
        }
    }

    pub fn shares(&self) -> &[RouteShare] {
        &self.shares
    }

    /// The route's series in this pool.
    pub fn metrics(&self, route: &str) -> Option<&Arc<RouteMetrics>> {
        self.index.get(route).map(|&i| &self.metrics[i])
    }

    /// Every route's share and counts, for `/v1/pools`.
    pub fn views(&self) -> Vec<RouteView> {
        self.shares
            .iter()
            .zip(&self.metrics)
            .map(|(share, m)| RouteView {
                name: share.route.to_string(),
                priority: share.priority,
                min_share: share.min_share,
                max_share: share.max_share,
                recovery_share: share.recovery_share,
                admitted: m.admitted.get(),
                rejected: m.rejected.get(),
                recovery_admissions: m.recovery_admissions.get(),
                reserved_tokens: m.reserved_tokens.get(),
                charged_tokens: m.charged_tokens.get(),
            })
            .collect()
    }

    /// The ledger request for `route` (retrying if `retry`); `None` for a route not in the pool.
    pub fn request(&self, route: &str, retry: bool) -> Option<ShareRequest<'_>> {
        let caller = *self.index.get(route)?;
        Some(ShareRequest {
            routes: &self.shares,
            caller,
            retry,
            retry_reserve: self.retry_reserve,
            priority_margin: self.priority_margin,
            idle: self.idle,
        })
    }

    /// [`PoolShares::request`], owned, for the admission queue.
    pub fn demand(&self, route: &str, retry: bool) -> Option<RouteDemand> {
        let caller = *self.index.get(route)?;
        Some(RouteDemand {
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

/// Who is asking: the route the caller identified as, and whether this is a retry.
#[derive(Debug, Clone)]
pub struct Caller {
    pub route: Arc<Route>,
    /// An SDK retry of a call this proxy turned away ([`super::retries`]): it may draw on the
    /// retry reserve.
    pub retry: bool,
}

impl Caller {
    pub fn is_retry(&self) -> bool {
        self.retry
    }
}

/// The attempt number from `amz-sdk-request: attempt=N; max=M` (1 when absent or unreadable).
pub fn sdk_attempt(headers: &http::HeaderMap) -> u32 {
    headers
        .get("amz-sdk-request")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.split(';')
                .filter_map(|part| part.trim().strip_prefix("attempt="))
                .find_map(|n| n.trim().parse::<u32>().ok())
        })
        .unwrap_or(1)
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attempt_from_the_sdk_header() {
        let mut h = http::HeaderMap::new();
        assert_eq!(sdk_attempt(&h), 1);
        h.insert("amz-sdk-request", "attempt=3; max=5".parse().unwrap());
        assert_eq!(sdk_attempt(&h), 3);
        h.insert(
            "amz-sdk-request",
            "ttl=20240101T000000Z; attempt=2; max=3".parse().unwrap(),
        );
        assert_eq!(sdk_attempt(&h), 2);
        h.insert("amz-sdk-request", "attempt=zero".parse().unwrap());
        assert_eq!(sdk_attempt(&h), 1);
    }
}
