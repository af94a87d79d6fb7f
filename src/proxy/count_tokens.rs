//! Exact input counts for pools with `input_estimate = "count_tokens"`: admission's
//! [`InputCounter`], asking upstream's CountTokens (free of charge) through the same transport.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, header};

use crate::{
    admission::InputCounter,
    bedrock::{Operation, operation::model_path},
    upstream::Upstream,
};

/// The body of a CountTokens request for the model call `body`.
fn count_tokens_body(operation: Operation, body: &Bytes) -> Result<serde_json::Value, String> {
    use base64::Engine;
    if operation.is_converse() {
        // Parsed here, not during admission: only count_tokens pools pay for the tree.
        let json: serde_json::Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        let mut converse = serde_json::Map::new();
        for key in [
            "messages",
            "system",
            "toolConfig",
            "additionalModelRequestFields",
        ] {
            if let Some(v) = json.get(key) {
                converse.insert(key.to_string(), v.clone());
            }
        }
        Ok(serde_json::json!({ "input": { "converse": converse } }))
    } else {
        let encoded = base64::engine::general_purpose::STANDARD.encode(body);
        Ok(serde_json::json!({ "input": { "invokeModel": { "body": encoded } } }))
    }
}

/// Exact input counts from upstream's CountTokens, for pools with
/// `input_estimate = "count_tokens"`.
#[derive(Debug)]
pub struct UpstreamCounter(pub Arc<Upstream>);

#[async_trait::async_trait]
impl InputCounter for UpstreamCounter {
    async fn count_input_tokens(
        &self,
        region: &str,
        model_id: &str,
        operation: Operation,
        body: &Bytes,
    ) -> Result<u64, String> {
        use http_body_util::BodyExt;
        let upstream = &self.0;
        let path = model_path(Operation::CountTokens, model_id, None)
            .ok_or_else(|| "CountTokens names its model in the path".to_string())?;
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let request = Bytes::from(count_tokens_body(operation, body)?.to_string());
        let response = upstream
            .send(
                Operation::CountTokens,
                region,
                Method::POST,
                &path,
                &headers,
                request,
            )
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status();
        let bytes = tokio::time::timeout(upstream.idle_timeout, response.into_body().collect())
            .await
            .map_err(|_| "CountTokens body timed out".to_string())?
            .map_err(|e| e.to_string())?
            .to_bytes();
        if !status.is_success() {
            return Err(format!(
                "CountTokens answered {status}: {}",
                String::from_utf8_lossy(&bytes)
            ));
        }
        let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
        v.get("inputTokens")
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| "CountTokens answer has no inputTokens".to_string())
    }
}
