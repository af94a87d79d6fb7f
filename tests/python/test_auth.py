"""Caller identity with boto3: SigV4 with a key pair the proxy issued (boto3's own signature is
verified), a bearer key over TLS, and the ways a signature fails (wrong key, wrong secret, an
expired date, a body altered after signing), each a 403 counted by reason."""

from __future__ import annotations

import datetime
import hashlib
import re
import shutil
import subprocess
from pathlib import Path
from unittest import mock

import boto3
import botocore.auth
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from conftest import HAIKU, Proxy, pool

TRIAGE_KEY_ID = "AKIATRIAGE0000000001"
TRIAGE_SECRET = "triage-secret-0123456789"
BEARER_KEY = "tg-bearer-triage-0123456789"

SIGV4_ROUTES = f"""
[auth]
mode = "sigv4"

[[routes]]
name = "triage"
priority = 10
access_key_id = "{TRIAGE_KEY_ID}"
secret_access_key = "{TRIAGE_SECRET}"
"""


def client(url: str, key_id: str, secret: str, **kwargs):
    return boto3.client(
        "bedrock-runtime",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id=key_id,
        aws_secret_access_key=secret,
        config=Config(retries={"mode": "standard", "total_max_attempts": 1}),
        **kwargs,
    )


def converse(c, text: str = "hello"):
    return c.converse(
        modelId=HAIKU,
        messages=[{"role": "user", "content": [{"text": text}]}],
        inferenceConfig={"maxTokens": 50},
    )


def error_code(call) -> tuple[int, str]:
    with pytest.raises(ClientError) as e:
        call()
    return e.value.response["ResponseMetadata"]["HTTPStatusCode"], e.value.response["Error"]["Code"]


def auth_failures(proxy: Proxy) -> dict[str, float]:
    import urllib.request

    text = urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
        f"{proxy.url}/metrics", timeout=10).read().decode()
    out = {}
    for m in re.finditer(r'^tokengate_auth_failures_total\{mode="(\w+)",reason="(\w+)"\} (\S+)$', text, re.M):
        out[m.group(2)] = float(m.group(3))
    return out


def admitted(proxy: Proxy, route: str) -> float:
    import urllib.request

    text = urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
        f"{proxy.url}/metrics", timeout=10).read().decode()
    m = re.search(rf'^tokengate_route_requests_total\{{outcome="admitted",pool="haiku3",route="{route}"\}} (\S+)$', text, re.M)
    assert m, f"no admitted series for {route}"
    return float(m.group(1))


@pytest.fixture
def sigv4_proxy(start_proxy):
    return start_proxy(pool("haiku3", HAIKU, tokens_per_minute=1_000_000, burndown=1), extra=SIGV4_ROUTES)


def test_boto3_signature_with_an_issued_key_pair_is_verified(sigv4_proxy):
    out = converse(client(sigv4_proxy.url, TRIAGE_KEY_ID, TRIAGE_SECRET))
    assert out["usage"]["outputTokens"] > 0
    assert admitted(sigv4_proxy, "triage") == 1
    sigv4_proxy.assert_ledger_zero()


def test_wrong_key_wrong_secret_expired_and_tampered_are_refused_and_counted(sigv4_proxy):
    url = sigv4_proxy.url
    assert error_code(lambda: converse(client(url, "AKIANOTISSUED0000001", TRIAGE_SECRET))) == (
        403, "UnrecognizedClientException")
    assert error_code(lambda: converse(client(url, TRIAGE_KEY_ID, "not-the-secret"))) == (
        403, "AccessDeniedException")

    # Signed ten minutes ago: outside the ±5 minute window.
    past = datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None) - datetime.timedelta(minutes=10)
    with mock.patch.object(botocore.auth, "get_current_datetime", return_value=past):
        expired = client(url, TRIAGE_KEY_ID, TRIAGE_SECRET)
        assert error_code(lambda: converse(expired)) == (403, "AccessDeniedException")

    # The body changed after boto3 signed it (same length, so only the signature can tell).
    tampered = client(url, TRIAGE_KEY_ID, TRIAGE_SECRET)

    def alter(request, **_):
        request.body = request.body.replace(b"hello", b"HELLO")

    tampered.meta.events.register("before-send.bedrock-runtime.Converse", alter)
    assert error_code(lambda: converse(tampered)) == (403, "AccessDeniedException")

    failures = auth_failures(sigv4_proxy)
    assert failures["unknown_key"] == 1
    assert failures["signature"] == 2, failures  # the wrong secret and the altered body
    assert failures["expired"] == 1
    # None of them reached upstream or the ledger.
    assert admitted(sigv4_proxy, "triage") == 0
    sigv4_proxy.assert_ledger_zero()


def self_signed(directory: Path) -> tuple[Path, Path]:
    if not shutil.which("openssl"):
        pytest.fail("openssl is needed for the TLS tests (apt-get install openssl)")
    cert, key = directory / "tls.crt", directory / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_boto3_bearer_key_over_tls(simulator, tmp_path, monkeypatch):
    cert, key = self_signed(tmp_path)
    digest = hashlib.sha256(BEARER_KEY.encode()).hexdigest()
    config = tmp_path / "bearer.toml"
    config.write_text(
        '[server]\nlisten = "127.0.0.1:0"\n'
        f'tls_cert = "{cert}"\ntls_key = "{key}"\n\n'
        f'[upstream]\nregion = "us-east-1"\nendpoint = "{simulator.url}"\n\n'
        '[auth]\nmode = "bearer"\n\n'
        f'[[routes]]\nname = "triage"\nbearer_token_sha256 = "{digest}"\n\n'
        + pool("haiku3", HAIKU, tokens_per_minute=1_000_000, burndown=1)
    )
    proxy = Proxy(config, tmp_path, "bearer-proxy")
    try:
        assert proxy.url.startswith("https://"), proxy.url
        # boto3 >= 1.44 sends AWS_BEARER_TOKEN_BEDROCK as `Authorization: Bearer` (over TLS only).
        monkeypatch.setenv("AWS_BEARER_TOKEN_BEDROCK", BEARER_KEY)
        c = boto3.client("bedrock-runtime", endpoint_url=proxy.url, region_name="us-east-1",
                         verify=str(cert),
                         config=Config(retries={"mode": "standard", "total_max_attempts": 1}))
        out = converse(c)
        assert out["usage"]["outputTokens"] > 0
        monkeypatch.setenv("AWS_BEARER_TOKEN_BEDROCK", "tg-not-issued")
        wrong = boto3.client("bedrock-runtime", endpoint_url=proxy.url, region_name="us-east-1",
                             verify=str(cert),
                             config=Config(retries={"mode": "standard", "total_max_attempts": 1}))
        assert error_code(lambda: converse(wrong)) == (403, "AccessDeniedException")
        import ssl
        import urllib.request
        context = ssl.create_default_context(cafile=str(cert))
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                             urllib.request.HTTPSHandler(context=context))
        text = opener.open(f"{proxy.url}/metrics", timeout=10).read().decode()
        assert re.search(r'^tokengate_auth_failures_total\{mode="bearer",reason="bad_token"\} 1$', text, re.M), text
        assert re.search(r'^tokengate_route_requests_total\{outcome="admitted",pool="haiku3",route="triage"\} 1$', text, re.M)
    finally:
        rc = proxy.process.stop()
        assert rc == 0, proxy.process.stderr_tail()
