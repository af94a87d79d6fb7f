//! Shared test harness: a simulator and a proxy on `127.0.0.1:0`, real SDK clients, and the
//! ledger-returns-to-zero check every test ends with.

pub mod apis;
pub mod endpoints;
pub mod fleet;
pub mod h2raw;
pub mod load;
pub mod log_capture;
pub mod prometheus;
pub mod redis_cluster;
pub mod redis_server;
pub mod scrape;
pub mod signing;
pub mod sonic;
pub mod sonic_raw;
pub mod tap;
pub mod wire;

use std::{net::SocketAddr, time::Duration};

use aws_credential_types::{Credentials, provider::SharedCredentialsProvider};
use aws_sdk_bedrockruntime::{
    Client,
    config::{BehaviorVersion, Region, retry::RetryConfig},
    types::{ContentBlock, ConversationRole, InferenceConfiguration, Message},
};
use tokengate::{
    config::Config,
    gateway::{Gateway, GatewayOptions},
    simulator::{self, SimulatorConfig, SimulatorHandle},
};
use tokio::net::TcpListener;

pub const SONNET_US: &str = "us.anthropic.claude-sonnet-4-20250514-v1:0";
pub const SONNET_GLOBAL: &str = "global.anthropic.claude-sonnet-4-20250514-v1:0";
pub const SONNET_US_ARN: &str = "arn:aws:bedrock:us-east-1:123456789012:inference-profile/us.anthropic.claude-sonnet-4-20250514-v1:0";
pub const HAIKU: &str = "anthropic.claude-3-haiku-20240307-v1:0";
/// Claude 3 Haiku on demand in us-west-2, named by its ARN there (a spill target).
pub const HAIKU_WEST: &str =
    "arn:aws:bedrock:us-west-2::foundation-model/anthropic.claude-3-haiku-20240307-v1:0";

/// Two pools of one permit each, queueing nothing: `haiku` (on demand in the upstream Region)
/// spilling to `haiku-west` ([`HAIKU_WEST`]). Spilling needs a route that allows it (`spill =
/// true`).
pub fn haiku_spilling_west() -> String {
    format!(
        "[[pools]]\nname = \"haiku\"\nmodels = [\"{HAIKU}\"]\ntokens_per_minute = 100000\n\
         max_concurrency = 1\noutput_burndown = 1\ndefault_max_tokens = 100\nmax_wait_ms = 0\n\
         spill_to = [\"haiku-west\"]\n\n[[pools]]\nname = \"haiku-west\"\nmodels = [\"{HAIKU_WEST}\"]\n\
         region = \"us-west-2\"\ntokens_per_minute = 100000\nmax_concurrency = 1\noutput_burndown = 1\n\
         default_max_tokens = 100\nmax_wait_ms = 0\n"
    )
}

/// The proxy's own credentials (what the simulator should see).
pub const PROXY_KEY_ID: &str = "AKIATOKENGATEPROXY01";
pub const PROXY_SECRET: &str = "proxy-secret-key";
/// The application's credentials (what the proxy receives and must not forward).
pub const CLIENT_KEY_ID: &str = "AKIAAPPLICATION00001";

pub fn proxy_credentials() -> SharedCredentialsProvider {
    SharedCredentialsProvider::new(Credentials::new(
        PROXY_KEY_ID,
        PROXY_SECRET,
        None,
        None,
        "tests",
    ))
}

/// A simulator on an ephemeral port; `extra` is TOML for the `[simulator]` table.
pub async fn start_simulator(extra: &str) -> SimulatorHandle {
    let config: SimulatorConfig = toml::from_str(extra).expect("simulator config");
    simulator::spawn(config, SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .expect("simulator starts")
}

/// A proxy config in front of `upstream`, with `pools` as TOML `[[pools]]` tables and any
/// further top-level tables in `extra`.
pub fn proxy_config(upstream: SocketAddr, pools: &str, extra: &str) -> Config {
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n\n[upstream]\nregion = \"us-east-1\"\nendpoint = \"http://{upstream}\"\n\n{extra}\n\n{pools}\n"
    );
    Config::parse(&text).unwrap_or_else(|e| panic!("test config: {e}\n{text}"))
}

/// The pool most tests use: Claude Sonnet 4 through the `us.` profile.
pub fn sonnet_pool(tokens_per_minute: u64, max_concurrency: u32) -> String {
    format!(
        "[[pools]]\nname = \"sonnet4-us\"\nmodels = [\"{SONNET_US}\"]\ntokens_per_minute = {tokens_per_minute}\n\
         max_concurrency = {max_concurrency}\noutput_burndown = 5\ndefault_max_tokens = 1000\n"
    )
}

pub async fn start_proxy(config: Config) -> Gateway {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let options = GatewayOptions {
        credentials: Some(proxy_credentials()),
        ..Default::default()
    };
    Gateway::start(config, listener, options)
        .await
        .expect("proxy starts")
}

/// A simulator plus a proxy in front of it.
pub struct Stack {
    pub sim: SimulatorHandle,
    pub proxy: Gateway,
}

impl Stack {
    pub async fn start(sim_toml: &str, pools: &str, extra: &str) -> Stack {
        let sim = start_simulator(sim_toml).await;
        let proxy = start_proxy(proxy_config(sim.addr, pools, extra)).await;
        Stack { sim, proxy }
    }

    pub fn client(&self) -> Client {
        sdk_client(self.proxy.addr, 1)
    }

    pub fn direct_client(&self) -> Client {
        sdk_client(self.sim.addr, 1)
    }

    /// Asserts every reservation and permit came back, and none was dropped unsettled.
    pub async fn assert_ledger_zero(&self) {
        assert_ledger_zero(&self.proxy).await;
    }
}

/// An SDK client for `addr` with the application's credentials and `attempts` attempts.
pub fn sdk_client(addr: SocketAddr, attempts: u32) -> Client {
    let retry = if attempts <= 1 {
        RetryConfig::disabled()
    } else {
        RetryConfig::standard().with_max_attempts(attempts)
    };
    let config = aws_sdk_bedrockruntime::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .endpoint_url(format!("http://{addr}"))
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new(
            CLIENT_KEY_ID,
            "application-secret",
            None,
            None,
            "tests",
        ))
        .retry_config(retry)
        .build();
    Client::from_conf(config)
}

/// An SDK client for `addr` that sends `Authorization: Bearer <token>` (no AWS credentials), as
/// `AWS_BEARER_TOKEN_BEDROCK` configures it.
pub fn bearer_client(addr: SocketAddr, token: &str) -> Client {
    let config = aws_sdk_bedrockruntime::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .endpoint_url(format!("http://{addr}"))
        .region(Region::new("us-east-1"))
        .bearer_token(aws_sdk_bedrockruntime::config::Token::new(token, None))
        .retry_config(RetryConfig::disabled())
        .build();
    Client::from_conf(config)
}

/// An SDK client for `addr` signing with the key pair `key_id` / `secret`.
pub fn keyed_client(addr: SocketAddr, key_id: &str, secret: &str) -> Client {
    let config = aws_sdk_bedrockruntime::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .endpoint_url(format!("http://{addr}"))
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new(key_id, secret, None, None, "tests"))
        .retry_config(RetryConfig::disabled())
        .build();
    Client::from_conf(config)
}

/// The proxy's `/metrics`, parsed.
pub async fn scrape(addr: SocketAddr) -> scrape::Scrape {
    let response = raw_request(addr, "GET", "/metrics", "", false).await;
    scrape::Scrape::parse(std::str::from_utf8(&response.body).expect("utf-8"))
}

/// Hex SHA-256 of a bearer key, as `bearer_token_sha256` holds it.
pub fn sha256_hex(key: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(key.as_bytes()))
}

pub fn user_message(text: &str) -> Message {
    Message::builder()
        .role(ConversationRole::User)
        .content(ContentBlock::Text(text.to_string()))
        .build()
        .expect("message")
}

pub fn max_tokens(n: i32) -> InferenceConfiguration {
    InferenceConfiguration::builder().max_tokens(n).build()
}

/// Waits (bounded) until the proxy's ledger holds nothing, then asserts it. Settlement after a
/// client hang-up happens when the server notices, so this polls a condition; it never sleeps a
/// fixed time.
pub async fn assert_ledger_zero(proxy: &Gateway) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let states = proxy.admission().pool_views().await;
        let busy: Vec<_> = states
            .iter()
            .filter_map(|p| {
                p.ledger
                    .as_ref()
                    .map(|l| (p.name.clone(), l.reserved_tokens, l.in_flight_requests))
            })
            .filter(|(_, reserved, in_flight)| *reserved != 0 || *in_flight != 0)
            .collect();
        if busy.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "ledger did not return to zero: {busy:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        proxy.admission().ledger().stats().unsettled_drops(),
        0,
        "a reservation was dropped unsettled"
    );
}

/// Polls `condition` every 10 ms for up to `within` (a bound against hangs, not a timing
/// assertion).
pub async fn eventually(within: Duration, what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + within;
    while !condition() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// [`assert_ledger_zero`], and no request body held in memory: the body budget back at zero.
pub async fn assert_nothing_held(proxy: &Gateway) {
    assert_ledger_zero(proxy).await;
    let budget = &proxy.state.body_budget;
    eventually(
        Duration::from_secs(10),
        "the body budget to return to zero",
        || budget.held() == 0,
    )
    .await;
    assert_eq!(proxy.state.metrics.buffered_body_bytes.get(), 0);
}

/// A simulator for bidirectional sessions: instant answers, and the proxy's own SigV4 verified on
/// every head and every event.
pub const SONIC_SIM: &str = "time_to_first_token_ms = 0\ntokens_per_second = 0\n\
    verify_sigv4 = { access_key_id = \"AKIATOKENGATEPROXY01\", secret_access_key = \"proxy-secret-key\" }\n";

/// The simulator's bucket of Nova Sonic in us-east-1 (empty before its first call).
pub fn sonic_bucket(sim: &SimulatorHandle) -> simulator::BucketStats {
    sim.simulator
        .stats()
        .buckets
        .get(&format!("{}@us-east-1", sonic::SONIC))
        .cloned()
        .unwrap_or_default()
}

/// Waits until upstream holds no session either (the proxy reset the ones it cut).
pub async fn sonic_upstream_idle(sim: &SimulatorHandle) {
    eventually(Duration::from_secs(10), "upstream's session ended", || {
        sonic_bucket(sim).in_flight == 0
    })
    .await;
}

/// A plain HTTP response, for tests that speak raw HTTP.
#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: bytes::Bytes,
}

impl RawResponse {
    pub fn error_type(&self) -> &str {
        self.headers
            .get("x-amzn-errortype")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    pub fn message(&self) -> String {
        let v: serde_json::Value = serde_json::from_slice(&self.body).unwrap_or_default();
        v["message"].as_str().unwrap_or_default().to_string()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// Sends one unsigned request over HTTP/1.1 (or HTTP/2 prior knowledge with `h2`).
pub async fn raw_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: impl Into<bytes::Bytes>,
    h2: bool,
) -> RawResponse {
    raw_request_with(addr, method, path, body, h2, &[]).await
}

/// [`raw_request`] with extra request headers.
pub async fn raw_request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: impl Into<bytes::Bytes>,
    h2: bool,
    headers: &[(&str, &str)],
) -> RawResponse {
    use http_body_util::{BodyExt, Full};
    use hyper_util::{client::legacy::Client, rt::TokioExecutor};
    let client = Client::builder(TokioExecutor::new())
        .http2_only(h2)
        .build_http::<Full<bytes::Bytes>>();
    let mut request = http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(Full::new(body.into())).expect("request");
    let response = client.request(request).await.expect("response");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("body").to_bytes();
    RawResponse {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body,
    }
}

/// A Converse request body as JSON.
pub fn converse_body(text: &str, max_tokens: Option<u64>) -> String {
    let mut body = serde_json::json!({"messages": [{"role": "user", "content": [{"text": text}]}]});
    if let Some(n) = max_tokens {
        body["inferenceConfig"] = serde_json::json!({"maxTokens": n});
    }
    body.to_string()
}

/// A Converse call over a raw socket (HTTP/1.1), `max` as `inferenceConfig.maxTokens`.
pub async fn converse(
    addr: std::net::SocketAddr,
    model: &str,
    text: &str,
    max: Option<u64>,
) -> RawResponse {
    raw_request(
        addr,
        "POST",
        &model_path(model, "converse"),
        converse_body(text, max),
        false,
    )
    .await
}

/// `/model/{id}/{op}` with the id percent-encoded as SDKs do.
pub fn model_path(model_id: &str, op: &str) -> String {
    let encoded: String =
        percent_encoding::utf8_percent_encode(model_id, percent_encoding::NON_ALPHANUMERIC)
            .to_string()
            .replace("%2E", ".")
            .replace("%2D", "-")
            .replace("%5F", "_");
    format!("/model/{encoded}/{op}")
}

/// Requests `pool` has admitted on `proxy` and not settled yet.
pub fn in_flight(proxy: &Gateway, pool: &str) -> u64 {
    proxy
        .admission()
        .pools()
        .iter()
        .find(|p| &*p.name == pool)
        .map_or(0, |p| p.load.in_flight())
}

/// The value of one series of `proxy`'s metrics as `/metrics` exposes it now (the registry's text
/// exposition, parsed; the gauges `/metrics` refreshes from live state when scraped are read with
/// [`scrape`] over HTTP instead). For the polls of a sync closure.
pub fn metric(proxy: &Gateway, name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape::Scrape::parse(&tokengate::metrics::render(&proxy.state.registry)).get(name, labels)
}

/// How many of `pool`'s reservations settled by `rule`, as `/metrics` exposes it now.
pub fn settlements(proxy: &Gateway, pool: &str, rule: &str) -> u64 {
    metric(
        proxy,
        "tokengate_settlements_total",
        &[("pool", pool), ("rule", rule)],
    ) as u64
}
