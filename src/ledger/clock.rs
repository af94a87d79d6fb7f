//! Time for the ledger, injectable so tests control it.

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};
use std::time::Duration;

/// Monotonic nanoseconds since the clock was made.
#[derive(Debug, Clone)]
pub enum Clock {
    /// tokio's clock: real time, or paused test time under `tokio::time::pause`.
    Tokio(tokio::time::Instant),
    /// Moves only when told.
    Manual(Arc<AtomicU64>),
}

impl Clock {
    pub fn tokio() -> Clock {
        Clock::Tokio(tokio::time::Instant::now())
    }

    /// A manual clock at zero.
    pub fn manual() -> Clock {
        Clock::Manual(Arc::new(AtomicU64::new(0)))
    }

    pub fn now_ns(&self) -> u64 {
        match self {
            Clock::Tokio(epoch) => u64::try_from(epoch.elapsed().as_nanos()).unwrap_or(u64::MAX),
            Clock::Manual(ns) => ns.load(Ordering::Acquire),
        }
    }

    /// Advances a manual clock; a no-op on the tokio clock (use `tokio::time::advance`).
    pub fn advance(&self, by: Duration) {
        if let Clock::Manual(ns) = self {
            ns.fetch_add(
                u64::try_from(by.as_nanos()).unwrap_or(u64::MAX),
                Ordering::AcqRel,
            );
        }
    }
}

impl Default for Clock {
    fn default() -> Self {
        Clock::tokio()
    }
}
