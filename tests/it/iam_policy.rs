//! The IAM policy in README.md ("IAM policy") grants exactly the actions the operations need, as
//! `Operation::iam_action` records them, and the README's table of operations says the same as
//! that function.

use std::collections::BTreeSet;

use serde_json::Value;
use tokengate::bedrock::Operation;

fn readme_section(heading: &str) -> String {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md");
    let start = readme
        .find(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("README.md has a {heading:?} section"));
    let rest = &readme[start + heading.len() + 2..];
    let end = rest.find("\n#").unwrap_or(rest.len());
    rest[..end].to_string()
}

/// The actions every operation needs (tokengate forwards them all; operations AWS documents no
/// action for apart), and what endpoint pools need beyond them (`sagemaker::IAM_ACTIONS`).
fn needed_actions() -> BTreeSet<&'static str> {
    Operation::ALL
        .into_iter()
        .filter_map(Operation::iam_action)
        .chain(tokengate::sagemaker::IAM_ACTIONS)
        .collect()
}

#[test]
fn the_readme_policy_grants_exactly_the_forwarded_operations_actions() {
    let section = readme_section("### IAM policy");
    let json = section
        .split("```json\n")
        .nth(1)
        .and_then(|rest| rest.split("\n```").next())
        .expect("a ```json block in the IAM policy section");
    let policy: Value = serde_json::from_str(json).expect("the policy is JSON");
    assert_eq!(policy["Version"], "2012-10-17");
    let mut granted = Vec::new();
    for statement in policy["Statement"].as_array().expect("Statement list") {
        assert_eq!(statement["Effect"], "Allow", "{statement}");
        assert!(!statement["Resource"].is_null(), "{statement}");
        match &statement["Action"] {
            Value::String(a) => granted.push(a.clone()),
            Value::Array(list) => {
                granted.extend(list.iter().map(|a| a.as_str().expect("action").to_string()))
            }
            other => panic!("Action {other}"),
        }
    }
    let set: BTreeSet<&str> = granted.iter().map(String::as_str).collect();
    assert_eq!(
        set.len(),
        granted.len(),
        "an action granted twice: {granted:?}"
    );
    assert_eq!(set, needed_actions());
}

#[test]
fn the_readme_table_names_each_operations_action() {
    let section = readme_section("### IAM policy");
    for op in Operation::ALL {
        let row = section
            .lines()
            .find(|line| line.starts_with(&format!("| {} |", op.name())))
            .unwrap_or_else(|| panic!("the table has a row for {op}"));
        match op.iam_action() {
            Some(action) => assert!(row.contains(&format!("`{action}`")), "{row}"),
            None => assert!(row.contains("none documented"), "{row}"),
        }
    }
}
