//! The endpoint's callers: `aws-sdk-sagemakerruntime` clients as a team builds them (standard
//! retry mode, one retry partition per team), sending TGI-style bodies with InvokeEndpoint or
//! InvokeEndpointWithResponseStream, each call turned into a [`Record`].

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use aws_sdk_sagemakerruntime::Client;
use aws_sdk_sagemakerruntime::config::retry::{RetryConfig, RetryPartition};
use aws_sdk_sagemakerruntime::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_sagemakerruntime::primitives::Blob;
use aws_sdk_sagemakerruntime::types::ResponseStream;

use super::scenario::ENDPOINT;
use crate::arrivals::{Call, Op};
use crate::client::{AttemptCounter, Record, classify};

/// A sagemaker-runtime client for `addr` signing with `key`.
pub fn client(addr: SocketAddr, attempts: u32, partition: &str, key: (String, String)) -> Client {
    let config = aws_sdk_sagemakerruntime::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .endpoint_url(format!("http://{addr}"))
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new(key.0, key.1, None, None, "loadgen"))
        .retry_config(RetryConfig::standard().with_max_attempts(attempts.max(1)))
        .retry_partition(RetryPartition::new(partition.to_string()))
        .build();
    Client::from_conf(config)
}

/// How a call ended: its outcome, first bytes and tokens generated.
struct Done {
    outcome: String,
    ttft: Option<Instant>,
    generated: u64,
}

impl Done {
    fn new(outcome: impl Into<String>) -> Done {
        Done {
            outcome: outcome.into(),
            ttft: None,
            generated: 0,
        }
    }
}

/// Sends `call` (a Converse-shaped call from the schedule: Converse means InvokeEndpoint,
/// ConverseStream the stream) and returns its record.
pub async fn execute(client: &Client, call: &Call, team: &str, epoch: Instant) -> Record {
    let counter = AttemptCounter::default();
    let body = serde_json::json!({
        "inputs": call.prompt,
        "parameters": {"max_new_tokens": call.max_tokens.unwrap_or(1024), "details": true},
    })
    .to_string();
    let start = Instant::now();
    let (op, done) = match call.op {
        Op::ConverseStream => (
            Op::InvokeEndpointWithResponseStream,
            streamed(client, body, counter.clone()).await,
        ),
        _ => (
            Op::InvokeEndpoint,
            whole(client, body, counter.clone()).await,
        ),
    };
    let ms = |t: Instant| t.duration_since(epoch).as_secs_f64() * 1000.0;
    Record {
        team: team.to_string(),
        op,
        start_ms: ms(start),
        end_ms: ms(Instant::now()),
        ttft_ms: done
            .ttft
            .map(|t| t.duration_since(start).as_secs_f64() * 1000.0),
        attempts: counter.0.load(Relaxed),
        max_tokens: call.max_tokens,
        input_tokens: 0,
        output_tokens: done.generated,
        charged: if done.outcome == "ok" {
            done.generated
        } else {
            0
        },
        // Its payload names no answer length: nothing to compare the output with.
        cut_short: false,
        outcome: done.outcome,
    }
}

async fn whole(client: &Client, body: String, counter: AttemptCounter) -> Done {
    let sent = client
        .invoke_endpoint()
        .endpoint_name(ENDPOINT)
        .content_type("application/json")
        .body(Blob::new(body))
        .customize()
        .interceptor(counter)
        .send()
        .await;
    match sent {
        Ok(out) => {
            let text = out
                .body()
                .map(|b| String::from_utf8_lossy(b.as_ref()).into_owned());
            Done {
                generated: generated_tokens(&text.unwrap_or_default()),
                ..Done::new("ok")
            }
        }
        Err(e) => Done::new(classify(&e)),
    }
}

async fn streamed(client: &Client, body: String, counter: AttemptCounter) -> Done {
    let sent = client
        .invoke_endpoint_with_response_stream()
        .endpoint_name(ENDPOINT)
        .content_type("application/json")
        .body(Blob::new(body))
        .customize()
        .interceptor(counter)
        .send()
        .await;
    let mut out = match sent {
        Ok(out) => out,
        Err(e) => return Done::new(classify(&e)),
    };
    let mut done = Done::new("ok");
    let mut text = String::new();
    loop {
        match out.body.recv().await {
            Ok(Some(ResponseStream::PayloadPart(part))) => {
                done.ttft.get_or_insert_with(Instant::now);
                let bytes = part
                    .bytes()
                    .map(|b| b.as_ref().to_vec())
                    .unwrap_or_default();
                text.push_str(&String::from_utf8_lossy(&bytes));
            }
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(e) => {
                done.outcome = format!("stream_{}", classify(&e));
                break;
            }
        }
    }
    done.generated = generated_tokens(&text);
    done
}

/// TGI's `details.generated_tokens` in an answer (the last one of a stream).
fn generated_tokens(text: &str) -> u64 {
    const KEY: &str = "\"generated_tokens\":";
    text.rfind(KEY)
        .map(|i| &text[i + KEY.len()..])
        .map(|rest| {
            rest.trim_start()
                .chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
        })
        .and_then(|digits| digits.parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn generated_tokens_of_whole_and_streamed_answers() {
        assert_eq!(
            super::generated_tokens(r#"[{"details":{"generated_tokens": 42}}]"#),
            42
        );
        let stream = "data:{\"details\":null}\n\ndata:{\"details\":{\"generated_tokens\":7}}\n\n";
        assert_eq!(super::generated_tokens(stream), 7);
        assert_eq!(super::generated_tokens("nothing"), 0);
    }
}
