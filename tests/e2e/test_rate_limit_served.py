"""The rate limit of a served API key holds for the server, not per frontend process: with two
frontends and burst 4, fresh connections (spread over both by the kernel) get 4 requests through,
not 8; the refusals say when to retry."""
import httpx
import pytest
from serve_util import start_server

from conveyor.shared.model_files import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not default_model_path().is_file(),
                                                   reason="default model not fetched")]


def test_the_burst_is_per_key_across_frontends():
    server = start_server("--frontends", "2", "--api-key", "k", "--rate-limit", "0.05",
                          "--rate-limit-burst", "4")
    try:
        codes, refusals = [], []
        for _ in range(12):                      # a new connection each time
            r = httpx.get(server.http + "/v1/models", headers={"Authorization": "Bearer k"},
                          timeout=30)
            codes.append(r.status_code)
            if r.status_code == 429:
                refusals.append(r)
        assert codes.count(200) == 4 and codes.count(429) == 8, codes
        message = refusals[0].json()["error"]["message"]
        assert "0.05 requests per second per API key" in message, message
        assert 1 <= int(refusals[0].headers["retry-after"]) <= 20
    finally:
        server.kill_all()
