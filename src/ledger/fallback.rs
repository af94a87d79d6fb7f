//! `on_error = "local"`: the shared ledger while it answers, a local share of each pool while it
//! does not.
//!
//! # Failure semantics
//!
//! - **Redis fails a reserve** (unreachable, timed out, error): that request is decided by the
//!   local ledger instead, and so is every request after it until the shared ledger answers again
//!   (its background `PING`, every second while unhealthy, says when; no request waits on a
//!   probe). Each switch to the local share counts in [`LedgerStats::fallbacks`]
//!   (`tokengate_ledger_fallback_total`); every absorbed Redis error in
//!   [`LedgerStats::absorbed_errors`] (`tokengate_ledger_errors_total{backend="redis"}`);
//!   `tokengate_ledger_mode` says which mode serves now. Readiness stays true: the replica admits.
//!   The fallback and both ledgers inside it count into one [`LedgerStats`].
//! - **The local share** is a [`MemoryLedger`] holding `1 / expected_replicas` of each pool's
//!   limits (tokens, requests, concurrency; at least one of each), so that replicas that all lose
//!   Redis together stay, between them, within the pool's limits.
//! - **A reservation is settled where it was taken**: local ones on the local ledger, shared ones
//!   on Redis (if that fails, the shared lease expires; see [`super::redis`]).
//! - **Overshoot.** The local buckets start full, and the shared bucket does not know what was
//!   admitted locally: across the switch in either direction, the pool can receive up to one
//!   extra bucket's worth of tokens within a minute (the shared state and the local shares each
//!   admitting up to their full level), and up to `max_concurrency` extra requests in flight while
//!   local requests admitted during the outage are still running after Redis returns. If fewer
//!   replicas than `expected_replicas` lose Redis, the ones that keep it carry on with the shared
//!   state, which does not see the local admissions either: set `expected_replicas` to the
//!   replica count (or above) to keep the local shares small.
//! - Snapshots while Redis answers add the local reservations still outstanding to the shared
//!   figures, so "nothing in flight" means nothing in flight in either.

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use async_trait::async_trait;

use super::{
    BudgetRequest, BudgetVerdict, BudgetWindow, Clock, LeasedLedger, Ledger, LedgerError,
    LedgerMode, LedgerStats, Limits, MemoryLedger, Origin, PoolSnapshot, RedisLedger, Reservation,
    ReserveRequest, Verdict, WindowSnapshot,
};

/// What the fallback needs of the shared ledger it stands behind: the Redis ledger, alone or
/// with local capacity leases in front of it.
pub trait SharedLedger: Ledger {
    /// Whether the last call to Redis succeeded.
    fn is_healthy(&self) -> bool;
    /// The stats, to share with the fallback's local ledger.
    fn stats_handle(&self) -> Arc<LedgerStats>;
}

impl SharedLedger for RedisLedger {
    fn is_healthy(&self) -> bool {
        RedisLedger::is_healthy(self)
    }

    fn stats_handle(&self) -> Arc<LedgerStats> {
        RedisLedger::stats_handle(self)
    }
}

impl SharedLedger for LeasedLedger {
    fn is_healthy(&self) -> bool {
        self.shared().is_healthy()
    }

    fn stats_handle(&self) -> Arc<LedgerStats> {
        self.shared().stats_handle()
    }
}

/// The shared ledger with a local share behind it.
#[derive(Debug)]
pub struct FallbackLedger<S = RedisLedger> {
    shared: S,
    local: MemoryLedger,
    replicas: u32,
    /// True from a fallback until the shared ledger admits again.
    in_local: AtomicBool,
}

impl<S: SharedLedger> FallbackLedger<S> {
    /// `shared` with a local share on `clock` behind it; both count into `shared`'s stats.
    pub fn new(shared: S, clock: Clock, expected_replicas: u32) -> FallbackLedger<S> {
        let local = MemoryLedger::with_stats(clock, shared.stats_handle());
        FallbackLedger {
            shared,
            local,
            replicas: expected_replicas.max(1),
            in_local: AtomicBool::new(false),
        }
    }

    pub fn shared(&self) -> &S {
        &self.shared
    }

    /// This replica's share of `limits`: `1 / expected_replicas` of each, at least one.
    pub fn local_share(&self, limits: &Limits) -> Limits {
        let n = u64::from(self.replicas);
        Limits {
            tokens_per_minute: (limits.tokens_per_minute / n).max(1),
            requests_per_minute: limits.requests_per_minute.map(|r| (r / n).max(1)),
            max_concurrency: (limits.max_concurrency / self.replicas).max(1),
            // A share of the day, starting full: while Redis is away a replica may admit up to
            // this much more of the day than the shared bucket had left.
            tokens_per_day: limits.tokens_per_day.map(|d| (d / n).max(1)),
        }
    }

    /// This replica's share of a budget's windows (`1 / expected_replicas`, at least one token).
    fn local_windows(&self, windows: &[BudgetWindow]) -> Vec<BudgetWindow> {
        let n = u64::from(self.replicas);
        windows
            .iter()
            .map(|w| BudgetWindow {
                capacity: (w.capacity / n).max(1),
                ..*w
            })
            .collect()
    }

    fn enter_local(&self, reason: &LedgerError) {
        if !self.in_local.swap(true, Ordering::AcqRel) {
            self.shared.stats().count_fallback();
            tracing::warn!(error = %reason, replicas = self.replicas, "shared ledger unavailable: admitting from the local share (1/expected_replicas of each pool)");
        }
    }

    fn enter_shared(&self) {
        if self.in_local.swap(false, Ordering::AcqRel) {
            tracing::info!("shared ledger back: admitting from Redis again");
        }
    }

    async fn reserve_local(&self, request: &ReserveRequest<'_>) -> Result<Verdict, LedgerError> {
        let local = ReserveRequest {
            pool: request.pool,
            limits: self.local_share(&request.limits),
            tokens: request.tokens,
            // Shares are fractions of the limits: they scale with the local share.
            share: request.share,
            hold_back: request.hold_back,
        };
        self.local.reserve(&local).await
    }
}

#[async_trait]
impl<S: SharedLedger> Ledger for FallbackLedger<S> {
    async fn reserve(&self, request: &ReserveRequest<'_>) -> Result<Verdict, LedgerError> {
        if self.shared.is_healthy() {
            match self.shared.reserve(request).await {
                Ok(verdict) => {
                    self.enter_shared();
                    return Ok(verdict);
                }
                Err(e) => {
                    self.shared.stats().count_absorbed_error();
                    self.enter_local(&e);
                }
            }
        } else if !self.in_local.load(Ordering::Acquire) {
            self.enter_local(&LedgerError {
                backend: self.shared.backend(),
                message: "unreachable at the last call".into(),
            });
        }
        self.reserve_local(request).await
    }

    async fn settle(
        &self,
        reservation: Reservation,
        charged_tokens: u64,
    ) -> Result<(), LedgerError> {
        match reservation.origin() {
            Origin::Local => self.local.settle(reservation, charged_tokens).await,
            Origin::Shared => self.shared.settle(reservation, charged_tokens).await,
        }
    }

    async fn snapshot(&self, pool: &str, limits: &Limits) -> Result<PoolSnapshot, LedgerError> {
        let local = self.local.snapshot(pool, &self.local_share(limits)).await?;
        if !self.shared.is_healthy() {
            return Ok(local);
        }
        match self.shared.snapshot(pool, limits).await {
            Ok(mut shared) => {
                shared.reserved_tokens += local.reserved_tokens;
                shared.in_flight_requests += local.in_flight_requests;
                Ok(shared)
            }
            Err(e) => {
                self.shared.stats().count_absorbed_error();
                tracing::warn!(error = %e, "shared snapshot failed; showing the local share");
                Ok(local)
            }
        }
    }

    async fn take_budget(&self, request: &BudgetRequest<'_>) -> Result<BudgetVerdict, LedgerError> {
        if self.shared.is_healthy() {
            match self.shared.take_budget(request).await {
                Ok(verdict) => return Ok(verdict),
                Err(e) => {
                    self.shared.stats().count_absorbed_error();
                    self.enter_local(&e);
                }
            }
        }
        // The local share of each window, like the pools' limits.
        let windows = self.local_windows(request.windows);
        let local = BudgetRequest {
            windows: &windows,
            ..*request
        };
        self.local.take_budget(&local).await
    }

    async fn settle_budget(
        &self,
        request: &BudgetRequest<'_>,
        origin: Origin,
        charged: u64,
    ) -> Result<(), LedgerError> {
        match origin {
            Origin::Shared => self.shared.settle_budget(request, origin, charged).await,
            Origin::Local => {
                let windows = self.local_windows(request.windows);
                let local = BudgetRequest {
                    windows: &windows,
                    ..*request
                };
                self.local.settle_budget(&local, origin, charged).await
            }
        }
    }

    async fn budget_snapshot(
        &self,
        scope: &str,
        windows: &[BudgetWindow],
    ) -> Result<Vec<WindowSnapshot>, LedgerError> {
        if self.shared.is_healthy() {
            match self.shared.budget_snapshot(scope, windows).await {
                Ok(s) => return Ok(s),
                Err(_) => self.shared.stats().count_absorbed_error(),
            }
        }
        self.local
            .budget_snapshot(scope, &self.local_windows(windows))
            .await
    }

    fn backend(&self) -> &'static str {
        self.shared.backend()
    }

    fn stats(&self) -> &LedgerStats {
        self.shared.stats()
    }

    fn mode(&self) -> LedgerMode {
        if self.shared.is_healthy() {
            LedgerMode::Shared
        } else {
            LedgerMode::LocalShare
        }
    }

    async fn close(&self) {
        self.shared.close().await;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::ledger::RedisOptions;

    #[tokio::test]
    async fn the_fallback_and_its_ledgers_count_into_one_stats() {
        let dir = tempfile::tempdir().expect("temp dir");
        let options = RedisOptions {
            url: format!("redis+unix://{}/nobody.sock", dir.path().display()),
            timeout: Duration::from_millis(200),
            lease: Duration::from_secs(60),
        };
        let shared = RedisLedger::connect(options).await.expect("a usable URL");
        let fallback = FallbackLedger::new(shared, Clock::manual(), 2);
        assert!(
            fallback.stats().absorbed_errors() >= 1,
            "the probe at connect failed and was absorbed"
        );
        let request = crate::ledger::tests::small_request();
        let Ok(Verdict::Granted(local)) = fallback.reserve(&request).await else {
            panic!("the local share admits");
        };
        assert_eq!(local.origin(), Origin::Local);
        assert_eq!(fallback.stats().fallbacks(), 1);
        drop(local); // unsettled, on purpose
        assert_eq!(fallback.stats().unsettled_drops(), 1);
        assert_eq!(
            fallback.shared().stats().unsettled_drops(),
            1,
            "the local share counts in the shared ledger's stats"
        );
    }
}
