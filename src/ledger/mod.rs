//! The quota ledger: where reservations are taken and settled.
//!
//! [`Ledger`] is the seam between admission (which decides *what* to ask for) and storage (which
//! holds the shared state and answers atomically). A backend checks every limit of a pool (the
//! token bucket, the request bucket, the concurrency semaphore, the caller's route share) and
//! takes all of them or none: [`Ledger::reserve`] answers a [`Verdict`], `Granted` with a
//! [`Reservation`] or `Refused` with a [`Rejection`] that says which limit bound and when refill
//! would make room. Budgets outside any pool (the account's daily quota, a route's budgets) are
//! taken in a call of their own ([`Ledger::take_budget`], [`budget`]). The memory backend
//! ([`memory`]) serves one process; the Redis backend ([`redis`], its Lua in `lua/` and the
//! scripts' wire in `scripts.rs`; one node or a Redis Cluster, [`connection`]) shares one quota
//! between replicas behind the same trait, [`lease`] lets a replica admit from a slice of it in
//! memory, and [`fallback`] puts a local share behind either for when Redis is unreachable.
//!
//! Limits travel with each call instead of living in the backend: admission owns the effective
//! limits (headroom, upstream-throttle feedback, config reloads), and every replica sharing a
//! Redis ledger applies its own current view.
//!
//! # One arithmetic, two backends
//!
//! The bucket arithmetic ([`bucket`]) and the route-share rules ([`shares`]) are written in Rust
//! for the memory backend and in Lua for Redis. What ties them together is not comments: the
//! constants both use are defined once ([`units`]) and formatted into the scripts; the scripts
//! answer typed JSON replies; the contract suite (`tests/it/ledger_contract.rs`) runs every case
//! on both backends; and a differential property test (`tests/it/ledger_differential.rs`) drives
//! both through the same random operations at the same instants and requires the same answers,
//! exactly. The memory backend counts in nanoseconds and Redis in milliseconds: at
//! whole milliseconds their levels agree, and both report waits in whole milliseconds, rounded
//! up.
//!
//! # Settlement and counters
//!
//! A [`Reservation`] is `#[must_use]` and must be handed back to [`Ledger::settle`] of the ledger
//! that issued it ([`Reservation::origin`]) exactly once. Dropping one unsettled is a bug: it is
//! logged and counted in the issuing ledger's [`LedgerStats`] ([`Ledger::stats`]), which tests
//! assert stays zero. (The admission layer wraps reservations in a guard that always settles.)
//! Each ledger instance keeps its own stats (unsettled drops, settlements in flight, errors it
//! absorbed, fallbacks); nothing here is process-wide, and the ledger knows nothing of
//! Prometheus: `/metrics` publishes the stats when it is scraped.

pub mod bucket;
pub mod budget;
pub mod clock;
pub mod connection;
pub mod fallback;
pub mod lease;
pub mod memory;
pub mod redis;
mod scripts;
pub mod shares;
pub mod stats;
pub mod units;
pub mod window;

use std::{fmt, sync::Arc, time::Duration};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

pub use budget::{BudgetRefusal, BudgetRequest, BudgetWindow, WindowSnapshot};
pub use clock::Clock;
pub use fallback::{FallbackLedger, SharedLedger};
pub use lease::{LeaseCounts, LeaseOptions, LeasedLedger};
pub use memory::MemoryLedger;
pub use redis::{RedisLedger, RedisOptions};
pub use shares::{RouteShare, ShareHold, ShareRequest};
pub use stats::LedgerStats;

/// The limits of one pool, as admission currently applies them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Token bucket capacity (and refill per minute), after headroom and feedback.
    pub tokens_per_minute: u64,
    pub requests_per_minute: Option<u64>,
    pub max_concurrency: u32,
    /// The pool's daily quota: a bucket refilling continuously over 24 hours ([`window`]),
    /// checked and taken in the same atomic step as the rest.
    pub tokens_per_day: Option<u64>,
}

/// One request's demand on one pool.
#[derive(Debug, Clone, Copy)]
pub struct ReserveRequest<'a> {
    pub pool: &'a str,
    pub limits: Limits,
    /// Tokens to reserve: `input + maxTokens`, as Bedrock deducts at request start.
    pub tokens: u64,
    /// The calling route and the shares of every route in the pool; `None` checks the pool's
    /// limits alone.
    pub share: Option<&'a ShareRequest>,
    /// Tokens the bucket must hold beyond this request: charges admission expects but has not
    /// settled yet (the burndown excess of streams in flight, which upstream deducts when they
    /// end, a moment before their usage reaches the proxy).
    pub hold_back: u64,
}

/// Which limit turned a request away.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Limit {
    Tokens,
    Requests,
    Concurrency,
    /// The calling route's `max_share` of the pool.
    Share,
    /// A daily quota: the pool's (`tokens_per_day`) or the account's
    /// (`admission.account_tokens_per_day`).
    #[serde(rename = "daily_quota")]
    DailyQuota,
    /// The calling route's `budgets` (never answered by a pool's reservation).
    Budget,
    /// The calling route's `max_concurrency` (a concurrency-only "pool" of the route's own).
    #[serde(rename = "route_concurrency")]
    RouteConcurrency,
}

impl Limit {
    /// The `x-tokengate-reason` value and metrics label.
    pub fn label(self) -> &'static str {
        match self {
            Limit::Tokens => "tokens",
            Limit::Requests => "requests",
            Limit::Concurrency => "concurrency",
            Limit::Share => "share",
            Limit::DailyQuota => "daily_quota",
            Limit::Budget => "budget",
            Limit::RouteConcurrency => "route_concurrency",
        }
    }
}

/// Why a request does not fit now, with what the ledger knows about when it might.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// The binding limit: the one with the longest projected wait.
    pub limit: Limit,
    /// Time until refill alone makes room (zero for concurrency, which does not refill).
    /// `None` when refill alone never will (the demand exceeds the current capacity).
    pub refill_wait: Option<Duration>,
    /// Tokens missing right now.
    pub token_deficit: u64,
    /// Tokens reserved by requests in flight, which settlement will partly return.
    pub in_flight_tokens: u64,
    pub in_flight_requests: u32,
    /// The bucket held the request's own tokens, but not what a borrowing route must leave for
    /// other routes' guarantees: those routes' requests may still fit.
    pub held_for_others: bool,
}

/// The ledger's answer to [`Ledger::reserve`].
#[derive(Debug)]
pub enum Verdict {
    /// Everything was taken: settle the reservation exactly once.
    Granted(Reservation),
    /// Nothing was taken.
    Refused(Rejection),
}

/// The ledger's answer to [`Ledger::take_budget`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BudgetVerdict {
    /// Taken from every window, by the ledger named: settle it there ([`Ledger::settle_budget`]).
    Taken(Origin),
    /// Nothing was taken.
    Refused(BudgetRefusal),
}

/// Which ledger issued a reservation, and so must settle it: a [`FallbackLedger`] holds both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// This process's memory (the memory backend, or a fallback's local share).
    Local,
    /// The shared (Redis) ledger.
    Shared,
}

/// Who issued a reservation: the pool it was taken in, the ledger that must settle it, and
/// that ledger's stats (where an unsettled drop is counted). One per pool in the memory backend,
/// shared by every reservation of the pool.
#[derive(Debug)]
pub(crate) struct Issuer {
    pub pool: Arc<str>,
    pub origin: Origin,
    pub stats: Arc<LedgerStats>,
}

/// Tokens, a request and a concurrency permit held in one pool until settled.
#[must_use = "a reservation must be settled with Ledger::settle"]
pub struct Reservation {
    issuer: Arc<Issuer>,
    tokens: u64,
    id: u64,
    share: Option<ShareHold>,
    settled: bool,
}

impl Reservation {
    pub(crate) fn new(issuer: Arc<Issuer>, tokens: u64, id: u64) -> Self {
        Reservation {
            issuer,
            tokens,
            id,
            share: None,
            settled: false,
        }
    }

    /// Records what the reservation took from its route's share buckets.
    pub(crate) fn with_share(mut self, share: Option<ShareHold>) -> Self {
        self.share = share;
        self
    }

    /// What it took from its route's share buckets, if it was taken for a route.
    pub fn share(&self) -> Option<&ShareHold> {
        self.share.as_ref()
    }

    /// The ledger that issued it: a reservation is settled where it was taken.
    pub fn origin(&self) -> Origin {
        self.issuer.origin
    }

    pub fn pool(&self) -> &str {
        &self.issuer.pool
    }

    /// Tokens reserved.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Unique within the backend (a lease id for shared backends).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Marks the reservation settled (backends call this inside `settle`): its tokens, id and
    /// route hold.
    pub(crate) fn disarm(mut self) -> (u64, u64, Option<ShareHold>) {
        self.settled = true;
        (self.tokens, self.id, self.share.take())
    }
}

impl fmt::Debug for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reservation")
            .field("pool", &self.issuer.pool)
            .field("tokens", &self.tokens)
            .field("id", &self.id)
            .field("origin", &self.issuer.origin)
            .field("share", &self.share)
            .finish()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.settled {
            self.issuer.stats.count_unsettled_drop();
            tracing::error!(pool = %self.issuer.pool, tokens = self.tokens, id = self.id, "reservation dropped without settlement");
        }
    }
}

/// A pool's live state (also the Redis snapshot script's reply, field for field).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolSnapshot {
    /// Tokens in the bucket now; negative while repaying a burndown charge.
    pub tokens_available: i64,
    pub tokens_capacity: u64,
    pub reserved_tokens: u64,
    pub in_flight_requests: u32,
    pub requests_available: Option<u64>,
    /// The daily bucket, when the pool has one: tokens left (negative while repaying a
    /// burndown debt), its capacity, and milliseconds until it is full again.
    pub day_tokens_available: Option<i64>,
    pub day_tokens_capacity: Option<u64>,
    pub day_full_in_ms: Option<u64>,
}

/// The ledger backend failed (unreachable, timed out, answered nonsense).
#[derive(Debug, Clone, thiserror::Error)]
#[error("ledger {backend}: {message}")]
pub struct LedgerError {
    pub backend: &'static str,
    pub message: String,
}

/// How a ledger is serving now: readiness and `tokengate_ledger_mode{mode}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LedgerMode {
    /// The in-process ledger of a single replica.
    Memory,
    /// The shared (Redis) ledger, answering.
    Shared,
    /// The shared ledger is unreachable; admitting from this replica's local share of each pool.
    LocalShare,
    /// The shared ledger is unreachable and there is no fallback: requests get 503.
    Unavailable,
}

impl LedgerMode {
    pub const ALL: [LedgerMode; 4] = [
        LedgerMode::Memory,
        LedgerMode::Shared,
        LedgerMode::LocalShare,
        LedgerMode::Unavailable,
    ];

    /// The `mode` label of `tokengate_ledger_mode`.
    pub fn label(self) -> &'static str {
        match self {
            LedgerMode::Memory => "memory",
            LedgerMode::Shared => "shared",
            LedgerMode::LocalShare => "local_share",
            LedgerMode::Unavailable => "unavailable",
        }
    }

    /// Whether a replica in this mode should receive traffic.
    pub fn ready(self) -> bool {
        self != LedgerMode::Unavailable
    }
}

/// Quota state, checked and updated atomically per request.
#[async_trait]
pub trait Ledger: Send + Sync + fmt::Debug + 'static {
    /// Takes `tokens` from the token bucket, one request from the request bucket (if limited)
    /// and one concurrency permit, all or nothing.
    async fn reserve(&self, request: &ReserveRequest<'_>) -> Result<Verdict, LedgerError>;

    /// Settles a reservation to the actual charge: credits back `reserved - charged` (or debits
    /// the excess), releases the permit. The request stays counted in the request bucket.
    async fn settle(
        &self,
        reservation: Reservation,
        charged_tokens: u64,
    ) -> Result<(), LedgerError>;

    /// The pool's state now, as seen with `limits`.
    async fn snapshot(&self, pool: &str, limits: &Limits) -> Result<PoolSnapshot, LedgerError>;

    /// Takes tokens from every window of a scope's budget, or none ([`budget`]): a call of its
    /// own, made before the pool's reservation.
    async fn take_budget(&self, request: &BudgetRequest<'_>) -> Result<BudgetVerdict, LedgerError>;

    /// Settles `request.tokens` taken from a budget by the ledger `origin` names to `charged`
    /// (zero gives them back, as when the pool refused).
    async fn settle_budget(
        &self,
        request: &BudgetRequest<'_>,
        origin: Origin,
        charged: u64,
    ) -> Result<(), LedgerError>;

    /// Each window of a scope's budget now, in the order given.
    async fn budget_snapshot(
        &self,
        scope: &str,
        windows: &[BudgetWindow],
    ) -> Result<Vec<WindowSnapshot>, LedgerError>;

    /// `memory`, `redis`, ...: for logs and metrics.
    fn backend(&self) -> &'static str;

    /// What this ledger counts about itself (shared by a fallback and the ledgers inside it).
    fn stats(&self) -> &LedgerStats;

    /// How the ledger is serving now (readiness follows it). A backend that cannot fail is
    /// always [`LedgerMode::Memory`].
    fn mode(&self) -> LedgerMode {
        LedgerMode::Memory
    }

    /// Gives back what this ledger holds for its own use (a replica's capacity slices,
    /// [`lease`]); shutdown calls it once every settlement is done. Nothing for other backends.
    async fn close(&self) {}
}

#[cfg(test)]
pub(crate) mod tests {
    use super::{Limits, ReserveRequest};

    /// Ten tokens in pool `p` of 1,000 tokens per minute and four permits: always admitted first.
    pub fn small_request() -> ReserveRequest<'static> {
        ReserveRequest {
            pool: "p",
            limits: Limits {
                tokens_per_minute: 1_000,
                requests_per_minute: None,
                max_concurrency: 4,
                tokens_per_day: None,
            },
            tokens: 10,
            share: None,
            hold_back: 0,
        }
    }
}
