//! Adaptive maxTokens (issue #22): a route's `adaptive_max_tokens` learns an output cap per model,
//! writes it into the forwarded body in the field each API reads, and reserves it; before
//! `min_samples` the caller's value stands, the cap never exceeds the caller's value, and a
//! proxy-caused truncation past the target raises it at once. Through aws-sdk-bedrockruntime and
//! the simulator (which caps its output at the `maxTokens` it receives), and, for every API's own
//! field, through `Admission::decide` on a memory ledger.

use std::sync::Arc;

use aws_sdk_bedrockruntime::types::StopReason;
use bytes::Bytes;
use serde_json::{Value, json};
use tokengate::{
    admission::{Admission, Decision, Facts, adaptive::LearnerView},
    bedrock::Operation,
    config::Config,
    gateway::Gateway,
    ledger::{Clock, Ledger, MemoryLedger},
};

use crate::common::*;

pub(crate) use crate::common::apis::FAST_SIM as INSTANT_SIM;

/// One pool of Claude 3 Haiku, room for thousands of calls.
pub(crate) fn haiku_pool() -> String {
    format!(
        "[[pools]]\nname = \"haiku\"\nmodels = [\"{HAIKU}\"]\ntokens_per_minute = 10000000\n\
         max_concurrency = 64\noutput_burndown = 1\ndefault_max_tokens = 4000\n"
    )
}

/// What the first route learned for the first pool's first model.
pub(crate) async fn learned(proxy: &Gateway) -> LearnerView {
    let pools = proxy.admission().pool_views().await;
    pools[0].adaptive_max_tokens[0].clone()
}

/// A Converse call to Haiku with `max` as its maxTokens: its output tokens and stop reason.
pub(crate) async fn converse_answer(stack: &Stack, prompt: &str, max: i32) -> (i32, StopReason) {
    let out = stack
        .client()
        .converse()
        .model_id(HAIKU)
        .messages(user_message(prompt))
        .inference_config(max_tokens(max))
        .send()
        .await
        .expect("admitted and answered");
    let output = out.usage().map_or(0, |u| u.output_tokens());
    (output, out.stop_reason().clone())
}

async fn converse_output(stack: &Stack, prompt: &str, max: i32) -> i32 {
    converse_answer(stack, prompt, max).await.0
}

#[tokio::test]
async fn adaptive_cap_is_learned_written_reserved_and_raised_through_the_sdk() {
    let route =
        "[[routes]]\nname = \"chat\"\nadaptive_max_tokens = { min_samples = 20, floor = 64 }\n";
    let stack = Stack::start(INSTANT_SIM, &haiku_pool(), route).await;
    // Before min_samples the caller's 4000 stands: a long answer is not cut.
    assert_eq!(
        converse_output(&stack, "[sim:output=300] a", 4000).await,
        300
    );
    for _ in 0..18 {
        assert_eq!(
            converse_output(&stack, "[sim:output=100] b", 4000).await,
            100
        );
    }
    let before = learned(&stack.proxy).await;
    assert_eq!((before.samples, before.cap), (19, None), "{before:?}");
    assert_eq!(
        converse_output(&stack, "[sim:output=100] c", 4000).await,
        100
    );
    // 20 samples: p99.9 is the 300 (capped at the max seen) x 1.2 = 360, rounded up to 384.
    let view = learned(&stack.proxy).await;
    assert_eq!((view.samples, view.cap), (20, Some(384)), "{view:?}");
    // The forwarded body carries the cap: the simulator stops at it.
    assert_eq!(
        converse_output(&stack, "[sim:output=2000] d", 4000).await,
        384
    );
    // Never above the caller's own value.
    assert_eq!(
        converse_output(&stack, "[sim:output=2000] e", 200).await,
        200
    );
    // The reservation is the cap: a decision on the same body reserves input + 384.
    let admission = stack.proxy.admission();
    let caller = admission.first_route_caller();
    let body = Bytes::from(converse_body("[sim:output=10] f", Some(4000)));
    let Decision::Admit(admitted) = admission
        .decide(&facts(Operation::Converse, Some(HAIKU), &body, &caller))
        .await
    else {
        panic!("admitted");
    };
    let estimate = admitted.hold.estimate();
    assert_eq!(estimate.max_tokens, 384);
    assert_eq!(admitted.hold.reserved(), estimate.input + 384);
    assert_eq!(admitted.hold.adaptive_cap(), Some(384));
    drop(admitted);
    // The call at "d" stopped at the proxy's cap: one truncation is allowed in a quiet window,
    // the second passes 0.1% and raises the cap at once.
    let view = learned(&stack.proxy).await;
    assert_eq!((view.guard.proxy_truncations, view.guard.raises), (1, 0));
    assert_eq!(
        converse_output(&stack, "[sim:output=2000] g", 4000).await,
        384
    );
    let view = learned(&stack.proxy).await;
    assert_eq!((view.guard.proxy_truncations, view.guard.raises), (2, 1));
    // Margin 2.4 over the p99.9, now the truncated 384: 921.6, rounded up to 960.
    assert_eq!(view.cap, Some(960), "{view:?}");
    assert_eq!(
        converse_output(&stack, "[sim:output=900] h", 4000).await,
        900
    );
    // The same figures in /metrics, per pool, route and model.
    let m = scrape(stack.proxy.addr).await;
    let labels = [("pool", "haiku"), ("route", "chat"), ("model", HAIKU)];
    m.expect("tokengate_adaptive_max_tokens", &labels, 960.0);
    m.expect("tokengate_adaptive_capped_calls", &labels, 3.0);
    m.expect("tokengate_adaptive_proxy_truncations", &labels, 2.0);
    m.expect("tokengate_adaptive_raises", &labels, 1.0);
    stack.assert_ledger_zero().await;
}

fn facts<'a>(
    operation: Operation,
    model_id: Option<&'a str>,
    body: &'a Bytes,
    caller: &'a tokengate::admission::Caller,
) -> Facts<'a> {
    Facts {
        operation,
        model_id,
        body,
        read: None,
        caller,
        service_tier: None,
        endpoint: None,
    }
}

const TITAN: &str = "amazon.titan-text-express-v1";
const NOVA: &str = "amazon.nova-lite-v1:0";
const LLAMA: &str = "meta.llama3-8b-instruct-v1:0";
const MISTRAL: &str = "mistral.mistral-large-2402-v1:0";
const GPT_OSS: &str = "openai.gpt-oss-120b-1:0";

/// The value at the dotted `path` of `body`.
fn at<'a>(body: &'a Value, path: &str) -> &'a Value {
    path.split('.').fold(body, |v, key| &v[key])
}

#[tokio::test]
async fn adaptive_cap_is_written_in_each_apis_own_field() {
    let models = [HAIKU, TITAN, NOVA, LLAMA, MISTRAL, GPT_OSS];
    let list: Vec<String> = models.iter().map(|m| format!("{m:?}")).collect();
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nregion = \"us-east-1\"\n\
         [[pools]]\nname = \"mixed\"\nmodels = [{}]\ntokens_per_minute = 10000000\n\
         max_concurrency = 64\noutput_burndown = 1\ndefault_max_tokens = 4000\nmax_output_tokens = 8192\n\
         [[routes]]\nname = \"chat\"\nadaptive_max_tokens = {{ min_samples = 1, floor = 64 }}\n",
        list.join(", ")
    );
    let config = Config::parse(&text).unwrap_or_else(|e| panic!("{e}"));
    let ledger = Arc::new(MemoryLedger::new(Clock::tokio()));
    let p = &config.policy;
    let admission = Admission::new(&p.pools, &p.routes, p.admission.clone(), ledger.clone());
    let learners = admission.routes().routes()[0]
        .adaptive
        .as_ref()
        .expect("the route learns");
    for model in models {
        // One sample of 100 output tokens: 100 x 1.2 rounded up to 64 is 128.
        learners
            .get(model)
            .expect("every pooled model")
            .settled(100, None);
    }
    let messages = json!([{"role": "user", "content": [{"text": "hi"}]}]);
    let chat = json!([{"role": "user", "content": "hi"}]);
    // (operation, model in the path, body, the fields that must say 128)
    let cases: Vec<(Operation, Option<&str>, Value, Vec<&str>)> = vec![
        (
            Operation::Converse,
            Some(HAIKU),
            json!({"messages": messages, "inferenceConfig": {"maxTokens": 4000}}),
            vec!["inferenceConfig.maxTokens"],
        ),
        (
            Operation::ConverseStream,
            Some(HAIKU),
            json!({"messages": messages}),
            vec!["inferenceConfig.maxTokens"],
        ),
        (
            Operation::InvokeModel,
            Some(HAIKU),
            json!({"anthropic_version": "bedrock-2023-05-31", "max_tokens": 4000, "messages": chat}),
            vec!["max_tokens"],
        ),
        (
            Operation::InvokeModel,
            Some(TITAN),
            json!({"inputText": "hi", "textGenerationConfig": {"maxTokenCount": 4000}}),
            vec!["textGenerationConfig.maxTokenCount"],
        ),
        (
            Operation::InvokeModelWithResponseStream,
            Some(NOVA),
            json!({"messages": messages, "inferenceConfig": {"maxTokens": 4000}}),
            vec!["inferenceConfig.maxTokens"],
        ),
        (
            Operation::InvokeModel,
            Some(NOVA),
            json!({"messages": messages}),
            vec!["inferenceConfig.maxTokens"],
        ),
        (
            Operation::InvokeModel,
            Some(LLAMA),
            json!({"prompt": "hi", "max_gen_len": 4000}),
            vec!["max_gen_len"],
        ),
        (
            Operation::InvokeModel,
            Some(MISTRAL),
            json!({"prompt": "hi", "max_tokens": 4000}),
            vec!["max_tokens"],
        ),
        (
            Operation::OpenAIChatCompletions,
            None,
            json!({"model": GPT_OSS, "messages": chat, "max_completion_tokens": 4000, "max_tokens": 3000}),
            vec!["max_completion_tokens", "max_tokens"],
        ),
        (
            Operation::OpenAIResponses,
            None,
            json!({"model": GPT_OSS, "input": "hi", "max_output_tokens": 4000}),
            vec!["max_output_tokens"],
        ),
        (
            Operation::AnthropicMessages,
            None,
            json!({"model": HAIKU, "messages": chat, "max_tokens": 4000}),
            vec!["max_tokens"],
        ),
    ];
    let caller = admission.first_route_caller();
    for (operation, model_id, body, fields) in cases {
        let bytes = Bytes::from(body.to_string());
        let decision = admission
            .decide(&facts(operation, model_id, &bytes, &caller))
            .await;
        let Decision::Admit(admitted) = decision else {
            panic!("{operation:?} {body}: {decision:?}");
        };
        let sent: Value =
            serde_json::from_slice(admitted.body.as_ref().expect("rewritten")).expect("JSON");
        for field in fields {
            assert_eq!(
                at(&sent, field),
                &json!(128),
                "{operation:?} {field}: {sent}"
            );
        }
        assert_eq!(admitted.hold.estimate().max_tokens, 128, "{operation:?}");
        // Everything else passes as sent.
        assert_eq!(sent.get("messages"), body.get("messages"), "{operation:?}");
        assert_eq!(sent.get("prompt"), body.get("prompt"), "{operation:?}");
    }
    eventually(
        std::time::Duration::from_secs(10),
        "every hold settled",
        || ledger.stats().settlements_in_flight() == 0,
    )
    .await;
    assert_eq!(ledger.stats().unsettled_drops(), 0);
}

#[tokio::test]
async fn adaptive_a_reload_keeps_what_was_learned_unless_the_settings_change() {
    let route = |floor: u64| {
        format!(
            "[[routes]]\nname = \"chat\"\nadaptive_max_tokens = {{ min_samples = 5, floor = {floor} }}\n"
        )
    };
    let stack = Stack::start(INSTANT_SIM, &haiku_pool(), &route(64)).await;
    for _ in 0..5 {
        assert_eq!(
            converse_output(&stack, "[sim:output=100] a", 4000).await,
            100
        );
    }
    assert_eq!(learned(&stack.proxy).await.cap, Some(128));
    let same = proxy_config(stack.sim.addr, &haiku_pool(), &route(64));
    stack.proxy.reload(same).expect("reloads");
    let kept = learned(&stack.proxy).await;
    assert_eq!((kept.samples, kept.cap), (5, Some(128)), "{kept:?}");
    assert_eq!(
        converse_output(&stack, "[sim:output=900] b", 4000).await,
        128
    );
    let changed = proxy_config(stack.sim.addr, &haiku_pool(), &route(32));
    stack.proxy.reload(changed).expect("reloads");
    let fresh = learned(&stack.proxy).await;
    assert_eq!((fresh.samples, fresh.cap), (0, None), "{fresh:?}");
    assert_eq!(
        converse_output(&stack, "[sim:output=900] c", 4000).await,
        900
    );
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn adaptive_a_call_without_max_tokens_carries_and_reserves_the_learned_cap() {
    let route =
        "[[routes]]\nname = \"chat\"\nadaptive_max_tokens = { min_samples = 3, floor = 64 }\n";
    let stack = Stack::start(INSTANT_SIM, &haiku_pool(), route).await;
    for _ in 0..3 {
        assert_eq!(
            converse_output(&stack, "[sim:output=100] a", 4000).await,
            100
        );
    }
    assert_eq!(learned(&stack.proxy).await.cap, Some(128));
    // No maxTokens: the pool would reserve the model's maximum (reserve_model_max); the learned
    // cap is written in instead, so upstream stops at it.
    let out = stack
        .client()
        .converse()
        .model_id(HAIKU)
        .messages(user_message("[sim:output=900] b"))
        .send()
        .await
        .expect("admitted and answered");
    assert_eq!(out.usage().map(|u| u.output_tokens()), Some(128));
    let admission = stack.proxy.admission();
    let caller = admission.first_route_caller();
    let body = Bytes::from(converse_body("[sim:output=10] c", None));
    let Decision::Admit(admitted) = admission
        .decide(&facts(Operation::Converse, Some(HAIKU), &body, &caller))
        .await
    else {
        panic!("admitted");
    };
    assert_eq!(
        admitted.hold.estimate().max_tokens,
        128,
        "not the model's maximum"
    );
    drop(admitted);
    stack.assert_ledger_zero().await;
}
