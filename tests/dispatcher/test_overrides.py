"""Operators' overrides (dispatcher/control.py, dispatcher/overrides.py, lua/override.lua,
lib/capacity_in_force.lua, the preference in lib/pick.lua) against real Redis servers (every
available version): what each does to dispatch at once, what clearing and lapsing put
back, the audit of each, and the checks that refuse a bad one with nothing changed."""

from __future__ import annotations

from typing import Any

import anyio
import msgspec
import pytest
from redis.asyncio import Redis

from dispatcher import events, keys, overrides
from dispatcher.catalog import read_catalog
from dispatcher.config import Config, parse
from dispatcher.control import Actor, CapacityBody, Control, FallbacksBody, PreferenceBody
from dispatcher.exceptions import InvalidOverride, ModelNotFound, UnknownProvider
from dispatcher.plans import Plans
from dispatcher.script_calls import ScriptCalls
from tests.dispatcher.harness import LaneHarness, lane_config

pytestmark = pytest.mark.anyio

OPS = Actor("ops", "http")


class OverrideHarness(LaneHarness):
    def __init__(self, redis: Redis, config: Any) -> None:
        super().__init__(redis, config)
        self.file_config = config
        self.control = Control(self.calls, redis, config)

    async def running_on(self, pid: str) -> list[str]:
        return [a.job for a in await self.assignments() if a.provider == pid]

    async def field(self, pid: str, name: str) -> str | None:
        raw = await self.redis.hget(keys.provider(pid), name)
        return raw.decode() if raw is not None else None

    async def audit(self) -> list[tuple[str, str, Any, Any, str, str]]:
        return [(e.action, e.target, e.before, e.after, e.by, e.via) for e in await self.control.audit()]

    async def apply(self) -> None:
        """What every process's watch does when the version moves: run the effective config."""
        snap = await overrides.read(self.redis)
        config = overrides.effective(self.file_config, snap)
        self.calls = ScriptCalls(self.calls.scripts, config, Plans(config))
        self.api.calls = self.calls  # type: ignore[attr-defined]
        self.control = Control(self.calls, self.redis, self.file_config)


@pytest.fixture
def harness(any_redis: Redis) -> Any:
    return lambda config: OverrideHarness(any_redis, config)


async def test_a_disabled_provider_gets_nothing_new_its_running_jobs_finish_and_enable_pumps(harness: Any) -> None:
    h = harness(lane_config({"a": None, "b": None}, capacity=1, hold_ms=60_000))
    await h.up("a")
    await h.up("b")
    main = h.calls.plans.main_lane("m")
    on_a, _ = await h.submit_to(main)
    view = await h.control.disable("a", OPS)
    assert (view["field"], view["value"], view["config"], view["by"], view["until"]) == ("enabled", False, True,
                                                                                         "ops", None)
    on_b, _ = await h.submit_to(main)
    waiting, status = await h.submit_to(main)
    assert await h.running_on("a") == [on_a]
    assert await h.running_on("b") == [on_b]
    assert status == "queued"
    # a's job finishes; its freed slot is not handed out while it is disabled.
    assert await h.done(on_a) == "released"
    assert await h.running_on("a") == []
    assert await h.queued("m") == [waiting]
    assert (await read_catalog(h.redis, h.config)).providers[0].enabled is False
    # enable: the waiting job takes a's free slot at once.
    assert (await h.control.enable("a", OPS))["cleared"] is True
    assert await h.queued("m") == []
    assert await h.running_on("a") == [waiting]
    assert (await h.control.enable("a", OPS))["cleared"] is False  # nothing to clear, nothing audited
    assert [(a, t, b, af) for a, t, b, af, *_ in await h.audit()] == [
        ("enable", "provider/a", False, True), ("disable", "provider/a", True, False)]


async def test_disabling_the_only_provider_answers_the_waiting_jobs_as_a_drain_does(harness: Any) -> None:
    h = harness(lane_config({"a": None}, capacity=1))
    await h.up("a")
    main = h.calls.plans.main_lane("m")
    await h.submit_to(main)
    waiting, _ = await h.submit_to(main)
    await h.control.disable("a", OPS)
    assert await h.queued("m") == []
    assert await h.record(waiting) is None
    (_, fields), = await h.redis.xrange(keys.reply("rep1"))
    assert fields[b"job"] == waiting.encode()
    refusal = events.decode(fields[b"event"])
    assert refusal.code == "no_provider_available"  # type: ignore[union-attr]
    assert "disabled by an operator" in refusal.message  # type: ignore[union-attr]


async def test_a_capacity_override_stands_over_every_heartbeat_and_clearing_puts_the_workers_back(
        harness: Any) -> None:
    h = harness(lane_config({"a": None}, capacity=4))
    await h.up("a")
    await h.control.set_capacity("a", CapacityBody(capacity=2), OPS)
    assert await h.field("a", "capacity") == "2"
    await h.up("a")  # the worker proposes its config's 4 again
    assert await h.field("a", "capacity") == "2"
    main = h.calls.plans.main_lane("m")
    statuses = [(await h.submit_to(main))[1] for _ in range(3)]
    assert statuses == ["dispatched", "dispatched", "queued"]
    # Cleared: the worker's last proposal is in force at once, and the waiting job runs.
    assert (await h.control.clear_capacity("a", OPS))["cleared"] is True
    assert await h.field("a", "capacity") == "4"
    assert await h.queued("m") == []
    assert [a for a, *_ in await h.audit()] == ["capacity.clear", "capacity"]


async def test_the_bounds_of_a_learned_capacity_clamp_what_its_worker_publishes(harness: Any) -> None:
    h = harness(parse({
        "nodes": [{"id": "n1", "providers": [{"id": "a", "type": "vllm", "base_url": "http://127.0.0.1:1",
                                              "models": ["m"], "capacity": "auto", "max_capacity": 16}]}],
        "models": [{"id": "m", "providers": {"a": "m"}}]}).config)
    await h.node.heartbeat("a", "available", [("capacity", 12), ("node", "n1")])
    view = await h.control.set_capacity("a", CapacityBody(min=2, max=6), OPS)
    assert (view["value"], view["config"]) == ({"min": 2, "max": 6}, {"min": 1, "max": 16})
    assert await h.field("a", "capacity") == "6"
    await h.node.heartbeat("a", "available", [("capacity", 1), ("node", "n1")])
    assert await h.field("a", "capacity") == "2"
    # The worker's own config follows (dispatcher/overrides.py effective): it learns within them.
    snap = await overrides.read(h.redis)
    prov = overrides.effective(h.file_config, snap).provider("a")
    assert prov is not None
    assert prov.capacity_bounds == (2, 6)
    await h.control.clear_capacity("a", OPS)
    assert await h.field("a", "capacity") == "1"


async def test_bad_capacities_are_refused_naming_the_bound_and_change_nothing(harness: Any) -> None:
    h = harness(lane_config({"a": None}, capacity=4))
    await h.up("a")
    for body, words in [(CapacityBody(capacity=0), "at least 1"),
                        (CapacityBody(capacity=65), "64, the most an override may give"),
                        (CapacityBody(min=1, max=4), "fixed one"), (CapacityBody(), "give")]:
        with pytest.raises(InvalidOverride, match=words):
            await h.control.set_capacity("a", body, OPS)
    with pytest.raises(UnknownProvider):
        await h.control.set_capacity("nope", CapacityBody(capacity=2), OPS)
    assert await h.field("a", "capacity") == "4"
    assert await h.audit() == []
    assert await h.redis.exists(keys.OVERRIDES) == 0


def _two_models() -> Config:
    return parse({
        "nodes": [{"id": "n1", "providers": [
            {"id": p, "type": "openai_api", "base_url": "http://127.0.0.1:1", "models": ["m", "x", "y"],
             "capacity": 2} for p in ("a", "b", "c")]}],
        "models": [{"id": "m", "providers": {"a": "m", "b": "m", "c": "m"}, "fallbacks": ["x"]},
                   {"id": "x", "providers": {"a": "x"}}, {"id": "y", "providers": {"b": "y"}, "fallbacks": ["m"]}]}
    ).config


async def test_fallbacks_are_checked_as_the_config_is_and_apply_through_the_effective_config(harness: Any) -> None:
    h = harness(_two_models())
    with pytest.raises(InvalidOverride, match="fallbacks loop: m -> y -> m"):
        await h.control.set_fallbacks("m", FallbacksBody(["y"]), OPS)
    with pytest.raises(InvalidOverride, match="unknown model 'nope'"):
        await h.control.set_fallbacks("m", FallbacksBody(["nope"]), OPS)
    with pytest.raises(ModelNotFound):
        await h.control.set_fallbacks("nope", FallbacksBody(["x"]), OPS)
    view = await h.control.set_fallbacks("m", FallbacksBody([]), OPS)
    assert (view["value"], view["config"]) == ([], ["x"])
    snap = await overrides.read(h.redis)
    model = overrides.effective(h.file_config, snap).model("m")
    assert model is not None
    assert model.fallbacks == []
    # The catalog shows the value in force beside the override.
    await h.apply()
    found = next(m for m in (await read_catalog(h.redis, h.calls.config)).models if m.id == "m")
    assert found.fallbacks == []
    assert found.override["fallbacks"].config == ["x"]


async def test_a_preference_fills_the_named_providers_first_in_order(harness: Any) -> None:
    h = harness(_two_models())
    for pid in ("a", "b", "c"):
        await h.node.heartbeat(pid, "available", [("capacity", 2), ("node", "n1")])
    with pytest.raises(InvalidOverride, match="'z' is not a provider of model 'm'"):
        await h.control.set_preference("m", PreferenceBody(["z"]), OPS)
    await h.control.set_preference("m", PreferenceBody(["c", "b"]), OPS)
    await h.apply()
    main = h.calls.plans.main_lane("m")
    for _ in range(5):
        await h.submit_to(main)
    # c's two slots, then b's two, then the unranked a, though a was the least loaded all along.
    assert [len(await h.running_on(p)) for p in ("c", "b", "a")] == [2, 2, 1]


async def test_an_override_lapses_by_the_servers_clock_once_and_audited(harness: Any) -> None:
    h = harness(lane_config({"a": None}, capacity=3))
    await h.up("a")
    await h.control.disable("a", OPS, for_s=0.05)
    snap = await overrides.read(h.redis)
    rec = snap.get("enabled", "a")
    assert rec is not None
    assert rec.until is not None
    assert rec.until - rec.at == 50
    # Not due yet by the server's clock: nothing happens.
    if await h.now_ms() < rec.until:
        assert await h.control.lapse("enabled", "a") is False
    while await h.now_ms() < rec.until:
        pass
    assert await h.control.lapse("enabled", "a") is True
    assert await h.control.lapse("enabled", "a") is False
    assert await h.field("a", "off") is None
    assert (await h.audit())[0][:2] == ("enable", "provider/a")
    assert (await h.audit())[0][-1] == "expiry"


async def test_a_reload_that_removes_what_an_override_names_drops_it(harness: Any) -> None:
    h = harness(_two_models())
    await h.control.set_preference("m", PreferenceBody(["c"]), OPS)
    await h.control.set_capacity("b", CapacityBody(capacity=1), OPS)
    raw = msgspec.to_builtins(_two_models())
    raw["nodes"][0]["providers"] = [p for p in raw["nodes"][0]["providers"] if p["id"] != "c"]
    raw["models"][0]["providers"].pop("c")
    smaller = parse(raw).config
    h.calls = ScriptCalls(h.calls.scripts, smaller, Plans(smaller))
    dropped = await Control(h.calls, h.redis, smaller).drop_stale(await overrides.read(h.redis))
    assert dropped == ["override preference of m dropped: provider(s) c no longer serve model 'm'"]
    snap = await overrides.read(h.redis)
    assert list(snap.records) == [("capacity", "b")]
    assert (await h.audit())[0][:2] == ("preference.drop", "model/m")


async def test_the_watch_applies_what_is_in_force_at_start_then_each_change_and_lets_due_ones_lapse(
        harness: Any) -> None:
    h = harness(_two_models())
    await h.control.set_preference("m", PreferenceBody(["b"]), OPS)
    applied: list[dict[tuple[str, str], Any]] = []
    lapsed: list[tuple[str, str]] = []

    back_to_one = anyio.Event()

    async def apply(snap: overrides.Snapshot) -> None:
        applied.append({k: rec.value for k, rec in snap.records.items()})
        if len(applied) > 2 and applied[-1] == {("preference", "m"): ["b"]}:
            back_to_one.set()

    async def lapse(name: overrides.Field, target_id: str) -> None:
        lapsed.append((name, target_id))
        await h.control.lapse(name, target_id)

    watch = overrides.OverrideWatch(h.redis, apply, lapse)
    await watch.start()
    assert applied == [{("preference", "m"): ["b"]}]
    assert await watch.refresh() is False  # nothing moved: nothing rebuilt
    await h.control.disable("a", OPS, for_s=0.05)
    assert await watch.refresh() is True
    assert applied[-1] == {("preference", "m"): ["b"], ("enabled", "a"): False}
    rec = watch.snapshot.get("enabled", "a")
    assert rec is not None
    assert rec.until is not None
    while await h.now_ms() < rec.until:
        pass
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch.run)
            await back_to_one.wait()
            tg.cancel_scope.cancel()
    assert lapsed[0] == ("enabled", "a")
