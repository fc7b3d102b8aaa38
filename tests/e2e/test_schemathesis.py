"""Schemathesis against the OpenAPI document iop serves, with real processes behind it:
whatever the schema allows (and the ways it can be broken), no answer is a server error."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from iop.redis_server import RedisServer
from tests.e2e.system import System, http_provider


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path_factory.mktemp("schemathesis"), redis_server)
    sys_.write_config({
        "queue": {"max_queue": 100, "queue_timeout_ms": 5000},
        "models": [{"id": "qwen3.6:35b", "display_name": "Qwen", "providers": {"p": "served"}},
                   {"id": "embed", "providers": {"p": "served"}}],
        "nodes": [{"id": "n1", "providers": [http_provider("p", "vllm", sys_.port("f"), 8, ["served"])]}],
    })
    with sys_:
        sys_.fake("f", "--models", "served", "--tokens", "3")
        sys_.worker("n1")
        sys_.api()
        sys_.wait_available("p")
        yield sys_


def test_no_server_errors(system: System) -> None:
    # Driven by hand rather than through schemathesis' pytest plugin, which does not run on
    # this pytest: every operation of the document, each with its own Hypothesis search.
    schema = schemathesis.openapi.from_url(f"{system.api_url}/schema/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                                              "/v1/models", "/catalog", "/metrics"}
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            def run(case: Any) -> None:
                case.call_and_validate(base_url=system.api_url, checks=[not_a_server_error], timeout=30)

            try:
                run()
            except Unsatisfiable:
                # Nothing to break in an operation without parameters or body (GET /healthz).
                assert mode is GenerationMode.NEGATIVE, operation.path
    # The valid bodies went all the way to the provider and back.
    assert system.fakes["f"].stats()["completed"] > 0
