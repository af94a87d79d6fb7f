//! Injected faults: 503s, 500s and resets take no quota; cut streams are charged what they
//! generated; stalls pause a stream.

use std::time::{Duration, Instant};

use aws_sdk_bedrockruntime::types::ConverseStreamOutput;
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::{client::legacy::Client as HttpClient, rt::TokioExecutor};
use tokengate::simulator::SimulatorConfig;

use super::{SONNET, client, instant_config, post, start, user};

#[tokio::test]
async fn injected_faults() {
    let sim = start(SimulatorConfig {
        stall_ms: 300,
        ..instant_config()
    })
    .await;
    let c = client(&sim, "secret");
    let err = c
        .converse()
        .model_id(SONNET)
        .messages(user("[sim:fault=503]"))
        .send()
        .await
        .unwrap_err();
    assert_eq!(err.raw_response().unwrap().status().as_u16(), 503);
    assert!(err.into_service_error().is_service_unavailable_exception());
    let b = &sim.simulator.stats().buckets[&format!("{SONNET}@us-east-1")];
    assert_eq!(
        (b.errors, b.tokens_charged, b.in_flight),
        (1, 0, 0),
        "no quota taken"
    );

    let mut stream = c
        .converse_stream()
        .model_id(SONNET)
        .messages(user("[sim:fault=cut] [sim:output=40]"))
        .send()
        .await
        .unwrap()
        .stream;
    let mut deltas = 0;
    let error = loop {
        match stream.recv().await {
            Ok(Some(ConverseStreamOutput::Metadata(_))) => panic!("a cut stream has no metadata"),
            Ok(Some(ConverseStreamOutput::ContentBlockDelta(_))) => deltas += 1,
            Ok(Some(_)) => {}
            Ok(None) => panic!("the stream ended cleanly"),
            Err(e) => break e,
        }
    };
    assert!(deltas >= 1, "{error:?}");
    let b = &sim.simulator.stats().buckets[&format!("{SONNET}@us-east-1")];
    assert_eq!(
        (
            b.errors,
            b.in_flight,
            b.tokens_reserved_in_flight,
            b.completed
        ),
        (2, 0, 0, 0)
    );
    assert!(
        b.tokens_charged > 0 && b.tokens_charged < 5 * 40 + 20,
        "{}",
        b.tokens_charged
    );

    let started = Instant::now();
    let mut stream = c
        .converse_stream()
        .model_id(SONNET)
        .messages(user("[sim:fault=stall] [sim:output=40]"))
        .send()
        .await
        .unwrap()
        .stream;
    let mut saw_metadata = false;
    while let Some(e) = stream.recv().await.unwrap() {
        saw_metadata |= matches!(e, ConverseStreamOutput::Metadata(_));
    }
    assert!(saw_metadata);
    assert!(started.elapsed() >= Duration::from_millis(300));
}

#[tokio::test]
async fn injected_500s_and_resets_take_no_quota() {
    let sim = start(instant_config()).await;
    let (status, headers, body) = post(
        &sim,
        &format!("/model/{SONNET}/converse"),
        br#"{"messages":[{"role":"user","content":[{"text":"[sim:fault=500]"}]}]}"#,
    )
    .await;
    assert_eq!(status, 500);
    assert_eq!(headers["x-amzn-errortype"], "InternalServerException");
    assert!(body["message"].as_str().is_some_and(|m| !m.is_empty()));

    // A reset: the connection closes before any response byte.
    let http = HttpClient::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    for op in ["converse", "converse-stream"] {
        let request = http::Request::post(format!("http://{}/model/{SONNET}/{op}", sim.addr))
            .body(Full::new(Bytes::from_static(
                br#"{"messages":[{"role":"user","content":[{"text":"[sim:fault=reset]"}]}]}"#,
            )))
            .unwrap();
        let err = http.request(request).await.expect_err("no response");
        assert!(
            format!("{err:?}").contains("IncompleteMessage"),
            "{op}: {err:?}"
        );
    }
    let b = &sim.simulator.stats().buckets[&format!("{SONNET}@us-east-1")];
    assert_eq!(
        (b.requests, b.errors, b.tokens_charged, b.in_flight),
        (3, 3, 0, 0),
        "no quota taken"
    );
    let faults = sim.simulator.stats().faults;
    assert_eq!((faults["500"], faults["reset"], faults["503"]), (1, 2, 0));
    // Random faults at the configured rates.
    let sim = start(SimulatorConfig {
        error_500_rate: 0.5,
        reset_rate: 1.0,
        ..instant_config()
    })
    .await;
    let mut statuses = std::collections::BTreeMap::new();
    for i in 0..40 {
        let request = http::Request::post(format!("http://{}/model/{SONNET}/converse", sim.addr))
            .body(Full::new(Bytes::from(format!(
                r#"{{"messages":[{{"role":"user","content":[{{"text":"{i}"}}]}}]}}"#
            ))))
            .unwrap();
        let key = match http.request(request).await {
            Ok(r) => r.status().as_u16(),
            Err(_) => 0,
        };
        *statuses.entry(key).or_insert(0) += 1;
    }
    assert_eq!(statuses.keys().copied().collect::<Vec<_>>(), [0, 500]);
    assert!((10..=30).contains(&statuses[&500]), "{statuses:?}");
}
