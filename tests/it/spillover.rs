//! Pools in several Regions and spill chains between them (issue #18): each pool's requests are
//! signed for its Region (the simulator tells Regions by the SigV4 scope), and a request its home
//! pool cannot admit now runs in the first pool of the chain with room.

use crate::common::*;

const SIM: &str = "time_to_first_token_ms = 0\ntokens_per_second = 0\ndefault_tokens_per_minute = 10000000\n\
    verify_sigv4 = { access_key_id = \"AKIATOKENGATEPROXY01\", secret_access_key = \"proxy-secret-key\" }\n";

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
