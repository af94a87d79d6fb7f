//! The quota report against a known load: a fixed sequence of calls with known usage, over
//! three minutes of a manual clock, through the simulator. Input counts are exact
//! (`input_estimate = "count_tokens"`), so every reservation is `inputTokens + maxTokens` and
//! the report's totals, peaks, medians and quantiles are asserted exactly; then the Markdown
//! form, and `tokengate report` against the running proxy.

use std::time::Duration;

use crate::common::*;
use serde_json::Value;
use tokengate::{
    gateway::{Gateway, GatewayOptions},
    ledger::Clock,
};
use tokio::net::TcpListener;

const NOVA: &str = "us.amazon.nova-lite-v1:0";
/// Instant answers; a stall holds a call 1.5 s; Nova's upstream quota is smaller than the
/// proxy's pool (other traffic shares the account), so upstream throttles it.
const SIM: &str = "time_to_first_token_ms = 0\ntokens_per_second = 0\nstall_ms = 1500\n\
                   [[quotas]]\nmodel = \"us.amazon.nova-lite-v1:0\"\ntokens_per_minute = 1000\n";

fn pools() -> String {
    format!(
        "[[pools]]\nname = \"sonnet4-us\"\nmodels = [\"{SONNET_US}\"]\ntokens_per_minute = 1000000\n\
         max_concurrency = 8\noutput_burndown = 5\ndefault_max_tokens = 1000\ninput_estimate = \"count_tokens\"\n\n\
         [[pools]]\nname = \"haiku\"\nmodels = [\"{HAIKU}\"]\ntokens_per_minute = 1000000\nheadroom = 0.2\n\
         max_concurrency = 1\noutput_burndown = 1\ndefault_max_tokens = 100\ninput_estimate = \"count_tokens\"\n\
         max_wait_ms = 5000\nmax_queue = 1\n\n\
         [[pools]]\nname = \"nova\"\nmodels = [\"{NOVA}\"]\ntokens_per_minute = 1000000\nmax_concurrency = 8\n\
         output_burndown = 1\ndefault_max_tokens = 100\n"
    )
}

/// One Converse call; returns its status and reported input tokens.
async fn converse(
    addr: std::net::SocketAddr,
    model: &str,
    text: &str,
    max: u64,
    headers: &[(&str, &str)],
) -> (u16, u64) {
    let r = raw_request_with(
        addr,
        "POST",
        &model_path(model, "converse"),
        converse_body(text, Some(max)),
        false,
        headers,
    )
    .await;
    let v: Value = serde_json::from_slice(&r.body).unwrap_or_default();
    (r.status, v["usage"]["inputTokens"].as_u64().unwrap_or(0))
}

/// Waits (bounded) until `pool` has `n` requests in flight.
async fn wait_in_flight(proxy: &Gateway, pool: &str, n: u64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while in_flight(proxy, pool) < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{pool}: not {n} in flight"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A prompt with its output length set, held (`stall`) or not (`quiet`, a fault the simulator
/// does not know): every prompt has the same length, so every call the same input count.
fn prompt(output: u64, stall: bool) -> String {
    let fault = if stall { "stall" } else { "quiet" };
    format!("[sim:output={output:03}] [sim:fault={fault}] summarise the quarter's tickets")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_report_adds_up_a_known_load_minute_by_minute() {
    let sim = start_simulator(SIM).await;
    let clock = Clock::manual();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let options = GatewayOptions {
        credentials: Some(proxy_credentials()),
        clock: Some(clock.clone()),
        ..Default::default()
    };
    let config = proxy_config(sim.addr, &pools(), "");
    let proxy = Gateway::start(config, listener, options)
        .await
        .expect("proxy starts");
    let addr = proxy.addr;

    // Minute 0: three Sonnet calls, one after another; maxTokens 200.
    let mut inputs = Vec::new();
    for output in [7, 15, 31] {
        let (status, input) = converse(addr, SONNET_US, &prompt(output, false), 200, &[]).await;
        assert_eq!(status, 200);
        inputs.push(input);
    }
    // Haiku takes one at a time and queues one: a held call, a queued one, then the queue is full
    // for a first attempt (demand) and for an SDK retry (not demand again).
    let held = tokio::spawn(async move { converse(addr, HAIKU, &prompt(3, true), 50, &[]).await });
    wait_in_flight(&proxy, "haiku", 1).await;
    let queued =
        tokio::spawn(async move { converse(addr, HAIKU, &prompt(3, false), 50, &[]).await });
    let depth = || proxy.admission().pools()[1].queue.depth();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while depth() == 0 {
        assert!(tokio::time::Instant::now() < deadline, "nothing queued");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let invocation = (
        "amz-sdk-invocation-id",
        "4a5b6c7d-0000-4000-8000-000000000001",
    );
    let first = [invocation, ("amz-sdk-request", "attempt=1; max=3")];
    let full = converse(addr, HAIKU, &prompt(3, false), 50, &first).await;
    assert_eq!(full.0, 429);
    // The SDK's retry of the same invocation.
    let retry = [invocation, ("amz-sdk-request", "attempt=2; max=3")];
    assert_eq!(
        converse(addr, HAIKU, &prompt(3, false), 50, &retry).await.0,
        429
    );
    let (held, queued) = (held.await.expect("task"), queued.await.expect("task"));
    assert_eq!((held.0, queued.0), (200, 200));
    assert_eq!(held.1, queued.1, "prompts of one length");
    let haiku_input = held.1;
    // Nova: admitted, throttled upstream.
    assert_eq!(
        converse(addr, NOVA, "[sim:output=3] n", 2000, &[]).await.0,
        429
    );

    // Minute 1: the busy minute, five Sonnet calls: two, then three in flight at once.
    clock.advance(Duration::from_secs(60));
    for output in [7, 15] {
        let (status, input) = converse(addr, SONNET_US, &prompt(output, false), 200, &[]).await;
        assert_eq!(status, 200);
        inputs.push(input);
    }
    let stalled: Vec<_> = [63, 127, 255]
        .into_iter()
        .map(|o| {
            tokio::spawn(async move { converse(addr, SONNET_US, &prompt(o, true), 400, &[]).await })
        })
        .collect();
    wait_in_flight(&proxy, "sonnet4-us", 3).await;
    for task in stalled {
        let (status, input) = task.await.expect("task");
        assert_eq!(status, 200);
        inputs.push(input);
    }
    // Minute 2: one call.
    clock.advance(Duration::from_secs(60));
    let (status, input) = converse(addr, SONNET_US, &prompt(31, false), 200, &[]).await;
    assert_eq!(status, 200);
    inputs.push(input);
    let input = inputs[0];
    assert!(
        input > 0 && inputs.iter().all(|i| *i == input),
        "{inputs:?}"
    );
    assert_ledger_zero(&proxy).await;

    let r = raw_request(addr, "GET", "/v1/quota-report", "", false).await;
    assert_eq!(r.status, 200);
    let report: Value = serde_json::from_slice(&r.body).expect("json");
    assert_eq!(report["window_minutes"], 1440);
    let pool = |name: &str| {
        report["pools"]
            .as_array()
            .expect("pools")
            .iter()
            .find(|p| p["pool"] == name)
            .cloned()
            .expect("the pool")
    };

    // Sonnet: reservations input + maxTokens, charges input + output x 5.
    let s = pool("sonnet4-us");
    let reserve = |max: u64, calls: u64| calls * (input + max);
    let charge = |outputs: &[u64]| outputs.iter().map(|o| input + o * 5).sum::<u64>();
    let minute1_reserved = reserve(400, 3) + reserve(200, 2);
    let minute1_charged = charge(&[63, 127, 255, 7, 15]);
    assert_eq!(s["minutes_with_traffic"], 3);
    let first = s["first_minute_unix"].as_u64().expect("first minute");
    let t = &s["tokens_per_minute"];
    assert_eq!(t["reserved"]["peak"], minute1_reserved);
    assert_eq!(t["reserved"]["peak_minute_unix"], first + 60);
    // Steady: the median minute (minutes 0, 1, 2 reserved 3, 5 and 1 calls' worth).
    assert_eq!(t["reserved"]["steady"], reserve(200, 3));
    assert_eq!(t["charged"]["peak"], minute1_charged);
    assert_eq!(t["charged"]["steady"], charge(&[7, 15, 31]));
    assert_eq!(t["demand"]["peak"], minute1_reserved, "nothing turned away");
    let rpm = &s["requests_per_minute"];
    assert_eq!(
        (rpm["steady"].as_u64(), rpm["peak"].as_u64()),
        (Some(3), Some(5))
    );
    assert_eq!(s["peak_concurrency"], 3);
    let totals = &s["totals"];
    assert_eq!(totals["requests"], 9);
    assert_eq!(totals["admitted"], 9);
    assert_eq!(totals["throttled"], 0);
    assert_eq!(
        totals["charged_tokens"],
        charge(&[7, 15, 31]) + minute1_charged + charge(&[31])
    );
    // Outputs 7, 15, 31, 63, 127, 255, 7, 15, 31: each an exact bucket edge.
    assert_eq!(
        s["output_tokens"],
        serde_json::json!({"p50": 31, "p99": 255, "max": 255})
    );
    assert_eq!(
        s["input_tokens"],
        serde_json::json!({"p50": input, "p99": input, "max": input})
    );
    assert!(s["queue_wait_ms"].is_null(), "nothing queued");
    let basis = minute1_reserved.max(minute1_charged);
    let request = &s["quota_request"];
    assert_eq!(request["basis_tokens_per_minute"], basis);
    assert_eq!(request["tokens_per_minute"], basis.div_ceil(1000) * 1000);
    assert_eq!(request["increase_needed"], false);

    // Haiku: two admitted (one after queueing), two turned away, one of them a retry: demand
    // counts the first attempt only; a 20% headroom raises the request.
    let h = pool("haiku");
    let reservation = haiku_input + 50;
    let totals = &h["totals"];
    assert_eq!(
        (
            totals["admitted"].as_u64(),
            totals["throttled"].as_u64(),
            totals["queued"].as_u64()
        ),
        (Some(2), Some(2), Some(1))
    );
    assert_eq!(totals["demand_tokens"], 3 * reservation);
    assert_eq!(h["tokens_per_minute"]["demand"]["peak"], 3 * reservation);
    assert_eq!(h["minutes_with_traffic"], 1);
    assert_eq!(h["peak_concurrency"], 1);
    let waited = &h["queue_wait_ms"];
    assert!(waited["p50"].as_u64() >= Some(1), "{waited}");
    let needed = ((3 * reservation) as f64 / 0.8).ceil() as u64;
    assert_eq!(
        h["quota_request"]["tokens_per_minute"],
        needed.div_ceil(1000) * 1000
    );

    // Nova: throttled upstream; no traffic at all in no pool.
    let n = pool("nova");
    assert_eq!(n["totals"]["upstream_throttles"], 1);
    assert_eq!(n["totals"]["charged_tokens"], 0);

    // Markdown, and the command that prints it.
    let md = raw_request(addr, "GET", "/v1/quota-report?format=markdown", "", false).await;
    assert_eq!(
        md.header("content-type"),
        Some("text/markdown; charset=utf-8")
    );
    let md = String::from_utf8(md.body.to_vec()).expect("utf-8");
    for needle in [
        "# tokengate quota report".to_string(),
        "## sonnet4-us".into(),
        format!(
            "| tokens per minute reserved | {} | {minute1_reserved} |",
            reserve(200, 3)
        ),
        "| requests per minute | 3 | 5 |".into(),
        "| output tokens | 31 | 255 | 255 |".into(),
        format!(
            "No increase needed: {} tokens per minute serve the busiest minute ({basis} tokens)",
            basis.div_ceil(1000) * 1000
        ),
        "with 20% headroom".into(),
        "Upstream throttled 1 requests".into(),
    ] {
        assert!(md.contains(&needle), "{needle:?} not in:\n{md}");
    }
    let bad = raw_request(addr, "GET", "/v1/quota-report?format=xml", "", false).await;
    assert_eq!(bad.status, 400);
    assert!(
        bad.message().contains("format=markdown"),
        "{}",
        bad.message()
    );

    let printed = report_command(&["--url", &format!("http://{addr}")]).await;
    assert!(
        printed.status.success(),
        "{}",
        String::from_utf8_lossy(&printed.stderr)
    );
    assert_eq!(String::from_utf8(printed.stdout).expect("utf-8"), md);
    let json = report_command(&["--url", &format!("http://{addr}/"), "--format", "json"]).await;
    let printed: Value = serde_json::from_slice(&json.stdout).expect("json");
    assert_eq!(printed["pools"], report["pools"]);
    sim.shutdown().await;
}

#[tokio::test]
async fn the_report_command_says_what_failed() {
    let closed = {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        l.local_addr().expect("addr")
    };
    let out = report_command(&["--url", &format!("http://{closed}")]).await;
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("/v1/quota-report") && stderr.contains("cannot connect"),
        "{stderr}"
    );
}

/// `tokengate report` with `args`, run to its end.
async fn report_command(args: &[&str]) -> std::process::Output {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_tokengate"))
            .arg("report")
            .args(args)
            .output()
            .expect("tokengate report runs")
    })
    .await
    .expect("task")
}
