"""The simulator's body-model APIs driven by the real `openai` and `anthropic` SDKs (and boto3 for
the native side): every call's usage and the simulator's charge against its own arithmetic (the
input-token rule and burndown, rewritten here), one quota across APIs, and the SDKs' view of the
simulator's errors.

The simulator requires credentials here: the OpenAI SDK's `Authorization: Bearer`, the Anthropic
SDK's `x-api-key` (an accepted Bedrock API key), and boto3's SigV4 (the verified key pair).
"""

from __future__ import annotations

import json
import math
import urllib.request

import anthropic
import openai
import pytest

from conftest import SONNET_US, Simulator, bedrock_client, http_json

GPT = "openai.gpt-oss-120b-1:0"
GPT_SMALL = "openai.gpt-oss-20b-1:0"  # a 2,000-tokens-a-minute bucket, to be throttled
API_KEY = "sim-test-key"

SIMULATOR = f"""
time_to_first_token_ms = 0
tokens_per_second = 0
default_tokens_per_minute = 10000000
api_keys = ["{API_KEY}"]
verify_sigv4 = {{ access_key_id = "test", secret_access_key = "test" }}

[[simulator.quotas]]
model = "{GPT_SMALL}"
tokens_per_minute = 2000
"""

BURNDOWN = {GPT: 1, GPT_SMALL: 1, SONNET_US: 5}


def input_tokens(*texts: str, messages: int) -> int:
    """The simulator's input rule: ceil(UTF-8 bytes of the prompt text / 4) + 3 per message."""
    return max(1, math.ceil(sum(len(t.encode()) for t in texts) / 4) + 3 * messages)


def charge(model: str, inp: int, out: int) -> int:
    return inp + out * BURNDOWN[model]


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    s = Simulator(tmp_path_factory.mktemp("sim-apis"), SIMULATOR)
    yield s
    s.process.stop()


@pytest.fixture
def oai(sim):
    return openai.OpenAI(base_url=f"{sim.url}/openai/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
def claude(sim):
    return anthropic.Anthropic(base_url=f"{sim.url}/anthropic", api_key=API_KEY, max_retries=0)


def charged(sim, api: str) -> int:
    return sim.stats()["apis"].get(api, {}).get("tokens_charged", 0)


def test_chat_completions_json_and_streams(sim, oai):
    before = charged(sim, "OpenAIChatCompletions")
    prompt = "hello chat [sim:output=7]"
    messages = [{"role": "user", "content": prompt}]
    inp = input_tokens(prompt, messages=1)

    r = oai.chat.completions.create(model=GPT, messages=messages, max_completion_tokens=50,
                                    service_tier="flex")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (inp, 7)
    assert r.usage.total_tokens == inp + 7
    assert r.choices[0].finish_reason == "stop"
    assert math.ceil(len(r.choices[0].message.content) / 4) == 7
    assert r.service_tier == "flex"

    chunks = list(oai.chat.completions.create(model=GPT, messages=messages, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens == inp
    assert all(c.usage is None for c in chunks[:-1])
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert math.ceil(len(streamed) / 4) == 7

    plain = list(oai.chat.completions.create(model=GPT, messages=messages, stream=True))
    assert all(c.usage is None for c in plain), "no usage chunk unless asked for"
    assert plain[-1].choices[0].finish_reason == "stop"

    capped = oai.chat.completions.create(model=GPT, messages=messages, max_tokens=3)
    assert (capped.choices[0].finish_reason, capped.usage.completion_tokens) == ("length", 3)

    assert charged(sim, "OpenAIChatCompletions") - before == 3 * charge(GPT, inp, 7) + charge(GPT, inp, 3)


def test_responses_json_and_stream(sim, oai):
    before = charged(sim, "OpenAIResponses")
    prompt = "hello responses [sim:output=9]"
    instructions = "be terse"
    inp = input_tokens(prompt, instructions, messages=1)

    r = oai.responses.create(model=GPT, input=prompt, instructions=instructions, max_output_tokens=64)
    assert r.status == "completed"
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (inp, 9, inp + 9)
    assert math.ceil(len(r.output_text) / 4) == 9

    events = list(oai.responses.create(model=GPT, input=prompt, instructions=instructions, stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert math.ceil(len(deltas) / 4) == 9
    assert events[-1].response.output_text == deltas
    assert events[-1].response.usage.output_tokens == 9
    assert [e.sequence_number for e in events] == list(range(len(events)))

    items = [{"role": "user", "content": [{"type": "input_text", "text": prompt}]}]
    capped = oai.responses.create(model=GPT, input=items, max_output_tokens=4)
    assert capped.status == "incomplete"
    assert capped.incomplete_details.reason == "max_output_tokens"
    assert capped.usage.output_tokens == 4
    items_inp = input_tokens(prompt, messages=1)

    assert charged(sim, "OpenAIResponses") - before == (
        2 * charge(GPT, inp, 9) + charge(GPT, items_inp, 4))


def test_anthropic_messages_json_and_stream(sim, claude):
    before = charged(sim, "AnthropicMessages")
    prompt = "hello claude [sim:output=11]"
    system = "you are a simulator"
    inp = input_tokens(prompt, system, messages=1)
    messages = [{"role": "user", "content": prompt}]

    m = claude.messages.create(model=SONNET_US, max_tokens=100, system=system, messages=messages)
    assert (m.usage.input_tokens, m.usage.output_tokens) == (inp, 11)
    assert m.stop_reason == "end_turn"
    assert math.ceil(len(m.content[0].text) / 4) == 11

    with claude.messages.stream(model=SONNET_US, max_tokens=100, system=system, messages=messages) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert math.ceil(len(text) / 4) == 11
    assert (final.usage.input_tokens, final.usage.output_tokens) == (inp, 11)

    capped = claude.messages.create(model=SONNET_US, max_tokens=5, system=system, messages=messages)
    assert (capped.stop_reason, capped.usage.output_tokens) == ("max_tokens", 5)

    assert charged(sim, "AnthropicMessages") - before == (
        2 * charge(SONNET_US, inp, 11) + charge(SONNET_US, inp, 5))


def test_anthropic_bedrock_client_uses_the_native_invoke_paths(sim):
    before = sim.stats()["operations"]
    client = anthropic.AnthropicBedrock(aws_access_key="test", aws_secret_key="test",
                                        aws_region="us-east-1", base_url=sim.url, max_retries=0)
    prompt = "native [sim:output=6]"
    m = client.messages.create(model=SONNET_US, max_tokens=50,
                               messages=[{"role": "user", "content": prompt}])
    assert (m.usage.input_tokens, m.usage.output_tokens) == (input_tokens(prompt, messages=1), 6)
    with client.messages.stream(model=SONNET_US, max_tokens=50,
                                messages=[{"role": "user", "content": prompt}]) as s:
        assert s.get_final_message().usage.output_tokens == 6
    after = sim.stats()["operations"]
    assert after["InvokeModel"] - before.get("InvokeModel", 0) == 1
    assert after["InvokeModelWithResponseStream"] - before.get("InvokeModelWithResponseStream", 0) == 1


def test_one_quota_across_apis_and_errors_the_sdks_understand(sim, oai, claude):
    # boto3 Converse drains most of GPT_SMALL's 2,000-token minute (1,900 output, burndown 1).
    boto = bedrock_client(sim.url)
    out = boto.converse(modelId=GPT_SMALL,
                        messages=[{"role": "user", "content": [{"text": "drain [sim:output=1900]"}]}],
                        inferenceConfig={"maxTokens": 1950})
    assert out["usage"]["outputTokens"] == 1900
    messages = [{"role": "user", "content": "too much"}]
    with pytest.raises(openai.RateLimitError) as e:
        oai.chat.completions.create(model=GPT_SMALL, messages=messages, max_tokens=500)
    assert e.value.status_code == 429
    assert e.value.body["message"] == "Too many tokens, please wait before trying again."
    assert e.value.body["code"] == "rate_limit_exceeded"
    with pytest.raises(anthropic.RateLimitError) as e:
        claude.messages.create(model=GPT_SMALL, max_tokens=500, messages=messages)
    assert e.value.body["error"]["type"] == "rate_limit_error"
    bucket = sim.stats()["buckets"][f"{GPT_SMALL}@us-east-1"]
    assert (bucket["completed"], bucket["throttled"]) == (1, 2)

    # A day used up: the SDKs see Bedrock's daily message.
    body = json.dumps({"model": GPT, "tokens_used": 10_000_000 * 1440}).encode()
    req = urllib.request.Request(f"{sim.url}/_sim/daily", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
    with pytest.raises(openai.RateLimitError) as e:
        oai.responses.create(model=GPT, input="x", max_output_tokens=16)
    assert e.value.body["message"] == "Too many tokens per day, please wait before trying again."

    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4o", messages=messages)
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-3-opus", max_tokens=5, messages=messages)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=GPT, messages=[])
    assert "messages is required" in e.value.body["message"]
    bad_key = openai.OpenAI(base_url=f"{sim.url}/openai/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):
        bad_key.chat.completions.create(model=GPT, messages=messages)
    assert http_json(f"{sim.url}/_sim/stats")["api_keys"]["rejected"] >= 1
