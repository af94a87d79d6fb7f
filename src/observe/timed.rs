//! The ledger's round-trip time, measured around every reserve and settle: a [`Ledger`] that
//! wraps the configured one and observes `tokengate_ledger_seconds`. (For Redis that is the Redis
//! round trip; for the memory ledger, the lock and the arithmetic.)

use std::{sync::Arc, time::Instant};

use async_trait::async_trait;
use prometheus::Histogram;

use crate::ledger::{
    BudgetRequest, BudgetVerdict, BudgetWindow, Ledger, LedgerError, LedgerMode, LedgerStats,
    Limits, Origin, PoolSnapshot, Reservation, ReserveRequest, Verdict, WindowSnapshot,
};

/// A ledger whose reserve and settle calls are timed.
#[derive(Debug)]
pub struct TimedLedger {
    inner: Arc<dyn Ledger>,
    seconds: Histogram,
}

impl TimedLedger {
    pub fn new(inner: Arc<dyn Ledger>, seconds: Histogram) -> TimedLedger {
        TimedLedger { inner, seconds }
    }
}

#[async_trait]
impl Ledger for TimedLedger {
    async fn reserve(&self, request: &ReserveRequest<'_>) -> Result<Verdict, LedgerError> {
        let started = Instant::now();
        let decision = self.inner.reserve(request).await;
        self.seconds.observe(started.elapsed().as_secs_f64());
        decision
    }

    async fn settle(
        &self,
        reservation: Reservation,
        charged_tokens: u64,
    ) -> Result<(), LedgerError> {
        let started = Instant::now();
        let settled = self.inner.settle(reservation, charged_tokens).await;
        self.seconds.observe(started.elapsed().as_secs_f64());
        settled
    }

    async fn snapshot(&self, pool: &str, limits: &Limits) -> Result<PoolSnapshot, LedgerError> {
        self.inner.snapshot(pool, limits).await
    }

    async fn take_budget(&self, request: &BudgetRequest<'_>) -> Result<BudgetVerdict, LedgerError> {
        let started = Instant::now();
        let verdict = self.inner.take_budget(request).await;
        self.seconds.observe(started.elapsed().as_secs_f64());
        verdict
    }

    async fn settle_budget(
        &self,
        request: &BudgetRequest<'_>,
        origin: Origin,
        charged: u64,
    ) -> Result<(), LedgerError> {
        let started = Instant::now();
        let settled = self.inner.settle_budget(request, origin, charged).await;
        self.seconds.observe(started.elapsed().as_secs_f64());
        settled
    }

    async fn budget_snapshot(
        &self,
        scope: &str,
        windows: &[BudgetWindow],
    ) -> Result<Vec<WindowSnapshot>, LedgerError> {
        self.inner.budget_snapshot(scope, windows).await
    }

    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn stats(&self) -> &LedgerStats {
        self.inner.stats()
    }

    fn mode(&self) -> LedgerMode {
        self.inner.mode()
    }

    async fn close(&self) {
        self.inner.close().await;
    }
}
