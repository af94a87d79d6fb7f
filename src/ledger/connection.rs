//! The Redis ledger's connection: one Redis node, or a Redis Cluster.
//!
//! `ledger.url` names one or the other:
//!
//! - `redis://[user:password@]host:port[/db]` or `redis+unix:///path/to/socket`: one node, through
//!   the `redis` crate's `ConnectionManager` (one multiplexed connection, reconnected on failure).
//! - `redis+cluster://[user:password@]host:port[,host:port...]`: a Redis Cluster, through the
//!   crate's async cluster client. The comma-separated nodes are seeds: the client reads the slot
//!   map from the first that answers (`CLUSTER SLOTS`) and keeps one connection per node. List
//!   more than one, so that a start or a reconnection does not depend on one node. The
//!   credentials apply to every node; a cluster has one database, so no `/db`.
//!
//! Every script call names its pool's keys, which share one hash tag (one slot), so the cluster
//! client sends each `EVALSHA` to the master of that slot, following `MOVED` and `ASK`; a script
//! a node does not have is loaded on every node (`SCRIPT LOAD`, replicas included, so a promoted
//! replica has the scripts already; the load fails while a node in the slot map is down) and the
//! call retried.
//!
//! # Failure semantics
//!
//! A call that fails or times out is the ledger's to handle ([`super::redis`]). On a cluster, a
//! master that dies fails the calls of the pools in its slots until its replica is promoted
//! (`cluster-node-timeout` and the election), while the other masters' pools carry on (if the
//! cluster runs with `cluster-require-full-coverage no`; by default Redis refuses every slot,
//! `CLUSTERDOWN`, while any is uncovered); once promoted, the client finds the new master (its
//! replica of the same shard, or a `MOVED` answer or a lost node that makes it read the slot
//! map again). The health probe (`PING`) goes to every master, so the ledger reports itself
//! available only when every master answers (`tests/it/cluster.rs` has a failover under load,
//! and the probe finding the promoted master with no traffic).

use std::time::Duration;

use redis::{
    Cmd, Pipeline, RedisFuture, Value,
    aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig},
    cluster::{ClusterClient, ClusterConfig},
    cluster_async::ClusterConnection,
};

use super::{LedgerError, scripts::BACKEND};

/// The scheme of a cluster's `ledger.url`.
pub const CLUSTER_SCHEME: &str = "redis+cluster://";

/// Retries of one cluster call (after a redirect, a lost connection, `TRYAGAIN`), all within
/// `ledger.timeout_ms`.
const CLUSTER_RETRIES: u32 = 4;
/// The shortest and longest pause before a cluster call is retried (a slot being moved, a
/// cluster down while it elects), in milliseconds.
const CLUSTER_RETRY_WAIT_MS: (u64, u64) = (10, 100);

/// A connection to one Redis node or to a Redis Cluster; cheap to clone.
#[derive(Clone)]
pub enum Connection {
    Node(ConnectionManager),
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Connection::Node(_) => f.write_str("Connection::Node"),
            Connection::Cluster(_) => f.write_str("Connection::Cluster"),
        }
    }
}

impl Connection {
    /// Sets up the connection `url` names, lazily: nothing is dialled until the first call, so
    /// an unreachable Redis is an error of that call, not of this one. Errors only on a URL that
    /// cannot be used.
    pub fn open(url: &str, timeout: Duration) -> Result<Connection, LedgerError> {
        if let Some(rest) = url.strip_prefix(CLUSTER_SCHEME) {
            let seeds = cluster_seeds(rest).map_err(|e| unusable(&e))?;
            return open_cluster(&seeds, timeout).map(Connection::Cluster);
        }
        let client = redis::Client::open(url).map_err(|e| unusable(&e.to_string()))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_secs(1));
        ConnectionManager::new_lazy_with_config(client, config)
            .map(Connection::Node)
            .map_err(|e| LedgerError {
                backend: BACKEND,
                message: format!("cannot set up the Redis connection (ledger.url): {e}"),
            })
    }
}

/// The cluster client on `seeds`, connecting in the background (the first call waits for it).
fn open_cluster(seeds: &[String], timeout: Duration) -> Result<ClusterConnection, LedgerError> {
    let (min_wait, max_wait) = CLUSTER_RETRY_WAIT_MS;
    let client = ClusterClient::builder(seeds.iter().map(String::as_str))
        .retries(CLUSTER_RETRIES)
        .min_retry_wait(min_wait)
        .max_retry_wait(max_wait)
        .build()
        .map_err(|e| unusable(&e.to_string()))?;
    let config = ClusterConfig::new()
        .set_connection_timeout(timeout)
        .set_response_timeout(timeout);
    Ok(client.get_pending_async_connection_with_config(config))
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Node(conn) => conn.req_packed_command(cmd),
            Connection::Cluster(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Node(conn) => conn.req_packed_commands(pipeline, offset, count),
            Connection::Cluster(conn) => conn.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Node(conn) => conn.get_db(),
            Connection::Cluster(conn) => conn.get_db(),
        }
    }
}

/// The seeds of a cluster URL (what follows `redis+cluster://`), each as a `redis://` URL
/// carrying the credentials: `[user:password@]host:port[,host:port...]`.
pub fn cluster_seeds(rest: &str) -> Result<Vec<String>, String> {
    let (userinfo, hosts) = match rest.rsplit_once('@') {
        Some((userinfo, hosts)) => (Some(userinfo), hosts),
        None => (None, rest),
    };
    if hosts.contains(['/', '?', '#']) {
        return Err(
            "a cluster URL names its nodes only (a cluster has one database: no /db, no options)"
                .into(),
        );
    }
    hosts
        .split(',')
        .map(|seed| match seed.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0) => {
                Ok(match userinfo {
                    Some(userinfo) => format!("redis://{userinfo}@{seed}"),
                    None => format!("redis://{seed}"),
                })
            }
            // Never echo the seed: the URL may hold a password.
            _ => Err("each cluster node is host:port, separated by commas".into()),
        })
        .collect()
}

fn unusable(reason: &str) -> LedgerError {
    LedgerError {
        backend: BACKEND,
        message: format!("ledger.url is not a usable Redis URL: {reason}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_seeds_carry_the_credentials_to_every_node() {
        assert_eq!(
            cluster_seeds("10.0.0.1:6379,10.0.0.2:6380").unwrap(),
            ["redis://10.0.0.1:6379", "redis://10.0.0.2:6380"]
        );
        assert_eq!(
            cluster_seeds("app:p%40ss@redis-0:7000,redis-1:7000").unwrap(),
            [
                "redis://app:p%40ss@redis-0:7000",
                "redis://app:p%40ss@redis-1:7000"
            ]
        );
        assert_eq!(cluster_seeds("[::1]:7000").unwrap(), ["redis://[::1]:7000"]);
    }

    #[test]
    fn cluster_seeds_refuse_what_a_cluster_cannot_use() {
        for bad in [
            "", "host", "host:", ":7000", "host:0", "a:1,,b:2", "a:1/0", "a:1?x=y",
        ] {
            let e = cluster_seeds(bad).expect_err(bad);
            assert!(
                e.contains("host:port") || e.contains("one database"),
                "{bad}: {e}"
            );
        }
        let e = cluster_seeds("user:secret@host").expect_err("no port");
        assert!(!e.contains("secret"), "{e}");
    }
}
