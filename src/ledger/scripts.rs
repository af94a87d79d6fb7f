//! The Redis ledger's Lua scripts (`lua/`) and their wire: how each script is built, what each
//! (Over 500 lines: every script's arguments and reply, side by side with the others.)
//! call sends (keys and arguments) and what it answers (typed replies).
//!
//! # Building
//!
//! Every script is a prelude plus its body: the constants the scripts share with Rust
//! ([`super::units`], and this file's batch sizes), formatted in as Lua `local`s, then
//! `lua/common.lua` (key layout, bucket arithmetic, leases, route shares, the reply encoder). The
//! constants are formatted in rather than passed with each call: they never change between calls,
//! so arguments would add bytes and parsing to every round trip, and formatted in they are part of
//! each script's SHA1, so two builds whose constants differ never run each other's scripts.
//!
//! A build for tests ([`super::RedisLedger::connect_with_clock`]) appends `lua/test_clock.lua`:
//! the time then comes from the last argument of each call instead of Redis `TIME`. Production
//! never builds it.
//!
//! # Replies
//!
//! Each script answers one JSON object, decoded here with serde ([`AdmitReply`], [`SettleReply`],
//! [`SliceReply`], [`PoolSnapshot`]); a reply that does not decode is a [`LedgerError`] quoting it. The scripts
//! write each reply with one `string.format` of a fixed template: integers through `%d`, exact for
//! every integer a double holds (`cjson.encode` keeps only 14 digits), and one string made per
//! reply (a field-by-field encoder cost Redis about 3 µs more per call: `loadtest/RESULTS.md`).

use std::time::Duration;

use redis::{Script, ScriptInvocation};
use serde::{Deserialize, de::DeserializeOwned};

use super::{
    BudgetRequest, LedgerError, Limit, Limits, ReserveRequest, ShareHold,
    shares::share_tokens,
    units::{
        DAY_MS, MAX_BUDGET_TOKENS, MAX_TOKENS_PER_WINDOW, MAX_WINDOW_TICKS, MILLIS_PER_MINUTE,
        UPSTREAM_TRANSIT_MS, WINDOW_TICK_MS,
    },
};

/// The version of the key layout, in every key: bump it with any change to what is stored or what
/// it means. (Scripts need no version: they are addressed by their SHA1.)
pub const LAYOUT_VERSION: &str = "v1";

/// The largest `tokens_per_minute` the scripts keep exact: a full bucket is `tpm x 60,000` units,
/// and levels (including burndown debt) must stay far below 2^53.
pub const MAX_TOKENS_PER_MINUTE: u64 = 1_000_000_000;
/// Charges above this are debited as this much (ten of the largest buckets): same reason.
pub const MAX_CHARGE: u64 = 10 * MAX_TOKENS_PER_MINUTE;
/// Expired leases reclaimed per script call (`PURGE_BATCH` in the scripts).
const PURGE_BATCH: usize = 256;
/// How long an idle pool's keys outlive the moment every lease has expired and both buckets are
/// full again (`KEY_GRACE_MS` in the scripts).
const KEY_GRACE: Duration = Duration::from_secs(60);
/// The backend's name, in errors and metrics.
pub const BACKEND: &str = "redis";

const COMMON: &str = include_str!("lua/common.lua");
const TEST_CLOCK: &str = include_str!("lua/test_clock.lua");

/// The constants the scripts share with Rust, as Lua.
fn constants() -> String {
    format!(
        "local U = {MILLIS_PER_MINUTE}\nlocal TRANSIT_MS = {UPSTREAM_TRANSIT_MS}\n\
         local PURGE_BATCH = {PURGE_BATCH}\nlocal KEY_GRACE_MS = {}\n\
         local TICK_MS = {WINDOW_TICK_MS}\nlocal MAX_WINDOW_TICKS = {MAX_WINDOW_TICKS}\n\
         local DAY_MS = {DAY_MS}\n",
        KEY_GRACE.as_millis()
    )
}

/// The scripts, each one round trip.
#[derive(Debug)]
pub struct Scripts {
    admit: Script,
    settle: Script,
    renew: Script,
    snapshot: Script,
    budget: Script,
    slice: Script,
}

impl Scripts {
    /// The scripts, reading Redis `TIME`, or with `test_clock` the time passed with each call.
    pub fn new(test_clock: bool) -> Scripts {
        let clock = if test_clock { TEST_CLOCK } else { "" };
        let prelude = format!("{}{COMMON}{clock}", constants());
        let script = |body: &str| Script::new(&format!("{prelude}\n{body}"));
        Scripts {
            admit: script(include_str!("lua/admit.lua")),
            settle: script(include_str!("lua/settle.lua")),
            renew: script(include_str!("lua/renew.lua")),
            snapshot: script(include_str!("lua/snapshot.lua")),
            budget: script(include_str!("lua/budget.lua")),
            slice: script(include_str!("lua/slice.lua")),
        }
    }

    /// `admit.lua` for `request`, as lease `member` lasting `lease`.
    pub fn admit(
        &self,
        request: &ReserveRequest<'_>,
        member: &str,
        lease: Duration,
    ) -> ScriptInvocation<'_> {
        let limits = &request.limits;
        let mut invocation = self.pool_call(&self.admit, request.pool);
        invocation
            .arg(member)
            .arg(request.tokens)
            .arg(limits.tokens_per_minute)
            .arg(rpm_arg(limits))
            .arg(limits.max_concurrency)
            .arg(millis(lease))
            .arg(request.hold_back.min(MAX_TOKENS_PER_MINUTE))
            .arg(tpd_arg(limits));
        share_args(&mut invocation, request);
        invocation
    }

    /// `settle.lua`: lease `member` of `pool`, `reserved` tokens, settled to `charged`.
    pub fn settle(
        &self,
        pool: &str,
        member: &str,
        (reserved, charged): (u64, u64),
        hold: Option<&ShareHold>,
    ) -> ScriptInvocation<'_> {
        let mut invocation = self.pool_call(&self.settle, pool);
        invocation
            .arg(member)
            .arg(reserved)
            .arg(charged.min(MAX_CHARGE));
        if let Some(hold) = hold {
            invocation
                .arg(&*hold.route)
                .arg(hold.guaranteed)
                .arg(u8::from(hold.recovered));
        }
        invocation
    }

    /// `renew.lua`: pushes the expiry of `members` of `pool` to `lease` from now.
    pub fn renew(&self, pool: &str, lease: Duration, members: &[String]) -> ScriptInvocation<'_> {
        let mut invocation = self.pool_call(&self.renew, pool);
        invocation.arg(millis(lease));
        for m in members {
            invocation.arg(m);
        }
        invocation
    }

    /// `snapshot.lua` for `pool` under `limits`.
    pub fn snapshot(&self, pool: &str, limits: &Limits) -> ScriptInvocation<'_> {
        let mut invocation = self.pool_call(&self.snapshot, pool);
        invocation
            .arg(limits.tokens_per_minute)
            .arg(rpm_arg(limits))
            .arg(tpd_arg(limits));
        invocation
    }

    /// `budget.lua`: `op` (`take`, `settle` or `snapshot`) on the scope's budget, `tokens`
    /// (settled to `charged`).
    pub fn budget(
        &self,
        op: &str,
        request: &BudgetRequest<'_>,
        charged: u64,
    ) -> ScriptInvocation<'_> {
        let mut invocation = self.budget.prepare_invoke();
        invocation
            .key(budget_key(request.scope))
            .arg(op)
            .arg(request.tokens.min(MAX_BUDGET_TOKENS))
            .arg(charged.min(MAX_BUDGET_TOKENS))
            .arg(request.windows.len());
        for w in request.windows {
            invocation.arg(w.name).arg(w.capacity).arg(w.window_ms);
        }
        invocation
    }

    /// `slice.lua`: gives `back` back and takes `take` in `pool` under `limits`, the new slice's
    /// lease lasting `lease`.
    pub fn slice(
        &self,
        pool: &str,
        limits: &Limits,
        lease: Duration,
        back: Option<&SliceBack<'_>>,
        take: Option<&SliceTake>,
    ) -> ScriptInvocation<'_> {
        let mut invocation = self.pool_call(&self.slice, pool);
        invocation
            .arg(limits.tokens_per_minute)
            .arg(rpm_arg(limits))
            .arg(limits.max_concurrency)
            .arg(millis(lease))
            .arg(tpd_arg(limits));
        match back {
            Some(b) => invocation
                .arg(slice_id(b.id))
                .arg(b.tokens)
                .arg(b.requests)
                .arg(b.permits)
                .arg(b.unused_tokens)
                .arg(b.unused_requests)
                .arg(u8::from(b.from_full)),
            None => invocation
                .arg("-")
                .arg(0)
                .arg(0)
                .arg(0)
                .arg(0)
                .arg(0)
                .arg(0),
        };
        match take {
            Some(t) => invocation
                .arg(slice_id(t.id))
                .arg(t.least)
                .arg(t.tokens)
                .arg(t.requests)
                .arg(t.permits)
                .arg(t.keep)
                .arg(t.route.as_ref().map_or("-", |(r, _)| &**r))
                .arg(t.route.as_ref().map_or(0, |(_, v)| *v))
                .arg(t.hold_back.min(MAX_TOKENS_PER_MINUTE)),
            None => invocation
                .arg("-")
                .arg(0)
                .arg(0)
                .arg(0)
                .arg(0)
                .arg(0)
                .arg("-")
                .arg(0)
                .arg(0),
        };
        for &(id, tokens) in back.map_or(&[][..], |b| b.in_flight) {
            invocation.arg(member(id, tokens));
        }
        invocation
    }

    fn pool_call<'a>(&self, script: &'a Script, pool: &str) -> ScriptInvocation<'a> {
        let [state, leases] = keys(pool);
        let mut invocation = script.prepare_invoke();
        invocation.key(state).key(leases);
        invocation
    }
}

/// A pool's two keys, sharing the hash tag `{pool}` (one Cluster slot): the state hash and the
/// lease set.
fn keys(pool: &str) -> [String; 2] {
    [
        format!("tg:{LAYOUT_VERSION}:{{{pool}}}:s"),
        format!("tg:{LAYOUT_VERSION}:{{{pool}}}:l"),
    ]
}

/// A budget's key, under the scope's own hash tag.
fn budget_key(scope: &str) -> String {
    format!("tg:{LAYOUT_VERSION}:{{budget:{scope}}}:b")
}

/// Refuses budget windows the script cannot keep exact, naming the scope and the window.
pub fn check_windows(request: &BudgetRequest<'_>) -> Result<(), LedgerError> {
    match request
        .windows
        .iter()
        .find(|w| w.capacity > MAX_TOKENS_PER_WINDOW || w.window_ms == 0)
    {
        Some(w) => Err(LedgerError {
            backend: BACKEND,
            message: format!(
                "budget {:?}: {} = {} per {} ms is outside the redis ledger's exact range ({MAX_TOKENS_PER_WINDOW})",
                request.scope, w.name, w.capacity, w.window_ms
            ),
        }),
        None => Ok(()),
    }
}

/// The budget script's reply to `take` and `settle`.
#[derive(Debug, Deserialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum BudgetReply {
    Taken,
    Settled,
    Refused {
        window: String,
        wait_ms: Option<u64>,
        deficit: u64,
    },
}

/// A capacity slice given back ([`super::lease`]): what it was taken with, what it did not use,
/// and its reservations still in flight (id, tokens), which become leases of their own.
#[derive(Debug)]
pub struct SliceBack<'a> {
    pub id: u64,
    pub tokens: u64,
    pub requests: u64,
    pub permits: u32,
    /// Negative when its reservations were charged more than it held.
    pub unused_tokens: i64,
    pub unused_requests: u64,
    /// It admitted a request while nothing of it was used: the pool's bucket may have been full.
    pub from_full: bool,
    pub in_flight: &'a [(u64, u64)],
}

/// A capacity slice to take: at least `least` tokens (the request asking), at most the sizes,
/// leaving `keep` tokens in the bucket; taken only if the bucket also holds the request's
/// `hold_back` (as an admission checks it); `route`: the asking route and its recovery (tokens
/// per minute), marked seen as an admission marks it.
#[derive(Debug)]
pub struct SliceTake {
    pub id: u64,
    pub least: u64,
    pub tokens: u64,
    pub requests: u64,
    pub permits: u32,
    pub keep: u64,
    pub hold_back: u64,
    pub route: Option<(std::sync::Arc<str>, u64)>,
}

/// The slice script's reply.
#[derive(Debug, Deserialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum SliceReply {
    /// Only given back (nothing asked).
    Returned { returned: bool, purged: u64 },
    /// What the new slice holds.
    Granted {
        returned: bool,
        purged: u64,
        tokens: u64,
        requests: u64,
        permits: u32,
    },
    /// As [`AdmitReply::Refused`], for the request that asked.
    Refused {
        returned: bool,
        purged: u64,
        limit: Limit,
        wait_ms: Option<u64>,
        deficit: u64,
        reserved: u64,
        in_flight: u32,
        held_for_others: bool,
    },
}

impl SliceReply {
    /// Expired leases (and slices) this call reclaimed.
    pub fn purged(&self) -> u64 {
        match self {
            SliceReply::Returned { purged, .. }
            | SliceReply::Granted { purged, .. }
            | SliceReply::Refused { purged, .. } => *purged,
        }
    }

    /// Whether the slice given back was live (else it had expired and was charged in full).
    pub fn returned(&self) -> bool {
        match self {
            SliceReply::Returned { returned, .. }
            | SliceReply::Granted { returned, .. }
            | SliceReply::Refused { returned, .. } => *returned,
        }
    }
}

/// A slice's id in its lease members (`lua/slice.lua` builds them from it).
fn slice_id(id: u64) -> String {
    format!("{id:016x}")
}

/// The lease's member in the pool's sorted set: its id and the tokens it holds.
pub fn member(id: u64, tokens: u64) -> String {
    format!("{id:016x}:{tokens}")
}

/// The lease id of a member, if it is one.
pub fn lease_id(member: &str) -> Option<u64> {
    let (id, _) = member.split_once(':')?;
    u64::from_str_radix(id, 16).ok()
}

/// Refuses limits the scripts cannot keep exact, naming the pool and the limit.
pub fn check_limits(pool: &str, limits: &Limits) -> Result<(), LedgerError> {
    let too_big = |what: &str, v: u64| LedgerError {
        backend: BACKEND,
        message: format!(
            "pool {pool:?}: {what} = {v} is above the redis ledger's exact range ({MAX_TOKENS_PER_MINUTE})"
        ),
    };
    if limits.tokens_per_minute > MAX_TOKENS_PER_MINUTE {
        return Err(too_big("tokens_per_minute", limits.tokens_per_minute));
    }
    if let Some(tpd) = limits.tokens_per_day.filter(|d| *d > MAX_TOKENS_PER_WINDOW) {
        return Err(LedgerError {
            backend: BACKEND,
            message: format!(
                "pool {pool:?}: tokens_per_day = {tpd} is above the redis ledger's exact range ({MAX_TOKENS_PER_WINDOW})"
            ),
        });
    }
    match limits.requests_per_minute {
        Some(rpm) if rpm > MAX_TOKENS_PER_MINUTE => Err(too_big("requests_per_minute", rpm)),
        _ => Ok(()),
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The admit script's route-share arguments (see admit.lua): `0` without shares.
fn share_args(invocation: &mut ScriptInvocation<'_>, request: &ReserveRequest<'_>) {
    let Some(share) = request.share else {
        invocation.arg(0);
        return;
    };
    let tpm = request.limits.tokens_per_minute;
    invocation
        .arg(share.routes.len())
        .arg(share.caller + 1)
        .arg(u8::from(share.retry))
        .arg(share_tokens(share.retry_reserve, tpm))
        .arg(share_tokens(share.priority_margin, tpm))
        .arg(millis(share.idle));
    for route in share.routes.iter() {
        let (guaranteed, ceiling, recovery) = route.capacities(tpm);
        invocation
            .arg(&*route.route)
            .arg(route.priority)
            .arg(guaranteed)
            .arg(ceiling.map_or(-1, |c| i64::try_from(c).unwrap_or(i64::MAX)))
            .arg(recovery);
    }
}

fn tpd_arg(limits: &Limits) -> i64 {
    limits
        .tokens_per_day
        .map_or(-1, |d| i64::try_from(d).unwrap_or(i64::MAX))
}

fn rpm_arg(limits: &Limits) -> i64 {
    limits
        .requests_per_minute
        .map_or(-1, |r| i64::try_from(r).unwrap_or(i64::MAX))
}

/// The admit script's reply.
#[derive(Debug, Deserialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum AdmitReply {
    Granted {
        /// Expired leases this call reclaimed.
        purged: u64,
        /// Tokens taken from the caller's guarantee.
        guaranteed: u64,
        /// Taken under the caller's recovery budget.
        recovered: bool,
    },
    Refused {
        purged: u64,
        limit: Limit,
        /// `None`: refill alone never makes room.
        wait_ms: Option<u64>,
        deficit: u64,
        reserved: u64,
        in_flight: u32,
        held_for_others: bool,
    },
}

impl AdmitReply {
    /// Expired leases this call reclaimed.
    pub fn purged(&self) -> u64 {
        match self {
            AdmitReply::Granted { purged, .. } | AdmitReply::Refused { purged, .. } => *purged,
        }
    }
}

/// The settle script's reply.
#[derive(Debug, Deserialize)]
pub struct SettleReply {
    /// The lease was live (not expired and purged before the settlement arrived).
    pub held: bool,
}

/// Decodes a script's JSON reply; anything else is a [`LedgerError`] that quotes it.
pub fn decode<T: DeserializeOwned>(op: &str, reply: &str) -> Result<T, LedgerError> {
    serde_json::from_str(reply).map_err(|e| LedgerError {
        backend: BACKEND,
        message: format!("{op}: unexpected reply from the script ({e}): {reply}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_share_one_hash_tag_per_pool() {
        let [state, leases] = keys("sonnet4-us");
        assert_eq!(state, "tg:v1:{sonnet4-us}:s");
        assert_eq!(leases, "tg:v1:{sonnet4-us}:l");
    }

    #[test]
    fn replies_decode_by_name() {
        // 15 digits: what cjson.encode would have printed as 1.2345678901234e+14.
        let refused = r#"{"verdict":"refused","purged":0,"limit":"share","wait_ms":null,"deficit":123456789012345,"reserved":3,"in_flight":1,"held_for_others":false}"#;
        match decode::<AdmitReply>("admit", refused).expect("decodes") {
            AdmitReply::Refused {
                limit,
                wait_ms,
                deficit,
                ..
            } => {
                assert_eq!(limit, Limit::Share);
                assert_eq!(wait_ms, None);
                assert_eq!(deficit, 123_456_789_012_345);
            }
            other => panic!("{other:?}"),
        }
        let granted = r#"{"verdict":"granted","purged":2,"guaranteed":10,"recovered":true}"#;
        assert!(matches!(
            decode::<AdmitReply>("admit", granted),
            Ok(AdmitReply::Granted {
                purged: 2,
                guaranteed: 10,
                recovered: true
            })
        ));
        let e =
            decode::<SettleReply>("settle", "[1,0]").expect_err("positional replies are refused");
        assert!(
            e.message.contains("settle") && e.message.contains("[1,0]"),
            "{e}"
        );
    }

    #[test]
    fn lease_members_carry_id_and_tokens() {
        let m = member(0xabc, 1_500);
        assert_eq!(m, "0000000000000abc:1500");
        assert_eq!(lease_id(&m), Some(0xabc));
        assert_eq!(lease_id("nonsense"), None);
    }
}
