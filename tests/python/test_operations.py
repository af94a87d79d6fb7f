"""Every bedrock-runtime model operation, called with boto3 through the proxy, gives the same
result as the same call made directly to the simulator, for each kind of model id."""

from __future__ import annotations

import contextlib
import json

import pytest

from conftest import HAIKU, SONNET_US, SONNET_US_ARN

MODELS = [
    pytest.param(HAIKU, id="base-model"),
    pytest.param(SONNET_US, id="us-profile"),
    pytest.param(SONNET_US_ARN, id="profile-arn"),
]

# The pool each model id must be admitted through (the ARN names the us. profile).
POOL_OF = {HAIKU: "haiku3", SONNET_US: "sonnet4-us", SONNET_US_ARN: "sonnet4-us"}

LATENCY_FIELDS = {"latencyMs", "invocationLatency", "firstByteLatency"}


def strip_volatile(value):
    """Drops what legitimately differs between two identical calls: latencies, response ids and
    boto3's per-call ResponseMetadata."""
    if isinstance(value, dict):
        return {
            k: strip_volatile(v)
            for k, v in value.items()
            if k not in LATENCY_FIELDS and k not in ("id", "ResponseMetadata")
        }
    if isinstance(value, list):
        return [strip_volatile(v) for v in value]
    return value


def prompt_for(model: str) -> str:
    return f"Summarise the quarterly report for {model}."


def messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": [{"text": prompt}]}]


def anthropic_body(prompt: str) -> str:
    return json.dumps({
        "anthropic_version": "bedrock-2023-05-31",
        "max_tokens": 200,
        "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
    })


def converse(client, model: str) -> dict:
    response = client.converse(
        modelId=model, messages=messages(prompt_for(model)), inferenceConfig={"maxTokens": 300}
    )
    return strip_volatile(response)


def converse_stream(client, model: str) -> list[dict]:
    response = client.converse_stream(
        modelId=model, messages=messages(prompt_for(model)), inferenceConfig={"maxTokens": 300}
    )
    return [strip_volatile(event) for event in response["stream"]]


def invoke(client, model: str) -> dict:
    response = client.invoke_model(
        modelId=model, body=anthropic_body(prompt_for(model)),
        contentType="application/json", accept="application/json",
    )
    headers = response["ResponseMetadata"]["HTTPHeaders"]
    return {
        "contentType": response["contentType"],
        "body": strip_volatile(json.loads(response["body"].read())),
        "usage_headers": {
            k: v for k, v in headers.items()
            if k.startswith("x-amzn-bedrock-") and "latency" not in k
        },
    }


def invoke_stream(client, model: str) -> list[dict]:
    response = client.invoke_model_with_response_stream(
        modelId=model, body=anthropic_body(prompt_for(model)), contentType="application/json",
    )
    return [strip_volatile(json.loads(event["chunk"]["bytes"])) for event in response["body"]]


def count_tokens(client, model: str) -> dict:
    response = client.count_tokens(
        modelId=model, input={"converse": {"messages": messages(prompt_for(model))}}
    )
    return strip_volatile(response)


@contextlib.contextmanager
def admitted_through(proxy, model: str, times: int = 1):
    """Asserts the block's proxied calls were admitted `times` times, all through the pool that
    the model id resolves to, and that the ledger returned to zero afterwards."""
    before = {p["name"]: p["admitted"] for p in proxy.pools()["pools"]}
    yield
    after = {p["name"]: p["admitted"] for p in proxy.pools()["pools"]}
    delta = {name: after[name] - before[name] for name in after if after[name] != before[name]}
    expected = {POOL_OF[model]: times} if times else {}
    assert delta == expected, f"admissions by pool for {model}"


def event_kinds(events: list[dict]) -> list[str]:
    """Event names in order, with runs of contentBlockDelta collapsed to one."""
    kinds: list[str] = []
    for event in events:
        (kind,) = event.keys()
        if not (kind == "contentBlockDelta" and kinds and kinds[-1] == kind):
            kinds.append(kind)
    return kinds


@pytest.mark.parametrize("model", MODELS)
def test_converse_equals_direct(proxy, simulator, model):
    """Converse through the proxy: a real answer with usage, identical to the direct call."""
    with admitted_through(proxy, model, times=1):
        via = converse(proxy.client(), model)
    assert via["usage"]["outputTokens"] > 0
    assert via["output"]["message"]["content"][0]["text"]
    assert via == converse(simulator.client(), model)


@pytest.mark.parametrize("model", MODELS)
def test_converse_stream_equals_direct(proxy, simulator, model):
    """ConverseStream through the proxy: every event, in Bedrock's order, ending with metadata
    that carries usage; identical to the direct stream."""
    with admitted_through(proxy, model, times=1):
        via = converse_stream(proxy.client(), model)
    kinds = event_kinds(via)
    kinds_without_block_start = [k for k in kinds if k != "contentBlockStart"]
    assert kinds_without_block_start == [
        "messageStart", "contentBlockDelta", "contentBlockStop", "messageStop", "metadata"
    ], kinds
    usage = via[-1]["metadata"]["usage"]
    assert usage["inputTokens"] > 0 and usage["outputTokens"] > 0
    assert usage["totalTokens"] == usage["inputTokens"] + usage["outputTokens"]
    deltas = [e for e in via if "contentBlockDelta" in e]
    assert len(deltas) > 1, "the answer arrives as several deltas"
    assert via == converse_stream(simulator.client(), model)


@pytest.mark.parametrize("model", MODELS)
def test_invoke_model_equals_direct(proxy, simulator, model):
    """InvokeModel (Anthropic messages body): the model-native body and the usage headers are
    identical to the direct call."""
    with admitted_through(proxy, model, times=1):
        via = invoke(proxy.client(), model)
    assert via["body"]["usage"]["output_tokens"] > 0
    assert int(via["usage_headers"]["x-amzn-bedrock-output-token-count"]) > 0
    assert via == invoke(simulator.client(), model)


@pytest.mark.parametrize("model", MODELS)
def test_invoke_model_with_response_stream_equals_direct(proxy, simulator, model):
    """InvokeModelWithResponseStream: every chunk identical to the direct stream, and the last
    chunk carries amazon-bedrock-invocationMetrics."""
    with admitted_through(proxy, model, times=1):
        via = invoke_stream(proxy.client(), model)
    assert len(via) >= 2
    metrics = via[-1].get("amazon-bedrock-invocationMetrics")
    assert metrics, f"last chunk carries invocation metrics: {via[-1]}"
    assert metrics["inputTokenCount"] > 0 and metrics["outputTokenCount"] > 0
    assert via == invoke_stream(simulator.client(), model)


@pytest.mark.parametrize("model", MODELS)
def test_count_tokens_equals_direct(proxy, simulator, model):
    """CountTokens through the proxy: the same inputTokens as direct, and (being free of charge)
    it takes nothing from any pool."""
    with admitted_through(proxy, model, times=0):
        via = count_tokens(proxy.client(), model)
    assert via["inputTokens"] > 0
    assert via == count_tokens(simulator.client(), model)
