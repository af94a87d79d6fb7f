//! Shutdown through the real binary (`tokengate serve`, with its in-process simulator): SIGTERM
//! turns readiness false first, stops accepting, lets in-flight streams finish up to the drain
//! deadline, ends what is left in-band, settles everything and exits 0.
//!
//! The process's own word is the evidence: its JSON log (one access-log line per request, with
//! its settlement rule, and the last line reporting the ledger) and its exit status. No sleeps:
//! the address comes from the "tokengate listening on" stdout line, states are polled.

#![cfg(unix)]

use std::{
    net::SocketAddr,
    process::Stdio,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use crate::common::{scrape::Scrape, wire::*, *};
use serde_json::Value;
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, Command},
};

/// A running `tokengate serve`.
struct Running {
    child: Child,
    addr: SocketAddr,
    /// Its stderr (the JSON log), line by line, as it comes.
    log: Arc<Mutex<Vec<String>>>,
    /// Reads stderr until the process closes it.
    log_reader: Option<tokio::task::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl Running {
    async fn start(server: &str, tokens_per_second: u32) -> Running {
        Running::start_with(server, tokens_per_second, &[]).await
    }

    /// [`Running::start`], with `serve`'s further command-line `args`.
    async fn start_with(server: &str, tokens_per_second: u32, args: &[&str]) -> Running {
        let config = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n{server}\n\n\
             [upstream]\nregion = \"us-east-1\"\nendpoint = \"simulated\"\n\n\
             [log]\nformat = \"json\"\nlevel = \"info\"\n\n\
             [simulator]\ntime_to_first_token_ms = 0\ntokens_per_second = {tokens_per_second}\n\n\
             {}",
            sonnet_pool(10_000_000, 8)
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tokengate.toml");
        std::fs::write(&path, config).expect("config");
        let mut child = Command::new(env!("CARGO_BIN_EXE_tokengate"))
            .args(["serve", "--config"])
            .arg(&path)
            .args(args)
            // The runtime's own override, which would change the default counted below.
            .env_remove("TOKIO_WORKER_THREADS")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("tokengate starts");
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut stderr = BufReader::new(child.stderr.take().expect("stderr")).lines();
        let sink = log.clone();
        let log_reader = tokio::spawn(async move {
            while let Ok(Some(line)) = stderr.next_line().await {
                sink.lock().expect("log").push(line);
            }
        });
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let addr = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                let line = stdout.next_line().await.expect("stdout").expect("a line");
                if let Some(addr) = line.strip_prefix("tokengate listening on http://") {
                    return addr.parse::<SocketAddr>().expect("address");
                }
            }
        })
        .await
        .expect("tokengate says where it listens");
        // Keep draining stdout so the child never blocks on it.
        tokio::spawn(async move { while let Ok(Some(_)) = stdout.next_line().await {} });
        Running {
            child,
            addr,
            log,
            log_reader: Some(log_reader),
            _dir: dir,
        }
    }

    fn sigterm(&self) {
        let pid = self.child.id().expect("running");
        let status = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    }

    /// Waits for the exit, and for the last of its log.
    async fn exit_code(&mut self, within: Duration) -> Option<i32> {
        let status = tokio::time::timeout(within, self.child.wait())
            .await
            .expect("tokengate exits in time")
            .expect("wait");
        if let Some(reader) = self.log_reader.take() {
            tokio::time::timeout(Duration::from_secs(5), reader)
                .await
                .expect("stderr closes with the process")
                .expect("log reader");
        }
        status.code()
    }

    async fn in_flight(&self) -> f64 {
        let r = raw_request(self.addr, "GET", "/metrics", "", false).await;
        let text = String::from_utf8(r.body.to_vec()).expect("utf8");
        Scrape::parse(&text).get("tokengate_inflight_requests", &[("pool", "sonnet4-us")])
    }

    /// The JSON log lines, parsed.
    fn log_lines(&self) -> Vec<Value> {
        let lines = self.log.lock().expect("log");
        lines
            .iter()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// The settlement rules of the access-log lines, in order.
    fn rules(&self) -> Vec<String> {
        self.log_lines()
            .iter()
            .filter(|l| l["target"] == "tokengate::access")
            .filter_map(|l| l["fields"]["rule"].as_str().map(str::to_string))
            .collect()
    }

    /// The last log line: the ledger as the process left it.
    fn assert_stopped_clean(&self) {
        let lines = self.log_lines();
        let last = lines.last().expect("a log");
        let fields = &last["fields"];
        assert_eq!(
            fields["message"], "stopped: every reservation settled",
            "{last}"
        );
        assert_eq!(
            (
                fields["reserved_tokens"].as_i64(),
                fields["in_flight"].as_i64()
            ),
            (Some(0), Some(0))
        );
    }
}

async fn eventually_async<F, Fut>(within: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn spawn_request(
    addr: SocketAddr,
    path: String,
    body: String,
) -> tokio::task::JoinHandle<TryResponse> {
    tokio::spawn(async move { try_request(addr, &path, body).await })
}

async fn refuses_connections(addr: SocketAddr) -> bool {
    tokio::net::TcpStream::connect(addr).await.is_err()
}

#[tokio::test]
async fn sigterm_turns_unready_first_then_drains_in_flight_streams_and_exits_zero() {
    // A stream of 500 tokens at 100 tokens/s: five seconds, well inside the 20 s drain.
    let mut proxy = Running::start("drain_secs = 20\naccept_grace_secs = 1", 100).await;
    let addr = proxy.addr;
    let stream = spawn_request(
        addr,
        model_path(SONNET_US, "converse-stream"),
        converse_body("[sim:output=500] a long answer", Some(600)),
    );
    eventually_async(
        Duration::from_secs(10),
        "the stream to be admitted",
        || async { proxy.in_flight().await == 1.0 },
    )
    .await;
    let ready = raw_request(addr, "GET", "/readyz", "", false).await;
    assert_eq!(ready.status, 200);

    proxy.sigterm();
    let signalled = Instant::now();
    // Readiness goes false while the listener still accepts: a new call is still served.
    eventually_async(Duration::from_secs(5), "readiness to go false", || async {
        raw_request(addr, "GET", "/readyz", "", false).await.status == 503
    })
    .await;
    let late = raw_request(
        addr,
        "POST",
        &model_path(SONNET_US, "converse"),
        converse_body("[sim:output=5] just in time", Some(10)),
        false,
    )
    .await;
    assert_eq!(late.status, 200, "served during the accept grace");
    // Then the listener closes, after the grace period.
    eventually_async(Duration::from_secs(10), "the listener to close", || {
        refuses_connections(addr)
    })
    .await;
    assert!(
        signalled.elapsed() >= Duration::from_millis(900),
        "closed before the grace period"
    );

    // The stream in flight finishes whole, and the process exits 0.
    let r = stream.await.expect("task");
    assert_eq!(r.status, 200);
    let frames = frames(&r.body.expect("a complete stream"));
    let last = frames.last().expect("frames");
    assert_eq!(
        (last.message_type.as_str(), last.kind.as_str()),
        ("event", "metadata")
    );
    assert_eq!(proxy.exit_code(Duration::from_secs(20)).await, Some(0));
    assert_eq!(
        proxy.rules(),
        ["usage", "usage"],
        "both settled on their usage"
    );
    proxy.assert_stopped_clean();
}

#[tokio::test]
async fn what_is_left_at_the_drain_deadline_ends_in_band_and_is_settled() {
    // 1,000 tokens at 50 tokens/s: twenty seconds, far past the 1 s drain.
    let mut proxy = Running::start("drain_secs = 1", 50).await;
    let addr = proxy.addr;
    let long = "[sim:output=1000] far too long";
    let stream = spawn_request(
        addr,
        model_path(SONNET_US, "converse-stream"),
        converse_body(long, Some(1000)),
    );
    // A plain call has no response head until generation ends.
    let waiting = spawn_request(
        addr,
        model_path(SONNET_US, "converse"),
        converse_body(long, Some(1000)),
    );
    eventually_async(Duration::from_secs(10), "both calls in flight", || async {
        proxy.in_flight().await == 2.0
    })
    .await;
    proxy.sigterm();

    let r = stream.await.expect("task");
    assert_eq!(r.status, 200);
    let frames = frames(&r.body.expect("the proxy ends the stream cleanly, in-band"));
    let (last, before) = frames.split_last().expect("frames");
    assert!(before.iter().any(|f| f.kind == "contentBlockDelta"));
    assert_eq!(
        (last.message_type.as_str(), last.kind.as_str()),
        ("exception", "serviceUnavailableException")
    );
    let message: Value = serde_json::from_slice(&last.payload).expect("json");
    assert!(
        message["message"]
            .as_str()
            .is_some_and(|m| m.contains("drain_secs")),
        "{message}"
    );

    let r = waiting.await.expect("task");
    assert_eq!(
        (r.status, r.error_type()),
        (503, "ServiceUnavailableException")
    );
    assert!(
        r.headers.contains_key("x-amz-retry-after"),
        "SDKs retry it elsewhere"
    );

    // Exits after the deadline, not when the generation would have ended (twenty seconds): the
    // stream above ended in-band, cut short, and the wait for the exit is bounded.
    assert_eq!(proxy.exit_code(Duration::from_secs(15)).await, Some(0));
    let mut rules = proxy.rules();
    rules.sort();
    assert_eq!(rules, ["no_usage", "timeout"]);
    proxy.assert_stopped_clean();
}

#[tokio::test]
async fn queued_calls_are_answered_at_once_and_shutdown_reports_nothing_left() {
    let sim = "time_to_first_token_ms = 0\ntokens_per_second = 100\ndefault_tokens_per_minute = 10000000\n";
    let sim = start_simulator(sim).await;
    // One slot; a second call waits in the admission queue (up to 20 s).
    let pools = format!("{}max_wait_ms = 20000\n", sonnet_pool(10_000_000, 1));
    let mut config = proxy_config(sim.addr, &pools, "");
    config.process.server.drain = Duration::from_secs(10);
    let proxy = start_proxy(config).await;
    let (addr, state) = (proxy.addr, proxy.state.clone());
    let request = |path: String, body: String| {
        tokio::spawn(async move { try_request(addr, &path, body).await })
    };
    // Three seconds of stream hold the slot.
    let holder = request(
        model_path(SONNET_US, "converse-stream"),
        converse_body("[sim:output=300] holds the slot", Some(400)),
    );
    let admission = proxy.admission();
    let in_flight = || admission.pools()[0].load.in_flight();
    eventually_async(Duration::from_secs(5), "the holder admitted", || async {
        in_flight() == 1
    })
    .await;
    let queued = request(
        model_path(SONNET_US, "converse"),
        converse_body("[sim:output=5] waits", Some(10)),
    );
    let depth = || admission.pools()[0].queue.depth();
    eventually_async(Duration::from_secs(5), "the second call queued", || async {
        depth() == 1
    })
    .await;

    let shutdown = tokio::spawn(proxy.shutdown());
    let queued = queued.await.expect("task");
    // Answered at once, not after the drain: the holder is still streaming.
    assert_eq!(
        in_flight(),
        1,
        "the queued call was answered while the holder ran"
    );
    let report = shutdown.await.expect("task").expect("shutdown");
    let holder = holder.await.expect("task");
    assert_eq!(
        (queued.status, queued.error_type()),
        (503, "ServiceUnavailableException")
    );
    assert!(queued.headers.contains_key("x-amz-retry-after"));
    assert_eq!(holder.status, 200);
    let frames = frames(&holder.body.expect("the holder's stream finishes whole"));
    assert_eq!(frames.last().map(|f| f.kind.as_str()), Some("metadata"));
    assert!(report.is_clean(), "{report:?}");
    // The registry outlives the listener: read it as `/metrics` exposed it.
    let metrics =
        crate::common::scrape::Scrape::parse(&tokengate::metrics::render(&state.registry));
    assert_eq!(
        metrics.get(
            "tokengate_settlements_total",
            &[("pool", "sonnet4-us"), ("rule", "usage")]
        ),
        1.0,
        "the holder settled on its usage; the queued call held nothing"
    );
}

#[tokio::test]
async fn worker_threads_sets_how_many_threads_run_requests() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    for (args, expected) in [(&["--worker-threads", "1"][..], 1), (&[][..], cpus)] {
        let mut proxy = Running::start_with("", 1000, args).await;
        // The startup line says how many the runtime runs (batched: it comes within 50 ms).
        let mut said = None;
        eventually_async(Duration::from_secs(5), "the serving line", || {
            said = proxy
                .log_lines()
                .iter()
                .find(|line| line["fields"]["message"] == "serving")
                .map(|line| line["fields"]["worker_threads"].clone());
            std::future::ready(said.is_some())
        })
        .await;
        assert_eq!(said, Some(Value::from(expected)), "serve {args:?}");
        let r = raw_request(
            proxy.addr,
            "POST",
            &model_path(SONNET_US, "converse"),
            converse_body("[sim:output=5] hello", Some(10)),
            false,
        )
        .await;
        assert_eq!(r.status, 200, "serve {args:?} answers");
        proxy.sigterm();
        assert_eq!(proxy.exit_code(Duration::from_secs(30)).await, Some(0));
        proxy.assert_stopped_clean();
    }
}

/// `tokengate serve` with `args` and `env`, which must exit before it starts: its exit code and
/// stderr.
async fn refused_at_start(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tokengate"))
        .args(["serve", "--config", "unused.toml"])
        .args(args)
        .envs(env.iter().copied())
        .output()
        .await
        .expect("tokengate runs");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn worker_threads_of_zero_is_refused_with_the_flag_named() {
    let (code, stderr) = refused_at_start(&["--worker-threads", "0"], &[]).await;
    assert_eq!(code, Some(2));
    assert!(stderr.contains("--worker-threads"), "{stderr}");
}

#[tokio::test]
async fn a_bad_tokio_worker_threads_is_an_error_not_a_panic() {
    let (code, stderr) = refused_at_start(&[], &[("TOKIO_WORKER_THREADS", "0")]).await;
    assert_eq!(code, Some(1));
    assert!(
        stderr.contains("TOKIO_WORKER_THREADS=0: not a positive number")
            && !stderr.contains("panicked"),
        "{stderr}"
    );
}
