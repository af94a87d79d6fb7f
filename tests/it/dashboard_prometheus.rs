//! The dashboard and the alert rules, proven on a real Prometheus: a `prometheus` server scrapes
//! a running proxy every second (with `config/prometheus/alerts.yml` loaded) while a short mixed
//! load runs (admits, throttles, queueing and queue timeouts, spillover, streams, upstream
//! throttles, errors and resets, a refused reload). Then every panel query of `config/grafana/tokengate.json`
//! (template variables substituted as Grafana would) and every alert expression is evaluated
//! through Prometheus's HTTP API at the end of the load: each must be valid, each panel must
//! return series carrying the labels its legend names, with a number; the alerts that the load
//! provokes must fire their expressions, and the rest are named below with the reason they stay
//! empty.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use crate::common::{prometheus::Prometheus, *};
use serde_json::Value;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const NOVA: &str = "us.amazon.nova-lite-v1:0";

/// Grafana's `$__rate_interval` for a 1 s scrape on a short range, and the range itself.
const RATE_INTERVAL: &str = "20s";
const RANGE: &str = "5m";

/// Alerts the short load cannot fire, and why.
const EXPECTED_EMPTY: &[(&str, &str)] = &[
    (
        "TokengateLedgerErrors",
        "the memory ledger has no backend to fail",
    ),
    (
        "TokengateQuotaNearExhaustion",
        "needs 90% of the quota charged on average over 10 minutes; the load lasts seconds",
    ),
    (
        "TokengateUpstreamDailyQuota",
        "the load's simulator keeps no daily quota (tests/it/daily_quota.rs provokes upstream's daily 429)",
    ),
    (
        "TokengateUnsettledReservations",
        "every reservation is settled (a bug otherwise)",
    ),
];

/// Instant answers, a stall holds a call 1.2 s; Nova's upstream quota is below the proxy's pool.
const SIM: &str = "time_to_first_token_ms = 20\ntokens_per_second = 0\nstall_ms = 1200\n\
                   [[quotas]]\nmodel = \"us.amazon.nova-lite-v1:0\"\ntokens_per_minute = 1000\n";

fn pools() -> String {
    format!(
        "[[pools]]\nname = \"sonnet4-us\"\nmodels = [\"{SONNET_US}\"]\ntokens_per_minute = 2000000\n\
         max_concurrency = 3\noutput_burndown = 5\ndefault_max_tokens = 1000\nmax_wait_ms = 400\n\n\
         [[pools]]\nname = \"haiku\"\nmodels = [\"{HAIKU}\"]\ntokens_per_minute = 1000000\n\
         max_concurrency = 1\noutput_burndown = 1\ndefault_max_tokens = 100\nmax_wait_ms = 0\n\
         tokens_per_day = 1000000000\n\
         spill_to = [\"haiku-west\"]\n\n\
         [[pools]]\nname = \"haiku-west\"\nmodels = [\"{HAIKU_WEST}\"]\nregion = \"us-west-2\"\n\
         tokens_per_minute = 1000000\nmax_concurrency = 1\noutput_burndown = 1\ndefault_max_tokens = 100\n\
         max_wait_ms = 0\n\n\
         [[pools]]\nname = \"nova\"\nmodels = [\"{NOVA}\"]\ntokens_per_minute = 1000000\nmax_concurrency = 8\n\
         output_burndown = 1\ndefault_max_tokens = 100\n"
    )
}

async fn call(addr: SocketAddr, model: &str, op: &str, text: String, max: u64) -> u16 {
    raw_request(
        addr,
        "POST",
        &model_path(model, op),
        converse_body(&text, Some(max)),
        false,
    )
    .await
    .status
}

/// One round of the mixed load: a few seconds of everything the dashboard shows.
async fn round(addr: SocketAddr, i: u64) {
    let mut tasks = Vec::new();
    // Sonnet: three held calls fill its concurrency; two more queue, time out (400 ms < 1.2 s).
    for k in 0..5 {
        let text = format!("[sim:output={}] [sim:fault=stall] held {i} {k}", 20 + k);
        tasks.push(tokio::spawn(call(addr, SONNET_US, "converse", text, 300)));
    }
    // Haiku: one at a time, no queue: one of three runs at home, one spills to us-west-2, one is
    // turned away.
    for k in 0..3 {
        let text = format!("[sim:output=5] [sim:fault=stall] h {i} {k}");
        tasks.push(tokio::spawn(call(addr, HAIKU, "converse", text, 50)));
    }
    for task in tasks {
        task.await.expect("task");
    }
    // Then, with room again: plain calls and streams (queueing briefly behind each other), an
    // upstream 503, a reset, and an upstream throttle.
    let mut tasks = Vec::new();
    for k in 0..8 {
        let op = if k % 2 == 0 {
            "converse"
        } else {
            "converse-stream"
        };
        let text = format!("[sim:output={}] call {i} {k}", 30 + 40 * k);
        tasks.push(tokio::spawn(call(addr, SONNET_US, op, text, 800)));
    }
    for task in tasks {
        task.await.expect("task");
    }
    call(addr, SONNET_US, "converse", "[sim:fault=503] x".into(), 100).await;
    call(
        addr,
        SONNET_US,
        "converse",
        "[sim:fault=reset] x".into(),
        100,
    )
    .await;
    call(
        addr,
        NOVA,
        "converse",
        format!("[sim:output=5] n {i}"),
        2000,
    )
    .await;
}

/// Grafana's substitutions: every pool (the `All` value), the rate interval and the range.
fn substitute(expr: &str) -> String {
    expr.replace("$pool", ".*")
        .replace("$__rate_interval", RATE_INTERVAL)
        .replace("${__rate_interval}", RATE_INTERVAL)
        .replace("$__range", RANGE)
}

/// The labels a legend names (`{{pool}} {{outcome}}`), or a table's `by (...)` labels.
fn expected_labels(legend: &str, expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = legend;
    while let Some(start) = rest.find("{{") {
        let end = rest[start..].find("}}").expect("closed") + start;
        out.insert(rest[start + 2..end].trim().to_string());
        rest = &rest[end + 2..];
    }
    if legend.is_empty()
        && let Some(start) = expr.find(" by (")
    {
        let inner = &expr[start + 5..];
        let inner = &inner[..inner.find(')').expect("closed")];
        out.extend(inner.split(',').map(|l| l.trim().to_string()));
    }
    out.remove("le");
    out
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_panel_and_alert_evaluates_on_a_real_prometheus() {
    // A daily quota and budgets, for the panels of what is left of them; the implicit route's
    // settings declared with an adaptive maxTokens too (that never has its samples, so nothing
    // here is capped), so that its panels have series to show.
    let budgets = "[admission]\naccount_tokens_per_day = 1000000000\n\
                   [[routes]]\nname = \"default\"\nspill = true\nbudgets = { tokens_per_day = 1000000000 }\n\
                   adaptive_max_tokens = { min_samples = 1000000 }\n";
    let stack = Stack::start(SIM, &pools(), budgets).await;
    let addr = stack.proxy.addr;
    let rules = std::path::Path::new(ROOT).join("config/prometheus/alerts.yml");
    let Some(prom) = Prometheus::start(addr, &rules).await else {
        return;
    };
    // Wait for the first scrape.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while prom
        .query("tokengate_configured_tokens_per_minute", now())
        .await
        .unwrap_or_default()
        .is_empty()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "prometheus never scraped the proxy"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A config file that does not validate: refused and counted.
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[server]\nlisten = \"nowhere\"\n").expect("write");
    assert!(stack.proxy.reload_from(&bad).is_err());
    for i in 0..4 {
        round(addr, i).await;
    }
    stack.assert_ledger_zero().await;
    // Evaluate at the first scrape after the load.
    let end = now();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let at = loop {
        let latest = prom
            .query("max(timestamp(tokengate_requests_total))", now())
            .await
            .expect("query");
        let t = latest
            .first()
            .and_then(|s| s["value"][1].as_str()?.parse::<f64>().ok());
        if let Some(t) = t.filter(|t| *t >= end) {
            break t;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no scrape after the load"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{ROOT}/config/grafana/tokengate.json")).expect("read"),
    )
    .expect("json");
    let mut failures = Vec::new();
    let mut evaluated = 0;
    for panel in dashboard["panels"].as_array().expect("panels") {
        let title = panel["title"].as_str().unwrap_or_default();
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = substitute(target["expr"].as_str().expect("expr"));
            let legend = target["legendFormat"].as_str().unwrap_or_default();
            evaluated += 1;
            match prom.query(&expr, at).await {
                Err(e) => failures.push(format!("{title}: {e}")),
                Ok(series) => {
                    if let Some(problem) = check_series(&series, &expected_labels(legend, &expr)) {
                        failures.push(format!("{title}: {expr}: {problem}"));
                    }
                }
            }
        }
    }
    assert!(evaluated >= 40, "{evaluated} panel queries");
    // The pool picker.
    let pools = prom
        .api(
            "label/pool/values",
            &[("match[]", "tokengate_configured_tokens_per_minute")],
        )
        .await
        .expect("label values");
    assert_eq!(
        pools,
        serde_json::json!(["haiku", "haiku-west", "nova", "sonnet4-us"])
    );

    // Alert expressions: all valid; those the load provokes return series.
    let alerts: serde_norway::Value =
        serde_norway::from_str(&std::fs::read_to_string(&rules).expect("read")).expect("yaml");
    let expected_empty: BTreeMap<_, _> = EXPECTED_EMPTY.iter().copied().collect();
    let mut fired = BTreeSet::new();
    for group in alerts["groups"].as_sequence().expect("groups") {
        for rule in group["rules"].as_sequence().expect("rules") {
            let name = rule["alert"].as_str().expect("alert");
            let expr = rule["expr"].as_str().expect("expr");
            match prom.query(expr, at).await {
                Err(e) => failures.push(format!("alert {name}: {e}")),
                Ok(series) if series.is_empty() => {
                    if !expected_empty.contains_key(name) {
                        failures.push(format!("alert {name} did not fire: {expr}"));
                    }
                }
                Ok(_) => {
                    if let Some(why) = expected_empty.get(name) {
                        failures.push(format!("alert {name} fired, but {why}"));
                    }
                    fired.insert(name.to_string());
                }
            }
        }
    }
    // Prometheus evaluates the rules itself too: every one healthy.
    let rules = prom.api("rules", &[]).await.expect("rules");
    for group in rules["groups"].as_array().expect("groups") {
        for rule in group["rules"].as_array().expect("rules") {
            if rule["health"] != "ok" && rule["health"] != "unknown" {
                failures.push(format!(
                    "rule {}: {} {}",
                    rule["name"], rule["health"], rule["lastError"]
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(fired.len() >= 5, "{fired:?}");
}

/// `None` if `series` is data with `labels` and at least one number; else what is wrong.
fn check_series(series: &[Value], labels: &BTreeSet<String>) -> Option<String> {
    if series.is_empty() {
        return Some("no data".into());
    }
    for s in series {
        let metric = s["metric"].as_object().cloned().unwrap_or_default();
        if let Some(missing) = labels.iter().find(|l| !metric.contains_key(*l)) {
            return Some(format!("a series without {missing}: {s}"));
        }
    }
    let number = |s: &Value| {
        let v = if s.is_array() { &s[1] } else { &s["value"][1] };
        v.as_str()
            .and_then(|v| v.parse::<f64>().ok())
            .is_some_and(f64::is_finite)
    };
    (!series.iter().any(number)).then(|| format!("no series has a number: {series:?}"))
}
