//! Adaptive maxTokens where it meets the rest of the policy (issue #22's open decisions): a
//! shadow route observes its learned cap without writing it; a call that names no maxTokens and
//! gets the learned cap counts as `adaptive_cap` in `tokengate_max_tokens_missing_total`; a
//! spilled call keeps the cap of the model it asked for, and that model's learner learns from it;
//! a call asking for more than the model's maximum is not capped (Bedrock refuses it).
//! Through the Rust SDK or raw HTTP and the simulator, which stops at the maxTokens it receives.

use bytes::Bytes;
use tokengate::{
    admission::{Decision, Facts, adaptive::LearnerView},
    bedrock::Operation,
    gateway::Gateway,
    ledger::{ReserveRequest, Verdict},
};

use crate::{
    adaptive::{INSTANT_SIM, haiku_pool},
    common::*,
};

/// A route `chat` learning from 3 calls, floor 64; `extra` adds keys.
fn route(extra: &str) -> String {
    format!(
        "[[routes]]\nname = \"chat\"\n{extra}adaptive_max_tokens = {{ min_samples = 3, floor = 64 }}\n"
    )
}

/// What route `chat` learned for `model`.
async fn learned(proxy: &Gateway, model: &str) -> LearnerView {
    let pools = proxy.admission().pool_views().await;
    pools
        .iter()
        .flat_map(|p| p.adaptive_max_tokens.iter())
        .find(|v| v.model == model)
        .cloned()
        .unwrap_or_else(|| panic!("no learner for {model}"))
}

async fn output_of(
    proxy: &Gateway,
    model: &str,
    prompt: &str,
    max: Option<u64>,
) -> (u64, RawResponse) {
    let raw = converse(proxy.addr, model, prompt, max).await;
    assert_eq!(raw.status, 200, "{:?}", raw.body);
    let v: serde_json::Value = serde_json::from_slice(&raw.body).expect("JSON");
    let output = v["usage"]["outputTokens"].as_u64().expect("usage");
    (output, raw)
}

async fn learn(proxy: &Gateway, model: &str) {
    for _ in 0..3 {
        assert_eq!(
            output_of(proxy, model, "[sim:output=100] a", Some(4000))
                .await
                .0,
            100
        );
    }
    assert_eq!(learned(proxy, model).await.cap, Some(128));
}

#[tokio::test]
async fn adaptive_a_shadow_route_observes_the_cap_without_writing_it() {
    let stack = Stack::start(INSTANT_SIM, &haiku_pool(), &route("shadow = true\n")).await;
    learn(&stack.proxy, HAIKU).await;
    // The caller's 4000 goes upstream: the 900-token answer is not cut.
    let (output, _) = output_of(&stack.proxy, HAIKU, "[sim:output=900] b", Some(4000)).await;
    assert_eq!(output, 900);
    // The learner counts what the cap would have done: one call capped, one truncation.
    let view = learned(&stack.proxy, HAIKU).await;
    assert_eq!(
        (view.guard.capped_calls, view.guard.proxy_truncations),
        (1, 1),
        "{view:?}"
    );
    // Nothing rewritten, the caller's value reserved.
    let admission = stack.proxy.admission();
    let caller = admission.first_route_caller();
    let body = Bytes::from(converse_body("[sim:output=10] c", Some(4000)));
    let facts = Facts {
        operation: Operation::Converse,
        model_id: Some(HAIKU),
        body: &body,
        read: None,
        caller: &caller,
        service_tier: None,
        endpoint: None,
    };
    let Decision::Admit(admitted) = admission.decide(&facts).await else {
        panic!("admitted");
    };
    assert!(admitted.body.is_none(), "forwarded as sent");
    assert_eq!(admitted.hold.estimate().max_tokens, 4000);
    assert_eq!(admitted.hold.adaptive_cap(), None);
    drop(admitted);
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn adaptive_a_call_without_max_tokens_that_gets_the_cap_counts_as_adaptive_cap() {
    let stack = Stack::start(INSTANT_SIM, &haiku_pool(), &route("")).await;
    let missing = |action: &'static str| [("pool", "haiku"), ("route", "chat"), ("action", action)];
    // Before min_samples: the pool's rule (the model's maximum reserved).
    assert_eq!(
        output_of(&stack.proxy, HAIKU, "[sim:output=100] a", None)
            .await
            .0,
        100
    );
    learn(&stack.proxy, HAIKU).await;
    assert_eq!(
        output_of(&stack.proxy, HAIKU, "[sim:output=900] b", None)
            .await
            .0,
        128
    );
    let m = scrape(stack.proxy.addr).await;
    m.expect(
        "tokengate_max_tokens_missing_total",
        &missing("reserve_model_max"),
        1.0,
    );
    m.expect(
        "tokengate_max_tokens_missing_total",
        &missing("adaptive_cap"),
        1.0,
    );
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn adaptive_a_call_asking_above_the_models_maximum_is_not_capped() {
    let pool = format!("{}max_output_tokens = 4096\n", haiku_pool());
    let stack = Stack::start(INSTANT_SIM, &pool, &route("")).await;
    learn(&stack.proxy, HAIKU).await;
    let admission = stack.proxy.admission();
    let caller = admission.first_route_caller();
    let decide = |max: u64| {
        let body = Bytes::from(converse_body("[sim:output=10] c", Some(max)));
        let caller = &caller;
        let admission = &admission;
        async move {
            let facts = Facts {
                operation: Operation::Converse,
                model_id: Some(HAIKU),
                body: &body,
                read: None,
                caller,
                service_tier: None,
                endpoint: None,
            };
            match admission.decide(&facts).await {
                Decision::Admit(admitted) => admitted,
                _ => panic!("admitted"),
            }
        }
    };
    // At the model's maximum the learned cap is written ...
    let at_max = decide(4096).await;
    assert_eq!(at_max.hold.adaptive_cap(), Some(128));
    assert!(at_max.body.is_some(), "rewritten with the cap");
    drop(at_max);
    // ... above it the body goes as sent, for Bedrock to refuse as it would without the proxy.
    let above = decide(4097).await;
    assert_eq!(above.hold.adaptive_cap(), None);
    assert!(above.body.is_none(), "forwarded as sent");
    assert_eq!(above.hold.estimate().max_tokens, 4097);
    drop(above);
    stack.assert_ledger_zero().await;
}

/// `sonnet-us` (one permit, no queue) spills to `sonnet-global`.
fn spill_pools() -> String {
    let pool = |name: &str, model: &str, extra: &str| {
        format!(
            "[[pools]]\nname = \"{name}\"\nmodels = [\"{model}\"]\ntokens_per_minute = 1000000\n\
             max_concurrency = 1\noutput_burndown = 5\ndefault_max_tokens = 1000\nmax_wait_ms = 0\n{extra}\n"
        )
    };
    [
        pool("sonnet-us", SONNET_US, "spill_to = [\"sonnet-global\"]\n"),
        pool("sonnet-global", SONNET_GLOBAL, ""),
    ]
    .join("\n")
}

#[tokio::test]
async fn adaptive_a_spilled_call_keeps_its_models_cap_and_learner() {
    let stack = Stack::start(INSTANT_SIM, &spill_pools(), &route("spill = true\n")).await;
    learn(&stack.proxy, SONNET_US).await;
    // The home pool full: the call runs in sonnet-global, capped at what the route learned for
    // the model it asked for.
    let admission = stack.proxy.admission();
    let home = admission
        .pools()
        .iter()
        .find(|p| &*p.name == "sonnet-us")
        .expect("pool");
    let Ok(Verdict::Granted(held)) = admission
        .ledger()
        .reserve(&ReserveRequest {
            pool: "sonnet-us",
            limits: home.limits(),
            tokens: 1,
            share: None,
            hold_back: 0,
        })
        .await
    else {
        panic!("the home pool's one permit");
    };
    let (output, raw) = output_of(&stack.proxy, SONNET_US, "[sim:output=900] b", Some(4000)).await;
    assert_eq!(raw.header("x-tokengate-pool"), Some("sonnet-global"));
    assert_eq!(output, 128, "the cap went with it");
    admission.ledger().settle(held, 1).await.expect("settle");
    // Its output is the asked-for model's sample; the spill pool's model learned nothing.
    let home_view = learned(&stack.proxy, SONNET_US).await;
    assert_eq!(
        (
            home_view.samples,
            home_view.guard.capped_calls,
            home_view.guard.proxy_truncations
        ),
        (4, 1, 1),
        "{home_view:?}"
    );
    assert_eq!(learned(&stack.proxy, SONNET_GLOBAL).await.samples, 0);
    stack.assert_ledger_zero().await;
}
