//! Daily quotas: per bucket (default: the minute's quota x 1,440) and account-wide per Region,
//! reserved and settled like the minute, refused with Bedrock's daily message; `POST
//! /_sim/daily` starts a new day or sets the day's use.

use aws_sdk_bedrockruntime::Client;
use serde_json::{Value, json};
use tokengate::simulator::{QuotaOverride, SimulatorConfig, SimulatorHandle};

use super::{SONNET, client, instant_config, max_tokens, post, start, user};

const HAIKU: &str = "anthropic.claude-3-haiku-20240307-v1:0";
const PER_DAY: &str = "Too many tokens per day, please wait before trying again.";
const PER_MINUTE: &str = "Too many tokens, please wait before trying again.";

/// A Converse call; `Ok(charge)` (input + output x burndown, from the usage) or `Err(message)`
/// of a ThrottlingException.
async fn call(c: &Client, model: &str, output: u32, max: i32) -> Result<u64, String> {
    let burndown = if model.contains("claude-3-haiku") {
        1
    } else {
        5
    };
    match c
        .converse()
        .model_id(model)
        .messages(user(&format!("day [sim:output={output}]")))
        .inference_config(max_tokens(max))
        .send()
        .await
    {
        Ok(out) => {
            let u = out.usage().unwrap();
            Ok(u.input_tokens() as u64 + burndown * u.output_tokens() as u64)
        }
        Err(e) => {
            let e = e.into_service_error();
            assert!(e.is_throttling_exception(), "{e:?}");
            Err(e.meta().message().unwrap().to_string())
        }
    }
}

async fn daily(sim: &SimulatorHandle, body: Value) -> (u16, Value) {
    let (status, _, v) = post(sim, "/_sim/daily", body.to_string().as_bytes()).await;
    (status, v)
}

#[tokio::test]
async fn a_bucket_s_day_is_reserved_settled_and_refused_with_the_daily_message() {
    let sim = start(SimulatorConfig {
        default_tokens_per_minute: 100_000,
        default_tokens_per_day: Some(3_000),
        quotas: vec![QuotaOverride {
            model: HAIKU.into(),
            region: None,
            tokens_per_minute: Some(500),
            tokens_per_day: None,
            reserved_tokens_per_minute: None,
        }],
        ..instant_config()
    })
    .await;
    let c = client(&sim, "secret");
    let first = call(&c, SONNET, 100, 1_000).await.unwrap();
    let key = format!("{SONNET}@us-east-1");
    let b = sim.simulator.stats().buckets[&key].clone();
    assert_eq!(
        (b.tokens_per_day, b.tokens_used_today),
        (Some(3_000), first)
    );
    // input + 2,500 on top of what the day has used does not fit the day (the minute has room).
    let refused = call(&c, SONNET, 1, 2_500).await.unwrap_err();
    assert_eq!(refused, PER_DAY);
    // The per-minute refusal keeps its own message: Haiku's minute is 500.
    assert_eq!(call(&c, HAIKU, 1, 600).await.unwrap_err(), PER_MINUTE);

    let stats = sim.simulator.stats();
    let b = &stats.buckets[&key];
    assert_eq!(
        (b.throttled, b.throttled_daily, b.tokens_used_today),
        (1, 1, first)
    );
    let haiku = &stats.buckets[&format!("{HAIKU}@us-east-1")];
    assert_eq!((haiku.throttled, haiku.throttled_daily), (1, 0));
    assert_eq!(
        haiku.tokens_per_day,
        Some(3_000),
        "the default applies to every bucket"
    );
    let converse = &stats.apis["Converse"];
    assert_eq!((converse.throttled, converse.throttled_daily), (2, 1));

    // A new day: the same call fits.
    let (status, v) = daily(&sim, json!({"new_day": true})).await;
    assert_eq!(status, 200);
    assert_eq!(v["buckets"][&key]["tokens_used_today"], 0);
    let second = call(&c, SONNET, 1, 2_500).await.unwrap();
    assert_eq!(
        sim.simulator.stats().buckets[&key].tokens_used_today,
        second
    );
    // Setting the day's use: 10 tokens left refuse a call of 11 or more.
    let (status, _) = daily(&sim, json!({"model": SONNET, "tokens_used": 2_990})).await;
    assert_eq!(status, 200);
    assert_eq!(call(&c, SONNET, 1, 10).await.unwrap_err(), PER_DAY);
    assert_eq!(sim.simulator.stats().buckets[&key].tokens_used_today, 2_990);
    for bad in [
        json!({}),
        json!({"model": SONNET}),
        json!({"tokens_used": 1}),
        json!({"bogus": 1}),
    ] {
        let (status, v) = daily(&sim, bad.clone()).await;
        assert_eq!(status, 400, "{bad}");
        assert!(
            v["message"].as_str().unwrap().contains("/_sim/daily"),
            "{v}"
        );
    }
}

#[tokio::test]
async fn the_default_day_is_the_minute_times_1440_and_the_account_day_spans_models() {
    let sim = start(SimulatorConfig {
        default_tokens_per_minute: 60_000,
        account_tokens_per_day: Some(3_000),
        ..instant_config()
    })
    .await;
    let c = client(&sim, "secret");
    let a = call(&c, SONNET, 10, 2_000).await.unwrap();
    let b = call(&c, HAIKU, 10, 2_000).await.unwrap();
    let stats = sim.simulator.stats();
    assert_eq!(
        stats.buckets[&format!("{SONNET}@us-east-1")].tokens_per_day,
        Some(60_000 * 1440)
    );
    let region = &stats.regions["us-east-1"];
    assert_eq!(
        (
            region.account_tokens_per_day,
            region.account_tokens_used_today
        ),
        (Some(3_000), a + b)
    );
    // What is left of the account's day cannot hold input + 3,000 - a - b, in any model.
    let cap = (3_000 - a - b) as i32;
    for model in [SONNET, HAIKU, "us.amazon.nova-lite-v1:0"] {
        assert_eq!(
            call(&c, model, 1, cap).await.unwrap_err(),
            PER_DAY,
            "{model}"
        );
    }
    let (status, _) = daily(&sim, json!({"region": "us-east-1", "tokens_used": 0})).await;
    assert_eq!(status, 200);
    call(&c, HAIKU, 1, cap).await.unwrap();
    // Another Region has its own account day.
    let (status, v) = daily(&sim, json!({"region": "eu-west-1", "tokens_used": 4_999})).await;
    assert_eq!(status, 200);
    assert_eq!(
        v["regions"]["eu-west-1"]["account_tokens_used_today"],
        4_999
    );
    assert_eq!(sim.simulator.stats().tiers["default"].throttled_daily, 3);
}
