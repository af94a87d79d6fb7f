//! modelId forms and the inference route they take.
//!
//! Bedrock keeps a separate quota bucket per model for each inference route: on-demand (a base
//! model id in one Region), geographic cross-Region profiles (`us.`, `eu.`, `apac.`, ...) and
//! global profiles (`global.`). ARNs name the same things by resource: `foundation-model/{base}`,
//! `inference-profile/{profile}`; application inference profiles share the bucket of the profile
//! they were made from, which only configuration can tell.

/// Geography prefixes of system-defined cross-Region inference profiles.
pub const GEO_PREFIXES: &[&str] = &[
    "us", "us-gov", "eu", "apac", "jp", "au", "ca", "sa", "me", "ap",
];

/// The inference route a model id takes, which selects its quota bucket.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum InferenceRoute {
    /// A base model id, served in one Region.
    OnDemand,
    /// A geographic cross-Region profile such as `us.` or `eu.`; holds the prefix (one of
    /// [`GEO_PREFIXES`]).
    Geographic(&'static str),
    /// A `global.` cross-Region profile.
    Global,
    /// Something only configuration can place: an application inference profile, a provisioned
    /// or custom model, a prompt.
    Other,
}

impl InferenceRoute {
    /// A short label: `on-demand`, `geo`, `global`, `other`.
    pub fn label(&self) -> &'static str {
        match self {
            InferenceRoute::OnDemand => "on-demand",
            InferenceRoute::Geographic(_) => "geo",
            InferenceRoute::Global => "global",
            InferenceRoute::Other => "other",
        }
    }
}

/// A parsed modelId, borrowing its parts from the id (parsed once per request: no allocation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelRef<'a> {
    /// The id as the caller sent it (decoded).
    pub raw: &'a str,
    /// The id that names the quota bucket: the base model id or the system profile id; for an ARN,
    /// its resource id (`foundation-model/X` gives `X`); for other ARNs, the whole ARN.
    pub resource_id: &'a str,
    /// The base model without any route prefix (`anthropic.claude-...`), when known.
    pub base_model: Option<&'a str>,
    pub route: InferenceRoute,
    /// The Region named by an ARN.
    pub arn_region: Option<&'a str>,
}

impl<'a> ModelRef<'a> {
    pub fn parse(model_id: &'a str) -> ModelRef<'a> {
        if let Some(arn) = parse_arn(model_id) {
            let inner = match arn.resource_type {
                "foundation-model" | "inference-profile" => {
                    Some(Self::parse_plain(arn.resource_id))
                }
                _ => None,
            };
            return match inner {
                Some(inner) => ModelRef {
                    raw: model_id,
                    arn_region: Some(arn.region).filter(|r| !r.is_empty()),
                    ..inner
                },
                None => ModelRef {
                    raw: model_id,
                    resource_id: model_id,
                    base_model: None,
                    route: InferenceRoute::Other,
                    arn_region: Some(arn.region).filter(|r| !r.is_empty()),
                },
            };
        }
        Self::parse_plain(model_id)
    }

    fn parse_plain(id: &'a str) -> ModelRef<'a> {
        let (route, base) = match id.split_once('.') {
            Some(("global", rest)) => (InferenceRoute::Global, rest),
            Some((prefix, rest)) if rest.contains('.') => {
                match GEO_PREFIXES.iter().find(|geo| **geo == prefix) {
                    Some(geo) => (InferenceRoute::Geographic(geo), rest),
                    None => (InferenceRoute::OnDemand, id),
                }
            }
            _ => (InferenceRoute::OnDemand, id),
        };
        ModelRef {
            raw: id,
            resource_id: id,
            base_model: Some(base),
            route,
            arn_region: None,
        }
    }

    /// The model's provider (`anthropic`, `amazon`, `meta`, ...), when known.
    pub fn provider(&self) -> Option<&'a str> {
        self.base_model.and_then(|b| b.split('.').next())
    }
}

struct Arn<'a> {
    region: &'a str,
    resource_type: &'a str,
    resource_id: &'a str,
}

/// `arn:{partition}:bedrock:{region}:{account}:{type}/{id}`
fn parse_arn(s: &str) -> Option<Arn<'_>> {
    // Most ids are not ARNs: say so before splitting (this runs on every request).
    let mut parts = s.strip_prefix("arn:")?.splitn(5, ':');
    let (_partition, service, region, _account, resource) = (
        parts.next()?,
        parts.next()?,
        parts.next()?,
        parts.next()?,
        parts.next()?,
    );
    if service != "bedrock" {
        return None;
    }
    let (resource_type, resource_id) = resource.split_once('/')?;
    Some(Arn {
        region,
        resource_type,
        resource_id,
    })
}

/// The resource id of an application-inference-profile ARN, if `s` is one.
pub fn application_profile_id(s: &str) -> Option<&str> {
    parse_arn(s)
        .filter(|a| a.resource_type == "application-inference-profile")
        .map(|a| a.resource_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_geo_and_global_ids() {
        let m = ModelRef::parse("anthropic.claude-3-haiku-20240307-v1:0");
        assert_eq!(m.route, InferenceRoute::OnDemand);
        assert_eq!(m.provider(), Some("anthropic"));

        let m = ModelRef::parse("us.anthropic.claude-sonnet-4-20250514-v1:0");
        assert_eq!(m.route, InferenceRoute::Geographic("us"));
        assert_eq!(
            m.base_model,
            Some("anthropic.claude-sonnet-4-20250514-v1:0")
        );

        let m = ModelRef::parse("global.anthropic.claude-sonnet-4-5-20250929-v1:0");
        assert_eq!(m.route, InferenceRoute::Global);
        assert_eq!(m.provider(), Some("anthropic"));
    }

    #[test]
    fn arns_resolve_to_their_resource() {
        let m = ModelRef::parse(
            "arn:aws:bedrock:us-east-1:123456789012:inference-profile/us.meta.llama3-3-70b-instruct-v1:0",
        );
        assert_eq!(m.resource_id, "us.meta.llama3-3-70b-instruct-v1:0");
        assert_eq!(m.route, InferenceRoute::Geographic("us"));
        assert_eq!(m.arn_region, Some("us-east-1"));

        let m = ModelRef::parse("arn:aws:bedrock:eu-west-1::foundation-model/amazon.nova-pro-v1:0");
        assert_eq!(m.resource_id, "amazon.nova-pro-v1:0");
        assert_eq!(m.route, InferenceRoute::OnDemand);

        let app = "arn:aws:bedrock:us-east-1:123456789012:application-inference-profile/abc123";
        let m = ModelRef::parse(app);
        assert_eq!(m.route, InferenceRoute::Other);
        assert_eq!(m.resource_id, app);
        assert_eq!(application_profile_id(app), Some("abc123"));
    }
}
