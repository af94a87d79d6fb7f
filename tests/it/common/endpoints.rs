//! SageMaker endpoints in tests: a simulator running fleets, a proxy whose `[[endpoints]]` point
//! at it, and `aws-sdk-sagemakerruntime` clients.

use std::{net::SocketAddr, time::Duration};

use aws_credential_types::Credentials;
use aws_sdk_sagemakerruntime::{
    Client,
    config::{BehaviorVersion, Region, retry::RetryConfig},
    primitives::Blob,
    types::ResponseStream,
};
use tokengate::simulator::sagemaker::FleetStats;

use super::{CLIENT_KEY_ID, PROXY_KEY_ID, PROXY_SECRET, Stack, raw_request};

/// The simulator table that makes it check the proxy signs for `sagemaker` with its own key,
/// followed by `fleets` (`[[endpoints]]` tables of the simulator).
pub fn sim_toml(fleets: &str) -> String {
    format!(
        "verify_sigv4 = {{ access_key_id = \"{PROXY_KEY_ID}\", secret_access_key = \"{PROXY_SECRET}\" }}\n{fleets}"
    )
}

/// A `[[endpoints]]` fleet of the simulator.
pub fn fleet(name: &str, component: Option<&str>, copies: u32, cap: u32, extra: &str) -> String {
    let component = component.map_or(String::new(), |c| {
        format!("inference_component = \"{c}\"\n")
    });
    format!(
        "[[endpoints]]\nname = \"{name}\"\n{component}copies = {copies}\nmax_concurrency_per_copy = {cap}\n{extra}\n"
    )
}

/// A proxy `[[endpoints]]` entry, sending to (and describing at) the simulator at `sim`.
pub fn endpoint_pool(
    pool: &str,
    endpoint: &str,
    component: Option<&str>,
    copies: u32,
    cap: u32,
    sim: SocketAddr,
    extra: &str,
) -> String {
    let component = component.map_or(String::new(), |c| {
        format!("inference_component = \"{c}\"\n")
    });
    format!(
        "[[endpoints]]\nname = \"{pool}\"\nendpoint = \"{endpoint}\"\n{component}copies = {copies}\n\
         max_concurrency_per_copy = {cap}\nruntime_url = \"http://{sim}\"\ncontrol_url = \"http://{sim}\"\n{extra}\n"
    )
}

/// A simulator running `fleets`, and a proxy in front with `endpoints(sim_addr)` as its
/// `[[endpoints]]` and `extra` as further tables.
pub async fn start(fleets: &str, endpoints: impl Fn(SocketAddr) -> String, extra: &str) -> Stack {
    let sim = super::start_simulator(&sim_toml(fleets)).await;
    let config = super::proxy_config(sim.addr, &endpoints(sim.addr), extra);
    let proxy = super::start_proxy(config).await;
    Stack { sim, proxy }
}

/// A sagemaker-runtime client for `addr` with the application's credentials; `attempts` > 1
/// retries in the SDK's standard mode.
pub fn client(addr: SocketAddr, attempts: u32) -> Client {
    keyed_client(addr, attempts, CLIENT_KEY_ID, "application-secret")
}

/// A client straight at the simulator, signing with the key it accepts (the proxy's).
pub fn direct_client(sim: SocketAddr, attempts: u32) -> Client {
    keyed_client(sim, attempts, PROXY_KEY_ID, PROXY_SECRET)
}

fn keyed_client(addr: SocketAddr, attempts: u32, key_id: &str, secret: &str) -> Client {
    let retry = if attempts <= 1 {
        RetryConfig::disabled()
    } else {
        RetryConfig::standard().with_max_attempts(attempts)
    };
    let config = aws_sdk_sagemakerruntime::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .endpoint_url(format!("http://{addr}"))
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new(key_id, secret, None, None, "tests"))
        .retry_config(retry)
        .build();
    Client::from_conf(config)
}

/// An OpenAI-style chat body asking for `max_tokens`, generating `output` tokens.
pub fn chat(output: u64, max_tokens: u64) -> Blob {
    Blob::new(
        serde_json::json!({
            "messages": [{"role": "user", "content": format!("[sim:output={output}] summarise this")}],
            "max_tokens": max_tokens,
            "stream": false,
        })
        .to_string(),
    )
}

/// A TGI-style body generating `output` tokens of at most `max_new_tokens`.
pub fn tgi(output: u64, max_new_tokens: u64) -> Blob {
    Blob::new(
        serde_json::json!({
            "inputs": format!("[sim:output={output}] look this up"),
            "parameters": {"max_new_tokens": max_new_tokens, "details": true},
        })
        .to_string(),
    )
}

/// The bytes of every `PayloadPart` of a stream, joined, and whether it ended in an error.
pub async fn read_stream(
    mut stream: aws_sdk_sagemakerruntime::primitives::event_stream::EventReceiver<
        ResponseStream,
        aws_sdk_sagemakerruntime::types::error::ResponseStreamError,
    >,
) -> (String, Option<String>) {
    let mut text = String::new();
    loop {
        match stream.recv().await {
            Ok(Some(ResponseStream::PayloadPart(part))) => {
                let bytes = part
                    .bytes()
                    .map(|b| b.as_ref().to_vec())
                    .unwrap_or_default();
                text.push_str(&String::from_utf8_lossy(&bytes));
            }
            Ok(Some(other)) => return (text, Some(format!("{other:?}"))),
            Ok(None) => return (text, None),
            Err(e) => return (text, Some(format!("{e:?}"))),
        }
    }
}

/// The simulator's figures of `endpoint`.
pub async fn fleet_stats(sim: SocketAddr, endpoint: &str) -> FleetStats {
    let response = raw_request(sim, "GET", "/_sim/sagemaker", "", false).await;
    let v: serde_json::Value = serde_json::from_slice(&response.body).expect("json");
    let found = v["endpoints"]
        .as_array()
        .expect("endpoints")
        .iter()
        .find(|e| e["endpoint"] == endpoint)
        .cloned()
        .expect("the fleet");
    serde_json::from_value(found).expect("fleet stats")
}

/// Asks the simulator for `copies` of `endpoint` (and `component`).
pub async fn scale(sim: SocketAddr, endpoint: &str, component: Option<&str>, copies: u32) {
    let body = serde_json::json!({"endpoint": endpoint, "inference_component": component, "copies": copies});
    let response = raw_request(sim, "POST", "/_sim/sagemaker", body.to_string(), false).await;
    assert_eq!(response.status, 200, "{:?}", response.body);
}

/// Polls `condition` every 10 ms for up to `limit`; panics with `what` if it never holds.
pub async fn until(limit: Duration, what: &str, mut condition: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    while !condition().await {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
