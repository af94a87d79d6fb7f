//! The model catalogue: what Bedrock reserves for a call that names no output cap (the model's
//! maximum output tokens) and how fast its output burns quota (the burndown factor), per model
//! family, as `../shared/BEDROCK-APIS.md` and `../shared/BEDROCK.md` list them.
//!
//! Each entry says whether the figure is certain (**V**: stated by AWS or the model's vendor) or
//! not (**U**: third-party, or inferred from neighbouring models); the README repeats the table.
//! Where a figure is uncertain the catalogue errs high: a maximum output or a burndown above the
//! truth wastes some quota, one below it admits what upstream then throttles. A pool's
//! `max_output_tokens` and `output_burndown` override the catalogue; a pool whose models it does
//! not know must set them (config validation names the key).
//!
//! Lookup is by the base model id, whatever the inference route (`us.`, `global.`, an ARN of a
//! foundation model or system profile): Anthropic ids are read as family and version
//! (`claude-sonnet-4-5-20250929-v1:0` is Sonnet 4.5, `claude-3-7-sonnet-...` is Sonnet 3.7), the
//! others by prefix. Pure data and string matching: no I/O.

use super::ModelRef;

/// What the catalogue knows of one model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelFacts {
    /// The family, for messages (`Claude Sonnet 4.5`, `Amazon Nova`).
    pub family: &'static str,
    /// The most output tokens a call may ask for: what Bedrock reserves when it names none.
    /// `None` where no source says.
    pub max_output_tokens: Option<Figure>,
    /// Quota tokens charged per output token.
    pub output_burndown: Figure,
}

/// A figure and whether its source is certain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Figure {
    pub value: u64,
    /// Stated by AWS or the model's vendor (V); `false`: third-party or inferred (U).
    pub certain: bool,
}

const fn v(value: u64) -> Figure {
    Figure {
        value,
        certain: true,
    }
}

const fn u(value: u64) -> Figure {
    Figure {
        value,
        certain: false,
    }
}

/// A Claude model: (family, major, minor), its name, maximum output and burndown.
type ClaudeEntry = (&'static str, u32, u32, &'static str, Option<Figure>, Figure);

/// Claude models by (family, major, minor): maximum output and burndown.
const CLAUDE: &[ClaudeEntry] = &[
    // Claude 5: 128K (V, Anthropic's model pages). Burndown: one guide says 10 (U); the
    // catalogue takes the higher reading.
    ("opus", 5, 0, "Claude Opus 5", Some(v(128_000)), u(10)),
    ("sonnet", 5, 0, "Claude Sonnet 5", Some(v(128_000)), u(10)),
    // Claude 4 family: burndown 5 (V, AWS "How tokens are counted").
    ("opus", 4, 8, "Claude Opus 4.8", Some(v(128_000)), v(5)),
    // Opus 4.7 is listed by no source: between 4.6 and 4.8, both 128K (U).
    ("opus", 4, 7, "Claude Opus 4.7", Some(u(128_000)), v(5)),
    ("opus", 4, 6, "Claude Opus 4.6", Some(v(128_000)), v(5)),
    ("opus", 4, 5, "Claude Opus 4.5", Some(v(64_000)), v(5)),
    ("opus", 4, 1, "Claude Opus 4.1", Some(u(32_000)), v(5)),
    ("opus", 4, 0, "Claude Opus 4", Some(u(32_000)), v(5)),
    ("sonnet", 4, 6, "Claude Sonnet 4.6", Some(v(128_000)), v(5)),
    ("sonnet", 4, 5, "Claude Sonnet 4.5", Some(v(64_000)), v(5)),
    ("sonnet", 4, 0, "Claude Sonnet 4", Some(u(64_000)), v(5)),
    ("haiku", 4, 5, "Claude Haiku 4.5", Some(v(64_000)), v(5)),
    // Claude 3.7 Sonnet: burndown 5 (V); 64K output (U: Anthropic's page, 128K with a beta header).
    ("sonnet", 3, 7, "Claude Sonnet 3.7", Some(u(64_000)), v(5)),
    // Claude 3.5 and 3: burndown 1 (V); outputs 8K and 4K (U).
    ("sonnet", 3, 5, "Claude Sonnet 3.5", Some(u(8_192)), v(1)),
    ("haiku", 3, 5, "Claude Haiku 3.5", Some(u(8_192)), v(1)),
    ("sonnet", 3, 0, "Claude Sonnet 3", Some(u(4_096)), v(1)),
    ("haiku", 3, 0, "Claude Haiku 3", Some(u(4_096)), v(1)),
    ("opus", 3, 0, "Claude Opus 3", Some(u(4_096)), v(1)),
];

/// Other families by the prefix of the base model id. Burndown 1 for all of them (U for Nova,
/// Llama and gpt-oss in BEDROCK-APIS.md); a maximum output only where a source gives one.
const OTHERS: &[(&str, &str, Option<Figure>, Figure)] = &[
    (
        "amazon.nova-premier",
        "Amazon Nova Premier",
        Some(u(32_000)),
        u(1),
    ),
    ("amazon.nova", "Amazon Nova", Some(u(10_000)), u(1)),
    (
        "amazon.titan-text",
        "Amazon Titan Text",
        Some(u(8_192)),
        v(1),
    ),
    ("meta.llama", "Meta Llama", Some(u(8_192)), u(1)),
    ("openai.gpt-oss", "OpenAI gpt-oss", None, u(1)),
    ("mistral.", "Mistral", None, v(1)),
    ("cohere.", "Cohere", None, v(1)),
    ("ai21.", "AI21", None, v(1)),
    ("deepseek.", "DeepSeek", None, v(1)),
    ("qwen.", "Qwen", None, v(1)),
];

/// What the catalogue knows of `model_id` (any form a pool lists: base id, profile id, ARN).
pub fn lookup(model_id: &str) -> Option<ModelFacts> {
    let base = ModelRef::parse(model_id).base_model?;
    if let Some(claude) = base.strip_prefix("anthropic.claude-") {
        let (family, major, minor) = claude_version(claude)?;
        return CLAUDE
            .iter()
            .find(|(f, ma, mi, ..)| *f == family && *ma == major && *mi == minor)
            .map(|&(_, _, _, name, max, burndown)| ModelFacts {
                family: name,
                max_output_tokens: max,
                output_burndown: burndown,
            });
    }
    OTHERS
        .iter()
        .find(|(prefix, ..)| base.starts_with(prefix))
        .map(|&(_, name, max, burndown)| ModelFacts {
            family: name,
            max_output_tokens: max,
            output_burndown: burndown,
        })
}

/// Family and version of a Claude id after `anthropic.claude-`: `sonnet-4-5-20250929-v1:0` or
/// `3-7-sonnet-20250219-v1:0` (older naming). Version numbers are the short numeric segments
/// before the date; a missing minor is 0.
fn claude_version(rest: &str) -> Option<(&str, u32, u32)> {
    let mut family = None;
    let mut numbers = Vec::with_capacity(2);
    for segment in rest.split('-') {
        if matches!(segment, "opus" | "sonnet" | "haiku") {
            family = Some(segment);
        } else if segment.len() <= 2 && segment.bytes().all(|b| b.is_ascii_digit()) {
            numbers.push(segment.parse::<u32>().ok()?);
        } else {
            // A date (`20250929`) or the version suffix (`v1:0`): the name is over.
            break;
        }
    }
    let major = *numbers.first()?;
    Some((family?, major, numbers.get(1).copied().unwrap_or(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn max(id: &str) -> Option<u64> {
        lookup(id)
            .and_then(|f| f.max_output_tokens)
            .map(|f| f.value)
    }

    fn burndown(id: &str) -> Option<u64> {
        lookup(id).map(|f| f.output_burndown.value)
    }

    #[test]
    fn claude_ids_are_read_as_family_and_version_on_every_route() {
        let sonnet4 = [
            "anthropic.claude-sonnet-4-20250514-v1:0",
            "us.anthropic.claude-sonnet-4-20250514-v1:0",
            "global.anthropic.claude-sonnet-4-20250514-v1:0",
            "arn:aws:bedrock:us-east-1:123456789012:inference-profile/us.anthropic.claude-sonnet-4-20250514-v1:0",
            "arn:aws:bedrock:us-east-1::foundation-model/anthropic.claude-sonnet-4-20250514-v1:0",
        ];
        for id in sonnet4 {
            assert_eq!((max(id), burndown(id)), (Some(64_000), Some(5)), "{id}");
        }
        let cases = [
            ("anthropic.claude-sonnet-4-5-20250929-v1:0", 64_000, 5),
            ("anthropic.claude-sonnet-4-6", 128_000, 5),
            ("anthropic.claude-opus-4-1-20250805-v1:0", 32_000, 5),
            ("anthropic.claude-opus-4-5-20251101-v1:0", 64_000, 5),
            ("anthropic.claude-opus-4-6-v1", 128_000, 5),
            ("anthropic.claude-haiku-4-5-20251001-v1:0", 64_000, 5),
            ("anthropic.claude-3-7-sonnet-20250219-v1:0", 64_000, 5),
            ("anthropic.claude-3-5-haiku-20241022-v1:0", 8_192, 1),
            ("anthropic.claude-3-haiku-20240307-v1:0", 4_096, 1),
            ("anthropic.claude-sonnet-5", 128_000, 10),
        ];
        for (id, m, b) in cases {
            assert_eq!((max(id), burndown(id)), (Some(m), Some(b)), "{id}");
        }
    }

    #[test]
    fn other_families_by_prefix_some_without_a_maximum() {
        assert_eq!(max("us.amazon.nova-pro-v1:0"), Some(10_000));
        assert_eq!(max("amazon.nova-premier-v1:0"), Some(32_000));
        assert_eq!(burndown("meta.llama3-3-70b-instruct-v1:0"), Some(1));
        let oss = lookup("openai.gpt-oss-120b-1:0").expect("known family");
        assert_eq!(
            (oss.max_output_tokens, oss.output_burndown.value),
            (None, 1)
        );
    }

    #[test]
    fn unknown_models_are_not_guessed() {
        for id in [
            "acme.rocket-1",
            "anthropic.claude-sonnet-9-20300101-v1:0",
            "anthropic.claude-instant-v1",
            "arn:aws:bedrock:us-east-1:123456789012:provisioned-model/abc",
            "",
        ] {
            assert_eq!(lookup(id), None, "{id}");
        }
    }

    #[test]
    fn certainty_is_kept_per_figure() {
        let sonnet4 = lookup("anthropic.claude-sonnet-4-20250514-v1:0").expect("known");
        assert_eq!(sonnet4.max_output_tokens.map(|f| f.certain), Some(false));
        assert!(sonnet4.output_burndown.certain);
        let sonnet45 = lookup("anthropic.claude-sonnet-4-5-20250929-v1:0").expect("known");
        assert_eq!(sonnet45.max_output_tokens.map(|f| f.certain), Some(true));
    }
}
