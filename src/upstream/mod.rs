//! Upstream forwarding. STUB.
