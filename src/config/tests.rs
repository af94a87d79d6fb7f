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
