"""compose.yaml run for real: the stack in podman containers, through its load balancer.

``./dev compose up`` brings a private project up (its own name, its load balancer on a free
port of 127.0.0.1, the images made as tests/podman_stack.py says); the tests below run in
order against it, each leaving the stack whole again for the next, and the last brings it
down and checks that nothing of it is left. The module's fixture brings it down in any
case, a failed test or a failed ``up`` included. Skips, with the reason, where podman
cannot run containers (tests/podman_stack.unavailable); ``-m "not containers"`` leaves it
out.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from iop.redis_server import free_port
from tests.podman_stack import ROOT, Stack, podman, unavailable

pytestmark = [pytest.mark.containers, pytest.mark.timeout(2400)]

DEPLOY = yaml.safe_load((ROOT / "deploy" / "iop.yaml").read_text())
CONFIGURED = [p for node in DEPLOY["nodes"] for p in node["providers"]]
PROVIDERS = {p["id"]: node["id"] for node in DEPLOY["nodes"] for p in node["providers"]}
NODES = sorted({node["id"] for node in DEPLOY["nodes"]})
MODELS = sorted(m["id"] for m in DEPLOY["models"])
HEALTHCHECKED = ["redis", "api", "lb", "fake-a", "fake-b", "fake-c", "fake-d"]
WORKERS = [f"worker-{node}" for node in NODES]
CHAT = {"model": "qwen3.6:35b", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    log_dir = tmp_path_factory.mktemp("compose")
    state = Path(os.environ.get("IOP_COMPOSE_STATE", "/var/tmp/iop-compose"))
    state.mkdir(parents=True, exist_ok=True)
    # One stack test at a time on a machine: they share the image tag iop:local.
    with (state / "test.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        running = Stack(f"iop-test-{os.getpid()}", free_port(), log_dir)
        try:
            running.up()
            yield running
        except BaseException:
            print(running.logs())
            raise
        finally:
            running.down()


@pytest.fixture(autouse=True)
def logs_of_a_failure(request: pytest.FixtureRequest, stack: Stack) -> Iterator[None]:
    """The containers' logs when a test fails, taken at once: the module's last test brings
    the stack down, so by the module's teardown there are none left to read. Printed (a
    failed test's output is all a CI run keeps) and written beside the compose logs."""
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:
        logs = stack.logs(tail=400, timestamps=True)
        path = stack.log_dir / f"{request.node.name}.containers.log"
        path.write_text(logs)
        print(f"the containers' logs ({path}):\n{logs}")


def _sse_data(text: str) -> list[str]:
    return [line[len("data:"):].strip() for line in text.splitlines() if line.startswith("data:")]


def _chat(client: httpx.Client, model: str = "qwen3.6:35b") -> httpx.Response:
    return client.post("/v1/chat/completions", json={**CHAT, "model": model})


def _answered(resp: httpx.Response) -> str:
    assert resp.status_code == 200, f"{resp.status_code}: {resp.text[:300]}"
    content: str = resp.json()["choices"][0]["message"]["content"]
    assert content, resp.text
    return content


def _requests_served(stack: Stack, name: str) -> float:
    """iop_requests_total summed over its labels, read from inside the replica itself."""
    text = stack.exec(name, "python", "-c",
                      "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8080/metrics').read()"
                      ".decode())")
    return sum(float(m.group(1)) for m in re.finditer(r"^iop_requests_total\{[^}]*\} (\S+)$", text, re.M))


def _all_available(stack: Stack) -> bool:
    with stack.client() as client:
        catalog = client.get("/catalog").json()
    return all(p["health"] == "available" for p in catalog["providers"])


# --------------------------------------------------------------------------- the stack as run


def test_every_healthcheck_passes(stack: Stack) -> None:
    for service in HEALTHCHECKED:
        for name in stack.containers(service):
            stack.wait_healthy(name)
    assert len(stack.containers("api", running=True)) == 2, "deploy.replicas: 2"
    for service in WORKERS:
        assert stack.containers(service, running=True), f"{service} is not running"


def test_the_readme_curls_through_the_load_balancer(stack: Stack) -> None:
    stack.wait_until("every provider available", lambda: _all_available(stack))
    with stack.client() as client:
        models = client.get("/v1/models")
        assert models.status_code == 200, models.text
        assert sorted(m["id"] for m in models.json()["data"]) == MODELS

        _answered(_chat(client))

        stream = client.post("/v1/chat/completions", json={**CHAT, "model": "llama3.1:8b", "stream": True})
        assert stream.status_code == 200, stream.text
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = _sse_data(stream.text)
        assert events[-1] == "[DONE]", events[-3:]
        pieces = [json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                  if json.loads(e)["choices"]]
        assert len([p for p in pieces if p]) > 1, f"one chunk only: {events}"

        responses = client.post("/v1/responses", json={"model": "qwen3.6:35b", "stream": True, "input": "hi"})
        assert responses.status_code == 200, responses.text
        kinds = [json.loads(e)["type"] for e in _sse_data(responses.text)]
        assert kinds[-1] == "response.completed", kinds
        assert "response.output_text.delta" in kinds, kinds

        messages = client.post("/v1/messages", headers={"anthropic-version": "2023-06-01"},
                               json={"model": "qwen3.6:35b", "max_tokens": 64,
                                     "messages": [{"role": "user", "content": "hi"}]})
        assert messages.status_code == 200, messages.text
        body = messages.json()
        assert body["type"] == "message", body
        assert body["content"][0]["text"], body


def test_catalog_shows_both_nodes_providers(stack: Stack) -> None:
    stack.wait_until("every provider available", lambda: _all_available(stack))
    with stack.client() as client:
        catalog = client.get("/catalog").json()
    assert {p["id"]: p["node_id"] for p in catalog["providers"]} == PROVIDERS
    assert sorted(n["id"] for n in catalog["nodes"]) == NODES
    assert {p["id"]: p["health"] for p in catalog["providers"]} == dict.fromkeys(PROVIDERS, "available")

    # `iop catalog` from inside a container, through the load balancer by its service name
    # (once the container's DNS answers that name: a CI run met a temporary failure there).
    stack.wait_until("lb resolves in the api container", lambda: stack.resolves(stack.container("api"), "lb"))
    shown = stack.exec(stack.container("api"), "iop", "catalog", "--url", "http://lb:8080", "--no-colour")
    for provider, node in PROVIDERS.items():
        assert re.search(rf"\b{re.escape(provider)}\b", shown), shown
        assert re.search(rf"\b{re.escape(node)}\b", shown), shown


def test_requests_are_answered_with_an_api_and_a_worker_killed(stack: Stack) -> None:
    api, worker = stack.container("api"), stack.container("worker-gpu-a")
    podman("kill", "--signal", "KILL", api, worker)
    try:
        with stack.client(timeout=90) as client:
            nodes = set()
            for model in MODELS * 3:
                resp = _chat(client, model)
                _answered(resp)
                nodes.add(resp.headers["x-iop-node"])
        assert nodes == {"gpu-b"}, f"answered by {nodes} with worker-gpu-a killed"
    finally:
        for name in (api, worker):
            if not stack.state(name)["Running"]:
                podman("start", name)
    stack.wait_healthy(api)
    stack.wait_until("every provider available", lambda: _all_available(stack))


def _fake_control(stack: Stack, service: str, **options: int) -> dict[str, Any]:
    """POST /_fake/control to a fake provider from inside the compose network; its options after.
    Podman's DNS can fail a name for a moment (a CI run met "Name or service not known" for a
    fake right after the redis container restarted): the name resolves first."""
    url = next(p["base_url"] for p in CONFIGURED if urlsplit(p["base_url"]).hostname == service)
    api = stack.container("api")
    stack.wait_until(f"{service} resolves in the api container", lambda: stack.resolves(api, service), timeout=60)
    answer = stack.exec(api, "python", "-c",
                        "import sys, urllib.request; print(urllib.request.urlopen(urllib.request.Request(sys.argv[1], "
                        "data=sys.argv[2].encode(), headers={'content-type': 'application/json'}), timeout=10).read()"
                        ".decode())", f"http://{urlsplit(url).netloc}/_fake/control", json.dumps(options))
    result: dict[str, Any] = json.loads(answer)
    return result


def test_queued_work_survives_a_redis_restart(stack: Stack) -> None:
    # Every slot of qwen3.6:35b held by slow calls, so that the requests beyond them queue.
    slow = ["fake-a", "fake-c"]  # gpu-a-vllm and gpu-b-ollama
    slots = sum(p["capacity"] for p in CONFIGURED if urlsplit(p["base_url"]).hostname in slow)
    waiting = 4
    redis = stack.container("redis")
    results: list[httpx.Response | BaseException] = []

    def send() -> None:
        try:
            with stack.client(timeout=120) as client:
                results.append(_chat(client))
        except BaseException as exc:
            results.append(exc)

    def queued() -> int:
        with stack.client() as client:
            return int(sum(m["queued"] for m in client.get("/catalog").json()["models"]))

    senders = [threading.Thread(target=send) for _ in range(slots + waiting)]
    delays = {service: _fake_control(stack, service)["delay_ms"] for service in slow}
    for service in slow:
        _fake_control(stack, service, delay_ms=8000)
    try:
        for thread in senders:
            thread.start()
        stack.wait_until(f"{waiting} queued jobs", lambda: queued() == waiting, timeout=20, pause=0.2)
        time.sleep(1.5)  # appendfsync everysec: past a second, the submits are on the volume
        podman("restart", "--time", "0", redis)  # SIGKILL: only what the AOF on the volume holds is left
        stack.wait_healthy(redis, timeout=60)
        kept = stack.exec(redis, "sh", "-c",
                          "redis-cli --scan --pattern '{iop}:q:*' | while read -r k; do redis-cli ZCARD \"$k\"; done")
        assert sum(int(n) for n in kept.split()) == waiting, f"jobs queued after the restart: {kept!r}"
    finally:
        for service, delay in delays.items():
            _fake_control(stack, service, delay_ms=delay)
        for thread in senders:
            thread.join(timeout=150)
    assert len(results) == slots + waiting, results
    for result in results:
        assert isinstance(result, httpx.Response), repr(result)
        _answered(result)
    stack.wait_until("every provider available", lambda: _all_available(stack))


def test_api_scales_to_three_and_the_lb_finds_the_new_replica(stack: Stack) -> None:
    stack.up("--scale", "api=3")
    replicas = stack.containers("api", running=True)
    assert len(replicas) == 3, replicas
    for name in replicas:
        stack.wait_healthy(name)
    before = {name: _requests_served(stack, name) for name in replicas}

    def every_replica_served() -> bool:
        with stack.client() as client:
            for _ in range(6):
                _answered(_chat(client))
        return all(_requests_served(stack, name) > before[name] for name in replicas)

    # nginx re-resolves `api` every 5 s (resolver valid=5s): no reload, no restart of lb.
    stack.wait_until("requests on all three replicas", every_replica_served, timeout=90, pause=1)


def test_prometheus_scrapes_every_api_replica(stack: Stack) -> None:
    # Grafana, the profile's other service, is in no Debian suite: where no registry gives
    # its image it cannot run here, and tests/test_compose.py checks its wiring by reading it.
    stack.up("prometheus", profiles="monitoring")
    prometheus = stack.container("prometheus")
    stack.wait_healthy(prometheus)
    replicas = len(stack.containers("api", running=True))

    def api_targets() -> list[dict[str, Any]]:
        answer = json.loads(stack.exec(prometheus, "wget", "-q", "-O", "-", "http://127.0.0.1:9090/api/v1/targets"))
        return [t for t in answer["data"]["activeTargets"] if t["labels"]["job"] == "iop-api"]

    # dns_sd_configs type A on `api`: one target per replica, each answering /metrics.
    stack.wait_until(f"{replicas} api targets up",
                     lambda: [t["health"] for t in api_targets()] == ["up"] * replicas, timeout=90, pause=1)


def test_down_leaves_nothing(stack: Stack) -> None:
    stack.down()
    assert stack.leftovers() == {}
    # The next test module starts clean; the fixture's own down finds nothing to remove.
