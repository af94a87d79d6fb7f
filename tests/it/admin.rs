//! The operator's surface: `/v1/pools`, `/metrics`, health endpoints, `check-config`, and pool
//! resolution options (unknown models passed through, application inference profiles).

use std::process::Command;

use crate::common::*;

const FAST_SIM: &str =
    "time_to_first_token_ms = 0\ntokens_per_second = 0\ndefault_tokens_per_minute = 10000000\n";

#[tokio::test]
async fn pools_and_metrics_show_the_ledger() {
    let stack = Stack::start(FAST_SIM, &sonnet_pool(200_000, 8), "").await;
    let addr = stack.proxy.addr;
    let ok = raw_request(
        addr,
        "POST",
        &model_path(SONNET_US, "converse"),
        converse_body("[sim:output=20] hi", Some(500)),
        false,
    )
    .await;
    assert_eq!(ok.status, 200);
    let never = raw_request(
        addr,
        "POST",
        &model_path(SONNET_US, "converse"),
        converse_body("hi", Some(500_000)),
        false,
    )
    .await;
    assert_eq!(never.status, 400);
    stack.assert_ledger_zero().await;

    let pools = raw_request(addr, "GET", "/v1/pools", "", false).await;
    assert_eq!(pools.status, 200);
    let v: serde_json::Value = serde_json::from_slice(&pools.body).expect("json");
    assert_eq!(v["ledger"], "memory");
    assert_eq!(v["unsettled_reservations"], 0);
    let pool = &v["pools"][0];
    assert_eq!(pool["name"], "sonnet4-us");
    assert_eq!(pool["tokens_per_minute"], 200_000);
    assert_eq!(pool["effective_tokens_per_minute"], 200_000);
    assert_eq!(pool["admitted"], 1);
    assert_eq!(pool["rejected"]["never_fits"], 1);
    assert_eq!(pool["ledger"]["reserved_tokens"], 0);
    assert_eq!(pool["ledger"]["in_flight_requests"], 0);
    // The one request was charged (input + 20 x 5), so the bucket is below capacity.
    let available = pool["ledger"]["tokens_available"].as_i64().expect("tokens");
    assert!(available < 200_000 && available > 199_000, "{available}");
    assert!(
        pool["learned"]["input_calibration_ratio"]
            .as_f64()
            .is_some()
    );

    let metrics = raw_request(addr, "GET", "/metrics", "", false).await;
    let text = String::from_utf8_lossy(&metrics.body).to_string();
    for line in [
        r#"tokengate_requests_total{api="bedrock",operation="Converse",outcome="admitted",pool="sonnet4-us"} 1"#,
        r#"tokengate_requests_total{api="bedrock",operation="Converse",outcome="invalid",pool="sonnet4-us"} 1"#,
        r#"tokengate_rejections_total{pool="sonnet4-us",reason="never_fits"} 1"#,
        r#"tokengate_reserved_tokens{pool="sonnet4-us"} 0"#,
        r#"tokengate_inflight_requests{pool="sonnet4-us"} 0"#,
        r#"tokengate_settlements_total{pool="sonnet4-us",rule="usage"} 1"#,
        r#"tokengate_output_tokens_total{pool="sonnet4-us"} 20"#,
        r#"tokengate_configured_tokens_per_minute{pool="sonnet4-us"} 200000"#,
        r#"tokengate_upstream_responses_total{pool="sonnet4-us",status="200"} 1"#,
        "tokengate_unsettled_reservations_total 0",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }
    assert!(
        text.contains("tokengate_upstream_throttles_total"),
        "registered from the start"
    );

    assert_eq!(
        raw_request(addr, "GET", "/healthz", "", false).await.status,
        200
    );
    assert_eq!(
        raw_request(addr, "GET", "/readyz", "", false).await.status,
        200
    );
}

#[tokio::test]
async fn unknown_models_pass_uncounted_when_configured() {
    let stack = Stack::start(
        FAST_SIM,
        &sonnet_pool(200_000, 8),
        "[admission]\nunknown_models = \"pass\"\n",
    )
    .await;
    let r = raw_request(
        stack.proxy.addr,
        "POST",
        &model_path(HAIKU, "converse"),
        converse_body("hi", Some(10)),
        false,
    )
    .await;
    assert_eq!(r.status, 200);
    let passed = stack
        .proxy
        .state
        .metrics
        .requests
        .with_label_values(&["none", "bedrock", "Converse", "unknown_model_passed"])
        .get();
    assert_eq!(passed, 1);
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn application_inference_profiles_draw_on_the_pool_they_map_to() {
    let arn = "arn:aws:bedrock:us-east-1:123456789012:application-inference-profile/team-a";
    let extra = format!("[admission.application_profiles]\n\"{arn}\" = \"{SONNET_US}\"\n");
    let stack = Stack::start(FAST_SIM, &sonnet_pool(200_000, 8), &extra).await;
    // The simulator does not know application profiles; what matters is which pool admitted it.
    let _ = raw_request(
        stack.proxy.addr,
        "POST",
        &model_path(arn, "converse"),
        converse_body("hi", Some(10)),
        false,
    )
    .await;
    let admitted = stack
        .proxy
        .state
        .metrics
        .requests
        .with_label_values(&["sonnet4-us", "bedrock", "Converse", "admitted"])
        .get();
    assert_eq!(admitted, 1);
    stack.assert_ledger_zero().await;
}

#[test]
fn check_config_accepts_shipped_configs_and_names_the_bad_key() {
    let bin = env!("CARGO_BIN_EXE_tokengate");
    let root = env!("CARGO_MANIFEST_DIR");
    let ok = Command::new(bin)
        .args(["check-config", &format!("{root}/config/local.toml")])
        .output()
        .expect("runs");
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    // The values in force per pool, and where the model facts come from.
    let stdout = String::from_utf8_lossy(&ok.stdout);
    for says in [
        "pool \"sonnet4-us\" (on_demand): tokens_per_minute = 200000",
        "max_output_tokens = 64000 (catalogue: Claude Sonnet 4, uncertain)",
        "output_burndown = 5 (from the config)",
        "when_max_tokens_missing = \"reserve_model_max\"",
        "pool \"gpt-oss-120b\" (on_demand)",
        "max_output_tokens = 4096 (from the config)",
    ] {
        assert!(stdout.contains(says), "{stdout} lacks {says:?}");
    }

    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("bad.toml");
    let text = std::fs::read_to_string(format!("{root}/config/local.toml")).expect("read");
    std::fs::write(
        &bad,
        text.replacen("max_concurrency = 32", "max_concurrency = 0", 1),
    )
    .expect("write");
    let out = Command::new(bin)
        .args(["check-config", bad.to_str().expect("utf8")])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("pools[0] (sonnet4-us).max_concurrency: must be greater than zero"),
        "{stderr}"
    );
}

/// With `server.admin_listen`, a second listener serves the admin endpoints and nothing else (a
/// sidecar keeps the proxy on loopback and lets the kubelet and Prometheus reach only these); it
/// answers "not ready" while the proxy drains and closes after it.
#[tokio::test]
async fn the_admin_listener_serves_admin_endpoints_only() {
    let sim = start_simulator(FAST_SIM).await;
    let mut config = proxy_config(sim.addr, &sonnet_pool(200_000, 8), "");
    config.process.server.admin_listen = Some("127.0.0.1:0".parse().expect("addr"));
    let stack = Stack {
        sim,
        proxy: start_proxy(config).await,
    };
    let admin = stack.proxy.admin_addr.expect("admin listener");
    assert_ne!(admin, stack.proxy.addr);
    for path in ["/healthz", "/readyz", "/metrics", "/v1/pools"] {
        let r = raw_request(admin, "GET", path, "", false).await;
        assert_eq!(r.status, 200, "{path}");
    }
    let model_call = raw_request(
        admin,
        "POST",
        &model_path(SONNET_US, "converse"),
        converse_body("hi", Some(10)),
        false,
    )
    .await;
    assert_eq!(model_call.status, 404, "the admin listener never proxies");
    let proxied = raw_request(
        stack.proxy.addr,
        "POST",
        &model_path(SONNET_US, "converse"),
        converse_body("hi", Some(10)),
        false,
    )
    .await;
    assert_eq!(proxied.status, 200);
    stack.assert_ledger_zero().await;
    stack.proxy.shutdown().await.expect("shutdown");
    assert!(tokio::net::TcpStream::connect(admin).await.is_err());
}

/// `tokengate healthcheck` (the image's HEALTHCHECK) exits 0 while `/readyz` answers 200, and 1
/// once nothing listens.
#[tokio::test]
async fn the_healthcheck_command_probes_readiness() {
    let stack = Stack::start(FAST_SIM, &sonnet_pool(200_000, 8), "").await;
    let url = format!("http://{}/readyz", stack.proxy.addr);
    let probe = |url: String| {
        tokio::task::spawn_blocking(move || {
            Command::new(env!("CARGO_BIN_EXE_tokengate"))
                .args(["healthcheck", "--url", &url, "--timeout-secs", "5"])
                .output()
                .expect("runs")
        })
    };
    let ok = probe(url.clone()).await.expect("join");
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&ok.stdout).trim(),
        format!("{url}: 200")
    );

    stack.proxy.shutdown().await.expect("shutdown");
    let down = probe(url).await.expect("join");
    assert_eq!(down.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&down.stderr).contains("cannot connect"),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
}

#[derive(Debug)]
struct NoCredentials;

impl aws_credential_types::provider::ProvideCredentials for NoCredentials {
    fn provide_credentials<'a>(
        &'a self,
    ) -> aws_credential_types::provider::future::ProvideCredentials<'a>
    where
        Self: 'a,
    {
        aws_credential_types::provider::future::ProvideCredentials::ready(Err(
            aws_credential_types::provider::error::CredentialsError::not_loaded(
                "no credentials in the environment",
            ),
        ))
    }
}

#[tokio::test]
async fn a_real_endpoint_without_credentials_refuses_to_start() {
    let config = tokengate::config::Config::parse(
        "[server]\nlisten = \"127.0.0.1:0\"\n\n[upstream]\nregion = \"us-east-1\"\n",
    )
    .expect("config");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let options = tokengate::gateway::GatewayOptions {
        credentials: Some(
            aws_credential_types::provider::SharedCredentialsProvider::new(NoCredentials),
        ),
        ..Default::default()
    };
    let err = tokengate::gateway::Gateway::start(config, listener, options)
        .await
        .expect_err("must refuse");
    assert!(
        matches!(err, tokengate::gateway::StartError::Credentials(_)),
        "{err}"
    );
    assert!(
        err.to_string().contains("no AWS credentials") && err.to_string().contains("default chain"),
        "{err}"
    );
}
