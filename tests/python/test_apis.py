"""The OpenAI and Anthropic APIs through the proxy, driven by their own SDKs (installed from PyPI):
`openai` chat completions and responses, streaming and not; `anthropic` with `base_url` to
`/anthropic`, and `AnthropicBedrock`, which calls the native invoke paths. Each call's settlement
equals the simulator's charge; the SDKs read the proxy's refusals as the errors they are and obey
its retry hints.
"""

from __future__ import annotations

import re
import subprocess
import time
import urllib.request

import anthropic
import openai
import pytest

from conftest import SONNET_US, pool, process_env, tokengate_bin, write_config

GPT = "openai.gpt-oss-120b-1:0"
# The catalogue knows no maximum output for gpt-oss: the pool sets the simulator's.
GPT_MAX = "max_output_tokens = 4096"
TOLERANCE_S = 0.05  # clock granularity between the hook's timestamps


def metric_sum(proxy, name: str, **labels: str) -> float:
    """The sum of `name` over every series whose labels include `labels`."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    text = opener.open(f"{proxy.url}/metrics", timeout=10).read().decode()
    total = 0.0
    for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


class Charges:
    """What the proxy settled against what the simulator charged, call by call."""

    def __init__(self, proxy, simulator):
        self.proxy, self.simulator = proxy, simulator
        self.before = self.now()

    def now(self) -> tuple[float, int, float]:
        sim = sum(b["tokens_charged"] for b in self.simulator.stats()["buckets"].values())
        return (metric_sum(self.proxy, "tokengate_charged_tokens_total"), sim,
                metric_sum(self.proxy, "tokengate_settlements_total", rule="usage"))

    def assert_call_settled(self) -> int:
        """The call since the last check settled on its usage, at exactly the simulator's charge."""
        self.proxy.assert_ledger_zero()
        after = self.now()
        proxy, sim, by_usage = (a - b for a, b in zip(after, self.before))
        self.before = after
        assert by_usage == 1, "settled on the usage upstream reported"
        assert sim > 0 and proxy == sim, f"proxy settled {proxy}, the simulator charged {sim}"
        return sim


@pytest.fixture
def api_proxy(start_proxy):
    pools = (pool("gpt", GPT, tokens_per_minute=1_000_000, burndown=1, extra=GPT_MAX)
             + pool("sonnet4-us", SONNET_US, tokens_per_minute=1_000_000, burndown=5))
    return start_proxy(pools)


@pytest.fixture
def charges(api_proxy, simulator):
    return Charges(api_proxy, simulator)


def test_openai_chat_completions_streaming_and_not(api_proxy, charges):
    client = openai.OpenAI(base_url=f"{api_proxy.url}/openai/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hello chat [sim:output=7]"}]

    r = client.chat.completions.create(model=GPT, messages=messages, max_completion_tokens=50)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (7, "stop")
    assert charges.assert_call_settled() == r.usage.prompt_tokens + 7

    # Not asked for: no chunk carries usage (the proxy asked upstream, and took it out), and the
    # call still settles on the usage upstream reported.
    chunks = list(client.chat.completions.create(model=GPT, messages=messages, stream=True))
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks), "no empty-choices usage chunk"
    assert chunks[-1].choices[0].finish_reason == "stop"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert len(text) > 0
    charges.assert_call_settled()

    # Asked for: the usage chunk arrives as the client asked.
    chunks = list(client.chat.completions.create(
        model=GPT, messages=messages, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert charges.assert_call_settled() == chunks[-1].usage.total_tokens

    capped = client.chat.completions.create(model=GPT, messages=messages, max_tokens=3)
    assert (capped.choices[0].finish_reason, capped.usage.completion_tokens) == ("length", 3)
    charges.assert_call_settled()


def test_openai_responses_streaming_and_not(api_proxy, charges):
    client = openai.OpenAI(base_url=f"{api_proxy.url}/openai/v1", api_key="unused", max_retries=0)
    prompt = "hello responses [sim:output=9]"
    r = client.responses.create(model=GPT, input=prompt, instructions="be terse", max_output_tokens=64)
    assert (r.status, r.usage.output_tokens) == ("completed", 9)
    assert charges.assert_call_settled() == r.usage.total_tokens

    events = list(client.responses.create(model=GPT, input=prompt, stream=True))
    assert events[-1].type == "response.completed"
    assert charges.assert_call_settled() == events[-1].response.usage.total_tokens

    capped = client.responses.create(model=GPT, input=prompt, max_output_tokens=4)
    assert (capped.status, capped.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    charges.assert_call_settled()


def test_anthropic_messages_streaming_and_not(api_proxy, charges):
    client = anthropic.Anthropic(base_url=f"{api_proxy.url}/anthropic", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hello claude [sim:output=11]"}]
    m = client.messages.create(model=SONNET_US, max_tokens=100, system="sim", messages=messages)
    assert (m.usage.output_tokens, m.stop_reason) == (11, "end_turn")
    assert charges.assert_call_settled() == m.usage.input_tokens + 5 * 11

    with client.messages.stream(model=SONNET_US, max_tokens=100, messages=messages) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text and final.usage.output_tokens == 11
    assert charges.assert_call_settled() == final.usage.input_tokens + 5 * 11

    capped = client.messages.create(model=SONNET_US, max_tokens=5, messages=messages)
    assert (capped.stop_reason, capped.usage.output_tokens) == ("max_tokens", 5)
    charges.assert_call_settled()


def test_anthropic_bedrock_uses_the_native_invoke_paths(api_proxy, charges):
    client = anthropic.AnthropicBedrock(aws_access_key="local", aws_secret_key="local",
                                        aws_region="us-east-1", base_url=api_proxy.url, max_retries=0)
    messages = [{"role": "user", "content": "native [sim:output=6]"}]
    m = client.messages.create(model=SONNET_US, max_tokens=50, messages=messages)
    assert m.usage.output_tokens == 6
    charges.assert_call_settled()
    with client.messages.stream(model=SONNET_US, max_tokens=50, messages=messages) as s:
        assert s.get_final_message().usage.output_tokens == 6
    charges.assert_call_settled()
    for op in ("InvokeModel", "InvokeModelWithResponseStream"):
        assert metric_sum(api_proxy, "tokengate_requests_total", api="bedrock", operation=op,
                          outcome="admitted") == 1, op


def test_the_sdks_read_the_proxys_refusals(api_proxy):
    oai = openai.OpenAI(base_url=f"{api_proxy.url}/openai/v1", api_key="unused", max_retries=0)
    claude = anthropic.Anthropic(base_url=f"{api_proxy.url}/anthropic", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="openai.gpt-99", messages=messages)
    assert 'no quota pool for model "openai.gpt-99"' in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=GPT, input="x", max_output_tokens=5_000_000)
    assert "set max_output_tokens to at most" in e.value.body["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=SONNET_US, max_tokens=-1, messages=messages)
    assert e.value.body["error"]["message"] == "max_tokens must be a positive integer, got -1"
    with pytest.raises(openai.NotFoundError) as e:
        oai.models.list()
    assert "POST /openai/v1/chat/completions" in e.value.body["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.models.list()
    assert "POST /anthropic/v1/messages" in e.value.body["error"]["message"]
    api_proxy.assert_ledger_zero()


class Attempts:
    """Every attempt an SDK sends and the answer it gets, from its HTTP client's event hooks."""

    def __init__(self):
        self.sent: list[float] = []
        self.answers: list[tuple[int, int | None]] = []

    def hooks(self) -> dict:
        return {"request": [lambda _r: self.sent.append(time.monotonic())],
                "response": [self._response]}

    def _response(self, response) -> None:
        hint = response.headers.get("retry-after-ms")
        self.answers.append((response.status_code, int(hint) if hint is not None else None))

    def assert_retried_after_each_hint(self) -> int:
        """Each 429 was retried, no sooner than its `retry-after-ms`; returns the 429s."""
        throttled = 0
        for k, (status, hint_ms) in enumerate(self.answers[:-1]):
            assert status == 429 and hint_ms is not None, self.answers
            gap = self.sent[k + 1] - self.sent[k]
            assert gap >= hint_ms / 1000 - TOLERANCE_S, \
                f"attempt {k + 2} came {gap * 1000:.0f} ms after attempt {k + 1}, told {hint_ms} ms"
            throttled += 1
        assert self.answers[-1][0] == 200, self.answers
        return throttled


def test_the_sdks_retry_a_throttle_after_the_hinted_delay(start_proxy):
    # 3,000 tokens a minute (50 a second), no queue: a call charged about 2,910 leaves too little
    # for the next (about 210), which is turned away with a hint of about the refill it waits for
    # (a few seconds). One proxy (one full bucket) per SDK.
    for sdk in ("openai", "anthropic"):
        proxy = start_proxy(pool("gpt", GPT, tokens_per_minute=3000, burndown=1, default_max_tokens=100, extra=GPT_MAX))
        attempts = Attempts()
        if sdk == "openai":
            http = openai.DefaultHttpxClient(event_hooks=attempts.hooks())
            client = openai.OpenAI(base_url=f"{proxy.url}/openai/v1", api_key="unused",
                                   max_retries=3, http_client=http)
            call = lambda n, text: client.chat.completions.create(  # noqa: E731
                model=GPT, max_completion_tokens=n, messages=[{"role": "user", "content": text}])
        else:
            http = anthropic.DefaultHttpxClient(event_hooks=attempts.hooks())
            client = anthropic.Anthropic(base_url=f"{proxy.url}/anthropic", api_key="unused",
                                         max_retries=3, http_client=http)
            call = lambda n, text: client.messages.create(  # noqa: E731
                model=GPT, max_tokens=n, messages=[{"role": "user", "content": text}])
        call(2950, "drain [sim:output=2900]")
        attempts.sent.clear()
        attempts.answers.clear()
        call(200, "then this [sim:output=10]")
        assert attempts.assert_retried_after_each_hint() >= 1, f"{sdk}: the pool was not drained"
        proxy.assert_ledger_zero()


def test_the_sdks_retry_of_a_call_turned_away_may_use_the_retry_reserve(start_proxy):
    # These SDKs send no call id: the proxy knows a retry by `x-stainless-retry-count` and the body,
    # which must come back byte for byte. 6,000 tokens a minute (100 a second), 2,400 kept for
    # retries: after a call charged about 3,510, a first attempt of about 430 lacks about 340 (3.4 s
    # of refill), and its retry fits the reserve. The hint is taken off the refusal so that the SDK
    # comes back after its own backoff (under a second), before the refill would admit it anyway.
    reserve = "retry_reserve = 0.4"
    for sdk in ("openai", "anthropic"):
        proxy = start_proxy(pool("gpt", GPT, tokens_per_minute=6000, burndown=1, default_max_tokens=100,
                                 extra=f"{GPT_MAX}\n{reserve}"))
        sent: list[tuple[str | None, bytes]] = []

        def unhinted(response) -> None:
            for header in ("retry-after-ms", "retry-after"):
                response.headers.pop(header, None)

        hooks = {"request": [lambda r: sent.append((r.headers.get("x-stainless-retry-count"), r.content))],
                 "response": [unhinted]}
        if sdk == "openai":
            client = openai.OpenAI(base_url=f"{proxy.url}/openai/v1", api_key="unused", max_retries=1,
                                   http_client=openai.DefaultHttpxClient(event_hooks=hooks))
            call = lambda n, text: client.chat.completions.create(  # noqa: E731
                model=GPT, max_completion_tokens=n, messages=[{"role": "user", "content": text}])
        else:
            client = anthropic.Anthropic(base_url=f"{proxy.url}/anthropic", api_key="unused", max_retries=1,
                                         http_client=anthropic.DefaultHttpxClient(event_hooks=hooks))
            call = lambda n, text: client.messages.create(  # noqa: E731
                model=GPT, max_tokens=n, messages=[{"role": "user", "content": text}])
        call(3550, "drain [sim:output=3500]")
        sent.clear()
        call(400, "then this [sim:output=10]")
        assert [count for count, _ in sent] == ["0", "1"], f"{sdk}: refused once, then admitted"
        assert sent[0][1] == sent[1][1], f"{sdk}: the retry resends the body byte for byte"
        assert metric_sum(proxy, "tokengate_recovery_admissions_total", pool="gpt") == 1, sdk
        proxy.assert_ledger_zero()


def test_check_config_says_a_sonic_pool_still_needs_sigv4_with_an_api_key(tmp_path):
    """`tokengate check-config` accepts `upstream.api_key_env` naming a set variable, notes on
    stderr that a pool's Nova Sonic model (bidirectional streams: SigV4 only) still needs AWS
    credentials, and names the key when the variable is unset."""
    pools = (pool("gpt", GPT, tokens_per_minute=100_000, burndown=1, extra=GPT_MAX)
             + pool("sonic", "amazon.nova-sonic-v1:0", tokens_per_minute=100_000, burndown=1))
    path = write_config(tmp_path, "keyed", endpoint="simulated", pools=pools)
    path.write_text(path.read_text().replace(
        'endpoint = "simulated"', 'endpoint = "simulated"\napi_key_env = "TG_TEST_BEDROCK_KEY"'))
    env = process_env()
    run = subprocess.run([str(tokengate_bin()), "check-config", str(path)], capture_output=True,
                         text=True, timeout=30, env={**env, "TG_TEST_BEDROCK_KEY": "a-key"})
    assert run.returncode == 0, run.stderr
    assert "ok (2 pools, 0 endpoints)" in run.stdout
    assert 'note: upstream.api_key_env (TG_TEST_BEDROCK_KEY): pool "sonic"' in run.stderr, run.stderr
    assert "accepts only SigV4" in run.stderr
    assert "a-key" not in run.stdout + run.stderr, "the key is never printed"
    env.pop("TG_TEST_BEDROCK_KEY", None)
    run = subprocess.run([str(tokengate_bin()), "check-config", str(path)], capture_output=True,
                         text=True, timeout=30, env=env)
    assert run.returncode != 0
    assert "upstream.api_key_env: the environment variable TG_TEST_BEDROCK_KEY is not set" in run.stderr
