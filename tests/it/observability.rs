//! A scripted workload through simulator and proxy, then a scrape of `/metrics`: every metric moved
//! by what the workload determines (counts, token sums reported by the simulator, histogram
//! counts, queue outcomes), every exported metric is present, and `/v1/pools` shows the maxTokens
//! advice.

use crate::common;
use std::time::Duration;

use crate::common::{scrape::Scrape, *};
use aws_sdk_bedrockruntime::types::ConverseStreamOutput;
use serde_json::Value;

const NOVA: &str = "us.amazon.nova-lite-v1:0";
/// Nova Micro through the `us.` profile: a small pool that spills to the `global.` one.
const MICRO: &str = "us.amazon.nova-micro-v1:0";
/// The `api` label of the native operations.
const BEDROCK: (&str, &str) = ("api", "bedrock");
/// Instant generation; a 1000-token upstream quota for Nova (other traffic shares the account),
/// so the proxy's admitted Nova request is throttled upstream.
const SIM: &str = "time_to_first_token_ms = 0\ntokens_per_second = 0\ndefault_tokens_per_minute = 10000000\n\
                   stall_ms = 400\n[[quotas]]\nmodel = \"us.amazon.nova-lite-v1:0\"\ntokens_per_minute = 1000\n";

fn pools() -> String {
    format!(
        "{}max_wait_ms = 0\nwhen_max_tokens_missing = \"inject\"\n\n\
         [[pools]]\nname = \"haiku\"\nmodels = [\"{HAIKU}\"]\ntokens_per_minute = 1000000\nmax_concurrency = 1\n\
         output_burndown = 1\ndefault_max_tokens = 100\nmax_wait_ms = 5000\ntokens_per_day = 100000000\n\n\
         [[pools]]\nname = \"nova\"\nmodels = [\"{NOVA}\"]\ntokens_per_minute = 1000000\nmax_concurrency = 8\n\
         output_burndown = 1\ndefault_max_tokens = 100\nmax_wait_ms = 0\n\n\
         [[pools]]\nname = \"micro\"\nmodels = [\"{MICRO}\"]\ntokens_per_minute = 3000\nmax_concurrency = 8\n\
         output_burndown = 1\ndefault_max_tokens = 100\nmax_wait_ms = 0\nspill_to = [\"micro-global\"]\n\n\
         [[pools]]\nname = \"micro-global\"\nmodels = [\"global.amazon.nova-micro-v1:0\"]\n\
         tokens_per_minute = 1000000\nmax_concurrency = 8\noutput_burndown = 1\ndefault_max_tokens = 100\n\n\n\
         [[endpoints]]\nname = \"llm\"\nendpoint = \"llm-prod\"\ncopies = 2\nmax_concurrency_per_copy = 4\n",
        sonnet_pool(20_000, 8)
    )
}

/// Reported usage, summed over the requests the workload sent.
#[derive(Default, Debug)]
struct Sums {
    input: u64,
    output: u64,
    charge: u64,
    requests: u64,
}

impl Sums {
    fn add(&mut self, input: u64, output: u64, burndown: u64) {
        self.input += input;
        self.output += output;
        self.charge += input + output * burndown;
        self.requests += 1;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scripted_workload_moves_every_metric_by_what_it_did() {
    // The implicit route's settings, declared to add an adaptive maxTokens that never has its
    // samples: its gauges are in the scrape, and nothing is capped. Upstream over HTTP/2 (the
    // simulator by prior knowledge), so that the connection set's gauges are in the scrape too.
    let extra = "http = \"http2\"\n[admission]\naccount_tokens_per_day = 1000000000\n\
                 [[routes]]\nname = \"default\"\nspill = true\n\
                 adaptive_max_tokens = { min_samples = 1000000 }\n";
    let stack = Stack::start(SIM, &pools(), extra).await;
    let addr = stack.proxy.addr;
    let mut sonnet = Sums::default();
    let mut requested = 0;

    // 24 Converse calls with known output lengths; every sixth without maxTokens (the pool injects
    // its default_max_tokens of 1000, and reserves it).
    for i in 0..24u64 {
        let max = (i % 6 != 0).then_some(400);
        let r = converse(
            addr,
            SONNET_US,
            &format!("[sim:output={}] call {i}", 50 + i),
            max,
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.message());
        let v: Value = serde_json::from_slice(&r.body).expect("json");
        let usage = &v["usage"];
        assert_eq!(usage["outputTokens"], 50 + i);
        sonnet.add(usage["inputTokens"].as_u64().expect("input"), 50 + i, 5);
        requested += max.unwrap_or(1000);
    }
    // Two streams through the SDK.
    let client = stack.client();
    for _ in 0..2 {
        let mut out = client
            .converse_stream()
            .model_id(SONNET_US)
            .messages(user_message("[sim:output=30] stream"))
            .inference_config(max_tokens(400))
            .send()
            .await
            .expect("stream");
        let mut usage = None;
        while let Some(event) = out.stream.recv().await.expect("event") {
            if let ConverseStreamOutput::Metadata(m) = event {
                let u = m.usage().expect("usage");
                usage = Some((u.input_tokens() as u64, u.output_tokens() as u64));
            }
        }
        let (input, output) = usage.expect("metadata event");
        sonnet.add(input, output, 5);
        requested += 400;
    }
    // Three that do not fit now (the bucket holds 20k; about 8k were charged): 429, reason tokens.
    for _ in 0..3 {
        let r = converse(addr, SONNET_US, "big", Some(19_500)).await;
        assert_eq!(
            (r.status, r.header("x-tokengate-reason")),
            (429, Some("tokens"))
        );
    }
    // One that can never fit, one unknown model, one upstream 503, one stream cut half-way.
    assert_eq!(
        converse(addr, SONNET_US, "huge", Some(500_000))
            .await
            .status,
        400
    );
    assert_eq!(
        converse(addr, SONNET_GLOBAL, "hi", Some(10)).await.status,
        400
    );
    assert_eq!(
        converse(addr, SONNET_US, "[sim:fault=503] x", Some(400))
            .await
            .status,
        503
    );
    let cut = raw_request(
        addr,
        "POST",
        &model_path(SONNET_US, "converse-stream"),
        converse_body("[sim:output=40] [sim:fault=cut] x", Some(400)),
        false,
    )
    .await;
    assert_eq!(cut.status, 200, "a stream cut after its 200 ends in-band");

    // Haiku allows one request at a time and queues: the second waits for the first (stalled).
    let slow = tokio::spawn(converse(
        addr,
        HAIKU,
        "[sim:output=5] [sim:fault=stall] first",
        Some(50),
    ));
    let inflight = || common::in_flight(&stack.proxy, "haiku");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while inflight() == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the first haiku call was never admitted"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let queued = converse(addr, HAIKU, "[sim:output=7] second", Some(50)).await;
    assert_eq!(queued.status, 200, "{}", queued.message());
    assert_eq!(slow.await.expect("task").status, 200);

    // Nova: admitted by the proxy, throttled by the (smaller) upstream quota.
    let throttled = converse(addr, NOVA, "[sim:output=5] x", Some(2_000)).await;
    assert_eq!(
        (throttled.status, throttled.header("x-tokengate-reason")),
        (429, Some("upstream"))
    );

    // Nova Micro: the first call leaves its small pool about half empty; the second does not fit
    // there now and runs in the pool it spills to.
    let first = converse(addr, MICRO, "[sim:output=1500] fill", Some(2_000)).await;
    assert_eq!(first.header("x-tokengate-pool"), Some("micro"));
    let spilled = converse(addr, MICRO, "[sim:output=5] spill", Some(2_000)).await;
    assert_eq!(spilled.status, 200, "{}", spilled.message());
    assert_eq!(spilled.header("x-tokengate-pool"), Some("micro-global"));

    stack.assert_ledger_zero().await;
    let text = String::from_utf8(
        raw_request(addr, "GET", "/metrics", "", false)
            .await
            .body
            .to_vec(),
    )
    .expect("utf8");
    let m = Scrape::parse(&text);
    let (s, conv, stream) = (
        ("pool", "sonnet4-us"),
        ("operation", "Converse"),
        ("operation", "ConverseStream"),
    );
    let n = |v: u64| v as f64;

    // Outcomes and rejections.
    let outcome = |op, o| {
        m.get(
            "tokengate_requests_total",
            &[s, BEDROCK, op, ("outcome", o)],
        )
    };
    assert_eq!(outcome(conv, "admitted"), 25.0, "24 + the 503");
    assert_eq!(outcome(stream, "admitted"), 3.0, "2 + the cut one");
    assert_eq!(outcome(conv, "rejected"), 3.0);
    assert_eq!(outcome(conv, "invalid"), 1.0);
    m.expect(
        "tokengate_requests_total",
        &[
            BEDROCK,
            ("pool", "none"),
            conv,
            ("outcome", "unknown_model"),
        ],
        1.0,
    );
    m.expect(
        "tokengate_rejections_total",
        &[s, ("reason", "tokens")],
        3.0,
    );
    m.expect(
        "tokengate_rejections_total",
        &[s, ("reason", "never_fits")],
        1.0,
    );
    m.expect(
        "tokengate_rejections_total",
        &[s, ("reason", "concurrency")],
        0.0,
    );
    m.expect("tokengate_retry_hint_seconds_count", &[s], 3.0);
    // The four calls without maxTokens: the pool's default written in, once each.
    let missing = |action| {
        m.get(
            "tokengate_max_tokens_missing_total",
            &[s, ("route", "default"), ("action", action)],
        )
    };
    assert_eq!(
        (missing("inject"), missing("reserve_model_max")),
        (4.0, 0.0)
    );

    // Settlements and tokens: exactly what the simulator reported.
    m.expect(
        "tokengate_settlements_total",
        &[s, ("rule", "usage")],
        n(sonnet.requests),
    );
    m.expect(
        "tokengate_settlements_total",
        &[s, ("rule", "not_charged")],
        1.0,
    );
    m.expect(
        "tokengate_settlements_total",
        &[s, ("rule", "no_usage")],
        1.0,
    );
    m.expect(
        "tokengate_settlements_total",
        &[s, ("rule", "abandoned")],
        0.0,
    );
    m.expect("tokengate_output_tokens_total", &[s], n(sonnet.output));
    m.expect("tokengate_input_tokens_total", &[s], n(sonnet.input));
    m.expect("tokengate_cache_read_tokens_total", &[s], 0.0);
    m.expect("tokengate_cache_write_tokens_total", &[s], 0.0);
    // The cut stream is charged its reservation (its input estimate + 400), the rest their usage.
    let cut_charge = m.get("tokengate_charged_tokens_total", &[s]) - n(sonnet.charge);
    assert!(
        (400.0..500.0).contains(&cut_charge),
        "cut stream charged {cut_charge}"
    );
    let reserved = m.get("tokengate_reserved_tokens_total", &[s]);
    assert!(
        reserved > n(requested + 800),
        "reserved {reserved} covers every maxTokens"
    );
    m.expect("tokengate_reserved_tokens", &[s], 0.0);
    m.expect("tokengate_inflight_requests", &[s], 0.0);
    m.expect(
        "tokengate_over_reservation_ratio_count",
        &[s],
        n(sonnet.requests),
    );

    // Length distributions: one observation per request with usage.
    m.expect(
        "tokengate_output_tokens_per_request_count",
        &[s],
        n(sonnet.requests),
    );
    m.expect(
        "tokengate_output_tokens_per_request_sum",
        &[s],
        n(sonnet.output),
    );
    m.expect(
        "tokengate_input_tokens_per_request_sum",
        &[s],
        n(sonnet.input),
    );
    m.expect("tokengate_requested_max_tokens_sum", &[s], n(requested));
    m.expect(
        "tokengate_output_tokens_per_request_bucket",
        &[s, ("le", "64")],
        15.0 + 2.0,
    );

    // Latency histograms: the 503 has no body; the cut stream showed content before it broke.
    m.expect("tokengate_request_duration_seconds_count", &[s, conv], 25.0);
    m.expect(
        "tokengate_request_duration_seconds_count",
        &[s, stream],
        3.0,
    );
    m.expect(
        "tokengate_time_to_first_token_seconds_count",
        &[s, conv],
        24.0,
    );
    m.expect(
        "tokengate_time_to_first_token_seconds_count",
        &[s, stream],
        3.0,
    );
    m.expect(
        "tokengate_time_to_first_byte_seconds_count",
        &[s, conv],
        24.0,
    );

    // Upstream.
    m.expect(
        "tokengate_upstream_responses_total",
        &[s, ("status", "200")],
        27.0,
    );
    m.expect(
        "tokengate_upstream_responses_total",
        &[s, ("status", "503")],
        1.0,
    );
    m.expect(
        "tokengate_upstream_errors_total",
        &[s, ("kind", "stream_cut")],
        1.0,
    );
    m.expect(
        "tokengate_upstream_errors_total",
        &[s, ("kind", "connect")],
        0.0,
    );
    let nova = ("pool", "nova");
    m.expect("tokengate_upstream_throttles_total", &[nova], 1.0);
    m.expect(
        "tokengate_upstream_responses_total",
        &[nova, ("status", "429")],
        1.0,
    );
    m.expect(
        "tokengate_settlements_total",
        &[nova, ("rule", "not_charged")],
        1.0,
    );
    m.expect("tokengate_retry_hint_seconds_count", &[nova], 1.0);
    // Shrunk x0.8 by the throttle, and regrowing since at 1% of the limit per second: the gauge
    // shows the limit at the scrape.
    let effective = m.get("tokengate_effective_tokens_per_minute", &[nova]);
    assert!(
        (800_000.0..810_000.0).contains(&effective),
        "effective limit {effective}"
    );
    m.expect("tokengate_upstream_throttles_total", &[s], 0.0);

    // Limits, bucket, calibration.
    m.expect("tokengate_configured_tokens_per_minute", &[s], 20_000.0);
    m.expect("tokengate_effective_tokens_per_minute", &[s], 20_000.0);
    let available = m.get("tokengate_tokens_available", &[s]);
    assert!(
        available > 0.0 && available < 20_000.0 - n(sonnet.charge) + 2_000.0,
        "{available}"
    );
    assert!(m.get("tokengate_input_calibration_ratio", &[s]) > 0.0);

    // The queue: one waited and was admitted.
    let h = ("pool", "haiku");
    m.expect(
        "tokengate_queue_outcomes_total",
        &[h, ("outcome", "admitted")],
        1.0,
    );
    m.expect(
        "tokengate_queue_outcomes_total",
        &[h, ("outcome", "timed_out")],
        0.0,
    );
    m.expect("tokengate_queue_wait_seconds_count", &[h], 1.0);
    m.expect("tokengate_queue_depth", &[h], 0.0);
    m.expect(
        "tokengate_requests_total",
        &[BEDROCK, h, conv, ("outcome", "admitted")],
        2.0,
    );
    m.expect("tokengate_output_tokens_total", &[h], 12.0);

    // The ledger: one timed round trip per decision and per settlement (the queue's own
    // admission of the haiku waiter is not a request-path call).
    let decisions = 25.0 + 3.0 + 3.0 + 2.0 + 1.0;
    assert!(m.get("tokengate_ledger_seconds_count", &[]) >= decisions + 28.0 + 2.0 + 1.0);
    m.expect(
        "tokengate_ledger_errors_total",
        &[("backend", "memory")],
        0.0,
    );
    m.expect("tokengate_config_reloads_total", &[("result", "ok")], 0.0);
    m.expect("tokengate_unsettled_reservations_total", &[], 0.0);
    m.expect(
        "tokengate_spillover_total",
        &[
            ("from", "micro"),
            ("to", "micro-global"),
            ("route", "default"),
        ],
        1.0,
    );

    // maxTokens advice, as gauges ...
    let model = ("model", SONNET_US);
    m.expect("tokengate_output_tokens_p99", &[s, model], 73.0);
    m.expect("tokengate_requested_max_tokens_p99", &[s, model], 1000.0);
    m.expect("tokengate_suggested_max_tokens", &[s, model], 128.0);
    let unused = 1.0 - n(sonnet.output) / n(requested);
    assert!((m.get("tokengate_max_tokens_unused_ratio", &[s, model]) - unused).abs() < 1e-9);

    // Adaptive maxTokens before its samples: nothing capped, no cap.
    let learner = [s, ("route", "default"), model];
    m.expect("tokengate_adaptive_max_tokens", &learner, 0.0);
    m.expect("tokengate_adaptive_capped_calls", &learner, 0.0);
    m.expect("tokengate_adaptive_proxy_truncations", &learner, 0.0);
    m.expect("tokengate_adaptive_raises", &learner, 0.0);

    // What is left of haiku's day and of the account's: every admitted call's charge is gone.
    let day = m.get("tokengate_daily_tokens_available", &[h]);
    assert!((1e8 - 1e4..1e8).contains(&day), "haiku's day {day}");
    let account = m.get(
        "tokengate_budget_tokens_available",
        &[("scope", "account"), ("window", "tokens_per_day")],
    );
    assert!(
        (1e9 - 1e6..1e9).contains(&account),
        "the account's day {account}"
    );
    // The upstream HTTP/2 connections: open, nothing in flight once every call is done.
    let host = format!("http://{}", stack.sim.addr);
    assert!(m.get("tokengate_upstream_connections", &[("host", &host)]) >= 1.0);
    m.expect("tokengate_upstream_streams", &[("host", &host)], 0.0);
    // An endpoint pool nobody called: its copies, and no demand on them.
    m.expect("tokengate_endpoint_copies", &[("pool", "llm")], 2.0);
    m.expect(
        "tokengate_endpoint_demand_per_copy",
        &[("pool", "llm")],
        0.0,
    );

    // ... every metric the proxy registers is in the scrape ...
    let (_, fresh) = tokengate::metrics::Metrics::standalone();
    for family in fresh.families() {
        let series = match family.kind {
            tokengate::metrics::Kind::Histogram => format!("{}_count", family.name),
            _ => family.name.to_string(),
        };
        assert!(m.0.contains_key(&series), "{series} is not in the scrape");
    }

    // ... and in /v1/pools.
    let pools: Value =
        serde_json::from_slice(&raw_request(addr, "GET", "/v1/pools", "", false).await.body)
            .expect("json");
    let pool = |name: &str| {
        pools["pools"]
            .as_array()
            .expect("pools")
            .iter()
            .find(|p| p["name"] == name)
            .cloned()
            .expect("pool")
    };
    let advice = &pool("sonnet4-us")["max_tokens_advice"];
    assert_eq!(advice.as_array().map(Vec::len), Some(1), "{advice}");
    let a = &advice[0];
    assert_eq!(a["model"], SONNET_US);
    assert_eq!(a["requests"], sonnet.requests);
    let (p50, p99) = (
        a["p50_output"].as_u64().expect("p50"),
        a["p99_output"].as_u64().expect("p99"),
    );
    let p99_requested = a["p99_requested_max_tokens"].as_u64().expect("requested");
    let suggested = a["suggested_max_tokens"]
        .as_u64()
        .expect("enough requests to suggest");
    assert!(
        p50 <= p99 && p99 <= p99_requested && p99 <= suggested,
        "{a}"
    );
    assert!((50..=73).contains(&p99) && suggested < 400, "{a}");
    assert!((a["reserved_but_unused_share"].as_f64().expect("share") - unused).abs() < 1e-9);
    let haiku = &pool("haiku")["max_tokens_advice"][0];
    assert_eq!(
        (haiku["requests"].as_u64(), haiku["p99_output"].as_u64()),
        (Some(2), Some(7))
    );
    assert_eq!(
        haiku["suggested_max_tokens"],
        Value::Null,
        "two requests are too few"
    );
    assert_eq!(
        pool("nova")["max_tokens_advice"],
        serde_json::json!([]),
        "no usage, no advice"
    );
}
