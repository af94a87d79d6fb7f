//! The OpenAI and Anthropic APIs' paths, a model each serves, the simulator the tests of them run
//! against (`apis.rs`, `apis_auth.rs`, `apis_faults.rs`), and their SSE bodies read back.

use serde_json::Value;

pub const GPT: &str = "openai.gpt-oss-120b-1:0";
pub const CHAT: &str = "/openai/v1/chat/completions";
pub const RESPONSES: &str = "/openai/v1/responses";
pub const MESSAGES: &str = "/anthropic/v1/messages";
/// Instant answers, a quota far above anything the tests send.
pub const FAST_SIM: &str =
    "time_to_first_token_ms = 0\ntokens_per_second = 0\ndefault_tokens_per_minute = 10000000\n";

/// A pool `gpt` for [`GPT`] (burndown 1; the catalogue has no maximum output for gpt-oss, so the
/// pool sets the simulator's), with `extra` TOML lines.
pub fn gpt_pool(tokens_per_minute: u64, extra: &str) -> String {
    format!(
        "[[pools]]\nname = \"gpt\"\nmodels = [\"{GPT}\"]\ntokens_per_minute = {tokens_per_minute}\n\
         max_concurrency = 16\noutput_burndown = 1\nmax_output_tokens = 4096\ndefault_max_tokens = 1000\n{extra}\n"
    )
}

/// `(event name, data)` of every SSE event; data that is not JSON (`[DONE]`) is `Null`.
pub fn sse_events(bytes: &[u8]) -> Vec<(String, Value)> {
    let text = std::str::from_utf8(bytes).expect("an SSE body is UTF-8");
    text.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|event| {
            let mut name = String::new();
            let mut data = Value::Null;
            for line in event.lines() {
                if let Some(n) = line.strip_prefix("event: ") {
                    name = n.to_string();
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data = serde_json::from_str(d).unwrap_or(Value::Null);
                }
            }
            (name, data)
        })
        .collect()
}
