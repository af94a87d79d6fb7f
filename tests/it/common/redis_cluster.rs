//! Redis on loopback TCP ports: a node (`redis-server` on a free port, in cluster mode or not)
//! and a Redis Cluster of them (`redis-cli --cluster create`), each waited for by polling the
//! servers, never by sleeping a fixed time; every server is killed when its handle drops.
//!
//! Used by the integration tests (through `common/mod.rs`, which turns a missing `redis-server`
//! or `redis-cli` into a visible skip) and by the load generator (`loadtest/src/redis.rs`
//! includes this file by path), so it uses std and tokio only and reports what is missing as an
//! error instead of skipping.

use std::{
    net::TcpListener,
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    net::TcpStream,
};

/// How long a cluster node waits before it calls a silent peer failed (and its replica takes
/// over): short, so that a failover in a test takes about two seconds.
const NODE_TIMEOUT_MS: u64 = 1000;
/// How long starting and settling may take before it is a failure.
const SETTLE: Duration = Duration::from_secs(30);

/// Whether `redis-server` (and, for a cluster, `redis-cli`) can be run here: `None` if so, else
/// what to install.
pub fn missing_tools(cluster: bool) -> Option<&'static str> {
    let runs = |tool: &str| {
        Command::new(tool)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok()
    };
    if !runs("redis-server") || (cluster && !runs("redis-cli")) {
        return Some(
            "redis-server and redis-cli are not on PATH (apt-get install -y redis-server)",
        );
    }
    None
}

/// One `redis-server` on a loopback port, without persistence.
#[derive(Debug)]
pub struct RedisNode {
    pub port: u16,
    child: Child,
}

impl RedisNode {
    /// Starts a server in `dir` and waits until it answers `PING`. In cluster mode its cluster
    /// bus gets a free port of its own. A port taken between choosing and binding makes the
    /// server exit: then it is tried again on other ports.
    pub async fn start(dir: &Path, cluster: bool) -> Result<RedisNode, String> {
        let mut last = String::new();
        for _ in 0..5 {
            let port = free_port()?;
            let mut args = vec![
                "--port".to_string(),
                port.to_string(),
                "--bind".into(),
                "127.0.0.1".into(),
                "--save".into(),
                String::new(),
                "--appendonly".into(),
                "no".into(),
            ];
            if cluster {
                args.extend(
                    [
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        &format!("nodes-{port}.conf"),
                        "--cluster-port",
                        &free_port()?.to_string(),
                        "--cluster-node-timeout",
                        &NODE_TIMEOUT_MS.to_string(),
                        // A replica always stands for election, however long its master has
                        // been quiet (the default refuses after ten node timeouts of silence).
                        "--cluster-replica-validity-factor",
                        "0",
                        // The masters that are up keep serving their slots while another's
                        // fail over (the default stops the whole cluster: CLUSTERDOWN).
                        "--cluster-require-full-coverage",
                        "no",
                    ]
                    .map(String::from),
                );
            }
            let child = Command::new("redis-server")
                .args(&args)
                .current_dir(dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| format!("redis-server: {e}"))?;
            let mut node = RedisNode { port, child };
            match node.wait_ready().await {
                Ok(()) => return Ok(node),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Kills the server (SIGKILL): it stops answering at once, as a lost machine does.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    async fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + SETTLE;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!(
                    "redis-server on port {} exited: {status}",
                    self.port
                ));
            }
            if let Ok(reply) = command(self.port, "PING").await
                && reply == "PONG"
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "redis-server on port {} did not answer PING",
                    self.port
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for RedisNode {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A Redis Cluster on loopback: `masters` masters, each with `replicas` replicas.
#[derive(Debug)]
pub struct RedisCluster {
    pub nodes: Vec<RedisNode>,
}

impl RedisCluster {
    /// Starts the nodes in `dir`, joins them (`redis-cli --cluster create`, the slots split
    /// evenly over the masters) and waits until every node says the cluster is ok, knows every
    /// other node, and every replica is in sync with its master.
    pub async fn start(
        dir: &Path,
        masters: usize,
        replicas: usize,
    ) -> Result<RedisCluster, String> {
        let mut nodes = Vec::new();
        for _ in 0..masters * (1 + replicas) {
            nodes.push(RedisNode::start(dir, true).await?);
        }
        let cluster = RedisCluster { nodes };
        let mut create = tokio::process::Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for node in &cluster.nodes {
            create.arg(format!("127.0.0.1:{}", node.port));
        }
        let out = create
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .await
            .map_err(|e| format!("redis-cli: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "redis-cli --cluster create failed: {}",
                String::from_utf8_lossy(&out.stdout)
            ));
        }
        cluster.wait_settled(None).await?;
        Ok(cluster)
    }

    /// `redis+cluster://` with every node as a seed: `ledger.url`.
    pub fn url(&self) -> String {
        let seeds: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis+cluster://{}", seeds.join(","))
    }

    /// The port of the live master that serves `key`'s slot, as a live node sees the cluster.
    pub async fn master_of(&self, key: &str) -> Result<u16, String> {
        let port = self.live_port()?;
        let slot: u16 = command(port, &format!("CLUSTER KEYSLOT {key}"))
            .await?
            .parse()
            .map_err(|e| format!("CLUSTER KEYSLOT: {e}"))?;
        let nodes = command(port, "CLUSTER NODES").await?;
        nodes
            .lines()
            .find_map(|line| master_serving(line, slot))
            .ok_or_else(|| format!("no live master serves slot {slot}:\n{nodes}"))
    }

    /// Kills the node on `port` (SIGKILL).
    pub fn kill(&mut self, port: u16) {
        if let Some(node) = self.nodes.iter_mut().find(|n| n.port == port) {
            node.kill();
        }
        self.nodes.retain(|n| n.port != port);
    }

    /// After the master of `key` on `dead` was killed: waits until a replica took its slots over
    /// and every live node says the cluster is ok again; returns the new master's port.
    pub async fn wait_failover(&self, key: &str, dead: u16) -> Result<u16, String> {
        let deadline = Instant::now() + SETTLE;
        loop {
            if let Ok(port) = self.master_of(key).await
                && port != dead
            {
                self.wait_settled(Some(dead)).await?;
                return Ok(port);
            }
            if Instant::now() > deadline {
                return Err(format!("no replica took over from port {dead}"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn live_port(&self) -> Result<u16, String> {
        self.nodes
            .first()
            .map(|n| n.port)
            .ok_or_else(|| "no live node".to_string())
    }

    /// Polls every node until the cluster is ok, each knows every node (the `dead` one
    /// included: it stays known, flagged failed), and every replica's link is up.
    async fn wait_settled(&self, dead: Option<u16>) -> Result<(), String> {
        let deadline = Instant::now() + SETTLE;
        let known = self.nodes.len() + usize::from(dead.is_some());
        let mut last = String::new();
        loop {
            match self.settled(known).await {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => last = e,
            }
            if Instant::now() > deadline {
                return Err(format!("the cluster did not settle: {last}"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn settled(&self, known: usize) -> Result<bool, String> {
        for node in &self.nodes {
            let info = command(node.port, "CLUSTER INFO").await?;
            let says = |field: &str, value: &str| {
                info.lines().any(|l| l.trim() == format!("{field}:{value}"))
            };
            if !says("cluster_state", "ok") || !says("cluster_known_nodes", &known.to_string()) {
                return Ok(false);
            }
            let replication = command(node.port, "INFO replication").await?;
            if replication.contains("role:slave") && !replication.contains("master_link_status:up")
            {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// The port of the node on this `CLUSTER NODES` line if it is a live master serving `slot`.
fn master_serving(line: &str, slot: u16) -> Option<u16> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    let (addr, flags) = (fields.get(1)?, fields.get(2)?);
    if !flags.split(',').any(|f| f == "master") || flags.contains("fail") {
        return None;
    }
    let serves = fields.iter().skip(8).any(|range| {
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        matches!((lo.parse::<u16>(), hi.parse::<u16>()), (Ok(lo), Ok(hi)) if (lo..=hi).contains(&slot))
    });
    let port = addr.split('@').next()?.rsplit_once(':')?.1.parse().ok()?;
    serves.then_some(port)
}

/// Sends one inline command to the node on `port`; the reply as text (a simple or bulk string,
/// or an integer), or the error it answered.
pub async fn command(port: u16, line: &str) -> Result<String, String> {
    let exchange = async {
        let mut stream = TcpStream::connect(("127.0.0.1", port))
            .await
            .map_err(|e| e.to_string())?;
        stream
            .write_all(format!("{line}\r\n").as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let mut reader = BufReader::new(stream);
        let mut head = String::new();
        reader
            .read_line(&mut head)
            .await
            .map_err(|e| e.to_string())?;
        let head = head.trim_end();
        match head.split_at_checked(1) {
            Some(("+" | ":", value)) => Ok(value.to_string()),
            Some(("$", len)) => {
                let len: usize = len.parse().map_err(|_| format!("bad reply {head:?}"))?;
                let mut body = vec![0; len + 2];
                reader
                    .read_exact(&mut body)
                    .await
                    .map_err(|e| e.to_string())?;
                body.truncate(len);
                String::from_utf8(body).map_err(|e| e.to_string())
            }
            _ => Err(format!("{line}: {head}")),
        }
    };
    tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .map_err(|_| format!("{line}: no answer from port {port}"))?
}

/// A port nobody listens on now (the kernel's choice for port 0).
fn free_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port: {e}"))
}
