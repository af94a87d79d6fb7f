//! `loadgen pace`: one request sent at a fixed rate (open loop) to one address over keep-alive
//! HTTP/1.1, and the latency of each call, for judging what a hop adds at a given rate
//! (`loadtest/nginx_compare.py --rate`, which runs it against the simulator, nginx and tokengate
//! in turn).
//!
//! The client is as thin as it can be, so that its own cost is small beside the hop's and the
//! same on every side: a hand-written request over a plain `TcpStream` and a response read to its
//! `content-length`, on a single-threaded runtime of its own. Call `i` is sent at `start + i /
//! rate`, whether or not earlier calls have come back (a new connection is opened when none is
//! idle), so a slow answer never delays the next send; latency runs from just before the request
//! is written to the last byte of the response. The timer's lateness (tokio's timer has a 1 ms
//! granularity) is reported apart, as `send_lag_ms`: it is not part of any call's latency.
//!
//! A call fails if its connection fails, its answer is not a `200` with a `content-length`, or it
//! takes longer than [`CALL_TIMEOUT`]; failures are counted, never part of the percentiles.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::report::{Pcts, pcts};

/// Longer than this and a call counts as failed.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// What to send, how often, for how long.
#[derive(Debug, Clone, clap::Args)]
pub struct PaceArgs {
    /// `host:port` to send to.
    pub addr: SocketAddr,
    /// Request path.
    #[arg(long)]
    pub path: String,
    /// The JSON body of every request.
    #[arg(long)]
    pub body: String,
    /// Extra header lines, `name: value` (repeatable).
    #[arg(long = "header")]
    pub headers: Vec<String>,
    /// Calls per second.
    #[arg(long, default_value_t = 1000)]
    pub rate: u32,
    /// How long to send, after the warm-up.
    #[arg(long, default_value_t = 10)]
    pub seconds: u32,
    /// Sent first at the same rate and not counted (connections opened, caches warm).
    #[arg(long, default_value_t = 1)]
    pub warm_up_seconds: u32,
}

/// What one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct PaceReport {
    pub rate: u32,
    pub seconds: u32,
    pub calls: usize,
    pub failed: usize,
    /// The first failure's reason, if any.
    pub first_failure: Option<String>,
    pub connections_opened: usize,
    pub latency_ms: Option<Pcts>,
    /// How late the timer woke for each send, in milliseconds (not part of any latency).
    pub send_lag_ms: Option<Pcts>,
}

/// Runs `args` on a single-threaded runtime of its own (so the client takes one core at most)
/// and prints the report as one JSON line.
pub fn run(args: PaceArgs) -> anyhow::Result<()> {
    let report = std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("a runtime for the pacer")?
            .block_on(pace(&args))
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the pacer's thread panicked"))??;
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

/// Idle keep-alive connections, and how many were ever opened.
#[derive(Default)]
struct Pool {
    idle: Vec<TcpStream>,
    opened: usize,
}

type Outcome = Result<Duration, String>;

async fn pace(args: &PaceArgs) -> anyhow::Result<PaceReport> {
    let request: Arc<[u8]> = request_bytes(args).into();
    let pool = Arc::new(Mutex::new(Pool::default()));
    let interval = Duration::from_secs_f64(1.0 / f64::from(args.rate.max(1)));
    let warm_up = (args.rate * args.warm_up_seconds) as usize;
    let total = warm_up + (args.rate * args.seconds) as usize;
    let mut calls = tokio::task::JoinSet::new();
    let mut lags = Vec::with_capacity(total);
    let start = Instant::now();
    for i in 0..total {
        let due = start + interval * i as u32;
        tokio::time::sleep_until(due.into()).await;
        if i >= warm_up {
            lags.push(due.elapsed().as_secs_f64() * 1e3);
        }
        let (request, pool, addr) = (request.clone(), pool.clone(), args.addr);
        calls.spawn(async move {
            let outcome = tokio::time::timeout(CALL_TIMEOUT, call(addr, &request, &pool)).await;
            (i, outcome.unwrap_or_else(|_| Err("timed out".into())))
        });
    }
    let mut latencies = Vec::with_capacity(total);
    let (mut failed, mut first_failure) = (0, None);
    while let Some(joined) = calls.join_next().await {
        let (i, outcome) = joined.context("a call's task")?;
        match outcome {
            _ if i < warm_up => {}
            Ok(took) => latencies.push(took.as_secs_f64() * 1e3),
            Err(reason) => {
                failed += 1;
                first_failure.get_or_insert(reason);
            }
        }
    }
    let opened = pool.lock().map_or(0, |p| p.opened);
    Ok(PaceReport {
        rate: args.rate,
        seconds: args.seconds,
        calls: total - warm_up,
        failed,
        first_failure,
        connections_opened: opened,
        latency_ms: pcts(latencies),
        send_lag_ms: pcts(lags),
    })
}

fn request_bytes(args: &PaceArgs) -> Vec<u8> {
    let mut head = format!(
        "POST {} HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        args.path,
        args.addr,
        args.body.len()
    );
    for header in &args.headers {
        head.push_str(header);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(args.body.as_bytes());
    bytes
}

/// One call on an idle connection (or a new one): its latency, or why it failed.
async fn call(addr: SocketAddr, request: &[u8], pool: &Mutex<Pool>) -> Outcome {
    let idle = pool.lock().ok().and_then(|mut p| p.idle.pop());
    let mut stream = match idle {
        Some(stream) => stream,
        None => {
            let stream = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
            stream.set_nodelay(true).map_err(|e| e.to_string())?;
            if let Ok(mut p) = pool.lock() {
                p.opened += 1;
            }
            stream
        }
    };
    let began = Instant::now();
    stream.write_all(request).await.map_err(|e| e.to_string())?;
    read_response(&mut stream).await?;
    let took = began.elapsed();
    if let Ok(mut p) = pool.lock() {
        p.idle.push(stream);
    }
    Ok(took)
}

/// Reads one response to the end of its `content-length` body; fails unless it is a `200`.
async fn read_response(stream: &mut TcpStream) -> Result<(), String> {
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        let n = stream.read(&mut chunk).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("connection closed before a response head".into());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = std::str::from_utf8(&buf[..head_end]).map_err(|_| "head is not UTF-8")?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(head.lines().next().unwrap_or_default().to_string());
    }
    let length = head
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse::<usize>().ok())?
        })
        .ok_or("no content-length in the response")?;
    let mut have = buf.len() - head_end;
    while have < length {
        let n = stream.read(&mut chunk).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("connection closed in the response body".into());
        }
        have += n;
    }
    Ok(())
}
