"""Redis Cluster and Sentinel (issue: MOVED on every request through a node that does not
serve ``{iop}``): both clients find the primary, follow it when it moves, and /readyz says
whether the scripts can run. Against real topologies from ``tests/topologies.py``.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import pytest
from litestar.testing import AsyncTestClient
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.exceptions import ConnectionError, RedisError

from api.app import create_app
from api.gateway import Gateway
from dispatcher import config as cfg
from dispatcher import keys, redis_conn
from dispatcher.config import RedisConfig, SentinelConfig
from dispatcher.fastredis import FastRedis
from dispatcher.redis_conn import connect, connect_fast
from dispatcher.redis_topology import (
    IOP_SLOT,
    Address,
    ClusterLocator,
    Locator,
    Probe,
    SentinelLocator,
    StaticLocator,
    described,
    locator_for,
    shown_url,
)
from iop.redis_server import RedisServer, free_port
from tests.conftest import REDIS_BINARIES
from tests.dispatcher.config.one_model import ONE_MODEL
from tests.topologies import DOWN_AFTER_MS, MASTER_NAME, NODE_TIMEOUT_MS, RedisCluster, SentinelSet, redis_cli
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

# A script that writes one {iop} key and says which server ran it.
WRITE = "redis.call('SET', KEYS[1], ARGV[1]) return redis.call('INFO', 'server'):match('tcp_port:(%d+)')"
# Failure detection, election and a few client retries.
RECOVERY_S = NODE_TIMEOUT_MS / 1000 + 8


def _version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    return "redis-" + (out.split("v=", 1)[1].split()[0] if "v=" in out else "unknown")


def _need_redis_cli() -> None:
    if redis_cli() is None:
        pytest.skip("redis-cli is not on PATH: the tests need it to create a Redis Cluster")


def iop_config(redis: dict[str, Any]) -> cfg.Config:
    return cfg.parse({
        "redis": redis,
        # No worker runs: a submit must wait, not be refused for want of a provider.
        "queue": {"hold_when_unavailable_ms": 3_600_000},
        "models": [{"id": "m", "providers": {"p": "served-m"}}],
        "nodes": [{"id": "n", "providers": [
            {"id": "p", "type": "vllm", "base_url": "http://127.0.0.1:9", "models": ["served-m"]}]}],
    }).config


@pytest.fixture(autouse=True)
def _no_redis_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IOP_REDIS_URL", raising=False)


@pytest.fixture
async def gateways() -> AsyncIterator[Callable[[dict[str, Any]], Gateway]]:
    made: list[Gateway] = []

    def make(redis: dict[str, Any]) -> Gateway:
        made.append(Gateway(iop_config(redis)))
        return made[-1]

    yield make
    for gw in made:
        await gw.close()


async def use_both_clients(gw: Gateway, value: str = "v") -> None:
    """The request path's client runs a script, redis-py writes and reads, /readyz agrees."""
    await gw.runtime.jobs.heartbeat()
    await gw.redis.set("{iop}:topology-test", value)
    assert await gw.redis.get("{iop}:topology-test") == value.encode()
    ok, detail = await gw.ready()
    assert ok, detail


async def submit(gw: Gateway) -> str:
    model = gw.config.model("m")
    assert model is not None
    lane = gw.runtime.plans.main_lane(model.id)
    result = await gw.runtime.jobs.submit(gw.next_job_id(), lane, b'{"model":"m"}', "chat/completions", False)
    return result.status


async def recover(gw: Gateway, within: float) -> None:
    """Until both clients work again (a Redis error or a failed check means not yet)."""

    async def recovered() -> bool:
        await use_both_clients(gw, "recovered")
        return True

    await eventually(recovered, what="both clients working again", within=within, every=0.1,
                     retrying=(RedisError, AssertionError))


async def primary_of(client: FastRedis) -> Address:
    locator = client._locator
    assert locator is not None
    return await locator.primary()


def address(server: RedisServer) -> Address:
    return (server.host, server.port)


# --- the locator on its own ---------------------------------------------------------------


class CountingLocator(Locator):
    def __init__(self) -> None:
        super().__init__()
        self.discoveries = 0

    async def _discover(self) -> Address:
        self.discoveries += 1
        await asyncio.sleep(0.05)
        return ("10.0.0.1", 6379 + self.discoveries)


async def test_concurrent_callers_share_one_discovery() -> None:
    locator = CountingLocator()
    answers = await asyncio.gather(*(locator.primary() for _ in range(20)))
    assert set(answers) == {("10.0.0.1", 6380)}
    assert locator.discoveries == 1


async def test_only_the_address_still_believed_in_is_forgotten() -> None:
    locator = CountingLocator()
    first = await locator.primary()
    locator.invalidate(("10.0.0.9", 1))  # an older primary: nothing to do
    assert await locator.primary() == first
    assert locator.discoveries == 1
    generation = locator.generation
    locator.invalidate(first, moved_to=("10.0.0.2", 7000))  # a MOVED reply names the new one
    assert await locator.primary() == ("10.0.0.2", 7000)
    assert locator.discoveries == 1
    assert locator.generation == generation + 1
    locator.invalidate()
    assert await locator.primary() == ("10.0.0.1", 6381)
    assert locator.discoveries == 2


async def test_a_standalone_url_asks_nothing() -> None:
    locator = locator_for(RedisConfig(url="redis://10.1.2.3:6400/2"))
    assert isinstance(locator, StaticLocator)
    assert not locator.dynamic
    assert await locator.primary() == ("10.1.2.3", 6400)
    assert connect_fast("redis://10.1.2.3:6400/2")._locator is None


async def test_nothing_answers_and_the_error_says_what_was_tried() -> None:
    dead = [("127.0.0.1", free_port()), ("127.0.0.1", free_port())]
    cluster = ClusterLocator(dead[0], Probe({}))
    with pytest.raises(ConnectionError, match=f"slot {IOP_SLOT}.*127.0.0.1:{dead[0][1]}"):
        await cluster.primary()
    sentinel = SentinelLocator(MASTER_NAME, dead, Probe({}), Probe({}))
    with pytest.raises(ConnectionError) as caught:
        await sentinel.primary()
    assert all(f"sentinel 127.0.0.1:{port}" in str(caught.value) for _, port in dead)
    assert MASTER_NAME in str(caught.value)


# --- Redis Cluster ------------------------------------------------------------------------


@pytest.fixture(scope="module", params=REDIS_BINARIES, ids=_version)
def any_cluster(request: pytest.FixtureRequest) -> Iterator[RedisCluster]:
    """A small cluster (no replicas) of each available redis-server."""
    _need_redis_cli()
    cluster = RedisCluster(masters=3, replicas=0, binary=request.param)
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    """Three masters with a replica each; the failover tests below change who owns {iop}."""
    _need_redis_cli()
    cluster = RedisCluster(masters=3, replicas=1)
    yield cluster
    cluster.close()


async def test_the_locator_finds_the_owner_from_a_seed_that_does_not_own_it(any_cluster: RedisCluster) -> None:
    seed = any_cluster.seed_not_owning_iop()
    client = Redis.from_url(seed)
    assert await client.cluster("KEYSLOT", keys.PREFIX) == IOP_SLOT
    await client.aclose()
    locator = locator_for(RedisConfig(url=seed, cluster=True))
    assert isinstance(locator, ClusterLocator)
    assert await locator.primary() == address(any_cluster.owner_of_iop())
    assert len(locator.nodes) == len(any_cluster.nodes)  # every node learnt, for when the seed is gone


async def test_both_clients_run_scripts_through_a_seed_that_does_not_own_iop(
    any_cluster: RedisCluster, gateways: Callable[[dict[str, Any]], Gateway]
) -> None:
    gw = gateways({"url": any_cluster.seed_not_owning_iop(), "cluster": True})
    await gw.scripts.load()
    assert await gw.scripts.loaded()
    assert await submit(gw) == "queued"  # no provider is up: it waits in the queue
    await use_both_clients(gw)
    owner = any_cluster.owner_of_iop()
    assert int(await gw.clients.fast.execute("EVAL", WRITE, 1, "{iop}:who", "x")) == owner.port
    assert await primary_of(gw.clients.fast) == address(owner)


async def test_a_resharding_of_the_iop_slot(any_cluster: RedisCluster) -> None:
    """While slot 8313 migrates, a key already moved is asked for at the target (ASK), and a
    script whose keys are split between the two nodes waits (TRYAGAIN) until its timeout."""
    owner = any_cluster.owner_of_iop()
    target = next(n for n in any_cluster.nodes if n is not owner)
    fast = connect_fast(RedisConfig(url=any_cluster.seed_not_owning_iop(), cluster=True))
    await fast.execute("SET", "{iop}:stays", "1")
    async with Redis.from_url(owner.url) as source_admin, Redis.from_url(target.url) as target_admin:
        source_id = await source_admin.execute_command("CLUSTER", "MYID")
        target_id = await target_admin.execute_command("CLUSTER", "MYID")
        await target_admin.execute_command("CLUSTER", "SETSLOT", IOP_SLOT, "IMPORTING", source_id)
        await source_admin.execute_command("CLUSTER", "SETSLOT", IOP_SLOT, "MIGRATING", target_id)
        try:
            assert int(await fast.execute("EVAL", WRITE, 1, "{iop}:new", "x")) == target.port
            assert await fast.execute("GET", "{iop}:stays") == b"1"  # not moved yet: served at the source
            started = time.monotonic()
            with pytest.raises(ConnectionError, match="TRYAGAIN"):
                await fast.execute("MGET", "{iop}:stays", "{iop}:elsewhere", reply_within=0.5)
            assert 0.2 < time.monotonic() - started < 1  # short pauses, within reply_within
        finally:
            # Undo the migration: drop what reached the target (ASKING holds for one command).
            async with target_admin.pipeline(transaction=False) as pipe:
                pipe.execute_command("ASKING")
                pipe.delete("{iop}:new")
                await pipe.execute()
            for admin in (source_admin, target_admin):
                await admin.execute_command("CLUSTER", "SETSLOT", IOP_SLOT, "NODE", source_id)
            await fast.close()


async def test_a_cluster_that_only_an_acl_user_may_enter(gateways: Callable[[dict[str, Any]], Gateway]) -> None:
    _need_redis_cli()
    cluster = RedisCluster(masters=3, replicas=0, acl_user=("iop", "s3cret-pass"))
    try:
        seed = cluster.seed_not_owning_iop()
        assert "iop:s3cret-pass@" in seed
        gw = gateways({"url": seed, "cluster": True})
        assert await submit(gw) == "queued"
        await use_both_clients(gw)
        wrong = connect_fast(RedisConfig(url=seed.replace("s3cret", "wrong"), cluster=True))
        with pytest.raises(ConnectionError, match=r"WRONGPASS|invalid"):
            await wrong.execute("PING")
        await wrong.close()
    finally:
        cluster.close()


async def test_pubsub_goes_to_the_owner(cluster: RedisCluster) -> None:
    config = RedisConfig(url=cluster.seed_not_owning_iop(), cluster=True)
    redis = connect(config)
    pubsub = redis.pubsub()
    await pubsub.subscribe(keys.cancel_channel("n"))
    subscribed = await pubsub.get_message(timeout=2)
    assert subscribed is not None
    assert subscribed["type"] == "subscribe"
    assert await redis.publish(keys.cancel_channel("n"), "job-1") >= 1
    message = await pubsub.get_message(timeout=2)
    assert message is not None
    assert message["data"] == b"job-1"
    await pubsub.aclose()  # type: ignore[no-untyped-call]
    await redis.aclose()


async def test_readyz_fails_where_the_scripts_cannot_run(cluster: RedisCluster) -> None:
    seed = cluster.seed_not_owning_iop()
    # Not told it is a cluster: PING answers, but every keyed call gets MOVED.
    async with AsyncTestClient(create_app(iop_config({"url": seed}))) as client:
        ready = await client.get("/readyz")
        assert ready.status_code == 503
        assert "MOVED" in ready.json()["detail"]
    async with AsyncTestClient(create_app(iop_config({"url": seed, "cluster": True}))) as client:
        assert (await client.get("/readyz")).status_code == 200


async def test_a_manual_failover_is_followed_without_an_error(
    cluster: RedisCluster, gateways: Callable[[dict[str, Any]], Gateway]
) -> None:
    gw = gateways({"url": cluster.seed_not_owning_iop(), "cluster": True})
    await use_both_clients(gw, "before")
    old = cluster.owner_of_iop()
    replica = cluster.replica_of(old)
    await anyio.to_thread.run_sync(_cluster_failover, replica)
    new = await anyio.to_thread.run_sync(cluster.wait_failover, old)
    assert new is replica
    # The connections still open to the old owner get MOVED: both clients follow it at once.
    await use_both_clients(gw, "after")
    assert await primary_of(gw.clients.fast) == address(new)


def _cluster_failover(replica: RedisServer) -> None:
    with SyncRedis(host=replica.host, port=replica.port) as client:
        client.execute_command("CLUSTER", "FAILOVER")


async def test_both_clients_recover_when_the_owner_is_killed(
    cluster: RedisCluster, gateways: Callable[[dict[str, Any]], Gateway]
) -> None:
    gw = gateways({"url": cluster.seed_not_owning_iop(), "cluster": True})
    await use_both_clients(gw)
    owner = cluster.owner_of_iop()
    replica = cluster.replica_of(owner)
    cluster.kill(owner)
    await recover(gw, RECOVERY_S)
    assert await primary_of(gw.clients.fast) == address(replica)


# --- READONLY: a master demoted by hand ---------------------------------------------------


class RoleLocator(Locator):
    """Whichever of some standalone servers says it is a master."""

    def __init__(self, servers: list[RedisServer]) -> None:
        super().__init__()
        self.servers = servers

    async def _discover(self) -> Address:
        for server in self.servers:
            client = Redis.from_url(server.url)
            try:
                if (await client.execute_command("ROLE"))[0] == b"master":
                    return address(server)
            finally:
                await client.aclose()
        raise ConnectionError("no master")


@pytest.fixture(params=REDIS_BINARIES, ids=_version)
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[RedisServer, RedisServer]]:
    with RedisServer(binary=request.param) as a, RedisServer(binary=request.param) as b:
        yield a, b


async def test_a_demoted_master_is_left_for_the_new_one(
    pair: tuple[RedisServer, RedisServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = pair
    locator = RoleLocator([a, b])
    monkeypatch.setattr(redis_conn, "locator_for", lambda config: locator)
    config = RedisConfig(url=a.url, cluster=True)  # any dynamic topology: the locator is the test's
    redis, fast = connect(config), connect_fast(config)
    admin_a, admin_b = Redis.from_url(a.url), Redis.from_url(b.url)
    try:
        await admin_b.replicaof(a.host, a.port)
        for client_write in (lambda v: fast.execute("EVAL", WRITE, 1, "{iop}:k", v),
                             lambda v: redis.eval(WRITE, 1, "{iop}:k", v)):
            assert int(await client_write("1")) == a.port
        await redis.set("{iop}:plain", "1")
        # Demote a by hand; its clients stay connected and now get READONLY.
        await admin_b.replicaof("NO", "ONE")
        await admin_a.replicaof(b.host, b.port)
        # Redis 6.2 reports a script's READONLY inside "Error running script": both forms count.
        assert int(await fast.execute("EVAL", WRITE, 1, "{iop}:k", "2")) == b.port
        assert int(await redis.eval(WRITE, 1, "{iop}:k", "3")) == b.port
        assert await redis.set("{iop}:plain", "2")
        assert await locator.primary() == address(b)
    finally:
        await admin_a.replicaof("NO", "ONE")
        for client in (admin_a, admin_b, redis):
            await client.aclose()
        await fast.close()


# --- Sentinel -----------------------------------------------------------------------------


def sentinel_config(sentinels: SentinelSet) -> dict[str, Any]:
    return {"sentinel": {"master": MASTER_NAME, "nodes": sentinels.sentinel_nodes}}


@pytest.fixture(scope="module", params=REDIS_BINARIES, ids=_version)
def any_sentinels(request: pytest.FixtureRequest) -> Iterator[SentinelSet]:
    sentinels = SentinelSet(binary=request.param)
    yield sentinels
    sentinels.close()


@pytest.fixture(scope="module")
def sentinels() -> Iterator[SentinelSet]:
    sentinels = SentinelSet()
    yield sentinels
    sentinels.close()


async def test_sentinel_discovery_from_the_sentinels_alone(
    any_sentinels: SentinelSet, gateways: Callable[[dict[str, Any]], Gateway]
) -> None:
    gw = gateways(sentinel_config(any_sentinels))
    await gw.scripts.load()
    assert await submit(gw) == "queued"
    await use_both_clients(gw)
    master = any_sentinels.current_master()
    assert await primary_of(gw.clients.fast) == address(master)
    assert int(await gw.clients.fast.execute("EVAL", WRITE, 1, "{iop}:who", "x")) == master.port


async def test_sentinel_failover_demotes_the_master_and_clients_follow(
    sentinels: SentinelSet, gateways: Callable[[dict[str, Any]], Gateway]
) -> None:
    gw = gateways(sentinel_config(sentinels))
    await use_both_clients(gw, "before")
    old = await anyio.to_thread.run_sync(sentinels.failover)
    new = await anyio.to_thread.run_sync(sentinels.wait_new_master, old)
    # Sentinel would demote the old master within its 10 s INFO period: do it now.
    async with Redis.from_url(old.url) as client:
        await client.replicaof(new.host, new.port)
    # The old master is up and holds the clients' connections: writes there get READONLY.
    await use_both_clients(gw, "after")
    assert await primary_of(gw.clients.fast) == address(new)


async def test_sentinel_master_killed_and_clients_recover(
    sentinels: SentinelSet, gateways: Callable[[dict[str, Any]], Gateway]
) -> None:
    gw = gateways(sentinel_config(sentinels))
    await use_both_clients(gw)
    old = sentinels.kill_master()
    survivor = next(s for s in sentinels.servers if s is not old)
    await recover(gw, DOWN_AFTER_MS / 1000 + 10)
    assert await primary_of(gw.clients.fast) == address(survivor)


async def test_sentinels_with_a_password_of_their_own(
    sentinels: SentinelSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    master = sentinels.current_master()
    port = int(sentinels.sentinel_nodes[0].rsplit(":", 1)[1])
    async with Redis(host="127.0.0.1", port=port) as admin:
        await admin.execute_command("ACL", "SETUSER", "default", "resetpass", ">sentinel-secret")
    try:
        nodes = [sentinels.sentinel_nodes[0]]
        config = RedisConfig(sentinel=SentinelConfig(master=MASTER_NAME, nodes=nodes))
        with pytest.raises(ConnectionError, match=r"NOAUTH|[Aa]uthenticat"):
            await locator_for(config).primary()
        monkeypatch.setenv("IOP_TEST_SENTINEL_PASS", "sentinel-secret")
        config = RedisConfig(sentinel=SentinelConfig(master=MASTER_NAME, nodes=nodes,
                                                     sentinel_password_env="IOP_TEST_SENTINEL_PASS"))
        assert await locator_for(config).primary() == address(master)
    finally:
        async with Redis(host="127.0.0.1", port=port, password="sentinel-secret") as admin:
            await admin.execute_command("ACL", "SETUSER", "default", "nopass")


# --- what a process says at start about the Redis it uses -------------------------------------


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("redis://:hunter2@10.0.0.9:6379/0", "redis://:***@10.0.0.9:6379/0"),
    ("rediss://iop:p%40ss@r.internal:6380/2", "rediss://iop:***@r.internal:6380/2"),
    ("redis://iop@r.internal", "redis://iop@r.internal"),
    ("unix:///run/redis.sock?db=1&password=hunter2", "unix:///run/redis.sock?db=1&password=***"),
])
def test_a_shown_url_never_holds_the_password(url: str, shown: str) -> None:
    assert shown_url(url) == shown


def test_described_names_the_redis_and_where_its_url_comes_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IOP_REDIS_URL", raising=False)
    assert described(RedisConfig()) == ("redis://127.0.0.1:6379/0, the default: neither IOP_REDIS_URL nor "
                                        "redis.url is set")
    assert described(RedisConfig(url="redis://:pw@r:6379/3")) == "redis://:***@r:6379/3 (redis.url)"
    assert described(RedisConfig(url="redis://node-1:7000", cluster=True)) == (
        "the Redis Cluster of redis://node-1:7000 (redis.url, redis.cluster)")
    sentinel = SentinelConfig(master="mymaster", nodes=["10.0.0.1:26379", "10.0.0.2:26379"])
    assert described(RedisConfig(sentinel=sentinel)) == (
        "the master 'mymaster' of the sentinels 10.0.0.1:26379, 10.0.0.2:26379 (redis.sentinel)")
    monkeypatch.setenv("IOP_REDIS_URL", "rediss://u:pw@r/2")
    assert described(cfg.parse({**ONE_MODEL, "redis": {"sentinel": {"master": "m", "nodes": ["s:26379"]}}})
                     .config.redis) == ("the master 'm' of the sentinels s:26379 (redis.sentinel), with the db, "
                                        "TLS and credentials of rediss://u:***@r/2 (IOP_REDIS_URL)")
