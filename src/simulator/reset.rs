//! The `reset` fault: a connection that closes before any response byte.
//!
//! A handler cannot close its own connection, so it answers with a [`ResetMarker`] response, and
//! [`Resetting`] (around the simulator's router) turns that into a service error, on which hyper
//! closes the connection without writing anything (HTTP/2: resets the stream).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::Router;
use axum::response::{IntoResponse, Response};
use tower::ServiceExt;

/// Marks a response that must not be sent: its connection closes instead.
#[derive(Debug, Clone, Copy)]
struct ResetMarker;

/// The response of a call that gets the `reset` fault.
pub(super) fn response() -> Response {
    let mut response = ().into_response();
    response.extensions_mut().insert(ResetMarker);
    response
}

/// Why a connection closed without an answer.
#[derive(Debug, thiserror::Error)]
#[error("simulated connection reset")]
pub struct SimulatedReset;

/// The simulator's router, with marked responses turned into closed connections.
#[derive(Clone, Debug)]
pub struct Resetting(pub Router);

impl<B> tower::Service<http::Request<B>> for Resetting
where
    Router: tower::Service<http::Request<B>, Response = Response, Error = Infallible>,
    <Router as tower::Service<http::Request<B>>>::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = Response;
    type Error = SimulatedReset;
    type Future = Pin<Box<dyn Future<Output = Result<Response, SimulatedReset>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let call = self.0.clone().oneshot(request);
        Box::pin(async move {
            let response = match call.await {
                Ok(r) => r,
                Err(never) => match never {},
            };
            if response.extensions().get::<ResetMarker>().is_some() {
                Err(SimulatedReset)
            } else {
                Ok(response)
            }
        })
    }
}
