//! One pool's capacity slice on this replica ([`super`]): what is left of it, the reservations
//! admitted from it, and the demand the next one is sized from. Pure bookkeeping under the pool's
//! mutex: no I/O, no waiting.

use std::{
    collections::HashMap,
    sync::{Mutex, MutexGuard},
    time::Duration,
};

use tokio::time::Instant;

use super::LeaseOptions;
use crate::ledger::{
    Limits, PoolSnapshot, ReserveRequest, ShareHold,
    scripts::{MAX_CHARGE, SliceBack, SliceTake},
    shares::share_tokens,
};

/// The most permits one slice holds (each is a member of the pool's lease set).
const MAX_SLICE_PERMITS: u32 = 1_024;

#[derive(Debug, Default)]
pub(super) struct Local {
    pub(super) slice: Option<Slice>,
    pub(super) demand: Demand,
}

/// A live slice: what it was taken with, what is left, its reservations in flight.
#[derive(Debug)]
pub(super) struct Slice {
    id: u64,
    limits: Limits,
    /// What the shared bucket keeps for retries under it (a route share's retry reserve).
    keep: u64,
    tokens: u64,
    requests: u64,
    permits: u32,
    unused_tokens: i64,
    unused_requests: u64,
    free_permits: u32,
    from_full: bool,
    taken_at: Instant,
    last_admit: Instant,
    /// Reservation id -> tokens.
    in_flight: HashMap<u64, u64>,
}

/// What this replica asked of a pool since its last slice was taken.
#[derive(Debug, Default)]
pub(super) struct Demand {
    since: Option<Instant>,
    /// The requests' tokens, and how much their hold-back grew: a slice must cover both.
    tokens: u64,
    requests: u64,
    peak_in_flight: u32,
    /// The last request's hold-back (kept from one slice to the next).
    hold_back: u64,
}

// === impl Local, Slice, Demand ===

impl Local {
    /// Admits `request` from the live slice if it fits: the reservation's id, and whether that
    /// used the slice up.
    pub(super) fn admit(
        &mut self,
        request: &ReserveRequest<'_>,
        options: &LeaseOptions,
        now: Instant,
    ) -> Option<(u64, bool)> {
        let slice = self.slice.as_mut()?;
        if !slice.fits(request, options, now) {
            return None;
        }
        let id = slice.admit(request.tokens, now);
        Some((id, slice.exhausted()))
    }

    /// Whether the sweep should give the slice back.
    pub(super) fn stale(&self, options: &LeaseOptions, now: Instant) -> bool {
        self.slice.as_ref().is_some_and(|s| {
            now.duration_since(s.last_admit) >= options.horizon
                || now.duration_since(s.taken_at) >= options.max_age
        })
    }

    /// Settles a reservation of the live slice in it; false if it is not one of them.
    pub(super) fn settle(&mut self, id: u64, charged: u64) -> bool {
        let Some(slice) = self.slice.as_mut() else {
            return false;
        };
        let Some(tokens) = slice.in_flight.remove(&id) else {
            return false;
        };
        let delta = i128::from(tokens) - i128::from(charged.min(MAX_CHARGE));
        slice.unused_tokens = i64::try_from(i128::from(slice.unused_tokens) + delta)
            .unwrap_or(i64::MIN)
            .max(-i64::try_from(MAX_CHARGE).unwrap_or(i64::MAX));
        slice.free_permits += 1;
        true
    }
}

impl Slice {
    pub(super) fn new(
        take: &SliceTake,
        limits: Limits,
        (tokens, requests, permits): (u64, u64, u32),
        now: Instant,
    ) -> Slice {
        Slice {
            id: take.id,
            limits,
            keep: take.keep,
            tokens,
            requests,
            permits,
            unused_tokens: i64::try_from(tokens).unwrap_or(i64::MAX),
            unused_requests: requests,
            free_permits: permits,
            from_full: false,
            taken_at: now,
            last_admit: now,
            in_flight: HashMap::new(),
        }
    }

    /// The limits it was taken under: it admits only calls carrying the same.
    pub(super) fn limits(&self) -> &Limits {
        &self.limits
    }

    /// What it left in the shared bucket for retries (see [`keep`]).
    pub(super) fn keep(&self) -> u64 {
        self.keep
    }

    /// Its reservations in flight.
    pub(super) fn admitted(&self) -> usize {
        self.in_flight.len()
    }

    fn request_limited(&self) -> bool {
        self.limits.requests_per_minute.is_some()
    }

    /// Whether `request` may be admitted from the slice: taken under its limits and leaving its
    /// retry reserve, and what is left covers its tokens and its hold-back. (The exact bucket
    /// holds at least what is left of the slice and the reserve left beside it, so this never
    /// admits what the exact bucket would refuse; the hold-back stays in the slice, where the
    /// burndown debts it is kept for are settled.)
    pub(super) fn fits(
        &self,
        request: &ReserveRequest<'_>,
        options: &LeaseOptions,
        now: Instant,
    ) -> bool {
        self.limits == request.limits
            && self.keep == keep(request)
            && now.duration_since(self.taken_at) < options.max_age
            && i128::from(self.unused_tokens)
                >= i128::from(request.tokens) + i128::from(request.hold_back)
            && self.free_permits > 0
            && (!self.request_limited() || self.unused_requests > 0)
    }

    /// Takes a fitting request's tokens, request and permit; its reservation id.
    pub(super) fn admit(&mut self, tokens: u64, now: Instant) -> u64 {
        self.from_full |= self.unused_tokens >= i64::try_from(self.tokens).unwrap_or(i64::MAX);
        self.unused_tokens -= i64::try_from(tokens).unwrap_or(i64::MAX);
        self.free_permits -= 1;
        if self.request_limited() {
            self.unused_requests -= 1;
        }
        self.last_admit = now;
        let id = rand::random();
        self.in_flight.insert(id, tokens);
        id
    }

    /// Nothing more fits: no permit, no request, or (for a slice of tokens) no token left.
    pub(super) fn exhausted(&self) -> bool {
        self.free_permits == 0
            || (self.request_limited() && self.unused_requests == 0)
            || (self.tokens > 0 && self.unused_tokens <= 0)
    }

    pub(super) fn in_flight(&self) -> Vec<(u64, u64)> {
        self.in_flight.iter().map(|(&id, &t)| (id, t)).collect()
    }

    pub(super) fn back<'a>(&self, in_flight: &'a [(u64, u64)]) -> SliceBack<'a> {
        SliceBack {
            id: self.id,
            tokens: self.tokens,
            requests: self.requests,
            permits: self.permits,
            unused_tokens: self.unused_tokens,
            unused_requests: self.unused_requests,
            from_full: self.from_full,
            in_flight,
        }
    }

    /// Adds this slice's view to the shared snapshot: its unused part is available here, its
    /// reservations (not the slice) are in flight.
    pub(super) fn add_to(&self, snapshot: &mut PoolSnapshot) {
        let reserved: u64 = self.in_flight.values().sum();
        let in_flight = u32::try_from(self.in_flight.len()).unwrap_or(u32::MAX);
        snapshot.tokens_available = snapshot.tokens_available.saturating_add(self.unused_tokens);
        snapshot.reserved_tokens = snapshot.reserved_tokens.saturating_sub(self.tokens) + reserved;
        snapshot.in_flight_requests =
            snapshot.in_flight_requests.saturating_sub(self.permits) + in_flight;
        if let Some(r) = snapshot.requests_available.as_mut() {
            *r += self.unused_requests;
        }
    }
}

impl Demand {
    /// Counts a request asking, with `in_flight` already admitted from the slice. A hold-back
    /// that grew since the last request counts as tokens asked: what is left of the slice must
    /// cover it as it covers the requests.
    pub(super) fn note(&mut self, request: &ReserveRequest<'_>, in_flight: usize, now: Instant) {
        self.since.get_or_insert(now);
        let grown = request.hold_back.saturating_sub(self.hold_back);
        self.hold_back = request.hold_back;
        self.tokens = self
            .tokens
            .saturating_add(request.tokens)
            .saturating_add(grown);
        self.requests += 1;
        let in_flight = u32::try_from(in_flight).unwrap_or(u32::MAX);
        self.peak_in_flight = self.peak_in_flight.max(in_flight.saturating_add(1));
    }

    /// The next slice for `request`, from the demand since the last one (which starts afresh),
    /// and the request's hold-back on top: the slice must go on covering it for the next request
    /// to fit (a horizon of zero takes exactly the request, hold-back checked but not taken).
    pub(super) fn size(
        &mut self,
        id: u64,
        request: &ReserveRequest<'_>,
        options: &LeaseOptions,
        now: Instant,
    ) -> SliceTake {
        let demand = std::mem::take(self);
        self.since = Some(now);
        self.hold_back = demand.hold_back;
        let limits = &request.limits;
        let f = options.max_fraction;
        let elapsed = demand
            .since
            .map_or(Duration::ZERO, |s| now.duration_since(s));
        // Twice the demand of the last horizon: the whole demand when it came within one.
        let scale = if options.horizon.is_zero() {
            0.0
        } else if elapsed <= options.horizon {
            2.0
        } else {
            2.0 * options.horizon.as_secs_f64() / elapsed.as_secs_f64()
        };
        let scaled = |n: u64| (n as f64 * scale).ceil() as u64;
        let hold_back = if scale > 0.0 { request.hold_back } else { 0 };
        let permits = if options.horizon.is_zero() {
            1
        } else {
            demand.peak_in_flight.saturating_mul(2)
        };
        let permit_cap =
            part(u64::from(limits.max_concurrency), f).min(u64::from(MAX_SLICE_PERMITS));
        let route = request.share.map(|share| {
            let (_, _, recovery) = share.caller().capacities(limits.tokens_per_minute);
            (share.caller().route.clone(), recovery)
        });
        SliceTake {
            id,
            least: request.tokens,
            keep: keep(request),
            hold_back: request.hold_back,
            route,
            tokens: scaled(demand.tokens)
                .saturating_add(hold_back)
                .min(part(limits.tokens_per_minute, f))
                .max(request.tokens.saturating_add(hold_back)),
            requests: limits
                .requests_per_minute
                .map_or(0, |r| scaled(demand.requests).min(part(r, f)).max(1)),
            permits: u32::try_from(u64::from(permits).min(permit_cap))
                .unwrap_or(1)
                .max(1),
        }
    }
}

/// What a request's share leaves in the shared bucket: a first attempt leaves the retry reserve
/// (a share that a slice may decide has no guarantees, ceilings or priorities to weigh:
/// [`super::Inner::sliceable`]).
pub(super) fn keep(request: &ReserveRequest<'_>) -> u64 {
    request.share.map_or(0, |share| {
        share_tokens(share.retry_reserve, request.limits.tokens_per_minute)
    })
}

/// What a reservation from a slice took from its route's buckets: nothing (a share a slice
/// decides has no guarantee), as the admit script answers for it.
pub(super) fn hold(request: &ReserveRequest<'_>) -> Option<ShareHold> {
    request.share.map(|share| ShareHold {
        route: share.caller().route.clone(),
        guaranteed: 0,
        recovered: false,
    })
}

/// `fraction` of a limit, rounded down.
pub(super) fn part(limit: u64, fraction: f64) -> u64 {
    (limit as f64 * fraction).floor() as u64
}

/// A poisoned lock means a panic mid-update elsewhere; the few integers inside stay consistent.
pub(super) fn lock(local: &Mutex<Local>) -> MutexGuard<'_, Local> {
    local
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
