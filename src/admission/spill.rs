//! Spilling: where a request may run when its home pool cannot admit it now (issue #18).
//!
//! A request's spill candidates are its home pool's chain ([`crate::config::spill`]), in order,
//! less the pools it may not use: none unless its route has `spill = true`; none outside the
//! route's `regions`; none when the home pool has `spill_cached = false` and the body holds a
//! prompt-cache point; none that could never hold its reservation; none whose queue has
//! requests waiting (they come first there). [`super::candidates`] then tries the home pool and
//! these in order, and the first with room now wins.
//!
//! A spilled request keeps the reservation estimated for its home pool (the same model, so the
//! same arithmetic): that estimate counts every input token, cached or not, so the cache write a
//! spilled request pays in a Region whose cache does not hold its prefix is within it.
//!
//! When no candidate admits now, the request waits in its home pool's queue if it has one (the
//! dispatcher there admits in the home pool only: the chain was tried once, and a request that
//! waits is one the chain had no room for either), else gets its 429 with the soonest hint of
//! the pools tried.

use std::sync::Arc;

use super::{
    Admission, Admitted, Decision, Facts, Invalid, Pool, Throttle, candidates::Refusal, hint,
    rewrite,
};
use crate::bedrock::Operation;
use crate::ledger::Rejection;

/// JSON member names that mark a prompt-cache point: Converse's `cachePoint`, Anthropic's
/// `cache_control`.
const CACHE_POINT_KEYS: [&[u8]; 2] = [b"\"cachePoint\"", b"\"cache_control\""];

/// Whether `body` holds a prompt-cache point. A byte search (run only when spilling is on the
/// table): a prompt whose text quotes one of the member names errs toward staying home.
pub fn has_cache_point(body: &[u8]) -> bool {
    CACHE_POINT_KEYS
        .iter()
        .any(|key| body.windows(key.len()).any(|w| w == *key))
}

impl Admission {
    /// The pools `home`'s request may spill to, in order (see the module doc).
    pub(super) fn spill_candidates(
        &self,
        home: &Pool,
        facts: &Facts<'_>,
        tokens: u64,
    ) -> Vec<&Arc<Pool>> {
        let route = &facts.caller.route.config;
        let chain = self.table.chain(home.id);
        if chain.is_empty() || !route.spill || !spills(facts.operation) {
            return Vec::new();
        }
        let body = facts.body;
        if !home.config.spill_cached && has_cache_point(body) {
            return Vec::new();
        }
        let pools = self.pools();
        chain
            .iter()
            .filter_map(|&id| pools.get(id))
            .filter(|pool| {
                let in_regions = route
                    .regions
                    .as_ref()
                    .is_none_or(|r| r.contains(&pool.config.region));
                let queue_busy = pool.queue.enabled() && !pool.queue.is_empty();
                in_regions && !queue_busy && pool.can_ever_hold(tokens)
            })
            .collect()
    }

    /// The 429 when no candidate admitted now and the home pool does not queue: the home pool's
    /// binding limit, with the soonest hint of the pools tried.
    pub(super) fn throttle_soonest(
        &self,
        home: &Arc<Pool>,
        home_rejection: &Rejection,
        refused: &[(Arc<Pool>, Refusal)],
        tokens: u64,
    ) -> Decision {
        let mut decision = self.throttle(home, home_rejection, tokens);
        let soonest = refused
            .iter()
            .filter(|(pool, _)| pool.id != home.id)
            .filter_map(|(pool, refusal)| match refusal {
                Refusal::NoRoom(r) => Some((pool, r)),
                Refusal::Failed(_) => None,
            })
            .map(|(pool, r)| hint::projected_wait(r, pool.history(), self.config.max_retry_hint))
            .min();
        if let (Decision::Throttle(Throttle { hint, .. }), Some(wait)) = (&mut decision, soonest) {
            let home_wait =
                hint::projected_wait(home_rejection, home.history(), self.config.max_retry_hint);
            if wait < home_wait {
                *hint = self.hint(wait);
            }
        }
        decision
    }
}

/// Whether `operation` may spill: it names its model in the path (rewritten on the way out) or,
/// for the OpenAI and Anthropic APIs, in the body's `model` (rewritten here); a bidirectional
/// session (admitted from its head) and StartAsyncInvoke (a job, not a call) stay home.
fn spills(operation: Operation) -> bool {
    operation.model_in_body()
        || (operation.model_segment().is_some()
            && operation != Operation::InvokeModelWithBidirectionalStream)
}

/// The decision for `admitted`: a spilled call of an API that names its model in the body is
/// sent with the body's `model` set to its pool's (the path of a native call is rewritten by
/// the forwarder). A body that cannot be rewritten (it was read as a JSON object already, so
/// this does not happen) is refused, its reservation given back.
pub(super) fn sent_as_its_pool(mut admitted: Admitted, facts: &Facts<'_>) -> Decision {
    if admitted.spilled_from.is_none() || !facts.operation.model_in_body() {
        return Decision::Admit(admitted);
    }
    let body = admitted.body.as_ref().unwrap_or(facts.body);
    let model = admitted.hold.pool().config.model_id();
    match rewrite::with_model(facts.operation, body, model) {
        Ok(body) => {
            admitted.body = Some(body);
            Decision::Admit(admitted)
        }
        Err(problem) => {
            admitted.hold.settle_not_charged();
            Decision::Invalid(Invalid {
                pool: admitted.spilled_from.clone(),
                problem,
            })
        }
    }
}

/// The home pool's own refusal among `refused`, if it was tried.
pub(super) fn home_refusal<'r>(
    home: &Pool,
    refused: &'r [(Arc<Pool>, Refusal)],
) -> Option<&'r Refusal> {
    refused
        .iter()
        .find(|(pool, _)| pool.id == home.id)
        .map(|(_, r)| r)
}
