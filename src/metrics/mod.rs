//! Metrics. STUB.
