//! Local capacity leases end to end on a burndown pool with a stream in flight: every call then
//! carries a hold-back (the stream's expected excess, `Pool::pending_excess`), and the slice still
//! decides it when what is left of it covers the call and the hold-back. Redis is real (its own
//! `redis-server`, see `common/redis_server.rs`); the callers are the Rust SDK.

use std::time::Duration;

use crate::common::{redis_server::RedisServer, *};

/// While a stream's output costs more than its reservation (burndown 5), 40 Converse calls each
/// carry a hold-back; Redis sees a handful of script calls for them (slices taken and given back),
/// where without leases, or with leases that leave hold-back to Redis, it sees two per call
/// (admit and settle). The ledger ends at zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burndown_pool_with_a_stream_in_flight_admits_from_the_slice() {
    const CALLS: usize = 40;
    let Some(server) = RedisServer::start().await else {
        return;
    };
    // 20 output tokens a second: the stream's 400 take 20 s, its excess shows after 80 (4 s).
    let sim = "time_to_first_token_ms = 0\ntokens_per_second = 20\n";
    // `[ledger.local_leases]` with its defaults.
    let ledger = format!(
        "[ledger]\nbackend = \"redis\"\nurl = \"{}\"\n\n[ledger.local_leases]\n",
        server.url()
    );
    let stack = Stack::start(sim, &sonnet_pool(1_000_000, 32), &ledger).await;
    let pending =
        || async { stack.proxy.admission().pool_views().await[0].pending_burndown_excess };
    let client = stack.client();
    let stream = client
        .converse_stream()
        .model_id(SONNET_US)
        .messages(user_message("[sim:output=400] a long answer"))
        .inference_config(max_tokens(400))
        .send()
        .await
        .expect("the stream starts");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while pending().await == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the stream's output never cost more than its reservation"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let monitor = server.monitor().await;
    for _ in 0..CALLS {
        client
            .converse()
            .model_id(SONNET_US)
            .messages(user_message("[sim:output=1] hi"))
            .inference_config(max_tokens(100))
            .send()
            .await
            .expect("admitted");
    }
    let sent = monitor.stop().await;
    // The stream's excess only grows until it settles, once: still held back now, it was for
    // every call.
    assert!(
        pending().await > 0,
        "the stream settled before the calls were done (a machine too slow for this test)"
    );
    let scripts = sent.iter().filter(|c| *c == "evalsha").count();
    println!("{scripts} script calls for {CALLS} calls with a hold-back");
    assert!(
        scripts <= CALLS / 4,
        "{scripts} script calls for {CALLS} calls with a hold-back: {sent:?}"
    );
    drop(stream);
    stack.assert_ledger_zero().await;
}
