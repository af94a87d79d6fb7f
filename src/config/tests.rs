//! Config validation: one case per rule, each error naming its key.
//! (Over 500 lines: the cases of every section, with the helpers they share.)

use std::time::Duration;

use super::*;

const MINIMAL: &str = r#"
[server]
listen = "127.0.0.1:8080"

[upstream]
region = "us-east-1"
endpoint = "simulated"

[ledger]
backend = "memory"

[[pools]]
name = "sonnet4-us"
models = ["us.anthropic.claude-sonnet-4-20250514-v1:0"]
tokens_per_minute = 200000
max_concurrency = 32
output_burndown = 5
default_max_tokens = 8192
"#;

#[test]
fn the_documented_minimal_config_parses() {
    let config = Config::parse(MINIMAL).unwrap();
    assert_eq!(config.process.server.listen.port(), 8080);
    assert_eq!(config.process.upstream.endpoint, Endpoint::Simulated);
    assert_eq!(config.process.upstream.http, UpstreamHttp::Auto);
    assert_eq!(config.process.upstream.h2_streams_per_connection, 100);
    assert_eq!(config.process.ledger, LedgerConfig::Memory);
    let pool = &config.policy.pools[0];
    assert_eq!(pool.name, "sonnet4-us");
    assert_eq!(pool.region, "us-east-1");
    assert_eq!(pool.usable_tokens_per_minute(), 200_000);
    assert_eq!(pool.input_estimate, InputEstimate::Heuristic);
    assert_eq!(pool.bidirectional_reservation, 8192, "default_max_tokens");
    let own = Config::parse(&format!("{MINIMAL}bidirectional_reservation = 2000\n")).unwrap();
    assert_eq!(own.policy.pools[0].bidirectional_reservation, 2000);
}

/// Applies `edit` to the minimal config and returns the error message.
fn error_of(edit: impl Fn(&str) -> String) -> String {
    Config::parse(&edit(MINIMAL))
        .expect_err("config should be refused")
        .to_string()
}

type Edit = Box<dyn Fn(&str) -> String>;

#[test]
fn each_invalid_setting_names_its_key() {
    let cases: Vec<(Edit, &str)> = vec![
        (
            Box::new(|c| c.replace("tokens_per_minute = 200000", "tokens_per_minute = 0")),
            "pools[0] (sonnet4-us).tokens_per_minute: must be greater than zero",
        ),
        (
            Box::new(|c| c.replace("max_concurrency = 32", "max_concurrency = 0")),
            "pools[0] (sonnet4-us).max_concurrency: must be greater than zero",
        ),
        (
            Box::new(|c| c.replace("output_burndown = 5", "output_burndown = 0")),
            "pools[0] (sonnet4-us).output_burndown: must be at least 1",
        ),
        (
            Box::new(|c| c.replace("default_max_tokens = 8192", "default_max_tokens = 300000")),
            "pools[0] (sonnet4-us).default_max_tokens: 300000 does not fit",
        ),
        (
            Box::new(|c| format!("{c}bidirectional_reservation = 300000\n")),
            "pools[0] (sonnet4-us).bidirectional_reservation: 300000 does not fit",
        ),
        (
            Box::new(|c| format!("{c}bidirectional_reservation = 0\n")),
            "pools[0] (sonnet4-us).bidirectional_reservation: must be greater than zero",
        ),
        (
            Box::new(|c| format!("{c}headroom = 1.5\n")),
            "pools[0] (sonnet4-us).headroom: must be a fraction",
        ),
        (
            Box::new(|c| {
                format!(
                    "{c}\n[[pools]]\nname = \"dup\"\nmodels = [\"us.anthropic.claude-sonnet-4-20250514-v1:0\"]\ntokens_per_minute = 1000\nmax_concurrency = 1\noutput_burndown = 1\ndefault_max_tokens = 10\n"
                )
            }),
            "pools[1] (dup).models: \"us.anthropic.claude-sonnet-4-20250514-v1:0\" is already in pool \"sonnet4-us\"",
        ),
        (
            Box::new(|c| c.replace("listen = \"127.0.0.1:8080\"", "listen = \"localhost\"")),
            "server.listen:",
        ),
        (
            Box::new(|c| {
                c.replace(
                    "listen = \"127.0.0.1:8080\"",
                    "listen = \"127.0.0.1:8080\"\nadmin_listen = \":9090\"",
                )
            }),
            "server.admin_listen: \":9090\" is not an address",
        ),
        (
            Box::new(|c| c.replace("backend = \"memory\"", "backend = \"etcd\"")),
            "unknown variant `etcd`, expected `memory` or `redis`",
        ),
        (
            Box::new(|c| c.replace("backend = \"memory\"", "backend = \"redis\"")),
            "ledger.url: backend = \"redis\" needs url",
        ),
        (
            Box::new(|c| {
                c.replace(
                    "backend = \"memory\"",
                    "backend = \"memory\"\nlease_secs = 60",
                )
            }),
            "ledger.lease_secs: only the redis backend takes this key",
        ),
        (
            Box::new(|c| {
                c.replace(
                    "backend = \"memory\"",
                    "backend = \"redis\"\nurl = \"rediss://h:6379\"",
                )
            }),
            "ledger.url: TLS (rediss://) is not supported",
        ),
        (
            Box::new(|c| {
                c.replace(
                    "backend = \"memory\"",
                    "backend = \"redis\"\nurl = \"redis://h\"\non_error = \"local\"",
                )
            }),
            "ledger.expected_replicas: on_error = \"local\" needs expected_replicas",
        ),
        (
            Box::new(|c| {
                c.replace(
                    "backend = \"memory\"",
                    "backend = \"redis\"\nurl = \"redis://h\"\nexpected_replicas = 3",
                )
            }),
            "ledger.expected_replicas: only on_error = \"local\" uses it",
        ),
        (
            Box::new(|c| {
                c.replace(
                    "backend = \"memory\"",
                    "backend = \"redis\"\nurl = \"redis://h\"\non_error = \"open\"",
                )
            }),
            "unknown variant `open`, expected `fail-closed` or `local`",
        ),
        (
            Box::new(|c| {
                c.replace(
                    "backend = \"memory\"",
                    "backend = \"redis\"\nurl = \"redis://h\"\ntimeout_ms = 1000\nlease_secs = 2",
                )
            }),
            "ledger.lease_secs: must be longer than three ledger.timeout_ms",
        ),
        (
            Box::new(|c| c.replace("[ledger]", "[ledger]\nlocal_leases = {}")),
            "ledger.local_leases: only the redis backend takes this key",
        ),
        (
            Box::new(|c| {
                c.replace(
                    "backend = \"memory\"",
                    "backend = \"redis\"\nurl = \"redis://h\"\nlocal_leases = { max_fraction = 0.0 }",
                )
            }),
            "ledger.local_leases.max_fraction: must be a fraction in (0, 1]",
        ),
        (
            Box::new(|c| {
                c.replace(
                    "backend = \"memory\"",
                    "backend = \"redis\"\nurl = \"redis://h\"\nlease_secs = 3\nlocal_leases = { max_age_ms = 1500 }",
                )
            }),
            "ledger.local_leases.max_age_ms: must be at least horizon_ms and at most a third of ledger.lease_secs",
        ),
        (
            Box::new(|c| c.replace("endpoint = \"simulated\"", "endpoint = \"ftp://x\"")),
            "upstream.endpoint:",
        ),
        (
            Box::new(|c| c.replace("region = \"us-east-1\"", "region = \"US East\"")),
            "upstream.region:",
        ),
        (
            Box::new(|c| {
                c.replace(
                    "endpoint = \"simulated\"",
                    "endpoint = \"simulated\"\nhttp = \"h2\"",
                )
            }),
            "upstream.http: \"h2\": write \"auto\"",
        ),
        (
            Box::new(|c| {
                c.replace(
                    "endpoint = \"simulated\"",
                    "endpoint = \"simulated\"\nh2_streams_per_connection = 0",
                )
            }),
            "upstream.h2_streams_per_connection: must be greater than zero",
        ),
        (
            Box::new(|c| {
                c.replace(
                    "endpoint = \"simulated\"",
                    "endpoint = \"simulated\"\nh2_streams_per_connection = 2147483648",
                )
            }),
            "upstream.h2_streams_per_connection: must be at most 2147483647",
        ),
        (
            Box::new(|c| c.replace("[ledger]", "[ledger]\ncolour = \"blue\"")),
            "unknown field `colour`",
        ),
    ];
    for (edit, expected) in cases {
        let message = error_of(edit);
        assert!(
            message.contains(expected),
            "expected {expected:?} in {message:?}"
        );
    }
}

#[test]
fn the_redis_ledger_keys_parse_with_defaults() {
    let redis = |extra: &str| {
        let text = MINIMAL.replace(
            "backend = \"memory\"",
            &format!("backend = \"redis\"\nurl = \"redis://10.0.0.5:6379\"\n{extra}"),
        );
        match Config::parse(&text).unwrap().process.ledger {
            LedgerConfig::Redis(r) => r,
            other => panic!("{other:?}"),
        }
    };
    let defaults = redis("");
    assert_eq!(defaults.url, "redis://10.0.0.5:6379");
    assert_eq!(defaults.timeout, Duration::from_millis(250));
    assert_eq!(defaults.lease, Duration::from_secs(600));
    assert_eq!(defaults.on_error, OnLedgerError::FailClosed);
    assert_eq!(defaults.local_leases, None, "off unless asked for");
    let leases = redis("local_leases = {}").local_leases;
    assert_eq!(
        leases,
        Some(crate::config::LocalLeasesConfig {
            horizon: Duration::from_millis(250),
            max_fraction: 0.1,
            max_age: Duration::from_secs(2),
        })
    );
    let leases =
        redis("local_leases = { horizon_ms = 100, max_fraction = 0.25, max_age_ms = 500 }");
    assert_eq!(
        leases
            .local_leases
            .map(|l| (l.horizon, l.max_fraction, l.max_age)),
        Some((Duration::from_millis(100), 0.25, Duration::from_millis(500)))
    );
    let local =
        redis("timeout_ms = 50\nlease_secs = 30\non_error = \"local\"\nexpected_replicas = 4");
    assert_eq!(local.timeout, Duration::from_millis(50));
    assert_eq!(local.lease, Duration::from_secs(30));
    assert_eq!(
        local.on_error,
        OnLedgerError::Local {
            expected_replicas: 4
        }
    );
}

#[test]
fn a_redis_cluster_url_is_accepted() {
    let text = MINIMAL.replace(
        "backend = \"memory\"",
        "backend = \"redis\"\nurl = \"redis+cluster://10.0.0.5:7000,10.0.0.6:7000\"",
    );
    match Config::parse(&text).unwrap().process.ledger {
        LedgerConfig::Redis(r) => assert_eq!(r.url, "redis+cluster://10.0.0.5:7000,10.0.0.6:7000"),
        other => panic!("{other:?}"),
    }
    let bad = MINIMAL.replace(
        "backend = \"memory\"",
        "backend = \"redis\"\nurl = \"cluster://10.0.0.5:7000\"",
    );
    let e = Config::parse(&bad).unwrap_err().to_string();
    assert!(
        e.starts_with("ledger.url:") && e.contains("redis+cluster://host1:6379,host2:6379"),
        "{e}"
    );
}

#[test]
fn every_shipped_config_parses() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut checked = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            Config::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            checked += 1;
        }
    }
    assert!(checked >= 1);
}

#[test]
fn the_redis_url_can_come_from_an_environment_variable() {
    let text = MINIMAL.replace(
        "backend = \"memory\"",
        "backend = \"redis\"\nurl_env = \"TOKENGATE_REDIS_URL\"",
    );
    let env = |name: &str| {
        (name == "TOKENGATE_REDIS_URL")
            .then(|| "redis://:s3cret@redis.tokengate:6379/0".to_string())
    };
    match Config::parse_with_env(&text, &env).unwrap().process.ledger {
        LedgerConfig::Redis(r) => assert_eq!(r.url, "redis://:s3cret@redis.tokengate:6379/0"),
        other => panic!("{other:?}"),
    }

    let error = |text: &str, env: &Env| Config::parse_with_env(text, env).unwrap_err().to_string();
    let unset = error(&text, &|_| None);
    assert!(
        unset
            .starts_with("ledger.url_env: the environment variable TOKENGATE_REDIS_URL is not set"),
        "{unset}"
    );
    assert_eq!(error(&text, &|_| Some(String::new())), unset);
    // A bad URL is blamed on the variable, and its value (which may hold a password) is not shown.
    let bad = error(&text, &|_| Some("rediss://:s3cret@h:6379".to_string()));
    assert!(
        bad.starts_with("ledger.url_env (TOKENGATE_REDIS_URL): TLS (rediss://) is not supported"),
        "{bad}"
    );
    assert!(!bad.contains("s3cret"), "{bad}");
    let both = text.replace("url_env", "url = \"redis://h:6379\"\nurl_env");
    assert_eq!(
        error(&both, &env),
        "ledger.url_env: set url or url_env, not both"
    );
    let memory = MINIMAL.replace(
        "backend = \"memory\"",
        "backend = \"memory\"\nurl_env = \"X\"",
    );
    assert_eq!(
        error(&memory, &env),
        "ledger.url_env: only the redis backend takes this key"
    );
}

/// The base config of the route tests: one pool `sonnet4-us`, TLS off.
fn with_routes(routes: &str) -> Result<Config, ConfigError> {
    Config::parse(&format!("{MINIMAL}\n{routes}\n"))
}

#[test]
fn routes_default_to_one_implicit_route() {
    let config = with_routes("").expect("no routes");
    assert_eq!(config.policy.auth.mode, AuthMode::None);
    assert_eq!(config.policy.auth.default_route, "default");
    assert_eq!(config.policy.routes.len(), 1);
    assert_eq!(config.policy.routes[0].name, "default");
    let one = with_routes("[[routes]]\nname = \"app\"\n").expect("one route");
    assert_eq!(one.policy.auth.default_route, "app");
}

#[test]
fn route_settings_parse() {
    let config = with_routes(
        "[auth]\nmode = \"sigv4\"\n\n[[routes]]\nname = \"triage\"\npriority = 10\n\
         access_key_id = \"AKIATRIAGE0000000001\"\nsecret_access_key_env = \"TG_TEST_TRIAGE_SECRET\"\n\
         max_tokens_ceiling = 2000\nmax_tokens_policy = \"reject\"\nrecovery_budget = 0.05\n\
         [routes.shares]\nsonnet4-us = { min = 0.6, max = 0.9 }\n",
    );
    // The secret comes from the environment: absent, the error names the key and the variable.
    let err = config.expect_err("variable not set").to_string();
    assert!(
        err.contains("routes[0] (triage).secret_access_key_env")
            && err.contains("TG_TEST_TRIAGE_SECRET"),
        "{err}"
    );
    let text = "[auth]\nmode = \"sigv4\"\n\n[[routes]]\nname = \"triage\"\npriority = 10\n\
         access_key_id = \"AKIATRIAGE0000000001\"\nsecret_access_key = \"s3cret\"\n\
         max_tokens_ceiling = 2000\nmax_tokens_policy = \"reject\"\nrecovery_budget = 0.05\n\
         [routes.shares]\nsonnet4-us = { min = 0.6, max = 0.9 }\n";
    let config = with_routes(text).expect("valid");
    let r = &config.policy.routes[0];
    assert_eq!((r.priority, r.max_tokens_ceiling), (10, Some(2000)));
    assert_eq!(r.max_tokens_policy, MaxTokensPolicy::Reject);
    assert_eq!(
        r.shares["sonnet4-us"],
        ShareConfig {
            min: 0.6,
            max: Some(0.9)
        }
    );
    assert!(!format!("{r:?}").contains("s3cret"), "secrets never print");
}

#[test]
fn each_invalid_route_setting_names_its_key() {
    let sha = "a".repeat(64);
    let cases = [
        (
            "[auth]\nmode = \"oauth\"\n",
            "unknown variant `oauth`, expected one of `none`, `bearer`, `sigv4`",
        ),
        (
            "[auth]\nmode = \"bearer\"\n[[routes]]\nname = \"a\"\nbearer_token_sha256 = \"SHA\"\n",
            "auth.mode: \"bearer\" sends keys in the clear without TLS",
        ),
        (
            "[auth]\nmode = \"bearer\"\nallow_plaintext_bearer = true\n[[routes]]\nname = \"a\"\n",
            "routes[0] (a).bearer_token_sha256: auth.mode = \"bearer\" needs",
        ),
        (
            "[auth]\nmode = \"bearer\"\nallow_plaintext_bearer = true\n[[routes]]\nname = \"a\"\nbearer_token_sha256 = \"xyz\"\n",
            "routes[0] (a).bearer_token_sha256: must be 64 hex digits",
        ),
        (
            "[auth]\nmode = \"sigv4\"\n[[routes]]\nname = \"a\"\naccess_key_id = \"AKIA0000000000000001\"\n",
            "routes[0] (a).access_key_id: auth.mode = \"sigv4\" needs",
        ),
        (
            "[auth]\nmode = \"sigv4\"\n",
            "routes: auth.mode = \"sigv4\" needs at least one",
        ),
        (
            "[[routes]]\nname = \"a\"\n[[routes]]\nname = \"a\"\n",
            "routes[1].name: \"a\" names two routes",
        ),
        ("[[routes]]\nname = \"a b\"\n", "routes[0] (a b).name"),
        (
            "[[routes]]\nname = \"a\"\n[[routes]]\nname = \"b\"\n",
            "auth.default_route: with auth.mode = \"none\" and several routes",
        ),
        (
            "[auth]\ndefault_route = \"x\"\n[[routes]]\nname = \"a\"\n",
            "auth.default_route: \"x\" is not the name",
        ),
        (
            "[[routes]]\nname = \"a\"\nmodels = [\"m.unknown\"]\n",
            "routes[0] (a).models: \"m.unknown\" is in no pool",
        ),
        (
            "[[routes]]\nname = \"a\"\nmax_tokens_ceiling = 0\n",
            "routes[0] (a).max_tokens_ceiling: must be greater than zero",
        ),
        (
            "[[routes]]\nname = \"a\"\nmax_tokens_policy = \"cut\"\n",
            "unknown variant `cut`, expected `clamp` or `reject`",
        ),
        (
            "[[routes]]\nname = \"a\"\nrecovery_budget = 2.0\n",
            "routes[0] (a).recovery_budget",
        ),
        (
            "[[routes]]\nname = \"a\"\n[routes.shares]\nnope = { min = 0.1 }\n",
            "routes[0] (a).shares.nope: there is no pool",
        ),
        (
            "[[routes]]\nname = \"a\"\n[routes.shares]\nsonnet4-us = { min = 0.5, max = 0.4 }\n",
            "routes[0] (a).shares.sonnet4-us: max must be",
        ),
        (
            "[auth]\ndefault_route = \"a\"\n[[routes]]\nname = \"a\"\n[routes.shares]\nsonnet4-us = { min = 0.7 }\n[[routes]]\nname = \"b\"\n[routes.shares]\nsonnet4-us = { min = 0.4 }\n",
            "routes.shares: the min shares of pool \"sonnet4-us\" add up to 1.100",
        ),
        (
            "[admission]\npriority_margin = 0.7\n",
            "admission.priority_margin: must be a fraction",
        ),
    ];
    for (routes, want) in cases {
        let routes = routes.replace("SHA", &sha);
        let err = with_routes(&routes).expect_err(&routes).to_string();
        assert!(err.contains(want), "{routes}\n  got: {err}\n  want: {want}");
    }
}

#[test]
fn server_timeouts_default_and_name_their_key() {
    let config = Config::parse(MINIMAL).unwrap();
    assert_eq!(config.process.server.drain, Duration::from_secs(30));
    assert_eq!(config.process.server.accept_grace, Duration::ZERO);
    assert_eq!(
        config.process.server.header_read_timeout,
        Duration::from_secs(30)
    );
    let with = |extra: &str| {
        MINIMAL.replace(
            "listen = \"127.0.0.1:8080\"",
            &format!("listen = \"127.0.0.1:8080\"\n{extra}"),
        )
    };
    let config = Config::parse(&with(
        "accept_grace_secs = 5\nheader_read_timeout_secs = 10",
    ))
    .unwrap();
    assert_eq!(
        (
            config.process.server.accept_grace,
            config.process.server.header_read_timeout
        ),
        (Duration::from_secs(5), Duration::from_secs(10))
    );
    assert_eq!(
        Config::parse(&with("header_read_timeout_secs = 0"))
            .unwrap_err()
            .to_string(),
        "server.header_read_timeout_secs: must be greater than zero"
    );
}

#[test]
fn upstream_urls_with_credentials_are_refused_without_echoing_them() {
    for url in [
        "http://user:hunter2@127.0.0.1:9000",
        "https://hunter2@bedrock.internal/",
        "http://user:hunter2@[bad",
    ] {
        let text = MINIMAL.replace("endpoint = \"simulated\"", &format!("endpoint = \"{url}\""));
        let err = Config::parse(&text).expect_err(url).to_string();
        assert!(err.starts_with("upstream.endpoint:"), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
    }
    assert_eq!(
        crate::upstream::redact_userinfo("http://u:p/w?x#@host:1/path"),
        "http://***@host:1/path"
    );
    assert_eq!(
        crate::upstream::redact_userinfo("http://host:1/"),
        "http://host:1/"
    );
}

#[test]
fn the_regions_served_are_the_upstream_s_and_every_pool_s() {
    let text = format!(
        "{MINIMAL}\n[[pools]]\nname = \"eu\"\nregion = \"eu-west-1\"\nmodels = [\"eu.m\"]\n\
         tokens_per_minute = 1000\nmax_concurrency = 1\noutput_burndown = 1\nmax_output_tokens = 10\ndefault_max_tokens = 10\n"
    );
    let config = Config::parse(&text).expect("valid");
    assert_eq!(config.policy.auth.regions, ["us-east-1", "eu-west-1"]);
}
