//! Ordered candidate pools: the first that admits now wins.
//!
//! One mechanism for every "this pool, else that one" of admission: a spill chain (issue #18: the
//! home pool, then its `spill_to` chain) and, once merged, the service tiers (reserved capacity,
//! then the standard pool). The caller decides which pools are candidates and in what order
//! (fixed by the config, so every replica tries the same ones in the same order); this walks
//! them.
//!
//! Each candidate gets one ledger call (one Redis round trip), in order, and the walk stops at
//! the first grant. A ledger decision takes all of a pool's limits or none, and the walk never
//! asks another pool after a grant, so no reservation is ever held in two pools, whatever runs
//! at the same time. A refusal holds nothing. A ledger error counts as that pool not admitting
//! now: the walk goes on to the next candidate, and the caller sees the error among the
//! refusals (all failed: the ledger is out, as for a single pool).

use std::future::Future;

use crate::ledger::{LedgerError, Rejection, Reservation, Verdict};

/// Why one candidate did not admit.
#[derive(Debug)]
pub enum Refusal {
    /// No room now.
    NoRoom(Rejection),
    /// The ledger could not decide.
    Failed(LedgerError),
}

/// What the walk found, for candidates of type `P` (a pool, or its id).
#[derive(Debug)]
pub enum FirstAdmitting<P> {
    /// `pool` admitted (the refusals of the candidates before it are dropped: they hold nothing).
    Admitted { pool: P, reservation: Reservation },
    /// No candidate admits now: each one's refusal, in the order tried.
    Refused(Vec<(P, Refusal)>),
}

/// Tries `candidates` (pools, in order) with `try_now` (one ledger decision each) and stops at
/// the first that grants.
pub async fn first_admitting<P: Clone, Fut>(
    candidates: Vec<P>,
    mut try_now: impl FnMut(P) -> Fut,
) -> FirstAdmitting<P>
where
    Fut: Future<Output = Result<Verdict, LedgerError>>,
{
    let mut refused = Vec::new();
    for pool in candidates {
        match try_now(pool.clone()).await {
            Ok(Verdict::Granted(reservation)) => {
                return FirstAdmitting::Admitted { pool, reservation };
            }
            Ok(Verdict::Refused(rejection)) => refused.push((pool, Refusal::NoRoom(rejection))),
            Err(error) => refused.push((pool, Refusal::Failed(error))),
        }
    }
    FirstAdmitting::Refused(refused)
}
