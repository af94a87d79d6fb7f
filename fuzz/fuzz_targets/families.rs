//! The model families the body targets try: `None` (no provider), each provider with its own
//! `maxTokens` field, and one nobody knows.

pub const PROVIDERS: [Option<&str>; 9] = [
    None,
    Some("anthropic"),
    Some("amazon"),
    Some("meta"),
    Some("ai21"),
    Some("mistral"),
    Some("cohere"),
    Some("deepseek"),
    Some("someone-new"),
];
