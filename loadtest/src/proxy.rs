//! tokengate as a child process (`tokengate serve --config FILE`), so that its memory is its
//! own and readable from `/proc/<pid>/status`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// A running proxy. Dropping it kills the process.
#[derive(Debug)]
pub struct ProxyProcess {
    child: Child,
    pub addr: SocketAddr,
    pid: u32,
    /// Its stderr.
    pub log: PathBuf,
}

/// Resident memory of the proxy, KiB.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Memory {
    pub rss_kib: u64,
    /// Peak resident set since the start (VmHWM).
    pub hwm_kib: u64,
}

/// `target/release/tokengate` beside this binary (they build into the same directory).
pub fn default_binary() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join("tokengate")))
        .unwrap_or_else(|| PathBuf::from("target/release/tokengate"))
}

impl ProxyProcess {
    /// Writes `config` to `config_path`, starts the proxy and waits for its listening line.
    pub async fn start(bin: &Path, config: &str, config_path: &Path) -> anyhow::Result<Self> {
        std::fs::write(config_path, config)?;
        let log_path = config_path.with_extension("log");
        let log = std::fs::File::create(&log_path)?;
        let mut child = Command::new(bin)
            .args(["serve", "--config"])
            .arg(config_path)
            .env("AWS_ACCESS_KEY_ID", "AKIATOKENGATELOADGEN")
            .env("AWS_SECRET_ACCESS_KEY", "loadgen-secret")
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| {
                format!(
                    "starting {} (build it with cargo build --release)",
                    bin.display()
                )
            })?;
        let pid = child.id().context("proxy pid")?;
        let stdout = child.stdout.take().context("proxy stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let addr = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = lines.next_line().await? {
                if let Some(a) = line.strip_prefix("tokengate listening on http://") {
                    return Ok(a.trim().parse::<SocketAddr>()?);
                }
            }
            bail!(
                "the proxy exited before listening; see {}",
                config_path.with_extension("log").display()
            )
        })
        .await
        .context("the proxy did not start within 30 s")??;
        // Keep draining stdout so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(ProxyProcess {
            child,
            addr,
            pid,
            log: log_path,
        })
    }

    /// VmRSS and VmHWM from `/proc/<pid>/status` (zeros where unreadable).
    pub fn memory(&self) -> Memory {
        memory_of(self.pid)
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Sends SIGTERM and waits (up to `within`) for the exit status; `None` if it had to be
    /// killed or died by a signal.
    pub async fn terminate(mut self, within: Duration) -> anyhow::Result<Option<i32>> {
        let status = std::process::Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status()
            .context("kill -TERM")?;
        if !status.success() {
            bail!("kill -TERM {} failed", self.pid);
        }
        match tokio::time::timeout(within, self.child.wait()).await {
            Ok(status) => Ok(status?.code()),
            Err(_) => {
                let _ = self.child.kill().await;
                Ok(None)
            }
        }
    }

    /// Kills the proxy and reaps it.
    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// VmRSS and VmHWM of process `pid` (zeros where unreadable).
pub fn memory_of(pid: u32) -> Memory {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    Memory {
        rss_kib: field("VmRSS:"),
        hwm_kib: field("VmHWM:"),
    }
}
