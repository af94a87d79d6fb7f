//! Caller identity. SigV4 verification lives in [`sigv4`].

pub mod sigv4;
