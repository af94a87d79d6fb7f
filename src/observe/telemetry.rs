//! What the observer feeds beyond the metrics and the access log, and what outlives a config
//! reload: the quota report's windows, the CloudWatch EMF output and the trace exporter.

use std::sync::Arc;

use super::{emf, otlp, report::QuotaReport, tally};
use crate::metrics::Metrics;

/// What outlives a config reload: the quota report's windows, the CloudWatch EMF output and the
/// trace exporter.
#[derive(Debug)]
pub struct Telemetry {
    pub report: QuotaReport,
    /// `[metrics] cloudwatch_emf`, when set.
    pub emf: Option<Arc<emf::Emf>>,
    /// `[tracing]`, when an OTLP endpoint is set.
    pub tracer: Option<Tracer>,
}

/// Traces requests and hands their spans to the exporter.
#[derive(Debug)]
pub struct Tracer {
    pub exporter: otlp::Exporter,
    /// Fraction of requests without a caller's trace context that are traced.
    pub sample_ratio: f64,
}

impl Telemetry {
    /// Only the quota report: no EMF, no traces.
    pub fn new(report: QuotaReport) -> Telemetry {
        Telemetry {
            report,
            emf: None,
            tracer: None,
        }
    }

    /// Everything `config` asks for, on `clock` (the ledger's). The trace exporter and the EMF
    /// writer start on the current runtime (the writer once [`emf::Emf::start`] is called).
    pub fn for_config(
        config: &crate::config::ProcessConfig,
        clock: crate::ledger::Clock,
        metrics: &Metrics,
    ) -> Result<Telemetry, otlp::ExportError> {
        let report = QuotaReport::new(clock, config.metrics.quota_report_window);
        let tracer = match &config.tracing {
            Some(t) => Some(Tracer {
                exporter: otlp::Exporter::start(t, metrics)?,
                sample_ratio: t.sample_ratio,
            }),
            None => None,
        };
        Ok(Telemetry {
            report,
            emf: config
                .metrics
                .emf
                .clone()
                .map(|c| Arc::new(emf::Emf::new(c))),
            tracer,
        })
    }

    /// Sends and writes what the outputs still hold (the last spans, the last EMF interval) and
    /// stops them.
    pub async fn shutdown(&self) {
        if let Some(emf) = &self.emf {
            emf.shutdown().await;
        }
        if let Some(tracer) = &self.tracer {
            tracer.exporter.shutdown().await;
        }
    }
}

/// One pool's EMF tallies, and its routes' by slot.
#[derive(Debug)]
pub(super) struct EmfSlots {
    pub(super) pool: Arc<emf::PoolTallies>,
    pub(super) routes: Vec<Arc<std::sync::Mutex<tally::Tally>>>,
}
