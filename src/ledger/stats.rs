//! What one ledger counts about itself: reservations dropped unsettled, settlements still on
//! their way, errors it absorbed, switches to the local share.
//!
//! Each ledger instance owns one [`LedgerStats`] (a [`super::FallbackLedger`] and the two ledgers
//! inside it share one), so two gateways in one process, or two tests running in parallel in one
//! binary, never see each other's counts. Counts only grow, except settlements in flight. The
//! ledger knows nothing of Prometheus: `/metrics` reads these at scrape time and publishes them
//! (`src/app.rs`).

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

/// One ledger's own counters. Read with the getters; backends count through the crate-private
/// methods.
#[derive(Debug, Default)]
pub struct LedgerStats {
    unsettled_drops: AtomicU64,
    settlements_in_flight: AtomicU64,
    absorbed_errors: AtomicU64,
    fallbacks: AtomicU64,
}

impl LedgerStats {
    /// Reservations this ledger issued that were dropped without being settled (a bug if
    /// non-zero: every test asserts it stays zero).
    pub fn unsettled_drops(&self) -> u64 {
        self.unsettled_drops.load(Ordering::Relaxed)
    }

    /// Settlements started and not finished yet. Only a backend that waits (Redis) ever has
    /// any; shutdown waits for them.
    pub fn settlements_in_flight(&self) -> u64 {
        self.settlements_in_flight.load(Ordering::Acquire)
    }

    /// Errors the ledger handled itself instead of returning them: failed lease renewals and
    /// health probes, and the shared ledger's failures that the fallback answered from the local
    /// share. (Errors returned to the caller are the caller's to count.)
    pub fn absorbed_errors(&self) -> u64 {
        self.absorbed_errors.load(Ordering::Relaxed)
    }

    /// Times the fallback ledger switched to the local share because the shared ledger failed.
    pub fn fallbacks(&self) -> u64 {
        self.fallbacks.load(Ordering::Relaxed)
    }

    pub(crate) fn count_unsettled_drop(&self) {
        self.unsettled_drops.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn count_absorbed_error(&self) {
        self.absorbed_errors.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn count_fallback(&self) {
        self.fallbacks.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a settlement in flight until the returned guard drops (when it completes, or is
    /// abandoned).
    pub(crate) fn settlement_started(self: &Arc<Self>) -> SettlementInFlight {
        self.settlements_in_flight.fetch_add(1, Ordering::AcqRel);
        SettlementInFlight(self.clone())
    }
}

/// One settlement in flight; dropping it counts it finished.
#[derive(Debug)]
pub(crate) struct SettlementInFlight(Arc<LedgerStats>);

impl Drop for SettlementInFlight {
    fn drop(&mut self) {
        self.0.settlements_in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}
