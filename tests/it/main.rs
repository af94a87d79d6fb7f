//! The integration suite: one binary, one module per surface. The simulator and the proxy run on
//! `127.0.0.1:0`, driven by real clients (aws-sdk-bedrockruntime, raw sockets, raw h2 frames), and
//! every test ends with the ledger back at zero. Shared helpers live in [`common`].
//!
//! | module | what it covers |
//! |---|---|
//! | `proxy` | every operation through the proxy equals the same call direct to the simulator |
//! | `apis`, `apis_auth`, `apis_faults` | the OpenAI and Anthropic APIs: settlement, streams, each API's errors; credentials and ceilings; faults and the access log |
//! | `admission` | rejections and their hints, never-fitting requests, settlement on every path |
//! | `daily_quota` | daily quotas: upstream's daily 429, a pool's `tokens_per_day`, the account's day across pools |
//! | `route_limits` | a route's budgets and max_concurrency across pools: refusals, hints, what is left |
//! | `tiers` | service tiers: reserved capacity first, overflowing to on-demand; the tier from the body or the header |
//! | `adaptive`, `adaptive_decisions`, `adaptive_retry` | adaptive maxTokens: the learned cap written in each API's field, reserved and raised; shadow, calls without maxTokens, spilled calls; the retry of a call the cap stopped |
//! | `max_tokens_missing` | requests naming no maxTokens: the model maximum reserved, the default injected, or refused |
//! | `queue`, `queue_fleet` | the admission queue (paused clock), and a closed-loop SDK fleet against it |
//! | `routes` | application routes and caller identity: keys, allow-lists, shares, recovery |
//! | `saturation` | the product's promise under saturating load: no upstream throttle, the quota busy |
//! | `ledger_contract`, `ledger_differential`, `ledger_leases`, `leases_hold_back`, `redis`, `cluster` | what every ledger backend must do (the memory ledger, Redis, Redis with local capacity leases, a Redis Cluster); the memory and Redis ledgers giving the same answers to the same random operations; local capacity leases never admitting more than the exact bucket, across replicas, and deciding a burndown pool's calls with a stream in flight from the slice; the shared ledger end to end; on a Redis Cluster, pools over the masters and a master's failover under load |
//! | `reload`, `lifecycle` | config reload; shutdown through the real binary |
//! | `access_log`, `observability`, `dashboards`, `admin` | what operators see: the log line, metrics, the dashboard and alerts, the admin endpoints |
//! | `dashboard_prometheus`, `tracing`, `emf`, `quota_report`, `top` | what operators run it with (issue #20): the dashboard and alerts on a real Prometheus, OpenTelemetry spans at OTLP receivers (every API's calls, a speech session's too), CloudWatch EMF lines, the quota report, `tokengate top` in tmux |
//! | `bad_input`, `client_faults`, `upstream_faults` | bad requests, misbehaving clients, misbehaving upstreams |
//! | `upstream_h2` | HTTP/2 upstream: more streams than one connection carries, the connection set (spread, replaced, closed when idle), its metrics |
//! | `security_request`, `security_transport`, `security_bodies` | the attacks of issue #14, one test each |
//! | `iam_policy` | the README's IAM policy against the forwarded operations |
//! | `simulator` | the simulator on its own: Bedrock's arithmetic and wire shapes, with real clients |
//! | `spillover`, `spillover_property` | pools in several Regions, each signed for its own; spill chains between pools, and all or nothing across a chain under concurrency on both ledgers |
//! | `endpoints` | SageMaker endpoint pools with aws-sdk-sagemakerruntime: the per-copy limit, the queue, hints, the copies from the control plane |
//! | `bidi`, `bidi_raw` | InvokeModelWithBidirectionalStream through the proxy: the Rust SDK's sessions, and raw HTTP/2 where the SDK cannot say it |

mod common;

mod access_log;
mod adaptive;
mod adaptive_decisions;
mod adaptive_retry;
mod admin;
mod admission;
mod apis;
mod apis_auth;
mod apis_faults;
mod bad_input;
mod bidi;
mod bidi_raw;
mod client_faults;
mod cluster;
mod daily_quota;
mod dashboard_prometheus;
mod dashboards;
mod emf;
mod endpoints;
mod iam_policy;
mod leases_hold_back;
mod ledger_contract;
mod ledger_differential;
mod ledger_leases;
mod lifecycle;
mod max_tokens_missing;
mod observability;
mod proxy;
mod queue;
mod queue_fleet;
mod quota_report;
mod redis;
mod reload;
mod route_limits;
mod router;
mod routes;
mod saturation;
mod security_bodies;
mod security_request;
mod security_transport;
mod simulator;
mod spillover;
mod spillover_property;
mod tiers;
mod top;
mod tracing;
mod upstream_faults;
mod upstream_h2;
