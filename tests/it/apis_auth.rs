//! Credentials and route rules on the OpenAI and Anthropic APIs: the keys their SDKs send
//! (`Authorization: Bearer`, `x-api-key`) and SigV4 map to routes in every mode and never leave
//! the proxy; a route's `max_tokens_ceiling` is written into each API's own field; with
//! `upstream.api_key_env` the proxy's own upstream credential is a Bedrock API key.

use crate::common::{apis::*, *};
use serde_json::{Value, json};
use tokengate::config::Config;

fn pools() -> String {
    format!(
        "{}\n{}",
        gpt_pool(1_000_000, ""),
        sonnet_pool(1_000_000, 16)
    )
}

/// A simulator, a tap in front of it, and a proxy in front of the tap with `extra` tables.
async fn tapped(
    extra: &str,
) -> (
    tokengate::simulator::SimulatorHandle,
    tap::Tap,
    tokengate::gateway::Gateway,
) {
    let sim = start_simulator(FAST_SIM).await;
    let tap = tap::Tap::start(sim.addr, &[]).await;
    let proxy = start_proxy(proxy_config(tap.addr, &pools(), extra)).await;
    (sim, tap, proxy)
}

fn chat_body() -> String {
    json!({"model": GPT, "messages": [{"role": "user", "content": "hi [sim:output=3]"}]})
        .to_string()
}

fn messages_body() -> String {
    json!({"model": SONNET_US, "max_tokens": 20, "messages": [{"role": "user", "content": "hi [sim:output=3]"}]})
        .to_string()
}

async fn call(
    addr: std::net::SocketAddr,
    path: &str,
    body: String,
    headers: &[(&str, &str)],
) -> RawResponse {
    raw_request_with(addr, "POST", path, body, false, headers).await
}

/// Signed headers but `content-type`, which `raw_request_with` sends itself.
fn without_content_type(headers: &[(String, String)]) -> Vec<(&str, &str)> {
    headers
        .iter()
        .filter(|(k, _)| k != "content-type")
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

/// The route's key `k-app` identifies it on both APIs: as the OpenAI SDK sends it
/// (`Authorization: Bearer`) and as the Anthropic SDK does (`x-api-key`, with its version).
async fn the_key_identifies_the_route(addr: std::net::SocketAddr) {
    let openai = [("authorization", "Bearer k-app")];
    let r = call(addr, CHAT, chat_body(), &openai).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let anthropic = [("x-api-key", "k-app"), ("anthropic-version", "2023-06-01")];
    let r = call(addr, MESSAGES, messages_body(), &anthropic).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
}

/// What the proxy sent upstream carries only the proxy's credential.
fn assert_only_the_proxys_credential(seen: &[tap::Seen]) {
    assert!(!seen.is_empty());
    for request in seen {
        let h = &request.headers;
        assert!(h.get("x-api-key").is_none(), "{h:?}");
        let authorization = h["authorization"].to_str().expect("an ASCII authorization");
        assert!(
            authorization.starts_with(&format!("AWS4-HMAC-SHA256 Credential={PROXY_KEY_ID}/")),
            "{authorization}"
        );
    }
}

#[tokio::test]
async fn in_bearer_mode_the_key_comes_as_authorization_or_x_api_key_and_stays_here() {
    let extra = format!(
        "[auth]\nmode = \"bearer\"\nallow_plaintext_bearer = true\n\n\
         [[routes]]\nname = \"app\"\nbearer_token_sha256 = \"{}\"\n",
        sha256_hex("k-app")
    );
    let (_sim, tap, proxy) = tapped(&extra).await;
    let addr = proxy.addr;
    the_key_identifies_the_route(addr).await;
    // The same key in both headers is one key; two different keys are refused.
    let both = [("authorization", "Bearer k-app"), ("x-api-key", "k-app")];
    assert_eq!(
        call(addr, MESSAGES, messages_body(), &both).await.status,
        200
    );
    let two = [("authorization", "Bearer k-app"), ("x-api-key", "k-other")];
    let r = call(addr, MESSAGES, messages_body(), &two).await;
    assert_eq!(r.status, 403);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["error"]["type"], "permission_error", "{v}");
    let r = call(
        addr,
        CHAT,
        chat_body(),
        &[("authorization", "Bearer wrong")],
    )
    .await;
    assert_eq!(r.status, 403);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["error"]["code"], "invalid_api_key", "{v}");
    // The native operations take the key in x-api-key too.
    let converse = converse_body("hi", Some(20));
    let r = call(
        addr,
        &model_path(SONNET_US, "converse"),
        converse,
        &[("x-api-key", "k-app")],
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let seen = tap.seen();
    assert_eq!(seen.len(), 4, "refused callers reach nothing");
    assert_only_the_proxys_credential(&seen);
    // The Anthropic API's own headers go upstream; the OpenAI SDK's do not.
    assert_eq!(seen[1].headers["anthropic-version"], "2023-06-01");
    assert_ledger_zero(&proxy).await;
}

#[tokio::test]
async fn in_sigv4_mode_these_apis_take_a_routes_signature_or_its_bearer_key() {
    let extra = format!(
        "[auth]\nmode = \"sigv4\"\n\n[[routes]]\nname = \"app\"\naccess_key_id = \"AKIAAPPROUTE00000001\"\n\
         secret_access_key = \"app-secret\"\nbearer_token_sha256 = \"{}\"\n",
        sha256_hex("k-app")
    );
    let (_sim, tap, proxy) = tapped(&extra).await;
    let addr = proxy.addr;
    the_key_identifies_the_route(addr).await;
    let body = chat_body();
    let signing = signing::Signing::new("AKIAAPPROUTE00000001", "app-secret");
    let signed = signing::signed_headers(signing, &addr.to_string(), CHAT, body.as_bytes(), &[]);
    let signed = without_content_type(&signed);
    let r = call(addr, CHAT, body.clone(), &signed).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    // A signature that does not verify is refused, key or no key.
    let bad = signing::Signing::new("AKIAAPPROUTE00000001", "wrong");
    let signed = signing::signed_headers(bad, &addr.to_string(), CHAT, body.as_bytes(), &[]);
    let signed = without_content_type(&signed);
    assert_eq!(call(addr, CHAT, body, &signed).await.status, 403);
    assert_eq!(
        call(addr, CHAT, chat_body(), &[("authorization", "Bearer nope")])
            .await
            .status,
        403
    );
    // The native operations take signatures only.
    let converse = converse_body("hi", Some(20));
    let r = call(
        addr,
        &model_path(SONNET_US, "converse"),
        converse,
        &[("authorization", "Bearer k-app")],
    )
    .await;
    assert_eq!((r.status, r.error_type()), (403, "AccessDeniedException"));
    let seen = tap.seen();
    assert_eq!(seen.len(), 3);
    assert_only_the_proxys_credential(&seen);
    assert_ledger_zero(&proxy).await;
}

#[tokio::test]
async fn a_routes_ceiling_is_written_into_each_apis_own_field() {
    let extra = "[auth]\nmode = \"none\"\ndefault_route = \"app\"\n\n\
        [[routes]]\nname = \"app\"\nmax_tokens_ceiling = 50\n";
    let (_sim, tap, proxy) = tapped(extra).await;
    let addr = proxy.addr;
    let m = json!([{"role": "user", "content": "x"}]);
    let cases = [
        (
            CHAT,
            json!({"model": GPT, "messages": m, "max_tokens": 5000}),
            json!({"max_tokens": 50}),
        ),
        (
            CHAT,
            json!({"model": GPT, "messages": m}),
            json!({"max_completion_tokens": 50}),
        ),
        (
            CHAT,
            json!({"model": GPT, "messages": m, "max_tokens": 10, "max_completion_tokens": 900}),
            json!({"max_tokens": 10, "max_completion_tokens": 50}),
        ),
        (
            RESPONSES,
            json!({"model": GPT, "input": "x", "max_output_tokens": 800}),
            json!({"max_output_tokens": 50}),
        ),
        (
            MESSAGES,
            json!({"model": SONNET_US, "messages": m, "max_tokens": 4096}),
            json!({"max_tokens": 50}),
        ),
    ];
    // The SDKs' keys come along, and stay here.
    let keys = [
        ("authorization", "Bearer sk-caller"),
        ("x-api-key", "sk-caller"),
    ];
    for (i, (path, body, written)) in cases.iter().enumerate() {
        let r = call(addr, path, body.to_string(), &keys).await;
        assert_eq!(r.status, 200, "{path} {body}: {:?}", r.body);
        let forwarded: Value = serde_json::from_slice(&tap.seen()[i].body).unwrap();
        for (field, value) in written.as_object().unwrap() {
            assert_eq!(&forwarded[field], value, "{path} {body} -> {forwarded}");
        }
        for field in ["max_tokens", "max_completion_tokens", "max_output_tokens"] {
            if written.get(field).is_none() {
                assert_eq!(forwarded.get(field), body.get(field), "{field} untouched");
            }
        }
    }
    assert_only_the_proxys_credential(&tap.seen());
    let clamped = proxy
        .state
        .metrics
        .max_tokens_clamped
        .with_label_values(&["gpt", "app"])
        .get();
    assert_eq!(clamped, 4);
    assert_ledger_zero(&proxy).await;
}

#[tokio::test]
async fn a_reject_ceiling_names_the_apis_field() {
    let extra = "[auth]\nmode = \"none\"\ndefault_route = \"app\"\n\n\
        [[routes]]\nname = \"app\"\nmax_tokens_ceiling = 50\nmax_tokens_policy = \"reject\"\n";
    let stack = Stack::start(FAST_SIM, &pools(), extra).await;
    let body = json!({"model": GPT, "input": "x", "max_output_tokens": 800}).to_string();
    let r = call(stack.proxy.addr, RESPONSES, body, &[]).await;
    assert_eq!(r.status, 400);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(
        v["error"]["message"],
        "max_output_tokens 800 is above the ceiling of 50 that tokengate route \"app\" allows; set max_output_tokens to at most 50"
    );
    stack.assert_ledger_zero().await;
}

fn keyed_proxy_config(upstream: std::net::SocketAddr, key: Option<&str>) -> Result<Config, String> {
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n\n[upstream]\nregion = \"us-east-1\"\nendpoint = \"http://{upstream}\"\n\
         api_key_env = \"TG_UPSTREAM_KEY\"\n\n{}\n[[pools]]\nname = \"sonic\"\nmodels = [\"amazon.nova-sonic-v1:0\"]\n\
         tokens_per_minute = 100000\nmax_concurrency = 4\noutput_burndown = 1\ndefault_max_tokens = 1000\n",
        pools()
    );
    let key = key.map(str::to_string);
    Config::parse_with_env(&text, &move |name| {
        (name == "TG_UPSTREAM_KEY").then(|| key.clone()).flatten()
    })
    .map_err(|e| e.to_string())
}

#[tokio::test]
async fn an_upstream_api_key_goes_as_bearer_on_every_operation_that_takes_one() {
    let sim = start_simulator(&format!("{FAST_SIM}api_keys = [\"up-key\"]\n")).await;
    let tap = tap::Tap::start(sim.addr, &[]).await;
    let config = keyed_proxy_config(tap.addr, Some("up-key")).expect("config");
    let notes = config.notes();
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(
        notes[0].starts_with("upstream.api_key_env (TG_UPSTREAM_KEY): pool \"sonic\" lists \"amazon.nova-sonic-v1:0\", whose InvokeModelWithBidirectionalStream accepts only SigV4"),
        "{}",
        notes[0]
    );
    let proxy = start_proxy(config).await;
    let client = sdk_client(proxy.addr, 1);
    let out = client
        .converse()
        .model_id(SONNET_US)
        .messages(user_message("hi [sim:output=3]"))
        .inference_config(max_tokens(20))
        .send()
        .await
        .expect("converse with the proxy's API key");
    assert_eq!(out.usage().unwrap().output_tokens(), 3);
    assert_eq!(call(proxy.addr, CHAT, chat_body(), &[]).await.status, 200);
    let mut stream: Value = serde_json::from_str(&messages_body()).unwrap();
    stream["stream"] = json!(true);
    assert_eq!(
        call(proxy.addr, MESSAGES, stream.to_string(), &[])
            .await
            .status,
        200
    );
    for request in tap.seen() {
        let h = &request.headers;
        assert_eq!(h["authorization"], "Bearer up-key", "{h:?}");
        assert!(h.get("x-amz-date").is_none(), "not signed");
    }
    let stats = sim.simulator.stats();
    assert_eq!((stats.api_keys.accepted, stats.api_keys.rejected), (3, 0));
    assert_ledger_zero(&proxy).await;

    let missing = keyed_proxy_config(tap.addr, None).expect_err("an unset variable");
    assert!(
        missing.starts_with(
            "upstream.api_key_env: the environment variable TG_UPSTREAM_KEY is not set"
        ),
        "{missing}"
    );
}

/// A short-term Bedrock API key is valid in one Region: `upstream.api_key_env_by_region` gives a
/// Region its own key, which its pools' calls carry in place of `api_key_env`'s; `check-config`
/// says which Regions would get the default key.
#[tokio::test]
async fn each_region_s_calls_carry_that_region_s_api_key() {
    let sim = start_simulator(&format!(
        "{FAST_SIM}api_keys = [\"east-key\", \"west-key\"]\n"
    ))
    .await;
    let tap = tap::Tap::start(sim.addr, &[]).await;
    let config = |by_region: &str| {
        let text = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n\n[upstream]\nregion = \"us-east-1\"\n\
             endpoint = \"http://{}\"\napi_key_env = \"TG_EAST_KEY\"\n{by_region}\n{}\n\
             [[pools]]\nname = \"haiku-west\"\nmodels = [\"{HAIKU}\"]\nregion = \"us-west-2\"\n\
             tokens_per_minute = 100000\nmax_concurrency = 4\noutput_burndown = 1\ndefault_max_tokens = 100\n",
            tap.addr,
            sonnet_pool(100_000, 4)
        );
        Config::parse_with_env(&text, &|name| match name {
            "TG_EAST_KEY" => Some("east-key".into()),
            "TG_WEST_KEY" => Some("west-key".into()),
            _ => None,
        })
        .map_err(|e| e.to_string())
    };
    let one_key = config("").expect("config");
    assert_eq!(
        one_key.notes(),
        [
            "upstream.api_key_env (TG_EAST_KEY): pools in us-west-2 send this key too; a short-term \
          Bedrock API key is valid only in the Region it was made for, so if it is one, name a key \
          for us-west-2 in upstream.api_key_env_by_region"
        ]
    );
    let by_region = "api_key_env_by_region = { \"us-west-2\" = \"TG_WEST_KEY\" }";
    let config = config(by_region).expect("config");
    assert_eq!(config.notes(), Vec::<String>::new());
    let proxy = start_proxy(config).await;
    let client = sdk_client(proxy.addr, 1);
    // Sonnet's pool is in us-east-1, Haiku's in us-west-2.
    for model in [SONNET_US, HAIKU, SONNET_US] {
        client
            .converse()
            .model_id(model)
            .messages(user_message("hi [sim:output=3]"))
            .inference_config(max_tokens(20))
            .send()
            .await
            .unwrap_or_else(|e| panic!("{model}: {e:?}"));
    }
    let sent: Vec<(bool, String)> = tap
        .seen()
        .iter()
        .map(|r| {
            let west = r.path.contains("claude-3-haiku");
            (
                west,
                r.headers["authorization"]
                    .to_str()
                    .expect("text")
                    .to_string(),
            )
        })
        .collect();
    assert_eq!(
        sent,
        [
            (false, "Bearer east-key".to_string()),
            (true, "Bearer west-key".to_string()),
            (false, "Bearer east-key".to_string()),
        ]
    );
    let stats = sim.simulator.stats();
    assert_eq!((stats.api_keys.accepted, stats.api_keys.rejected), (3, 0));
    assert_ledger_zero(&proxy).await;

    let wrong = [
        (
            "api_key_env_by_region = { \"US-West\" = \"TG_WEST_KEY\" }",
            "upstream.api_key_env_by_region.US-West: \"US-West\" is not a Region name",
        ),
        (
            "api_key_env_by_region = { \"us-west-2\" = \"TG_NOT_SET\" }",
            "upstream.api_key_env_by_region.us-west-2: the environment variable TG_NOT_SET is not set",
        ),
    ];
    for (setting, says) in wrong {
        let text = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n\n[upstream]\nregion = \"us-east-1\"\n\
             endpoint = \"http://{}\"\n{setting}\n",
            tap.addr
        );
        let err = Config::parse_with_env(&text, &|_| None)
            .expect_err(setting)
            .to_string();
        assert!(err.starts_with(says), "{err}");
    }
}
