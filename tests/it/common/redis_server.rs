//! A private `redis-server` per test: on a unix socket in a temporary directory (no port to race
//! for), no persistence, killed when the handle drops (also when the test panics).
//!
//! Without `redis-server` on `PATH`, [`RedisServer::start`] returns `None` after recording a
//! visible skip ([`skip`]), which fails the test under CI (`CI=true`: CI installs it).

// Also included alone (by path) from benches/ledger.rs, so it brings its own copy of the skips.
#[path = "skip.rs"]
pub mod skip;

use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::UnixStream,
};

#[derive(Debug)]
pub struct RedisServer {
    child: Child,
    dir: tempfile::TempDir,
}

impl RedisServer {
    /// Starts a server and waits (bounded) until it answers PING.
    pub async fn start() -> Option<RedisServer> {
        if Command::new("redis-server")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_err()
        {
            skip::skip("redis-server is not on PATH (apt-get install -y redis-server)");
            return None;
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let server = RedisServer {
            child: spawn(&dir.path().join("redis.sock")),
            dir,
        };
        server.wait_ready().await;
        Some(server)
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("redis.sock")
    }

    /// The URL for `[ledger] url`.
    pub fn url(&self) -> String {
        format!("redis+unix://{}", self.socket().display())
    }

    /// Freezes the server (SIGSTOP): connections stay open and nothing answers, as with a hung or
    /// partitioned Redis. State is kept.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    /// Kills the server (its state is lost) and starts a new one on the same socket.
    pub async fn restart(&mut self) {
        self.kill();
        self.child = spawn(&self.socket());
        self.wait_ready().await;
    }

    /// Kills the server; [`Self::restart`] brings one back.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(self.socket());
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill {signal} failed");
    }

    /// Sends one inline command and returns the raw reply.
    pub async fn command(&self, line: &str) -> String {
        let mut stream = UnixStream::connect(self.socket()).await.expect("connect");
        stream
            .write_all(format!("{line}\r\n").as_bytes())
            .await
            .expect("write");
        let mut buf = vec![0; 64 * 1024];
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
            .await
            .expect("redis answers")
            .expect("read");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    /// The server's clock (`TIME`), in milliseconds: the clock the ledger's scripts use.
    pub async fn time_ms(&self) -> u64 {
        let reply = self.command("TIME").await;
        let parts = bulk_strings(&reply);
        let secs: u64 = parts[0].parse().expect("TIME seconds");
        let micros: u64 = parts[1].parse().expect("TIME microseconds");
        secs * 1000 + micros / 1000
    }

    /// When each lease of `pool` expires (the scores of its lease set), in `TIME` milliseconds.
    pub async fn lease_expiries(&self, pool: &str) -> Vec<u64> {
        let reply = self
            .command(&format!("ZRANGE tg:v1:{{{pool}}}:l 0 -1 WITHSCORES"))
            .await;
        bulk_strings(&reply)
            .chunks(2)
            .map(|pair| pair[1].parse().expect("a score"))
            .collect()
    }

    /// Starts watching every command clients send (`MONITOR`); [`Monitor::stop`] returns them.
    pub async fn monitor(&self) -> Monitor {
        let mut stream = UnixStream::connect(self.socket()).await.expect("connect");
        stream.write_all(b"MONITOR\r\n").await.expect("write");
        let mut ok = [0u8; 5];
        stream.read_exact(&mut ok).await.expect("MONITOR answers");
        assert_eq!(&ok, b"+OK\r\n");
        let task = tokio::spawn(async move {
            let mut seen = Vec::new();
            let mut buf = vec![0u8; 64 * 1024];
            while !String::from_utf8_lossy(&seen).contains(MONITOR_END) {
                match stream.read(&mut buf).await {
                    Ok(n) if n > 0 => seen.extend_from_slice(&buf[..n]),
                    _ => break,
                }
            }
            seen
        });
        Monitor {
            socket: self.socket(),
            task,
        }
    }

    async fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut stream) = UnixStream::connect(self.socket()).await
                && stream.write_all(b"PING\r\n").await.is_ok()
            {
                let mut buf = [0; 16];
                if let Ok(Ok(n)) =
                    tokio::time::timeout(Duration::from_secs(1), stream.read(&mut buf)).await
                    && buf[..n].starts_with(b"+PONG")
                {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not answer PING"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// The marker [`Monitor::stop`] sends: every command before it has been seen once it is.
const MONITOR_END: &str = "tokengate-test-monitor-end";

/// Commands seen by [`RedisServer::monitor`].
pub struct Monitor {
    socket: PathBuf,
    task: tokio::task::JoinHandle<Vec<u8>>,
}

impl Monitor {
    /// The names of the commands clients sent (lower case), in order, up to now; commands that
    /// scripts ran (`[... lua]`) are not round trips and are left out.
    pub async fn stop(self) -> Vec<String> {
        let mut stream = UnixStream::connect(&self.socket).await.expect("connect");
        stream
            .write_all(format!("ECHO {MONITOR_END}\r\n").as_bytes())
            .await
            .expect("write");
        let seen = tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .expect("MONITOR shows the marker")
            .expect("monitor task");
        String::from_utf8_lossy(&seen)
            .lines()
            .filter(|line| line.starts_with('+') && !line.contains(" lua] "))
            .filter(|line| !line.contains(MONITOR_END))
            .filter_map(|line| line.split('"').nth(1).map(str::to_ascii_lowercase))
            .collect()
    }
}

/// The bulk strings of a RESP reply, in order (enough for `TIME` and `ZRANGE`).
fn bulk_strings(reply: &str) -> Vec<String> {
    let mut lines = reply.split("\r\n");
    let mut out = Vec::new();
    while let Some(line) = lines.next() {
        if line.starts_with('$') && line != "$-1" {
            out.push(lines.next().unwrap_or_default().to_string());
        }
    }
    out
}

fn spawn(socket: &std::path::Path) -> Child {
    Command::new("redis-server")
        .args(["--port", "0", "--unixsocket"])
        .arg(socket)
        .args([
            "--unixsocketperm",
            "700",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server starts")
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // SIGKILL ends a paused (stopped) server too.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
