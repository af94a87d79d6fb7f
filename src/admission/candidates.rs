//! An ordered list of candidate pools for one request: the first that admits it *now* wins, all
//! or nothing (a pool that refuses takes nothing; the next is asked). Service tiers use it
//! (`reserved` capacity first, overflowing to the on-demand pool as Bedrock does:
//! [`crate::bedrock::tier`]); spillover
//! across pools (issue #18) is the same mechanism with a longer list.
//!
//! Only immediate admission is tried here: when no candidate admits now, the caller falls back
//! to its home pool's usual path (its queue, its refusal and hint).

use std::sync::Arc;

use super::{Admission, Caller, Pool, reserve::Granted};
use crate::ledger::Verdict;

impl Admission {
    /// The first pool of `candidates` (pool ids, in order) that admits `tokens` now, and its
    /// reservation; `None` when none does. A pool that can never hold `tokens`, or whose ledger
    /// fails, is passed over.
    pub(super) async fn first_admitting_now(
        &self,
        candidates: &[usize],
        tokens: u64,
        caller: &Caller,
    ) -> Option<(Arc<Pool>, Granted)> {
        for &id in candidates {
            let Some(pool) = self.pools().get(id) else {
                continue;
            };
            if !pool.config.can_ever_hold(tokens) {
                continue;
            }
            if let Ok(Verdict::Granted(reservation)) = self.try_reserve(pool, tokens, caller).await
            {
                let granted = Granted {
                    reservation,
                    queued_for: None,
                    budgets: None,
                };
                return Some((pool.clone(), granted));
            }
        }
        None
    }
}
