"""Per-process metrics of ``iop api --workers N`` add up: any process's scrape counts every request."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from iop.redis_server import RedisServer
from tests.e2e.system import System, http_provider

REQUESTS = 24


@pytest.fixture
def system(tmp_path: Path, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path, redis_server)
    sys_.write_config({
        "models": [{"id": "m", "providers": {"p": "served"}}],
        "nodes": [{"id": "n1", "providers": [http_provider("p", "vllm", sys_.port("f"), 4, ["served"])]}],
    })
    try:
        sys_.fake("f", "--models", "served")
        sys_.worker("n1")
        sys_.api(workers=2)
        sys_.wait_available("p")
        yield sys_
    finally:
        sys_.close()


def ok_count(text: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "iop_requests_total" and sample.labels == {"model": "m", "provider": "p",
                                                                         "status": "200", "tenant": "default"}:
                return sample.value
    return 0.0


def test_every_scrape_counts_the_requests_of_all_processes(system: System) -> None:
    for _ in range(REQUESTS):
        # A new connection each time, so both processes take requests.
        resp = httpx.post(f"{system.api_url}/v1/chat/completions", json={"model": "m", "messages": []})
        assert resp.status_code == 200
    scrapes = [ok_count(httpx.get(f"{system.api_url}/metrics").text) for _ in range(8)]
    assert scrapes == [REQUESTS] * 8
