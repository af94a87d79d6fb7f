//! One simulated endpoint's copies: how many serve, the requests on them, and scaling that
//! takes time.
//!
//! Routing is least-outstanding-requests: a call finds a free slot as long as any copy is below
//! its cap, so it is refused only when `in flight = copies x max_concurrency_per_copy`. A slot is
//! held by a [`Slot`] guard until the response ends (or its client leaves). Asking for other
//! copies (`POST /_sim/sagemaker`) sets the desired count at once and the current one
//! `scale_delay_ms` later; requests made while others are pending land in the order they were
//! made, each its own delay after it (as scaling activities follow one another). Removed copies
//! finish what they serve: in flight may exceed the new capacity until those calls end.

use std::sync::{
    Arc, Mutex,
    atomic::{AtomicU32, AtomicU64, Ordering::Relaxed},
};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::config::EndpointSimConfig;

/// One endpoint (or inference component) and its copies.
#[derive(Debug)]
pub struct Fleet {
    pub config: EndpointSimConfig,
    current: AtomicU32,
    desired: AtomicU32,
    in_flight: AtomicU32,
    counts: Counts,
    peak: Mutex<u32>,
}

#[derive(Debug, Default)]
struct Counts {
    invocations: AtomicU64,
    served: AtomicU64,
    overloaded: AtomicU64,
    no_capacity: AtomicU64,
    output_tokens: AtomicU64,
}

/// A fleet in `GET /_sim/sagemaker`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FleetStats {
    pub endpoint: String,
    pub inference_component: Option<String>,
    pub copies: u32,
    pub desired_copies: u32,
    pub max_concurrency_per_copy: u32,
    pub in_flight: u32,
    /// The most requests in flight at once since start.
    pub peak_in_flight: u32,
    /// Calls that reached the fleet.
    pub invocations: u64,
    /// Calls answered in full.
    pub served: u64,
    /// Calls refused because every copy was at its cap (the container's 429).
    pub overloaded: u64,
    /// Calls refused because no copy served.
    pub no_capacity: u64,
    pub output_tokens: u64,
}

/// Why a call found no slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Every copy is at its cap.
    Overloaded,
    /// No copy serves (scaled to zero).
    NoCapacity,
}

/// A request slot on a copy, given back when dropped.
#[derive(Debug)]
pub struct Slot {
    fleet: Arc<Fleet>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.fleet.in_flight.fetch_sub(1, Relaxed);
    }
}

impl Fleet {
    pub fn new(config: EndpointSimConfig) -> Fleet {
        Fleet {
            current: AtomicU32::new(config.copies),
            desired: AtomicU32::new(config.copies),
            in_flight: AtomicU32::new(0),
            counts: Counts::default(),
            peak: Mutex::new(0),
            config,
        }
    }

    pub fn copies(&self) -> u32 {
        self.current.load(Relaxed)
    }

    pub fn desired(&self) -> u32 {
        self.desired.load(Relaxed)
    }

    /// Takes a slot, or says why there is none.
    pub fn acquire(self: &Arc<Self>) -> Result<Slot, Refusal> {
        self.counts.invocations.fetch_add(1, Relaxed);
        let copies = self.copies();
        if copies == 0 {
            self.counts.no_capacity.fetch_add(1, Relaxed);
            return Err(Refusal::NoCapacity);
        }
        let cap = copies.saturating_mul(self.config.max_concurrency_per_copy);
        let taken = self
            .in_flight
            .fetch_update(Relaxed, Relaxed, |n| (n < cap).then_some(n + 1));
        match taken {
            Ok(before) => {
                let mut peak = self.peak.lock().unwrap_or_else(|p| p.into_inner());
                *peak = (*peak).max(before + 1);
                Ok(Slot {
                    fleet: self.clone(),
                })
            }
            Err(_) => {
                self.counts.overloaded.fetch_add(1, Relaxed);
                Err(Refusal::Overloaded)
            }
        }
    }

    /// A call finished in full, having generated `output_tokens`.
    pub fn served(&self, output_tokens: u64) {
        self.counts.served.fetch_add(1, Relaxed);
        self.counts.output_tokens.fetch_add(output_tokens, Relaxed);
    }

    /// Asks for `copies`: desired at once, serving `scale_delay_ms` later.
    pub fn scale(self: &Arc<Self>, copies: u32) {
        self.desired.store(copies, Relaxed);
        let delay = Duration::from_millis(self.config.scale_delay_ms);
        if delay.is_zero() {
            self.current.store(copies, Relaxed);
            return;
        }
        let fleet = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            fleet.current.store(copies, Relaxed);
        });
    }

    pub fn stats(&self) -> FleetStats {
        let c = &self.counts;
        FleetStats {
            endpoint: self.config.name.clone(),
            inference_component: self.config.inference_component.clone(),
            copies: self.copies(),
            desired_copies: self.desired(),
            max_concurrency_per_copy: self.config.max_concurrency_per_copy,
            in_flight: self.in_flight.load(Relaxed),
            peak_in_flight: *self.peak.lock().unwrap_or_else(|p| p.into_inner()),
            invocations: c.invocations.load(Relaxed),
            served: c.served.load(Relaxed),
            overloaded: c.overloaded.load(Relaxed),
            no_capacity: c.no_capacity.load(Relaxed),
            output_tokens: c.output_tokens.load(Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet(copies: u32, cap: u32, delay_ms: u64) -> Arc<Fleet> {
        Arc::new(Fleet::new(EndpointSimConfig {
            name: "e".into(),
            inference_component: None,
            copies,
            max_concurrency_per_copy: cap,
            time_to_first_token_ms: 0,
            tokens_per_second: 0.0,
            scale_delay_ms: delay_ms,
            default_max_new_tokens: 10,
        }))
    }

    #[test]
    fn slots_are_copies_times_the_cap_and_come_back() {
        let f = fleet(2, 3, 0);
        let slots: Vec<Slot> = (0..6).map(|_| f.acquire().unwrap()).collect();
        assert_eq!(f.acquire().unwrap_err(), Refusal::Overloaded);
        drop(slots);
        assert_eq!(f.stats().in_flight, 0);
        assert_eq!(f.stats().peak_in_flight, 6);
        f.scale(0);
        assert_eq!(f.acquire().unwrap_err(), Refusal::NoCapacity);
        let s = f.stats();
        assert_eq!((s.invocations, s.overloaded, s.no_capacity), (8, 1, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn copies_arrive_after_the_delay_in_the_order_asked() {
        let f = fleet(1, 1, 60_000);
        f.scale(4);
        assert_eq!((f.copies(), f.desired()), (1, 4));
        tokio::time::sleep(Duration::from_secs(30)).await;
        f.scale(6);
        assert_eq!((f.copies(), f.desired()), (1, 6));
        tokio::time::sleep(Duration::from_secs(31)).await;
        assert_eq!(f.copies(), 4, "the first request landed");
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert_eq!((f.copies(), f.desired()), (6, 6));
    }
}
