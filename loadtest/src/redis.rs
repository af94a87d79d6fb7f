//! The shared ledger a scenario's replicas stand on (`ledger = "redis"` or `"redis-cluster"`):
//! one `redis-server`, or a three-master Redis Cluster, on loopback ports in the output
//! directory, started before the proxies and killed after them. The servers are the tests' own
//! harness (`tests/it/common/redis_cluster.rs`), included here by path.

use std::path::Path;

use anyhow::{Context, bail};

use crate::scenario::LedgerKind;

// The tests' harness; the failover helpers are theirs alone.
#[allow(dead_code)]
#[path = "../../tests/it/common/redis_cluster.rs"]
mod harness;

use harness::{RedisCluster, RedisNode};

/// A running Redis or Redis Cluster; dropping it kills the servers.
#[derive(Debug)]
pub enum SharedLedger {
    Node(RedisNode),
    Cluster(RedisCluster),
}

/// Masters of the cluster scenario: pools spread over them by slot.
const CLUSTER_MASTERS: usize = 3;

impl SharedLedger {
    /// Starts what `kind` names under `dir` (`None` for the memory ledger).
    pub async fn start(kind: LedgerKind, dir: &Path) -> anyhow::Result<Option<SharedLedger>> {
        let cluster = match kind {
            LedgerKind::Memory => return Ok(None),
            LedgerKind::Redis => false,
            LedgerKind::RedisCluster => true,
        };
        if let Some(missing) = harness::missing_tools(cluster) {
            bail!("ledger = {kind:?} needs Redis: {missing}");
        }
        std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
        let started = if cluster {
            RedisCluster::start(dir, CLUSTER_MASTERS, 0)
                .await
                .map(SharedLedger::Cluster)
        } else {
            RedisNode::start(dir, false).await.map(SharedLedger::Node)
        };
        started.map(Some).map_err(anyhow::Error::msg)
    }

    /// The proxies' `ledger.url`.
    pub fn url(&self) -> String {
        match self {
            SharedLedger::Node(node) => format!("redis://127.0.0.1:{}", node.port),
            SharedLedger::Cluster(cluster) => cluster.url(),
        }
    }
}
