"""Models that load and unload, in the scripts (lua/lib/warm.lua, lua/lib/place.lua,
lua/lib/model_room.lua, lua/models.lua, lua/load_done.lua) against real Redis servers (every
available version): a request goes only where its model is loaded; a model loaded nowhere,
or whose copies would keep its jobs waiting longer than a load, gets a load placed once, on
the provider where it costs least, never evicting a model that runs or waits; a load's end
dispatches the jobs that waited for it."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis

from dispatcher import config as cfg
from dispatcher import keys, wire
from dispatcher.catalog import read_catalog
from tests.dispatcher.harness import Harness
from workers.adapters.model_runtime import RuntimeModels
from workers.model_lifecycle import report_of

pytestmark = pytest.mark.anyio


def swap_config(providers: dict[str, int], models: list[str], *, max_loaded: int = 1, load_s: float = 5.0,
                idle_s: float = 0.0, static: tuple[str, ...] = ()) -> cfg.Config:
    """Providers (id -> capacity) on node n1, each serving every model (as the model's own
    name), managed (type ollama, ``lifecycle: managed``) unless named in ``static``."""
    return cfg.parse({
        "nodes": [{"id": "n1", "providers": [
            {"id": pid, "type": "ollama", "base_url": "http://127.0.0.1:1", "capacity": cap, "models": models,
             "max_loaded": max_loaded, "load_s": load_s, "unload_idle_s": idle_s,
             "lifecycle": "static" if pid in static else "managed"}
            for pid, cap in providers.items()
        ]}],
        "models": [{"id": m, "providers": {pid: m for pid in providers}} for m in models],
    }).config


class SwapHarness(Harness):
    async def start(self, holding: dict[str, dict[str, str]]) -> None:
        """Every provider up, its runtime holding ``holding[pid]`` (served -> state)."""
        await self.scripts.load()
        for _, prov in self.config.providers():
            await self.up(prov.id)
            await self.holds(prov.id, holding.get(prov.id, {}))

    async def holds(self, pid: str, states: dict[str, str], max_loaded: int | None = None) -> int:
        """The provider's worker publishes what its runtime holds (lua/models.lua)."""
        prov = next(p for _, p in self.config.providers() if p.id == pid)
        report = report_of(self.config, prov, RuntimeModels(states=states, max_loaded=max_loaded))
        return await self.calls.models(pid, report)

    async def send(self, model: str) -> tuple[str, str]:
        return await self.submit(model)

    async def order(self, pid: str) -> tuple[str, str]:
        load, evict = await self.redis.hmget(keys.provider(pid), ["load", "load_evict"])
        return (load or b"").decode(), (evict or b"").decode()

    async def state(self, pid: str, served: str) -> str:
        return ((await self.redis.hget(keys.provider(pid), f"ms:{served}")) or b"unknown").decode()

    async def loaded(self, pid: str, served: str, ok: bool = True, evicted: bool = True, reason: str = "") -> int:
        _, evict = await self.order(pid)
        outcome = wire.LoadOutcome(provider=pid, served=served, ok=ok, load_ms=1200 if ok else 0, reason=reason,
                                   evict=evict, evicted=evicted and bool(evict))
        return await self.calls.load_done(pid, outcome)

    async def on(self, job: str) -> str | None:
        return next((a.provider for a in await self.assignments() if a.job == job), None)

    async def done(self, job: str) -> None:
        await self.node.finish(await self.assignment(job), b"", mode="done")

    async def service_ms(self, pid: str, ms: float) -> None:
        """What the capacity loop publishes of its calls (lua/capacity.lua svc_ms)."""
        await self.redis.hset(keys.provider(pid), "svc_ms", ms)


@pytest.fixture
def swaps(any_redis: Redis) -> Any:
    async def make(config: cfg.Config, holding: dict[str, dict[str, str]]) -> SwapHarness:
        h = SwapHarness(any_redis, config)
        await h.start(holding)
        return h
    return make


async def test_a_request_goes_only_where_its_model_is_loaded(swaps: Any) -> None:
    h = await swaps(swap_config({"a": 2, "b": 2}, ["x", "y"]), {"a": {"x": "loaded"}, "b": {"y": "loaded"}})
    # a is busier with x than b, but b holds y, not x: every x goes to a, every y to b.
    xs = [(await h.send("x"))[0] for _ in range(2)]
    ys = [(await h.send("y"))[0] for _ in range(2)]
    assert [await h.on(j) for j in xs] == ["a", "a"]
    assert [await h.on(j) for j in ys] == ["b", "b"]
    # A third x waits for a rather than make b evict y, which runs there.
    job, status = await h.send("x")
    assert status == "queued"
    assert await h.order("b") == ("", "")
    await h.done(xs[0])
    assert await h.on(job) == "a"


async def test_a_model_loaded_nowhere_places_one_load_and_its_jobs_start_when_it_ends(swaps: Any) -> None:
    h = await swaps(swap_config({"a": 2, "b": 2}, ["x", "y"], max_loaded=2), {"a": {}, "b": {}})
    first, status = await h.send("x")
    assert status == "queued"
    # One load for the whole fleet, on the lowest provider id of equal cost.
    assert await h.order("a") == ("x", "")
    assert await h.order("b") == ("", "")
    assert await h.state("a", "x") == "loading"
    second, _ = await h.send("x")
    assert await h.order("b") == ("", ""), "a copy loading counts: no second load for the same burst"
    # The runtime does not show the load yet: what iop ordered stands.
    await h.holds("a", {})
    assert await h.state("a", "x") == "loading"
    assert await h.loaded("a", "x") == 2
    assert [await h.on(j) for j in (first, second)] == ["a", "a"]
    fields = {k.decode(): v.decode() for k, v in (await h.redis.hgetall(keys.provider("a"))).items()}
    state = wire.models_state(fields)["x"]
    assert (state.state, state.load_s, state.running, state.loads) == ("loaded", 1.2, 2, {"demand": 1})


async def test_a_provider_evicts_only_an_idle_model_and_the_least_recently_used(swaps: Any) -> None:
    h = await swaps(swap_config({"a": 4}, ["x", "y", "z"], max_loaded=2),
                    {"a": {"x": "loaded", "y": "loaded"}})
    running_x, _ = await h.send("x")
    y_job, _ = await h.send("y")
    await h.done(y_job)  # y used after x was, but nothing of y runs now
    job, status = await h.send("z")
    assert status == "queued"
    assert await h.order("a") == ("z", "y"), "x runs: y goes, though it was used last"
    assert await h.state("a", "y") == "unloading"
    # Nothing goes to a model being unloaded.
    _, y_status = await h.send("y")
    assert y_status == "queued"
    await h.loaded("a", "z")
    assert await h.state("a", "y") == "unloaded"
    assert await h.on(job) == "a"
    assert await h.on(running_x) == "a"


async def test_nothing_is_evicted_while_every_model_held_runs_or_waits(swaps: Any) -> None:
    h = await swaps(swap_config({"a": 1, "b": 1}, ["x", "y", "z"]),
                    {"a": {"x": "loaded"}, "b": {"y": "loaded"}})
    await h.send("x")
    await h.send("y")
    _, status = await h.send("z")
    assert status == "queued"
    assert (await h.order("a"), await h.order("b")) == (("", ""), ("", ""))
    # b's y finishes, but another y waits for it: still not b's to give up.
    await h.send("y")
    y_running = next(a.job for a in await h.assignments() if a.provider == "b")
    await h.done(y_running)
    assert await h.order("b") == ("", "")


async def test_a_model_used_within_unload_idle_s_is_kept(swaps: Any) -> None:
    h = await swaps(swap_config({"a": 1}, ["x", "y"], idle_s=3600),
                    {"a": {"x": "loaded"}})
    x, _ = await h.send("x")
    await h.done(x)
    _, status = await h.send("y")
    assert status == "queued"
    assert await h.order("a") == ("", "")


async def test_a_second_copy_is_loaded_only_when_waiting_costs_more_than_a_load(swaps: Any) -> None:
    h = await swaps(swap_config({"a": 1, "b": 1}, ["x", "y"], load_s=5.0),
                    {"a": {"x": "loaded"}, "b": {"y": "loaded"}})
    await h.send("x")  # runs on a
    # No service time measured yet: no evidence that waiting costs more than a load.
    await h.send("x")
    assert await h.order("b") == ("", "")
    # 2 s a call, one slot: the 2nd waiting job starts in 4 s, under a 5 s load. The 3rd in 6.
    await h.service_ms("a", 2000)
    await h.send("x")
    assert await h.order("b") == ("", "")
    await h.send("x")
    assert await h.order("b") == ("x", "y")


async def test_a_failed_load_is_not_ordered_there_again_for_a_while_and_goes_elsewhere(swaps: Any) -> None:
    h = await swaps(swap_config({"a": 1, "b": 1}, ["x"]), {"a": {}, "b": {}})
    job, _ = await h.send("x")
    assert await h.order("a") == ("x", "")
    await h.loaded("a", "x", ok=False, reason="out of memory")
    # The same pump placed it on b; a keeps the runtime's words and a time before a retry.
    assert await h.order("b") == ("x", "")
    fields = {k.decode(): v.decode() for k, v in (await h.redis.hgetall(keys.provider("a"))).items()}
    state = wire.models_state(fields)["x"]
    assert (state.state, state.failure, state.load_failures) == ("unloaded", "out of memory", 1)
    assert state.failed_until is not None
    assert state.failed_until > await h.now_ms() + 5000
    await h.loaded("b", "x")
    assert await h.on(job) == "b"


async def test_one_load_at_a_time_per_provider(swaps: Any) -> None:
    h = await swaps(swap_config({"a": 2}, ["x", "y"], max_loaded=2), {"a": {}})
    await h.send("x")
    await h.send("y")
    assert await h.order("a") == ("x", "")
    assert await h.state("a", "y") == "unloaded"
    await h.loaded("a", "x")
    # The load's end pumps: y, still waiting, is placed next.
    assert await h.order("a") == ("y", "")


async def test_a_lapsed_order_gives_way_to_a_new_one(swaps: Any) -> None:
    h = await swaps(swap_config({"a": 1}, ["x", "y"]), {"a": {"y": "loaded"}})
    await h.send("x")
    assert await h.order("a") == ("x", "y")
    await h.redis.hset(keys.provider("a"), "load_until", 1)  # its worker died mid-load
    # The next reading: the runtime had unloaded y and never loaded x. The lapsed order is
    # forgotten, the runtime's word stands, and the job still waiting places a new load.
    await h.holds("a", {"y": "unloaded"})
    assert await h.state("a", "y") == "unloaded"
    assert await h.order("a") == ("x", "")


async def test_what_the_runtime_changes_by_itself_is_read_and_counted(swaps: Any) -> None:
    h = await swaps(swap_config({"a": 1}, ["x", "y"]), {"a": {"y": "loaded"}})
    # Another client's request made the runtime load x in y's place.
    await h.holds("a", {"x": "loaded", "y": "unloaded"})
    fields = {k.decode(): v.decode() for k, v in (await h.redis.hgetall(keys.provider("a"))).items()}
    models = wire.models_state(fields)
    assert (models["x"].state, models["x"].loads, models["y"].unloads) == ("loaded", {"runtime": 1}, {"runtime": 1})
    job, status = await h.send("x")
    assert (status, await h.on(job)) == ("dispatched", "a")


async def test_a_static_provider_of_the_same_model_is_always_warm(swaps: Any) -> None:
    h = await swaps(swap_config({"a": 1, "s": 1}, ["x"], static=("s",)), {"a": {}})
    job, status = await h.send("x")
    assert (status, await h.on(job)) == ("dispatched", "s")
    # s is busy: a copy is there (s), with no service time yet, so nothing is placed on a.
    _, status = await h.send("x")
    assert status == "queued"
    assert await h.order("a") == ("", "")


async def test_reconcile_rebuilds_a_models_running_count(swaps: Any) -> None:
    h = await swaps(swap_config({"a": 2}, ["x"]), {"a": {"x": "loaded"}})
    job, _ = await h.send("x")
    await h.redis.hset(keys.provider("a"), "mr:x", 7)
    await h.calls.reconcile(["a"])
    assert await h.redis.hget(keys.provider("a"), "mr:x") == b"1"
    await h.done(job)
    assert await h.redis.hget(keys.provider("a"), "mr:x") == b"0"


async def test_the_catalog_shows_what_each_provider_holds(swaps: Any) -> None:
    h = await swaps(swap_config({"a": 1}, ["x", "y"], max_loaded=1), {"a": {"x": "loaded"}})
    catalog = await read_catalog(h.redis, h.config)
    a = next(p for p in catalog.providers if p.id == "a")
    assert a.max_loaded == 1
    assert {k: v.state for k, v in a.models_state.items()} == {"x": "loaded", "y": "unloaded"}


async def test_a_spare_copy_makes_room_though_its_model_is_busy_elsewhere(swaps: Any) -> None:
    h = await swaps(swap_config({"a": 1, "b": 1}, ["x", "z"], idle_s=60),
                    {"a": {"x": "loaded"}, "b": {"x": "loaded"}})
    long_ago = await h.now_ms() - 120_000
    for pid in ("a", "b"):
        await h.redis.hset(keys.provider(pid), "mt:x", long_ago)  # loaded two minutes ago
    # x was used a moment ago on a and b (warm-first spreads it): neither copy is idle.
    x1, _ = await h.send("x")
    x2, _ = await h.send("x")
    first, second = await h.on(x1), await h.on(x2)
    assert {first, second} == {"a", "b"}
    assert first is not None
    assert second is not None
    await h.done(x1)
    # z, loaded nowhere, waits; the other still runs x, the first's copy runs nothing: a spare.
    z, status = await h.send("z")
    assert status == "queued"
    assert await h.order(first) == ("z", "x")
    assert await h.order(second) == ("", "")
    await h.loaded(first, "z")
    assert await h.on(z) == first
    # The last copy of x is nobody's spare, even idle of requests and wanted for z.
    assert await h.redis.hget(keys.MODEL_COPIES, "x") == f",{second},".encode()
    await h.done(x2)
    await h.service_ms(first, 10_000)
    await h.send("z")
    await h.send("z")
    assert await h.order(second) == ("", "")
    # Once x has another copy, it is.
    await h.redis.hset(keys.MODEL_COPIES, "x", f",{second},elsewhere,")
    await h.send("z")
    assert await h.order(second) == ("z", "x")


async def test_a_copy_loaded_a_moment_ago_is_nobodys_spare(swaps: Any) -> None:
    h = await swaps(swap_config({"a": 1, "b": 1}, ["x", "z"], idle_s=60),
                    {"a": {"x": "loaded"}, "b": {"x": "loaded"}})
    x, _ = await h.send("x")
    await h.done(x)
    _, status = await h.send("z")
    assert status == "queued"
    assert (await h.order("a"), await h.order("b")) == (("", ""), ("", ""))
