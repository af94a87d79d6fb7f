//! The units and constants both ledger backends use, defined once.
//!
//! The memory backend ([`super::bucket`]) keeps bucket levels in token-nanominutes; the Redis
//! scripts (`lua/`) keep them in token-milliminutes, because Lua numbers are doubles and
//! nanominutes would pass 2^53. Both are "one token = the clock ticks in a minute", so a bucket
//! of `C` tokens per minute refills exactly `C` units per tick in either, and at
//! millisecond-aligned times the two levels are the same number of tokens exactly.
//!
//! Nothing here is copied into the Lua by hand: [`super::redis`] formats these values into the
//! scripts' prelude when it builds them (so each script's SHA1 covers them).

use std::time::Duration;

/// Nanoseconds per minute: the memory backend's units per token.
pub const NANOS_PER_MINUTE: u64 = 60_000_000_000;

/// Milliseconds per minute: the Redis scripts' units per token (`U` in `lua/common.lua`).
pub const MILLIS_PER_MINUTE: u64 = 60_000;

/// How long a request takes to reach upstream, at most: refill after a full bucket starts this
/// long after the reservation ([`super::bucket::TokenBucket::take_in_transit`], and the same
/// rule in `lua/admit.lua`). Costs a pool at most this much refill (100 ms of a minute: 0.17%)
/// per idle spell. A whole number of milliseconds, so that both backends hold it exactly.
pub const UPSTREAM_TRANSIT: Duration = Duration::from_millis(100);

/// [`UPSTREAM_TRANSIT`] in nanoseconds, the memory backend's clock.
pub const UPSTREAM_TRANSIT_NS: u64 = UPSTREAM_TRANSIT.as_nanos() as u64;

/// [`UPSTREAM_TRANSIT`] in milliseconds, the Redis scripts' clock.
pub const UPSTREAM_TRANSIT_MS: u64 = UPSTREAM_TRANSIT.as_millis() as u64;

// Both clocks agree on these exactly (checked when the crate compiles).
const _: () = assert!(NANOS_PER_MINUTE == MILLIS_PER_MINUTE * 1_000_000);
const _: () = assert!(UPSTREAM_TRANSIT_NS == UPSTREAM_TRANSIT_MS * 1_000_000);

/// The shortest tick of long-window buckets ([`super::window`]): they refill once per tick, in
/// both backends, so that a window's bucket stays exact in a Lua double.
pub const WINDOW_TICK_MS: u64 = 1_000;

/// The most ticks in a window: a window longer than a day ticks more slowly (30 days: every
/// 30 s), so that a full bucket (`capacity x ticks` units) stays below 2^53 (9.007e15).
pub const MAX_WINDOW_TICKS: u64 = 86_400;

/// The most tokens a budget call takes or settles (more is taken as this much): ten of the
/// largest minute buckets, far above any reservation, and `x MAX_WINDOW_TICKS` below 2^53.
pub const MAX_BUDGET_TOKENS: u64 = 10_000_000_000;

/// A day, in milliseconds.
pub const DAY_MS: u64 = 86_400_000;

/// The largest capacity of a long-window bucket that both backends keep exact.
pub const MAX_TOKENS_PER_WINDOW: u64 = 100_000_000_000;

const _: () = assert!(DAY_MS / WINDOW_TICK_MS == MAX_WINDOW_TICKS);
const _: () = assert!((MAX_TOKENS_PER_WINDOW as u128) * (MAX_WINDOW_TICKS as u128) < (1u128 << 53));
