//! A closed-loop fleet of aws-sdk-bedrockruntime clients with a mix of short and long calls.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use aws_sdk_bedrockruntime::Client;
use rand::{Rng, SeedableRng, rngs::SmallRng};
use tokio::time::Instant;

use super::{max_tokens, sdk_client, user_message};

/// What the clients send.
#[derive(Debug, Clone)]
pub struct Mix {
    pub model: &'static str,
    /// Fraction of long calls.
    pub long_share: f64,
    pub short_max_tokens: i32,
    pub short_output: std::ops::Range<u32>,
    pub long_max_tokens: i32,
    pub long_output: std::ops::Range<u32>,
}

/// Claude Sonnet 4 through the `us.` profile: a quarter long summaries (maxTokens 4000), the
/// rest short answers (maxTokens 400).
pub const SONNET_MIXED: Mix = Mix {
    model: super::SONNET_US,
    long_share: 0.25,
    short_max_tokens: 400,
    short_output: 150..300,
    long_max_tokens: 4000,
    long_output: 1500..3500,
};

#[derive(Debug, Default)]
pub struct FleetResult {
    pub completed: u64,
    pub failed: u64,
    pub elapsed: Duration,
}

impl FleetResult {
    pub fn failure_rate(&self) -> f64 {
        self.failed as f64 / (self.completed + self.failed).max(1) as f64
    }
}

/// Runs `clients` closed-loop clients against `addr` for `duration` (each finishes its call in
/// progress), with the SDK's standard retry mode and 3 attempts.
pub async fn run(addr: SocketAddr, clients: u64, duration: Duration, mix: &Mix) -> FleetResult {
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|i| {
            let (ok, failed, mix) = (ok.clone(), failed.clone(), mix.clone());
            tokio::spawn(async move {
                let client = sdk_client(addr, 3);
                let mut rng = SmallRng::seed_from_u64(i);
                while start.elapsed() < duration {
                    let counter = if one_call(&client, &mut rng, &mix).await {
                        &ok
                    } else {
                        &failed
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("client task");
    }
    FleetResult {
        completed: ok.load(Ordering::Relaxed),
        failed: failed.load(Ordering::Relaxed),
        elapsed: start.elapsed(),
    }
}

/// One Converse or ConverseStream call, read to the end. True if it succeeded.
pub async fn one_call(client: &Client, rng: &mut SmallRng, mix: &Mix) -> bool {
    let long = rng.random_bool(mix.long_share);
    let (max, output) = if long {
        (
            mix.long_max_tokens,
            rng.random_range(mix.long_output.clone()),
        )
    } else {
        (
            mix.short_max_tokens,
            rng.random_range(mix.short_output.clone()),
        )
    };
    let prompt = format!(
        "[sim:output={output}] {}",
        "please summarise the incident report ".repeat(rng.random_range(2..20))
    );
    if rng.random_bool(0.5) {
        return client
            .converse()
            .model_id(mix.model)
            .messages(user_message(&prompt))
            .inference_config(max_tokens(max))
            .send()
            .await
            .is_ok();
    }
    let Ok(mut out) = client
        .converse_stream()
        .model_id(mix.model)
        .messages(user_message(&prompt))
        .inference_config(max_tokens(max))
        .send()
        .await
    else {
        return false;
    };
    loop {
        match out.stream.recv().await {
            Ok(Some(_)) => {}
            Ok(None) => return true,
            Err(_) => return false,
        }
    }
}
