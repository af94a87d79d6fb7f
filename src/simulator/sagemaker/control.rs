//! The SageMaker control plane's two describe calls, and `/_sim/sagemaker`, which scales a
//! fleet and reports every one.
//!
//! awsJson1_1 as botocore's `sagemaker` service model has it: `POST /` with `X-Amz-Target:
//! SageMaker.DescribeEndpoint` (or `DescribeInferenceComponent`) and a JSON body; errors carry
//! `__type` and `message` (and `x-amzn-ErrorType`). The answers hold the fields the model
//! requires and the counts that matter here: `ProductionVariants[].CurrentInstanceCount` and
//! `DesiredInstanceCount` (an endpoint without inference components: its fleet's copies; with
//! them, one instance), `RuntimeConfig.CurrentCopyCount` and `DesiredCopyCount`.

use std::sync::Arc;

use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderValue, StatusCode, header};
use serde::Deserialize;
use serde_json::{Value, json};

use super::Fleets;
use super::fleet::Fleet;
use crate::bedrock::error::X_AMZN_ERROR_TYPE;

/// When the simulated resources were made (epoch seconds), for the timestamps the model requires.
const CREATED: f64 = 1_767_225_600.0;
const ACCOUNT: &str = "111122223333";

/// Answers one control plane call named by `target` (`SageMaker.{Operation}`).
pub(super) fn describe(
    fleets: &Fleets,
    region: &str,
    target: Option<&str>,
    body: &[u8],
) -> Response {
    let request: Value = match serde_json::from_slice(body) {
        Ok(v @ Value::Object(_)) => v,
        _ => return aws_json_error("SerializationException", "the body must be a JSON object"),
    };
    let name = |field: &str| {
        request
            .get(field)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    match target {
        Some("SageMaker.DescribeEndpoint") => {
            describe_endpoint(fleets, region, &name("EndpointName"))
        }
        Some("SageMaker.DescribeInferenceComponent") => {
            describe_component(fleets, region, &name("InferenceComponentName"))
        }
        other => aws_json_error(
            "UnknownOperationException",
            &format!(
                "the simulator serves DescribeEndpoint and DescribeInferenceComponent, not {other:?}"
            ),
        ),
    }
}

fn describe_endpoint(fleets: &Fleets, region: &str, endpoint: &str) -> Response {
    let on_endpoint: Vec<&Arc<Fleet>> = fleets
        .iter()
        .filter(|f| f.config.name == endpoint)
        .collect();
    if on_endpoint.is_empty() {
        return aws_json_error(
            "ValidationException",
            &format!("Could not find endpoint \"{endpoint}\"."),
        );
    }
    let whole = on_endpoint
        .iter()
        .find(|f| f.config.inference_component.is_none());
    let (current, desired) = whole.map_or((1, 1), |f| (f.copies(), f.desired()));
    let status = if current == desired {
        "InService"
    } else {
        "Updating"
    };
    answer(&json!({
        "EndpointName": endpoint,
        "EndpointArn": format!("arn:aws:sagemaker:{region}:{ACCOUNT}:endpoint/{}", endpoint.to_lowercase()),
        "EndpointConfigName": format!("{endpoint}-config"),
        "ProductionVariants": [{
            "VariantName": "AllTraffic",
            "CurrentWeight": 1.0,
            "DesiredWeight": 1.0,
            "CurrentInstanceCount": current,
            "DesiredInstanceCount": desired,
        }],
        "EndpointStatus": status,
        "CreationTime": CREATED,
        "LastModifiedTime": CREATED,
    }))
}

fn describe_component(fleets: &Fleets, region: &str, component: &str) -> Response {
    let Some(fleet) = fleets
        .iter()
        .find(|f| f.config.inference_component.as_deref() == Some(component))
    else {
        return aws_json_error(
            "ValidationException",
            &format!("Could not find inference component \"{component}\"."),
        );
    };
    let endpoint = &fleet.config.name;
    answer(&json!({
        "InferenceComponentName": component,
        "InferenceComponentArn": format!("arn:aws:sagemaker:{region}:{ACCOUNT}:inference-component/{}", component.to_lowercase()),
        "EndpointName": endpoint,
        "EndpointArn": format!("arn:aws:sagemaker:{region}:{ACCOUNT}:endpoint/{}", endpoint.to_lowercase()),
        "VariantName": "AllTraffic",
        "RuntimeConfig": {"DesiredCopyCount": fleet.desired(), "CurrentCopyCount": fleet.copies()},
        "InferenceComponentStatus": "InService",
        "CreationTime": CREATED,
        "LastModifiedTime": CREATED,
    }))
}

fn answer(v: &Value) -> Response {
    let mut r = v.to_string().into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(crate::sagemaker::control::CONTENT_TYPE),
    );
    r
}

fn aws_json_error(kind: &'static str, message: &str) -> Response {
    let mut r = (
        StatusCode::BAD_REQUEST,
        json!({ "__type": kind, "message": message }).to_string(),
    )
        .into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(crate::sagemaker::control::CONTENT_TYPE),
    );
    h.insert(X_AMZN_ERROR_TYPE, HeaderValue::from_static(kind));
    r
}

/// `POST /_sim/sagemaker`: scale one fleet.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Scale {
    endpoint: String,
    #[serde(default)]
    inference_component: Option<String>,
    copies: u32,
}

/// `GET /_sim/sagemaker`: every fleet.
pub(super) fn stats(fleets: &Fleets) -> Response {
    let all: Vec<_> = fleets.iter().map(|f| f.stats()).collect();
    axum::Json(json!({ "endpoints": all })).into_response()
}

/// `POST /_sim/sagemaker` `{"endpoint": ..., "inference_component": ..., "copies": N}`: asks for
/// N copies (they arrive after the fleet's `scale_delay_ms`); answers the fleet's stats.
pub(super) fn scale(fleets: &Fleets, body: &Bytes) -> Response {
    let scale: Scale = match serde_json::from_slice(body) {
        Ok(s) => s,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response(),
    };
    match fleets.find(&scale.endpoint, scale.inference_component.as_deref()) {
        Some(fleet) => {
            fleet.scale(scale.copies);
            axum::Json(fleet.stats()).into_response()
        }
        None => (
            StatusCode::NOT_FOUND,
            format!(
                "no simulated endpoint {:?} / {:?}\n",
                scale.endpoint, scale.inference_component
            ),
        )
            .into_response(),
    }
}
