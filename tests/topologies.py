"""Real Redis Cluster and Sentinel topologies for tests, from private ``redis-server``
processes on free ports (never the system Redis).

Timings are small so that a failover happens within a few seconds: a node is declared
failed after ``NODE_TIMEOUT_MS`` (cluster) or ``DOWN_AFTER_MS`` (sentinel).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from redis import Redis
from redis.exceptions import RedisError

from dispatcher.redis_topology import IOP_SLOT, Address
from iop.redis_server import RedisServer, die_with_parent, find_redis_server, free_port
from tests.waiting import eventually_sync

NODE_TIMEOUT_MS = 1000
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 3000
MASTER_NAME = "mymaster"
# A replica's first sync starts at once (Redis 7 waits 5 s for more replicas by default).
FAST_SYNC = ["--repl-diskless-sync-delay", "0"]
HOST = "127.0.0.1"

T = TypeVar("T")


def redis_cli() -> str | None:
    return shutil.which("redis-cli")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 15.0, interval: float = 0.05) -> T:
    """The first truthy result of ``probe`` (RedisError counts as not yet)."""
    try:
        found: T = eventually_sync(probe, what=what, within=timeout, every=interval,
                                   retrying=(RedisError,))
    except AssertionError as exc:
        raise TimeoutError(str(exc)) from None
    return found


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    while True:
        port = free_port(HOST)
        if port < 55536 and _bindable(port + 10000):
            return port


# The ACL user and password of servers started with one, by port, for the helpers' connections.
_CREDENTIALS: dict[int, tuple[str, str]] = {}


def _client(server: RedisServer) -> Redis:
    username, password = _CREDENTIALS.get(server.port, (None, None))
    return Redis(host=server.host, port=server.port, username=username, password=password,
                 socket_timeout=1.0, socket_connect_timeout=1.0)


def _ask(server: RedisServer, *args: Any) -> Any:
    with _client(server) as client:
        return client.execute_command(*args)


def _info(server: RedisServer, section: str) -> dict[str, Any]:
    with _client(server) as client:
        info: dict[str, Any] = client.info(section)
        return info


def _cluster_ok(server: RedisServer) -> bool:
    return "cluster_state:ok" in _ask(server, "CLUSTER", "INFO").decode()


def _alive(server: RedisServer) -> bool:
    return server.proc is not None and server.proc.poll() is None


class RedisCluster:
    """``masters`` masters with ``replicas`` replicas each, made by ``redis-cli --cluster create``;
    with ``acl_user`` (user, password) the default user is off and only that user gets in."""

    def __init__(self, masters: int = 3, replicas: int = 1, *, binary: str | None = None,
                 acl_user: tuple[str, str] | None = None) -> None:
        cli = redis_cli()
        if cli is None:
            raise FileNotFoundError("redis-cli is not on PATH: it creates the cluster")
        self.cli = cli
        self.nodes: list[RedisServer] = []
        args = ["--cluster-enabled", "yes", "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                "--cluster-replica-validity-factor", "0", *FAST_SYNC]
        cli_auth: list[str] = []
        if acl_user:
            user, password = acl_user
            args += ["--user", "default", "off", "--user", user, "on", f">{password}", "~*", "&*", "+@all",
                     "--masteruser", user, "--masterauth", password]
            cli_auth = ["--user", user, "--pass", password, "--no-auth-warning"]
        try:
            for _ in range(masters * (1 + replicas)):
                node = RedisServer(cluster_port(), binary=binary, appendonly=True, extra_args=args)
                self.nodes.append(node)
                if acl_user:
                    _CREDENTIALS[node.port] = acl_user
                node.start()
            subprocess.run(
                [cli, *cli_auth, "--cluster", "create", *(f"{HOST}:{n.port}" for n in self.nodes),
                 "--cluster-replicas", str(replicas), "--cluster-yes"],
                check=True, capture_output=True, timeout=60,
            )
            for node in self.nodes:
                wait_for(f"cluster_state:ok on {node.port}", lambda n=node: _cluster_ok(n))  # type: ignore[misc]
            self._wait_replicas_linked()
        except BaseException:
            self.close()
            raise

    def _wait_replicas_linked(self) -> None:
        for node in self.nodes:
            if _alive(node) and _info(node, "replication").get("role") == "slave":
                wait_for(f"replica {node.port} linked",
                         lambda n=node: _info(n, "replication").get("master_link_status") == "up")  # type: ignore[misc]

    def node_at(self, address: Address) -> RedisServer:
        return next(n for n in self.nodes if (n.host, n.port) == address)

    def live(self) -> list[RedisServer]:
        return [n for n in self.nodes if _alive(n)]

    def owner_address(self, asking: RedisServer | None = None) -> Address | None:
        """The master serving ``{iop}``, as ``asking`` (any live node by default) sees it."""
        for node in [asking] if asking else self.live():
            try:
                slots = _ask(node, "CLUSTER", "SLOTS")
            except RedisError:
                continue
            for start, end, master, *_ in slots:
                if int(start) <= IOP_SLOT <= int(end):
                    return (master[0].decode() or node.host, int(master[1]))
        return None

    def owner_of_iop(self) -> RedisServer:
        address = self.owner_address()
        assert address is not None, "no node serves the {iop} slot"
        return self.node_at(address)

    def replica_of(self, master: RedisServer, timeout: float = 10.0) -> RedisServer:
        """A replica of ``master`` in sync with it (after a failover it takes a moment)."""
        def linked() -> RedisServer | None:
            node_id = _ask(master, "CLUSTER", "MYID").decode()
            for line in _ask(master, "CLUSTER", "NODES").decode().splitlines():
                fields = line.split()
                if fields[3] == node_id and "fail" not in fields[2]:
                    replica = self.node_at((HOST, int(fields[1].split("@")[0].rsplit(":", 1)[1])))
                    if _info(replica, "replication").get("master_link_status") == "up":
                        return replica
            return None
        return wait_for(f"a replica of {master.port} in sync", linked, timeout)

    def seed_not_owning_iop(self) -> str:
        """The URL of a live master that does not serve ``{iop}`` (with the ACL user, if any)."""
        owner = self.owner_of_iop()
        for node in self.live():
            if node is not owner and _info(node, "replication").get("role") == "master":
                if node.port in _CREDENTIALS:
                    user, password = _CREDENTIALS[node.port]
                    return node.url.replace("redis://", f"redis://{user}:{password}@", 1)
                return node.url
        raise LookupError("every live master serves {iop}")

    def kill(self, node: RedisServer) -> None:
        node.stop(kill=True)

    def wait_failover(self, old: RedisServer, timeout: float = 15.0) -> RedisServer:
        """The master that took ``{iop}`` over from ``old``, once every live node says so."""
        def settled() -> RedisServer | None:
            owners = {self.owner_address(n) for n in self.live()}
            if len(owners) != 1:
                return None
            (owner,) = owners
            if owner is None or owner == (old.host, old.port):
                return None
            node = self.node_at(owner)
            return node if all(_cluster_ok(n) for n in self.live()) else None
        return wait_for(f"a new master of {{iop}} instead of {old.port}", settled, timeout)

    def close(self) -> None:
        for node in self.nodes:
            node.close()
            _CREDENTIALS.pop(node.port, None)


class SentinelSet:
    """A master, one replica and three sentinels watching them as ``MASTER_NAME``."""

    def __init__(self, *, binary: str | None = None) -> None:
        self.binary = binary or find_redis_server()
        self.dir = tempfile.mkdtemp(prefix="iop-sentinel-")
        self.sentinels: list[tuple[int, subprocess.Popen[bytes]]] = []
        self.master = RedisServer(binary=self.binary, extra_args=FAST_SYNC)
        self.replica: RedisServer | None = None
        self.servers = [self.master]
        try:
            self.master.start()
            self.replica = RedisServer(binary=self.binary,
                                       extra_args=[*FAST_SYNC, "--replicaof", HOST, str(self.master.port)])
            self.servers.append(self.replica)
            self.replica.start()
            wait_for("the replica linked",
                     lambda: _info(self.replica, "replication").get("master_link_status") == "up")  # type: ignore[arg-type]
            # Each sentinel is told of the others and of the replica up front: discovering them
            # through hello messages takes seconds.
            ports = [free_port(HOST) for _ in range(3)]
            ids = {port: uuid.uuid4().hex + uuid.uuid4().hex[:8] for port in ports}
            for port in ports:
                self._start_sentinel(port, ids)
            wait_for("sentinels that see the replica and each other", self._sentinels_ready)
        except BaseException:
            self.close()
            raise

    @property
    def sentinel_nodes(self) -> list[str]:
        return [f"{HOST}:{port}" for port, _ in self.sentinels]

    def _start_sentinel(self, port: int, ids: dict[int, str]) -> None:
        assert self.replica is not None
        others = "".join(f"sentinel known-sentinel {MASTER_NAME} {HOST} {p} {i}\n" for p, i in ids.items() if p != port)
        conf = os.path.join(self.dir, f"sentinel-{port}.conf")
        with open(conf, "w") as f:
            f.write(
                f"port {port}\nbind {HOST}\nprotected-mode no\ndir {self.dir}\n"
                f"logfile {self.dir}/sentinel-{port}.log\n"
                f"sentinel monitor {MASTER_NAME} {HOST} {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {MASTER_NAME} 1\n"
                f"sentinel myid {ids[port]}\n{others}"
                f"sentinel known-replica {MASTER_NAME} {HOST} {self.replica.port}\n"
            )
        proc = subprocess.Popen([self.binary, conf, "--sentinel"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
        self.sentinels.append((port, proc))

    def _sentinel(self, port: int, *args: Any) -> Any:
        with Redis(host=HOST, port=port, socket_timeout=1.0, socket_connect_timeout=1.0) as client:
            return client.execute_command(*args)

    def _sentinels_ready(self) -> bool:
        for port, _ in self.sentinels:
            fields: dict[bytes, bytes] = self._sentinel(port, "SENTINEL", "MASTER", MASTER_NAME)
            if int(fields[b"num-slaves"]) < 1 or int(fields[b"num-other-sentinels"]) < 2:
                return False
        return True

    def master_address(self) -> Address | None:
        """What the sentinels agree the master is (None while they disagree or know none)."""
        answers = set()
        for port, _ in self.sentinels:
            reply = self._sentinel(port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME)
            answers.add((reply[0].decode(), int(reply[1])) if reply else None)
        return answers.pop() if len(answers) == 1 else None

    def server_at(self, address: Address) -> RedisServer:
        return next(s for s in self.servers if (s.host, s.port) == address)

    def current_master(self) -> RedisServer:
        address = wait_for("the sentinels to agree on a master", self.master_address)
        return self.server_at(address)

    def kill_master(self) -> RedisServer:
        master = self.current_master()
        master.stop(kill=True)
        return master

    def failover(self) -> RedisServer:
        """Have Sentinel promote the replica and demote the master, which stays up."""
        old = self.current_master()
        self._sentinel(self.sentinels[0][0], "SENTINEL", "FAILOVER", MASTER_NAME)
        return old

    def wait_new_master(self, old: RedisServer, timeout: float = 20.0) -> RedisServer:
        """The master the sentinels name instead of ``old``, once it says it is one."""
        def promoted() -> RedisServer | None:
            address = self.master_address()
            if address is None or address == (old.host, old.port):
                return None
            server = self.server_at(address)
            return server if _ask(server, "ROLE")[0] == b"master" else None
        return wait_for(f"a master other than {old.port}", promoted, timeout)

    def close(self) -> None:
        for _, proc in self.sentinels:
            proc.kill()
            proc.wait()
        for server in self.servers:
            server.close()
        shutil.rmtree(self.dir, ignore_errors=True)
