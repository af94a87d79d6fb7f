//! CloudWatch Embedded Metric Format output: every line is checked against the EMF
//! specification's required fields (`_aws.Timestamp`, `CloudWatchMetrics[].Namespace`,
//! `Dimensions`, `Metrics[].Name`, every metric and dimension as a top-level member of the right
//! type), and the interval counts add up to a known load, per pool and per route.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use crate::common::*;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};

/// The units CloudWatch accepts (`MetricDatum.Unit`).
const UNITS: &[&str] = &[
    "Seconds",
    "Microseconds",
    "Milliseconds",
    "Bytes",
    "Kilobytes",
    "Megabytes",
    "Gigabytes",
    "Terabytes",
    "Bits",
    "Kilobits",
    "Megabits",
    "Gigabits",
    "Terabits",
    "Percent",
    "Count",
    "Bytes/Second",
    "Kilobytes/Second",
    "Megabytes/Second",
    "Gigabytes/Second",
    "Terabytes/Second",
    "Bits/Second",
    "Kilobits/Second",
    "Megabits/Second",
    "Gigabits/Second",
    "Terabits/Second",
    "Count/Second",
    "None",
];

/// Checks one line against the EMF specification and returns its dimensions and metrics.
fn validate(line: &str) -> (BTreeMap<String, String>, BTreeMap<String, f64>) {
    let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
    let root = v.as_object().expect("a JSON object");
    let aws = root["_aws"].as_object().expect("_aws is an object");
    let timestamp = aws["Timestamp"]
        .as_u64()
        .expect("_aws.Timestamp: ms since the epoch");
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64;
    assert!(
        timestamp <= now && now - timestamp < 3_600_000,
        "Timestamp {timestamp}"
    );
    let directives = aws["CloudWatchMetrics"]
        .as_array()
        .expect("CloudWatchMetrics array");
    assert!(!directives.is_empty(), "{line}");
    let (mut dims, mut metrics) = (BTreeMap::new(), BTreeMap::new());
    for d in directives {
        let ns = d["Namespace"].as_str().expect("Namespace");
        assert!((1..=255).contains(&ns.len()), "Namespace {ns:?}");
        for set in d["Dimensions"]
            .as_array()
            .expect("Dimensions: an array of sets")
        {
            let set = set.as_array().expect("a dimension set is an array");
            assert!(set.len() <= 30, "{line}");
            for key in set {
                let key = key.as_str().expect("dimension keys are strings");
                let value = root
                    .get(key)
                    .unwrap_or_else(|| panic!("dimension {key} is not a member"));
                let value = value.as_str().expect("dimension values are strings");
                assert!(!value.is_empty() && value.len() <= 1024);
                dims.insert(key.to_string(), value.to_string());
            }
        }
        let defs = d["Metrics"].as_array().expect("Metrics array");
        assert!((1..=100).contains(&defs.len()), "{line}");
        for m in defs {
            let name = m["Name"].as_str().expect("Metrics[].Name");
            assert!((1..=255).contains(&name.len()));
            if let Some(unit) = m.get("Unit") {
                assert!(UNITS.contains(&unit.as_str().expect("unit")), "unit {unit}");
            }
            if let Some(res) = m.get("StorageResolution") {
                assert!(res == 1 || res == 60, "StorageResolution {res}");
            }
            let value = root
                .get(name)
                .unwrap_or_else(|| panic!("metric {name} is not a member"));
            let value = value.as_f64().expect("metric values are numbers");
            metrics.insert(name.to_string(), value);
        }
    }
    assert!(!dims.is_empty(), "{line}");
    (dims, metrics)
}

/// Sums each metric over the lines of each dimension set (pool, or pool/route); `latest` keeps
/// the last value of the gauges.
fn totals(text: &str) -> BTreeMap<String, BTreeMap<String, f64>> {
    let mut out: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
    for line in text.lines().filter(|l| l.contains("\"_aws\"")) {
        let (dims, metrics) = validate(line);
        let key = dims.values().cloned().collect::<Vec<_>>().join("/");
        let sums = out.entry(key).or_default();
        for (name, v) in metrics {
            *sums.entry(name).or_default() += v;
        }
    }
    out
}

fn pools() -> String {
    format!(
        "{}max_wait_ms = 0\n\n[[pools]]\nname = \"haiku\"\nmodels = [\"{HAIKU}\"]\ntokens_per_minute = 100000\n\
         max_concurrency = 4\noutput_burndown = 1\ndefault_max_tokens = 100\n",
        sonnet_pool(20_000, 8)
    )
}

const ROUTES: &str = "[auth]\nmode = \"bearer\"\nallow_plaintext_bearer = true\n\n\
     [[routes]]\nname = \"triage\"\nbearer_token_sha256 = \"TRIAGE\"\n\n\
     [[routes]]\nname = \"batch\"\nbearer_token_sha256 = \"BATCH\"\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emf_lines_follow_the_specification_and_add_up_to_the_load() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("emf.log");
    let extra = format!(
        "{}\n[metrics]\ncloudwatch_emf = \"{}\"\ncloudwatch_emf_interval_secs = 1\ncloudwatch_emf_namespace = \"Team/Gateway\"\n",
        ROUTES
            .replace("TRIAGE", &sha256_hex("triage-key"))
            .replace("BATCH", &sha256_hex("batch-key")),
        path.display()
    );
    let sim = "time_to_first_token_ms = 0\ntokens_per_second = 0\nstall_ms = 1500\n";
    let stack = Stack::start(sim, &pools(), &extra).await;
    let addr = stack.proxy.addr;
    let call = |key: &'static str, model: &'static str, text: String, max: u64| async move {
        let auth = format!("Bearer {key}");
        raw_request_with(
            addr,
            "POST",
            &model_path(model, "converse"),
            converse_body(&text, Some(max)),
            false,
            &[("authorization", auth.as_str())],
        )
        .await
    };
    // Triage: three Sonnet calls; batch: two, one of them held while a third does not fit (the
    // bucket holds 20k, the held one reserves 15k).
    let mut charged = BTreeMap::<&str, u64>::new();
    let mut count = |route, r: RawResponse, output: u64| {
        assert_eq!(r.status, 200, "{}", r.message());
        let v: Value = serde_json::from_slice(&r.body).expect("json");
        let input = v["usage"]["inputTokens"].as_u64().expect("input");
        *charged.entry(route).or_default() += input + output * 5;
    };
    for (key, route, output) in [
        ("triage-key", "triage", 10),
        ("triage-key", "triage", 20),
        ("batch-key", "batch", 30),
        ("triage-key", "triage", 40),
    ] {
        count(
            route,
            call(key, SONNET_US, format!("[sim:output={output}] x"), 500).await,
            output,
        );
    }
    let held = tokio::spawn(call(
        "batch-key",
        SONNET_US,
        "[sim:output=50] [sim:fault=stall] x".into(),
        15_000,
    ));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while in_flight(&stack.proxy, "sonnet4-us") == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the held call was not admitted"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let r = call("batch-key", SONNET_US, "big".into(), 6_000).await;
    assert_eq!(r.status, 429, "{}", r.message());
    count("batch", held.await.expect("task"), 50);
    let r = call("triage-key", HAIKU, "[sim:output=5] h".into(), 50).await;
    assert_eq!(r.status, 200);
    stack.assert_ledger_zero().await;
    let (sim, proxy) = (stack.sim, stack.proxy);
    // Shutdown writes the last interval.
    proxy.shutdown().await.expect("shutdown");
    sim.shutdown().await;

    let text = std::fs::read_to_string(&path).expect("the EMF file");
    let t = totals(&text);
    let sonnet = &t["sonnet4-us"];
    assert_eq!(sonnet["Requests"], 6.0);
    assert_eq!(sonnet["Admitted"], 5.0);
    assert_eq!(sonnet["Throttles"], 1.0);
    assert_eq!(
        sonnet["TokensCharged"],
        (charged["triage"] + charged["batch"]) as f64
    );
    assert!(sonnet["TokensDemanded"] >= sonnet["TokensReserved"] + 6_000.0);
    let triage = &t["sonnet4-us/triage"];
    assert_eq!((triage["Requests"], triage["Admitted"]), (3.0, 3.0));
    assert_eq!(triage["TokensCharged"], charged["triage"] as f64);
    let batch = &t["sonnet4-us/batch"];
    assert_eq!((batch["Requests"], batch["Throttles"]), (3.0, 1.0));
    assert_eq!(batch["TokensCharged"], charged["batch"] as f64);
    assert_eq!(
        triage["TokensReserved"] + batch["TokensReserved"],
        sonnet["TokensReserved"]
    );
    assert_eq!(t["haiku/triage"]["Requests"], 1.0);
    assert_eq!(t["haiku/batch"]["Requests"], 0.0, "a line for every route");
    // The namespace, the metric set of each kind of line, and a line per pool and route.
    let first: Value = serde_json::from_str(text.lines().next().expect("a line")).expect("json");
    assert_eq!(
        first["_aws"]["CloudWatchMetrics"][0]["Namespace"],
        "Team/Gateway"
    );
    let names = |key: &str| t[key].keys().cloned().collect::<BTreeSet<_>>();
    for m in [
        "InFlight",
        "QueueDepth",
        "QueuedTokens",
        "PeakInFlight",
        "TokensDemanded",
    ] {
        assert!(names("sonnet4-us").contains(m), "{m}");
    }
    assert!(names("haiku/batch").contains("ReservedInFlight"));
    assert_eq!(t.len(), 2 + 2 * 2, "{:?}", t.keys());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokengate_serve_writes_emf_lines_to_stdout() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("tokengate.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n\n[upstream]\nregion = \"us-east-1\"\nendpoint = \"simulated\"\n\n\
             [simulator]\ntime_to_first_token_ms = 0\ntokens_per_second = 0\n\n\
             [metrics]\ncloudwatch_emf = \"stdout\"\ncloudwatch_emf_interval_secs = 1\n\n{}",
            sonnet_pool(100_000, 4)
        ),
    )
    .expect("config");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_tokengate"))
        .args(["serve", "--config"])
        .arg(&config)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("tokengate serve");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let addr = loop {
        let line = next_line(&mut lines, deadline).await;
        if let Some(a) = line.strip_prefix("tokengate listening on http://") {
            break a.parse().expect("address");
        }
    };
    let r = raw_request(
        addr,
        "POST",
        &model_path(SONNET_US, "converse"),
        converse_body("[sim:output=9] x", Some(50)),
        false,
    )
    .await;
    assert_eq!(r.status, 200);
    loop {
        let line = next_line(&mut lines, deadline).await;
        if !line.contains("\"_aws\"") {
            continue;
        }
        let (dims, metrics) = validate(&line);
        assert_eq!(dims["Pool"], "sonnet4-us");
        if metrics["Requests"] == 1.0 {
            assert_eq!(metrics["Admitted"], 1.0);
            break;
        }
    }
    child.kill().await.expect("kill");
}

/// The child's next stdout line, by `deadline`.
async fn next_line(
    lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    deadline: tokio::time::Instant,
) -> String {
    tokio::time::timeout_at(deadline, lines.next_line())
        .await
        .expect("in time")
        .expect("stdout")
        .expect("a line")
}

/// A request that spilled counts in `SpilledIn` of the pool it ran in (and of its route there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spilled_request_counts_in_the_pool_it_ran_in() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("emf.log");
    let pools = haiku_spilling_west();
    let extra = format!(
        "[[routes]]\nname = \"default\"\nspill = true\n\n[metrics]\ncloudwatch_emf = \"{}\"\n\
         cloudwatch_emf_interval_secs = 1\n",
        path.display()
    );
    let sim = "time_to_first_token_ms = 0\ntokens_per_second = 0\nstall_ms = 1500\n";
    let stack = Stack::start(sim, &pools, &extra).await;
    let addr = stack.proxy.addr;
    let call = |text: &'static str| async move {
        raw_request(
            addr,
            "POST",
            &model_path(HAIKU, "converse"),
            converse_body(text, Some(10)),
            false,
        )
        .await
        .status
    };
    // The home pool's only permit, held; the next call spills.
    let held = tokio::spawn(call("[sim:fault=stall] held"));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while in_flight(&stack.proxy, "haiku") == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the held call was not admitted"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(call("[sim:output=3] spills").await, 200);
    assert_eq!(held.await.expect("task"), 200);
    stack.assert_ledger_zero().await;
    let (sim, proxy) = (stack.sim, stack.proxy);
    proxy.shutdown().await.expect("shutdown");
    sim.shutdown().await;

    let t = totals(&std::fs::read_to_string(&path).expect("the EMF file"));
    let counts = |key: &str| (t[key]["Admitted"], t[key]["SpilledIn"]);
    assert_eq!(counts("haiku"), (1.0, 0.0));
    assert_eq!(counts("haiku-west"), (1.0, 1.0));
    assert_eq!(counts("haiku-west/default"), (1.0, 1.0));
}
