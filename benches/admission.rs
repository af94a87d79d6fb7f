//! What one admission decision costs, from the ledger alone up to the full `Admission::admit`.
//!
//! - `memory_ledger/reserve_settle`: one `reserve` and one `settle` on the memory ledger.
//! - `memory_ledger/reserve_settle_2_threads`: the same pair from two OS threads on one pool;
//!   reported as wall time per pair with both threads' pairs counted. Half the single-threaded
//!   figure would be perfect scaling on two cores; equal to it, no gain from the second thread.
//!   Each thread's own latency per pair is twice the figure.
//! - `admission/admit_settle_converse`: `Admission::admit` for a ~1 KB Converse body (one-pass
//!   read of `maxTokens` and the input estimate, calibration, metrics, ledger) then
//!   `Admitted::settle_usage`, observed as the proxy observes it (tracing off: the quota report's
//!   counts, metrics, the access-log line).
//! - `admission/admit_settle_converse_unobserved`: the same decision and settlement without the
//!   observer (no request metrics, quota report or access-log line): admission and the ledger
//!   alone, the split of the figure above.
//! - `admission/admit_settle_converse_traced`: the same with tracing on, every request sampled:
//!   its spans built and queued for the exporter (whose task sends them on a worker of its own).
//!
//! - `observe/quota_report_record`: the quota report's share of the above, alone: a request's two
//!   events counted in its pool's window.
//! - `admission/reference_body_read`: the one-pass read of the body alone (`admission::body::read`,
//!   the decision's share of parsing).
//! - `admission/reference_json_parse`, `admission/reference_estimate_input`: what the decision did
//!   before the one-pass read (parse into a `serde_json::Value`, then walk it), for comparison.
//!
//! The async functions are driven with `FutureExt::now_or_never`: the memory ledger never awaits,
//! so one poll completes them, which is also how admission itself settles on the memory ledger
//! (`settle_in_background`). A runtime's `block_on` would add its own enter/park cost to every
//! iteration and measure the executor rather than the decision.
//!
//! The bench runs on the proxy's allocator (mimalloc), as the proxy does.
//!
//! Run: `cargo bench --bench admission -- --warm-up-time 1 --measurement-time 3`

use std::{
    hint::black_box,
    sync::{Arc, Barrier},
    thread,
    time::{Duration, Instant},
};

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use futures_util::FutureExt;
use http::{HeaderMap, HeaderValue};
use tokengate::{
    admission::{Admission, Caller, Decision, Facts, body, estimate::estimate_input_tokens},
    bedrock::{Operation, Usage},
    config::Config,
    ledger::{self, Clock, Ledger, Limits, MemoryLedger, ReserveRequest},
    metrics::Metrics,
    observe::{
        Observation, Observer, Telemetry, Tracer, otlp,
        report::{Event, QuotaReport},
    },
};

const MODEL: &str = "us.anthropic.claude-sonnet-4-20250514-v1:0";

/// The proxy's allocator (`src/main.rs`), so that the bench measures what the proxy runs.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Large enough that nothing is rejected during a run: the bench measures admissions only.
const LIMITS: Limits = Limits {
    tokens_per_minute: 1_000_000_000,
    requests_per_minute: None,
    max_concurrency: 1_000_000,
    tokens_per_day: None,
};

/// One reserve of 1,000 tokens settled for 0: the bucket stays full however long the run.
fn reserve_settle(ledger: &MemoryLedger, pool: &str) {
    let request = ReserveRequest {
        pool,
        limits: LIMITS,
        tokens: 1_000,
        share: None,
        hold_back: 0,
    };
    let decision = ledger.reserve(black_box(&request)).now_or_never();
    match decision {
        Some(Ok(ledger::Verdict::Granted(reservation))) => {
            let settled = ledger.settle(reservation, 0).now_or_never();
            assert!(matches!(settled, Some(Ok(()))), "settle: {settled:?}");
        }
        other => panic!("the bench pool must admit everything: {other:?}"),
    }
}

fn memory_ledger(c: &mut Criterion) {
    let mut group = c.benchmark_group("memory_ledger");
    let ledger = MemoryLedger::new(Clock::tokio());
    group.bench_function("reserve_settle", |b| {
        b.iter(|| reserve_settle(&ledger, "bench"));
    });

    let ledger = Arc::new(MemoryLedger::new(Clock::tokio()));
    group.bench_function("reserve_settle_2_threads", |b| {
        b.iter_custom(|iters| two_threads(&ledger, iters));
    });
    group.finish();
}

/// Wall time for two threads doing `iters` pairs each on one pool, halved: per pair.
fn two_threads(ledger: &Arc<MemoryLedger>, iters: u64) -> Duration {
    let start = Arc::new(Barrier::new(3));
    let workers: Vec<_> = (0..2)
        .map(|_| {
            let (ledger, start) = (ledger.clone(), start.clone());
            thread::spawn(move || {
                start.wait();
                for _ in 0..iters {
                    reserve_settle(&ledger, "bench-2-threads");
                }
            })
        })
        .collect();
    start.wait();
    let began = Instant::now();
    for worker in workers {
        if let Err(panic) = worker.join() {
            std::panic::resume_unwind(panic);
        }
    }
    began.elapsed() / 2
}

/// A Converse request of about 1 KB: a system prompt, three turns, and inference settings.
fn converse_body() -> Bytes {
    let body = serde_json::json!({
        "system": [{"text": "You are a support assistant for an online bookshop. Answer briefly, cite the \
            order number when there is one, and never promise a refund: refer refunds to a human agent."}],
        "messages": [
            {"role": "user", "content": [{"text": "Hello, I ordered three paperbacks last Tuesday \
                (order 40-1183-2207) and the tracking page has not moved since Thursday. Is it lost?"}]},
            {"role": "assistant", "content": [{"text": "I am sorry for the wait. Order 40-1183-2207 \
                left our warehouse on Wednesday; carriers often skip scans over a weekend. If nothing \
                changes by Monday evening I can open an investigation with the carrier."}]},
            {"role": "user", "content": [{"text": "Monday is fine, but one of the books is a gift for \
                Saturday. Could you send that one again by express and cancel it from the original \
                parcel? Also, do you ship to Portugal, and what does express to Lisbon usually cost?"}]}
        ],
        "inferenceConfig": {"maxTokens": 1024, "temperature": 0.2, "topP": 0.9, "stopSequences": ["\n\nUser:"]},
        "additionalModelRequestFields": {"top_k": 40}
    });
    Bytes::from(body.to_string())
}

fn config() -> Config {
    Config::parse(&config_text()).unwrap_or_else(|e| panic!("bench config: {e}"))
}

fn config_text() -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

[upstream]
region = "us-east-1"
endpoint = "simulated"

[ledger]
backend = "memory"

[[pools]]
name = "bench"
models = ["{MODEL}"]
tokens_per_minute = {}
max_concurrency = {}
output_burndown = 5
default_max_tokens = 4096
"#,
        LIMITS.tokens_per_minute, LIMITS.max_concurrency
    )
}

/// One request's decision and settlement, observed as the proxy observes it (arrival with
/// `headers`, the decision, the settlement and its access-log line); with `observer` `None`,
/// the decision and settlement alone (nothing counted outside admission and the ledger).
fn admit_settle(
    admission: &Admission,
    observer: Option<&Observer>,
    caller: &Caller,
    body: &Bytes,
    headers: &HeaderMap,
    usage: &Usage,
) {
    let mut observed = observer.map(|observer| {
        let mut obs = Observation::start();
        observer.began(&mut obs, headers);
        obs.target(Operation::Converse, Some(MODEL));
        (observer, obs)
    });
    let facts = Facts {
        operation: Operation::Converse,
        model_id: Some(MODEL),
        body: black_box(body),
        read: None,
        caller,
        service_tier: None,
        endpoint: None,
    };
    let decision = admission.decide(&facts).now_or_never();
    let Some(decision) = decision else {
        panic!("the memory ledger never waits")
    };
    if let Some((observer, obs)) = &mut observed {
        observer.decided(obs, &decision);
    }
    match decision {
        Decision::Admit(mut admitted) => {
            let settled = admitted.hold.settle_usage(usage);
            if let (Some((observer, obs)), Some(settled)) = (observed, settled) {
                observer.settled(obs, &settled);
            }
        }
        other => panic!("the bench pool must admit everything: {other:?}"),
    }
}

/// The telemetry of the proxy: the quota report, and with `traced` an OTLP exporter (to a port
/// nothing listens on: the bench measures building and queueing spans, not sending them).
fn telemetry(metrics: &Metrics, traced: bool) -> Arc<Telemetry> {
    let mut telemetry = Telemetry::new(QuotaReport::new(
        Clock::tokio(),
        Duration::from_secs(86_400),
    ));
    if traced {
        let config = Config::parse(&format!(
            "{}\n[tracing]\notlp_endpoint = \"http://127.0.0.1:9\"\n",
            config_text()
        ))
        .unwrap_or_else(|e| panic!("bench config: {e}"));
        let tracing = config
            .process
            .tracing
            .unwrap_or_else(|| panic!("tracing on"));
        let exporter =
            otlp::Exporter::start(&tracing, metrics).unwrap_or_else(|e| panic!("exporter: {e}"));
        telemetry.tracer = Some(Tracer {
            exporter,
            sample_ratio: 1.0,
        });
    }
    Arc::new(telemetry)
}

fn admission(c: &mut Criterion) {
    let config = config();
    let ledger = Arc::new(MemoryLedger::new(Clock::tokio()));
    let (_registry, metrics) = Metrics::standalone();
    let admission = Admission::new(
        &config.policy.pools,
        &config.policy.routes,
        config.policy.admission,
        ledger,
    );
    // What the proxy does around a decision: count it, and record the settlement.
    let observer = Observer::new(
        Arc::new(metrics.clone()),
        &admission,
        telemetry(&metrics, false),
    );
    let caller = admission.first_route_caller();
    let body = converse_body();
    // What boto3 sends, without a trace context.
    let mut headers = HeaderMap::new();
    for (name, value) in [
        ("content-type", "application/json"),
        (
            "user-agent",
            "Boto3/1.44.8 md/Botocore#1.44.8 cfg/retry-mode#standard",
        ),
        (
            "amz-sdk-invocation-id",
            "f2c6a4a0-6c1b-4a52-9d0b-3c0b0f3ad7a1",
        ),
        ("amz-sdk-request", "attempt=1; max=3"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    // A prompt-cached call: every input token is reported (so calibration learns from it) but
    // only 4 + 2 x 5 = 14 are charged. A realistic uncached charge (about 700 tokens) at this rate
    // would drain even a billion-token bucket within seconds, and the bench would then measure
    // rejections; the settlement code path is the same whatever the charge.
    let usage = Usage {
        input_tokens: 4,
        output_tokens: 2,
        cache_read_input_tokens: 250,
        cache_write_input_tokens: 0,
    };
    let mut group = c.benchmark_group("admission");
    group.bench_function("admit_settle_converse", |b| {
        b.iter(|| {
            admit_settle(
                &admission,
                Some(&observer),
                &caller,
                &body,
                &headers,
                &usage,
            )
        });
    });
    // The decision and settlement alone: what the figure above spends outside the observer.
    group.bench_function("admit_settle_converse_unobserved", |b| {
        b.iter(|| admit_settle(&admission, None, &caller, &body, &headers, &usage));
    });
    // The same with tracing on: every request sampled, its three spans built and queued.
    // The exporter's task runs on a worker of its own, as in the proxy.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"));
    let traced = {
        let _entered = runtime.enter();
        Observer::new(
            Arc::new(metrics.clone()),
            &admission,
            telemetry(&metrics, true),
        )
    };
    group.bench_function("admit_settle_converse_traced", |b| {
        b.iter(|| admit_settle(&admission, Some(&traced), &caller, &body, &headers, &usage));
    });
    // Reference points for reading the figure above: its one-pass read of the body alone, and the
    // parse into a `Value` and walk it replaced.
    let facts = body::read(Operation::Converse, Some("anthropic"), &body);
    assert!(facts.is_ok(), "the bench body must read: {facts:?}");
    group.bench_function("reference_body_read", |b| {
        b.iter(|| body::read(Operation::Converse, Some("anthropic"), black_box(&body)).is_ok());
    });
    group.bench_function("reference_json_parse", |b| {
        b.iter(|| {
            serde_json::from_slice::<serde_json::Value>(black_box(&body)).map(|v| v.is_object())
        });
    });
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    group.bench_function("reference_estimate_input", |b| {
        b.iter(|| estimate_input_tokens(Operation::Converse, black_box(&json)));
    });
    group.finish();
}

/// What the quota report adds to a request, alone: its two events (admitted, settled with usage)
/// counted in the pool's window.
fn quota_report(c: &mut Criterion) {
    let report = QuotaReport::new(Clock::tokio(), Duration::from_secs(86_400));
    let window = report.pool("bench");
    let admitted = Event::Admitted {
        reserved: 1_300,
        in_flight: 1,
        queued_for: None,
        spilled: false,
    };
    let settled = Event::Settled {
        charge: 14,
        usage: Some(Usage {
            input_tokens: 4,
            output_tokens: 2,
            cache_read_input_tokens: 250,
            cache_write_input_tokens: 0,
        }),
    };
    c.bench_function("observe/quota_report_record", |b| {
        b.iter(|| {
            window.record(report.minute(), black_box(&admitted));
            window.record(report.minute(), black_box(&settled));
        });
    });
}

criterion_group!(benches, memory_ledger, admission, quota_report);
criterion_main!(benches);
