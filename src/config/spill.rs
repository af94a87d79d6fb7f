//! Spill chains: `pools[].spill_to` (where a request runs when its home pool cannot admit it
//! now), and the routes' say over them (`routes[].spill`, `routes[].regions`).
//!
//! A pool's chain is its `spill_to` list in order, then the lists of those pools in turn
//! (breadth first, each pool once, never the home pool): fixed by the config alone, so every
//! replica tries the same pools in the same order. Each pool named must exist, must not be the
//! pool itself, and must serve the same model (the base model of its first model id, the id a
//! spilled request is sent with); no chain may lead back to where it started. A pool whose first
//! model names no base model (a provisioned or custom model ARN) cannot be checked and is taken
//! as serving what the chain says.
//!
//! A route with `regions` never leaves those Regions: every pool it may call must be in one
//! (else the config is refused), and pools of a chain outside them are skipped at run time.

use std::collections::BTreeMap;

use super::{ConfigError, PoolConfig, RouteConfig, invalid};
use crate::bedrock::ModelRef;

/// The base model a pool serves, when its first model id names one.
fn family(pool: &PoolConfig) -> Option<&str> {
    ModelRef::parse(pool.model_id()).base_model
}

fn key(i: usize, pool: &PoolConfig) -> String {
    format!("pools[{i}] ({}).spill_to", pool.name)
}

/// Every `spill_to` names another existing pool of the same model, once, and no chain cycles.
pub(super) fn check_chains(pools: &[PoolConfig]) -> Result<(), ConfigError> {
    let index: BTreeMap<&str, usize> = pools
        .iter()
        .enumerate()
        .map(|(i, p)| (p.name.as_str(), i))
        .collect();
    for (i, pool) in pools.iter().enumerate() {
        for (n, name) in pool.spill_to.iter().enumerate() {
            let Some(&j) = index.get(name.as_str()) else {
                return Err(invalid(
                    key(i, pool),
                    format!("there is no pool named {name:?}"),
                ));
            };
            if j == i {
                return Err(invalid(key(i, pool), "a pool cannot spill to itself"));
            }
            if pool.spill_to[..n].contains(name) {
                return Err(invalid(key(i, pool), format!("{name:?} is listed twice")));
            }
            if let (Some(mine), Some(theirs)) = (family(pool), family(&pools[j]))
                && mine != theirs
            {
                return Err(invalid(
                    key(i, pool),
                    format!(
                        "pool {name:?} serves {theirs}, not {mine}: a request spills only to the same model"
                    ),
                ));
            }
        }
        if let Some(back) = cycle(pools, &index, i) {
            return Err(invalid(
                key(i, pool),
                format!(
                    "the chain leads back to {:?} through {back:?}: spill chains must not cycle",
                    pool.name
                ),
            ));
        }
    }
    Ok(())
}

/// A pool on pool `home`'s chain that lists `home` in its `spill_to`, if any.
fn cycle<'a>(
    pools: &'a [PoolConfig],
    index: &BTreeMap<&str, usize>,
    home: usize,
) -> Option<&'a str> {
    chain_of(pools, index, home)
        .into_iter()
        .map(|j| &pools[j])
        .find(|p| p.spill_to.contains(&pools[home].name))
        .map(|p| p.name.as_str())
}

/// Pool `home`'s chain as indexes into `pools` (see the module doc); `pools` are validated.
pub fn chain(pools: &[PoolConfig], home: usize) -> Vec<usize> {
    let index: BTreeMap<&str, usize> = pools
        .iter()
        .enumerate()
        .map(|(i, p)| (p.name.as_str(), i))
        .collect();
    chain_of(pools, &index, home)
}

fn chain_of(pools: &[PoolConfig], index: &BTreeMap<&str, usize>, home: usize) -> Vec<usize> {
    let mut out: Vec<usize> = Vec::new();
    let mut next = 0;
    let mut frontier = vec![home];
    while let Some(&at) = frontier.get(next) {
        next += 1;
        for name in &pools[at].spill_to {
            if let Some(&j) = index.get(name.as_str())
                && j != home
                && !out.contains(&j)
            {
                out.push(j);
                frontier.push(j);
            }
        }
    }
    out
}

/// A route with `regions` may call no pool outside them.
pub(super) fn check_route_regions(
    routes: &[RouteConfig],
    pools: &[PoolConfig],
    application_profiles: &BTreeMap<String, String>,
) -> Result<(), ConfigError> {
    for (i, route) in routes.iter().enumerate() {
        let Some(regions) = &route.regions else {
            continue;
        };
        let callable = |pool: &PoolConfig| match &route.models {
            None => true,
            Some(models) => models.iter().any(|m| {
                let model = application_profiles.get(m).unwrap_or(m);
                pool.models.contains(model)
            }),
        };
        if let Some(pool) = pools
            .iter()
            .find(|p| callable(p) && !regions.contains(&p.region))
        {
            return Err(invalid(
                format!("routes[{i}] ({}).regions", route.name),
                format!(
                    "pool {:?}, which the route may call, is in {}, outside {regions:?}: add the Region, \
                     or leave the pool's models out of routes[{i}].models",
                    pool.name, pool.region
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "spill_tests.rs"]
mod tests;
