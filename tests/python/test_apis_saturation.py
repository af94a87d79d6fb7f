"""One model's quota shared by three doors at twice its capacity: boto3 Converse, `openai` Chat
Completions and `anthropic` Messages callers, each with its SDK's own retry logic, against a
simulator whose quota equals the pool's. Upstream never throttles, the quota stays busy, and every
refusal the proxy answers is retried by its SDK no sooner than the hint it carried.

The pool queues a call for at most 300 ms, so that many are turned away (429 with a hint) and
retried by their SDK, each allowed 8 retries. A call its SDK gives up on is one refused on all nine
attempts, about as often as chance makes it (see the assertion).

Load: 12 closed-loop workers (4 per SDK, half of the OpenAI and Anthropic ones streaming), each
call about 200 output tokens generated at 200 tokens a second, so unthrottled they would draw
about 2.3 times the quota. The bucket starts full (a minute of quota, which this load would take a
minute to use up), so a few large-input calls empty it first. Utilisation is measured in steady
state: from when the pool first turns a call away or queues it to `TOKENGATE_MIXED_SECONDS` later,
the simulator's charge over the refill in that window (the calls in flight at either end are
about as many, and the bucket is about empty at both).

`TOKENGATE_MIXED_SECONDS` sets the run's length (default 30); loadtest/RESULTS.md has a longer run.
"""

from __future__ import annotations

import os
import threading
import time

import anthropic
import boto3
import openai
from botocore.config import Config

from conftest import HAIKU, Simulator, pool
from test_apis import TOLERANCE_S

QUOTA = 60_000  # tokens per minute: 1,000 a second
WORKERS_PER_SDK = 4
RUN_S = float(os.environ.get("TOKENGATE_MIXED_SECONDS", "30"))
RETRIES = 8
SIMULATOR = f"""
time_to_first_token_ms = 20
tokens_per_second = 200
default_tokens_per_minute = {QUOTA}
"""


class CallLog:
    """One worker's calls: each attempt's send time and answer (status, hint in ms), per call."""

    def __init__(self, hint_header: str):
        self.hint_header = hint_header
        self.calls: list[list[tuple[float, int, int | None]]] = []
        self.failures: list[str] = []

    def begin(self) -> None:
        self.calls.append([])

    def sent(self) -> None:
        self.calls[-1].append((time.monotonic(), 0, None))

    def answered(self, status: int, headers) -> None:
        at, _, _ = self.calls[-1][-1]
        hint = headers.get(self.hint_header)
        self.calls[-1][-1] = (at, status, int(hint) if hint is not None else None)

    def refusals_honoured(self) -> tuple[int, list[str]]:
        """The refusals answered, and what was wrong: every refusal carried a hint and, unless the
        SDK's budget was spent, was retried no sooner than it said."""
        refused, wrong = 0, []
        for attempts in self.calls:
            for k, (at, status, hint) in enumerate(attempts):
                if status in (200, 0):
                    continue
                refused += 1
                if status not in (429, 503) or hint is None:
                    wrong.append(f"a {status} without a hint")
                elif k + 1 < len(attempts):
                    gap = attempts[k + 1][0] - at
                    if gap < hint / 1000 - TOLERANCE_S:
                        wrong.append(f"retried after {gap * 1000:.0f} ms, told {hint} ms")
                elif len(attempts) < RETRIES + 1:
                    wrong.append(f"gave up on a {status} after {len(attempts)} attempts")
        return refused, wrong


def boto3_worker(url: str, log: CallLog, stop: threading.Event) -> None:
    client = boto3.client(
        "bedrock-runtime", endpoint_url=url, region_name="us-east-1",
        aws_access_key_id="local", aws_secret_access_key="local",
        config=Config(retries={"mode": "standard", "total_max_attempts": RETRIES + 1},
                      read_timeout=60, max_pool_connections=4))
    events = client.meta.events
    events.register("before-send.bedrock-runtime.Converse", lambda **_: log.sent())
    events.register("needs-retry.bedrock-runtime.Converse",
                    lambda response=None, **_: response and log.answered(response[0].status_code,
                                                                         response[0].headers))
    while not stop.is_set():
        log.begin()
        try:
            client.converse(modelId=HAIKU, inferenceConfig={"maxTokens": 300},
                            messages=[{"role": "user", "content": [{"text": "boto3 [sim:output=200]"}]}])
        except Exception as e:  # noqa: BLE001: every failure is counted and reported
            log.failures.append(repr(e))


def hooks(log: CallLog) -> dict:
    return {"request": [lambda _r: log.sent()],
            "response": [lambda r: log.answered(r.status_code, r.headers)]}


def openai_worker(url: str, log: CallLog, stop: threading.Event, stream: bool) -> None:
    client = openai.OpenAI(base_url=f"{url}/openai/v1", api_key="local", max_retries=RETRIES,
                           http_client=openai.DefaultHttpxClient(event_hooks=hooks(log)))
    messages = [{"role": "user", "content": "openai [sim:output=200]"}]
    while not stop.is_set():
        log.begin()
        try:
            r = client.chat.completions.create(model=HAIKU, messages=messages,
                                               max_completion_tokens=300, stream=stream)
            if stream:
                for _ in r:
                    pass
        except Exception as e:  # noqa: BLE001
            log.failures.append(repr(e))


def anthropic_worker(url: str, log: CallLog, stop: threading.Event, stream: bool) -> None:
    client = anthropic.Anthropic(base_url=f"{url}/anthropic", api_key="local", max_retries=RETRIES,
                                 http_client=anthropic.DefaultHttpxClient(event_hooks=hooks(log)))
    messages = [{"role": "user", "content": "anthropic [sim:output=200]"}]
    while not stop.is_set():
        log.begin()
        try:
            if stream:
                with client.messages.stream(model=HAIKU, max_tokens=300, messages=messages) as s:
                    s.get_final_message()
            else:
                client.messages.create(model=HAIKU, max_tokens=300, messages=messages)
        except Exception as e:  # noqa: BLE001
            log.failures.append(repr(e))


def drain(proxy) -> None:
    """Spends most of the pool's full bucket with large-input, one-token calls (the proxy
    estimates input at a third of its bytes, the simulator charges a quarter)."""
    client = boto3.client("bedrock-runtime", endpoint_url=proxy.url, region_name="us-east-1",
                          aws_access_key_id="local", aws_secret_access_key="local",
                          config=Config(retries={"mode": "standard", "total_max_attempts": 1}))
    for _ in range(10):
        available = proxy.pool("haiku")["ledger"]["tokens_available"]
        if available < QUOTA // 10:
            return
        text = "x" * int((available - 200) * 3 * 0.9)
        client.converse(modelId=HAIKU, inferenceConfig={"maxTokens": 1},
                        messages=[{"role": "user", "content": [{"text": text}]}])
    raise AssertionError(f"the bucket would not drain: {proxy.pool('haiku')['ledger']}")


def wait_for_pressure(proxy) -> None:
    """Polls (bounded) until the pool has queued or turned away a call: it is saturated."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        view = proxy.pool("haiku")
        if view["queue"]["depth"] > 0 or view["rejected"]["tokens"] > 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"the load never saturated the pool: {proxy.pool('haiku')}")


def charged(sim) -> int:
    return sum(b["tokens_charged"] for b in sim.stats()["buckets"].values())


def test_three_apis_share_one_quota_at_twice_its_capacity(start_proxy, tmp_path):
    sim = Simulator(tmp_path, SIMULATOR)
    try:
        proxy = start_proxy(pool("haiku", HAIKU, tokens_per_minute=QUOTA, burndown=1,
                                 max_concurrency=64, default_max_tokens=300, max_wait_ms=300),
                            endpoint=sim.url)
        stop = threading.Event()
        workers: list[tuple[str, CallLog, threading.Thread]] = []
        for i in range(WORKERS_PER_SDK):
            stream = i % 2 == 1
            for sdk, log, target, args in (
                ("boto3", CallLog("x-amz-retry-after"), boto3_worker, ()),
                ("openai", CallLog("retry-after-ms"), openai_worker, (stream,)),
                ("anthropic", CallLog("retry-after-ms"), anthropic_worker, (stream,)),
            ):
                thread = threading.Thread(target=target, args=(proxy.url, log, stop, *args), daemon=True)
                workers.append((sdk, log, thread))
        drain(proxy)
        for _, _, thread in workers:
            thread.start()
        wait_for_pressure(proxy)
        start, charged_before = time.monotonic(), charged(sim)
        time.sleep(RUN_S)  # the measured window, not a wait for readiness
        elapsed, used = time.monotonic() - start, charged(sim) - charged_before
        stop.set()
        for _, _, thread in workers:
            thread.join(timeout=120)
        throttled = sum(b["throttled"] for b in sim.stats()["buckets"].values())
        utilisation = used / (QUOTA / 60 * elapsed)
        report = {}
        for sdk, log, _ in workers:
            calls, refused, failed = report.get(sdk, (0, 0, 0))
            honoured, wrong = log.refusals_honoured()
            assert wrong == [], f"{sdk}: {wrong[:5]}"
            report[sdk] = (calls + len(log.calls), refused + honoured, failed + len(log.failures))
        print(f"\nmixed APIs over {elapsed:.1f} s: utilisation {utilisation:.3f}, charged {used}, "
              f"upstream throttles {throttled}; (calls, refusals, failures) by SDK {report}")
        assert throttled == 0, "upstream must never throttle"
        assert sum(r for _, r, _ in report.values()) > 0, "the load must saturate the pool"
        assert all(c > 0 for c, _, _ in report.values()), report
        # A call refused every time its SDK tried gives up with that refusal (the budget above is
        # checked to be spent), and nothing else fails. At twice the quota some do: a call meets the
        # pool as full on every attempt, so one refused a fraction p of its attempts gives up with
        # about p ** (RETRIES + 1). More than a few times that means calls were starved.
        failures = [f for _, log, _ in workers for f in log.failures]
        assert all("429" in f or "Throttling" in f for f in failures), failures[:5]
        by_chance = sum(calls * (refused / (calls - failed + refused)) ** (RETRIES + 1)
                        for calls, refused, failed in report.values())
        assert len(failures) <= 3 * by_chance + 3, \
            f"{len(failures)} calls gave up, against {by_chance:.1f} by chance alone: {report}"
        assert utilisation >= 0.85, f"the quota must stay busy: {utilisation:.3f}"
        proxy.assert_ledger_zero()
    finally:
        sim.process.stop()
