//! The simulator's own model-id parsing and its Regions: every id form lands in the bucket
//! Bedrock keeps for it (the keys below are literals, not computed), and each Region has its own.

use serde_json::json;
use tokengate::simulator::{QuotaOverride, SimulatorConfig};

use super::{SONNET, client, client_in, instant_config, max_tokens, post_with, start, user};

const APP_PROFILE: &str =
    "arn:aws:bedrock:us-east-1:123456789012:application-inference-profile/a1b2c3";

#[tokio::test]
async fn every_model_id_form_lands_in_its_bucket() {
    let sim = start(SimulatorConfig {
        application_profiles: [(APP_PROFILE.to_string(), format!("us.{SONNET}"))].into(),
        ..instant_config()
    })
    .await;
    let c = client(&sim, "secret");
    let cases = [
        (SONNET.to_string(), format!("{SONNET}@us-east-1")),
        (format!("us.{SONNET}"), format!("{SONNET}@geo:us")),
        (format!("us-gov.{SONNET}"), format!("{SONNET}@geo:us-gov")),
        (format!("eu.{SONNET}"), format!("{SONNET}@geo:eu")),
        (format!("apac.{SONNET}"), format!("{SONNET}@geo:apac")),
        (format!("jp.{SONNET}"), format!("{SONNET}@geo:jp")),
        (format!("au.{SONNET}"), format!("{SONNET}@geo:au")),
        (format!("global.{SONNET}"), format!("{SONNET}@global")),
        (
            format!("arn:aws:bedrock:us-west-2::foundation-model/{SONNET}"),
            format!("{SONNET}@us-west-2"),
        ),
        (
            format!("arn:aws:bedrock:eu-west-1:123456789012:inference-profile/eu.{SONNET}"),
            format!("{SONNET}@eu-west-1/geo:eu"),
        ),
        // An application profile shares the bucket of what it was made from.
        (APP_PROFILE.to_string(), format!("{SONNET}@geo:us")),
        (
            "arn:aws:bedrock:us-east-1:123456789012:provisioned-model/pt1".to_string(),
            "arn:aws:bedrock:us-east-1:123456789012:provisioned-model/pt1@us-east-1".to_string(),
        ),
    ];
    for (id, _) in &cases {
        c.converse()
            .model_id(id)
            .messages(user("route me [sim:output=1]"))
            .inference_config(max_tokens(10))
            .send()
            .await
            .unwrap();
    }
    let stats = sim.simulator.stats();
    for (id, bucket) in &cases {
        let expected = if bucket == &format!("{SONNET}@geo:us") {
            2
        } else {
            1
        };
        assert_eq!(
            stats.buckets.get(bucket).map(|b| b.completed),
            Some(expected),
            "{id} -> {bucket}: {:?}",
            stats.buckets.keys().collect::<Vec<_>>()
        );
    }
    assert_eq!(stats.buckets.len(), cases.len() - 1);
    let west = &stats.buckets[&format!("{SONNET}@us-west-2")];
    assert_eq!(
        (
            west.region.as_str(),
            west.route.as_str(),
            west.model.as_str()
        ),
        ("us-west-2", "on_demand", SONNET)
    );
    assert_eq!(
        stats.buckets[&format!("{SONNET}@eu-west-1/geo:eu")].route,
        "geo:eu"
    );
}

#[tokio::test]
async fn each_region_has_its_own_buckets_known_by_the_signature_or_the_host() {
    let sim = start(SimulatorConfig {
        default_tokens_per_minute: 10_000,
        quotas: vec![QuotaOverride {
            model: SONNET.into(),
            region: Some("us-west-2".into()),
            tokens_per_minute: Some(50_000),
            tokens_per_day: None,
            reserved_tokens_per_minute: None,
        }],
        ..instant_config()
    })
    .await;
    let east = client(&sim, "secret");
    let west = client_in(&sim, "us-west-2", "secret");
    // A charge of about 9,000 (1,800 output x 5) of us-east-1's 10,000: the next call reserving
    // 9,000 there is throttled, while us-west-2 still admits it.
    let big = || max_tokens(9_000);
    east.converse()
        .model_id(SONNET)
        .messages(user("a [sim:output=1800]"))
        .inference_config(big())
        .send()
        .await
        .unwrap();
    let err = east
        .converse()
        .model_id(SONNET)
        .messages(user("b"))
        .inference_config(big())
        .send()
        .await
        .unwrap_err();
    assert!(err.into_service_error().is_throttling_exception());
    for model in [SONNET.to_string(), format!("us.{SONNET}")] {
        west.converse()
            .model_id(&model)
            .messages(user("c [sim:output=1]"))
            .inference_config(big())
            .send()
            .await
            .unwrap();
    }
    // No signature: the Host names the Region.
    let body = json!({"messages": [{"role": "user", "content": [{"text": "d [sim:output=1]"}]}], "inferenceConfig": {"maxTokens": 10}}).to_string();
    let (status, _, _) = post_with(
        &sim,
        &format!("/model/{SONNET}/converse"),
        &[("host", "bedrock-runtime.eu-central-1.amazonaws.com")],
        body.as_bytes(),
    )
    .await;
    assert_eq!(status, 200);

    let stats = sim.simulator.stats();
    let bucket = |k: String| stats.buckets[&k].clone();
    assert_eq!(bucket(format!("{SONNET}@us-east-1")).throttled, 1);
    let w = bucket(format!("{SONNET}@us-west-2"));
    assert_eq!(
        (w.tokens_per_minute, w.completed, w.throttled),
        (50_000, 1, 0),
        "the Region's own quota"
    );
    let wp = bucket(format!("{SONNET}@us-west-2/geo:us"));
    assert_eq!(
        (wp.tokens_per_minute, wp.region.as_str()),
        (10_000, "us-west-2")
    );
    assert_eq!(bucket(format!("{SONNET}@eu-central-1")).completed, 1);

    let r = &stats.regions;
    assert_eq!(
        r.keys().collect::<Vec<_>>(),
        ["eu-central-1", "us-east-1", "us-west-2"]
    );
    assert_eq!(
        (
            r["us-east-1"].calls.requests,
            r["us-east-1"].calls.throttled
        ),
        (2, 1)
    );
    assert_eq!(
        (
            r["us-west-2"].calls.requests,
            r["us-west-2"].calls.completed
        ),
        (2, 2)
    );
    let mut west_buckets = r["us-west-2"].buckets.clone();
    west_buckets.sort();
    assert_eq!(
        west_buckets,
        [
            format!("{SONNET}@us-west-2"),
            format!("{SONNET}@us-west-2/geo:us")
        ]
    );
    let charged: u64 = stats.buckets.values().map(|b| b.tokens_charged).sum();
    assert_eq!(
        charged,
        r.values().map(|r| r.calls.tokens_charged).sum::<u64>()
    );
}
