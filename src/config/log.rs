//! `[log]`: the log's format and level.

use serde::Deserialize;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLog {
    pub format: Option<LogFormat>,
    pub level: Option<String>,
}

/// `log.format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, PartialEq)]
pub struct LogConfig {
    pub format: LogFormat,
    pub level: String,
}

impl From<RawLog> for LogConfig {
    fn from(raw: RawLog) -> LogConfig {
        LogConfig {
            format: raw.format.unwrap_or(LogFormat::Text),
            level: raw.level.unwrap_or_else(|| "info".to_string()),
        }
    }
}
