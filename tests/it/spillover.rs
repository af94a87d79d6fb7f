//! Pools in several Regions and spill chains between them (issue #18): each pool's requests are
//! signed for its Region (the simulator tells Regions by the SigV4 scope, and verifies the
//! proxy's signature on every call), and a request its home pool cannot admit now runs in the
//! first pool of the chain with room, sent as that pool's model in that pool's Region.
//!
//! Other traffic filling a pool is stood for by a reservation taken in the proxy's own ledger
//! ([`occupy`]): the pool then cannot admit now, exactly as when its own calls fill it.

use crate::common::{log_capture::Capture, *};
use tokengate::{
    gateway::Gateway,
    ledger::{Reservation, ReserveRequest, Verdict},
};

const SIM: &str = "time_to_first_token_ms = 0\ntokens_per_second = 0\ndefault_tokens_per_minute = 10000000\n\
    verify_sigv4 = { access_key_id = \"AKIATOKENGATEPROXY01\", secret_access_key = \"proxy-secret-key\" }\n";
const SONNET: &str = "anthropic.claude-sonnet-4-20250514-v1:0";
/// Claude Sonnet 4 on demand in us-west-2, by its ARN there.
const SONNET_WEST: &str =
    "arn:aws:bedrock:us-west-2::foundation-model/anthropic.claude-sonnet-4-20250514-v1:0";
const ROAM_KEY: &str = "tg-roam-0123456789ab";
const STAY_KEY: &str = "tg-stay-0123456789ab";
const RESIDENT_KEY: &str = "tg-resident-01234567";

async fn converse(client: &aws_sdk_bedrockruntime::Client, model: &str) {
    client
        .converse()
        .model_id(model)
        .messages(user_message("hello"))
        .inference_config(max_tokens(100))
        .send()
        .await
        .unwrap_or_else(|e| panic!("converse {model}: {e:?}"));
}

#[tokio::test]
async fn each_pool_is_signed_for_its_own_region() {
    let pools = format!(
        "{}\n[[pools]]\nname = \"haiku-usw2\"\nmodels = [\"{HAIKU}\"]\nregion = \"us-west-2\"\n\
         tokens_per_minute = 100000\nmax_concurrency = 4\noutput_burndown = 1\ndefault_max_tokens = 500\n",
        sonnet_pool(100_000, 4)
    );
    let stack = Stack::start(SIM, &pools, "").await;
    converse(&stack.client(), HAIKU).await;
    converse(&stack.client(), HAIKU).await;
    converse(&stack.client(), SONNET_US).await;
    let stats = stack.sim.simulator.stats();
    assert_eq!(stats.sigv4.verified, 3, "{:?}", stats.sigv4);
    assert_eq!(
        stats.regions["us-west-2"].calls.requests, 2,
        "{:?}",
        stats.regions
    );
    assert_eq!(
        stats.regions["us-east-1"].calls.requests, 1,
        "{:?}",
        stats.regions
    );
    stack.assert_ledger_zero().await;
}

/// `sonnet-us` (the `us.` profile) spills to `sonnet-global`, then to Sonnet on demand in
/// us-west-2; one permit each, no queue.
fn chain_pools(home_extra: &str) -> String {
    let pool = |name: &str, model: &str, extra: &str| {
        format!(
            "[[pools]]\nname = \"{name}\"\nmodels = [\"{model}\"]\ntokens_per_minute = 1000000\n\
             max_concurrency = 1\noutput_burndown = 5\ndefault_max_tokens = 1000\nmax_wait_ms = 0\n{extra}\n"
        )
    };
    [
        pool(
            "sonnet-us",
            SONNET_US,
            &format!("spill_to = [\"sonnet-global\", \"sonnet-west\"]\n{home_extra}"),
        ),
        pool("sonnet-global", SONNET_GLOBAL, ""),
        pool("sonnet-west", SONNET_WEST, "region = \"us-west-2\"\n"),
    ]
    .join("\n")
}

/// Takes `pool`'s only permit in the proxy's ledger: the pool cannot admit now.
async fn occupy(proxy: &Gateway, pool: &str) -> Reservation {
    let admission = proxy.admission();
    let found = admission
        .pools()
        .iter()
        .find(|p| &*p.name == pool)
        .expect("pool");
    let verdict = admission
        .ledger()
        .reserve(&ReserveRequest {
            pool,
            limits: found.limits(),
            tokens: 1,
            share: None,
            hold_back: 0,
        })
        .await
        .expect("ledger");
    match verdict {
        Verdict::Granted(r) => r,
        Verdict::Refused(r) => panic!("{pool} is already full: {r:?}"),
    }
}

async fn release(proxy: &Gateway, held: Vec<Reservation>) {
    for r in held {
        proxy
            .admission()
            .ledger()
            .settle(r, 1)
            .await
            .expect("settle");
    }
}

/// A Converse call to `SONNET_US` through the proxy, with `bearer` as the caller's key if any.
async fn call(proxy: &Gateway, bearer: Option<&str>) -> RawResponse {
    let auth = bearer.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    raw_request_with(
        proxy.addr,
        "POST",
        &model_path(SONNET_US, "converse"),
        converse_body("hello", Some(100)),
        false,
        &headers,
    )
    .await
}

fn requests_in(stack: &Stack, bucket: &str) -> u64 {
    let stats = stack.sim.simulator.stats();
    stats.buckets.get(bucket).map_or(0, |b| b.requests)
}

// A current-thread runtime: the proxy's tasks run on this thread, under the thread's subscriber
// (the access log is read back).
#[tokio::test]
async fn a_request_spills_only_when_its_home_pool_cannot_admit_now() {
    let capture = Capture::default();
    let _guard = tracing::subscriber::set_default(capture.subscriber());
    let stack = Stack::start(SIM, &chain_pools(""), "").await;
    let proxy = &stack.proxy;
    let (geo_us, global, west) = (
        format!("{SONNET}@geo:us"),
        format!("{SONNET}@global"),
        format!("{SONNET}@us-west-2"),
    );

    // Room at home: it stays.
    let home = call(proxy, None).await;
    assert_eq!(home.status, 200, "{:?}", home.body);
    assert_eq!(home.header("x-tokengate-pool"), Some("sonnet-us"));
    assert_eq!(requests_in(&stack, &geo_us), 1);

    // Home full: the first of the chain, as its own model (`global.`).
    let mut held = vec![occupy(proxy, "sonnet-us").await];
    let spilled = call(proxy, None).await;
    assert_eq!(spilled.status, 200, "{:?}", spilled.body);
    assert_eq!(spilled.header("x-tokengate-pool"), Some("sonnet-global"));
    assert_eq!(requests_in(&stack, &global), 1);
    assert_eq!(requests_in(&stack, &geo_us), 1, "never at home too");

    // Home and global full: Sonnet on demand in us-west-2, signed for us-west-2.
    held.push(occupy(proxy, "sonnet-global").await);
    let west_call = call(proxy, None).await;
    assert_eq!(west_call.status, 200, "{:?}", west_call.body);
    assert_eq!(west_call.header("x-tokengate-pool"), Some("sonnet-west"));
    assert_eq!(requests_in(&stack, &west), 1);
    let stats = stack.sim.simulator.stats();
    assert_eq!(
        stats.regions["us-west-2"].calls.requests, 1,
        "{:?}",
        stats.regions
    );
    assert_eq!(stats.sigv4.verified, 3, "every call signed for its Region");

    // Nowhere has room: the home pool's 429.
    held.push(occupy(proxy, "sonnet-west").await);
    let refused = call(proxy, None).await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.error_type(), "ThrottlingException");
    assert_eq!(refused.header("x-tokengate-pool"), Some("sonnet-us"));
    assert_eq!(refused.header("x-tokengate-reason"), Some("concurrency"));
    assert_eq!(
        stack.sim.simulator.stats().calls(),
        3,
        "nothing went upstream"
    );

    release(proxy, held).await;
    stack.assert_ledger_zero().await;

    // Seen everywhere: the metric, the access log, the chain in /v1/pools.
    let spilled = |to: &str| {
        metric(
            proxy,
            "tokengate_spillover_total",
            &[("from", "sonnet-us"), ("to", to), ("route", "default")],
        )
    };
    assert_eq!(
        (spilled("sonnet-global"), spilled("sonnet-west")),
        (1.0, 1.0)
    );
    let lines = capture.access_lines();
    let ran: Vec<(String, String)> = lines
        .iter()
        .filter(|l| l["decision"] == "admitted")
        .map(|l| {
            let field = |k: &str| l[k].as_str().unwrap_or("-").to_string();
            (field("pool"), field("spilled_from"))
        })
        .collect();
    let expected = [
        ("sonnet-us", "-"),
        ("sonnet-global", "sonnet-us"),
        ("sonnet-west", "sonnet-us"),
    ];
    let expected: Vec<(String, String)> = expected
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    assert_eq!(ran, expected, "{lines:?}");
    let pools = raw_request(proxy.addr, "GET", "/v1/pools", "", false).await;
    let pools: serde_json::Value = serde_json::from_slice(&pools.body).expect("json");
    assert_eq!(
        pools["pools"][0]["spill_chain"],
        serde_json::json!(["sonnet-global", "sonnet-west"])
    );
    assert_eq!(pools["pools"][1]["spill_chain"], serde_json::json!([]));
}

#[tokio::test]
async fn routes_decide_whether_and_where_they_may_spill() {
    let routes = format!(
        "[auth]\nmode = \"bearer\"\nallow_plaintext_bearer = true\n\n\
         [[routes]]\nname = \"roam\"\nspill = true\nbearer_token_sha256 = \"{}\"\n\n\
         [[routes]]\nname = \"stay\"\nbearer_token_sha256 = \"{}\"\n\n\
         [[routes]]\nname = \"resident\"\nspill = true\nregions = [\"us-east-1\"]\n\
         models = [\"{SONNET_US}\"]\nbearer_token_sha256 = \"{}\"\n",
        sha256_hex(ROAM_KEY),
        sha256_hex(STAY_KEY),
        sha256_hex(RESIDENT_KEY)
    );
    let stack = Stack::start(SIM, &chain_pools(""), &routes).await;
    let proxy = &stack.proxy;
    let mut held = vec![occupy(proxy, "sonnet-us").await];

    // A route without `spill` never leaves its pool.
    let stay = call(proxy, Some(STAY_KEY)).await;
    assert_eq!(stay.status, 429, "{:?}", stay.body);
    assert_eq!(stay.header("x-tokengate-pool"), Some("sonnet-us"));

    // The resident route may spill, but only within us-east-1.
    let resident = call(proxy, Some(RESIDENT_KEY)).await;
    assert_eq!(resident.header("x-tokengate-pool"), Some("sonnet-global"));
    held.push(occupy(proxy, "sonnet-global").await);
    let resident = call(proxy, Some(RESIDENT_KEY)).await;
    assert_eq!(resident.status, 429, "never to us-west-2");

    let roam = call(proxy, Some(ROAM_KEY)).await;
    assert_eq!(roam.status, 200, "{:?}", roam.body);
    assert_eq!(roam.header("x-tokengate-pool"), Some("sonnet-west"));
    let stats = stack.sim.simulator.stats();
    assert_eq!(
        stats.regions["us-west-2"].calls.requests, 1,
        "only roam's call"
    );

    release(proxy, held).await;
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn spill_cached_false_keeps_cached_prompts_home() {
    let stack = Stack::start(SIM, &chain_pools("spill_cached = false\n"), "").await;
    let proxy = &stack.proxy;
    let held = vec![occupy(proxy, "sonnet-us").await];
    let cached = serde_json::json!({
        "system": [{"text": "You are terse."}, {"cachePoint": {"type": "default"}}],
        "messages": [{"role": "user", "content": [{"text": "hello"}]}],
        "inferenceConfig": {"maxTokens": 100}
    });
    let path = model_path(SONNET_US, "converse");
    let kept = raw_request(proxy.addr, "POST", &path, cached.to_string(), false).await;
    assert_eq!(kept.status, 429, "{:?}", kept.body);
    let plain = raw_request(
        proxy.addr,
        "POST",
        &path,
        converse_body("hi", Some(100)),
        false,
    )
    .await;
    assert_eq!(plain.header("x-tokengate-pool"), Some("sonnet-global"));
    release(proxy, held).await;
    stack.assert_ledger_zero().await;
}

#[tokio::test]
async fn a_spilled_anthropic_messages_call_names_its_pool_s_model_in_the_body() {
    let stack = Stack::start(SIM, &chain_pools(""), "").await;
    let proxy = &stack.proxy;
    let held = vec![occupy(proxy, "sonnet-us").await];
    let body = serde_json::json!({"model": SONNET_US, "max_tokens": 100,
        "messages": [{"role": "user", "content": "hello"}]});
    let r = raw_request(
        proxy.addr,
        "POST",
        "/anthropic/v1/messages",
        body.to_string(),
        false,
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.header("x-tokengate-pool"), Some("sonnet-global"));
    let stats = stack.sim.simulator.stats();
    assert_eq!(stats.apis["AnthropicMessages"].requests, 1);
    assert_eq!(
        requests_in(&stack, &format!("{SONNET}@global")),
        1,
        "{:?}",
        stats.buckets
    );
    assert_eq!(requests_in(&stack, &format!("{SONNET}@geo:us")), 0);
    release(proxy, held).await;
    stack.assert_ledger_zero().await;
}

/// `sonnet-us` (one permit) spilling to `spill_to`; the global and us-west-2 pools with room for
/// many.
fn reload_config(stack_sim: std::net::SocketAddr, spill_to: &str) -> tokengate::config::Config {
    let pool = |name: &str, model: &str, concurrency: u32, extra: &str| {
        format!(
            "[[pools]]\nname = \"{name}\"\nmodels = [\"{model}\"]\ntokens_per_minute = 1000000\n\
             max_concurrency = {concurrency}\noutput_burndown = 5\ndefault_max_tokens = 1000\nmax_wait_ms = 0\n{extra}\n"
        )
    };
    let pools = [
        pool(
            "sonnet-us",
            SONNET_US,
            1,
            &format!("spill_to = [\"{spill_to}\"]\n"),
        ),
        pool("sonnet-global", SONNET_GLOBAL, 64, ""),
        pool("sonnet-west", SONNET_WEST, 64, "region = \"us-west-2\"\n"),
    ]
    .join("\n");
    proxy_config(stack_sim, &pools, "")
}

#[tokio::test]
async fn a_reload_changes_chains_atomically() {
    let sim = start_simulator(SIM).await;
    let proxy = start_proxy(reload_config(sim.addr, "sonnet-global")).await;
    let held = vec![occupy(&proxy, "sonnet-us").await];
    assert_eq!(
        call(&proxy, None).await.header("x-tokengate-pool"),
        Some("sonnet-global")
    );
    proxy
        .reload(reload_config(sim.addr, "sonnet-west"))
        .expect("reload");
    assert_eq!(
        call(&proxy, None).await.header("x-tokengate-pool"),
        Some("sonnet-west"),
        "the next request takes the new chain"
    );

    // Calls while the chain flips back and forth: each is decided by one generation, so each
    // runs in one of the two chains' pools, and none is refused (both have room).
    let proxy = std::sync::Arc::new(proxy);
    let calls: Vec<_> = (0..40)
        .map(|_| {
            let proxy = proxy.clone();
            tokio::spawn(async move { call(&proxy, None).await })
        })
        .collect();
    for i in 0..20 {
        let to = if i % 2 == 0 {
            "sonnet-global"
        } else {
            "sonnet-west"
        };
        proxy.reload(reload_config(sim.addr, to)).expect("reload");
        tokio::task::yield_now().await;
    }
    for call in calls {
        let r = call.await.expect("task");
        assert_eq!(r.status, 200, "{:?}", r.body);
        let pool = r.header("x-tokengate-pool");
        assert!(
            matches!(pool, Some("sonnet-global" | "sonnet-west")),
            "{pool:?}"
        );
    }
    let stats = sim.simulator.stats();
    assert_eq!(stats.calls(), 42);
    assert_eq!(stats.throttled(), 0);
    release(&proxy, held).await;
    assert_ledger_zero(&proxy).await;
}

/// An ARN names its Region: a call by a model's us-west-2 ARN draws on the pool that lists that
/// ARN (in us-west-2) and goes there, never on the pool of the plain id in us-east-1; an ARN of
/// a Region no pool covers is a model no pool meters.
#[tokio::test]
async fn an_arn_draws_on_the_pool_of_its_own_region() {
    const HAIKU_EU: &str =
        "arn:aws:bedrock:eu-west-1::foundation-model/anthropic.claude-3-haiku-20240307-v1:0";
    let pool = |name: &str, model: &str, region: &str| {
        format!(
            "[[pools]]\nname = \"{name}\"\nmodels = [\"{model}\"]\nregion = \"{region}\"\n\
             tokens_per_minute = 100000\nmax_concurrency = 4\noutput_burndown = 1\ndefault_max_tokens = 500\n"
        )
    };
    let pools = [
        pool("haiku", HAIKU, "us-east-1"),
        pool("haiku-west", HAIKU_WEST, "us-west-2"),
    ]
    .join("\n");
    let stack = Stack::start(SIM, &pools, "").await;
    converse(&stack.client(), HAIKU_WEST).await;
    converse(&stack.client(), HAIKU).await;
    converse(&stack.client(), HAIKU_WEST).await;
    let regions = stack.sim.simulator.stats().regions;
    let calls = |r: &str| regions.get(r).map_or(0, |s| s.calls.requests);
    assert_eq!(
        (calls("us-west-2"), calls("us-east-1")),
        (2, 1),
        "{regions:?}"
    );
    let admitted = |pool: &str| {
        metric(
            &stack.proxy,
            "tokengate_requests_total",
            &[
                ("pool", pool),
                ("api", "bedrock"),
                ("operation", "Converse"),
                ("outcome", "admitted"),
            ],
        )
    };
    assert_eq!((admitted("haiku-west"), admitted("haiku")), (2.0, 1.0));
    let r = raw_request(
        stack.proxy.addr,
        "POST",
        &model_path(HAIKU_EU, "converse"),
        converse_body("hi", Some(10)),
        false,
    )
    .await;
    assert_eq!((r.status, r.error_type()), (400, "ValidationException"));
    assert!(r.message().contains("no quota pool"), "{}", r.message());
    stack.assert_ledger_zero().await;
}
