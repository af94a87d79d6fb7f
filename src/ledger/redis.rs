//! The shared ledger: one quota for every replica, kept in Redis (or Valkey).
//! (Over 500 lines: the trait's six calls and their Redis round trips sit side by side.)
//!
//! # Layout
//!
//! Each pool is two keys sharing the hash tag `{pool}`, so that one script touches one Cluster
//! slot: `tg:v1:{pool}:s`, a hash with the token bucket, the request bucket, the daily bucket
//! (`tokens_per_day`, see [`super::window`]) and the tokens held by live leases; and `tg:v1:{pool}:l`, a sorted set of leases, one per admitted request, scored by
//! expiry (its size is the number of requests in flight). The logic is server-side Lua
//! (`src/ledger/lua/`), one script per operation, each one round trip: `admit` (purge expired
//! leases, refill, check tokens, requests, concurrency and the caller's route share, take all or
//! nothing), `settle`, `renew`, `snapshot`, `slice` (a replica's capacity slice given back and
//! taken, [`super::lease`]); and `budget` for a scope's budget
//! (`tg:v1:{budget:SCOPE}:b`, its own hash tag: see [`super::budget`]). Scripts are called by SHA1 (`EVALSHA`; a Redis that
//! lost them gets them again on `NOSCRIPT`) and read the time from Redis `TIME`, never from a
//! replica. Each answers a JSON object decoded into a typed reply; how the scripts are built
//! (the shared constants formatted in from [`super::units`]), what each call sends and what it
//! answers is in `ledger/scripts.rs`.
//!
//! The arithmetic is [`super::bucket`]'s, exact in integers, at millisecond resolution: a level is
//! kept in token-milliminutes (Lua numbers are doubles, and token-nanominutes would pass 2^53),
//! so refill over any split of time is exact; waits are rounded up to the millisecond (as the
//! memory backend reports them too). Limits above [`MAX_TOKENS_PER_MINUTE`] are refused rather
//! than computed inexactly.
//!
//! # Leases
//!
//! Every reservation is a lease that expires `lease` after it was taken or last renewed. This
//! ledger renews the leases it holds every `lease / 3` from a background task, so a live replica
//! keeps its reservations however long a generation runs, and a dead one stops renewing. Every
//! script first purges expired leases: their permits come back, their tokens stay **charged in
//! full** (no refund). The request a lease stood for may have run to the end upstream, which
//! deducted `input + maxTokens` at its start; refunding a reservation nobody settled could admit
//! what upstream then throttles, while keeping it only delays capacity that refill returns within
//! a minute anyway.
//!
//! # Failure semantics
//!
//! - **Redis unreachable, slow or failing.** Each call is bounded by `timeout` (`ledger.timeout_ms`)
//!   and fails with a [`LedgerError`] that says which operation and pool. The ledger then reports
//!   [`LedgerMode::Unavailable`] (readiness goes false) until a call, or the background `PING`
//!   sent every second while unhealthy, succeeds. Used alone (`on_error = "fail-closed"`),
//!   admission answers 503 `ServiceUnavailableException` with a retry hint: admitting without the
//!   shared state would break the promise that upstream never throttles. With
//!   `on_error = "local"` see [`super::fallback`].
//! - **A reserve that timed out may still have run** (the command was sent). Its lease is known to
//!   no replica, so nobody renews it: it holds its capacity until it expires (under-admission,
//!   never over). The same holds for a reserve abandoned mid-flight by a client that hung up.
//! - **A settle that fails** stops renewing its lease: the permit returns at expiry, the tokens
//!   stay charged in full.
//! - **A replica that dies** (crash, `SIGKILL`, lost node) stops renewing: all its leases expire
//!   within `lease` of its last renewal, and the next call on each pool reclaims them.
//! - **Bound on overshoot.** A live lease never over-admits. Once a lease has expired, upstream
//!   can receive more than the limits only from requests still running upstream after their
//!   replica stopped renewing: concurrency can exceed `max_concurrency` by the number of such
//!   requests (a dead replica's upstream connections close with it, so normally none), and tokens
//!   by their charge above their reservation (output burndown), which nobody debits: at most
//!   `maxTokens x (burndown - 1)` per request the dead replica had in flight.
//! - **A Redis Cluster** (`redis+cluster://`, see [`super::connection`]): each script call goes to
//!   the master of its pool's slot. A master that dies fails its pools' calls (the failures
//!   above, for those pools only) until a replica is promoted; the probe needs every master.
//!   Writes it acknowledged but had not replicated are lost with it: leases and deductions of
//!   the last moment's admissions are forgotten by the new master (their settlements find no
//!   lease, so only a charge above the reservation is debited), so it may admit those tokens
//!   again, once.
//! - **Clocks.** Only Redis `TIME` is used. After a failover to a Redis whose clock is behind,
//!   refill pauses until that clock catches up (time never runs backwards in a bucket). The one
//!   exception is for tests: [`RedisLedger::connect_with_clock`] builds the scripts to take the
//!   time from a clock of the test's, passed with every call; production never uses it.
//! - **Rolling deploys.** Scripts are addressed by their SHA1, so two builds never run each
//!   other's scripts; they share state as long as the key layout version (`tg:v1:`) is the same,
//!   which changes only with what is stored or what it means. A new layout version means new
//!   keys: while both versions run, each enforces the full limits on its own state, so roll such
//!   a change quickly or lower the limits while it rolls.
//! - **Counters.** Errors this ledger handles itself (failed renewals and probes) count in its
//!   [`LedgerStats`]; errors it returns are the caller's to count. Settlements count as in
//!   flight from the call's first poll until they complete or are dropped: shutdown waits for
//!   them.
//! - **Expiry of idle pools.** Both keys live until every lease has expired and both buckets are
//!   full again, plus a minute; a pool that expired is the same as a fresh, full one.

use std::{
    collections::HashMap,
    sync::{
        Arc, Weak,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use dashmap::DashMap;
use redis::{FromRedisValue, ScriptInvocation};
use tokio::task::AbortHandle;

use super::{
    BudgetRefusal, BudgetRequest, BudgetVerdict, BudgetWindow, Clock, Issuer, Ledger, LedgerError,
    LedgerMode, LedgerStats, Limits, Origin, PoolSnapshot, Rejection, Reservation, ReserveRequest,
    ShareHold, Verdict, WindowSnapshot,
    connection::Connection,
    scripts::{
        AdmitReply, BACKEND, BudgetReply, Scripts, SettleReply, SliceBack, SliceReply, SliceTake,
        check_limits, check_windows, decode, lease_id, member,
    },
};

pub use super::scripts::{LAYOUT_VERSION, MAX_TOKENS_PER_MINUTE};

/// Leases renewed per script call.
const RENEW_BATCH: usize = 256;

/// How to reach Redis and how long leases last.
#[derive(Debug, Clone)]
pub struct RedisOptions {
    /// `redis://[user:password@]host:port[/db]`, `redis+unix:///path/to/socket`, or a Redis
    /// Cluster: `redis+cluster://[user:password@]host:port[,host:port...]` (see
    /// [`super::connection`]).
    pub url: String,
    /// The longest any one call may take, connecting included.
    pub timeout: Duration,
    /// How long a reservation outlives the last renewal by its holder.
    pub lease: Duration,
}

/// The Redis-backed ledger. Cheap to share behind an `Arc`; dropping it stops lease renewal.
#[derive(Debug)]
pub struct RedisLedger {
    inner: Arc<Inner>,
    maintenance: AbortHandle,
}

#[derive(Debug)]
struct Inner {
    conn: Connection,
    scripts: Scripts,
    timeout: Duration,
    lease: Duration,
    /// Leases this replica holds and renews: id -> (pool, tokens).
    held: DashMap<u64, (Arc<str>, u64)>,
    healthy: AtomicBool,
    stats: Arc<LedgerStats>,
    /// Tests only ([`RedisLedger::connect_with_clock`]): the clock whose milliseconds every
    /// script call carries, instead of the scripts reading Redis `TIME`.
    test_clock: Option<Clock>,
}

// === impl RedisLedger ===

impl RedisLedger {
    /// Connects (lazily: an unreachable Redis makes the ledger unavailable, not the start fail)
    /// and starts lease renewal. Errors only on a URL that cannot be used.
    pub async fn connect(options: RedisOptions) -> Result<RedisLedger, LedgerError> {
        Self::start(options, None).await
    }

    /// [`RedisLedger::connect`], with the scripts taking the time from `clock` (its milliseconds
    /// are passed with every call) instead of reading Redis `TIME`. **For tests only**, which
    /// must drive both backends through the same instants to compare them exactly; production
    /// never calls it (the gateway uses [`RedisLedger::connect`]), because replicas' clocks
    /// differ and the shared state must follow one clock.
    pub async fn connect_with_clock(
        options: RedisOptions,
        clock: Clock,
    ) -> Result<RedisLedger, LedgerError> {
        Self::start(options, Some(clock)).await
    }

    async fn start(
        options: RedisOptions,
        test_clock: Option<Clock>,
    ) -> Result<RedisLedger, LedgerError> {
        let conn = Connection::open(&options.url, options.timeout)?;
        let inner = Arc::new(Inner {
            conn,
            scripts: Scripts::new(test_clock.is_some()),
            timeout: options.timeout,
            lease: options.lease,
            held: DashMap::new(),
            healthy: AtomicBool::new(true),
            stats: Arc::default(),
            test_clock,
        });
        inner.probe().await;
        let maintenance = tokio::spawn(maintain(Arc::downgrade(&inner))).abort_handle();
        Ok(RedisLedger { inner, maintenance })
    }

    /// Whether the last call to Redis succeeded.
    pub fn is_healthy(&self) -> bool {
        self.inner.healthy.load(Ordering::Acquire)
    }

    /// Leases this replica holds (and renews).
    pub fn held_leases(&self) -> usize {
        self.inner.held.len()
    }

    /// The stats, to share with a fallback's local ledger.
    pub(crate) fn stats_handle(&self) -> Arc<LedgerStats> {
        self.inner.stats.clone()
    }

    /// Renews every lease this replica holds now (the background task does this every
    /// `lease / 3`).
    pub async fn renew_all(&self) {
        self.inner.renew_all().await;
    }

    /// Gives a capacity slice back and/or takes one (`lua/slice.lua`, [`super::lease`]): one
    /// round trip. The reservations in flight of a slice given back become leases of this
    /// replica, renewed as its own.
    pub(super) async fn slice(
        &self,
        pool: &Arc<str>,
        limits: &Limits,
        back: Option<&SliceBack<'_>>,
        take: Option<&SliceTake>,
    ) -> Result<SliceReply, LedgerError> {
        check_limits(pool, limits)?;
        let inner = &self.inner;
        let invocation = inner.scripts.slice(pool, limits, inner.lease, back, take);
        let reply: String = inner.run(invocation, "slice", pool).await?;
        let reply: SliceReply = decode("slice", &reply)?;
        warn_purged(pool, reply.purged());
        if let Some(back) = back.filter(|_| reply.returned()) {
            for &(id, tokens) in back.in_flight {
                inner.held.insert(id, (pool.clone(), tokens));
            }
        }
        Ok(reply)
    }
}

impl Drop for RedisLedger {
    fn drop(&mut self) {
        self.maintenance.abort();
    }
}

/// The background task: renews held leases every `lease / 3`, and pings Redis every second
/// while it is unhealthy so that readiness (and the fallback) come back without traffic.
async fn maintain(inner: Weak<Inner>) {
    let Some(lease) = inner.upgrade().map(|i| i.lease) else {
        return;
    };
    let renew_every = lease / 3;
    let tick = renew_every.min(Duration::from_secs(1));
    let mut last_renewal = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(tick).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        if !inner.healthy.load(Ordering::Acquire) {
            inner.probe().await;
        }
        if last_renewal.elapsed() >= renew_every {
            last_renewal = tokio::time::Instant::now();
            inner.renew_all().await;
        }
    }
}

// === impl Inner ===

impl Inner {
    /// Runs one script call within the timeout; records health.
    async fn run<T: FromRedisValue>(
        &self,
        mut invocation: ScriptInvocation<'_>,
        op: &str,
        pool: &str,
    ) -> Result<T, LedgerError> {
        if let Some(clock) = &self.test_clock {
            // The last argument: lua/test_clock.lua's now_ms() takes it.
            invocation.arg(clock.now_ns() / 1_000_000);
        }
        let mut conn = self.conn.clone();
        let outcome = tokio::time::timeout(self.timeout, invocation.invoke_async(&mut conn)).await;
        let message = match outcome {
            Ok(Ok(value)) => {
                self.mark_healthy();
                return Ok(value);
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!(
                "no answer within {} ms (ledger.timeout_ms)",
                self.timeout.as_millis()
            ),
        };
        let message = format!("{op} for pool {pool:?}: {message}");
        self.mark_unhealthy(&message);
        Err(LedgerError {
            backend: BACKEND,
            message,
        })
    }

    fn mark_healthy(&self) {
        if !self.healthy.swap(true, Ordering::AcqRel) {
            tracing::info!("redis ledger reachable again");
        }
    }

    fn mark_unhealthy(&self, message: &str) {
        if self.healthy.swap(false, Ordering::AcqRel) {
            tracing::warn!(error = message, "redis ledger unavailable");
        }
    }

    /// Errors this ledger absorbs (renewal, probes) are counted here; errors returned to the
    /// caller are counted by whoever handles them, so each is counted once.
    fn count_absorbed_error(&self) {
        self.stats.count_absorbed_error();
    }

    async fn probe(&self) {
        let mut conn = self.conn.clone();
        let ping = redis::cmd("PING");
        match tokio::time::timeout(self.timeout, ping.query_async::<String>(&mut conn)).await {
            Ok(Ok(_)) => self.mark_healthy(),
            Ok(Err(e)) => {
                self.count_absorbed_error();
                self.mark_unhealthy(&format!("PING: {e}"));
            }
            Err(_) => {
                self.count_absorbed_error();
                self.mark_unhealthy("PING: no answer within ledger.timeout_ms");
            }
        }
    }

    async fn renew_all(&self) {
        let mut by_pool: HashMap<Arc<str>, Vec<String>> = HashMap::new();
        for entry in &self.held {
            let (pool, tokens) = entry.value();
            by_pool
                .entry(pool.clone())
                .or_default()
                .push(member(*entry.key(), *tokens));
        }
        for (pool, members) in by_pool {
            for batch in members.chunks(RENEW_BATCH) {
                let invocation = self.scripts.renew(&pool, self.lease, batch);
                match self.run::<Vec<String>>(invocation, "renew", &pool).await {
                    Ok(missing) => {
                        for id in missing.iter().filter_map(|m| lease_id(m)) {
                            self.held.remove(&id);
                        }
                    }
                    Err(e) => {
                        self.count_absorbed_error();
                        tracing::warn!(error = %e, "lease renewal failed; retrying next round");
                    }
                }
            }
        }
    }
}

/// Expired leases reclaimed by a call are a replica that stopped renewing: worth a warning.
fn warn_purged(pool: &str, purged: u64) {
    if purged > 0 {
        tracing::warn!(
            pool,
            purged,
            "expired leases reclaimed: a replica stopped renewing (crashed, or lost Redis)"
        );
    }
}

// === impl Ledger for RedisLedger ===

#[async_trait]
impl Ledger for RedisLedger {
    async fn reserve(&self, request: &ReserveRequest<'_>) -> Result<Verdict, LedgerError> {
        let inner = &self.inner;
        check_limits(request.pool, &request.limits)?;
        let id: u64 = rand::random();
        let invocation = inner
            .scripts
            .admit(request, &member(id, request.tokens), inner.lease);
        let reply: String = inner.run(invocation, "admit", request.pool).await?;
        let reply: AdmitReply = decode("admit", &reply)?;
        warn_purged(request.pool, reply.purged());
        Ok(match reply {
            AdmitReply::Granted {
                guaranteed,
                recovered,
                ..
            } => {
                let pool: Arc<str> = Arc::from(request.pool);
                inner.held.insert(id, (pool.clone(), request.tokens));
                let hold = request.share.map(|share| ShareHold {
                    route: share.caller().route.clone(),
                    guaranteed,
                    recovered,
                });
                let issuer = Arc::new(Issuer {
                    pool,
                    origin: Origin::Shared,
                    stats: inner.stats.clone(),
                });
                Verdict::Granted(Reservation::new(issuer, request.tokens, id).with_share(hold))
            }
            AdmitReply::Refused {
                limit,
                wait_ms,
                deficit,
                reserved,
                in_flight,
                held_for_others,
                ..
            } => Verdict::Refused(Rejection {
                limit,
                refill_wait: wait_ms.map(Duration::from_millis),
                token_deficit: deficit,
                in_flight_tokens: reserved,
                in_flight_requests: in_flight,
                held_for_others,
            }),
        })
    }

    async fn settle(
        &self,
        reservation: Reservation,
        charged_tokens: u64,
    ) -> Result<(), LedgerError> {
        let inner = &self.inner;
        let _in_flight = inner.stats.settlement_started();
        let pool = reservation.pool().to_owned();
        let (reserved, id, hold) = reservation.disarm();
        // Whatever happens next, this replica stops renewing it: a settle that fails leaves a
        // lease that expires.
        inner.held.remove(&id);
        let invocation = inner.scripts.settle(
            &pool,
            &member(id, reserved),
            (reserved, charged_tokens),
            hold.as_ref(),
        );
        let reply: String = inner.run(invocation, "settle", &pool).await?;
        let reply: SettleReply = decode("settle", &reply)?;
        if !reply.held {
            tracing::warn!(pool = %pool, reserved, charged_tokens, "settled after the lease expired: it was charged in full");
        }
        Ok(())
    }

    async fn snapshot(&self, pool: &str, limits: &Limits) -> Result<PoolSnapshot, LedgerError> {
        check_limits(pool, limits)?;
        let invocation = self.inner.scripts.snapshot(pool, limits);
        let reply: String = self.inner.run(invocation, "snapshot", pool).await?;
        decode("snapshot", &reply)
    }

    async fn take_budget(&self, request: &BudgetRequest<'_>) -> Result<BudgetVerdict, LedgerError> {
        check_windows(request)?;
        let invocation = self.inner.scripts.budget("take", request, 0);
        let reply: String = self
            .inner
            .run(invocation, "budget take", request.scope)
            .await?;
        match decode("budget take", &reply)? {
            BudgetReply::Refused {
                window,
                wait_ms,
                deficit,
            } => Ok(BudgetVerdict::Refused(BudgetRefusal {
                window: request
                    .windows
                    .iter()
                    .find(|w| w.name == window)
                    .map_or("unknown", |w| w.name),
                wait: wait_ms.map(Duration::from_millis),
                deficit,
            })),
            _ => Ok(BudgetVerdict::Taken(Origin::Shared)),
        }
    }

    async fn settle_budget(
        &self,
        request: &BudgetRequest<'_>,
        _origin: Origin,
        charged: u64,
    ) -> Result<(), LedgerError> {
        check_windows(request)?;
        let invocation = self.inner.scripts.budget("settle", request, charged);
        let reply: String = self
            .inner
            .run(invocation, "budget settle", request.scope)
            .await?;
        decode::<BudgetReply>("budget settle", &reply).map(|_| ())
    }

    async fn budget_snapshot(
        &self,
        scope: &str,
        windows: &[BudgetWindow],
    ) -> Result<Vec<WindowSnapshot>, LedgerError> {
        let request = BudgetRequest {
            scope,
            windows,
            tokens: 0,
        };
        check_windows(&request)?;
        let invocation = self.inner.scripts.budget("snapshot", &request, 0);
        let reply: String = self.inner.run(invocation, "budget snapshot", scope).await?;
        decode("budget snapshot", &reply)
    }

    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn stats(&self) -> &LedgerStats {
        &self.inner.stats
    }

    fn mode(&self) -> LedgerMode {
        if self.is_healthy() {
            LedgerMode::Shared
        } else {
            LedgerMode::Unavailable
        }
    }
}
