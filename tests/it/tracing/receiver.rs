//! The OTLP receivers of the tracing tests, decoding the official protobuf definitions
//! (`opentelemetry-proto`): an axum server for OTLP/HTTP, the collector's own generated gRPC
//! `TraceService`; and what the tests read of the spans they received.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{Router, body::Bytes, extract::State, routing::post};
use opentelemetry_proto::tonic::{
    collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
        trace_service_server::{TraceService, TraceServiceServer},
    },
    common::v1::{AnyValue, any_value::Value},
    trace::v1::{Span, span::SpanKind},
};
use prost::Message;
use tokio::net::TcpListener;

/// What a receiver got: every span, and the resources' `service.name`s.
#[derive(Clone, Default)]
pub struct Received {
    pub spans: Arc<Mutex<Vec<Span>>>,
    pub services: Arc<Mutex<Vec<String>>>,
}

impl Received {
    fn take(&self, request: ExportTraceServiceRequest) {
        for rs in request.resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.name")
                .and_then(|a| a.value.as_ref())
                .map(text);
            self.services
                .lock()
                .expect("lock")
                .push(service.unwrap_or_default());
            for ss in rs.scope_spans {
                self.spans.lock().expect("lock").extend(ss.spans);
            }
        }
    }

    /// Waits (bounded) for the first span that `pick` picks.
    pub async fn first(&self, pick: impl Fn(&Span) -> bool) -> Span {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(s) = self.spans.lock().expect("lock").iter().find(|s| pick(s)) {
                return s.clone();
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no such span arrived"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits (bounded) until `n` spans of trace `trace_id` arrived, and returns them.
    pub async fn trace(&self, trace_id: &[u8], n: usize) -> Vec<Span> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let spans: Vec<Span> = self
                .spans
                .lock()
                .expect("lock")
                .iter()
                .filter(|s| s.trace_id == trace_id)
                .cloned()
                .collect();
            if spans.len() >= n {
                assert_eq!(spans.len(), n, "more spans than expected: {spans:#?}");
                return spans;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{} of {n} spans of trace {} arrived",
                spans.len(),
                hex::encode(trace_id)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn text(v: &AnyValue) -> String {
    match &v.value {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        other => format!("{other:?}"),
    }
}

/// A span's attributes as text.
pub fn attributes(span: &Span) -> HashMap<String, String> {
    span.attributes
        .iter()
        .map(|a| {
            (
                a.key.clone(),
                a.value.as_ref().map(text).unwrap_or_default(),
            )
        })
        .collect()
}

pub fn one_of_kind(spans: &[Span], kind: SpanKind) -> Span {
    let found: Vec<_> = spans.iter().filter(|s| s.kind == kind as i32).collect();
    assert_eq!(found.len(), 1, "{kind:?} spans: {spans:#?}");
    found[0].clone()
}

/// `child` is a child of `parent`, within its time.
pub fn assert_child(child: &Span, parent: &Span) {
    assert_eq!(child.trace_id, parent.trace_id);
    assert_eq!(child.parent_span_id, parent.span_id, "{}", child.name);
    assert!(
        child.start_time_unix_nano >= parent.start_time_unix_nano
            && child.end_time_unix_nano <= parent.end_time_unix_nano
            && child.start_time_unix_nano <= child.end_time_unix_nano,
        "{} outside {}",
        child.name,
        parent.name
    );
}

/// An OTLP/HTTP receiver (`POST /v1/traces`, protobuf) on 127.0.0.1:0.
pub async fn http_receiver() -> (SocketAddr, Received) {
    async fn traces(State(r): State<Received>, body: Bytes) -> Vec<u8> {
        let request = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf body");
        r.take(request);
        ExportTraceServiceResponse::default().encode_to_vec()
    }
    let received = Received::default();
    let app = Router::new()
        .route("/v1/traces", post(traces))
        .with_state(received.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, received)
}

struct GrpcReceiver(Received);

#[tonic::async_trait]
impl TraceService for GrpcReceiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.take(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// The collector's gRPC `TraceService` on 127.0.0.1:0.
pub async fn grpc_receiver() -> (SocketAddr, Received) {
    let received = Received::default();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let service = TraceServiceServer::new(GrpcReceiver(received.clone()));
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    (addr, received)
}
