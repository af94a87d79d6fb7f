//! The quota ledger. STUB.
