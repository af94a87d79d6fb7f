//! The router. STUB.
