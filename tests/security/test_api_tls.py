"""The HTTP API over TLS: a certificate authority and a server certificate made here, a real
cluster serving HTTPS with them, the unmodified OpenAI SDK trusting that authority."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import openai
import pytest

from tests.live import ClusterFactory
from tests.security.certificates import make_certificates


def test_openai_sdk_over_https_with_a_key(cluster_factory: ClusterFactory, tmp_path: Path) -> None:
    ca, cert, key = make_certificates(tmp_path)
    cluster = cluster_factory(workers=1, api_tls=(cert, key))
    base_url = cluster.config.base_url
    assert base_url.startswith("https://127.0.0.1:")
    assert cluster.api_key is not None
    with openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=ca)) as http:
        sdk = openai.OpenAI(base_url=base_url, api_key=cluster.api_key, http_client=http)
        reply = sdk.chat.completions.create(
            model="laneway-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.choices[0].message.content
        streamed = sdk.completions.create(
            model="laneway-sim", prompt="Once", max_tokens=4, stream=True
        )
        assert "".join(chunk.choices[0].text for chunk in streamed)
    # Not trusting the authority, a client refuses the server; plain HTTP gets no answer.
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(base_url + "/models", timeout=5)
    with pytest.raises(httpx.HTTPError):
        httpx.get(base_url.replace("https://", "http://") + "/models", timeout=5)
