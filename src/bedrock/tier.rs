//! Bedrock's service tiers, as a request names them: Converse's body `serviceTier.type`, the
//! OpenAI and Anthropic APIs' `service_tier`, or InvokeModel's `X-Amzn-Bedrock-Service-Tier`
//! header (read by admission's body reader and the pipeline); a route's `allowed_tiers` and
//! forced `service_tier` name them too.
//!
//! `priority`, `default` and `flex` draw on the on-demand quota; `reserved` on reserved capacity
//! (a pool with `tier = "reserved"`), overflowing to the on-demand pool when the reserved one
//! cannot admit now, as Bedrock does. An unknown tier name is left to upstream to refuse.

use serde::Deserialize;

/// A service tier a request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ServiceTier {
    Priority,
    Default,
    Flex,
    Reserved,
}

impl ServiceTier {
    /// The tier a request names (`None`: a name Bedrock does not know, or none).
    pub fn parse(name: &str) -> Option<ServiceTier> {
        match name {
            "priority" => Some(ServiceTier::Priority),
            "default" => Some(ServiceTier::Default),
            "flex" => Some(ServiceTier::Flex),
            "reserved" => Some(ServiceTier::Reserved),
            _ => None,
        }
    }

    /// The name a request sends.
    pub fn label(self) -> &'static str {
        match self {
            ServiceTier::Priority => "priority",
            ServiceTier::Default => "default",
            ServiceTier::Flex => "flex",
            ServiceTier::Reserved => "reserved",
        }
    }
}
