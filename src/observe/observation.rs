//! [`Observation`]: one request's record, filled in as it goes through the pipeline and
//! consumed when its access-log line is written (and its spans, when traced, are built).

use std::sync::Arc;

use http::{HeaderMap, StatusCode};
use tokio::time::Instant;

use super::{Verdict, trace};
use crate::{
    admission::{Caller, Pool},
    bedrock::{Api, Operation, error::X_AMZN_REQUEST_ID},
};

/// One request's record, filled in as it goes, consumed when its line is written.
#[derive(Debug)]
pub struct Observation {
    pub(super) arrived: Instant,
    pub(super) operation: Option<Operation>,
    pub(super) model: Option<String>,
    pub(super) route: Option<Arc<str>>,
    /// The caller's SDK retried a call this proxy turned away.
    pub(super) retry: bool,
    pub(super) pool: Option<Arc<Pool>>,
    /// The home pool of a request that spilled to `pool`.
    pub(super) spilled_from: Option<Arc<str>>,
    /// The route's slot in the pool, once admitted.
    pub(super) route_slot: Option<usize>,
    pub(super) verdict: Option<Verdict>,
    pub(super) status: Option<u16>,
    /// Copied out of the response head: a `HeaderValue` would be a slice of the upstream
    /// connection's read buffer and keep all 8 KiB of it alive for as long as a stream lasts.
    pub(super) request_id: Option<Box<str>>,
    pub(super) admitted_at: Option<Instant>,
    pub(super) first_byte: Option<Instant>,
    pub(super) first_token: Option<Instant>,
    /// The request's trace, when it is traced.
    pub(super) trace: Option<Box<trace::RequestTrace>>,
}

impl Observation {
    /// A record for a request that arrived now.
    pub fn start() -> Observation {
        Observation {
            arrived: Instant::now(),
            operation: None,
            model: None,
            route: None,
            retry: false,
            pool: None,
            spilled_from: None,
            route_slot: None,
            verdict: None,
            status: None,
            request_id: None,
            admitted_at: None,
            first_byte: None,
            first_token: None,
            trace: None,
        }
    }

    /// Adds the W3C trace context to the headers going upstream: this request's trace when it
    /// is traced, else the caller's context as it came (`caller`'s headers; a SigV4 caller's only
    /// if it `signed` them, as every forwarded header).
    pub fn propagate_trace(&self, caller: &HeaderMap, signed: Option<&str>, out: &mut HeaderMap) {
        trace::propagate(self.trace.as_deref(), caller, signed, out);
    }

    pub fn target(&mut self, operation: Operation, model: Option<&str>) {
        self.operation = Some(operation);
        self.model = model.map(str::to_string);
    }

    /// Who is calling: the route the caller identified as, and whether this is a retry.
    pub fn caller(&mut self, caller: &Caller) {
        self.route = Some(caller.route.name.clone());
        self.retry = caller.retry;
    }

    /// The request was answered before admission decided (bad path, credentials or body).
    pub fn refused(&mut self, verdict: Verdict) {
        self.verdict = Some(verdict);
    }

    /// The answer the client gets: its status and request id.
    pub fn answered(&mut self, status: StatusCode, headers: &HeaderMap) {
        self.status = Some(status.as_u16());
        if let Some(id) = headers.get(X_AMZN_REQUEST_ID) {
            self.request_id = id.to_str().ok().map(Box::from);
        }
    }

    pub fn pool(&self) -> Option<&Arc<Pool>> {
        self.pool.as_ref()
    }

    pub(super) fn pool_name(&self) -> Option<&str> {
        self.pool.as_ref().map(|p| &*p.name)
    }

    pub(super) fn request_id(&self) -> Option<&str> {
        self.request_id.as_deref()
    }

    pub(super) fn operation_label(&self) -> &'static str {
        self.operation.map_or("unknown", Operation::name)
    }

    /// The `api` label: the operation's family (`bedrock` for an unknown path).
    pub(super) fn api_label(&self) -> &'static str {
        self.operation.map_or(Api::Bedrock, Operation::api).label()
    }
}
