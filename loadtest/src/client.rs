//! The caller: an `aws-sdk-bedrockruntime` client with the SDK's standard retry mode, and one
//! call turned into a [`Record`] (outcome, attempts, latency, time to first token, usage).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::time::Instant;

use aws_sdk_bedrockruntime::Client;
use aws_sdk_bedrockruntime::config::interceptors::BeforeTransmitInterceptorContextRef;
use aws_sdk_bedrockruntime::config::retry::{RetryConfig, RetryPartition};
use aws_sdk_bedrockruntime::config::{
    BehaviorVersion, ConfigBag, Credentials, Intercept, Region, RuntimeComponents,
    StalledStreamProtectionConfig,
};
use aws_sdk_bedrockruntime::error::{BoxError, ProvideErrorMetadata, SdkError};
use aws_sdk_bedrockruntime::primitives::Blob;
use aws_sdk_bedrockruntime::types::{
    ContentBlock, ConversationRole, ConverseStreamOutput, InferenceConfiguration, Message,
    TokenUsage,
};
use serde::Serialize;

use crate::arrivals::{Call, Op};
use crate::routes::RouteKey;

/// One logical call as the application saw it (retries included).
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    pub team: String,
    pub op: Op,
    /// Milliseconds from the start of the run.
    pub start_ms: f64,
    pub end_ms: f64,
    /// Streams only: the first content delta.
    pub ttft_ms: Option<f64>,
    /// `ok`, `throttled`, `unavailable`, `validation`, `stream_error`, `hung_up` (the caller
    /// dropped the stream on purpose), `unfinished`, ...
    pub outcome: String,
    pub attempts: u32,
    pub max_tokens: Option<u32>,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// `input + output x burndown`, Bedrock's end-of-request charge (0 unless ok).
    pub charged: u64,
    /// Completed with fewer output tokens than its answer's length and than its own maxTokens:
    /// cut short by a cap the caller did not set (the proxy's adaptive maxTokens).
    pub cut_short: bool,
}

/// An SDK client for `addr`, as an application team would build it: standard retry mode with
/// `attempts` attempts, its own retry partition (one application process per team), signing
/// with its route's `key` (any key when the proxy does not check signatures).
pub fn sdk_client(
    addr: SocketAddr,
    attempts: u32,
    partition: &str,
    key: Option<&RouteKey>,
) -> Client {
    let (id, secret) = key.map_or(("AKIALOADGEN", "loadgen"), |k| {
        (k.access_key_id.as_str(), k.secret_access_key.as_str())
    });
    let config = aws_sdk_bedrockruntime::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .endpoint_url(format!("http://{addr}"))
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new(id, secret, None, None, "loadgen"))
        .retry_config(RetryConfig::standard().with_max_attempts(attempts.max(1)))
        .retry_partition(RetryPartition::new(partition.to_string()))
        // Long stalls are part of the memory test; the default guard would cut them.
        .stalled_stream_protection(StalledStreamProtectionConfig::disabled())
        .build();
    Client::from_conf(config)
}

/// Counts the SDK's attempts of one operation (any AWS SDK's: the interceptor trait is the
/// smithy runtime's).
#[derive(Debug, Clone, Default)]
pub struct AttemptCounter(pub Arc<AtomicU32>);

impl Intercept for AttemptCounter {
    fn name(&self) -> &'static str {
        "AttemptCounter"
    }

    fn read_before_attempt(
        &self,
        _context: &BeforeTransmitInterceptorContextRef<'_>,
        _components: &RuntimeComponents,
        _cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        self.0.fetch_add(1, Relaxed);
        Ok(())
    }
}

/// What a finished call reports back.
struct Done {
    outcome: String,
    ttft: Option<Instant>,
    usage: (u64, u64),
}

impl Done {
    fn failed(outcome: String) -> Done {
        Done {
            outcome,
            ttft: None,
            usage: (0, 0),
        }
    }
}

/// Sends `call` with `client` and returns its record; `epoch` is the run's start.
pub async fn execute(
    client: &Client,
    model: &str,
    call: &Call,
    team: &str,
    burndown: u64,
    epoch: Instant,
) -> Record {
    let counter = AttemptCounter::default();
    let start = Instant::now();
    let done = match call.op {
        Op::Converse => converse(client, model, call, counter.clone()).await,
        Op::ConverseStream => converse_stream(client, model, call, counter.clone()).await,
        Op::Invoke => invoke(client, model, call, counter.clone()).await,
        // The endpoint scenario sends these with its sagemaker-runtime client (`endpoint`).
        Op::InvokeEndpoint | Op::InvokeEndpointWithResponseStream => {
            Done::failed("not_a_bedrock_call".into())
        }
    };
    let end = Instant::now();
    let ms = |t: Instant| t.duration_since(epoch).as_secs_f64() * 1000.0;
    let ok = done.outcome == "ok";
    Record {
        team: team.to_string(),
        op: call.op,
        start_ms: ms(start),
        end_ms: ms(end),
        ttft_ms: done
            .ttft
            .map(|t| t.duration_since(start).as_secs_f64() * 1000.0),
        outcome: done.outcome,
        attempts: counter.0.load(Relaxed),
        max_tokens: call.max_tokens,
        input_tokens: done.usage.0,
        output_tokens: done.usage.1,
        charged: if ok {
            done.usage.0 + done.usage.1 * burndown
        } else {
            0
        },
        cut_short: ok && done.usage.1 < own_limit(call),
    }
}

/// The output a call would end at on its own: its answer's length, or its own maxTokens when
/// lower.
fn own_limit(call: &Call) -> u64 {
    let length = u64::from(call.output_tokens);
    call.max_tokens
        .map_or(length, |max| length.min(u64::from(max)))
}

fn message(text: &str) -> Message {
    Message::builder()
        .role(ConversationRole::User)
        .content(ContentBlock::Text(text.to_string()))
        .build()
        .unwrap_or_else(|_| unreachable!("role and content are set"))
}

fn inference(call: &Call) -> Option<InferenceConfiguration> {
    call.max_tokens.map(|n| {
        InferenceConfiguration::builder()
            .max_tokens(n as i32)
            .build()
    })
}

fn usage_of(u: Option<&TokenUsage>) -> (u64, u64) {
    u.map_or((0, 0), |u| {
        (
            u.input_tokens().max(0) as u64,
            u.output_tokens().max(0) as u64,
        )
    })
}

async fn converse(client: &Client, model: &str, call: &Call, c: AttemptCounter) -> Done {
    let sent = client
        .converse()
        .model_id(model)
        .messages(message(&call.prompt))
        .set_inference_config(inference(call))
        .customize()
        .interceptor(c)
        .send()
        .await;
    match sent {
        Ok(out) => Done {
            outcome: "ok".into(),
            ttft: None,
            usage: usage_of(out.usage()),
        },
        Err(e) => Done::failed(classify(&e)),
    }
}

async fn converse_stream(client: &Client, model: &str, call: &Call, c: AttemptCounter) -> Done {
    let sent = client
        .converse_stream()
        .model_id(model)
        .messages(message(&call.prompt))
        .set_inference_config(inference(call))
        .customize()
        .interceptor(c)
        .send()
        .await;
    let mut out = match sent {
        Ok(out) => out,
        Err(e) => return Done::failed(classify(&e)),
    };
    let mut done = Done::failed("stream_ended_without_usage".into());
    loop {
        match out.stream.recv().await {
            Ok(Some(ConverseStreamOutput::ContentBlockDelta(_))) => {
                done.ttft.get_or_insert_with(Instant::now);
                if call.hang_up {
                    // The caller walks away mid-stream: dropping `out` closes the connection.
                    done.outcome = "hung_up".into();
                    return done;
                }
            }
            Ok(Some(ConverseStreamOutput::Metadata(m))) => {
                done.usage = usage_of(m.usage());
                done.outcome = "ok".into();
            }
            Ok(Some(_)) => {}
            Ok(None) => return done,
            Err(e) => {
                done.outcome = format!("stream_{}", classify(&e));
                return done;
            }
        }
    }
}

async fn invoke(client: &Client, model: &str, call: &Call, c: AttemptCounter) -> Done {
    let mut body = serde_json::json!({
        "anthropic_version": "bedrock-2023-05-31",
        "messages": [{"role": "user", "content": call.prompt}],
    });
    // Anthropic's native API requires max_tokens; "none" means the model's maximum here.
    body["max_tokens"] = call.max_tokens.unwrap_or(64_000).into();
    let sent = client
        .invoke_model()
        .model_id(model)
        .content_type("application/json")
        .body(Blob::new(body.to_string()))
        .customize()
        .interceptor(c)
        .send()
        .await;
    match sent {
        Ok(out) => {
            let v: serde_json::Value =
                serde_json::from_slice(out.body().as_ref()).unwrap_or_default();
            let n = |k: &str| v["usage"][k].as_u64().unwrap_or(0);
            Done {
                outcome: "ok".into(),
                ttft: None,
                usage: (n("input_tokens"), n("output_tokens")),
            }
        }
        Err(e) => Done::failed(classify(&e)),
    }
}

/// A short, bounded name for an SDK error.
pub fn classify<E: ProvideErrorMetadata + std::fmt::Debug, R>(e: &SdkError<E, R>) -> String {
    match e.code() {
        Some("ThrottlingException") => "throttled".into(),
        Some("ServiceUnavailableException") => "unavailable".into(),
        Some("ValidationException") => "validation".into(),
        Some(code) => code.trim_end_matches("Exception").to_ascii_lowercase(),
        None => match e {
            // Event-stream exceptions carry no error code: name them by their variant
            // (`ModelStreamErrorException(...)` gives `modelstreamerror`).
            SdkError::ServiceError(se) => {
                let debug = format!("{:?}", se.err());
                let variant = debug.split(['(', ' ', '{']).next().unwrap_or_default();
                match variant.trim_end_matches("Exception").to_ascii_lowercase() {
                    v if v.is_empty() || v.len() > 40 => "other".into(),
                    v => v,
                }
            }
            SdkError::TimeoutError(_) => "timeout".into(),
            SdkError::DispatchFailure(_) => "dispatch_failure".into(),
            SdkError::ResponseError(_) => "response_error".into(),
            _ => "other".into(),
        },
    }
}
