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
    assert_eq!(config.server.listen.port(), 8080);
    assert_eq!(config.upstream.endpoint, Endpoint::Simulated);
    assert_eq!(config.ledger, LedgerConfig::Memory);
    let pool = &config.pools[0];
    assert_eq!(pool.name, "sonnet4-us");
    assert_eq!(pool.region, "us-east-1");
    assert_eq!(pool.usable_tokens_per_minute(), 200_000);
    assert_eq!(pool.input_estimate, InputEstimate::Heuristic);
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
            Box::new(|c| c.replace("backend = \"memory\"", "backend = \"etcd\"")),
            "ledger.backend: \"etcd\" is not a backend",
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
            "ledger.on_error: \"open\": use \"fail-closed\" or \"local\"",
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
            Box::new(|c| c.replace("endpoint = \"simulated\"", "endpoint = \"ftp://x\"")),
            "upstream.endpoint:",
        ),
        (
            Box::new(|c| c.replace("region = \"us-east-1\"", "region = \"US East\"")),
            "upstream.region:",
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
        match Config::parse(&text).unwrap().ledger {
            LedgerConfig::Redis(r) => r,
            other => panic!("{other:?}"),
        }
    };
    let defaults = redis("");
    assert_eq!(defaults.url, "redis://10.0.0.5:6379");
    assert_eq!(defaults.timeout, Duration::from_millis(250));
    assert_eq!(defaults.lease, Duration::from_secs(600));
    assert_eq!(defaults.on_error, OnLedgerError::FailClosed);
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
fn server_timeouts_default_and_name_their_key() {
    let config = Config::parse(MINIMAL).unwrap();
    assert_eq!(config.server.drain, Duration::from_secs(30));
    assert_eq!(config.server.accept_grace, Duration::ZERO);
    assert_eq!(config.server.header_read_timeout, Duration::from_secs(30));
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
            config.server.accept_grace,
            config.server.header_read_timeout
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
