#![allow(dead_code)]
//! A private `prometheus` server per test (Debian's package): scraping a proxy every second,
//! with the shipped alert rules loaded, on a free loopback port, its data in a temporary
//! directory, killed when the handle drops (also when the test panics).
//!
//! Without `prometheus` on `PATH`, [`Prometheus::start`] returns `None` after recording a visible
//! skip, which fails the test under CI (`CI=true`: CI installs it).

use std::{
    net::SocketAddr,
    process::{Child, Command, Stdio},
    time::Duration,
};

use serde_json::Value;

use super::raw_request;

#[derive(Debug)]
pub struct Prometheus {
    child: Child,
    pub addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback port nothing listens on now (Prometheus cannot report a port it chose itself).
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

/// Polls `/-/ready` until it answers 200, or the process exits (its port was taken).
async fn wait_ready(child: &mut Child, addr: SocketAddr) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            return false;
        }
        if tokio::net::TcpStream::connect(addr).await.is_ok()
            && raw_request(addr, "GET", "/-/ready", "", false).await.status == 200
        {
            return true;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "prometheus never became ready"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

impl Prometheus {
    /// Starts a server scraping `target` every second with `rules` loaded, and waits (bounded)
    /// until it is ready.
    pub async fn start(target: SocketAddr, rules: &std::path::Path) -> Option<Prometheus> {
        if Command::new("prometheus")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_err()
        {
            super::redis_server::skip::skip(
                "prometheus is not on PATH (apt-get install -y prometheus)",
            );
            return None;
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\n\
                 scrape_configs:\n  - job_name: tokengate\n    static_configs:\n      - targets: ['{target}']\n",
                rules.display()
            ),
        )
        .expect("prometheus.yml");
        // The port can be taken between choosing and binding it: try a few.
        for _ in 0..5 {
            let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
            let mut child = Command::new("prometheus")
                .arg(format!("--config.file={}", config.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.path().join("data").display()
                ))
                .arg(format!("--web.listen-address={addr}"))
                .arg("--log.level=warn")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("prometheus starts");
            if wait_ready(&mut child, addr).await {
                return Some(Prometheus {
                    child,
                    addr,
                    _dir: dir,
                });
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("prometheus did not become ready on any port");
    }

    /// `GET /api/v1/...` with `params` (URL-encoded here); the `data` of a successful answer.
    pub async fn api(&self, path: &str, params: &[(&str, &str)]) -> Result<Value, String> {
        let query: Vec<String> = params
            .iter()
            .map(|(k, v)| {
                let v =
                    percent_encoding::utf8_percent_encode(v, percent_encoding::NON_ALPHANUMERIC);
                format!("{k}={v}")
            })
            .collect();
        let uri = format!("/api/v1/{path}?{}", query.join("&"));
        let r = raw_request(self.addr, "GET", &uri, "", false).await;
        let v: Value = serde_json::from_slice(&r.body).map_err(|e| format!("{uri}: {e}"))?;
        if v["status"] == "success" {
            Ok(v["data"].clone())
        } else {
            Err(format!("{uri}: {} {}", v["errorType"], v["error"]))
        }
    }

    /// An instant query at `time` (Unix seconds): its result vector.
    pub async fn query(&self, expr: &str, time: f64) -> Result<Vec<Value>, String> {
        let data = self
            .api("query", &[("query", expr), ("time", &format!("{time:.3}"))])
            .await?;
        match data["resultType"].as_str() {
            Some("vector") => Ok(data["result"].as_array().cloned().unwrap_or_default()),
            Some("scalar") => Ok(vec![data["result"].clone()]),
            other => Err(format!("{expr}: result type {other:?}")),
        }
    }
}
