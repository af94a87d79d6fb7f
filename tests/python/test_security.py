"""Forged signatures with boto3 against a proxy in SigV4 mode (issue #14, part B): what AWS refuses,
the proxy refuses, and an unknown caller is refused from its request head, before any body byte.

Each forgery is made with botocore's own signer, bent the way an attacker would bend it: a body
left unsigned (UNSIGNED-PAYLOAD) and then swapped, `host` or `x-amz-date` left out of the signature,
a credential scope for another Region or service. None may reach upstream or the ledger."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import boto3
import botocore.auth
import pytest
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials

from conftest import HAIKU
# sigv4_proxy is test_auth's fixture: a proxy whose one route holds the triage key pair.
from test_auth import (TRIAGE_KEY_ID, TRIAGE_SECRET, admitted, auth_failures, converse, error_code,  # noqa: F401
                       sigv4_proxy)


class HostUnsigned(botocore.auth.SigV4Auth):
    """SigV4 that leaves `host` out of the signature, so it could be changed in flight."""

    def headers_to_sign(self, request):
        headers = super().headers_to_sign(request)
        del headers["host"]
        return headers


class DateUnsigned(botocore.auth.SigV4Auth):
    """SigV4 that leaves `x-amz-date` out of the signature (a replay could carry any date)."""

    def headers_to_sign(self, request):
        headers = super().headers_to_sign(request)
        del headers["x-amz-date"]
        return headers


class AnotherService(botocore.auth.SigV4Auth):
    """SigV4 with a credential scope for S3: a signature made for another service."""

    def __init__(self, credentials, service_name, region_name, **kwargs):
        super().__init__(credentials, "s3", region_name, **kwargs)


def triage_client(url: str, region: str = "us-east-1", signer: type | None = None):
    """A boto3 client with the triage key pair, for `region`, its requests signed by `signer`
    (registered as a botocore signature version) or by boto3's own SigV4."""
    config = {"retries": {"mode": "standard", "total_max_attempts": 1}}
    if signer is not None:
        config["signature_version"] = f"v4-{signer.__name__.lower()}"
        botocore.auth.AUTH_TYPE_MAPS[config["signature_version"]] = signer
    return boto3.client("bedrock-runtime", endpoint_url=url, region_name=region,
                        aws_access_key_id=TRIAGE_KEY_ID, aws_secret_access_key=TRIAGE_SECRET,
                        config=Config(**config))


def test_an_unsigned_payload_cannot_carry_a_swapped_body(sigv4_proxy):
    """boto3 told not to sign the payload (x-amz-content-sha256: UNSIGNED-PAYLOAD): the signature
    then vouches for no body at all, and the body is swapped after signing. AWS checks the body of
    every bedrock-runtime call; so does the proxy."""
    c = triage_client(sigv4_proxy.url)

    def unsigned(request, **_):
        request.context["payload_signing_enabled"] = False

    def swap(request, **_):
        assert request.headers["X-Amz-Content-SHA256"] in ("UNSIGNED-PAYLOAD", b"UNSIGNED-PAYLOAD")
        request.body = request.body.replace(b"hello", b"HACKD")

    c.meta.events.register("before-sign.bedrock-runtime.Converse", unsigned)
    c.meta.events.register("before-send.bedrock-runtime.Converse", swap)
    assert error_code(lambda: converse(c)) == (403, "AccessDeniedException")
    assert auth_failures(sigv4_proxy)["payload_hash"] == 1
    assert admitted(sigv4_proxy, "triage") == 0
    sigv4_proxy.assert_ledger_zero()


@pytest.mark.parametrize("signer", [HostUnsigned, DateUnsigned], ids=["host", "x-amz-date"])
def test_host_and_date_must_be_signed(sigv4_proxy, signer):
    c = triage_client(sigv4_proxy.url, signer=signer)
    assert error_code(lambda: converse(c)) == (403, "AccessDeniedException")
    assert auth_failures(sigv4_proxy)["malformed"] == 1
    assert admitted(sigv4_proxy, "triage") == 0
    sigv4_proxy.assert_ledger_zero()


def test_the_credential_scope_names_bedrock_and_a_region_served(sigv4_proxy):
    """A signature is only good for the Region and service of its scope: one made for eu-west-3
    (the proxy serves us-east-1) or for S3 is refused, though the key and secret are right."""
    other_region = triage_client(sigv4_proxy.url, region="eu-west-3")
    assert error_code(lambda: converse(other_region)) == (403, "AccessDeniedException")
    other_service = triage_client(sigv4_proxy.url, signer=AnotherService)
    assert error_code(lambda: converse(other_service)) == (403, "AccessDeniedException")
    assert auth_failures(sigv4_proxy)["scope"] == 2
    # The same key pair, scoped right, works.
    assert converse(triage_client(sigv4_proxy.url))["usage"]["outputTokens"] > 0
    assert admitted(sigv4_proxy, "triage") == 1
    sigv4_proxy.assert_ledger_zero()


def signed_head(url: str, path: str, key_id: str, secret: str, content_length: int) -> bytes:
    """The head of a POST signed by botocore, promising a body of `content_length` bytes."""
    request = AWSRequest(method="POST", url=f"{url}{path}", data=b"{}",
                         headers={"Content-Type": "application/json"})
    botocore.auth.SigV4Auth(Credentials(key_id, secret), "bedrock", "us-east-1").add_auth(request)
    host = urlsplit(url).netloc
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}"]
    lines += [f"{k}: {v}" for k, v in request.headers.items() if k.lower() != "host"]
    lines.append(f"Content-Length: {content_length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_an_unknown_caller_is_refused_before_its_body(sigv4_proxy):
    """A key the proxy never issued, on a request that promises 25 MB and sends none of it: the
    answer (403) comes from the head alone, so such callers cannot make the proxy buffer bodies."""
    parts = urlsplit(sigv4_proxy.url)
    path = f"/model/{HAIKU.replace(':', '%3A')}/converse"
    head = signed_head(sigv4_proxy.url, path, "AKIANOTISSUED0000001", "whatever", 25_000_000)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as s:
        s.sendall(head)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = s.recv(4096)  # times out (10 s) if the proxy waits for the body
            assert chunk, f"closed without an answer: {answer!r}"
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.split()[1] == b"403", answer
    assert b"unrecognizedclientexception" in rest.lower(), answer
    assert auth_failures(sigv4_proxy)["unknown_key"] == 1
    sigv4_proxy.assert_ledger_zero()
