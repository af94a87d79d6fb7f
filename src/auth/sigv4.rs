//! SigV4 signature verification. STUB.
