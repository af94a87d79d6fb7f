"""SageMaker endpoint pools as boto3's `sagemaker-runtime` client sees them through the proxy:
both operations (the stream read with boto3's own event-stream parsing), calls within the
per-copy limit, a call queued then served, a refusal whose x-amz-retry-after boto3's standard
retry mode obeys (where the endpoint alone answers a ModelError boto3 does not retry), copies
followed from the simulated control plane, and SigV4 callers signing for `sagemaker`. Every test
ends with the ledger at zero."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from botocore.validate import ParamValidator

from conftest import REPO_ROOT, Proxy, Simulator, http_json

ENDPOINT = "llm-prod"
POOL = "summarizer"
COMPONENT = "ic-small"
TOLERANCE_S = 0.015
POLL_TIMEOUT_S = 20.0

FLEETS = f"""
time_to_first_token_ms = 0
verify_sigv4 = {{ access_key_id = "AKIATOKENGATEPROXY01", secret_access_key = "proxy-secret-key" }}

[[simulator.endpoints]]
name = "{ENDPOINT}"
copies = 1
max_concurrency_per_copy = 1
time_to_first_token_ms = 0
tokens_per_second = 100

[[simulator.endpoints]]
name = "shared"
inference_component = "{COMPONENT}"
copies = 2
max_concurrency_per_copy = 2
time_to_first_token_ms = 0
tokens_per_second = 0
"""


def sagemaker_client(url: str, max_attempts: int = 1, key: tuple[str, str] = ("test", "test")):
    """A boto3 sagemaker-runtime client, standard retry mode, `max_attempts` attempts in all."""
    return boto3.client(
        "sagemaker-runtime", endpoint_url=url, region_name="us-east-1",
        aws_access_key_id=key[0], aws_secret_access_key=key[1],
        config=Config(retries={"mode": "standard", "total_max_attempts": max_attempts},
                      connect_timeout=10, read_timeout=60),
    )


def endpoint_pools(sim_url: str, *, max_wait_ms: int, refresh_secs: int | None = None) -> str:
    refresh = f"refresh_secs = {refresh_secs}\n" if refresh_secs else ""
    common = f'runtime_url = "{sim_url}"\ncontrol_url = "{sim_url}"\nmax_wait_ms = {max_wait_ms}\n{refresh}'
    return (
        f'[[endpoints]]\nname = "{POOL}"\nendpoint = "{ENDPOINT}"\ncopies = 1\n'
        f"max_concurrency_per_copy = 1\n{common}\n"
        f'[[endpoints]]\nname = "small"\nendpoint = "shared"\ninference_component = "{COMPONENT}"\n'
        f"copies = 1\nmax_concurrency_per_copy = 2\n{common}\n"
    )


@pytest.fixture(scope="module")
def fleets(tmp_path_factory):
    """A simulator running the fleets, checking that callers sign for sagemaker with the proxy's key."""
    sim = Simulator(tmp_path_factory.mktemp("fleets"), FLEETS)
    yield sim
    sim.process.stop()


@pytest.fixture
def endpoint_proxy(fleets, start_proxy):
    """Starts proxies in front of the fleets (conftest's `start_proxy`: each is stopped at
    teardown and must exit 0)."""

    def start(max_wait_ms: int = 0, refresh_secs: int | None = None, extra: str = "") -> Proxy:
        pools = endpoint_pools(fleets.url, max_wait_ms=max_wait_ms, refresh_secs=refresh_secs)
        return start_proxy(pools, extra=extra, endpoint=fleets.url)

    return start


def chat(output: int, max_tokens: int = 500) -> str:
    return json.dumps({"messages": [{"role": "user", "content": f"[sim:output={output}] summarise"}],
                       "max_tokens": max_tokens})


def fleet_stats(sim: Simulator, endpoint: str) -> dict:
    return next(e for e in http_json(f"{sim.url}/_sim/sagemaker")["endpoints"] if e["endpoint"] == endpoint)


def scale(sim: Simulator, endpoint: str, component: str | None, copies: int) -> None:
    body = json.dumps({"endpoint": endpoint, "inference_component": component, "copies": copies}).encode()
    request = urllib.request.Request(f"{sim.url}/_sim/sagemaker", data=body, method="POST")
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=10) as r:
        assert r.status == 200


def poll(condition, what: str) -> None:
    deadline = time.monotonic() + POLL_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def hold_the_copy(proxy: Proxy) -> threading.Thread:
    """A stream of 150 tokens at 100 a second on ENDPOINT's only slot, read in the background;
    returns once it is admitted."""
    response = sagemaker_client(proxy.url).invoke_endpoint_with_response_stream(
        EndpointName=ENDPOINT, ContentType="application/json",
        Body=json.dumps({"inputs": "[sim:output=150] long", "parameters": {"max_new_tokens": 200}}))
    reader = threading.Thread(target=lambda: list(response["Body"]), daemon=True)
    reader.start()
    return reader


def test_both_operations_through_the_proxy(endpoint_proxy, fleets):
    """InvokeEndpoint (OpenAI-style body, usage in the answer) and InvokeEndpointWithResponseStream
    (TGI-style, read with boto3's event-stream parser), headers passed both ways, settled on the
    usage the container reported."""
    proxy = endpoint_proxy()
    client = sagemaker_client(proxy.url)
    response = client.invoke_endpoint(EndpointName="shared", InferenceComponentName=COMPONENT,
                                      ContentType="application/json", CustomAttributes="trace=1",
                                      Body=chat(9))
    answer = json.loads(response["Body"].read())
    assert answer["usage"]["completion_tokens"] == 9
    assert response["CustomAttributes"] == "trace=1"
    assert response["InvokedProductionVariant"] == "AllTraffic"

    streamed = client.invoke_endpoint_with_response_stream(
        EndpointName="shared", InferenceComponentName=COMPONENT, ContentType="application/json",
        Body=json.dumps({"inputs": "[sim:output=6] hi", "parameters": {"max_new_tokens": 50}}))
    text = b"".join(event["PayloadPart"]["Bytes"] for event in streamed["Body"]).decode()
    assert text.count('"token":{') == 6, text
    assert '"generated_tokens":6' in text

    state = proxy.pool("small")
    assert state["endpoint"]["copies"] == 1 and state["max_concurrency"] == 2
    assert state["admitted"] == 2
    proxy.assert_ledger_zero()


def test_a_call_past_the_limit_queues_then_is_served(endpoint_proxy, fleets):
    """With the endpoint's one slot held, a call waits in the admission queue (demand per copy
    2) and is served on its first attempt when the slot frees; the copy never saw more than one."""
    proxy = endpoint_proxy(max_wait_ms=20_000)
    peak_before = fleet_stats(fleets, ENDPOINT)["overloaded"]
    reader = hold_the_copy(proxy)
    client = sagemaker_client(proxy.url)
    result: dict = {}
    caller = threading.Thread(target=lambda: result.update(
        client.invoke_endpoint(EndpointName=ENDPOINT, Body=chat(2))), daemon=True)
    caller.start()
    poll(lambda: proxy.pool(POOL)["queue"]["depth"] == 1, "the call queued")
    assert proxy.pool(POOL)["endpoint"]["demand_per_copy"] == 2.0
    caller.join(timeout=60)
    reader.join(timeout=60)
    assert result["ResponseMetadata"]["RetryAttempts"] == 0
    assert proxy.pool(POOL)["rejected"]["concurrency"] == 0
    assert fleet_stats(fleets, ENDPOINT)["overloaded"] == peak_before
    proxy.assert_ledger_zero()


class AttemptLog:
    """Each attempt's send time, status and x-amz-retry-after, from botocore's own events."""

    def __init__(self, client, operation: str):
        self.sent: list[float] = []
        self.answers: list[tuple[int, int | None]] = []
        client.meta.events.register(f"before-send.sagemaker-runtime.{operation}",
                                    lambda **_: self.sent.append(time.monotonic()))
        client.meta.events.register(f"needs-retry.sagemaker-runtime.{operation}", self._answered)

    def _answered(self, response=None, **_kwargs):
        if response is not None:
            hint = response[0].headers.get("x-amz-retry-after")
            self.answers.append((response[0].status_code, int(hint) if hint else None))


def test_a_refusal_is_retried_at_the_hint_where_the_endpoint_alone_fails(endpoint_proxy, fleets):
    """Queueing off, the one slot held: straight at the endpoint a second call is a ModelError
    (the container's 429, HTTP 424) that boto3 does not retry; through the proxy it is a
    ThrottlingException whose x-amz-retry-after boto3 obeys (each retry no sooner than the hint),
    until the slot frees and the call succeeds."""
    proxy = endpoint_proxy(max_wait_ms=0)
    reader = hold_the_copy(proxy)
    direct = sagemaker_client(fleets.url, max_attempts=5,
                              key=("AKIATOKENGATEPROXY01", "proxy-secret-key"))
    with pytest.raises(ClientError) as excinfo:
        direct.invoke_endpoint(EndpointName=ENDPOINT, Body=chat(2))
    error = excinfo.value.response
    assert error["Error"]["Code"] == "ModelError"
    assert error["OriginalStatusCode"] == 429
    assert error["ResponseMetadata"]["RetryAttempts"] == 0, "boto3 does not retry a ModelError"

    client = sagemaker_client(proxy.url, max_attempts=8)
    log = AttemptLog(client, "InvokeEndpoint")
    response = client.invoke_endpoint(EndpointName=ENDPOINT, Body=chat(2))
    reader.join(timeout=60)
    assert json.loads(response["Body"].read())["usage"]["completion_tokens"] == 2
    assert len(log.sent) >= 2 and log.answers[-1][0] == 200
    for k, (status, hint_ms) in enumerate(log.answers[:-1]):
        assert status == 429 and hint_ms is not None, log.answers
        assert log.sent[k + 1] - log.sent[k] >= hint_ms / 1000 - TOLERANCE_S, (k, log.answers)
    assert proxy.pool(POOL)["rejected"]["concurrency"] == len(log.sent) - 1
    proxy.assert_ledger_zero()


def test_copies_follow_the_simulated_control_plane(endpoint_proxy, fleets):
    """With refresh_secs, the proxy reads DescribeInferenceComponent and DescribeEndpoint: its
    limits follow the copies the fleet reports, as boto3's own `sagemaker` client reads them."""
    proxy = endpoint_proxy(refresh_secs=1)
    poll(lambda: proxy.pool("small")["endpoint"]["copies"] == 2, "the component's copies read")
    assert proxy.pool("small")["max_concurrency"] == 4
    scale(fleets, ENDPOINT, None, 3)
    try:
        poll(lambda: proxy.pool(POOL)["endpoint"]["copies"] == 3, "three copies")
        assert proxy.pool(POOL)["max_concurrency"] == 3
        control = boto3.client("sagemaker", endpoint_url=fleets.url, region_name="us-east-1",
                               aws_access_key_id="AKIATOKENGATEPROXY01",
                               aws_secret_access_key="proxy-secret-key")
        variants = control.describe_endpoint(EndpointName=ENDPOINT)["ProductionVariants"]
        assert variants[0]["CurrentInstanceCount"] == 3
        component = control.describe_inference_component(InferenceComponentName=COMPONENT)
        assert component["RuntimeConfig"]["CurrentCopyCount"] == 2
        assert proxy.pool(POOL)["endpoint"]["refresh_errors"] == 0
    finally:
        scale(fleets, ENDPOINT, None, 1)
    proxy.assert_ledger_zero()


def test_sigv4_callers_sign_for_sagemaker(endpoint_proxy, fleets):
    """In auth mode sigv4 a route's key pair signs sagemaker-runtime calls as it signs Bedrock's:
    the proxy verifies the signature (scoped to sagemaker) and re-signs with its own key; a wrong
    secret is refused with a 403 that boto3 does not retry; the route's allow-list names
    endpoint pools by name."""
    extra = ('[auth]\nmode = "sigv4"\n\n[[routes]]\nname = "team"\naccess_key_id = "AKIATEAMROUTE0000001"\n'
             f'secret_access_key = "team-secret"\nmodels = ["small"]\n')
    proxy = endpoint_proxy(extra=extra)
    client = sagemaker_client(proxy.url, key=("AKIATEAMROUTE0000001", "team-secret"))
    response = client.invoke_endpoint(EndpointName="shared", InferenceComponentName=COMPONENT, Body=chat(1))
    assert json.loads(response["Body"].read())["usage"]["completion_tokens"] == 1
    with pytest.raises(ClientError) as excinfo:
        client.invoke_endpoint(EndpointName=ENDPOINT, Body=chat(1))
    assert excinfo.value.response["Error"]["Code"] == "AccessDeniedException", "not on its allow-list"
    forged = sagemaker_client(proxy.url, max_attempts=3, key=("AKIATEAMROUTE0000001", "wrong"))
    with pytest.raises(ClientError) as excinfo:
        forged.invoke_endpoint(EndpointName="shared", InferenceComponentName=COMPONENT, Body=chat(1))
    assert excinfo.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert excinfo.value.response["ResponseMetadata"]["RetryAttempts"] == 0
    proxy.assert_ledger_zero()


README_SECTION = re.compile(r"^## SageMaker endpoints\n(.*?)^## ", re.MULTILINE | re.DOTALL)
AUTOSCALING_BLOCK = re.compile(r"^```json application-autoscaling:(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def readme_sagemaker_section() -> str:
    section = README_SECTION.search((REPO_ROOT / "README.md").read_text())
    assert section, "README.md has a SageMaker endpoints section"
    return section.group(1)


def test_readme_autoscaling_json_is_what_application_auto_scaling_accepts(endpoint_proxy):
    """Every `json application-autoscaling:Operation` block of the README's SageMaker section is a
    valid input of that operation in botocore's application-autoscaling model; the policy tracks
    a metric the proxy exports, labelled with the pool that config/sagemaker.toml gives the
    inference component the blocks scale."""
    blocks = AUTOSCALING_BLOCK.findall(readme_sagemaker_section())
    assert {"RegisterScalableTarget", "PutScalingPolicy", "PutScheduledAction"} <= {op for op, _ in blocks}
    model = boto3.client("application-autoscaling", region_name="us-east-1").meta.service_model
    pools = {e["name"]: e for e in tomllib.loads((REPO_ROOT / "config" / "sagemaker.toml").read_text())["endpoints"]}
    exported = urllib.request.urlopen(f"{endpoint_proxy().url}/metrics", timeout=10).read().decode()
    for operation, text in blocks:
        params = json.loads(text)
        report = ParamValidator().validate(params, model.operation_model(operation).input_shape)
        assert not report.has_errors(), f"{operation}: {report.generate_report()}"
        assert params["ResourceId"] == "inference-component/ic-llama-8b", operation
        if operation == "PutScalingPolicy":
            metric = params["TargetTrackingScalingPolicyConfiguration"]["CustomizedMetricSpecification"]
            assert f'# TYPE {metric["MetricName"]} gauge' in exported
            assert metric["Dimensions"] == [{"Name": "pool", "Value": "lookup"}]
            assert pools["lookup"]["inference_component"] == "ic-llama-8b"


def test_readme_sagemaker_snippet_runs_against_its_config(tmp_path):
    """The README's sagemaker-runtime snippet, pointed at a proxy started from
    config/sagemaker.toml (the simulator runs its endpoints), runs and prints the answers."""
    snippet = re.search(r"^```python\n(.*?)^```", readme_sagemaker_section(), re.MULTILINE | re.DOTALL)
    assert snippet, "the section has a python snippet"
    text = (REPO_ROOT / "config" / "sagemaker.toml").read_text()
    config = tmp_path / "sagemaker.toml"
    config.write_text(re.sub(r'(?m)^listen\s*=\s*"[^"]*"', 'listen = "127.0.0.1:0"', text, count=1))
    proxy = Proxy(config, tmp_path, "sagemaker-proxy")
    try:
        script = tmp_path / "snippet.py"
        script.write_text(snippet.group(1).replace("http://127.0.0.1:8080", proxy.url))
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                             timeout=120, cwd=tmp_path)
        assert run.returncode == 0, f"snippet failed:\n{run.stdout}\n{run.stderr}"
        assert "completion_tokens" in run.stdout and "token" in run.stdout, run.stdout
        proxy.assert_ledger_zero()
    finally:
        proxy.stop()
