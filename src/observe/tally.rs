//! What a pool or a route did over a stretch of time, counted from the observer's events: the
//! quota report keeps one [`Tally`] per pool and minute ([`super::report`]), the CloudWatch EMF
//! output one per pool and route and interval ([`super::emf`]). Both are fed the same
//! [`Event`]s, so their figures agree.

use std::time::Duration;

use serde::Serialize;

use crate::bedrock::Usage;

/// One thing that happened to a request, as the tallies count it.
#[derive(Debug, Clone, Copy)]
pub enum Event {
    /// Admitted, reserving `reserved`; `in_flight` is the pool's count with it; `spilled`: it
    /// came down another pool's spill chain (its home pool could not admit it now).
    Admitted {
        reserved: u64,
        in_flight: u64,
        queued_for: Option<Duration>,
        spilled: bool,
    },
    /// Turned away by a limit or the queue (a 429). `demand` is its reservation when it was a
    /// first attempt (an SDK's retries of one call count once), else `None`.
    Throttled {
        demand: Option<u64>,
        queued_for: Option<Duration>,
    },
    /// Settled, charged `charge` tokens; the usage upstream reported, if it did.
    Settled { charge: u64, usage: Option<Usage> },
    /// Upstream throttled a request tokengate admitted.
    UpstreamThrottled,
}

/// Counts over one stretch of time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Tally {
    /// Requests admitted or turned away by a limit (invalid ones are not demand).
    pub requests: u64,
    pub admitted: u64,
    /// Turned away with a 429 by tokengate (a limit, the queue).
    pub throttled: u64,
    /// Throttled by upstream although tokengate admitted them.
    pub upstream_throttles: u64,
    /// Requests that waited in the admission queue (admitted or not).
    pub queued: u64,
    /// Tokens reserved at admission.
    pub reserved_tokens: u64,
    /// Tokens charged at settlement.
    pub charged_tokens: u64,
    /// Tokens asked for: the reservations of admitted requests and of first attempts turned
    /// away. What the pool would have had to hold to refuse nobody.
    pub demand_tokens: u64,
    /// Requests admitted here that came down another pool's spill chain.
    pub spilled_in: u64,
    /// The most requests in flight in the pool at once, seen at admissions.
    pub peak_in_flight: u64,
    /// Queue waits, summed and the longest, in milliseconds.
    pub queue_wait_ms: u64,
    pub queue_wait_max_ms: u64,
}

impl Tally {
    pub fn record(&mut self, event: &Event) {
        match *event {
            Event::Admitted {
                reserved,
                in_flight,
                queued_for,
                spilled,
            } => {
                self.requests += 1;
                self.admitted += 1;
                self.spilled_in += u64::from(spilled);
                self.reserved_tokens += reserved;
                self.demand_tokens += reserved;
                self.peak_in_flight = self.peak_in_flight.max(in_flight);
                self.queue_wait(queued_for);
            }
            Event::Throttled { demand, queued_for } => {
                self.requests += 1;
                self.throttled += 1;
                self.demand_tokens += demand.unwrap_or(0);
                self.queue_wait(queued_for);
            }
            Event::Settled { charge, .. } => self.charged_tokens += charge,
            Event::UpstreamThrottled => self.upstream_throttles += 1,
        }
    }

    fn queue_wait(&mut self, waited: Option<Duration>) {
        if let Some(w) = waited {
            let ms = millis(w);
            self.queued += 1;
            self.queue_wait_ms += ms;
            self.queue_wait_max_ms = self.queue_wait_max_ms.max(ms);
        }
    }
}

/// Whole milliseconds, rounded up so that any wait counts.
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_micros().div_ceil(1000)).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tally_counts_demand_once_per_call_and_keeps_peaks() {
        let mut t = Tally::default();
        let admitted = |reserved, in_flight, queued_for, spilled| Event::Admitted {
            reserved,
            in_flight,
            queued_for,
            spilled,
        };
        t.record(&admitted(100, 1, None, false));
        t.record(&admitted(300, 3, Some(Duration::from_millis(250)), false));
        // Down another pool's spill chain.
        t.record(&admitted(50, 2, None, true));
        t.record(&Event::Throttled {
            demand: Some(700),
            queued_for: Some(Duration::from_micros(1_000_001)),
        });
        // A retry of a call already counted as demand.
        t.record(&Event::Throttled {
            demand: None,
            queued_for: None,
        });
        t.record(&Event::Settled {
            charge: 80,
            usage: None,
        });
        t.record(&Event::UpstreamThrottled);
        assert_eq!(
            t,
            Tally {
                requests: 5,
                admitted: 3,
                throttled: 2,
                upstream_throttles: 1,
                queued: 2,
                reserved_tokens: 450,
                charged_tokens: 80,
                demand_tokens: 1150,
                spilled_in: 1,
                peak_in_flight: 3,
                queue_wait_ms: 250 + 1001,
                queue_wait_max_ms: 1001,
            }
        );
    }
}
