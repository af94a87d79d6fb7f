"""Admission decisions as boto3 sees them: rejections are Bedrock's ThrottlingException with a
retry hint that boto3's standard retry mode obeys; requests that can never be admitted are
ValidationExceptions that say what to change."""

from __future__ import annotations

import json
import math
import re
import threading
import time

import boto3
import botocore
import pytest
from botocore.exceptions import ClientError

from conftest import HAIKU, pool

# A small Claude 3 Haiku bucket: 3600 tokens per minute refills 60 tokens a second. (Below
# Haiku's 4096 output-token limit, so any maxTokens that fits the bucket is valid upstream.)
SMALL_POOL = "haiku-small"
SMALL_TPM = 3600
REFILL_PER_S = SMALL_TPM / 60

# Timing slack for the lower-bound checks: clocks and event dispatch, never an upper bound.
TOLERANCE_S = 0.015


def small_pool_proxy(start_proxy):
    return start_proxy(pool(SMALL_POOL, HAIKU, tokens_per_minute=SMALL_TPM, burndown=1,
                            max_concurrency=4, default_max_tokens=500))


def converse_haiku(client, prompt: str, max_tokens: int) -> dict:
    return client.converse(
        modelId=HAIKU,
        messages=[{"role": "user", "content": [{"text": prompt}]}],
        inferenceConfig={"maxTokens": max_tokens},
    )


def drain_small_pool(proxy) -> int:
    """Spends about 3000 of the small pool's 3600 tokens with one admitted call (output x burndown
    1 is charged), then returns the tokens left."""
    response = converse_haiku(proxy.client(), "[sim:output=3000] write at length", 3000)
    assert response["usage"]["outputTokens"] == 3000
    proxy.assert_ledger_zero()
    available = proxy.pool(SMALL_POOL)["ledger"]["tokens_available"]
    assert available < SMALL_TPM - 2500, f"the drain was charged: {available} left"
    return available


def error_of(excinfo) -> tuple[str, int, dict, str]:
    """(error code, HTTP status, lower-cased response headers, message) of a boto3 ClientError."""
    response = excinfo.value.response
    meta = response["ResponseMetadata"]
    return (response["Error"]["Code"], meta["HTTPStatusCode"], meta["HTTPHeaders"],
            response["Error"]["Message"])


def boto3_version_at_least(major: int, minor: int) -> bool:
    def parts(v: str) -> tuple[int, int]:
        m = re.match(r"(\d+)\.(\d+)", v)
        return (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    return min(parts(boto3.__version__), parts(botocore.__version__)) >= (major, minor)


def too_big_calls(available: int) -> dict:
    """One call per quota-counted operation, each asking for 600 more tokens than are left."""
    max_tokens = available + 600
    messages = [{"role": "user", "content": [{"text": "[sim:output=1] hi"}]}]
    body = json.dumps({"anthropic_version": "bedrock-2023-05-31", "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "[sim:output=1] hi"}]})
    return {
        "Converse": lambda c: c.converse(
            modelId=HAIKU, messages=messages, inferenceConfig={"maxTokens": max_tokens}),
        "ConverseStream": lambda c: list(c.converse_stream(
            modelId=HAIKU, messages=messages, inferenceConfig={"maxTokens": max_tokens})["stream"]),
        "InvokeModel": lambda c: c.invoke_model(modelId=HAIKU, body=body),
        "InvokeModelWithResponseStream": lambda c: list(
            c.invoke_model_with_response_stream(modelId=HAIKU, body=body)["body"]),
    }


def test_rejection_is_a_throttling_exception_with_hints(start_proxy, simulator):
    """A request that does not fit now is rejected before it reaches upstream, and boto3 sees
    Bedrock's own shape for every quota-counted operation (streaming ones included):
    ClientError ThrottlingException, HTTP 429, with x-amz-retry-after (ms), Retry-After (s),
    x-tokengate-reason and x-tokengate-pool. With one attempt allowed, boto3 does not retry."""
    proxy = small_pool_proxy(start_proxy)
    available = drain_small_pool(proxy)
    upstream_before = simulator.stats()["operations"]
    client = proxy.client(max_attempts=1)

    calls = too_big_calls(available)
    for operation, call in calls.items():
        with pytest.raises(ClientError) as excinfo:
            call(client)
        code, status, headers, message = error_of(excinfo)
        assert (code, status) == ("ThrottlingException", 429), f"{operation}: {message}"
        assert headers["x-tokengate-reason"] == "tokens", operation
        assert headers["x-tokengate-pool"] == SMALL_POOL, operation
        hint_ms = int(headers["x-amz-retry-after"])
        assert hint_ms > 0, operation
        assert int(headers["retry-after"]) == max(1, math.ceil(hint_ms / 1000)), operation
        assert excinfo.value.response["ResponseMetadata"]["RetryAttempts"] == 0, operation

    assert simulator.stats()["operations"] == upstream_before, \
        "the rejected calls never reached upstream"
    assert proxy.pool(SMALL_POOL)["rejected"]["tokens"] == len(calls)
    proxy.assert_ledger_zero()


class AttemptLog:
    """Each attempt's send time and, for each answered attempt, its status and x-amz-retry-after,
    recorded from botocore's own events (so it sees every retry boto3 makes)."""

    def __init__(self, client, operation: str):
        self.sent: list[float] = []
        self.answers: list[tuple[int, int | None]] = []
        self.reasons: list[str | None] = []
        events = client.meta.events
        events.register(f"before-send.bedrock-runtime.{operation}", self._before_send)
        events.register(f"needs-retry.bedrock-runtime.{operation}", self._needs_retry)

    def _before_send(self, **_kwargs):
        self.sent.append(time.monotonic())

    def _needs_retry(self, response=None, **_kwargs):
        if response is not None:
            http, _parsed = response
            hint = http.headers.get("x-amz-retry-after")
            self.answers.append((http.status_code, int(hint) if hint is not None else None))
            self.reasons.append(http.headers.get("x-tokengate-reason"))

    def assert_each_gap_at_least_the_hint(self) -> None:
        """Every attempt but the last was a 429 with a hint, and the next attempt was sent no
        sooner than that hint said (a lower bound only)."""
        assert len(self.answers) == len(self.sent)
        for k, (status, hint_ms) in enumerate(self.answers[:-1]):
            assert status == 429 and hint_ms is not None, self.answers
            gap = self.sent[k + 1] - self.sent[k]
            assert gap >= hint_ms / 1000 - TOLERANCE_S, \
                f"attempt {k + 2} came {gap * 1000:.0f} ms after attempt {k + 1}, told {hint_ms} ms"


def test_boto3_standard_retries_wait_at_least_the_hint(start_proxy):
    """boto3 >= 1.44 in standard retry mode obeys x-amz-retry-after: the gap between attempt k
    and attempt k+1 is at least the hint that attempt k's 429 carried. The hint here is well
    above boto3's own first backoff (under 1 s), so a client ignoring it would fail this test;
    the retry that comes back when told finds room and succeeds."""
    if not boto3_version_at_least(1, 44):
        pytest.skip(f"boto3 {boto3.__version__} (botocore {botocore.__version__}) predates "
                    "x-amz-retry-after support (1.44)")
    proxy = small_pool_proxy(start_proxy)
    available = drain_small_pool(proxy)
    client = proxy.client(max_attempts=4)
    log = AttemptLog(client, "Converse")

    # Needs about 90 tokens more than are left: the bucket refills them in about 1.5 s.
    deficit = 90
    response = converse_haiku(client, "[sim:output=1] hi", available + deficit)

    assert response["usage"]["outputTokens"] == 1
    assert len(log.sent) >= 2, "the first attempt was rejected and retried"
    assert log.answers[-1][0] == 200
    assert response["ResponseMetadata"]["RetryAttempts"] == len(log.sent) - 1
    first_status, first_hint = log.answers[0]
    assert (first_status, log.reasons[0]) == (429, "tokens")
    assert first_hint is not None and first_hint >= 1000 * deficit / REFILL_PER_S * 0.9, \
        f"the hint projects the refill: {first_hint} ms"
    log.assert_each_gap_at_least_the_hint()
    assert proxy.pool(SMALL_POOL)["rejected"]["tokens"] == len(log.sent) - 1
    proxy.assert_ledger_zero()


def test_boto3_retries_wait_at_least_the_hint_while_a_stream_holds_the_slot(start_proxy):
    """The same lower bound when the limit is concurrency: a 2-second stream holds the pool's
    only slot, a Converse is rejected (reason concurrency) possibly several times, and each
    retry comes no sooner than the hint of the attempt before; it succeeds once the slot frees."""
    if not boto3_version_at_least(1, 44):
        pytest.skip(f"boto3 {boto3.__version__} predates x-amz-retry-after support (1.44)")
    slow_simulator = ("[simulator]\ntime_to_first_token_ms = 0\ntokens_per_second = 200\n"
                      "default_tokens_per_minute = 10000000\n")
    proxy = start_proxy(pool("haiku-one-slot", HAIKU, tokens_per_minute=1_000_000, burndown=1,
                             max_concurrency=1),
                        extra=slow_simulator, endpoint="simulated")
    held = proxy.client().converse_stream(
        modelId=HAIKU, messages=[{"role": "user", "content": [{"text": "[sim:output=400] long"}]}],
        inferenceConfig={"maxTokens": 500})
    reader = threading.Thread(target=lambda: list(held["stream"]), daemon=True)
    reader.start()

    client = proxy.client(max_attempts=6)
    log = AttemptLog(client, "Converse")
    response = converse_haiku(client, "[sim:output=1] hi", 10)
    reader.join(timeout=60)

    assert response["usage"]["outputTokens"] == 1
    assert len(log.sent) >= 2, "the first attempt found the slot taken"
    assert (log.answers[0][0], log.reasons[0]) == (429, "concurrency")
    assert log.answers[-1][0] == 200
    log.assert_each_gap_at_least_the_hint()
    proxy.assert_ledger_zero()


def test_the_admission_queue_holds_a_boto3_call_instead_of_bouncing_it(start_proxy):
    """With max_wait_ms set, a call that finds the pool's only slot taken waits in the admission
    queue and succeeds on its first attempt, once the stream holding the slot ends."""
    slow_simulator = ("[simulator]\ntime_to_first_token_ms = 0\ntokens_per_second = 400\n"
                      "default_tokens_per_minute = 10000000\n")
    proxy = start_proxy(pool("haiku-queued", HAIKU, tokens_per_minute=1_000_000, burndown=1,
                             max_concurrency=1, max_wait_ms=10_000),
                        extra=slow_simulator, endpoint="simulated")
    held = proxy.client().converse_stream(
        modelId=HAIKU, messages=[{"role": "user", "content": [{"text": "[sim:output=400] long"}]}],
        inferenceConfig={"maxTokens": 500})
    reader = threading.Thread(target=lambda: list(held["stream"]), daemon=True)
    reader.start()

    client = proxy.client(max_attempts=1)
    log = AttemptLog(client, "Converse")
    response = converse_haiku(client, "[sim:output=1] hi", 10)
    reader.join(timeout=60)

    assert response["usage"]["outputTokens"] == 1
    assert len(log.sent) == 1, "one attempt: it waited instead of being rejected"
    state = proxy.pool("haiku-queued")
    assert state["rejected"]["concurrency"] == 0
    assert state["queue"]["depth"] == 0
    proxy.assert_ledger_zero()


def test_unknown_model_is_a_validation_exception(proxy):
    """A model id that no pool covers is refused with a Bedrock-shaped ValidationException that
    names the model and points at [[pools]]; boto3 does not retry it."""
    model = "meta.llama3-70b-instruct-v1:0"
    client = proxy.client(max_attempts=3)
    with pytest.raises(ClientError) as excinfo:
        client.converse(modelId=model, messages=[{"role": "user", "content": [{"text": "hi"}]}],
                        inferenceConfig={"maxTokens": 10})
    code, status, headers, message = error_of(excinfo)
    assert (code, status) == ("ValidationException", 400)
    assert headers.get("x-amzn-errortype", "").startswith("ValidationException")
    assert model in message and "[[pools]]" in message, message
    assert excinfo.value.response["ResponseMetadata"]["RetryAttempts"] == 0
    proxy.assert_ledger_zero()


def test_max_tokens_over_the_bucket_is_a_validation_exception_with_advice(start_proxy):
    """maxTokens larger than the pool's whole bucket can never be admitted: a ValidationException
    (not an endless 429) whose message says which maxTokens would fit, and that advice is right:
    the same call with the suggested maxTokens is admitted."""
    proxy = small_pool_proxy(start_proxy)
    client = proxy.client(max_attempts=3)
    with pytest.raises(ClientError) as excinfo:
        converse_haiku(client, "[sim:output=1] hi", SMALL_TPM + 300)
    code, status, _headers, message = error_of(excinfo)
    assert (code, status) == ("ValidationException", 400), message
    assert excinfo.value.response["ResponseMetadata"]["RetryAttempts"] == 0
    match = re.search(r"maxTokens to at most (\d+)", message)
    assert match, f"the message says which maxTokens would fit: {message}"
    suggested = int(match.group(1))
    assert 0 < suggested < SMALL_TPM
    assert proxy.pool(SMALL_POOL)["rejected"]["never_fits"] == 1

    response = converse_haiku(client, "[sim:output=1] hi", suggested)
    assert response["usage"]["outputTokens"] == 1
    assert response["ResponseMetadata"]["RetryAttempts"] == 0, "admitted at the first attempt"
    proxy.assert_ledger_zero()
