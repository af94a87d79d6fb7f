//! Admission control. STUB.
pub mod estimate;
