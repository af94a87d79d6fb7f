//! A route's `models` allow-list, applied to every operation that names a model (in its path,
//! or in its body for StartAsyncInvoke) before anything is passed through: a model in no pool,
//! forwarded to others under `unknown_models = "pass"`, is still refused to a route with a list,
//! and free operations (CountTokens, StartAsyncInvoke) are held to the list like model calls.

use std::sync::Arc;

use super::{Decision, NotAllowed, Pass, Pool, Route, ShadowReason};

/// `None` when `route` may call `model_id` (`resolved`: its pool and the model as the pool lists
/// it); else the refusal, or for a shadow pool or route, the pass that says what was waived.
pub(super) fn check(
    route: &Route,
    model_id: &str,
    resolved: Option<(&Arc<Pool>, &str)>,
) -> Option<Decision> {
    let allowed = match resolved {
        Some((_, configured)) => route.allows(configured),
        // A model in no pool is on no allow-list (config checks every entry is pooled).
        None => route.config.models.is_none(),
    };
    if allowed {
        return None;
    }
    let pool = resolved.map(|(pool, _)| pool.clone());
    let shadow = route.config.shadow || pool.as_ref().is_some_and(|p| p.config.shadow);
    Some(if shadow {
        Decision::Pass(Pass::Shadow {
            pool,
            reason: ShadowReason::NotAllowed,
        })
    } else {
        Decision::NotAllowed(NotAllowed {
            pool,
            route: route.name.clone(),
            model: model_id.to_string(),
        })
    })
}
