//! Service tiers: how a call asks for one, and what it draws on.
//!
//! Bedrock's tiers are `priority`, `default`, `flex` and `reserved` (botocore's
//! `ServiceTierType`). Converse and ConverseStream name one in the body (`"serviceTier":
//! {"type": ...}`), InvokeModel and its stream in the `X-Amzn-Bedrock-Service-Tier` header; the
//! answer echoes the tier that served the call in the same place (Converse body, the stream's
//! `metadata` event, the InvokeModel response header).
//!
//! `priority`, `default` and `flex` draw on the model's on-demand bucket; `reserved` draws on the
//! model's reserved capacity (`reserved_tokens_per_minute` in `[[simulator.quotas]]`) and, when
//! that is full, overflows to the on-demand bucket, answered as `default`. A model without
//! reserved capacity refuses `reserved` with a ValidationException (U: AWS says not every model
//! offers every tier, not how it refuses).
//!
//! The body-model APIs (U: AWS defers to each API's own field): OpenAI `service_tier`
//! (`auto` reads as `default`; Bedrock's four names are accepted too; `scale` is refused) is echoed
//! as `service_tier`; Anthropic `service_tier` (`auto` and `standard_only` read as `default`, and
//! Bedrock's four names) is echoed as `usage.service_tier`.

use std::fmt;

/// A service tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    Priority,
    Default,
    Flex,
    Reserved,
}

/// A tier name the API does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "The service tier {0:?} is not valid. Valid values are priority, default, flex and reserved."
)]
pub struct UnknownTier(pub String);

impl Tier {
    pub const ALL: [Tier; 4] = [Tier::Priority, Tier::Default, Tier::Flex, Tier::Reserved];

    /// Bedrock's name of the tier.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Priority => "priority",
            Tier::Default => "default",
            Tier::Flex => "flex",
            Tier::Reserved => "reserved",
        }
    }

    /// A Bedrock tier name (Converse `serviceTier.type`, `X-Amzn-Bedrock-Service-Tier`).
    pub fn parse(name: &str) -> Result<Tier, UnknownTier> {
        Tier::ALL
            .into_iter()
            .find(|t| t.name() == name)
            .ok_or_else(|| UnknownTier(name.to_string()))
    }

    /// OpenAI's `service_tier`: `auto` is the default tier.
    pub fn parse_openai(name: &str) -> Result<Tier, UnknownTier> {
        match name {
            "auto" => Ok(Tier::Default),
            other => Tier::parse(other),
        }
    }

    /// Anthropic's `service_tier`: `auto` and `standard_only` are the default tier.
    pub fn parse_anthropic(name: &str) -> Result<Tier, UnknownTier> {
        match name {
            "auto" | "standard_only" => Ok(Tier::Default),
            other => Tier::parse(other),
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_per_api() {
        for t in Tier::ALL {
            assert_eq!(Tier::parse(t.name()), Ok(t));
            assert_eq!(Tier::parse_openai(t.name()), Ok(t));
            assert_eq!(Tier::parse_anthropic(t.name()), Ok(t));
        }
        assert_eq!(Tier::parse_openai("auto"), Ok(Tier::Default));
        assert_eq!(Tier::parse_anthropic("standard_only"), Ok(Tier::Default));
        assert!(Tier::parse("auto").is_err());
        assert!(Tier::parse_openai("scale").is_err());
        assert!(Tier::parse("Priority").is_err(), "names are case-sensitive");
    }
}
