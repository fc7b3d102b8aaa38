"""What a running process takes from its config file when told to read it again."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from dispatcher.config import parse
from dispatcher.reloading import describe_changes, fixed_changes, keep_fixed, reread


def doc(capacity: int = 2, models: tuple[str, ...] = ("m",), **extra: Any) -> dict[str, Any]:
    return {
        "models": [{"id": m, "providers": {"a": "served"}} for m in models],
        "nodes": [{"id": "n1", "providers": [
            {"id": "a", "type": "vllm", "base_url": "http://127.0.0.1:9", "capacity": capacity, "models": ["served"]},
        ]}],
        **extra,
    }


def write(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "iop.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_valid_file_is_taken_and_its_changes_named(tmp_path: Path) -> None:
    running = parse(doc()).config
    new = reread(write(tmp_path, doc(capacity=5, models=("m", "n"))), running)
    assert new is not None
    assert next(p for _, p in new.providers()).capacity == 5
    assert describe_changes(running, new) == "model +n, provider ~a capacity 2->5"


def test_an_invalid_file_is_refused_with_every_problem(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    running = parse(doc()).config
    bad = doc()
    bad["models"][0]["providers"]["ghost"] = "x"
    bad["nodes"][0]["providers"][0]["type"] = "nonsense"
    with caplog.at_level(logging.ERROR, "iop.config"):
        assert reread(write(tmp_path, bad), running) is None
    text = caplog.text
    assert "2 problem(s); nothing changed" in text
    assert "$.models[0].providers.ghost" in text
    assert "$.nodes[0].providers[0].type" in text


def test_a_file_with_problems_of_every_kind_is_refused_with_all_of_them_in_one_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    running = parse(doc()).config
    bad = doc(queue={"max_queue": "many", "queue_timout_ms": 5}, models=("m", "m"))
    bad["nodes"][0]["providers"][0]["capacity"] = -1
    bad["models"][0]["providers"]["ghost"] = "x"
    with caplog.at_level(logging.ERROR, "iop.config"):
        assert reread(write(tmp_path, bad), running) is None
    [record] = caplog.records
    assert record.getMessage().splitlines() == [
        f"reload: {tmp_path / 'iop.yaml'} has 5 problem(s); nothing changed",
        # In the order of the file (yaml.safe_dump writes the keys sorted).
        "reload:   $.models[0].providers.ghost: no node defines provider 'ghost'",
        "reload:   $.models[1].id: duplicate model id 'm'",
        "reload:   $.nodes[0].providers[0].capacity: must be >= 0, got -1 (0 keeps the provider out of rotation)",
        "reload:   $.queue.max_queue: Expected `int`, got `str`",
        "reload:   $.queue.queue_timout_ms: unknown field `queue_timout_ms`",
    ]


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    assert reread(tmp_path / "nope.yaml", parse(doc()).config) is None


def test_what_needs_a_restart_keeps_its_running_value(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    running = parse(doc()).config
    changed = doc(dispatch={"lease_ms": 9000}, api={"max_body_bytes": 1000, "max_streams": 7},
                  redis={"url": "redis://elsewhere:1/0"})
    with caplog.at_level(logging.WARNING, "iop.config"):
        new = reread(write(tmp_path, changed), running)
    assert new is not None
    assert new.dispatch == running.dispatch
    assert new.redis == running.redis
    assert new.api.max_body_bytes == running.api.max_body_bytes
    assert new.api.max_streams == 7  # this one is applied
    for path in ("$.redis", "$.dispatch", "$.api.max_body_bytes"):
        assert f"{path} changed" in caplog.text


def test_the_restart_only_settings_come_from_the_schema() -> None:
    # Marked RESTART in dispatcher/config/schema.py: whole sections, and single api fields.
    running = parse(doc()).config
    new = parse(doc(capacity=5, redis={"failover_hold_ms": 1}, dispatch={"lease_ms": 9000},
                    tracing={"sample_ratio": 0.5}, queue={"max_queue": 3},
                    api={"max_body_bytes": 1000, "max_header_bytes": 2000, "header_timeout_s": 3.0,
                         "body_timeout_s": 4.0, "max_streams": 5})).config
    assert fixed_changes(running, new) == [
        "$.redis", "$.api.max_body_bytes", "$.api.max_header_bytes", "$.api.header_timeout_s", "$.dispatch",
        "$.tracing",
    ]
    assert fixed_changes(running, running) == []
    kept = keep_fixed(running, new)
    assert (kept.redis, kept.dispatch, kept.tracing) == (running.redis, running.dispatch, running.tracing)
    assert (kept.api.max_body_bytes, kept.api.max_header_bytes, kept.api.header_timeout_s) == (
        running.api.max_body_bytes, running.api.max_header_bytes, running.api.header_timeout_s)
    # Everything else is the new file's.
    assert (kept.api.body_timeout_s, kept.api.max_streams, kept.queue.max_queue) == (4.0, 5, 3)
    assert next(p for _, p in kept.providers()).capacity == 5
    assert fixed_changes(running, kept) == []


def test_turning_flow_control_on_needs_a_restart(tmp_path: Path) -> None:
    running = parse(doc()).config
    digest = hashlib.sha256(b"k").hexdigest()
    tenants = doc(api={"keys": [{"name": "t1", "key_sha256": digest}, {"name": "t2", "key_sha256": digest[::-1]}]})
    assert reread(write(tmp_path, tenants), running) is None
    one_tenant = doc(api={"keys": [{"name": "t1", "key_sha256": digest}]})
    assert reread(write(tmp_path, one_tenant), running) is not None
