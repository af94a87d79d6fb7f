//! A faithful stand-in for `bedrock-runtime`. STUB: interface being filled in.

use serde::Deserialize;

/// `[simulator]` settings.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimulatorConfig {}
