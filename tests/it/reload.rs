//! Config reload: a valid config swaps atomically without dropping in-flight requests (their
//! reservations, made under the old config, settle in the same ledger), and no request ever sees
//! parts of two configs; new limits, pools and routes apply from the next request; each pool
//! keeps what it learned (input calibration, throttle feedback); an invalid config is refused and
//! counted, and the old one stays.

use crate::common::*;
use aws_sdk_bedrockruntime::types::ConverseStreamOutput;
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

/// What a pool learned survives a reload: the effective limit upstream throttles shrank, and the
/// input calibration an under-estimate raised.
#[tokio::test]
async fn a_reload_keeps_what_each_pool_learned() {
    // Upstream's quota is far below the pool's (other traffic shares the account): a large call
    // is throttled there.
    let sim =
        "time_to_first_token_ms = 0\ntokens_per_second = 0\ndefault_tokens_per_minute = 30000\n";
    let stack = Stack::start(sim, &pools(1_000_000, false), "").await;
    let path = model_path(SONNET_US, "converse");
    // An image of 40,000 base64 characters: the estimate counts it as one image (1,600 tokens),
    // the simulator as 10,000 tokens of text. Calibration jumps to its ceiling of 4.
    let image = "A".repeat(40_000);
    let body = serde_json::json!({"messages": [{"role": "user", "content": [
        {"text": "[sim:output=5] what is it?"},
        {"image": {"format": "png", "source": {"bytes": image}}}]}],
        "inferenceConfig": {"maxTokens": 10}});
    let r = raw_request(stack.proxy.addr, "POST", &path, body.to_string(), false).await;
    assert_eq!(r.status, 200, "{}", r.message());
    // Twice the simulator's quota: upstream throttles it.
    let r = raw_request(
        stack.proxy.addr,
        "POST",
        &path,
        converse_body("x", Some(60_000)),
        false,
    )
    .await;
    assert_eq!(
        r.header("x-tokengate-reason"),
        Some("upstream"),
        "{}",
        r.message()
    );
    let learned = |stack: &Stack| {
        let admission = stack.proxy.admission();
        let pool = &admission.pools()[0];
        (pool.calibration_ratio(), pool.limit_factor())
    };
    let (ratio, factor) = learned(&stack);
    assert_eq!(
        ratio, 4.0,
        "calibrated to its ceiling by the under-estimate"
    );
    // x0.8 at the throttle, regrowing 1% a second: below 1 for twenty seconds; a new pool's is 1.
    assert!(factor < 1.0, "shrunk by the throttle: {factor}");

    let new = proxy_config(stack.sim.addr, &pools(900_000, false), "");
    stack.proxy.reload(new).expect("a valid config reloads");
    let (after_ratio, after_factor) = learned(&stack);
    assert_eq!(
        stack.proxy.admission().pool_views().await[0].tokens_per_minute,
        900_000,
        "the new config is in force"
    );
    assert_eq!(after_ratio, 4.0, "the calibration carried over");
    assert!(
        after_factor < 1.0,
        "the throttle feedback carried over: {after_factor}"
    );
    stack.assert_ledger_zero().await;
}

/// Two configs, A and B, that no request can mix: each names its own route (with its own
/// maxTokens ceiling) and its own pool. Reloads alternate between them while callers keep
/// sending, some of them with a reload between their head and their body; every answer comes
/// whole from one generation: the output its route's ceiling allows, and an access-log line
/// with that route, that pool and that ceiling.
// Requests and reloads on several threads, so that a reload can fall anywhere in a request; the
// log subscriber is the process's (no other test of this binary installs one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_sees_one_whole_config_while_reloads_alternate() {
    use std::sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    };
    use tokio::io::AsyncWriteExt;
    let capture = log_capture::Capture::default();
    tracing::subscriber::set_global_default(capture.subscriber()).expect("the only subscriber");
    let generation = |name: &str, ceiling: u64| {
        let pool = format!(
            "[[pools]]\nname = \"pool-{name}\"\nmodels = [\"{HAIKU}\"]\ntokens_per_minute = 10000000\n\
             max_concurrency = 64\noutput_burndown = 1\ndefault_max_tokens = 500\n"
        );
        let extra = format!(
            "[auth]\nmode = \"none\"\ndefault_route = \"{name}\"\n\n\
             [[routes]]\nname = \"{name}\"\nmax_tokens_ceiling = {ceiling}\n"
        );
        (pool, extra)
    };
    let (a, b) = (generation("alpha", 100), generation("beta", 200));
    let sim = "time_to_first_token_ms = 0\ntokens_per_second = 0\ndefault_tokens_per_minute = 100000000\n";
    let stack = Arc::new(Stack::start(sim, &a.0, &a.1).await);
    let addr = stack.proxy.addr;
    let path = model_path(HAIKU, "converse");
    let body = converse_body("[sim:output=400] write at length", Some(1000));
    let running = Arc::new(AtomicBool::new(true));
    let answers = Arc::new(Mutex::new(Vec::new()));
    let callers: Vec<_> = (0..4)
        .map(|_| {
            let (running, answers) = (running.clone(), answers.clone());
            let (path, body) = (path.clone(), body.clone());
            tokio::spawn(async move {
                while running.load(Ordering::Relaxed) {
                    let r = raw_request(addr, "POST", &path, body.clone(), false).await;
                    let id = r.header("x-amzn-requestid").unwrap_or_default().to_string();
                    answers.lock().expect("lock").push((r.status, id, r.body));
                }
            })
        })
        .collect();
    for round in 0..20 {
        // Heads first: a request takes its policy as its head arrives, so the reload below
        // falls between the policy it started with and the body it admits on.
        let mut split = Vec::new();
        for _ in 0..8 {
            let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
            let head = wire::post_head(addr, &path, body.len());
            stream.write_all(head.as_bytes()).await.expect("head");
            split.push(stream);
        }
        // Time for the proxy to take the heads (one that has not yet simply gets the next
        // generation whole).
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        let (pools, extra) = if round % 2 == 0 { &b } else { &a };
        stack
            .proxy
            .reload(proxy_config(stack.sim.addr, pools, extra))
            .expect("reload");
        let finish = split.into_iter().map(|mut stream| {
            let body = body.clone();
            async move {
                stream.write_all(body.as_bytes()).await.expect("body");
                read_response(&mut stream).await
            }
        });
        let finished = futures_util::future::join_all(finish).await;
        answers.lock().expect("lock").extend(finished);
    }
    running.store(false, Ordering::Relaxed);
    for caller in callers {
        caller.await.expect("caller");
    }
    stack.assert_ledger_zero().await;

    let lines = capture.access_lines();
    let answers = answers.lock().expect("lock");
    let mut seen = std::collections::BTreeMap::new();
    for (status, id, body) in answers.iter() {
        let body: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
        assert_eq!(*status, 200, "{body}");
        let output = body["usage"]["outputTokens"].as_u64().expect("usage");
        let line = lines
            .iter()
            .find(|l| l["request_id"] == id.as_str())
            .unwrap_or_else(|| panic!("no access-log line for {id}"));
        let (route, pool, max) = (&line["route"], &line["pool"], &line["max_tokens"]);
        let whole = match output {
            100 => route == "alpha" && pool == "pool-alpha" && max == 100,
            200 => route == "beta" && pool == "pool-beta" && max == 200,
            _ => false,
        };
        assert!(whole, "output {output} with {line}: a mixed generation");
        *seen.entry(output).or_insert(0) += 1;
    }
    assert_eq!(seen.len(), 2, "both generations served: {seen:?}");
}

/// A whole HTTP/1.1 response with a content length: status, request id, body.
async fn read_response(stream: &mut tokio::net::TcpStream) -> (u16, String, bytes::Bytes) {
    use tokio::io::AsyncReadExt;
    let (status, head, mut body) = wire::read_head(stream).await;
    let header = |name: &str| {
        head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
    };
    let length: usize = header("content-length")
        .and_then(|v| v.parse().ok())
        .expect("a content length");
    let mut chunk = [0u8; 4096];
    while body.len() < length {
        let n = stream.read(&mut chunk).await.expect("read");
        assert!(n > 0, "the body ended early");
        body.extend_from_slice(&chunk[..n]);
    }
    (
        status,
        header("x-amzn-requestid").unwrap_or_default(),
        body.into(),
    )
}
