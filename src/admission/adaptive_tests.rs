use proptest::prelude::*;

use super::*;

fn params(floor: u64, min_samples: u64) -> AdaptiveMaxTokens {
    AdaptiveMaxTokens {
        floor,
        min_samples,
        ..AdaptiveMaxTokens::default()
    }
}

#[test]
fn adaptive_the_callers_value_stands_until_min_samples() {
    let learner = Learner::new(params(256, 300));
    for _ in 0..299 {
        learner.settled(100, None);
        assert_eq!(learner.cap_for(32_000), None, "fewer than min_samples");
    }
    learner.settled(100, None);
    // 100 x 1.2 = 120, rounded up to 128, raised to the floor.
    assert_eq!(learner.cap_for(32_000), Some(256));
    let view = learner.view("r", "m");
    assert_eq!((view.samples, view.cap), (300, Some(256)));
}

#[test]
fn adaptive_cap_is_the_quantile_times_the_margin_rounded_up() {
    let learner = Learner::new(params(1, 1000));
    for v in 1..=1000 {
        learner.settled(v, None);
    }
    // p99.9 of 1..=1000 is 999 or 1000 (the bucket's edge, capped at the max seen) x 1.2,
    // rounded up to 64.
    let cap = learner.cap_for(u64::MAX).expect("learned");
    assert!(cap == 1216 || cap == 1200_u64.div_ceil(64) * 64, "{cap}");
    assert!(cap.is_multiple_of(64) && cap >= 1199, "{cap}");
}

#[test]
fn adaptive_never_above_the_callers_value_nor_below_the_floor() {
    let learner = Learner::new(params(512, 10));
    for _ in 0..10 {
        learner.settled(50, None);
    }
    assert_eq!(learner.cap_for(10_000), Some(512), "the floor, not 64");
    assert_eq!(
        learner.cap_for(512),
        None,
        "equal to the caller's: nothing to write"
    );
    assert_eq!(
        learner.cap_for(300),
        None,
        "the caller's own below the floor stands"
    );
}

#[test]
fn adaptive_a_truncation_counts_only_under_the_proxys_cap() {
    let learner = Arc::new(Learner::new(params(64, 1)));
    let uncapped = Ticket {
        learner: learner.clone(),
        cap: None,
        written: false,
        caller: 100,
    };
    uncapped.settled(100, true);
    assert_eq!(learner.view("r", "m").guard.capped_calls, 0);
    let capped = Ticket {
        learner: learner.clone(),
        cap: Some(128),
        written: true,
        caller: 4096,
    };
    capped.settled(90, false);
    capped.settled(128, false); // reached the cap: the stop reason need not say so
    capped.settled(100, true); // the stop reason said so
    let guard = learner.view("r", "m").guard;
    assert_eq!((guard.capped_calls, guard.proxy_truncations), (3, 2));
    // Observed only (a shadow route): the caller's own cap stopped it, not the proxy's; an
    // output past the cap it would have written counts as the truncation it would have been.
    let observed = Ticket {
        written: false,
        ..capped
    };
    observed.settled(100, true);
    observed.settled(300, false);
    let guard = learner.view("r", "m").guard;
    assert_eq!((guard.capped_calls, guard.proxy_truncations), (5, 3));
    assert_eq!(observed.written_cap(), None, "nothing written");
}

#[test]
fn adaptive_the_cap_rises_at_once_past_the_target() {
    let learner = Learner::new(params(64, 20));
    for _ in 0..20 {
        learner.settled(100, None);
    }
    let before = learner.cap_for(u64::MAX).expect("learned");
    assert_eq!(before, 128);
    // target 0.1%: over the first 1000 capped calls one truncation is allowed, the second raises.
    learner.settled(128, Some(true));
    assert_eq!(learner.cap_for(u64::MAX), Some(before));
    learner.settled(128, Some(true));
    // The margin doubles (1.2 -> 2.4) over the p99.9, now the truncated 128: 307, up to 320.
    assert_eq!(learner.cap_for(u64::MAX), Some(320), "raised at once");
    assert_eq!(learner.view("r", "m").guard.raises, 1);
}

#[test]
fn adaptive_the_guard_window_tumbles() {
    let mut guard = Guard::default();
    let target = 0.01; // window 1000 calls, at least 100 counted
    assert!(!guard.record(true, target));
    for _ in 0..998 {
        assert!(!guard.record(false, target));
    }
    // 1000 calls: the window restarts, its one truncation forgotten.
    assert!(!guard.record(false, target));
    assert_eq!((guard.window_calls, guard.window_truncated), (0, 0));
    assert!(
        !guard.record(true, target),
        "one in a new window is allowed"
    );
    assert!(
        guard.record(true, target),
        "the second of 2 calls passes 1%"
    );
    assert_eq!((guard.raises, guard.proxy_truncations), (1, 3));
}

#[test]
fn adaptive_route_learners_cover_the_routes_models() {
    let toml = "[server]\nlisten = \"127.0.0.1:8080\"\n[upstream]\nregion = \"us-east-1\"\n\
                [ledger]\nbackend = \"memory\"\n[[pools]]\nname = \"p\"\n\
                models = [\"a.m-1\", \"a.m-2\"]\ntokens_per_minute = 100000\nmax_concurrency = 4\noutput_burndown = 1\ndefault_max_tokens = 4096\nmax_output_tokens = 8192\n";
    let pools: Vec<PoolConfig> = crate::config::Config::parse(toml)
        .map(|c| c.policy.pools)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut route = RouteConfig::implicit("r");
    assert!(RouteLearners::new(&route, &pools).is_none(), "not opted in");
    route.adaptive_max_tokens = Some(AdaptiveMaxTokens {
        models: Some(vec!["a.m-2".into()]),
        ..AdaptiveMaxTokens::default()
    });
    let learners = RouteLearners::new(&route, &pools).expect("opted in");
    assert!(learners.get("a.m-1").is_none());
    let ticket = learners
        .ticket("a.m-2", 4096, Capping::Write)
        .expect("covered");
    assert_eq!((ticket.cap, ticket.caller), (None, 4096));
}

/// Outputs drawn around `typical`, with a share `long` of them `stretch` times longer.
fn output(typical: u64, long: bool, stretch: u64, jitter: u64) -> u64 {
    let base = typical + jitter % (typical / 2 + 1);
    if long { base * stretch } else { base }
}

proptest! {
    /// The controller against any workload: the cap written is below the caller's value and at
    /// least the floor, only after min_samples; it never falls while the guard is raising, and
    /// each raise lifts it at once. Truncations under the proxy's cap never sit in the guard's
    /// window past the target without a raise.
    #[test]
    fn adaptive_controller_invariants(
        typical in 1u64..2000,
        floor in 1u64..1024,
        min_samples in 1u64..400,
        callers in prop::collection::vec(1u64..40_000, 1..8),
        calls in prop::collection::vec((any::<bool>(), 1u64..20, any::<u64>(), 0u8..100), 1..1500),
    ) {
        let p = params(floor, min_samples);
        let target = p.truncation_target;
        let learner = Learner::new(p);
        for (i, (long, stretch, jitter, share)) in calls.into_iter().enumerate() {
            let caller = callers[i % callers.len()];
            let samples_before = learner.view("r", "m").samples;
            let cap = learner.cap_for(caller);
            if let Some(cap) = cap {
                prop_assert!(cap < caller, "cap {cap} >= caller {caller}");
                prop_assert!(cap >= floor, "cap {cap} < floor {floor}");
                prop_assert!(samples_before >= min_samples, "capped after {samples_before}");
            }
            // One long output in a hundred calls on average, when `long` and `share` agree.
            let wanted = output(typical, long && share == 0, stretch, jitter);
            let limit = cap.unwrap_or(caller);
            let got = wanted.min(limit);
            let in_force = learner.cap.load(Ordering::Relaxed);
            let raises_before = learner.view("r", "m").guard.raises;
            learner.settled(got, cap.map(|c| got >= c));
            let after = learner.view("r", "m");
            if after.guard.raises > raises_before {
                let risen = learner.cap.load(Ordering::Relaxed);
                prop_assert!(risen > in_force, "raised from {in_force} to {risen}");
            }
            let allowed = target * (after.guard.window_calls as f64).max((1.0 / target).ceil());
            prop_assert!(after.guard.window_truncated as f64 <= allowed + 1e-9);
        }
    }
}
