"""Adaptive maxTokens with boto3 (issue #22): a route's `adaptive_max_tokens` learns an output cap
from the answers it sees, shows it in `/v1/pools`, and writes it into the forwarded request (the
simulator stops at the maxTokens it receives, so an answer longer than the cap comes back cut at
it); with `adaptive_retry` a Converse call the cap cut is sent again with the caller's own
maxTokens. The ledger returns to zero after each."""

from __future__ import annotations

import json

from conftest import HAIKU, pool

ROUTE = '[[routes]]\nname = "chat"\n{extra}adaptive_max_tokens = {{ min_samples = 5, floor = 64 }}\n'


def haiku_pool() -> str:
    return pool("haiku3", HAIKU, tokens_per_minute=10_000_000, burndown=1, default_max_tokens=4000)


def converse(client, prompt: str, max_tokens: int) -> dict:
    return client.converse(
        modelId=HAIKU,
        messages=[{"role": "user", "content": [{"text": prompt}]}],
        inferenceConfig={"maxTokens": max_tokens},
    )


def learner(proxy) -> dict:
    views = proxy.pool("haiku3")["adaptive_max_tokens"]
    assert len(views) == 1, views
    assert (views[0]["route"], views[0]["model"]) == ("chat", HAIKU)
    return views[0]


def learned_proxy(start_proxy, route_extra: str = ""):
    """A proxy whose route `chat` learned from five answers of 100 tokens (the cap is 100 x 1.2,
    rounded up to 128), and a boto3 client of it."""
    proxy = start_proxy(haiku_pool(), extra=ROUTE.format(extra=route_extra))
    client = proxy.client()
    for _ in range(4):
        assert converse(client, "[sim:output=100] a", 4000)["usage"]["outputTokens"] == 100
    before = learner(proxy)
    assert (before["samples"], before["cap"]) == (4, None), "the caller's value until min_samples"
    assert converse(client, "[sim:output=100] a", 4000)["usage"]["outputTokens"] == 100
    after = learner(proxy)
    assert (after["samples"], after["cap"], after["quantile_output"]) == (5, 128, 100), after
    return proxy, client


def test_the_learned_cap_is_shown_and_written_into_boto3_calls(start_proxy):
    proxy, client = learned_proxy(start_proxy)
    # Written into Converse's inferenceConfig.maxTokens: a 900-token answer comes back at 128.
    out = converse(client, "[sim:output=900] b", 4000)
    assert (out["usage"]["outputTokens"], out["stopReason"]) == (128, "max_tokens")
    # And into InvokeModel's Anthropic max_tokens.
    body = {"anthropic_version": "bedrock-2023-05-31", "max_tokens": 4000,
            "messages": [{"role": "user", "content": "[sim:output=900] c"}]}
    answer = json.loads(client.invoke_model(modelId=HAIKU, body=json.dumps(body))["body"].read())
    assert (answer["usage"]["output_tokens"], answer["stop_reason"]) == (128, "max_tokens")
    # Never above the caller's own value.
    assert converse(client, "[sim:output=900] d", 100)["usage"]["outputTokens"] == 100
    view = learner(proxy)
    assert (view["capped_calls"], view["proxy_truncations"]) == (2, 2), view
    proxy.assert_ledger_zero()


def test_adaptive_retry_returns_the_whole_answer_to_boto3(start_proxy):
    proxy, client = learned_proxy(start_proxy, "adaptive_retry = true\n")
    out = converse(client, "[sim:output=900] e", 4000)
    assert (out["usage"]["outputTokens"], out["stopReason"]) == (900, "end_turn")
    assert out["ResponseMetadata"]["HTTPHeaders"]["x-tokengate-adaptive-retry"] == "answered"
    view = learner(proxy)
    # The first call (cut at 128) and its retry (900) both settled and were learned.
    assert (view["samples"], view["proxy_truncations"]) == (7, 1), view
    proxy.assert_ledger_zero()
