//! The admission queue: hold a request that does not fit for a short while instead of bouncing it.
//!
//! A request that does not fit now, and whose projected wait is within the pool's `max_wait`,
//! waits here. One dispatcher task per pool admits waiters: it is woken by settlements (a
//! request finished and gave back its permit and unused tokens), by new arrivals, and by a timer
//! set to the moment the ledger projects the head will fit by refill. It never polls, so with a
//! shared ledger it makes one round trip per wake-up, not one per waiter per tick.
//!
//! # Order
//!
//! Higher priority first. Within a priority, routes take turns (round robin, one admission each),
//! and each route's waiters are first come, first served. While any request waits in a pool, new
//! arrivals queue behind it rather than taking the capacity freed for it.
//!
//! # Large requests at the head
//!
//! A head that needs more tokens than are free does not block the queue outright: up to
//! [`MAX_BYPASS`] smaller waiters behind it that fit now may go first (bounded bypass). After that
//! the head has aged enough that nothing passes it: the free tokens accumulate for it, so it is
//! admitted after at most `MAX_BYPASS` small admissions plus its own refill time. Small requests
//! are thus not blocked by one large one, and a large one is not starved by a stream of small ones.
//!
//! # Leaving the queue
//!
//! A waiter whose deadline passes, or whose client hangs up (its future is dropped), leaves the
//! queue holding nothing: if the dispatcher admitted it in the same instant, the reservation it
//! was handed is released uncharged. On shutdown every waiter is answered at once with a
//! retryable error.
//!
//! (Long: the queue's state, its order and its dispatcher hold one lock's invariants; the waiting
//! side is in `waiting.rs`, the tests in `queue_tests.rs`.)

use std::{
    cmp::Reverse,
    collections::{BTreeMap, HashMap, VecDeque},
    ops::{Deref, DerefMut},
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use serde::Serialize;
use tokio::{
    sync::{Notify, oneshot},
    time::Instant,
};

use crate::ledger::{Ledger, Limit, Reservation, ReserveRequest, ShareRequest, Verdict};

/// How many smaller waiters may pass a head that does not fit, before it blocks the queue.
pub const MAX_BYPASS: u32 = 4;
/// How many waiters behind the head are considered for a bypass.
const BYPASS_SCAN: usize = 32;
/// Retry delay after a ledger error.
const LEDGER_RETRY: Duration = Duration::from_millis(100);

/// Who is waiting, for ordering, and the route demand the ledger checks for it.
#[derive(Debug, Clone)]
pub struct WaiterClass {
    pub priority: i32,
    pub route: Arc<str>,
    pub demand: Option<ShareRequest>,
}

impl Default for WaiterClass {
    fn default() -> Self {
        WaiterClass {
            priority: 0,
            route: Arc::from("default"),
            demand: None,
        }
    }
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    tokens: u64,
    route: Arc<str>,
    demand: Option<ShareRequest>,
    enqueued: Instant,
    bypassed: u32,
    tx: oneshot::Sender<Reservation>,
}

/// What the dispatcher needs of the head waiter.
#[derive(Debug)]
struct Head {
    id: u64,
    tokens: u64,
    /// How many smaller waiters have passed it.
    bypassed: u32,
    demand: Option<ShareRequest>,
    route: Arc<str>,
}

/// Waiters of one priority: a FIFO per route, and the routes' turn order.
#[derive(Debug, Default)]
struct Level {
    turns: VecDeque<Arc<str>>,
    routes: HashMap<Arc<str>, VecDeque<Waiter>>,
}

#[derive(Debug, Default)]
struct State {
    levels: BTreeMap<Reverse<i32>, Level>,
    len: usize,
    queued_tokens: u64,
    next_id: u64,
}

impl State {
    /// Waiters in admission order: by priority, routes taking turns, FIFO within a route.
    fn in_order(&self) -> impl Iterator<Item = &Waiter> {
        self.levels.values().flat_map(|level| {
            let longest = level.routes.values().map(VecDeque::len).max().unwrap_or(0);
            (0..longest).flat_map(move |i| {
                level
                    .turns
                    .iter()
                    .filter_map(move |route| level.routes.get(route).and_then(|q| q.get(i)))
            })
        })
    }

    fn head(&self) -> Option<&Waiter> {
        self.in_order().next()
    }

    fn push(&mut self, class: &WaiterClass, waiter: Waiter) {
        let level = self.levels.entry(Reverse(class.priority)).or_default();
        let queue = level.routes.entry(class.route.clone()).or_default();
        if queue.is_empty() {
            level.turns.push_back(class.route.clone());
        }
        self.len += 1;
        self.queued_tokens += waiter.tokens;
        queue.push_back(waiter);
    }

    /// Removes waiter `id`. When the head of the route whose turn it is leaves, that route goes
    /// to the back of the turn order (round robin); other removals keep every route's turn.
    fn remove(&mut self, id: u64) -> Option<Waiter> {
        let (key, route, index) = self.levels.iter().find_map(|(key, level)| {
            level.routes.iter().find_map(|(route, q)| {
                q.iter()
                    .position(|w| w.id == id)
                    .map(|i| (*key, route.clone(), i))
            })
        })?;
        let level = self.levels.get_mut(&key)?;
        let queue = level.routes.get_mut(&route)?;
        let waiter = queue.remove(index)?;
        if queue.is_empty() {
            level.routes.remove(&route);
            level.turns.retain(|r| r != &route);
        } else if index == 0 && level.turns.front() == Some(&route) {
            level.turns.rotate_left(1);
        }
        if level.routes.is_empty() {
            self.levels.remove(&key);
        }
        self.len -= 1;
        self.queued_tokens -= waiter.tokens;
        Some(waiter)
    }

    /// Drops waiters whose callers are gone.
    fn prune(&mut self) -> usize {
        let gone: Vec<u64> = self
            .in_order()
            .filter(|w| w.tx.is_closed())
            .map(|w| w.id)
            .collect();
        for id in &gone {
            self.remove(*id);
        }
        gone.len()
    }
}

/// What the queue looks like now, for `/v1/pools`.
#[derive(Debug, Clone, Serialize)]
pub struct QueueView {
    pub depth: usize,
    pub queued_tokens: u64,
    pub oldest_wait_secs: f64,
    pub max_wait_ms: u64,
    pub max_queue: usize,
}

/// Outcomes of queued requests: the `outcome` label of `tokengate_queue_outcomes_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueOutcome {
    Admitted,
    TimedOut,
    Cancelled,
    Shutdown,
}

impl QueueOutcome {
    pub fn label(self) -> &'static str {
        match self {
            QueueOutcome::Admitted => "admitted",
            QueueOutcome::TimedOut => "timed_out",
            QueueOutcome::Cancelled => "cancelled",
            QueueOutcome::Shutdown => "shutdown",
        }
    }
}

/// Why a queued request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitError {
    TimedOut,
    Shutdown,
}

/// One pool's admission queue.
#[derive(Debug)]
pub struct AdmissionQueue {
    state: Mutex<State>,
    /// `state`'s length and queued tokens, mirrored whenever the lock is released, so that
    /// admission can see an empty queue (the common case) without taking the lock.
    waiting: AtomicUsize,
    waiting_tokens: AtomicU64,
    /// Waiters whose caller left before an answer.
    cancelled: AtomicU64,
    wake: Notify,
    dispatcher_started: AtomicBool,
    closed: AtomicBool,
    /// The limit that last held the head back (for projections and rejection reasons).
    last_limit: Mutex<Option<Limit>>,
    pub max_wait: Duration,
    pub max_queue: usize,
}

impl AdmissionQueue {
    pub fn new(max_wait: Duration, max_queue: usize) -> AdmissionQueue {
        AdmissionQueue {
            state: Mutex::new(State::default()),
            waiting: AtomicUsize::new(0),
            waiting_tokens: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            wake: Notify::new(),
            dispatcher_started: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            last_limit: Mutex::new(None),
            max_wait,
            max_queue,
        }
    }

    fn lock(&self) -> StateGuard<'_> {
        StateGuard {
            state: self.state.lock().unwrap_or_else(|p| p.into_inner()),
            queue: self,
        }
    }

    pub fn enabled(&self) -> bool {
        !self.max_wait.is_zero()
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Requests waiting now.
    pub fn depth(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    pub fn is_empty(&self) -> bool {
        self.depth() == 0
    }

    /// Tokens the waiting requests ask for.
    pub fn queued_tokens(&self) -> u64 {
        self.waiting_tokens.load(Ordering::Acquire)
    }

    /// Waiters whose caller hung up before an answer, since start.
    pub fn cancelled(&self) -> u64 {
        self.cancelled.load(Ordering::Relaxed)
    }

    pub fn view(&self) -> QueueView {
        let state = self.lock();
        let oldest = state.in_order().map(|w| w.enqueued).min();
        QueueView {
            depth: state.len,
            queued_tokens: state.queued_tokens,
            oldest_wait_secs: oldest.map_or(0.0, |t| t.elapsed().as_secs_f64()),
            max_wait_ms: self.max_wait.as_millis() as u64,
            max_queue: self.max_queue,
        }
    }

    /// The limit that last held a request back here.
    pub fn last_limit(&self) -> Option<Limit> {
        *self.last_limit.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn set_last_limit(&self, limit: Limit) {
        *self.last_limit.lock().unwrap_or_else(|p| p.into_inner()) = Some(limit);
    }

    /// Something changed (an arrival, a departure, more capacity): let the dispatcher look again.
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// Capacity came back (a settlement): let the dispatcher look again if anyone waits. With
    /// nobody queued there is nothing to admit, and waking it would cost a task switch per
    /// call; a request queued after this check wakes the dispatcher itself, and its look sees
    /// the capacity already returned.
    pub fn capacity_returned(&self) {
        if !self.is_empty() {
            self.wake();
        }
    }

    /// Adds a waiter; `None` if the queue is full or closed.
    pub fn enqueue(
        self: &Arc<Self>,
        class: &WaiterClass,
        tokens: u64,
        ledger: Arc<dyn Ledger>,
    ) -> Option<Ticket> {
        if self.is_closed() {
            return None;
        }
        let (tx, rx) = oneshot::channel();
        let id = {
            let mut state = self.lock();
            if state.len >= self.max_queue {
                state.prune();
                if state.len >= self.max_queue {
                    return None;
                }
            }
            state.next_id += 1;
            let id = state.next_id;
            state.push(
                class,
                Waiter {
                    id,
                    tokens,
                    route: class.route.clone(),
                    demand: class.demand.clone(),
                    enqueued: Instant::now(),
                    bypassed: 0,
                    tx,
                },
            );
            id
        };
        self.wake();
        Some(Ticket {
            queue: self.clone(),
            ledger,
            id,
            rx: Some(rx),
            enqueued: Instant::now(),
            answered: false,
        })
    }

    /// Whether the dispatcher task has to be started (the first caller gets `true`).
    pub fn claim_dispatcher(&self) -> bool {
        !self.dispatcher_started.swap(true, Ordering::AcqRel)
    }

    /// Answers every waiter with [`WaitError::Shutdown`] and stops the dispatcher.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        let mut state = self.lock();
        *state = State::default();
        drop(state);
        self.wake();
    }

    /// The dispatcher: admits waiters as capacity appears. `reserve` asks the ledger for one
    /// waiter's tokens with the pool's current limits.
    pub async fn dispatch(
        self: Arc<Self>,
        ledger: Arc<dyn Ledger>,
        pool: Arc<str>,
        limits: impl Fn() -> (crate::ledger::Limits, u64),
    ) {
        while !self.is_closed() {
            let next = self.pump(ledger.as_ref(), &pool, &limits).await;
            match next {
                Some(at) => {
                    tokio::select! {
                        () = self.wake.notified() => {}
                        () = tokio::time::sleep_until(at) => {}
                    }
                }
                None => self.wake.notified().await,
            }
        }
    }

    /// The head waiter whose caller is still there.
    fn live_head(&self) -> Option<Head> {
        let mut state = self.lock();
        // Callers that left are removed by their tickets; only a head whose caller is gone (and
        // not yet removed) needs skipping here. No full scan per admission.
        while let Some(gone) = state.head().filter(|w| w.tx.is_closed()).map(|w| w.id) {
            state.remove(gone);
        }
        state.head().map(|w| Head {
            id: w.id,
            tokens: w.tokens,
            bypassed: w.bypassed,
            demand: w.demand.clone(),
            route: w.route.clone(),
        })
    }

    /// Admits from the head while it fits; returns when to look again by refill (`None`: only
    /// an event can help).
    async fn pump(
        &self,
        ledger: &dyn Ledger,
        pool: &str,
        limits: &impl Fn() -> (crate::ledger::Limits, u64),
    ) -> Option<Instant> {
        loop {
            let Head {
                id,
                tokens,
                bypassed,
                demand,
                route,
            } = self.live_head()?;
            let (limits, hold_back) = limits();
            match ledger
                .reserve(&ReserveRequest {
                    pool,
                    limits,
                    tokens,
                    share: demand.as_ref(),
                    hold_back,
                })
                .await
            {
                Ok(Verdict::Granted(reservation)) => self.deliver(id, reservation, ledger).await,
                Ok(Verdict::Refused(rejection)) => {
                    self.set_last_limit(rejection.limit);
                    let free = tokens.saturating_sub(rejection.token_deficit);
                    // A head held back by its own route (its ceiling, or what it must leave for
                    // other routes' guarantees) does not hold back the other routes: their
                    // waiters may pass it without limit. One held back by the pool's bucket lets
                    // at most MAX_BYPASS smaller waiters pass.
                    let other_route = |w: &Waiter| w.route != route;
                    let passed = match rejection.limit {
                        Limit::Share => {
                            self.bypass(id, &other_route, false, ledger, pool, (limits, hold_back))
                                .await
                        }
                        Limit::Tokens if rejection.held_for_others => {
                            self.bypass(id, &other_route, false, ledger, pool, (limits, hold_back))
                                .await
                        }
                        Limit::Tokens if bypassed < MAX_BYPASS => {
                            let smaller = |w: &Waiter| w.tokens <= free;
                            self.bypass(id, &smaller, true, ledger, pool, (limits, hold_back))
                                .await
                        }
                        _ => false,
                    };
                    if passed {
                        continue;
                    }
                    return match rejection.limit {
                        Limit::Concurrency => None,
                        Limit::Tokens
                        | Limit::Requests
                        | Limit::Share
                        | Limit::DailyQuota
                        | Limit::Budget
                        | Limit::RouteConcurrency => Some(
                            Instant::now()
                                + rejection
                                    .refill_wait
                                    .unwrap_or(Duration::from_secs(1))
                                    .max(Duration::from_millis(1)),
                        ),
                    };
                }
                Err(e) => {
                    tracing::warn!(pool, error = %e, "ledger unavailable to the admission queue");
                    return Some(Instant::now() + LEDGER_RETRY);
                }
            }
        }
    }

    /// Lets the first waiter behind the head that `eligible` accepts try to pass it (counted
    /// against the head's bypass allowance if `count`). Returns whether one did.
    async fn bypass(
        &self,
        head: u64,
        eligible: &(dyn Fn(&Waiter) -> bool + Sync),
        count: bool,
        ledger: &dyn Ledger,
        pool: &str,
        (limits, hold_back): (crate::ledger::Limits, u64),
    ) -> bool {
        let candidate = {
            let state = self.lock();
            state
                .in_order()
                .skip(1)
                .take(BYPASS_SCAN)
                .find(|w| eligible(w) && !w.tx.is_closed())
                .map(|w| (w.id, w.tokens, w.demand.clone()))
        };
        let Some((id, tokens, demand)) = candidate else {
            return false;
        };
        match ledger
            .reserve(&ReserveRequest {
                pool,
                limits,
                tokens,
                share: demand.as_ref(),
                hold_back,
            })
            .await
        {
            Ok(Verdict::Granted(reservation)) => {
                if count {
                    let mut state = self.lock();
                    for level in state.levels.values_mut() {
                        for w in level.routes.values_mut().flatten() {
                            if w.id == head {
                                w.bypassed += 1;
                            }
                        }
                    }
                }
                self.deliver(id, reservation, ledger).await;
                true
            }
            _ => false,
        }
    }

    /// Hands a reservation to waiter `id`; if it is gone, releases the reservation uncharged.
    async fn deliver(&self, id: u64, reservation: Reservation, ledger: &dyn Ledger) {
        let waiter = self.lock().remove(id);
        let unclaimed = match waiter {
            Some(w) => w.tx.send(reservation).err(),
            None => Some(reservation),
        };
        if let Some(r) = unclaimed
            && let Err(e) = ledger.settle(r, 0).await
        {
            tracing::error!(error = %e, "releasing an unclaimed queued reservation failed");
        }
    }
}

/// A place in the queue. Dropping it leaves the queue; a reservation handed over at that moment
/// is released, uncharged.
#[derive(Debug)]
pub struct Ticket {
    queue: Arc<AdmissionQueue>,
    ledger: Arc<dyn Ledger>,
    id: u64,
    rx: Option<oneshot::Receiver<Reservation>>,
    enqueued: Instant,
    /// Timed out or shut down: left with an answer, not cancelled.
    answered: bool,
}

impl Ticket {
    /// Waits until admitted, the deadline, or shutdown.
    pub async fn wait(mut self, deadline: Instant) -> Result<Reservation, WaitError> {
        let Some(rx) = self.rx.as_mut() else {
            return Err(WaitError::Shutdown);
        };
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(reservation)) => {
                self.rx = None;
                Ok(reservation)
            }
            Ok(Err(_)) => {
                self.answered = true;
                Err(WaitError::Shutdown)
            }
            Err(_) => {
                self.answered = true;
                Err(WaitError::TimedOut)
            }
        }
    }

    pub fn waited(&self) -> Duration {
        self.enqueued.elapsed()
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else { return };
        if !self.answered {
            self.queue.cancelled.fetch_add(1, Ordering::Relaxed);
        }
        self.queue.lock().remove(self.id);
        rx.close();
        if let Ok(reservation) = rx.try_recv() {
            // Admitted in the same instant the caller left: give it back.
            crate::admission::hold::release_unused(self.ledger.clone(), reservation);
        }
        self.queue.wake();
    }
}

/// The queue's state, locked; on unlock its length and queued tokens are mirrored into the
/// queue's atomics.
struct StateGuard<'a> {
    state: MutexGuard<'a, State>,
    queue: &'a AdmissionQueue,
}

impl Deref for StateGuard<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        &self.state
    }
}

impl DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.state
    }
}

impl Drop for StateGuard<'_> {
    fn drop(&mut self) {
        self.queue.waiting.store(self.state.len, Ordering::Release);
        self.queue
            .waiting_tokens
            .store(self.state.queued_tokens, Ordering::Release);
    }
}

#[cfg(test)]
#[path = "queue_tests.rs"]
mod tests;
