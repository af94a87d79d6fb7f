//! Service tiers: a `reserved` call draws on the pool of reserved capacity (`tier =
//! "reserved"`) and overflows to the on-demand pool when it cannot admit now; other tiers, and
//! calls that name none, draw on the on-demand pool. Converse names its tier in the body
//! (`serviceTier.type`), InvokeModel in the `X-Amzn-Bedrock-Service-Tier` header.

use serde_json::{Value, json};

use crate::common::*;

/// Upstream: Sonnet with 5,000 tokens a minute of reserved capacity, overflowing to standard.
const SIM: &str = "time_to_first_token_ms = 0\ntokens_per_second = 0\ndefault_tokens_per_minute = 10000000\n\
                   [[quotas]]\nmodel = \"us.anthropic.claude-sonnet-4-20250514-v1:0\"\nreserved_tokens_per_minute = 5000\n";

/// An InvokeModel body for Claude: the tier goes in a header.
const INVOKE: &str = r#"{"anthropic_version":"bedrock-2023-05-31","max_tokens":100,"messages":[{"role":"user","content":"[sim:output=5] hi"}]}"#;

fn pools() -> String {
    format!(
        "{}max_wait_ms = 0\n\n[[pools]]\nname = \"sonnet-reserved\"\ntier = \"reserved\"\nmodels = [\"{SONNET_US}\"]\n\
         tokens_per_minute = 5000\nmax_concurrency = 8\ndefault_max_tokens = 1000\nmax_wait_ms = 0\n",
        sonnet_pool(100_000, 8)
    )
}

fn tiered(text: &str, tier: Option<&str>, max: u64) -> String {
    let mut body: Value = serde_json::from_str(&converse_body(text, Some(max))).expect("json");
    if let Some(tier) = tier {
        body["serviceTier"] = json!({ "type": tier });
    }
    body.to_string()
}

async fn admitted(stack: &Stack) -> (u64, u64) {
    let views = stack.proxy.admission().pool_views().await;
    let count = |name: &str| {
        views
            .iter()
            .find(|v| v.name == name)
            .map_or(0, |v| v.admitted)
    };
    (count("sonnet-reserved"), count("sonnet4-us"))
}

#[tokio::test]
async fn reserved_calls_use_reserved_capacity_and_overflow_to_on_demand() {
    let stack = Stack::start(SIM, &pools(), "").await;
    let (addr, path) = (stack.proxy.addr, model_path(SONNET_US, "converse"));
    let call = |tier, text: &'static str, max| {
        let path = path.clone();
        async move { raw_request(addr, "POST", &path, tiered(text, tier, max), false).await }
    };
    // No tier, and the other tiers: the on-demand pool.
    for tier in [None, Some("default"), Some("priority"), Some("flex")] {
        let r = call(tier, "[sim:output=5] hi", 100).await;
        assert_eq!(r.status, 200, "{tier:?}: {}", r.message());
    }
    assert_eq!(admitted(&stack).await, (0, 4));
    // Reserved: the reserved pool; 900 x 5 charged, about 490 of its 5,000 left this minute.
    let r = call(Some("reserved"), "[sim:output=900] long", 1_000).await;
    assert_eq!(r.status, 200, "{}", r.message());
    assert_eq!(admitted(&stack).await, (1, 4));
    // The next reserved call does not fit the reserved pool now: it overflows, as Bedrock does.
    let r = call(Some("reserved"), "[sim:output=5] more", 2_000).await;
    assert_eq!(r.status, 200, "{}", r.message());
    assert_eq!(admitted(&stack).await, (1, 5));
    let reserved = stack.proxy.admission().pool_views().await;
    let reserved = reserved
        .iter()
        .find(|v| v.name == "sonnet-reserved")
        .expect("pool");
    assert_eq!(
        (reserved.rejected.tokens, reserved.upstream_throttles),
        (0, 0),
        "an overflow is no refusal"
    );
    // InvokeModel names its tier in a header.
    let r = raw_request_with(
        addr,
        "POST",
        &model_path(SONNET_US, "invoke"),
        INVOKE,
        false,
        &[("x-amzn-bedrock-service-tier", "reserved")],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.message());
    assert_eq!(admitted(&stack).await, (2, 5));
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn a_reserved_pool_needs_an_on_demand_one_and_a_tier_must_be_known() {
    let sim = start_simulator(SIM).await;
    let only_reserved = format!(
        "[[pools]]\nname = \"r\"\ntier = \"reserved\"\nmodels = [\"{SONNET_US}\"]\ntokens_per_minute = 5000\n\
         max_concurrency = 8\ndefault_max_tokens = 1000\n"
    );
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nregion = \"us-east-1\"\nendpoint = \"http://{}\"\n{only_reserved}",
        sim.addr
    );
    let e = tokengate::config::Config::parse(&text)
        .expect_err("refused")
        .to_string();
    assert!(
        e.contains("pools[0] (r).models") && e.contains("no on_demand pool"),
        "{e}"
    );
    let e = tokengate::config::Config::parse(&text.replace("\"reserved\"", "\"gold\""))
        .expect_err("refused")
        .to_string();
    assert!(e.contains("tier") && e.contains("on_demand"), "{e}");
}

#[tokio::test]
async fn a_routes_allowed_tiers_refuse_the_others_saying_which_to_send() {
    let routes = "[[routes]]\nname = \"batch\"\nallowed_tiers = [\"flex\", \"default\"]\n\
                  [auth]\ndefault_route = \"batch\"\n";
    let stack = Stack::start(SIM, &pools(), routes).await;
    let (addr, path) = (stack.proxy.addr, model_path(SONNET_US, "converse"));
    for (tier, status) in [(None, 200), (Some("flex"), 200), (Some("priority"), 400)] {
        let r = raw_request(
            addr,
            "POST",
            &path,
            tiered("[sim:output=5] hi", tier, 100),
            false,
        )
        .await;
        assert_eq!(r.status, status, "{tier:?}: {}", r.message());
        if status == 400 {
            assert_eq!(r.error_type(), "ValidationException");
            assert!(
                r.message()
                    .contains("route \"batch\" may not use service tier \"priority\"")
                    && r.message().contains("one of: flex, default"),
                "{}",
                r.message()
            );
        }
    }
    let r = raw_request_with(
        addr,
        "POST",
        &model_path(SONNET_US, "invoke"),
        INVOKE,
        false,
        &[("x-amzn-bedrock-service-tier", "reserved")],
    )
    .await;
    assert_eq!((r.status, r.error_type()), (400, "ValidationException"));
    assert_eq!(admitted(&stack).await, (0, 2));
    stack.assert_ledger_zero().await;
}

/// Calls upstream served in `tier`, as the simulator counted them.
fn served_in(stack: &Stack, tier: &str) -> u64 {
    let stats = stack.sim.simulator.stats();
    stats.tiers.get(tier).map_or(0, |t| t.completed)
}

#[tokio::test]
async fn a_route_that_forces_a_tier_runs_every_call_in_it() {
    // The batch route runs in reserved capacity whatever its calls ask for (one of them asks for
    // priority); the interactive route's calls keep their own.
    let routes = "[auth]\nmode = \"bearer\"\nallow_plaintext_bearer = true\n\
                  [[routes]]\nname = \"batch\"\nbearer_token_sha256 = \"2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b\"\n\
                  service_tier = \"reserved\"\n\
                  [[routes]]\nname = \"interactive\"\nbearer_token_sha256 = \"5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8\"\n";
    let stack = Stack::start(SIM, &pools(), routes).await;
    let (addr, path) = (stack.proxy.addr, model_path(SONNET_US, "converse"));
    let call = |key: &'static str,
                body: String,
                path: String,
                extra: Vec<(&'static str, &'static str)>| async move {
        let auth = format!("Bearer {key}");
        let mut headers = vec![("authorization", auth.as_str())];
        headers.extend(extra);
        raw_request_with(addr, "POST", &path, body, false, &headers).await
    };
    // "secret" and "password" are the keys whose SHA-256 the routes hold.
    for tier in [None, Some("priority")] {
        let r = call(
            "secret",
            tiered("[sim:output=5] hi", tier, 100),
            path.clone(),
            vec![],
        )
        .await;
        assert_eq!(r.status, 200, "{tier:?}: {}", r.message());
    }
    assert_eq!(
        admitted(&stack).await,
        (2, 0),
        "charged to reserved capacity"
    );
    assert_eq!(served_in(&stack, "reserved"), 2, "and sent as reserved");
    // InvokeModel: the header is written (or replaced).
    let invoke_path = model_path(SONNET_US, "invoke");
    let r = call(
        "secret",
        INVOKE.to_string(),
        invoke_path.clone(),
        vec![("x-amzn-bedrock-service-tier", "flex")],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.message());
    assert_eq!(admitted(&stack).await, (3, 0));
    assert_eq!(served_in(&stack, "reserved"), 3);
    // Anthropic Messages names it in the body's service_tier (its "auto" replaced).
    let messages = serde_json::json!({"model": SONNET_US, "max_tokens": 100, "service_tier": "auto",
        "messages": [{"role": "user", "content": "[sim:output=5] hi"}]});
    let r = call(
        "secret",
        messages.to_string(),
        "/anthropic/v1/messages".into(),
        vec![],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.message());
    assert_eq!(admitted(&stack).await, (4, 0));
    assert_eq!(served_in(&stack, "reserved"), 4);
    // The other route's calls run in what they ask for.
    let r = call(
        "password",
        tiered("[sim:output=5] hi", Some("flex"), 100),
        path.clone(),
        vec![],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.message());
    assert_eq!(admitted(&stack).await, (4, 1));
    assert_eq!(
        (served_in(&stack, "reserved"), served_in(&stack, "flex")),
        (4, 1)
    );
    stack.assert_ledger_zero().await;
}

#[test]
fn a_forced_tier_outside_the_routes_allowed_tiers_is_a_config_error() {
    let text = "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nregion = \"us-east-1\"\nendpoint = \"simulated\"\n\
                [[routes]]\nname = \"batch\"\nallowed_tiers = [\"flex\"]\nservice_tier = \"priority\"\n";
    let e = tokengate::config::Config::parse(text)
        .expect_err("refused")
        .to_string();
    assert!(
        e.contains("routes[0] (batch).service_tier") && e.contains("allowed_tiers"),
        "{e}"
    );
}
