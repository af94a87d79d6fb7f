//! Sending spans to an OpenTelemetry collector over OTLP: HTTP/protobuf (`POST /v1/traces`) or
//! gRPC (`TraceService/Export`), in batches.
//!
//! The request path only hands a finished request's spans to a bounded queue
//! (`[tracing] max_queued_spans`); a task sends what it holds every `export_interval_ms`, or at
//! once when a batch is full. Failure semantics: a full queue drops the request's spans, and a
//! failed export drops its batch (no retries: a collector that is down must not make the proxy
//! hold memory); both are counted in `tokengate_trace_spans_total{result}` and logged at most
//! every 30 seconds. At shutdown the queue is flushed, within a few seconds.

use std::{
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use opentelemetry_proto::tonic::{
    collector::trace::v1::{ExportTraceServiceRequest, trace_service_client::TraceServiceClient},
    common::v1::{AnyValue, InstrumentationScope, KeyValue, any_value},
    resource::v1::Resource,
    trace::v1::{ResourceSpans, ScopeSpans, Span},
};
use prometheus::IntCounter;
use prost::Message;
use tokio::{
    sync::{Mutex, mpsc},
    task::JoinHandle,
};
use tokio_util::sync::CancellationToken;

use crate::{
    config::{OtlpProtocol, TracingConfig},
    metrics::Metrics,
};

/// Spans sent in one export at most.
const MAX_BATCH: usize = 512;
/// The longest one export may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long shutdown waits for the last spans to go.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);
/// Export failures are logged at most this often.
const LOG_EVERY: Duration = Duration::from_secs(30);

/// Why an export failed.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("cannot reach the collector at {endpoint}: {message}")]
    Transport { endpoint: String, message: String },
    #[error("the collector at {endpoint} answered {status}: {body}")]
    Refused {
        endpoint: String,
        status: String,
        body: String,
    },
    #[error("the collector at {endpoint} did not answer within {EXPORT_TIMEOUT:?}")]
    Timeout { endpoint: String },
}

/// `tokengate_trace_spans_total{result}`.
#[derive(Debug, Clone)]
struct Counts {
    exported: IntCounter,
    dropped: IntCounter,
    failed: IntCounter,
}

/// The request path's end of the exporter.
#[derive(Debug)]
pub struct Exporter {
    queue: mpsc::Sender<Span>,
    counts: Counts,
    stop: CancellationToken,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl Exporter {
    /// Starts the export task (on the current tokio runtime).
    pub fn start(config: &TracingConfig, metrics: &Metrics) -> Result<Exporter, ExportError> {
        let counts = Counts {
            exported: metrics.trace_spans.with_label_values(&["exported"]),
            dropped: metrics.trace_spans.with_label_values(&["dropped"]),
            failed: metrics.trace_spans.with_label_values(&["failed"]),
        };
        let (queue, spans) = mpsc::channel(config.max_queued_spans);
        let stop = CancellationToken::new();
        let sender = Sender::new(config)?;
        let batcher = Batcher {
            spans,
            sender,
            resource: resource(&config.service_name),
            interval: config.export_interval,
            counts: counts.clone(),
            stop: stop.clone(),
            last_logged: None,
        };
        Ok(Exporter {
            queue,
            counts,
            stop,
            task: Mutex::new(Some(tokio::spawn(batcher.run()))),
        })
    }

    /// Queues a request's spans; drops (and counts) what does not fit.
    pub fn export(&self, spans: Vec<Span>) {
        for span in spans {
            if self.queue.try_send(span).is_err() {
                self.counts.dropped.inc();
            }
        }
    }

    /// Sends what is queued (within a few seconds) and stops.
    pub async fn shutdown(&self) {
        self.stop.cancel();
        if let Some(task) = self.task.lock().await.take() {
            let _ = tokio::time::timeout(FLUSH_TIMEOUT, task).await;
        }
    }
}

/// The export task: collects spans into batches and sends them.
struct Batcher {
    spans: mpsc::Receiver<Span>,
    sender: Sender,
    resource: Resource,
    interval: Duration,
    counts: Counts,
    stop: CancellationToken,
    last_logged: Option<tokio::time::Instant>,
}

impl Batcher {
    async fn run(mut self) {
        loop {
            let first = tokio::select! {
                span = self.spans.recv() => span,
                () = self.stop.cancelled() => None,
            };
            let Some(first) = first else { break };
            let mut batch = vec![first];
            let deadline = tokio::time::sleep(self.interval);
            tokio::pin!(deadline);
            while batch.len() < MAX_BATCH {
                tokio::select! {
                    span = self.spans.recv() => match span {
                        Some(span) => batch.push(span),
                        None => break,
                    },
                    () = &mut deadline => break,
                    () = self.stop.cancelled() => break,
                }
            }
            self.send(batch).await;
        }
        // Shutting down: what is still queued goes now.
        let mut rest = Vec::new();
        while let Ok(span) = self.spans.try_recv() {
            rest.push(span);
            if rest.len() == MAX_BATCH {
                self.send(std::mem::take(&mut rest)).await;
            }
        }
        if !rest.is_empty() {
            self.send(rest).await;
        }
    }

    async fn send(&mut self, spans: Vec<Span>) {
        let n = spans.len() as u64;
        let request = ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                resource: Some(self.resource.clone()),
                scope_spans: vec![ScopeSpans {
                    scope: Some(InstrumentationScope {
                        name: "tokengate".into(),
                        version: env!("CARGO_PKG_VERSION").into(),
                        ..InstrumentationScope::default()
                    }),
                    spans,
                    schema_url: String::new(),
                }],
                schema_url: String::new(),
            }],
        };
        match self.sender.send(request).await {
            Ok(()) => self.counts.exported.inc_by(n),
            Err(e) => {
                self.counts.failed.inc_by(n);
                let now = tokio::time::Instant::now();
                if self.last_logged.is_none_or(|t| now - t >= LOG_EVERY) {
                    self.last_logged = Some(now);
                    tracing::warn!(error = %e, spans = n, "trace export failed; these spans are dropped");
                }
            }
        }
    }
}

/// The transport to the collector.
enum Sender {
    Http {
        client: Box<Client<HttpsConnector<HttpConnector>, Full<Bytes>>>,
        endpoint: http::Uri,
    },
    Grpc {
        client: TraceServiceClient<tonic::transport::Channel>,
        endpoint: String,
    },
}

impl Sender {
    fn new(config: &TracingConfig) -> Result<Sender, ExportError> {
        let endpoint = config.endpoint.clone();
        Ok(match config.protocol {
            OtlpProtocol::HttpProtobuf => {
                let mut http = HttpConnector::new();
                http.enforce_http(false);
                http.set_connect_timeout(Some(EXPORT_TIMEOUT));
                let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
                let connector = hyper_rustls::HttpsConnectorBuilder::new()
                    .with_provider_and_webpki_roots(provider)
                    .map_err(|e| ExportError::Transport {
                        endpoint: endpoint.to_string(),
                        message: e.to_string(),
                    })?
                    .https_or_http()
                    .enable_http1()
                    .wrap_connector(http);
                let client = Client::builder(TokioExecutor::new()).build(connector);
                Sender::Http {
                    client: Box::new(client),
                    endpoint,
                }
            }
            OtlpProtocol::Grpc => {
                let shown = endpoint.to_string();
                let channel = tonic::transport::Endpoint::from(endpoint)
                    .timeout(EXPORT_TIMEOUT)
                    .connect_timeout(EXPORT_TIMEOUT);
                let channel = match channel
                    .clone()
                    .tls_config(tonic::transport::ClientTlsConfig::new().with_webpki_roots())
                {
                    Ok(tls) if shown.starts_with("https") => tls,
                    _ => channel,
                };
                Sender::Grpc {
                    client: TraceServiceClient::new(channel.connect_lazy()),
                    endpoint: shown,
                }
            }
        })
    }

    async fn send(&mut self, request: ExportTraceServiceRequest) -> Result<(), ExportError> {
        match self {
            Sender::Http { client, endpoint } => {
                let shown = endpoint.to_string();
                let post = http::Request::post(endpoint.clone())
                    .header(http::header::CONTENT_TYPE, "application/x-protobuf")
                    .body(Full::new(Bytes::from(request.encode_to_vec())))
                    .map_err(|e| ExportError::Transport {
                        endpoint: shown.clone(),
                        message: e.to_string(),
                    })?;
                let answer = tokio::time::timeout(EXPORT_TIMEOUT, async {
                    let response = client.request(post).await?;
                    let status = response.status();
                    let body = response.into_body().collect().await?.to_bytes();
                    Ok::<_, Box<dyn std::error::Error + Send + Sync>>((status, body))
                });
                match answer.await {
                    Err(_) => Err(ExportError::Timeout { endpoint: shown }),
                    Ok(Err(e)) => Err(ExportError::Transport {
                        endpoint: shown,
                        message: e.to_string(),
                    }),
                    Ok(Ok((status, _))) if status.is_success() => Ok(()),
                    Ok(Ok((status, body))) => Err(ExportError::Refused {
                        endpoint: shown,
                        status: status.to_string(),
                        body: String::from_utf8_lossy(&body[..body.len().min(256)]).into(),
                    }),
                }
            }
            Sender::Grpc { client, endpoint } => match client.export(request).await {
                Ok(_) => Ok(()),
                Err(status) if status.code() == tonic::Code::DeadlineExceeded => {
                    Err(ExportError::Timeout {
                        endpoint: endpoint.clone(),
                    })
                }
                Err(status) => Err(ExportError::Refused {
                    endpoint: endpoint.clone(),
                    status: format!("{:?}", status.code()),
                    body: status.message().to_string(),
                }),
            },
        }
    }
}

/// The resource every span belongs to: this process.
fn resource(service_name: &str) -> Resource {
    let started = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let instance = format!("{}-{started:x}", std::process::id());
    let attribute = |key: &str, value: String| KeyValue {
        key: key.into(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(value)),
        }),
        ..KeyValue::default()
    };
    Resource {
        attributes: vec![
            attribute("service.name", service_name.into()),
            attribute("service.version", env!("CARGO_PKG_VERSION").into()),
            attribute("service.instance.id", instance),
            attribute("telemetry.sdk.name", "tokengate".into()),
            attribute("telemetry.sdk.language", "rust".into()),
        ],
        ..Resource::default()
    }
}
