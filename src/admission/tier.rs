//! Bedrock's service tiers, as a request names them: Converse's body `serviceTier.type`, or
//! InvokeModel's `X-Amzn-Bedrock-Service-Tier` header (both read by the pipeline and the body
//! reader, and handed to admission as plain data).
//!
//! `priority`, `default` and `flex` draw on the on-demand quota; `reserved` on reserved capacity
//! (a pool with `tier = "reserved"`), overflowing to the on-demand pool when the reserved one
//! cannot admit now, as Bedrock does. An unknown tier name is left to upstream to refuse.

/// A service tier a request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
}
