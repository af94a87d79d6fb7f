//! A route's `models` allow-list, applied to every operation that names a model (in its path,
//! or in its body for StartAsyncInvoke) before anything is forwarded or counted: a model in no
//! pool, forwarded under `unknown_models = "pass"`, is still refused to a route with a list, and
//! free operations (CountTokens, StartAsyncInvoke) are held to the list like model calls.

use std::sync::Arc;

use super::{Admission, Caller, Pool, Verdict};
use crate::{
    bedrock::{BedrockError, ErrorCode, Operation},
    metrics::NO_POOL,
};

impl Admission {
    /// `Ok(None)` when `caller`'s route may call `model_id` (`resolved`: its pool and the model
    /// as the pool lists it); else the 403, or, for a shadow pool or route, `Ok(Some(_))`: the
    /// call goes on uncounted and the refusal is counted as a shadow rejection.
    pub(super) fn check_allowed(
        &self,
        operation: Operation,
        model_id: &str,
        resolved: Option<(&Arc<Pool>, &str)>,
        caller: &Caller,
    ) -> Result<Option<Verdict>, BedrockError> {
        let route = &caller.route;
        let allowed = match resolved {
            Some((_, configured)) => route.allows(configured),
            // A model in no pool is on no allow-list (config checks every entry is pooled).
            None => route.config.models.is_none(),
        };
        if allowed {
            return Ok(None);
        }
        let error = BedrockError::new(
            ErrorCode::AccessDenied,
            format!(
                "route {:?} is not allowed to call model {model_id:?}: add it to the route's models list in the tokengate config",
                route.name
            ),
        );
        match resolved {
            Some((pool, _)) => {
                self.count_for(pool, route, operation, "not_allowed");
                let shadow = pool.config.shadow || route.config.shadow;
                self.enforce_or_shadow(shadow, pool, route, "not_allowed", error)
                    .map(Some)
            }
            None => {
                self.count(NO_POOL, operation, "not_allowed");
                if !route.config.shadow {
                    return Err(error);
                }
                self.metrics
                    .shadow_rejections
                    .with_label_values(&[NO_POOL, &route.name, "not_allowed"])
                    .inc();
                Ok(Some(Verdict::Uncounted))
            }
        }
    }
}
