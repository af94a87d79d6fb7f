//! Security, part B: who the caller is, what it may call, what goes upstream. Each test is an
//! attack that got through before (issue #14), made with raw sockets, raw HTTP or requests signed
//! as the SDKs sign them, and checked where it matters: the answer, what reached upstream
//! (through a wire tap in front of the simulator), and the ledger back at zero.

use std::{
    net::SocketAddr,
    time::{Duration, SystemTime},
};

use crate::common::{
    signing::{Signing, signed_headers},
    tap::Tap,
    wire::read_head,
    *,
};
use aws_sigv4::http_request::SigningSettings;
use tokio::{io::AsyncWriteExt, net::TcpStream};

const FAST_SIM: &str = "time_to_first_token_ms = 0\ntokens_per_second = 0\n";
const KEY_ID: &str = "AKIATRIAGE0000000001";
const SECRET: &str = "triage-secret";

fn sigv4_route(extra: &str) -> String {
    format!(
        "[auth]\nmode = \"sigv4\"\n\n[[routes]]\nname = \"triage\"\naccess_key_id = \"{KEY_ID}\"\n\
         secret_access_key = \"{SECRET}\"\n{extra}\n"
    )
}

/// Signing with the triage route's key pair.
fn triage() -> Signing<'static> {
    Signing::new(KEY_ID, SECRET)
}

/// The headers of a POST to the proxy at `addr`, signed by `s`.
fn signed(
    s: Signing<'_>,
    addr: SocketAddr,
    path: &str,
    body: &[u8],
    headers: &[(&str, &str)],
) -> Vec<(String, String)> {
    signed_headers(s, &addr.to_string(), path, body, headers)
}

/// An HTTP/1.1 request written as raw bytes: `headers` as given, then `content-length` and the
/// body (`body_sent` of it; the head may promise more).
async fn raw_exchange(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(String, String)],
    content_length: usize,
    body_sent: &[u8],
) -> (u16, String, TcpStream) {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let mut head = format!("{method} {path} HTTP/1.1\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str(&format!("content-length: {content_length}\r\n\r\n"));
    stream.write_all(head.as_bytes()).await.expect("write head");
    stream.write_all(body_sent).await.expect("write body");
    let (status, head, _) = read_head(&mut stream).await;
    (status, head.to_ascii_lowercase(), stream)
}

fn error_type_in(head: &str) -> Option<&str> {
    head.lines()
        .find_map(|l| l.strip_prefix("x-amzn-errortype: "))
        .map(str::trim)
}

async fn converse_as(client: &aws_sdk_bedrockruntime::Client, model: &str) -> Result<(), String> {
    client
        .converse()
        .model_id(model)
        .messages(user_message("[sim:output=5] hi"))
        .inference_config(max_tokens(20))
        .send()
        .await
        .map(|_| ())
        .map_err(|e| format!("{:?}", e.into_service_error()))
}

/// Point 1a: in SigV4 mode a caller is identified from the head, and refused before any body
/// byte is read: each request below promises a 25 MB body and sends none, and gets its 403 at
/// once (before, the proxy waited for the whole body first, holding up to 26 MiB per caller).
#[tokio::test]
async fn sigv4_callers_are_refused_from_the_head_before_any_body_byte() {
    let stack = Stack::start(FAST_SIM, &sonnet_pool(1_000_000, 8), &sigv4_route("")).await;
    let addr = stack.proxy.addr;
    let path = model_path(SONNET_US, "converse");
    let body = converse_body("hi", Some(10));
    let head_only = |s: Signing<'static>| signed(s, addr, &path, body.as_bytes(), &[]);
    let mut no_host = SigningSettings::default();
    no_host.excluded_headers = Some(vec!["host".into()]);
    let cases = [
        (
            "a key the proxy never issued",
            head_only(Signing {
                key_id: "AKIANOTISSUED0000001",
                ..triage()
            }),
            "unrecognizedclientexception",
        ),
        (
            "a Region the proxy does not serve",
            head_only(Signing {
                region: "eu-west-3",
                ..triage()
            }),
            "accessdeniedexception",
        ),
        (
            "another service's scope",
            head_only(Signing {
                service: "s3",
                ..triage()
            }),
            "accessdeniedexception",
        ),
        (
            "host left unsigned",
            head_only(Signing {
                settings: no_host,
                ..triage()
            }),
            "accessdeniedexception",
        ),
        (
            "signed ten minutes ago",
            head_only(Signing {
                at: SystemTime::now() - Duration::from_secs(600),
                ..triage()
            }),
            "accessdeniedexception",
        ),
        (
            "no Authorization",
            vec![("host".to_string(), addr.to_string())],
            "accessdeniedexception",
        ),
    ];
    for (what, headers, error) in cases {
        let (status, head, _) = raw_exchange(addr, "POST", &path, &headers, 25_000_000, b"").await;
        assert_eq!(status, 403, "{what}: {head}");
        assert_eq!(error_type_in(&head), Some(error), "{what}: {head}");
    }
    let m = scrape(addr).await;
    for (reason, n) in [
        ("unknown_key", 1.0),
        ("scope", 2.0),
        ("malformed", 1.0),
        ("expired", 1.0),
        ("missing", 1.0),
    ] {
        m.expect(
            "tokengate_auth_failures_total",
            &[("mode", "sigv4"), ("reason", reason)],
            n,
        );
    }
    // The issued key pair, signed by the SDK, still gets through, body and all.
    converse_as(&keyed_client(addr, KEY_ID, SECRET), SONNET_US)
        .await
        .expect("the SDK's own signature verifies");
    assert_eq!(stack.sim.simulator.stats().calls(), 1);
    stack.assert_ledger_zero().await;
}

/// Points 3 and 4: a route's allow-list holds for a model in no pool (forwarded to others under
/// `unknown_models = "pass"`) and for every operation that names a model: CountTokens in its
/// path, StartAsyncInvoke in its body.
#[tokio::test]
async fn the_allow_list_holds_for_unpooled_models_and_every_operation() {
    let extra = format!(
        "[admission]\nunknown_models = \"pass\"\n\n[[routes]]\nname = \"app\"\nmodels = [\"{SONNET_US}\"]\n"
    );
    let stack = Stack::start(FAST_SIM, &sonnet_pool(1_000_000, 8), &extra).await;
    let addr = stack.proxy.addr;
    let post = |path: String, body: String| async move {
        raw_request(addr, "POST", &path, body, false).await
    };
    let converse = converse_body("[sim:output=5] hi", Some(10));
    let count =
        r#"{"input":{"converse":{"messages":[{"role":"user","content":[{"text":"hi"}]}]}}}"#;
    let start = |model: &str| {
        format!(
            r#"{{"modelId":"{model}","modelInput":{{}},"outputDataConfig":{{"s3OutputDataConfig":{{"s3Uri":"s3://b/o/"}}}}}}"#
        )
    };
    let refused = [
        (
            "converse, no pool",
            model_path(HAIKU, "converse"),
            converse.clone(),
        ),
        (
            "count-tokens",
            model_path(HAIKU, "count-tokens"),
            count.to_string(),
        ),
        ("async invoke", "/async-invoke".to_string(), start(HAIKU)),
    ];
    for (what, path, body) in refused {
        let r = post(path, body).await;
        assert_eq!(
            (r.status, r.error_type()),
            (403, "AccessDeniedException"),
            "{what}: {}",
            r.message()
        );
        assert!(
            r.message().contains("route \"app\" is not allowed"),
            "{what}"
        );
    }
    let twice = format!(
        r#"{{"modelId":"{SONNET_US}","modelId":"{HAIKU}","modelInput":{{}},"outputDataConfig":{{}}}}"#
    );
    let r = post("/async-invoke".into(), twice).await;
    assert_eq!((r.status, r.error_type()), (400, "ValidationException"));
    assert!(
        r.message().contains("duplicate field `modelId`"),
        "{}",
        r.message()
    );
    assert_eq!(
        stack.sim.simulator.stats().calls(),
        0,
        "nothing refused went upstream"
    );

    let allowed = [
        (model_path(SONNET_US, "converse"), converse),
        (model_path(SONNET_US, "count-tokens"), count.to_string()),
        ("/async-invoke".to_string(), start(SONNET_US)),
        (
            "/guardrail/gr1/version/1/apply".to_string(),
            "{}".to_string(),
        ),
    ];
    for (path, body) in allowed {
        let r = post(path.clone(), body).await;
        assert_eq!(r.status, 200, "{path}: {}", r.message());
    }
    assert_eq!(stack.sim.simulator.stats().calls(), 4);
    stack.assert_ledger_zero().await;
}

/// Every operation authenticates, whatever it costs: a guardrail call or an async-job lookup
/// without a key is refused like a model call.
#[tokio::test]
async fn operations_without_a_model_still_authenticate() {
    let key = "tg-only-key-0123456789";
    let extra = format!(
        "[auth]\nmode = \"bearer\"\nallow_plaintext_bearer = true\n\n[[routes]]\nname = \"app\"\nbearer_token_sha256 = \"{}\"\n",
        sha256_hex(key)
    );
    let stack = Stack::start(FAST_SIM, &sonnet_pool(1_000_000, 8), &extra).await;
    let addr = stack.proxy.addr;
    for (method, path) in [
        ("POST", "/guardrail/gr1/version/1/apply"),
        ("POST", "/guardrail-checks/invoke"),
        ("GET", "/async-invoke"),
        (
            "GET",
            "/async-invoke/arn%3Aaws%3Abedrock%3Aus-east-1%3A1%3Aasync-invoke%2Fx",
        ),
    ] {
        let r = raw_request(addr, method, path, "{}", false).await;
        assert_eq!(
            (r.status, r.error_type()),
            (403, "AccessDeniedException"),
            "{path}"
        );
        let bearer = format!("Bearer {key}");
        let r = raw_request_with(
            addr,
            method,
            path,
            "{}",
            false,
            &[("authorization", &bearer)],
        )
        .await;
        assert_eq!(r.status, 200, "{path}: {}", r.message());
    }
    assert_eq!(stack.sim.simulator.stats().calls(), 4);
    stack.assert_ledger_zero().await;
}

/// Point 3: a path with dot segments, empty segments or a double-encoded modelId could name
/// another resource to a server that normalises or decodes again (upstream), while the proxy
/// admitted (and signed) the one it read: refused, never forwarded.
#[tokio::test]
async fn paths_that_could_name_another_model_upstream_are_refused() {
    let extra = "[admission]\nunknown_models = \"pass\"\n";
    let stack = Stack::start(FAST_SIM, &sonnet_pool(1_000_000, 8), extra).await;
    let addr = stack.proxy.addr;
    let sonnet = model_path(SONNET_US, "converse");
    let haiku = model_path(HAIKU, "converse");
    let haiku_id = haiku
        .trim_start_matches("/model/")
        .trim_end_matches("/converse");
    let posts = [
        sonnet.replace("/converse", &format!("/../{haiku_id}/converse")),
        format!("/model/x/%2E%2E/{haiku_id}/converse"),
        format!("/model/x%2F..%2F{haiku_id}/converse"),
        format!("/model//{haiku_id}/converse"),
        sonnet.replace("%3A", "%253A"),
        format!("{sonnet}/"),
    ];
    for path in &posts {
        let r = raw_request(addr, "POST", path, converse_body("hi", Some(10)), false).await;
        assert_eq!(
            (r.status, r.error_type()),
            (400, "ValidationException"),
            "{path}"
        );
        assert!(r.message().contains("the path"), "{path}: {}", r.message());
    }
    let get = format!("/async-invoke/x/../..{haiku}");
    let r = raw_request(addr, "GET", &get, "", false).await;
    assert_eq!(
        (r.status, r.error_type()),
        (400, "ValidationException"),
        "{get}"
    );
    assert_eq!(stack.sim.simulator.stats().calls(), 0);
    stack.assert_ledger_zero().await;
}

/// Points 7 and 10: upstream gets only the headers bedrock-runtime defines (a cookie, another
/// service's `X-Amz-Target`, made-up `x-amzn-bedrock-*` headers stay behind, since the proxy signs
/// whatever it forwards); headers named in `Connection` are hop-by-hop, both ways.
#[tokio::test]
async fn only_the_api_s_headers_go_upstream_and_connection_headers_stop_here() {
    let sim = start_simulator(FAST_SIM).await;
    let tap = Tap::start(
        sim.addr,
        &[
            ("connection", "x-upstream-secret"),
            ("x-upstream-secret", "1"),
        ],
    )
    .await;
    let stack = Stack {
        proxy: start_proxy(proxy_config(tap.addr, &sonnet_pool(1_000_000, 8), "")).await,
        sim,
    };
    let addr = stack.proxy.addr;
    let path = model_path(SONNET_US, "converse");
    let body = converse_body("[sim:output=5] hi", Some(10));
    let header = |k: &str, v: &str| (k.to_string(), v.to_string());
    let mut headers = vec![
        header("host", &addr.to_string()),
        header("content-type", "application/json"),
        header("cookie", "session=stolen"),
        header("x-amz-target", "AmazonBedrockControlPlane.DeleteGuardrail"),
        header("x-amzn-bedrock-made-up", "1"),
        header("x-amzn-bedrock-trace", "ENABLED"),
        header("x-forwarded-for", "10.0.0.1"),
    ];
    let (status, head, _) =
        raw_exchange(addr, "POST", &path, &headers, body.len(), body.as_bytes()).await;
    assert_eq!(status, 200, "{head}");
    assert!(
        !head.contains("x-upstream-secret"),
        "named in Connection: {head}"
    );
    headers.push(header("connection", "keep-alive, X-Amzn-Bedrock-Trace"));
    let (status, _, _) =
        raw_exchange(addr, "POST", &path, &headers, body.len(), body.as_bytes()).await;
    assert_eq!(status, 200);

    let seen = tap.seen();
    assert_eq!(seen.len(), 2);
    let mut names: Vec<&str> = seen[0].headers.keys().map(|k| k.as_str()).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "authorization",
            "content-length",
            "content-type",
            "host",
            "x-amz-date",
            "x-amzn-bedrock-trace"
        ]
    );
    assert!(
        seen[0].headers["authorization"]
            .to_str()
            .is_ok_and(|a| a.contains(PROXY_KEY_ID))
    );
    assert!(
        !seen[1].headers.contains_key("x-amzn-bedrock-trace"),
        "named in the client's Connection header"
    );
    stack.assert_ledger_zero().await;
}

/// Point 7: a SigV4 caller's headers go upstream only if it signed them; one added on the way
/// (after signing) would otherwise be vouched for by the proxy's own signature.
#[tokio::test]
async fn a_sigv4_caller_s_unsigned_headers_never_go_upstream() {
    let sim = start_simulator(FAST_SIM).await;
    let tap = Tap::start(sim.addr, &[]).await;
    let config = proxy_config(tap.addr, &sonnet_pool(1_000_000, 8), &sigv4_route(""));
    let stack = Stack {
        proxy: start_proxy(config).await,
        sim,
    };
    let addr = stack.proxy.addr;
    let path = model_path(SONNET_US, "converse");
    let body = converse_body("[sim:output=5] hi", Some(10));
    let mut headers = signed(
        triage(),
        addr,
        &path,
        body.as_bytes(),
        &[("x-amzn-bedrock-trace", "ENABLED")],
    );
    headers.push((
        "x-amzn-bedrock-guardrailidentifier".into(),
        "added-in-flight".into(),
    ));
    let (status, head, _) =
        raw_exchange(addr, "POST", &path, &headers, body.len(), body.as_bytes()).await;
    assert_eq!(status, 200, "{head}");
    let seen = tap.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].headers["x-amzn-bedrock-trace"], "ENABLED");
    assert!(
        !seen[0]
            .headers
            .contains_key("x-amzn-bedrock-guardrailidentifier")
    );
    stack.assert_ledger_zero().await;
}

/// Point 5: with `server.admin_listen`, route names, shares, usage and the reasons signatures
/// failed are served there only; the proxy port keeps `/healthz` (what a liveness probe that
/// reaches only that port needs) and nothing else.
#[tokio::test]
async fn admin_endpoints_are_served_on_the_admin_listener_only() {
    let sim = start_simulator(FAST_SIM).await;
    let mut config = proxy_config(sim.addr, &sonnet_pool(200_000, 8), "");
    config.process.server.admin_listen = Some("127.0.0.1:0".parse().expect("addr"));
    let stack = Stack {
        proxy: start_proxy(config).await,
        sim,
    };
    let admin = stack.proxy.admin_addr.expect("admin listener");
    for path in ["/metrics", "/v1/pools", "/readyz"] {
        let r = raw_request(stack.proxy.addr, "GET", path, "", false).await;
        assert_eq!(
            (r.status, r.error_type()),
            (404, "UnknownOperationException"),
            "{path} on the proxy port"
        );
        assert_eq!(raw_request(admin, "GET", path, "", false).await.status, 200);
    }
    for addr in [stack.proxy.addr, admin] {
        assert_eq!(
            raw_request(addr, "GET", "/healthz", "", false).await.status,
            200
        );
    }
    stack.assert_ledger_zero().await;
}

/// Point 6: a route's `max_tokens_ceiling` cannot be dodged by leaving `maxTokens` out (Bedrock
/// would reserve, and allow, the model's maximum) or by naming it twice (reserved as one value,
/// read upstream as the other).
#[tokio::test]
async fn the_max_tokens_ceiling_cannot_be_dodged() {
    let sim = start_simulator(FAST_SIM).await;
    let tap = Tap::start(sim.addr, &[]).await;
    // The pool's default (1,000) is under the ceiling: a body without maxTokens gets the ceiling.
    let extra = "[[routes]]\nname = \"app\"\nmax_tokens_ceiling = 2000\n";
    let config = proxy_config(tap.addr, &sonnet_pool(1_000_000, 8), extra);
    let stack = Stack {
        proxy: start_proxy(config).await,
        sim,
    };
    let addr = stack.proxy.addr;
    let r = raw_request(
        addr,
        "POST",
        &model_path(SONNET_US, "converse"),
        converse_body("[sim:output=5] hi", None),
        false,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.message());
    let seen = tap.seen();
    let forwarded: serde_json::Value = serde_json::from_slice(&seen[0].body).expect("json");
    assert_eq!(forwarded["inferenceConfig"]["maxTokens"], 2000);

    let twice = [
        (
            model_path(SONNET_US, "converse"),
            r#"{"messages":[{"role":"user","content":[{"text":"hi"}]}],"inferenceConfig":{"maxTokens":60000,"maxTokens":1}}"#,
            "inferenceConfig.maxTokens appears more than once",
        ),
        (
            model_path(SONNET_US, "invoke"),
            r#"{"anthropic_version":"bedrock-2023-05-31","messages":[],"max_tokens":60000,"max_tokens":1}"#,
            "max_tokens appears more than once",
        ),
    ];
    for (path, body, says) in twice {
        let r = raw_request(addr, "POST", &path, body, false).await;
        assert_eq!(
            (r.status, r.error_type()),
            (400, "ValidationException"),
            "{body}"
        );
        assert!(r.message().contains(says), "{}", r.message());
    }
    assert_eq!(
        tap.seen().len(),
        1,
        "the doubled bodies never went upstream"
    );
    stack.assert_ledger_zero().await;
}

/// A pool for the retry reserve's tests: calls of 208-240 tokens (8-40 in, 200 out) against a
/// bucket of 1,200 that refills 20 a second, 540 of it kept for retries: three first attempts
/// fit, then one lacks about 170 tokens (some 8 s of refill, so a slow machine does not turn the
/// refusals below into admissions), and the retry reserve holds two more calls.
fn reserve_pool() -> String {
    format!(
        "[[pools]]\nname = \"haiku\"\nmodels = [\"{HAIKU}\"]\ntokens_per_minute = 1200\n\
         max_concurrency = 64\noutput_burndown = 1\ndefault_max_tokens = 500\nmax_wait_ms = 0\n\
         retry_reserve = 0.45\n"
    )
}

/// Through `call(n, attempt)` (call `n`'s attempt `attempt`, from 1), against [`reserve_pool`]:
/// first attempts fill the pool until one is turned away; a "retry" of a call never turned away
/// waits like a first attempt; the retry of the call turned away gets the reserve, once.
async fn a_rejection_vouches_for_one_retry<F, Fut>(stack: &Stack, call: F)
where
    F: Fn(u32, u32) -> Fut,
    Fut: std::future::Future<Output = u16>,
{
    let mut n = 0;
    let rejected = loop {
        if call(n, 1).await == 429 {
            break n;
        }
        n += 1;
        assert!(n < 20, "the pool never filled");
    };
    assert_eq!(
        call(99, 2).await,
        429,
        "a retry of a call never turned away waits like a first attempt"
    );
    assert_eq!(call(rejected, 2).await, 200);
    assert_eq!(
        call(rejected, 3).await,
        429,
        "one rejection vouches for one retry"
    );
    scrape(stack.proxy.addr).await.expect(
        "tokengate_recovery_admissions_total",
        &[("pool", "haiku"), ("route", "default")],
        1.0,
    );
    stack.assert_ledger_zero().await;
}

/// Point 9: the retry reserve is for SDK retries of calls this proxy turned away. Saying
/// `attempt=2` is not enough: a "retry" of a call never rejected waits like a first attempt,
/// and the retry of a call that was rejected gets the reserve.
#[tokio::test]
async fn a_forged_retry_gets_no_reserve() {
    let stack = Stack::start(FAST_SIM, &reserve_pool(), "").await;
    let addr = stack.proxy.addr;
    let path = model_path(HAIKU, "converse");
    let body = converse_body("[sim:output=200] go", Some(200));
    a_rejection_vouches_for_one_retry(&stack, |n, attempt| {
        let (path, body) = (path.clone(), body.clone());
        async move {
            let (id, attempt) = (format!("call-{n}"), format!("attempt={attempt}; max=3"));
            let headers = [
                ("amz-sdk-invocation-id", id.as_str()),
                ("amz-sdk-request", attempt.as_str()),
            ];
            raw_request_with(addr, "POST", &path, body, false, &headers)
                .await
                .status
        }
    })
    .await;
}

/// Point 9 for the OpenAI and Anthropic SDKs, which send no call id: they count their retries in
/// `x-stainless-retry-count` and resend the same body, so a retry of a body turned away gets the
/// reserve, a "retry" of a body never turned away does not, and one rejection vouches for one
/// retry.
#[tokio::test]
async fn an_anthropic_sdk_retry_of_a_body_turned_away_gets_the_reserve() {
    let stack = Stack::start(FAST_SIM, &reserve_pool(), "").await;
    let addr = stack.proxy.addr;
    a_rejection_vouches_for_one_retry(&stack, |n, attempt| async move {
        let body = serde_json::json!({"model": HAIKU, "max_tokens": 200,
            "messages": [{"role": "user", "content": format!("[sim:output=200] go {n:02}")}]});
        let retries = (attempt - 1).to_string();
        let headers = [
            ("anthropic-version", "2023-06-01"),
            ("x-stainless-retry-count", retries.as_str()),
        ];
        raw_request_with(
            addr,
            "POST",
            apis::MESSAGES,
            body.to_string(),
            false,
            &headers,
        )
        .await
        .status
    })
    .await;
}

/// Point 8: plaintext bearer keys are for a loopback listener only.
#[test]
fn plaintext_bearer_keys_are_refused_off_loopback() {
    let text = |listen: &str| {
        format!(
            "[server]\nlisten = \"{listen}\"\n\n[upstream]\nregion = \"us-east-1\"\nendpoint = \"simulated\"\n\n\
             [auth]\nmode = \"bearer\"\nallow_plaintext_bearer = true\n\n[[routes]]\nname = \"a\"\n\
             bearer_token_sha256 = \"{}\"\n",
            sha256_hex("k")
        )
    };
    for listen in ["127.0.0.1:8080", "[::1]:8080"] {
        tokengate::config::Config::parse(&text(listen)).expect(listen);
    }
    for listen in ["0.0.0.0:8080", "10.1.2.3:8080", "[::]:8080"] {
        let err = tokengate::config::Config::parse(&text(listen))
            .expect_err(listen)
            .to_string();
        assert!(
            err.starts_with("auth.allow_plaintext_bearer:")
                && err.contains("not a loopback address"),
            "{err}"
        );
    }
}

/// Point 11: credentials in the upstream URL are refused at config time and never echoed, and an
/// upstream built with them anyway never shows them in an error (the 503 body, the log).
#[tokio::test]
async fn upstream_url_credentials_are_refused_and_never_shown() {
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let dead = closed.local_addr().expect("addr");
    drop(closed);
    let url = format!("http://user:hunter2@{dead}");
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n\n[upstream]\nregion = \"us-east-1\"\nendpoint = \"{url}\"\n"
    );
    let err = tokengate::config::Config::parse(&text)
        .expect_err("userinfo refused")
        .to_string();
    assert!(
        err.starts_with("upstream.endpoint:") && !err.contains("hunter2"),
        "{err}"
    );

    let signer = tokengate::upstream::Signer::new(proxy_credentials(), "us-east-1");
    let built = tokengate::upstream::Upstream::new(
        url.parse().expect("uri"),
        signer,
        Duration::from_secs(1),
        Duration::from_secs(1),
        Duration::from_secs(1),
    );
    let message = match built {
        Err(e) => e.to_string(),
        Ok(upstream) => upstream
            .send(
                tokengate::bedrock::Operation::Converse,
                "us-east-1",
                http::Method::POST,
                "/model/m/converse",
                &http::HeaderMap::new(),
                bytes::Bytes::new(),
            )
            .await
            .expect_err("nothing listens")
            .to_string(),
    };
    assert!(!message.contains("hunter2"), "{message}");
}

/// Point 14: `secret_access_key_env` is looked up in the environment the config is parsed with
/// (not the process's), and the key pair then works end to end.
#[tokio::test]
async fn route_secrets_come_from_the_injected_environment() {
    let sim = start_simulator(FAST_SIM).await;
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n\n[upstream]\nregion = \"us-east-1\"\nendpoint = \"http://{}\"\n\n\
         [auth]\nmode = \"sigv4\"\n\n[[routes]]\nname = \"triage\"\naccess_key_id = \"{KEY_ID}\"\n\
         secret_access_key_env = \"TG_ONLY_IN_THE_INJECTED_ENV\"\n\n{}",
        sim.addr,
        sonnet_pool(1_000_000, 8)
    );
    let env = |name: &str| (name == "TG_ONLY_IN_THE_INJECTED_ENV").then(|| SECRET.to_string());
    let config =
        tokengate::config::Config::parse_with_env(&text, &env).expect("the variable is set");
    let stack = Stack {
        proxy: start_proxy(config).await,
        sim,
    };
    converse_as(&keyed_client(stack.proxy.addr, KEY_ID, SECRET), SONNET_US)
        .await
        .expect("the injected secret verifies");
    stack.assert_ledger_zero().await;
}
