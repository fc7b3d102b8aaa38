"""The ``redis`` section for Redis Cluster and Sentinel: decoding, validation (every problem
at its ``$.redis...`` path), the ``IOP_REDIS_URL`` override, and what the clients are built from."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest
from redis.asyncio.connection import SSLConnection, parse_url

from dispatcher import config as cfg
from dispatcher.exceptions import ConfigError, ConfigProblem
from dispatcher.fastredis import FastRedis
from dispatcher.redis_conn import LocatedConnection, LocatedSSLConnection, connect, connect_fast
from dispatcher.redis_topology import ClusterLocator, SentinelLocator, StaticLocator, data_url, locator_for
from tests.dispatcher.config.one_model import ONE_MODEL_YAML
from tests.dispatcher.config.yaml_text import load_text


@pytest.fixture(autouse=True)
def _no_redis_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IOP_REDIS_URL", raising=False)


def with_redis(redis: dict[str, Any]) -> dict[str, Any]:
    return {
        "redis": redis,
        "models": [{"id": "m", "providers": {"p": "served-m"}}],
        "nodes": [{"id": "n", "providers": [
            {"id": "p", "type": "vllm", "base_url": "http://gpu:8000", "models": ["served-m"]}]}],
    }


def problems_of(redis: dict[str, Any]) -> list[ConfigProblem]:
    with pytest.raises(ConfigError) as info:
        cfg.parse(with_redis(redis))
    return info.value.problems


SENTINEL = {"master": "mymaster", "nodes": ["10.0.0.1:26379", "10.0.0.2:26379"]}


def test_cluster_and_sentinel_from_yaml() -> None:
    config = load_text(textwrap.dedent("""
        redis:
          url: rediss://any-cluster-node:6379/0
          cluster: true
    """) + ONE_MODEL_YAML).config
    assert config.redis.cluster
    assert config.redis.sentinel is None
    config = load_text(textwrap.dedent("""
        redis:
          sentinel:
            master: mymaster
            nodes: ["10.0.0.1:26379", "[fd00::3]:26379"]
            password_env: IOP_REDIS_PASSWORD
            sentinel_password_env: IOP_SENTINEL_PASSWORD
    """) + ONE_MODEL_YAML).config
    sentinel = config.redis.sentinel
    assert sentinel is not None
    assert (sentinel.master, sentinel.nodes) == ("mymaster", ["10.0.0.1:26379", "[fd00::3]:26379"])
    assert (sentinel.password_env, sentinel.sentinel_password_env) == ("IOP_REDIS_PASSWORD", "IOP_SENTINEL_PASSWORD")
    assert not config.redis.cluster


def test_standalone_stays_the_default() -> None:
    redis = cfg.parse(with_redis({"url": "redis://r:6379/2"})).config.redis
    assert (redis.url, redis.cluster, redis.sentinel) == ("redis://r:6379/2", False, None)


@pytest.mark.parametrize(
    ("redis", "path", "words"),
    [
        ({"cluster": True, "sentinel": SENTINEL}, "$.redis.sentinel", "cannot be combined"),
        ({"sentinel": {"master": "", "nodes": ["h:1"]}}, "$.redis.sentinel.master", "empty"),
        ({"sentinel": {"master": "m", "nodes": []}}, "$.redis.sentinel.nodes", "at least one"),
        ({"sentinel": {"master": "m", "nodes": ["h:1", "h"]}}, "$.redis.sentinel.nodes[1]", "host:port"),
        ({"sentinel": {"master": "m", "nodes": ["h:99999"]}}, "$.redis.sentinel.nodes[0]", "host:port"),
        ({"sentinel": {"master": "m", "nodes": [":26379"]}}, "$.redis.sentinel.nodes[0]", "host:port"),
        ({"sentinel": {**SENTINEL, "password_env": "hunter2!"}}, "$.redis.sentinel.password_env", "environment"),
        ({"sentinel": {**SENTINEL, "sentinel_password_env": "a b"}}, "$.redis.sentinel.sentinel_password_env",
         "environment"),
        ({"url": "redis://node:6379/3", "cluster": True}, "$.redis.url", "database 0"),
        ({"url": "unix:///run/redis.sock", "cluster": True}, "$.redis.url", "TCP"),
        ({"url": "unix:///run/redis.sock", "sentinel": SENTINEL}, "$.redis.url", "TCP"),
    ],
)
def test_problems_are_reported_at_their_path(redis: dict[str, Any], path: str, words: str) -> None:
    (problem,) = problems_of(redis)
    assert problem.path == path
    assert words in problem.message


def test_every_redis_problem_at_once() -> None:
    problems = problems_of({"cluster": True, "sentinel": {"master": "", "nodes": ["x"]}})
    assert {p.path for p in problems} == {"$.redis.sentinel", "$.redis.sentinel.master", "$.redis.sentinel.nodes[0]"}


def test_unknown_and_missing_sentinel_fields() -> None:
    (problem,) = problems_of({"sentinel": {**SENTINEL, "mastre": "x"}})
    assert problem.path == "$.redis.sentinel.mastre"
    (problem,) = problems_of({"sentinel": {"nodes": ["h:1"]}})
    assert problem.path == "$.redis.sentinel"
    assert "master" in problem.message


def test_iop_redis_url_replaces_only_the_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_REDIS_URL", "rediss://override:7000/0")
    redis = cfg.parse(with_redis({"url": "redis://file:6379/0", "cluster": True})).config.redis
    assert (redis.url, redis.cluster) == ("rediss://override:7000/0", True)
    redis = cfg.parse(with_redis({"sentinel": SENTINEL})).config.redis
    assert redis.url == "rediss://override:7000/0"
    assert redis.sentinel is not None
    assert redis.sentinel.master == "mymaster"


def test_sentinel_data_url_takes_the_password_from_its_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_TEST_REDIS_PASS", "p@ss:w/rd %")
    redis = cfg.RedisConfig(
        url="rediss://ignored-host:1234/2?ssl_cert_reqs=none",
        sentinel=cfg.SentinelConfig(master="m", nodes=["h:1"], username="iop", password_env="IOP_TEST_REDIS_PASS"),
    )
    options = parse_url(data_url(redis))
    assert options["connection_class"] is SSLConnection  # TLS and db from the url
    assert options["db"] == 2
    assert (options["username"], options["password"]) == ("iop", "p@ss:w/rd %")
    assert options.get("ssl_cert_reqs") == "none"
    # Without a url: plain TCP, db 0, no credentials unless configured.
    options = parse_url(data_url(cfg.RedisConfig(sentinel=cfg.SentinelConfig(master="m", nodes=["h:1"]))))
    assert "password" not in options
    assert "connection_class" not in options


def test_locators_and_clients_for_each_shape() -> None:
    standalone = cfg.RedisConfig(url="redis://r:6390/0")
    cluster = cfg.RedisConfig(url="rediss://seed:7000/0", cluster=True)
    sentinel = cfg.RedisConfig(sentinel=cfg.SentinelConfig(master="m", nodes=["s1:26379", "[fd00::1]:26379"]))
    assert isinstance(locator_for(standalone), StaticLocator)
    cluster_locator = locator_for(cluster)
    assert isinstance(cluster_locator, ClusterLocator)
    assert cluster_locator.nodes == [("seed", 7000)]
    sentinel_locator = locator_for(sentinel)
    assert isinstance(sentinel_locator, SentinelLocator)
    assert sentinel_locator._sentinels == [("s1", 26379), ("fd00::1", 26379)]

    # A URL and a standalone config build the very same clients as before.
    for given in ("redis://r:6390/0", standalone):
        pool = connect(given).connection_pool
        assert pool.connection_class.__name__ == "Connection"
        assert isinstance(connect_fast(given), FastRedis)
        assert connect_fast(given)._locator is None
    assert connect(cluster).connection_pool.connection_class is LocatedSSLConnection
    assert connect(sentinel).connection_pool.connection_class is LocatedConnection
    assert connect_fast(cluster)._locator is not None
