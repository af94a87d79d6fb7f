//! `[tracing]` and `[metrics]`: what the proxy tells operators beyond `/metrics`, OpenTelemetry
//! traces to an OTLP collector, CloudWatch Embedded Metric Format lines, and the window of the
//! quota report. Both sections are optional and change only at a restart.

use std::{path::PathBuf, time::Duration};

use http::Uri;
use serde::Deserialize;

use super::{ConfigError, invalid};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTracing {
    pub otlp_endpoint: Option<String>,
    pub protocol: Option<String>,
    pub service_name: Option<String>,
    pub sample_ratio: Option<f64>,
    pub export_interval_ms: Option<u64>,
    pub max_queued_spans: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMetrics {
    pub cloudwatch_emf: Option<String>,
    pub cloudwatch_emf_interval_secs: Option<u64>,
    pub cloudwatch_emf_namespace: Option<String>,
    pub quota_report_window_hours: Option<u64>,
}

/// How spans travel to the collector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtlpProtocol {
    /// `POST {endpoint}/v1/traces`, `application/x-protobuf` (the collector's port 4318).
    HttpProtobuf,
    /// The `TraceService/Export` gRPC call (the collector's port 4317).
    Grpc,
}

impl OtlpProtocol {
    pub fn label(self) -> &'static str {
        match self {
            OtlpProtocol::HttpProtobuf => "http/protobuf",
            OtlpProtocol::Grpc => "grpc",
        }
    }
}

/// `[tracing]` with an `otlp_endpoint`: OpenTelemetry spans for every request.
#[derive(Debug, Clone, PartialEq)]
pub struct TracingConfig {
    /// Where spans go: for `http/protobuf` the full URL of the traces endpoint (`/v1/traces` is
    /// added to a URL without a path), for `grpc` the collector's base URL.
    pub endpoint: Uri,
    pub protocol: OtlpProtocol,
    /// The `service.name` resource attribute.
    pub service_name: String,
    /// Fraction of requests traced when the caller sent no `traceparent` (a caller's sampled
    /// flag is followed either way).
    pub sample_ratio: f64,
    /// How long spans wait to be sent together.
    pub export_interval: Duration,
    /// Spans waiting to be sent; more are dropped (and counted).
    pub max_queued_spans: usize,
}

/// Where CloudWatch Embedded Metric Format lines go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EmfTarget {
    Stdout,
    /// Appended to this file.
    File(PathBuf),
}

/// `[metrics] cloudwatch_emf`: a line per pool and route every interval.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmfConfig {
    pub target: EmfTarget,
    pub interval: Duration,
    /// The CloudWatch namespace of the metrics.
    pub namespace: String,
}

/// `[metrics]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsConfig {
    /// Off unless `cloudwatch_emf` is set.
    pub emf: Option<EmfConfig>,
    /// How far back `GET /v1/quota-report` looks (kept in memory, one slot per minute).
    pub quota_report_window: Duration,
}

const DEFAULT_EXPORT_INTERVAL_MS: u64 = 1_000;
const DEFAULT_MAX_QUEUED_SPANS: usize = 8_192;
const DEFAULT_EMF_INTERVAL_SECS: u64 = 60;
const DEFAULT_REPORT_WINDOW_HOURS: u64 = 24;
/// A week of minutes per pool is still under 2 MiB; longer windows belong in a time-series store.
const MAX_REPORT_WINDOW_HOURS: u64 = 168;

/// `[tracing]`: `None` unless `otlp_endpoint` is set.
pub fn validate_tracing(raw: RawTracing) -> Result<Option<TracingConfig>, ConfigError> {
    let Some(url) = raw.otlp_endpoint else {
        let set = [
            ("tracing.protocol", raw.protocol.is_some()),
            ("tracing.service_name", raw.service_name.is_some()),
            ("tracing.sample_ratio", raw.sample_ratio.is_some()),
            (
                "tracing.export_interval_ms",
                raw.export_interval_ms.is_some(),
            ),
            ("tracing.max_queued_spans", raw.max_queued_spans.is_some()),
        ];
        if let Some((key, _)) = set.iter().find(|(_, set)| *set) {
            return Err(invalid(
                *key,
                "tracing is off without tracing.otlp_endpoint; set otlp_endpoint = \"http://127.0.0.1:4318\" or remove this key",
            ));
        }
        return Ok(None);
    };
    let protocol = match raw.protocol.as_deref().unwrap_or("http/protobuf") {
        "http/protobuf" => OtlpProtocol::HttpProtobuf,
        "grpc" => OtlpProtocol::Grpc,
        other => {
            return Err(invalid(
                "tracing.protocol",
                format!("{other:?}: use \"http/protobuf\" or \"grpc\""),
            ));
        }
    };
    let endpoint = otlp_endpoint(&url, protocol)?;
    let service_name = raw.service_name.unwrap_or_else(|| "tokengate".to_string());
    if service_name.trim().is_empty() {
        return Err(invalid("tracing.service_name", "must not be empty"));
    }
    let sample_ratio = raw.sample_ratio.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&sample_ratio) {
        return Err(invalid(
            "tracing.sample_ratio",
            "must be in [0, 1]: 1 traces every request, 0.1 one in ten",
        ));
    }
    let export_interval_ms = raw.export_interval_ms.unwrap_or(DEFAULT_EXPORT_INTERVAL_MS);
    if !(10..=60_000).contains(&export_interval_ms) {
        return Err(invalid(
            "tracing.export_interval_ms",
            "must be between 10 and 60000",
        ));
    }
    let max_queued_spans = raw.max_queued_spans.unwrap_or(DEFAULT_MAX_QUEUED_SPANS);
    if max_queued_spans == 0 {
        return Err(invalid(
            "tracing.max_queued_spans",
            "must be greater than zero",
        ));
    }
    Ok(Some(TracingConfig {
        endpoint,
        protocol,
        service_name,
        sample_ratio,
        export_interval: Duration::from_millis(export_interval_ms),
        max_queued_spans,
    }))
}

/// The collector URL: `http` or `https` with a host; an HTTP endpoint without a path gets the
/// standard `/v1/traces`.
fn otlp_endpoint(url: &str, protocol: OtlpProtocol) -> Result<Uri, ConfigError> {
    let bad = || {
        invalid(
            "tracing.otlp_endpoint",
            format!(
                "{url:?} is not a collector URL; write \"http://127.0.0.1:4318\" (http/protobuf) or \"http://127.0.0.1:4317\" (grpc)"
            ),
        )
    };
    let uri: Uri = url.parse().map_err(|_| bad())?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
        return Err(bad());
    }
    if uri.authority().is_some_and(|a| a.as_str().contains('@')) {
        return Err(invalid(
            "tracing.otlp_endpoint",
            "must not carry credentials in the URL",
        ));
    }
    let bare = matches!(uri.path(), "" | "/") && uri.query().is_none();
    match protocol {
        OtlpProtocol::HttpProtobuf if bare => format!("{}/v1/traces", url.trim_end_matches('/'))
            .parse()
            .map_err(|_| bad()),
        OtlpProtocol::HttpProtobuf => Ok(uri),
        OtlpProtocol::Grpc if bare => Ok(uri),
        OtlpProtocol::Grpc => Err(invalid(
            "tracing.otlp_endpoint",
            format!("{url:?}: a grpc endpoint is the collector's base URL, without a path"),
        )),
    }
}

/// `[metrics]`.
pub fn validate_metrics(raw: RawMetrics) -> Result<MetricsConfig, ConfigError> {
    let emf = match raw.cloudwatch_emf.as_deref() {
        None => {
            let set = [
                (
                    "metrics.cloudwatch_emf_interval_secs",
                    raw.cloudwatch_emf_interval_secs.is_some(),
                ),
                (
                    "metrics.cloudwatch_emf_namespace",
                    raw.cloudwatch_emf_namespace.is_some(),
                ),
            ];
            if let Some((key, _)) = set.iter().find(|(_, set)| *set) {
                return Err(invalid(
                    *key,
                    "CloudWatch EMF is off without metrics.cloudwatch_emf; set cloudwatch_emf = \"stdout\" (or a file path) or remove this key",
                ));
            }
            None
        }
        Some(target) => Some(emf(target, &raw)?),
    };
    let hours = raw
        .quota_report_window_hours
        .unwrap_or(DEFAULT_REPORT_WINDOW_HOURS);
    if !(1..=MAX_REPORT_WINDOW_HOURS).contains(&hours) {
        return Err(invalid(
            "metrics.quota_report_window_hours",
            format!("must be between 1 and {MAX_REPORT_WINDOW_HOURS} (a week)"),
        ));
    }
    Ok(MetricsConfig {
        emf,
        quota_report_window: Duration::from_secs(hours * 3600),
    })
}

fn emf(target: &str, raw: &RawMetrics) -> Result<EmfConfig, ConfigError> {
    let target = match target {
        "stdout" => EmfTarget::Stdout,
        "" => {
            return Err(invalid(
                "metrics.cloudwatch_emf",
                "write \"stdout\" or the path of a file to append to",
            ));
        }
        path => EmfTarget::File(PathBuf::from(path)),
    };
    let interval = raw
        .cloudwatch_emf_interval_secs
        .unwrap_or(DEFAULT_EMF_INTERVAL_SECS);
    if !(1..=3600).contains(&interval) {
        return Err(invalid(
            "metrics.cloudwatch_emf_interval_secs",
            "must be between 1 and 3600 (CloudWatch's finest standard resolution is 60)",
        ));
    }
    let namespace = raw
        .cloudwatch_emf_namespace
        .clone()
        .unwrap_or_else(|| "tokengate".to_string());
    // CloudWatch: 1 to 255 characters of letters, digits and `.-_/#:`, not starting with `:`.
    let valid = !namespace.is_empty()
        && namespace.len() <= 255
        && !namespace.starts_with(':')
        && namespace
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || ".-_/#: ".contains(c));
    if !valid {
        return Err(invalid(
            "metrics.cloudwatch_emf_namespace",
            format!(
                "{namespace:?} is not a CloudWatch namespace (letters, digits and . - _ / # : only)"
            ),
        ));
    }
    Ok(EmfConfig {
        target,
        interval: Duration::from_secs(interval),
        namespace,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracing(toml: &str) -> Result<Option<TracingConfig>, ConfigError> {
        validate_tracing(toml::from_str(toml).expect("toml"))
    }

    fn metrics(toml: &str) -> Result<MetricsConfig, ConfigError> {
        validate_metrics(toml::from_str(toml).expect("toml"))
    }

    #[test]
    fn tracing_is_off_by_default_and_fills_in_the_standard_path() {
        assert_eq!(tracing("").expect("empty"), None);
        let t = tracing("otlp_endpoint = \"http://127.0.0.1:4318\"")
            .expect("valid")
            .expect("on");
        assert_eq!(t.endpoint, "http://127.0.0.1:4318/v1/traces");
        assert_eq!(t.protocol, OtlpProtocol::HttpProtobuf);
        assert_eq!(t.service_name, "tokengate");
        assert_eq!(t.sample_ratio, 1.0);
        let t = tracing("otlp_endpoint = \"https://otel.example:4318/custom/traces\"")
            .expect("valid")
            .expect("on");
        assert_eq!(t.endpoint, "https://otel.example:4318/custom/traces");
        let t = tracing("otlp_endpoint = \"http://collector:4317\"\nprotocol = \"grpc\"")
            .expect("valid")
            .expect("on");
        assert_eq!(t.protocol, OtlpProtocol::Grpc);
        assert_eq!(t.endpoint, "http://collector:4317/");
    }

    #[test]
    fn each_invalid_tracing_setting_names_its_key() {
        for (toml, key) in [
            ("sample_ratio = 0.5", "tracing.sample_ratio"),
            (
                "otlp_endpoint = \"collector:4318\"",
                "tracing.otlp_endpoint",
            ),
            ("otlp_endpoint = \"ftp://c:21\"", "tracing.otlp_endpoint"),
            (
                "otlp_endpoint = \"http://u:p@c:4318\"",
                "tracing.otlp_endpoint",
            ),
            (
                "otlp_endpoint = \"http://c:4317/x\"\nprotocol = \"grpc\"",
                "tracing.otlp_endpoint",
            ),
            (
                "otlp_endpoint = \"http://c:4318\"\nprotocol = \"thrift\"",
                "tracing.protocol",
            ),
            (
                "otlp_endpoint = \"http://c:4318\"\nsample_ratio = 1.5",
                "tracing.sample_ratio",
            ),
            (
                "otlp_endpoint = \"http://c:4318\"\nservice_name = \" \"",
                "tracing.service_name",
            ),
            (
                "otlp_endpoint = \"http://c:4318\"\nexport_interval_ms = 0",
                "tracing.export_interval_ms",
            ),
            (
                "otlp_endpoint = \"http://c:4318\"\nmax_queued_spans = 0",
                "tracing.max_queued_spans",
            ),
        ] {
            let e = tracing(toml).expect_err(toml).to_string();
            assert!(e.starts_with(&format!("{key}: ")), "{toml}: {e}");
        }
    }

    #[test]
    fn emf_is_off_by_default_and_the_report_keeps_a_day() {
        let m = metrics("").expect("empty");
        assert_eq!(m.emf, None);
        assert_eq!(m.quota_report_window, Duration::from_secs(86_400));
        let m = metrics("cloudwatch_emf = \"stdout\"").expect("valid");
        let emf = m.emf.expect("on");
        assert_eq!(emf.target, EmfTarget::Stdout);
        assert_eq!(emf.interval, Duration::from_secs(60));
        assert_eq!(emf.namespace, "tokengate");
        let m = metrics("cloudwatch_emf = \"/var/log/tokengate/emf.log\"\ncloudwatch_emf_interval_secs = 10\ncloudwatch_emf_namespace = \"Team/Gateway\"")
            .expect("valid");
        let emf = m.emf.expect("on");
        assert_eq!(
            emf.target,
            EmfTarget::File("/var/log/tokengate/emf.log".into())
        );
        assert_eq!(emf.interval, Duration::from_secs(10));
        assert_eq!(emf.namespace, "Team/Gateway");
    }

    #[test]
    fn each_invalid_metrics_setting_names_its_key() {
        for (toml, key) in [
            (
                "cloudwatch_emf_interval_secs = 10",
                "metrics.cloudwatch_emf_interval_secs",
            ),
            ("cloudwatch_emf = \"\"", "metrics.cloudwatch_emf"),
            (
                "cloudwatch_emf = \"stdout\"\ncloudwatch_emf_interval_secs = 0",
                "metrics.cloudwatch_emf_interval_secs",
            ),
            (
                "cloudwatch_emf = \"stdout\"\ncloudwatch_emf_namespace = \"a{b}\"",
                "metrics.cloudwatch_emf_namespace",
            ),
            (
                "quota_report_window_hours = 0",
                "metrics.quota_report_window_hours",
            ),
            (
                "quota_report_window_hours = 169",
                "metrics.quota_report_window_hours",
            ),
        ] {
            let e = metrics(toml).expect_err(toml).to_string();
            assert!(e.starts_with(&format!("{key}: ")), "{toml}: {e}");
        }
    }
}
