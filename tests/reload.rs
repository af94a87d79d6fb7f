//! Config reload: a valid config swaps atomically without dropping in-flight requests (their
//! reservations, made under the old config, settle in the same ledger); new limits, pools and
//! routes apply from the next request; an invalid config is refused and counted, and the old one
//! stays.

mod common;

use aws_sdk_bedrockruntime::types::ConverseStreamOutput;
use common::*;
use tokengate::config::Config;

/// A slow simulator: streams take about a second.
const SLOW_SIM: &str = "time_to_first_token_ms = 0\ntokens_per_second = 200\n";

/// One short call to `model`.
async fn small_call(
    client: &aws_sdk_bedrockruntime::Client,
    model: &str,
) -> Result<
    (),
    aws_sdk_bedrockruntime::error::SdkError<
        aws_sdk_bedrockruntime::operation::converse::ConverseError,
    >,
> {
    client
        .converse()
        .model_id(model)
        .messages(user_message("[sim:output=5] hi"))
        .inference_config(max_tokens(50))
        .send()
        .await
        .map(|_| ())
}

fn pools(sonnet_tpm: u64, with_haiku: bool) -> String {
    let mut out = sonnet_pool(sonnet_tpm, 16);
    if with_haiku {
        out.push_str(&format!(
            "\n[[pools]]\nname = \"haiku\"\nmodels = [\"{HAIKU}\"]\ntokens_per_minute = 100000\n\
             max_concurrency = 16\noutput_burndown = 1\ndefault_max_tokens = 500\n"
        ));
    }
    out
}

#[tokio::test]
async fn a_reload_swaps_limits_and_pools_while_a_stream_finishes_under_the_old_config() {
    let stack = Stack::start(SLOW_SIM, &pools(400_000, false), "").await;
    let client = stack.client();
    // A stream in flight across the reload.
    let mut stream = client
        .converse_stream()
        .model_id(SONNET_US)
        .messages(user_message("[sim:output=200] tell a long story"))
        .inference_config(max_tokens(2000))
        .send()
        .await
        .expect("stream starts")
        .stream;
    let first = stream.recv().await.expect("first event");
    assert!(first.is_some());
    let before = stack.proxy.admission().pool_views().await;
    assert!(
        before[0].ledger.as_ref().unwrap().reserved_tokens > 0,
        "the stream holds its reservation"
    );

    // Lower the Sonnet quota, add a Haiku pool.
    let new = proxy_config(stack.sim.addr, &pools(20_000, true), "");
    stack.proxy.reload(new).expect("a valid config reloads");

    // The stream finishes and settles by usage in the same ledger.
    let mut usage = None;
    while let Some(event) = stream.recv().await.expect("the stream goes on") {
        if let ConverseStreamOutput::Metadata(m) = event {
            usage = m.usage().map(|u| u.output_tokens());
        }
    }
    assert_eq!(usage, Some(200));
    stack.assert_ledger_zero().await;

    let after = stack.proxy.admission().pool_views().await;
    assert_eq!(after.len(), 2);
    assert_eq!(after[0].tokens_per_minute, 20_000);
    assert_eq!(after[0].admitted, 1, "the pool's counts carry over");
    // The new limit applies: 30,000 tokens can never fit a 20,000 pool.
    let too_big = client
        .converse()
        .model_id(SONNET_US)
        .messages(user_message("hello"))
        .inference_config(max_tokens(30_000))
        .send()
        .await
        .expect_err("above the new quota");
    let too_big = too_big.into_service_error();
    assert!(too_big.is_validation_exception(), "{too_big:?}");
    assert!(too_big.to_string().contains("20000"), "{too_big}");
    // The new pool serves.
    small_call(&client, HAIKU)
        .await
        .expect("the new pool admits");
    let m = scrape(stack.proxy.addr).await;
    m.expect("tokengate_config_reloads_total", &[("result", "ok")], 1.0);
    // Series live on across the reload: the gauges came back to zero (not below) when the
    // stream admitted before it settled, and counters kept counting.
    m.expect("tokengate_reserved_tokens", &[("pool", "sonnet4-us")], 0.0);
    m.expect(
        "tokengate_inflight_requests",
        &[("pool", "sonnet4-us")],
        0.0,
    );
    m.expect(
        "tokengate_route_reserved_tokens",
        &[("pool", "sonnet4-us"), ("route", "default")],
        0.0,
    );
    assert!(
        m.get(
            "tokengate_route_charged_tokens_total",
            &[("pool", "sonnet4-us"), ("route", "default")]
        ) >= 1000.0,
        "the stream's charge (200 output x 5) counted across the reload"
    );
    m.expect(
        "tokengate_configured_tokens_per_minute",
        &[("pool", "sonnet4-us")],
        20_000.0,
    );
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn an_invalid_config_is_refused_counted_and_the_old_one_stays() {
    let stack = Stack::start(SLOW_SIM, &pools(400_000, false), "").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tokengate.toml");
    let invalid = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nregion = \"us-east-1\"\nendpoint = \"http://{}\"\n{}",
        stack.sim.addr,
        pools(0, false)
    );
    std::fs::write(&path, invalid).expect("write");
    let err = stack
        .proxy
        .reload_from(&path)
        .expect_err("an invalid file is refused");
    assert!(
        err.to_string()
            .contains("pools[0] (sonnet4-us).tokens_per_minute: must be greater than zero"),
        "names the key: {err}"
    );
    let missing = stack
        .proxy
        .reload_from(&dir.path().join("absent.toml"))
        .expect_err("a missing file is refused");
    assert!(missing.to_string().contains("absent.toml"), "{missing}");
    let m = scrape(stack.proxy.addr).await;
    m.expect(
        "tokengate_config_reloads_total",
        &[("result", "error")],
        2.0,
    );
    m.expect("tokengate_config_reloads_total", &[("result", "ok")], 0.0);
    // The old config serves on.
    let states = stack.proxy.admission().pool_views().await;
    assert_eq!(states[0].tokens_per_minute, 400_000);
    small_call(&stack.client(), SONNET_US)
        .await
        .expect("still serving");
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn reloaded_routes_and_auth_apply_to_the_next_request() {
    let stack = Stack::start(SLOW_SIM, &pools(400_000, false), "").await;
    let key = "tg-reloaded-key-0001";
    let extra = format!(
        "[auth]\nmode = \"bearer\"\nallow_plaintext_bearer = true\n\n[[routes]]\nname = \"team\"\nbearer_token_sha256 = \"{}\"\n",
        sha256_hex(key)
    );
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n\n[upstream]\nregion = \"us-east-1\"\nendpoint = \"http://{}\"\n\n{extra}\n{}",
        stack.sim.addr,
        pools(400_000, false)
    );
    stack
        .proxy
        .reload(Config::parse(&text).expect("config"))
        .expect("reload");
    let denied = small_call(&stack.client(), SONNET_US)
        .await
        .expect_err("no bearer key any more");
    assert!(denied.into_service_error().is_access_denied_exception());
    small_call(&bearer_client(stack.proxy.addr, key), SONNET_US)
        .await
        .expect("the new route's key works");
    stack.assert_ledger_zero().await;
}
