use super::super::Config;

/// Three Sonnet 4 pools (us-east-1 on demand, us-west-2 on demand named by its ARN there, the
/// `global.` profile) and a Haiku pool; `east`, `west` and `global` are added to those pools'
/// tables, `extra` after them (routes).
fn config(east: &str, west: &str, global: &str, extra: &str) -> Result<Config, String> {
    let text = format!(
        r#"
[server]
listen = "127.0.0.1:8080"
[upstream]
region = "us-east-1"
endpoint = "simulated"

[[pools]]
name = "east"
models = ["anthropic.claude-sonnet-4-20250514-v1:0"]
tokens_per_minute = 100000
max_concurrency = 8
output_burndown = 5
default_max_tokens = 1000
{east}

[[pools]]
name = "west"
models = ["arn:aws:bedrock:us-west-2::foundation-model/anthropic.claude-sonnet-4-20250514-v1:0"]
region = "us-west-2"
tokens_per_minute = 100000
max_concurrency = 8
output_burndown = 5
default_max_tokens = 1000
{west}

[[pools]]
name = "global"
models = ["global.anthropic.claude-sonnet-4-20250514-v1:0"]
tokens_per_minute = 100000
max_concurrency = 8
output_burndown = 5
default_max_tokens = 1000
{global}

[[pools]]
name = "haiku"
models = ["anthropic.claude-3-haiku-20240307-v1:0"]
region = "eu-west-1"
tokens_per_minute = 100000
max_concurrency = 8
output_burndown = 1
default_max_tokens = 1000
{extra}
"#
    );
    Config::parse(&text).map_err(|e| e.to_string())
}

#[test]
fn a_chain_is_its_list_then_theirs_breadth_first() {
    let c = config(
        "spill_to = [\"west\"]",
        "spill_to = [\"global\"]",
        "",
        "[auth]\ndefault_route = \"app\"\n[[routes]]\nname = \"app\"\nspill = true\n[[routes]]\nname = \"home\"\n",
    )
    .unwrap();
    let pools = &c.policy.pools;
    assert_eq!(super::chain(pools, 0), vec![1, 2]);
    assert_eq!(super::chain(pools, 1), vec![2]);
    assert!(super::chain(pools, 2).is_empty());
    assert!(pools[0].spill_cached, "default");
    assert!(c.policy.routes[0].spill);
    assert!(!c.policy.routes[1].spill, "spill is opt-in per route");
    let no_routes = config("spill_to = [\"global\"]\nspill_cached = false", "", "", "").unwrap();
    assert!(!no_routes.policy.pools[0].spill_cached);
    assert!(
        no_routes.policy.routes[0].spill,
        "without [[routes]], a pool's chain is the opt-in"
    );
}

#[test]
fn each_bad_chain_names_its_key() {
    let cases = [
        (
            "spill_to = [\"nowhere\"]",
            "",
            "pools[0] (east).spill_to: there is no pool named \"nowhere\"",
        ),
        (
            "spill_to = [\"east\"]",
            "",
            "pools[0] (east).spill_to: a pool cannot spill to itself",
        ),
        (
            "spill_to = [\"global\", \"global\"]",
            "",
            "pools[0] (east).spill_to: \"global\" is listed twice",
        ),
        (
            "spill_to = [\"haiku\"]",
            "",
            "pools[0] (east).spill_to: pool \"haiku\" serves anthropic.claude-3-haiku-20240307-v1:0, \
             not anthropic.claude-sonnet-4-20250514-v1:0: a request spills only to the same model",
        ),
        // Two pools spilling to a third is no cycle.
        ("spill_to = [\"west\"]", "spill_to = [\"west\"]\n", ""),
    ];
    for (east, global, expected) in cases {
        let got = config(east, "", global, "");
        match expected {
            "" => assert!(got.is_ok(), "{got:?}"),
            _ => assert_eq!(got.unwrap_err(), expected, "{east}"),
        }
    }
    assert_eq!(
        config(
            "spill_to = [\"west\"]",
            "spill_to = [\"global\"]",
            "spill_to = [\"east\"]",
            ""
        )
        .unwrap_err(),
        "pools[0] (east).spill_to: the chain leads back to \"east\" through \"global\": spill chains must not cycle"
    );
}

#[test]
fn a_route_never_leaves_its_regions() {
    let ok = config(
        "",
        "",
        "",
        "[[routes]]\nname = \"eu\"\nmodels = [\"anthropic.claude-3-haiku-20240307-v1:0\"]\nregions = [\"eu-west-1\"]\n",
    );
    assert!(ok.is_ok(), "{ok:?}");
    assert_eq!(
        config(
            "",
            "",
            "",
            "[[routes]]\nname = \"eu\"\nregions = [\"eu-west-1\"]\n"
        )
        .unwrap_err(),
        "routes[0] (eu).regions: pool \"east\", which the route may call, is in us-east-1, outside \
         [\"eu-west-1\"]: add the Region, or leave the pool's models out of routes[0].models"
    );
    assert_eq!(
        config(
            "",
            "",
            "",
            "[[routes]]\nname = \"eu\"\nregions = [\"EU\"]\n"
        )
        .unwrap_err(),
        "routes[0] (eu).regions: \"EU\" is not a Region name like \"us-east-1\""
    );
}
