//! Model ids as Bedrock's side of the wire reads them, and the quota bucket each lands in.
//!
//! Written apart from the proxy's parser (`crate::bedrock::model_id`) on purpose: the simulator
//! is the reference the proxy is tested against, so the two must not share a mistake.
//!
//! | id as sent | route | bucket key |
//! |---|---|---|
//! | `anthropic.claude-...` (base id) | on demand, in the request's Region | `{base}@{region}` |
//! | `us.anthropic.claude-...` (`us`, `us-gov`, `eu`, `apac`, `jp`, `au`, `ca`) | geographic | `{base}@geo:us` |
//! | `global.anthropic.claude-...` | global | `{base}@global` |
//! | `arn:aws:bedrock:{r}::foundation-model/{base}` | on demand, in the ARN's Region | `{base}@{r}` |
//! | `arn:aws:bedrock:{r}:{acct}:inference-profile/{profile}` | the profile's route, from Region `{r}` | as the profile id |
//! | `arn:...:application-inference-profile/{id}` | the route of the model it was made from (`simulator.application_profiles`) | as that model |
//! | any other ARN (`provisioned-model`, `custom-model`, ...), or an unmapped application profile | its own capacity | `{arn}@{r}` |
//!
//! Buckets are per Region: a profile called from a Region other than the simulator's default
//! one gets `{region}/` before its route (`{base}@us-west-2/geo:us`), so keys of the default
//! Region read as they always have. On-demand keys already name their Region.

use std::collections::BTreeMap;

/// Geography prefixes of system-defined cross-Region inference profiles (AWS's inference
/// profile list and the CDK's `CrossRegionInferenceProfileRegion`; `ca` for Canada).
const GEOGRAPHIES: [&str; 7] = ["us", "us-gov", "eu", "apac", "jp", "au", "ca"];

/// Model providers on Bedrock: a base id is `{provider}.{model}`. Used to tell an unknown
/// model (404 on the body-model APIs) from a known one.
const PROVIDERS: [&str; 18] = [
    "ai21",
    "amazon",
    "anthropic",
    "cohere",
    "deepseek",
    "google",
    "luma",
    "meta",
    "minimax",
    "mistral",
    "moonshot",
    "moonshotai",
    "nvidia",
    "openai",
    "qwen",
    "stability",
    "twelvelabs",
    "writer",
];

/// Which capacity of a model a call draws on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// A base model in one Region.
    OnDemand,
    /// A geographic cross-Region profile; holds its prefix (`us`, `eu`, ...).
    Geographic(String),
    /// A `global.` cross-Region profile.
    Global,
    /// A resource with capacity of its own (provisioned or custom model, unmapped application
    /// profile): the whole id names it.
    Dedicated,
}

/// A parsed model id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelId {
    /// The base model (`anthropic.claude-...`), or the whole id for a [`Route::Dedicated`] one.
    pub base: String,
    pub route: Route,
    /// The Region an ARN names (empty Regions count as none).
    pub arn_region: Option<String>,
}

impl ModelId {
    /// Parses an id as callers send it (after the path's percent-decoding).
    pub fn parse(id: &str) -> ModelId {
        match id.strip_prefix("arn:") {
            Some(rest) => parse_arn(id, rest),
            None => parse_plain(id),
        }
    }

    /// Whether the base id names a model of a provider Bedrock serves.
    pub fn is_known(&self) -> bool {
        self.route != Route::Dedicated
            && self
                .base
                .split_once('.')
                .is_some_and(|(provider, model)| !model.is_empty() && PROVIDERS.contains(&provider))
    }
}

/// `base`, `{geo}.base` or `global.base`.
fn parse_plain(id: &str) -> ModelId {
    let plain = |base: &str, route| ModelId {
        base: base.to_string(),
        route,
        arn_region: None,
    };
    let Some((prefix, rest)) = id.split_once('.') else {
        return plain(id, Route::OnDemand);
    };
    // A profile id is a prefix before a whole base id, which has a dot of its own.
    if !rest.contains('.') {
        return plain(id, Route::OnDemand);
    }
    if prefix == "global" {
        plain(rest, Route::Global)
    } else if GEOGRAPHIES.contains(&prefix) {
        plain(rest, Route::Geographic(prefix.to_string()))
    } else {
        plain(id, Route::OnDemand)
    }
}

/// `arn:{partition}:bedrock:{region}:{account}:{type}/{resource}`; `rest` follows `arn:`.
fn parse_arn(id: &str, rest: &str) -> ModelId {
    let fields: Vec<&str> = rest.splitn(5, ':').collect();
    let dedicated = |region: Option<String>| ModelId {
        base: id.to_string(),
        route: Route::Dedicated,
        arn_region: region,
    };
    let [_partition, service, region, _account, resource] = fields[..] else {
        return dedicated(None);
    };
    let region = (!region.is_empty()).then(|| region.to_string());
    if service != "bedrock" {
        return dedicated(region);
    }
    let named = match resource.split_once('/') {
        Some(("foundation-model", base)) if !base.is_empty() => ModelId {
            base: base.to_string(),
            route: Route::OnDemand,
            arn_region: None,
        },
        Some(("inference-profile", profile)) if !profile.is_empty() => parse_plain(profile),
        _ => return dedicated(region),
    };
    ModelId {
        arn_region: region,
        ..named
    }
}

/// What a call's model id resolves to in the Region it was made in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// The base model (its facts: maximum output, burndown, body family).
    pub base: String,
    pub route: Route,
    /// The Region whose capacity the call draws on (an ARN's own, else the request's).
    pub region: String,
    /// The bucket key (see the module doc).
    pub bucket: String,
    /// Whether the model is one Bedrock serves ([`ModelId::is_known`]).
    pub known: bool,
}

/// Resolves `id` called in `region`; `default_region` keeps that Region's profile keys short;
/// `application_profiles` maps application inference profiles (ARN or id) to the model id they
/// were made from.
pub fn resolve(
    id: &str,
    region: &str,
    default_region: &str,
    application_profiles: &BTreeMap<String, String>,
) -> Resolved {
    let mut parsed = ModelId::parse(id);
    if let Some(source) = application_profile_source(id, application_profiles) {
        let region = parsed.arn_region.take();
        parsed = ModelId::parse(source);
        // The profile lives in its own Region; the model it copies is reached from there.
        parsed.arn_region = parsed.arn_region.or(region);
    }
    let region = parsed
        .arn_region
        .clone()
        .unwrap_or_else(|| region.to_string());
    let scope = match &parsed.route {
        Route::OnDemand | Route::Dedicated => region.clone(),
        Route::Geographic(geo) => profile_scope(&region, default_region, &format!("geo:{geo}")),
        Route::Global => profile_scope(&region, default_region, "global"),
    };
    Resolved {
        bucket: format!("{}@{scope}", parsed.base),
        known: parsed.is_known(),
        base: parsed.base,
        route: parsed.route,
        region,
    }
}

fn profile_scope(region: &str, default_region: &str, route: &str) -> String {
    if region == default_region {
        route.to_string()
    } else {
        format!("{region}/{route}")
    }
}

/// The model id an application inference profile was made from, looked up by its ARN or by the
/// id at the end of it.
fn application_profile_source<'a>(
    id: &str,
    profiles: &'a BTreeMap<String, String>,
) -> Option<&'a String> {
    if let Some(source) = profiles.get(id) {
        return Some(source);
    }
    let (_, resource) = id.rsplit_once(':')?;
    let profile_id = resource.strip_prefix("application-inference-profile/")?;
    profiles.get(profile_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SONNET: &str = "anthropic.claude-sonnet-4-20250514-v1:0";

    fn key(id: &str, region: &str) -> String {
        resolve(id, region, "us-east-1", &BTreeMap::new()).bucket
    }

    /// The forms not covered end to end by `tests/it/simulator/model_ids.rs` (which sends every
    /// id form through the SDK and checks the same keys).
    #[test]
    fn edge_forms_land_in_their_bucket() {
        let cases = [
            (
                format!("arn:aws:bedrock:us-east-1:123456789012:inference-profile/us.{SONNET}"),
                format!("{SONNET}@geo:us"),
            ),
            (format!("ca.{SONNET}"), format!("{SONNET}@geo:ca")),
            // Not a geography: one unknown on-demand model.
            (
                "xx.anthropic.claude".to_string(),
                "xx.anthropic.claude@us-east-1".to_string(),
            ),
            ("m".to_string(), "m@us-east-1".to_string()),
            ("global.m".to_string(), "global.m@us-east-1".to_string()),
        ];
        for (id, bucket) in cases {
            assert_eq!(key(&id, "us-east-1"), bucket, "{id}");
        }
    }

    #[test]
    fn buckets_are_per_region() {
        assert_eq!(key(SONNET, "us-west-2"), format!("{SONNET}@us-west-2"));
        assert_eq!(
            key(&format!("us.{SONNET}"), "us-west-2"),
            format!("{SONNET}@us-west-2/geo:us")
        );
        assert_eq!(
            key(&format!("global.{SONNET}"), "eu-west-1"),
            format!("{SONNET}@eu-west-1/global")
        );
        let r = resolve(
            &format!("us.{SONNET}"),
            "us-west-2",
            "us-east-1",
            &BTreeMap::new(),
        );
        assert_eq!((r.base.as_str(), r.region.as_str()), (SONNET, "us-west-2"));
        assert_eq!(r.route, Route::Geographic("us".into()));
    }

    #[test]
    fn application_profiles_take_the_bucket_of_their_source() {
        let arn = "arn:aws:bedrock:us-east-1:123456789012:application-inference-profile/a1b2c3";
        let by_arn = BTreeMap::from([(arn.to_string(), format!("us.{SONNET}"))]);
        let by_id = BTreeMap::from([("a1b2c3".to_string(), format!("global.{SONNET}"))]);
        assert_eq!(
            resolve(arn, "us-east-1", "us-east-1", &by_arn).bucket,
            format!("{SONNET}@geo:us")
        );
        assert_eq!(
            resolve(arn, "us-east-1", "us-east-1", &by_id).bucket,
            format!("{SONNET}@global")
        );
        let unmapped = resolve(arn, "us-east-1", "us-east-1", &BTreeMap::new());
        assert_eq!((unmapped.route, unmapped.known), (Route::Dedicated, false));
        assert_eq!(unmapped.bucket, format!("{arn}@us-east-1"));
    }

    #[test]
    fn known_models() {
        for id in [SONNET, "openai.gpt-oss-120b-1:0", "amazon.nova-sonic-v1:0"] {
            assert!(ModelId::parse(id).is_known(), "{id}");
            assert!(ModelId::parse(&format!("us.{id}")).is_known(), "{id}");
        }
        for id in [
            "gpt-4o",
            "acme.model",
            "anthropic.",
            "arn:aws:s3:::bucket/x",
            "global.x",
        ] {
            assert!(!ModelId::parse(id).is_known(), "{id}");
        }
    }

    #[test]
    fn malformed_arns_are_their_own_capacity() {
        for id in [
            "arn:aws:bedrock",
            "arn:aws:bedrock:us-east-1::foundation-model/",
            "arn:aws:s3:::x",
        ] {
            assert_eq!(ModelId::parse(id).route, Route::Dedicated, "{id}");
        }
    }
}
