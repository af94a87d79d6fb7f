//! The shipped Grafana dashboard, Prometheus alert rules and README metrics table refer only to
//! metrics the proxy exports, and every exported metric is documented: none of them can rot
//! silently when a metric is renamed or added. (`promtool check rules` and `promtool test rules`
//! run in `.ci/run`, which installs promtool and fails without it.)

use std::collections::BTreeSet;

use serde_json::Value;
use tokengate::metrics::{Kind, Metrics};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn read(path: &str) -> String {
    std::fs::read_to_string(format!("{ROOT}/{path}")).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Every series name the proxy exports: each metric's name, and a histogram's `_bucket`, `_sum`
/// and `_count` series.
fn exported() -> BTreeSet<String> {
    let (_, metrics) = Metrics::standalone();
    let mut out = BTreeSet::new();
    for family in metrics.families() {
        out.insert(family.name.to_string());
        if family.kind == Kind::Histogram {
            for suffix in ["_bucket", "_sum", "_count"] {
                out.insert(format!("{}{suffix}", family.name));
            }
        }
    }
    out
}

/// Every metric's name (histograms without suffixes).
fn families() -> BTreeSet<String> {
    let (_, metrics) = Metrics::standalone();
    metrics
        .families()
        .iter()
        .map(|f| f.name.to_string())
        .collect()
}

/// The `tokengate_*` identifiers in a PromQL expression (or any text).
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(found) = text[i..].find("tokengate_") {
        let start = i + found;
        let preceded_by_ident =
            start > 0 && (bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let end = text[start..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(text.len(), |n| start + n);
        if !preceded_by_ident {
            out.insert(text[start..end].to_string());
        }
        i = end;
    }
    out
}

/// Whether `name` (as written in PromQL) is a series the proxy exports.
fn is_exported(name: &str, exported: &BTreeSet<String>) -> bool {
    exported.contains(name)
}

/// Every string under a key named `key`, anywhere in `v`.
fn strings_under(v: &Value, key: &str, out: &mut Vec<String>) {
    match v {
        Value::Object(map) => {
            for (k, child) in map {
                match child {
                    Value::String(s) if k == key => out.push(s.clone()),
                    _ => strings_under(child, key, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|c| strings_under(c, key, out)),
        _ => {}
    }
}

#[test]
fn the_metric_name_scanner_finds_names_and_only_names() {
    let names = metric_names(
        r#"histogram_quantile(0.99, sum by (le) (rate(tokengate_ledger_seconds_bucket[5m]))) / xtokengate_no + tokengate_a_total"#,
    );
    assert_eq!(
        names.into_iter().collect::<Vec<_>>(),
        ["tokengate_a_total", "tokengate_ledger_seconds_bucket"]
    );
    let exported = exported();
    assert!(is_exported("tokengate_ledger_seconds_bucket", &exported));
    assert!(is_exported("tokengate_requests_total", &exported));
    assert!(!is_exported("tokengate_requests", &exported));
    assert!(!is_exported("tokengate_requests_total_count", &exported));
}

#[test]
fn every_dashboard_query_uses_exported_metrics() {
    let dashboard: Value = serde_json::from_str(&read("config/grafana/tokengate.json"))
        .expect("the dashboard is JSON");
    let exported = exported();
    let mut exprs = Vec::new();
    strings_under(&dashboard["panels"], "expr", &mut exprs);
    let mut panels = 0;
    let mut ids = BTreeSet::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        // Grafana keys a panel's state (links, repeats, edits) by its id.
        let id = panel["id"].as_u64().expect("every panel has an id");
        assert!(
            ids.insert(id),
            "two panels have id {id}: {}",
            panel["title"]
        );
        if panel["type"] == "row" {
            continue;
        }
        panels += 1;
        let targets = panel["targets"].as_array().map_or(0, Vec::len);
        assert!(targets > 0, "panel {} has no query", panel["title"]);
        assert_eq!(
            panel["datasource"]["uid"], "${datasource}",
            "panel {} must use the datasource variable",
            panel["title"]
        );
    }
    assert!(panels >= 20, "{panels} panels");
    assert!(exprs.len() >= panels, "{} expressions", exprs.len());
    let mut used = BTreeSet::new();
    for expr in &exprs {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "{expr:?} uses no tokengate metric");
        for name in names {
            assert!(
                is_exported(&name, &exported),
                "the dashboard queries {name}, which the proxy does not export: {expr}"
            );
            used.insert(name);
        }
    }
    // The template variables too: the pool picker lists the pools from a metric.
    let mut queries = Vec::new();
    strings_under(&dashboard["templating"], "definition", &mut queries);
    assert!(
        queries.contains(&"label_values(tokengate_configured_tokens_per_minute, pool)".to_string()),
        "{queries:?}"
    );
    for name in queries.iter().flat_map(|q| metric_names(q)) {
        assert!(
            is_exported(&name, &exported),
            "template variable uses {name}"
        );
    }
    // What an operator asks first has a panel.
    for needed in [
        "tokengate_charged_tokens_total",
        "tokengate_configured_tokens_per_minute",
        "tokengate_effective_tokens_per_minute",
        "tokengate_rejections_total",
        "tokengate_inflight_requests",
        "tokengate_queue_depth",
        "tokengate_queued_tokens",
        "tokengate_time_to_first_token_seconds_bucket",
        "tokengate_request_duration_seconds_bucket",
        "tokengate_upstream_throttles_total",
        "tokengate_output_tokens_per_request_bucket",
        "tokengate_suggested_max_tokens",
    ] {
        assert!(used.contains(needed), "no panel shows {needed}");
    }
}

/// Grafana moves overlapping panels out of each other's way when it loads a dashboard, so an
/// overlap shows panels in another order than the file's and under the wrong row: every panel has
/// a place of its own on the 24-column grid.
#[test]
fn dashboard_panels_never_overlap() {
    let dashboard: Value = serde_json::from_str(&read("config/grafana/tokengate.json"))
        .expect("the dashboard is JSON");
    let place = |panel: &Value| {
        let g = &panel["gridPos"];
        let n = |k: &str| {
            g[k].as_u64()
                .unwrap_or_else(|| panic!("{}: gridPos.{k}", panel["title"]))
        };
        (n("x"), n("y"), n("w"), n("h"))
    };
    let panels = dashboard["panels"].as_array().expect("panels");
    for (i, a) in panels.iter().enumerate() {
        let (x, y, w, h) = place(a);
        assert!(
            w > 0 && h > 0 && x + w <= 24,
            "{} is off the grid",
            a["title"]
        );
        for b in &panels[i + 1..] {
            let (bx, by, bw, bh) = place(b);
            let apart = x + w <= bx || bx + bw <= x || y + h <= by || by + bh <= y;
            assert!(apart, "{} and {} overlap", a["title"], b["title"]);
        }
    }
    // What an operator of `adaptive_retry` asks: how many truncated calls went again, and how.
    let mut exprs = Vec::new();
    strings_under(&dashboard["panels"], "expr", &mut exprs);
    assert!(
        exprs
            .iter()
            .any(|e| e.contains("tokengate_adaptive_retries_total")),
        "no panel shows tokengate_adaptive_retries_total"
    );
}

#[test]
fn alert_rules_are_complete_and_use_exported_metrics() {
    let rules: serde_norway::Value =
        serde_norway::from_str(&read("config/prometheus/alerts.yml")).expect("alerts.yml is YAML");
    let exported = exported();
    let groups = rules["groups"].as_sequence().expect("groups");
    assert!(!groups.is_empty());
    let mut alerts = BTreeSet::new();
    for group in groups {
        assert!(group["name"].as_str().is_some(), "a group without a name");
        for rule in group["rules"].as_sequence().expect("rules") {
            let name = rule["alert"].as_str().expect("every rule is an alert");
            assert!(alerts.insert(name.to_string()), "{name} twice");
            let expr = rule["expr"].as_str().expect("expr");
            let names = metric_names(expr);
            assert!(
                !names.is_empty(),
                "{name}: {expr:?} uses no tokengate metric"
            );
            for metric in names {
                assert!(
                    is_exported(&metric, &exported),
                    "{name} uses {metric}, which the proxy does not export"
                );
            }
            let duration = rule["for"]
                .as_str()
                .unwrap_or_else(|| panic!("{name}: for"));
            assert!(
                duration.ends_with('m') || duration.ends_with('s') || duration.ends_with('h'),
                "{name}: for = {duration:?}"
            );
            let severity = rule["labels"]["severity"].as_str();
            assert!(
                matches!(severity, Some("info" | "warning" | "critical")),
                "{name}: severity {severity:?}"
            );
            for key in ["summary", "description"] {
                let text = rule["annotations"][key].as_str().unwrap_or_default();
                assert!(!text.trim().is_empty(), "{name}: annotations.{key}");
            }
        }
    }
    for required in [
        "TokengateUpstreamThrottling",
        "TokengateHighRejectionRate",
        "TokengateLedgerErrors",
        "TokengateQuotaNearExhaustion",
        "TokengateUnsettledReservations",
        "TokengateQueueTimeouts",
    ] {
        assert!(alerts.contains(required), "missing alert {required}");
    }
}

#[test]
fn the_readme_lists_every_metric_and_only_those() {
    let readme = read("README.md");
    let table: String = readme
        .lines()
        .skip_while(|l| !l.starts_with("### Metrics"))
        .skip(1)
        .take_while(|l| !l.starts_with("#"))
        .filter(|l| l.starts_with("| `tokengate_"))
        .collect::<Vec<_>>()
        .join("\n");
    let documented: BTreeSet<String> = table
        .lines()
        .filter_map(|l| metric_names(l).into_iter().next())
        .collect();
    let exported = families();
    let undocumented: Vec<_> = exported.difference(&documented).collect();
    let stale: Vec<_> = documented.difference(&exported).collect();
    assert!(
        undocumented.is_empty(),
        "metrics missing from README.md's Metrics table: {undocumented:?}"
    );
    assert!(
        stale.is_empty(),
        "README.md documents metrics the proxy does not export: {stale:?}"
    );
}
