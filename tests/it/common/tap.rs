//! A wire tap between the proxy and the simulator: records every request exactly as it arrives
//! (method, path, headers, body) and relays it to the simulator unchanged, returning the
//! simulator's answer (plus any headers a test asks it to add). What the proxy sends upstream can
//! then be checked byte for byte, while the answers stay the simulator's own.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use axum::{
    Router,
    body::Body,
    extract::{Request, State},
    response::Response,
};
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};
use http_body_util::Full;
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};

/// One request as the tap received it.
#[derive(Debug, Clone)]
pub struct Seen {
    /// The request's path and query, as sent.
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

struct Inner {
    upstream: SocketAddr,
    client: Client<HttpConnector, Full<Bytes>>,
    seen: Mutex<Vec<Seen>>,
    /// Added to every response on its way back.
    response_headers: HeaderMap,
}

/// A running tap.
pub struct Tap {
    pub addr: SocketAddr,
    inner: Arc<Inner>,
}

impl Tap {
    /// A tap in front of `upstream` that adds `response_headers` to every answer.
    pub async fn start(upstream: SocketAddr, response_headers: &[(&str, &str)]) -> Tap {
        let mut extra = HeaderMap::new();
        for (name, value) in response_headers {
            extra.append(
                HeaderName::from_bytes(name.as_bytes()).expect("header name"),
                HeaderValue::from_str(value).expect("header value"),
            );
        }
        let inner = Arc::new(Inner {
            upstream,
            client: Client::builder(TokioExecutor::new()).build_http(),
            seen: Mutex::new(Vec::new()),
            response_headers: extra,
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let app = Router::new().fallback(relay).with_state(inner.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        Tap { addr, inner }
    }

    /// Every request relayed so far, in order.
    pub fn seen(&self) -> Vec<Seen> {
        self.inner.seen.lock().expect("lock").clone()
    }
}

async fn relay(State(tap): State<Arc<Inner>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX)
        .await
        .expect("request body");
    let path_and_query = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    tap.seen.lock().expect("lock").push(Seen {
        path: path_and_query.clone(),
        headers: parts.headers.clone(),
        body: body.clone(),
    });
    let mut out = http::Request::builder()
        .method(parts.method)
        .uri(format!("http://{}{path_and_query}", tap.upstream));
    for (name, value) in &parts.headers {
        out = out.header(name, value);
    }
    let response = tap
        .client
        .request(out.body(Full::new(body)).expect("request"))
        .await
        .expect("the simulator answers");
    let (mut head, incoming) = response.into_parts();
    for (name, value) in &tap.response_headers {
        head.headers.append(name, value.clone());
    }
    Response::from_parts(head, Body::new(incoming))
}
