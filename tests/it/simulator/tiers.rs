//! Service tiers: read from the Converse body and the InvokeModel header, echoed where the API
//! echoes them; priority/default/flex draw on the on-demand bucket, reserved on the model's
//! reserved capacity and overflows to on-demand when that is full; an unknown tier is a
//! ValidationException.

use aws_sdk_bedrockruntime::{
    primitives::Blob,
    types::{ConverseStreamOutput, ServiceTier, ServiceTierType},
};
use serde_json::{Value, json};
use tokengate::simulator::{QuotaOverride, SimulatorConfig};

use super::{SONNET, anthropic_body, client, instant_config, max_tokens, post_with, start, user};

fn tier(t: ServiceTierType) -> ServiceTier {
    ServiceTier::builder().r#type(t).build().unwrap()
}

#[tokio::test]
async fn tiers_are_read_echoed_and_counted() {
    let sim = start(instant_config()).await;
    let c = client(&sim, "secret");
    let out = c
        .converse()
        .model_id(SONNET)
        .messages(user("flex me [sim:output=3]"))
        .service_tier(tier(ServiceTierType::Flex))
        .send()
        .await
        .unwrap();
    assert_eq!(
        out.service_tier().map(|t| t.r#type()),
        Some(&ServiceTierType::Flex)
    );
    let flex_charge = out.usage().unwrap().input_tokens() as u64 + 5 * 3;

    let mut stream = c
        .converse_stream()
        .model_id(SONNET)
        .messages(user("hurry [sim:output=2]"))
        .service_tier(tier(ServiceTierType::Priority))
        .send()
        .await
        .unwrap()
        .stream;
    let mut echoed = None;
    while let Some(event) = stream.recv().await.unwrap() {
        if let ConverseStreamOutput::Metadata(m) = event {
            echoed = m.service_tier().map(|t| t.r#type().clone());
        }
    }
    assert_eq!(echoed, Some(ServiceTierType::Priority));

    let out = c
        .invoke_model()
        .model_id(SONNET)
        .body(Blob::new(anthropic_body("header tier [sim:output=1]", 10)))
        .service_tier(ServiceTierType::Priority)
        .send()
        .await
        .unwrap();
    assert_eq!(out.service_tier(), Some(&ServiceTierType::Priority));
    // No tier asked, none echoed.
    let plain = c
        .converse()
        .model_id(SONNET)
        .messages(user("plain"))
        .send()
        .await
        .unwrap();
    assert!(plain.service_tier().is_none());

    let stats = sim.simulator.stats();
    assert_eq!(
        stats.tiers.keys().collect::<Vec<_>>(),
        ["default", "flex", "priority"]
    );
    assert_eq!(
        (
            stats.tiers["priority"].requests,
            stats.tiers["priority"].completed
        ),
        (2, 2)
    );
    assert_eq!(stats.tiers["flex"].tokens_charged, flex_charge);
    assert_eq!(stats.tiers["default"].requests, 1);
    // All three draw on the one on-demand bucket.
    assert_eq!(stats.buckets.len(), 1);
    assert_eq!(stats.buckets[&format!("{SONNET}@us-east-1")].completed, 4);
}

#[tokio::test]
async fn reserved_capacity_serves_first_and_overflows_to_on_demand() {
    let sim = start(SimulatorConfig {
        quotas: vec![QuotaOverride {
            model: SONNET.into(),
            region: None,
            tokens_per_minute: None,
            tokens_per_day: None,
            reserved_tokens_per_minute: Some(3_000),
        }],
        ..instant_config()
    })
    .await;
    let c = client(&sim, "secret");
    let reserved = || {
        c.converse()
            .model_id(SONNET)
            .messages(user("reserved [sim:output=300]"))
            .inference_config(max_tokens(2_000))
            .service_tier(tier(ServiceTierType::Reserved))
    };
    let first = reserved().send().await.unwrap();
    assert_eq!(
        first.service_tier().map(|t| t.r#type()),
        Some(&ServiceTierType::Reserved)
    );
    let charge = first.usage().unwrap().input_tokens() as u64 + 5 * 300;
    // What the reserved bucket has left (3,000 - charge, about 1,500, refilling 50 a second)
    // cannot hold input + 2,000 for 10 seconds: the call overflows to on-demand and is answered
    // as default.
    let second = reserved().send().await.unwrap();
    assert_eq!(
        second.service_tier().map(|t| t.r#type()),
        Some(&ServiceTierType::Default)
    );

    let stats = sim.simulator.stats();
    let r = &stats.buckets[&format!("{SONNET}@us-east-1#reserved")];
    assert_eq!(
        (r.tier.as_str(), r.tokens_per_minute, r.tokens_per_day),
        ("reserved", 3_000, None)
    );
    assert_eq!(
        (r.requests, r.completed, r.overflowed, r.tokens_charged),
        (2, 1, 1, charge)
    );
    let on_demand = &stats.buckets[&format!("{SONNET}@us-east-1")];
    assert_eq!(
        (
            on_demand.requests,
            on_demand.completed,
            on_demand.tokens_charged
        ),
        (1, 1, charge)
    );
    assert_eq!(
        (
            stats.tiers["reserved"].requests,
            stats.tiers["reserved"].tokens_charged
        ),
        (2, 2 * charge)
    );

    // A model without reserved capacity refuses the tier.
    let err = c
        .converse()
        .model_id("anthropic.claude-3-haiku-20240307-v1:0")
        .messages(user("x"))
        .service_tier(tier(ServiceTierType::Reserved))
        .send()
        .await
        .unwrap_err()
        .into_service_error();
    assert!(err.is_validation_exception(), "{err:?}");
    assert!(
        err.meta()
            .message()
            .unwrap()
            .contains("no reserved capacity")
    );
}

#[tokio::test]
async fn unknown_tiers_are_validation_errors() {
    let sim = start(instant_config()).await;
    let converse = json!({"messages": [{"role": "user", "content": [{"text": "x"}]}], "serviceTier": {"type": "gold"}});
    let cases = [
        (
            "converse",
            vec![],
            converse.to_string().into_bytes(),
            "Value 'gold' at 'serviceTier.type'",
        ),
        (
            "invoke",
            vec![("x-amzn-bedrock-service-tier", "gold")],
            anthropic_body("x", 10),
            "Value 'gold' at 'serviceTier'",
        ),
    ];
    for (op, headers, body, needle) in cases {
        let path = format!("/model/{SONNET}/{op}");
        let (status, h, bytes) = post_with(&sim, &path, &headers, &body).await;
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(
            (status, h["x-amzn-errortype"].to_str().unwrap()),
            (400, "ValidationException")
        );
        assert!(v["message"].as_str().unwrap().contains(needle), "{v}");
    }
    assert!(
        sim.simulator.stats().buckets.is_empty(),
        "nothing was charged"
    );
}
