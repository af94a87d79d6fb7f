//! One quota-counted call, whatever API it came through: the buckets it may draw on (its tier's
//! and, for `reserved`, the on-demand one it overflows to), the account-wide day of its Region,
//! and the tallies its charge is counted in. Every API's edge goes through [`Call`], so a model's
//! quota is one whatever door a caller uses, as AWS states.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use super::Inner;
use super::model_id::{Resolved, Route};
use super::models;
use super::quota::{Bucket, BucketInfo, Reservation, Shortfall};
use super::stats::Tally;
use super::tier::Tier;

/// The 429 messages Bedrock sends (observed).
pub const TOO_MANY_TOKENS: &str = "Too many tokens, please wait before trying again.";
pub const TOO_MANY_TOKENS_PER_DAY: &str =
    "Too many tokens per day, please wait before trying again.";

/// A call that cannot be charged at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// `reserved` asked of a model with no reserved capacity (a ValidationException).
    #[error(
        "The model {model} has no reserved capacity in {region}. Use the default, priority or flex service tier, or reserve capacity for it."
    )]
    NoReservedCapacity { model: String, region: String },
}

/// A call on its way to a reservation.
pub struct Call<'a> {
    sim: &'a Inner,
    /// The on-demand bucket.
    standard: Arc<Bucket>,
    /// The reserved bucket, for a `reserved` call.
    reserved: Option<Arc<Bucket>>,
    tier: Option<Tier>,
    tallies: Vec<Arc<Tally>>,
    pub burndown: u64,
}

/// A call that got its reservation.
pub struct Admitted {
    pub reservation: Reservation,
    /// The tier that served it, to echo; `None` when the call named none.
    pub served: Option<Tier>,
}

impl<'a> Call<'a> {
    /// Looks up (or creates) the call's buckets and counts its arrival. `api` is its label in
    /// `/_sim/stats`.
    pub fn arrive(
        sim: &'a Inner,
        api: &'static str,
        model: &Resolved,
        tier: Option<Tier>,
    ) -> Result<Call<'a>, Refusal> {
        let reserved = match tier {
            Some(Tier::Reserved) => {
                if sim
                    .config
                    .limits_for(model)
                    .reserved_tokens_per_minute
                    .is_none()
                {
                    return Err(Refusal::NoReservedCapacity {
                        model: model.base.clone(),
                        region: model.region.clone(),
                    });
                }
                let key = format!("{}#reserved", model.bucket);
                Some(sim.buckets.get(&key, || info(sim, model, true)))
            }
            _ => None,
        };
        let standard = Call::bucket(sim, model);
        let tier_label = tier.unwrap_or(Tier::Default).name();
        let tallies = sim.tallies.of_call(api, tier_label, &model.region);
        for t in &tallies {
            t.requests.fetch_add(1, Relaxed);
        }
        reserved.as_ref().unwrap_or(&standard).count_request();
        Ok(Call {
            sim,
            standard,
            reserved,
            tier,
            tallies,
            burndown: models::burndown(&model.base),
        })
    }

    /// The on-demand bucket of `model`, created if new.
    pub fn bucket(sim: &Inner, model: &Resolved) -> Arc<Bucket> {
        sim.buckets.get(&model.bucket, || info(sim, model, false))
    }

    /// Counts an injected fault (the call takes no quota).
    pub fn count_fault(&self) {
        self.reserved
            .as_ref()
            .unwrap_or(&self.standard)
            .count_error();
        for t in &self.tallies {
            t.errors.fetch_add(1, Relaxed);
        }
    }

    /// Reserves `amount` (input + output cap): reserved capacity first for a `reserved` call,
    /// then the on-demand bucket within the day's quotas. A refusal is counted as a throttle.
    pub fn reserve(&self, amount: u64, input: u64) -> Result<Admitted, Shortfall> {
        let now = Instant::now();
        let day = self.sim.day();
        let admitted = |reservation: Reservation, served| Admitted {
            reservation: reservation
                .with_charge(input, self.burndown)
                .with_tallies(self.tallies.clone()),
            served,
        };
        if let Some(reserved) = &self.reserved {
            match reserved.try_reserve(amount, now, day, None) {
                Ok(r) => return Ok(admitted(r, Some(Tier::Reserved))),
                Err(_) => {
                    reserved.count_overflow();
                    self.standard.count_request();
                }
            }
        }
        let account = self
            .sim
            .config
            .account_tokens_per_day
            .map(|limit| self.sim.buckets.account(self.standard_region(), limit));
        match self
            .standard
            .try_reserve(amount, now, day, account.as_ref())
        {
            Ok(r) => {
                let served = self.tier.map(|t| match t {
                    Tier::Reserved => Tier::Default,
                    other => other,
                });
                Ok(admitted(r, served))
            }
            Err(shortfall) => {
                self.standard.count_throttle(shortfall);
                for t in &self.tallies {
                    t.throttled.fetch_add(1, Relaxed);
                    if shortfall == Shortfall::Day {
                        t.throttled_daily.fetch_add(1, Relaxed);
                    }
                }
                Err(shortfall)
            }
        }
    }

    fn standard_region(&self) -> &str {
        self.standard.region()
    }
}

/// The message of a 429 for `shortfall`.
pub fn throttle_message(shortfall: Shortfall) -> &'static str {
    match shortfall {
        Shortfall::Minute => TOO_MANY_TOKENS,
        Shortfall::Day => TOO_MANY_TOKENS_PER_DAY,
    }
}

/// What the bucket of `model` (its reserved capacity if `reserved`) is.
fn info(sim: &Inner, model: &Resolved, reserved: bool) -> BucketInfo {
    let limits = sim.config.limits_for(model);
    BucketInfo {
        region: model.region.clone(),
        model: model.base.clone(),
        route: route_label(&model.route),
        reserved,
        tokens_per_minute: match reserved {
            true => limits
                .reserved_tokens_per_minute
                .unwrap_or(limits.tokens_per_minute),
            false => limits.tokens_per_minute,
        },
        tokens_per_day: (!reserved).then_some(limits.tokens_per_day),
    }
}

fn route_label(route: &Route) -> String {
    match route {
        Route::OnDemand => "on_demand".into(),
        Route::Geographic(geo) => format!("geo:{geo}"),
        Route::Global => "global".into(),
        Route::Dedicated => "dedicated".into(),
    }
}
