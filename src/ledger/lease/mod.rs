//! Local capacity leases: a replica takes a slice of a pool's shared bucket in one round trip and
//! admits from it in memory, giving back what it does not use (`[ledger.local_leases]`).
//! (Over 500 lines: most of it is this design note; the code is the trait's calls and the exchange.)
//!
//! [`LeasedLedger`] wraps the [`RedisLedger`] behind the same [`Ledger`] trait. Most decisions
//! then take one mutex in this process and no round trip; Redis is asked only to give a slice back
//! and take the next one (`lua/slice.lua`, both in one call).
//!
//! # What a slice is
//!
//! Tokens, request-bucket units and concurrency permits taken from the pool's shared state exactly
//! as a reservation takes them (the same checks, all or nothing, the transit hold), held in the
//! pool's lease set as leases of their own (one member per permit, so every replica counts them
//! in flight, and a slice that nobody gives back expires like a lease). A request is admitted
//! from the slice when it fits what is left of it, under the limits the slice was taken with;
//! its settlement credits back (or debits) the slice. The reservations still in flight when a
//! slice is given back become ordinary leases in the same call, settled in Redis later.
//!
//! **No over-admission, whatever the number of replicas.** Everything out (reservations and
//! slices) was taken from the shared bucket, so the bucket never holds less than is out. And what
//! a slice has not used was never sent upstream, whose own bucket still holds it: the shared
//! bucket's refill and credits stop at its capacity less what live slices hold (`top` in
//! `lua/common.lua`), so the shared level plus every replica's unused slice never exceeds
//! capacity. The cost is under-admission while a pool's bucket is near full (refill waits for the
//! slice to come back); under load, when the bucket is low, nothing is lost.
//!
//! Three things change the bucket under a slice without its holder knowing, and each gives the
//! slice back: a call carrying other limits (first: a bucket that shrank is clamped, and a slice
//! must not keep more than it may hold), a settlement charged above its reservation in Redis
//! (first: its debt must meet the slice's unused part; one settled from the slice debits the
//! slice), and a grant in Redis that may leave the shared bucket below the retry reserve the
//! slice left there, on which its own check counts (after: a retry let into the reserve, or a
//! request keeping a smaller reserve, as across a reload of the pool's routes). What stays open:
//! a debt settled by *another* replica is not seen by this one's slice until it goes back (within
//! `max_age`), so while it lives the pool may admit up to that debt (output burndown above the reservation; the expected
//! part is exact: each replica's hold-back for its streams in flight is kept in the shared bucket
//! where Redis decides, or in its slice's unused part where the slice does); likewise another
//! replica's retry let into the reserve, until this slice goes back, may leave its first attempts
//! taking what the reserve keeps for retries (never capacity upstream lacks); and after slices
//! the shared level can trail the exact one, so a take from a bucket just short of full starts
//! refill at once where upstream's full bucket waits a transit: at most 100 ms of refill (0.17%
//! of a minute's tokens) per such take, which a decision in Redis may then grant. And Redis
//! learns that a route asks only when it takes a slice (it marks the route seen then, not at
//! each admission from it), so right after a reload that gives the pool's routes guarantees,
//! Redis may judge a route idle that asked from a slice within the last `max_age`, and lend its
//! guarantee.
//!
//! # Which requests
//!
//! A request is decided from a slice when its route share (every route of a pool carries one)
//! has nothing to weigh but the retry reserve: in a pool where no route has a guarantee, a
//! ceiling or another priority (those need every route's state: Redis decides them); the slice
//! is then taken leaving the retry reserve in the shared bucket, and marks the route seen. It
//! also needs a pool without a daily quota (a slice could not give the day's unused tokens back
//! exactly), and its tokens plus its hold-back, one request and one permit within `max_fraction`
//! of the pool's limits; any other request is a plain [`RedisLedger::reserve`]. So a pool whose
//! concurrency (or request limit) times `max_fraction` is below one keeps every decision in Redis:
//! concurrency stays exact where it binds.
//!
//! Such a request is admitted from the slice when what is left of it covers the request's tokens
//! **and its hold-back** ([`ReserveRequest::hold_back`]: the burndown excess this replica's
//! streams in flight are expected to be charged, non-zero for every burndown model under load).
//! The exact bucket holds at least the slice's unused part and the retry reserve left beside it,
//! so this never admits what the exact bucket would refuse, retries included (the slice leaves
//! the reserve whole, so a retry it covers is one the exact bucket admits without the reserve).
//! The hold-back stays in the slice, where the debts it is kept for are settled. When the slice
//! does not cover it, a first attempt gives the slice back and takes the next in one call, which
//! checks its tokens, the retry reserve and its hold-back exactly as an admission in Redis does;
//! a retry is decided in Redis (which may let it into the retry reserve: the recovery buckets are
//! Redis's).
//!
//! # Sizing
//!
//! A slice holds about twice the pool's demand on this replica (tokens and requests asked, and
//! how much the hold-back grew, which the slice must cover as it covers requests) over the last
//! `horizon`, plus the asking request's hold-back, and twice the most requests it had in flight at
//! once since the last slice; at least what the asking request needs (its tokens and hold-back),
//! at most `max_fraction` of each limit (and never more than the bucket holds: Redis takes what
//! there is up to the size asked). A slice is given back: when the next request does not fit it
//! (with the next one taken in the same call), at once when a request uses it up (so an empty
//! slice never holds the bucket's top down), when it has not admitted for `horizon` or is
//! `max_age` old (a background sweep), when a call's limits differ from the ones it was taken
//! with, before a debt is settled in Redis and after a grant there that may dip into the retry
//! reserve (above), and at shutdown ([`Ledger::close`]). A `horizon` of zero makes every slice exactly the request that asks (its
//! hold-back checked, not taken): the shared state then moves exactly as with plain reservations
//! (the differential test holds it to that).
//!
//! # Failure semantics
//!
//! - **Redis fails a slice call**: the error goes to the caller (admission answers it by
//!   `on_error`, as for any ledger error). A slice that was being given back is forgotten here: it
//!   expires in Redis like a dead replica's leases, its tokens charged in full and its permits back
//!   at expiry; its reservations still in flight settle in Redis, where settling an unknown lease
//!   debits only a charge above its reservation (see [`super::redis`]).
//! - **A replica dies**: its slice expires with its leases (`ledger.lease_secs`): tokens stay
//!   charged, permits come back.
//! - **Settling while the slice is given back**: waits for that call (one per pool at a time), so
//!   the reservation is a lease in Redis by the time it is settled there.
//! - **A caller that goes away mid-decision** (a client that hung up while its request waited for
//!   a slice): every slice call runs to its end in a task of its own, holding the pool's turn, so
//!   Redis and this replica never disagree about a slice; a reservation admitted for a caller
//!   that is gone is settled uncharged.
//! - **Rolling deploys**: no new key layout (a slice is leases in the same set, plus two fields of
//!   the pool's hash), but a build without slices does not lower the bucket's top for them: turn
//!   `local_leases` on once every replica runs a build that has it.

mod slice;

use std::{
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use dashmap::DashMap;
use tokio::{task::AbortHandle, time::Instant};

use super::{
    BudgetRequest, BudgetVerdict, BudgetWindow, Issuer, Ledger, LedgerError, LedgerMode,
    LedgerStats, Limits, Origin, PoolSnapshot, RedisLedger, Rejection, Reservation, ReserveRequest,
    ShareRequest, Verdict, WindowSnapshot,
    scripts::{SliceBack, SliceReply, SliceTake},
};
use slice::{Local, Slice, hold, keep, lock, part};

/// How slices are sized and how long they live (`[ledger.local_leases]`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeaseOptions {
    /// A slice holds about twice the demand of the last `horizon`; a slice that admitted nothing
    /// for this long is given back. Zero: every slice is exactly the request that asks.
    pub horizon: Duration,
    /// The largest part of each of a pool's limits one slice holds, in (0, 1].
    pub max_fraction: f64,
    /// A slice is given back at the latest this long after it was taken.
    pub max_age: Duration,
}

/// The Redis ledger with local capacity slices in front of it.
#[derive(Debug)]
pub struct LeasedLedger {
    inner: Arc<Inner>,
    sweeper: AbortHandle,
}

#[derive(Debug)]
struct Inner {
    shared: RedisLedger,
    options: LeaseOptions,
    pools: DashMap<Arc<str>, Arc<PoolSlices>>,
    from_slices: AtomicU64,
    slice_calls: AtomicU64,
}

/// How this replica's decisions were made: from a slice in memory, or with a round trip.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseCounts {
    /// Requests admitted from a slice (including the one each new slice was taken for).
    pub from_slices: u64,
    /// Calls to `lua/slice.lua`: slices taken and given back (one call may do both).
    pub slice_calls: u64,
}

/// One pool's slice on this replica.
#[derive(Debug)]
struct PoolSlices {
    /// Shared by every reservation admitted from the pool's slices: how settle knows them.
    issuer: Arc<Issuer>,
    /// Held across every slice call of the pool (one at a time), and by whoever must see the
    /// slice and Redis agree: a snapshot, a settlement whose slice is being given back.
    exchange: Arc<tokio::sync::Mutex<()>>,
    local: Mutex<Local>,
}

impl PoolSlices {
    /// A reservation admitted from the pool's slice for `request`.
    fn reservation(&self, request: &ReserveRequest<'_>, id: u64) -> Reservation {
        Reservation::new(self.issuer.clone(), request.tokens, id).with_share(hold(request))
    }
}

// === impl LeasedLedger ===

impl LeasedLedger {
    /// `shared` with slices sized by `options`; starts the sweep that gives idle slices back.
    pub fn new(shared: RedisLedger, options: LeaseOptions) -> LeasedLedger {
        let inner = Arc::new(Inner {
            shared,
            options,
            pools: DashMap::new(),
            from_slices: AtomicU64::new(0),
            slice_calls: AtomicU64::new(0),
        });
        let sweeper = tokio::spawn(sweep(Arc::downgrade(&inner))).abort_handle();
        LeasedLedger { inner, sweeper }
    }

    pub fn shared(&self) -> &RedisLedger {
        &self.inner.shared
    }

    pub fn counts(&self) -> LeaseCounts {
        LeaseCounts {
            from_slices: self.inner.from_slices.load(Ordering::Relaxed),
            slice_calls: self.inner.slice_calls.load(Ordering::Relaxed),
        }
    }

    /// Slices this replica holds now.
    pub fn live_slices(&self) -> usize {
        self.inner
            .pools
            .iter()
            .filter(|p| lock(&p.local).slice.is_some())
            .count()
    }

    /// Gives every slice back now (the sweep does this for idle ones; shutdown for all).
    pub async fn give_back_all(&self) {
        for pool in self.inner.pool_list() {
            self.inner.give_back_if(&pool, |l| l.slice.is_some()).await;
        }
    }
}

impl Drop for LeasedLedger {
    fn drop(&mut self) {
        self.sweeper.abort();
    }
}

/// Every `horizon / 2` (10 ms to 1 s), gives back the slices idle for `horizon` or `max_age` old.
async fn sweep(inner: Weak<Inner>) {
    let Some(options) = inner.upgrade().map(|i| i.options) else {
        return;
    };
    let every = (options.horizon / 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
    loop {
        tokio::time::sleep(every).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        for pool in inner.pool_list() {
            if !lock(&pool.local).stale(&options, Instant::now()) {
                continue;
            }
            let _turn = pool.exchange.lock().await;
            if lock(&pool.local).stale(&options, Instant::now()) {
                inner.give_back(&pool).await;
            }
        }
    }
}

/// A route share a slice can decide: no route with a guarantee, a ceiling or another priority
/// (nothing to weigh but the retry reserve it leaves in the shared bucket; a retry that the slice
/// does not cover is decided in Redis, which may let it into that reserve).
fn plain_share(share: &ShareRequest) -> bool {
    let priority = share.caller().priority;
    share.routes.iter().all(|r| {
        r.min_share == 0.0
            && r.max_share.is_none()
            && (r.priority == priority || share.priority_margin == 0.0)
    })
}

/// An SDK retry (attempt > 1) of a route share.
fn retry(request: &ReserveRequest<'_>) -> bool {
    request.share.is_some_and(|s| s.retry)
}

// === impl Inner ===

impl Inner {
    /// Whether `request` may be decided from a slice (see the module docs).
    fn sliceable(&self, request: &ReserveRequest<'_>) -> bool {
        let limits = &request.limits;
        let f = self.options.max_fraction;
        request.share.is_none_or(plain_share)
            && limits.tokens_per_day.is_none()
            && request.tokens.saturating_add(request.hold_back) <= part(limits.tokens_per_minute, f)
            && part(u64::from(limits.max_concurrency), f) >= 1
            && limits.requests_per_minute.is_none_or(|r| part(r, f) >= 1)
    }

    fn pool(&self, name: &str) -> Arc<PoolSlices> {
        if let Some(pool) = self.pools.get(name) {
            return pool.clone();
        }
        let key: Arc<str> = Arc::from(name);
        self.pools
            .entry(key.clone())
            .or_insert_with(|| {
                Arc::new(PoolSlices {
                    issuer: Arc::new(Issuer {
                        pool: key,
                        origin: Origin::Shared,
                        stats: self.shared.stats_handle(),
                    }),
                    exchange: Arc::new(tokio::sync::Mutex::new(())),
                    local: Mutex::new(Local::default()),
                })
            })
            .clone()
    }

    fn pool_list(&self) -> Vec<Arc<PoolSlices>> {
        self.pools.iter().map(|p| p.value().clone()).collect()
    }

    /// The slow path, run to its end even if the caller goes away (a client that hung up): gives
    /// the pool's slice back and takes the next one for a request of `tokens` with `hold_back`
    /// under `limits`, in one round trip, holding the pool's turn (another caller may have taken
    /// one meanwhile). A grant is [`Pending`] until the caller takes it.
    async fn exchange(
        self: Arc<Self>,
        pool: Arc<PoolSlices>,
        ask: Ask,
    ) -> Result<Exchanged, LedgerError> {
        let _turn = pool.exchange.clone().lock_owned().await;
        let request = ReserveRequest {
            pool: &pool.issuer.pool,
            limits: ask.limits,
            tokens: ask.tokens,
            share: ask.share.as_ref(),
            hold_back: ask.hold_back,
        };
        let (limits, tokens) = (ask.limits, ask.tokens);
        let now = Instant::now();
        let next = {
            let mut local = lock(&pool.local);
            match local.admit(&request, &self.options, now) {
                Some(admitted) => Err(admitted),
                None => {
                    let take = local
                        .demand
                        .size(rand::random(), &request, &self.options, now);
                    Ok((local.slice.take(), take))
                }
            }
        };
        let (back, take) = match next {
            Ok(next) => next,
            // Another caller took a slice meanwhile, and this request fits it.
            Err((id, exhausted)) => return Ok(self.granted(&pool, &request, id, exhausted).await),
        };
        let in_flight = back.as_ref().map(Slice::in_flight).unwrap_or_default();
        let back = back.as_ref().map(|s| s.back(&in_flight));
        let reply = self
            .slice_call(&pool, &limits, back.as_ref(), Some(&take))
            .await?;
        match reply {
            SliceReply::Granted {
                tokens: held,
                requests,
                permits,
                ..
            } => {
                let mut slice = Slice::new(&take, limits, (held, requests, permits), now);
                let id = slice.admit(tokens, now);
                let exhausted = slice.exhausted();
                lock(&pool.local).slice = Some(slice);
                Ok(self.granted(&pool, &request, id, exhausted).await)
            }
            SliceReply::Refused {
                limit,
                wait_ms,
                deficit,
                reserved,
                in_flight,
                held_for_others,
                ..
            } => Ok(Exchanged::Refused(Rejection {
                limit,
                refill_wait: wait_ms.map(Duration::from_millis),
                token_deficit: deficit,
                in_flight_tokens: reserved,
                in_flight_requests: in_flight,
                held_for_others,
            })),
            SliceReply::Returned { .. } => Err(LedgerError {
                backend: self.shared.backend(),
                message: format!(
                    "slice for pool {:?}: given back but none taken",
                    pool.issuer.pool
                ),
            }),
        }
    }

    /// The reservation admitted from the slice; a slice it used up is given back first (the
    /// caller holds the pool's turn).
    async fn granted(
        self: &Arc<Self>,
        pool: &PoolSlices,
        request: &ReserveRequest<'_>,
        id: u64,
        exhausted: bool,
    ) -> Exchanged {
        let pending = Pending::new(self, pool.reservation(request, id));
        if exhausted {
            self.give_back(pool).await;
        }
        self.from_slices.fetch_add(1, Ordering::Relaxed);
        Exchanged::Granted(pending)
    }

    /// One call to `lua/slice.lua`, counted.
    async fn slice_call(
        &self,
        pool: &PoolSlices,
        limits: &Limits,
        back: Option<&SliceBack<'_>>,
        take: Option<&SliceTake>,
    ) -> Result<SliceReply, LedgerError> {
        self.slice_calls.fetch_add(1, Ordering::Relaxed);
        self.shared
            .slice(&pool.issuer.pool, limits, back, take)
            .await
    }

    /// Gives the pool's slice back when `stale` says so, to the end even if the caller goes away:
    /// takes the pool's turn, then looks again.
    async fn give_back_if(
        self: &Arc<Self>,
        pool: &Arc<PoolSlices>,
        stale: impl Fn(&Local) -> bool + Send + 'static,
    ) {
        if !stale(&lock(&pool.local)) {
            return;
        }
        let (inner, pool) = (self.clone(), pool.clone());
        let _ = tokio::spawn(async move {
            let _turn = pool.exchange.clone().lock_owned().await;
            if stale(&lock(&pool.local)) {
                inner.give_back(&pool).await;
            }
        })
        .await;
    }

    /// Gives the pool's slice back, if it has one; the caller holds the pool's turn. A failure is
    /// absorbed: the slice expires in Redis.
    async fn give_back(&self, pool: &PoolSlices) {
        let Some(slice) = lock(&pool.local).slice.take() else {
            return;
        };
        let in_flight = slice.in_flight();
        let back = slice.back(&in_flight);
        if let Err(e) = self
            .slice_call(pool, slice.limits(), Some(&back), None)
            .await
        {
            self.shared.stats().count_absorbed_error();
            tracing::warn!(error = %e, "a capacity slice was not given back: it expires with its lease, charged in full");
        }
    }

    /// [`Ledger::settle`]: in the live slice if it is one of its reservations, else in Redis.
    async fn settle(
        self: &Arc<Self>,
        reservation: Reservation,
        charged: u64,
    ) -> Result<(), LedgerError> {
        let Some(pool) = self.pools.get(reservation.pool()).map(|p| p.clone()) else {
            return self.shared.settle(reservation, charged).await;
        };
        let from_slice = Arc::ptr_eq(&pool.issuer, &reservation.issuer);
        if from_slice && lock(&pool.local).settle(reservation.id(), charged) {
            let _ = reservation.disarm();
            return Ok(());
        }
        let debt = charged > reservation.tokens();
        if !from_slice && !debt {
            return self.shared.settle(reservation, charged).await;
        }
        // A reservation of a slice given back (or being given back now) is a lease in Redis by
        // the time the turn comes. A charge above the reservation puts the shared bucket in debt,
        // which the pool's live slice must meet: it goes back first.
        let inner = self.clone();
        tokio::spawn(async move {
            let _turn = pool.exchange.clone().lock_owned().await;
            if debt {
                inner.give_back(&pool).await;
            }
            inner.shared.settle(reservation, charged).await
        })
        .await
        .map_err(|e| self.lost(&e))?
    }

    /// A plain reservation in Redis, after giving back a slice taken under other limits (the
    /// bucket may have shrunk under it). A grant that may leave the shared bucket below the retry
    /// reserve the slice left there, on which the slice's own check counts (a retry Redis let into
    /// the reserve, or a request that keeps a smaller one, as across a reload of the pool's
    /// routes), gives the slice back after (the next one is taken leaving the reserve).
    async fn in_redis(
        self: &Arc<Self>,
        request: &ReserveRequest<'_>,
    ) -> Result<Verdict, LedgerError> {
        let limits = request.limits;
        let pool = self.pools.get(request.pool).map(|p| p.clone());
        if let Some(pool) = &pool {
            self.give_back_if(pool, move |l| {
                l.slice.as_ref().is_some_and(|s| *s.limits() != limits)
            })
            .await;
        }
        let verdict = self.shared.reserve(request).await?;
        if let (Some(pool), Verdict::Granted(r)) = (&pool, &verdict) {
            let recovered = r.share().is_some_and(|s| s.recovered);
            let keeps = keep(request);
            self.give_back_if(pool, move |l| {
                l.slice
                    .as_ref()
                    .is_some_and(|s| recovered || s.keep() > keeps)
            })
            .await;
        }
        Ok(verdict)
    }

    fn lost(&self, e: &tokio::task::JoinError) -> LedgerError {
        LedgerError {
            backend: self.shared.backend(),
            message: format!("a slice call did not finish: {e}"),
        }
    }
}

/// What the slow path asks for: a [`ReserveRequest`] that outlives its caller.
struct Ask {
    limits: Limits,
    tokens: u64,
    share: Option<ShareRequest>,
    hold_back: u64,
}

/// The slow path's answer.
enum Exchanged {
    Granted(Pending),
    Refused(Rejection),
}

/// A reservation admitted from a slice and not yet in the caller's hands: if the caller went
/// away meanwhile (a client that hung up), it is settled uncharged.
struct Pending {
    inner: Arc<Inner>,
    reservation: Option<Reservation>,
}

impl Pending {
    fn new(inner: &Arc<Inner>, reservation: Reservation) -> Pending {
        Pending {
            inner: inner.clone(),
            reservation: Some(reservation),
        }
    }

    fn into_verdict(mut self) -> Result<Verdict, LedgerError> {
        match self.reservation.take() {
            Some(r) => Ok(Verdict::Granted(r)),
            None => Err(LedgerError {
                backend: self.inner.shared.backend(),
                message: "a reservation admitted from a slice went missing".into(),
            }),
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(reservation) = self.reservation.take() {
            let inner = self.inner.clone();
            tokio::spawn(async move {
                if let Err(e) = inner.settle(reservation, 0).await {
                    tracing::warn!(error = %e, "a reservation nobody took was not settled");
                }
            });
        }
    }
}

// === impl Ledger for LeasedLedger ===

#[async_trait]
impl Ledger for LeasedLedger {
    async fn reserve(&self, request: &ReserveRequest<'_>) -> Result<Verdict, LedgerError> {
        let inner = &self.inner;
        if !inner.sliceable(request) {
            return inner.in_redis(request).await;
        }
        let pool = inner.pool(request.pool);
        let now = Instant::now();
        let admitted = {
            let mut local = lock(&pool.local);
            let in_flight = local.slice.as_ref().map_or(0, Slice::admitted);
            local.demand.note(request, in_flight, now);
            local.admit(request, &inner.options, now)
        };
        let Some((id, exhausted)) = admitted else {
            if retry(request) {
                return inner.in_redis(request).await;
            }
            let ask = Ask {
                limits: request.limits,
                tokens: request.tokens,
                share: request.share.cloned(),
                hold_back: request.hold_back,
            };
            let exchange = inner.clone().exchange(pool, ask);
            return match tokio::spawn(exchange).await.map_err(|e| inner.lost(&e))?? {
                Exchanged::Granted(pending) => pending.into_verdict(),
                Exchanged::Refused(rejection) => Ok(Verdict::Refused(rejection)),
            };
        };
        inner.from_slices.fetch_add(1, Ordering::Relaxed);
        let pending = Pending::new(inner, pool.reservation(request, id));
        if exhausted {
            inner
                .give_back_if(&pool, |l| l.slice.as_ref().is_some_and(Slice::exhausted))
                .await;
        }
        pending.into_verdict()
    }

    async fn settle(
        &self,
        reservation: Reservation,
        charged_tokens: u64,
    ) -> Result<(), LedgerError> {
        self.inner.settle(reservation, charged_tokens).await
    }

    async fn snapshot(&self, pool: &str, limits: &Limits) -> Result<PoolSnapshot, LedgerError> {
        let inner = &self.inner;
        let Some(slices) = inner.pools.get(pool).map(|p| p.clone()) else {
            return inner.shared.snapshot(pool, limits).await;
        };
        let other = *limits;
        inner
            .give_back_if(&slices, move |l| {
                l.slice.as_ref().is_some_and(|s| *s.limits() != other)
            })
            .await;
        let _turn = slices.exchange.lock().await;
        let mut snapshot = inner.shared.snapshot(pool, limits).await?;
        if let Some(slice) = &lock(&slices.local).slice {
            slice.add_to(&mut snapshot);
        }
        Ok(snapshot)
    }

    async fn take_budget(&self, request: &BudgetRequest<'_>) -> Result<BudgetVerdict, LedgerError> {
        self.inner.shared.take_budget(request).await
    }

    async fn settle_budget(
        &self,
        request: &BudgetRequest<'_>,
        origin: Origin,
        charged: u64,
    ) -> Result<(), LedgerError> {
        self.inner
            .shared
            .settle_budget(request, origin, charged)
            .await
    }

    async fn budget_snapshot(
        &self,
        scope: &str,
        windows: &[BudgetWindow],
    ) -> Result<Vec<WindowSnapshot>, LedgerError> {
        self.inner.shared.budget_snapshot(scope, windows).await
    }

    fn backend(&self) -> &'static str {
        self.inner.shared.backend()
    }

    fn stats(&self) -> &LedgerStats {
        self.inner.shared.stats()
    }

    fn mode(&self) -> LedgerMode {
        self.inner.shared.mode()
    }

    async fn close(&self) {
        self.give_back_all().await;
    }
}
