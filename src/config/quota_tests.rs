//! The model facts in force per pool (catalogue or config), `when_max_tokens_missing`,
//! `tokens_per_day`, `admission.account_tokens_per_day` and route budgets: values, and errors
//! that name the key.

use super::*;

fn pool(extra: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:8080\"\n[upstream]\nregion = \"us-east-1\"\nendpoint = \"simulated\"\n\
         [[pools]]\nname = \"p\"\ntokens_per_minute = 100000\nmax_concurrency = 4\ndefault_max_tokens = 1000\n{extra}\n"
    )
}

fn parsed(extra: &str) -> PoolConfig {
    let text = pool(extra);
    match Config::parse(&text) {
        Ok(c) => c.policy.pools[0].clone(),
        Err(e) => panic!("{e}\n{text}"),
    }
}

fn error(extra: &str) -> String {
    Config::parse(&pool(extra))
        .expect_err("config should be refused")
        .to_string()
}

#[test]
fn the_catalogue_fills_what_the_pool_leaves_out_taking_the_largest_of_its_models() {
    let p = parsed(
        "models = [\"us.anthropic.claude-3-5-haiku-20241022-v1:0\", \"us.anthropic.claude-sonnet-4-5-20250929-v1:0\"]",
    );
    assert_eq!((p.max_output_tokens, p.output_burndown), (64_000, 5));
    assert_eq!(
        p.when_max_tokens_missing,
        WhenMaxTokensMissing::ReserveModelMax
    );
    assert_eq!(p.tokens_per_day, None);
    let line = p.in_force();
    for says in [
        "max_output_tokens = 64000 (catalogue: Claude Sonnet 4.5)",
        "output_burndown = 5 (catalogue: Claude Sonnet 4.5)",
        "when_max_tokens_missing = \"reserve_model_max\"",
        "default_max_tokens = 1000",
    ] {
        assert!(line.contains(says), "{line:?} lacks {says:?}");
    }
}

#[test]
fn the_pools_own_values_win_and_say_so() {
    let p = parsed(
        "models = [\"us.anthropic.claude-sonnet-4-20250514-v1:0\"]\nmax_output_tokens = 4096\noutput_burndown = 1\n\
         when_max_tokens_missing = \"inject\"\ntokens_per_day = 5000000",
    );
    assert_eq!((p.max_output_tokens, p.output_burndown), (4096, 1));
    assert_eq!(p.when_max_tokens_missing, WhenMaxTokensMissing::Inject);
    assert_eq!(p.tokens_per_day, Some(5_000_000));
    let line = p.in_force();
    assert!(
        line.contains("max_output_tokens = 4096 (from the config)")
            && line.contains("tokens_per_day = 5000000"),
        "{line}"
    );
    // An uncertain catalogue figure is marked so.
    let p = parsed("models = [\"us.anthropic.claude-sonnet-4-20250514-v1:0\"]");
    assert!(
        p.in_force()
            .contains("(catalogue: Claude Sonnet 4, uncertain)"),
        "{}",
        p.in_force()
    );
}

#[test]
fn values_that_make_no_sense_are_errors_naming_the_key() {
    let sonnet = "models = [\"us.anthropic.claude-sonnet-4-20250514-v1:0\"]";
    let cases = [
        (
            "models = [\"acme.rocket-1\"]\noutput_burndown = 1".to_string(),
            "pools[0] (p).max_output_tokens: the built-in model catalogue has no figure for \"acme.rocket-1\": set it",
        ),
        (
            "models = [\"acme.rocket-1\"]\nmax_output_tokens = 100".to_string(),
            "pools[0] (p).output_burndown: the built-in model catalogue has no figure for \"acme.rocket-1\"",
        ),
        (
            // gpt-oss: a burndown is known, no maximum output.
            "models = [\"openai.gpt-oss-120b-1:0\"]".to_string(),
            "pools[0] (p).max_output_tokens: the built-in model catalogue has no figure",
        ),
        (
            format!("{sonnet}\nmax_output_tokens = 0"),
            "pools[0] (p).max_output_tokens: must be a positive integer",
        ),
        (
            format!("{sonnet}\nwhen_max_tokens_missing = \"sometimes\""),
            "when_max_tokens_missing",
        ),
        (
            format!("{sonnet}\ntokens_per_day = 0"),
            "pools[0] (p).tokens_per_day: must be greater than zero",
        ),
        (
            format!("{sonnet}\ntokens_per_day = 1000"),
            "pools[0] (p).tokens_per_day: 1000 is less than a minute's quota",
        ),
        (
            format!("{sonnet}\ntokens_per_day = 999999999999999"),
            "pools[0] (p).tokens_per_day: must be at most",
        ),
        (format!("{sonnet}\ntier = \"gold\""), "tier"),
    ];
    for (extra, says) in cases {
        let e = error(&extra);
        assert!(e.contains(says), "{extra:?}: {e:?} lacks {says:?}");
    }
    // The unknown variant's error shows the line it is on, and the values allowed.
    let e = error(&format!(
        "{sonnet}\nwhen_max_tokens_missing = \"sometimes\""
    ));
    assert!(
        e.contains("reserve_model_max") && e.contains("inject") && e.contains("reject"),
        "{e}"
    );
}

fn with_sonnet(extra: &str) -> String {
    format!(
        "{extra}\n{}",
        pool("models = [\"us.anthropic.claude-sonnet-4-20250514-v1:0\"]")
    )
}

#[test]
fn account_days_and_route_budgets_parse_into_windows() {
    let text = with_sonnet(
        "[admission]\naccount_tokens_per_day = 1000000\n\
         [[routes]]\nname = \"batch\"\nbudgets = { tokens_per_hour = 10000, tokens_per_30_days = 900000 }\n",
    );
    let config = Config::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(
        config.policy.admission.account_tokens_per_day,
        Some(1_000_000)
    );
    let windows = config.policy.routes[0].budgets.windows();
    let names: Vec<_> = windows.iter().map(|w| (w.name, w.capacity)).collect();
    assert_eq!(
        names,
        [("tokens_per_hour", 10_000), ("tokens_per_30_days", 900_000)]
    );
}

#[test]
fn budgets_that_make_no_sense_are_errors_naming_the_key() {
    let route = |budgets: &str| format!("[[routes]]\nname = \"batch\"\nbudgets = {budgets}\n");
    let cases = [
        (
            "[admission]\naccount_tokens_per_day = 0\n".to_string(),
            "admission.account_tokens_per_day: must be greater than zero",
        ),
        (
            "[admission]\naccount_tokens_per_day = 200000000000\n".to_string(),
            "admission.account_tokens_per_day: must be at most",
        ),
        (
            route("{ tokens_per_day = 0 }"),
            "routes[0] (batch).budgets.tokens_per_day: must be greater than zero",
        ),
        (route("{}"), "routes[0] (batch).budgets: names no limit"),
        (
            route("{ tokens_per_hour = 5000, tokens_per_day = 1000 }"),
            "routes[0] (batch).budgets.tokens_per_day: 1000 is less than tokens_per_hour = 5000",
        ),
        (
            route("{ tokens_per_week = 5 }"),
            "unknown field `tokens_per_week`",
        ),
        (
            "[[routes]]\nname = \"batch\"\nmax_concurrency = 0\n".to_string(),
            "routes[0] (batch).max_concurrency: must be greater than zero",
        ),
        (
            "[[routes]]\nname = \"batch\"\nallowed_tiers = []\n".to_string(),
            "routes[0] (batch).allowed_tiers: is empty",
        ),
        (
            "[[routes]]\nname = \"batch\"\nallowed_tiers = [\"gold\"]\n".to_string(),
            "unknown variant `gold`, expected one of `priority`, `default`, `flex`, `reserved`",
        ),
    ];
    for (extra, says) in cases {
        let e = Config::parse(&with_sonnet(&extra))
            .expect_err("refused")
            .to_string();
        assert!(e.contains(says), "{extra:?}: {e:?} lacks {says:?}");
    }
}
