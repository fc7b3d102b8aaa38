"""The container stack, checked by reading it: ``compose.yaml``, ``Dockerfile``, ``.dockerignore``,
``deploy/iop.yaml`` and ``deploy/nginx.conf`` (no Docker engine needed).

Each ``check_*`` function holds the rules for one part and fails with an ``AssertionError`` saying
what is wrong. The ``test_*`` functions run them on the real files; the ``test_*_catches_*`` ones
run them on broken copies, so every rule is shown to be able to fail.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec
import pytest
import yaml

from dispatcher import config as cfg
from iop.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
DEPLOY_CONFIG = ROOT / "deploy" / "iop.yaml"
NGINX_CONF = ROOT / "deploy" / "nginx.conf"
DEMO_CONFIG = ROOT / "iop" / "demo.yaml"

APP_DIR = "/app"  # where the image holds the repo copy (Dockerfile: WORKDIR /app, COPY . /app)
API_SERVICE = "api"
LB_SERVICE = "lb"
LB_HOST_PORT = 8080
REDIS_URL = "redis://redis:6379/0"
DOCKER_DNS = "127.0.0.11"

Compose = dict[str, Any]


# --------------------------------------------------------------------------- compose helpers


def load_compose() -> Compose:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict), "compose.yaml is not a mapping"
    return data


def services(compose: Compose) -> dict[str, dict[str, Any]]:
    svcs = compose.get("services")
    assert isinstance(svcs, dict), "compose.yaml: services is not a mapping"
    assert svcs, "compose.yaml has no services"
    return svcs


def project_services(compose: Compose) -> dict[str, dict[str, Any]]:
    """Services running the project image: built here, or the same image as the api."""
    svcs = services(compose)
    assert API_SERVICE in svcs, f"no {API_SERVICE!r} service"
    api_image = svcs[API_SERVICE].get("image")
    return {
        name: svc for name, svc in svcs.items()
        if "build" in svc or (api_image is not None and svc.get("image") == api_image)
    }


def command_of(name: str, svc: dict[str, Any]) -> list[str]:
    command = svc.get("command")
    assert command, f"service {name!r} has no command (the image's entrypoint is `iop`, command is the subcommand)"
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    return argv


def parse_iop(name: str, argv: list[str]) -> Any:
    try:
        return build_parser().parse_args(argv)
    except SystemExit:
        raise AssertionError(f"service {name!r}: `iop {shlex.join(argv)}` is not a valid iop command") from None


def parsed_by_role(compose: Compose, role: str) -> dict[str, Any]:
    """Project services whose command is the iop subcommand ``role``, with their parsed arguments."""
    out = {}
    for name, svc in project_services(compose).items():
        args = parse_iop(name, command_of(name, svc))
        if args.command == role:
            out[name] = args
    return out


def repo_path(container_path: str, root: Path = ROOT) -> Path:
    """The repo file behind a path in the image (the image holds the repo copy at /app)."""
    assert container_path.startswith(APP_DIR + "/"), f"{container_path!r} is not inside the image's {APP_DIR}"
    return root / container_path[len(APP_DIR) + 1:]


def environment(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def healthcheck_text(svc: dict[str, Any]) -> str:
    test = (svc.get("healthcheck") or {}).get("test")
    if not test:
        return ""
    if isinstance(test, str):
        return test
    assert test[0] in ("CMD", "CMD-SHELL"), f"healthcheck test must start with CMD or CMD-SHELL, got {test[0]!r}"
    return " ".join(str(t) for t in test[1:])


def published_ports(svc: dict[str, Any]) -> list[tuple[int | None, int]]:
    """(host port, container port) of every ``ports`` entry, short or long syntax."""
    out: list[tuple[int | None, int]] = []
    for entry in svc.get("ports") or []:
        if isinstance(entry, dict):
            published = entry.get("published")
            out.append((int(published) if published is not None else None, int(entry["target"])))
            continue
        spec = str(entry).split("/")[0]
        parts = spec.rsplit(":", 2)
        if len(parts) == 1:
            out.append((None, int(parts[0])))
        else:
            out.append((int(parts[-2]), int(parts[-1])))
    return out


def depends_on(svc: dict[str, Any]) -> dict[str, Any]:
    deps = svc.get("depends_on") or {}
    return {d: None for d in deps} if isinstance(deps, list) else deps


def load_config(path: Path) -> cfg.Config:
    return cfg.load(path).config


# --------------------------------------------------------------------------- nginx helpers


@dataclass
class Directive:
    name: str
    args: list[str]
    block: list[Directive] | None = None

    def all(self, name: str) -> list[Directive]:
        return [d for d in self.block or [] if d.name == name]


_NGINX_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|#[^\n]*|[{};]|[^\s{};"\'#]+')


def parse_nginx(text: str) -> Directive:
    """The config as a tree of directives (the main context is a block named ``main``)."""
    tokens = [t for t in _NGINX_TOKEN.findall(text) if not t.startswith("#")]
    pos = 0

    def block() -> list[Directive]:
        nonlocal pos
        out: list[Directive] = []
        words: list[str] = []
        while pos < len(tokens):
            tok = tokens[pos]
            pos += 1
            if tok == ";":
                assert words, "nginx.conf: empty directive"
                out.append(Directive(words[0], words[1:]))
                words = []
            elif tok == "{":
                assert words, "nginx.conf: block without a name"
                out.append(Directive(words[0], words[1:], block()))
                words = []
            elif tok == "}":
                assert not words, f"nginx.conf: unterminated directive {words}"
                return out
            else:
                words.append(tok[1:-1] if tok[0] in "\"'" else tok)
        assert not words, f"nginx.conf: unterminated directive {words}"
        return out

    root = Directive("main", [], block())
    assert pos == len(tokens), "nginx.conf: unbalanced braces"
    return root


def effective(chain: list[Directive], name: str) -> list[str] | None:
    """Arguments of directive ``name`` as nginx inherits it: innermost context first."""
    for ctx in reversed(chain):
        found = ctx.all(name)
        if found:
            return found[-1].args
    return None


def nginx_seconds(value: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    total = 0.0
    for number, unit in re.findall(r"(\d+)(ms|s|m|h|d)?", value):
        total += int(number) * units[unit or "s"]
    return total


def nginx_bytes(value: str) -> int:
    match = re.fullmatch(r"(\d+)([kKmMgG]?)", value)
    assert match, f"not an nginx size: {value!r}"
    return int(match.group(1)) * {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[match.group(2).lower()]


@dataclass
class Route:
    """Where ``location /`` sends requests, as (host, port) pairs, and whether nginx re-resolves them."""

    targets: list[tuple[str, int]] = field(default_factory=list)
    dynamic: bool = False


def route_of_root(conf: Directive) -> tuple[Route, list[Directive], int]:
    """The route of ``location /``, its context chain (main, http, server, location) and the listen port."""
    http = conf.all("http")
    assert len(http) == 1, "nginx.conf needs exactly one http block"
    servers = http[0].all("server")
    roots = [(srv, loc) for srv in servers for loc in srv.all("location") if loc.args == ["/"]]
    assert len(roots) == 1, "nginx.conf needs exactly one `location /`"
    server, location = roots[0]
    listens = server.all("listen")
    assert listens, "the server with `location /` has no listen directive"
    listen_port = int(listens[0].args[0].rsplit(":", 1)[-1])
    chain = [conf, http[0], server, location]

    proxy_pass = location.all("proxy_pass")
    assert len(proxy_pass) == 1, "`location /` needs one proxy_pass"
    target = proxy_pass[0].args[0]
    route = Route()
    if "$" in target:
        # A variable: nginx resolves the name per request through `resolver`.
        for var, value in (d.args for ctx in chain[1:] for d in ctx.all("set")):
            target = target.replace(var, value)
        route.dynamic = True
    url = urlsplit(target)
    assert url.scheme == "http", f"proxy_pass {target!r}: expected http://"
    upstreams = {u.args[0]: u for u in http[0].all("upstream")}
    if url.port is None and url.hostname in upstreams:
        upstream = upstreams[url.hostname]
        for server_line in upstream.all("server"):
            host, _, port = server_line.args[0].partition(":")
            route.targets.append((host, int(port or 80)))
            if "resolve" in server_line.args[1:]:
                assert upstream.all("zone"), f"upstream {url.hostname}: `resolve` needs a `zone`"
                route.dynamic = True
    else:
        assert url.hostname is not None
        route.targets.append((url.hostname, url.port or 80))
    return route, chain, listen_port


# --------------------------------------------------------------------------- Dockerfile helpers


@dataclass
class Stage:
    image: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)


def parse_dockerfile(text: str) -> list[Stage]:
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    assert not pending, "Dockerfile ends inside a continued line"
    stages: list[Stage] = []
    for line in lines:
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "FROM":
            words = [w for w in rest.split() if not w.startswith("--")]
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
            continue
        assert stages, f"Dockerfile: {keyword} before the first FROM"
        stages[-1].instructions.append((keyword, rest))
    assert stages, "Dockerfile has no FROM"
    return stages


def _in_dir(workdir: str, path: str) -> str:
    if path in (".", "./"):
        return workdir
    if path.startswith("/"):
        return path.rstrip("/") or "/"
    return f"{workdir.rstrip('/')}/{path.rstrip('/')}"


def copied_project_dirs(stage: Stage) -> set[str]:
    """Directories a stage copies the whole build context (``.``) to."""
    workdir = "/"
    out: set[str] = set()
    for keyword, rest in stage.instructions:
        if keyword == "WORKDIR":
            workdir = _in_dir(workdir, rest)
        elif keyword == "COPY":
            words = rest.split()
            if any(w.startswith("--from") for w in words):
                continue
            *sources, dest = [w for w in words if not w.startswith("--")]
            if "." in sources or "./" in sources:
                out.add(_in_dir(workdir, dest))
    return out


def final_workdir(stage: Stage) -> str | None:
    workdirs = [rest for keyword, rest in stage.instructions if keyword == "WORKDIR"]
    return workdirs[-1] if workdirs else None


# --------------------------------------------------------------------------- .dockerignore helpers


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out += pattern[i:end + 1]
            i = end + 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out)


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether the build context leaves ``path`` out (a pattern matching it or any parent directory)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _ignore_regex(pattern.lstrip("!").strip("/"))
        if any(regex.fullmatch(p) for p in prefixes):
            ignored = not negate
    return ignored


def dockerignore_patterns(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


# --------------------------------------------------------------------------- the rules


def check_commands(compose: Compose, root: Path = ROOT) -> None:
    """Every project service runs a real iop subcommand; every --config exists in the image and is valid."""
    project = project_services(compose)
    ignore = dockerignore_patterns((root / ".dockerignore").read_text())
    roles: dict[str, int] = {}
    for name, svc in project.items():
        assert "entrypoint" not in svc, f"service {name!r} overrides the image's `iop` entrypoint"
        argv = command_of(name, svc)
        args = parse_iop(name, argv)
        roles[args.command] = roles.get(args.command, 0) + 1
        config_path = getattr(args, "config", None)
        if config_path is None:
            continue
        path = repo_path(config_path, root)
        assert path.is_file(), f"service {name!r}: --config {config_path} -> {path} does not exist"
        relative = path.relative_to(root).as_posix()
        assert not dockerignored(relative, ignore), (
            f"service {name!r}: {relative} is excluded from the image by .dockerignore"
        )
        status: int | str | None
        try:
            status = main(["config", "check", str(path)])
        except SystemExit as exc:  # a config with problems exits 2 after listing them
            status = exc.code
        assert status == 0, f"service {name!r}: `iop config check {relative}` failed (exit {status})"
    assert roles.get("api") == 1, f"expected one api service, got {roles}"
    assert roles.get("worker", 0) >= 1, f"no worker service: {roles}"
    assert roles.get("fake-provider", 0) >= 1, f"no fake-provider service: {roles}"


def stack_config_path(compose: Compose) -> Path:
    """The one config every api/worker service runs (they must agree)."""
    paths = {
        args.config for role in ("api", "worker") for args in parsed_by_role(compose, role).values()
    }
    assert len(paths) == 1, f"api and workers must run the same --config, got {sorted(paths)}"
    return repo_path(paths.pop())


def check_workers(compose: Compose, config: cfg.Config) -> None:
    workers = parsed_by_role(compose, "worker")
    nodes = [n.id for n in config.nodes]
    by_node: dict[str, list[str]] = {}
    for name, args in workers.items():
        by_node.setdefault(args.node, []).append(name)
        assert name == f"worker-{args.node}", f"service {name!r} runs node {args.node!r}: name it worker-{args.node}"
    assert sorted(by_node) == sorted(nodes), f"workers serve nodes {sorted(by_node)}, the config has {sorted(nodes)}"
    for node, names in by_node.items():
        assert len(names) == 1, f"node {node!r} has several worker services: {names} (scale one instead)"
    svcs = services(compose)
    for name in workers:
        env = environment(svcs[name])
        assert env.get("IOP_REDIS_URL") == REDIS_URL, f"{name}: IOP_REDIS_URL is {env.get('IOP_REDIS_URL')!r}"


def provider_endpoints(config: cfg.Config) -> dict[tuple[str, int], list[str]]:
    """host:port of every HTTP provider -> the served names of the providers there."""
    out: dict[tuple[str, int], list[str]] = {}
    for _, prov in config.providers():
        if not prov.base_url:
            continue
        url = urlsplit(prov.base_url)
        assert url.hostname is not None
        port = url.port or (443 if url.scheme == "https" else 80)
        names = out.setdefault((url.hostname, port), [])
        names += [m for m in prov.models if m not in names]
    return out


def check_fakes(compose: Compose, config: cfg.Config) -> None:
    fakes = parsed_by_role(compose, "fake-provider")
    endpoints = provider_endpoints(config)
    served = {(name, args.port) for name, args in fakes.items()}
    assert served == set(endpoints), (
        f"fake services listen on {sorted(served)}, the config's base_urls name {sorted(endpoints)}"
    )
    svcs = services(compose)
    for name, args in fakes.items():
        assert args.host == "0.0.0.0", f"{name}: --host {args.host} is unreachable from other containers"
        models = [m for m in args.models.split(",") if m]
        assert sorted(models) == sorted(endpoints[(name, args.port)]), (
            f"{name}: --models {models}, providers there serve {endpoints[(name, args.port)]}"
        )
        assert f":{args.port}/" in healthcheck_text(svcs[name]), f"{name}: healthcheck does not probe port {args.port}"
    # Workers start after the fakes of their node, so their first probes find them up.
    for wname, wargs in parsed_by_role(compose, "worker").items():
        node = config.node(wargs.node)
        assert node is not None
        needed = set()
        for prov in node.providers:
            if prov.base_url:
                url = urlsplit(prov.base_url)
                if url.hostname in fakes:
                    needed.add(url.hostname)
        missing = needed - set(depends_on(svcs[wname]))
        assert not missing, f"{wname} does not wait for the fakes of its node: {sorted(missing)}"


def check_ports_and_lb(compose: Compose, nginx_text: str, config: cfg.Config) -> None:
    svcs = services(compose)
    api = svcs[API_SERVICE]
    api_args = parse_iop(API_SERVICE, command_of(API_SERVICE, api))
    assert api_args.host == "0.0.0.0", f"api --host {api_args.host}: replicas must listen on all interfaces"
    assert environment(api).get("IOP_REDIS_URL") == REDIS_URL, "api: IOP_REDIS_URL"
    assert api.get("deploy", {}).get("replicas") == 2, "api: deploy.replicas must be 2"
    assert "container_name" not in api, "api: container_name prevents replicas and --scale"

    publishers = {name for name, svc in svcs.items() if svc.get("ports")}
    assert publishers == {LB_SERVICE}, f"only {LB_SERVICE} may publish host ports, got {sorted(publishers)}"

    health = healthcheck_text(api)
    assert re.search(rf"(127\.0\.0\.1|localhost):{api_args.port}/readyz\b", health), (
        f"api healthcheck must GET /readyz on port {api_args.port}: {health!r}"
    )
    assert "curl" not in health, "curl is not in python:3.11-slim"

    lb = svcs[LB_SERVICE]
    assert str(lb.get("image", "")).startswith("nginx"), "lb must be nginx"
    mounts = [str(v).split(":") for v in lb.get("volumes") or []]
    conf_mounts = [m for m in mounts if (COMPOSE.parent / m[0]).resolve() == NGINX_CONF.resolve()]
    assert conf_mounts, f"{LB_SERVICE} does not mount deploy/nginx.conf"
    assert conf_mounts[0][1] in ("/etc/nginx/nginx.conf", "/etc/nginx/conf.d/default.conf"), (
        f"deploy/nginx.conf mounted at {conf_mounts[0][1]}, where nginx does not read it"
    )
    assert healthcheck_text(lb), f"{LB_SERVICE} has no healthcheck"

    conf = parse_nginx(nginx_text)
    if conf_mounts[0][1] == "/etc/nginx/conf.d/default.conf":  # included inside http { }
        conf = Directive("main", [], [Directive("http", [], conf.block)])
    route, chain, listen_port = route_of_root(conf)
    assert route.targets == [(API_SERVICE, api_args.port)], (
        f"location / goes to {route.targets}, the api service listens on {API_SERVICE}:{api_args.port}"
    )
    resolver = effective(chain, "resolver") or []
    assert DOCKER_DNS in resolver, f"nginx must resolve replicas through Docker's DNS {DOCKER_DNS}"
    assert route.dynamic, "nginx resolves `api` once at start-up: use `server api:P resolve` or a variable"
    assert (LB_HOST_PORT, listen_port) in published_ports(lb), (
        f"{LB_SERVICE} must publish {LB_HOST_PORT} to nginx's listen port {listen_port}: {lb.get('ports')}"
    )

    # SSE: no buffering, keep-alive HTTP/1.1, X-Accel-Buffering honoured, long reads.
    assert effective(chain, "proxy_buffering") == ["off"], "location /: proxy_buffering must be off"
    assert effective(chain, "proxy_http_version") == ["1.1"], "location /: proxy_http_version must be 1.1"
    headers = {tuple(d.args) for ctx in chain for d in ctx.all("proxy_set_header")}
    assert ("Connection", "") in headers, 'location /: proxy_set_header Connection ""'
    ignored = [h.lower() for h in effective(chain, "proxy_ignore_headers") or []]
    assert "x-accel-buffering" not in ignored, "X-Accel-Buffering from iop must be honoured"
    longest_call = max((p.timeout_s for _, p in config.providers()), default=600.0)
    longest_queue = max([config.queue_timeout_ms(m) / 1000 for m in config.models] or [0.0])
    read_timeout = nginx_seconds((effective(chain, "proxy_read_timeout") or ["60s"])[0])
    assert read_timeout >= longest_call + longest_queue, (
        f"proxy_read_timeout {read_timeout}s cuts streams: providers may take {longest_call}s after "
        f"{longest_queue}s in the queue"
    )
    body = nginx_bytes((effective(chain, "client_max_body_size") or ["1m"])[0])
    assert body == 0 or body >= config.api.max_body_bytes, (
        f"client_max_body_size {body} is below api.max_body_bytes {config.api.max_body_bytes}"
    )


def check_redis(compose: Compose) -> None:
    redis = services(compose).get("redis")
    assert redis is not None, "no redis service"
    assert str(redis.get("image", "")).split(":")[0] == "redis", "redis: image must be redis"
    assert str(redis["image"]).split(":")[1].startswith("7"), "redis: image must be redis:7"
    argv = command_of("redis", redis)
    assert argv[0] == "redis-server", f"redis: command must run redis-server, got {argv[0]!r}"
    options: dict[str, str] = {}
    for i, word in enumerate(argv[1:-1], start=1):
        if word.startswith("--"):
            options[word[2:]] = argv[i + 1]
    expected = {"appendonly": "yes", "appendfsync": "everysec", "maxmemory-policy": "noeviction"}
    for key, value in expected.items():
        assert options.get(key) == value, f"redis: --{key} must be {value}, got {options.get(key)!r}"
    volumes = [str(v) for v in redis.get("volumes") or []]
    data = [v.split(":")[0] for v in volumes if v.split(":")[1:2] == ["/data"]]
    assert data, "redis: /data (the AOF) must be on a volume"
    assert data[0] in (compose.get("volumes") or {}), f"redis: volume {data[0]!r} is not declared"
    health = healthcheck_text(redis)
    assert re.search(r"\bredis-cli\b.*\bping\b", health), f"redis healthcheck must be `redis-cli ping`: {health!r}"


def check_depends_on(compose: Compose) -> None:
    svcs = services(compose)
    graph: dict[str, set[str]] = {}
    for name, svc in svcs.items():
        graph[name] = set()
        for dep, spec in depends_on(svc).items():
            assert dep in svcs, f"{name} depends on unknown service {dep!r}"
            condition = (spec or {}).get("condition")
            if "healthcheck" in svcs[dep]:
                assert condition == "service_healthy", (
                    f"{name} -> {dep}: {dep} has a healthcheck, wait for it (condition: service_healthy), "
                    f"got {condition!r}"
                )
            else:
                assert condition in ("service_started", "service_completed_successfully"), (
                    f"{name} -> {dep}: condition {condition!r} (service_healthy needs a healthcheck on {dep})"
                )
            graph[name].add(dep)

    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        if state.get(node) == "done":
            return
        assert state.get(node) != "active", f"depends_on cycle: {' -> '.join([*path, node])}"
        state[node] = "active"
        for dep in sorted(graph[node]):
            visit(dep, [*path, node])
        state[node] = "done"

    for node in sorted(graph):
        visit(node, [])

    def before(node: str) -> set[str]:
        seen: set[str] = set()
        todo = list(graph[node])
        while todo:
            dep = todo.pop()
            if dep not in seen:
                seen.add(dep)
                todo += graph[dep]
        return seen

    redis_users = [API_SERVICE, *parsed_by_role(compose, "worker")]
    for name in redis_users:
        assert "redis" in before(name), f"{name} must start after redis (depends_on, service_healthy)"
    assert API_SERVICE in before(LB_SERVICE), f"{LB_SERVICE} must start after {API_SERVICE}"
    for name in ("redis", API_SERVICE, LB_SERVICE, *parsed_by_role(compose, "fake-provider")):
        assert healthcheck_text(svcs[name]), f"{name} has no healthcheck"


def check_dockerfile(text: str) -> None:
    stages = parse_dockerfile(text)
    for stage in stages:
        assert stage.image.startswith("python:3.11"), f"FROM {stage.image}: the base must be python:3.11(-slim)"
    final = stages[-1]

    users = [rest for k, rest in final.instructions if k == "USER"]
    assert users, "the image runs as root: add a USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0", ""), f"USER {users[-1]} is root"

    entrypoints = [rest for k, rest in final.instructions if k == "ENTRYPOINT"]
    assert entrypoints, "no ENTRYPOINT"
    try:
        entrypoint = json.loads(entrypoints[-1])
    except ValueError:
        entrypoint = None
    assert entrypoint == ["iop"], f'ENTRYPOINT {entrypoints[-1]}: must be ["iop"] (exec form, so signals reach iop)'

    assert final_workdir(final) == APP_DIR, f"WORKDIR must be {APP_DIR} (compose passes {APP_DIR}/deploy/iop.yaml)"
    assert APP_DIR in copied_project_dirs(final), f"the image must copy the repo to {APP_DIR}"

    installers = []
    for index, stage in enumerate(stages):
        project_dirs = copied_project_dirs(stage)
        for keyword, rest in stage.instructions:
            if keyword != "RUN" or "pip install" not in rest:
                continue
            assert "[test" not in rest, f"pip installs test extras: {rest}"
            assert " -e " not in f" {rest} ", f"editable install in an image: {rest}"
            targets = [w for w in rest.split("pip install", 1)[1].split() if not w.startswith("-")]
            workdir = final_workdir(stage) or "/"
            if any(_in_dir(workdir, t) in project_dirs for t in targets):
                installers.append((index, stage))
    assert installers, "no RUN pip install of the copied project"
    index, stage = installers[-1]
    if stage is not final:
        froms = [rest for k, rest in final.instructions if k == "COPY" and "--from" in rest]
        assert any(f"--from={stage.name or index}" in rest for rest in froms), (
            "the project is installed in a build stage the final image never copies from"
        )


def check_dockerignore(text: str) -> None:
    patterns = dockerignore_patterns(text)
    for path in (".venv/bin/python", ".venv-servers/litellm/bin/python", ".git/HEAD", "dispatcher/__pycache__",
                 ".pytest_cache/v/cache", ".mypy_cache/3.11/x.json", ".ruff_cache/CACHEDIR.TAG"):
        assert dockerignored(path, patterns), f".dockerignore lets {path} into the build context"
    for path in ("pyproject.toml", "README.md", "lua/submit.lua", "deploy/iop.yaml", "iop/cli.py",
                 "dispatcher/config/__init__.py", "api/app.py", "workers/worker.py"):
        assert (ROOT / path).exists(), f"{path} moved: update this test"
        assert not dockerignored(path, patterns), f".dockerignore leaves out {path}, which the image needs"


# --------------------------------------------------------------------------- the real files


@pytest.fixture(scope="module")
def compose() -> Compose:
    return load_compose()


@pytest.fixture(scope="module")
def stack_config(compose: Compose) -> cfg.Config:
    return load_config(stack_config_path(compose))


def test_every_project_service_runs_a_real_iop_command_with_a_valid_config(compose: Compose) -> None:
    check_commands(compose)
    assert stack_config_path(compose) == DEPLOY_CONFIG


def test_one_worker_per_node_of_the_config(compose: Compose, stack_config: cfg.Config) -> None:
    check_workers(compose, stack_config)
    assert sorted(parsed_by_role(compose, "worker")) == ["worker-gpu-a", "worker-gpu-b"]


def test_fakes_listen_where_the_config_points(compose: Compose, stack_config: cfg.Config) -> None:
    check_fakes(compose, stack_config)
    assert sorted(parsed_by_role(compose, "fake-provider")) == ["fake-a", "fake-b", "fake-c", "fake-d"]


def test_ports_line_up_and_the_lb_routes_to_the_api(compose: Compose, stack_config: cfg.Config) -> None:
    check_ports_and_lb(compose, NGINX_CONF.read_text(), stack_config)


def test_redis_is_durable_and_never_evicts(compose: Compose) -> None:
    check_redis(compose)


def test_start_order(compose: Compose) -> None:
    check_depends_on(compose)


def test_dockerfile() -> None:
    check_dockerfile(DOCKERFILE.read_text())


def test_dockerignore() -> None:
    check_dockerignore(DOCKERIGNORE.read_text())


def test_deploy_config_is_the_demo_topology_on_compose_names() -> None:
    raw = yaml.safe_load(DEPLOY_CONFIG.read_text())
    assert "demo" not in raw, "compose runs the fakes; deploy/iop.yaml must not list demo.fake_providers"
    assert (raw.get("redis") or {}).get("url") is None, "redis.url must come from IOP_REDIS_URL, not the file"
    deploy, demo = load_config(DEPLOY_CONFIG), load_config(DEMO_CONFIG)
    assert deploy.models == demo.models
    assert deploy.queue == demo.queue
    assert [n.id for n in deploy.nodes] == [n.id for n in demo.nodes]
    for (_, got), (_, want) in zip(deploy.providers(), demo.providers(), strict=True):
        assert got.base_url, got.id
        assert want.base_url, want.id
        got_url, want_url = urlsplit(got.base_url), urlsplit(want.base_url)
        assert got_url.hostname not in ("127.0.0.1", "localhost"), f"{got.id}: {got.base_url} is the container itself"
        assert (got_url.port, got_url.path) == (want_url.port, want_url.path), f"{got.id}: {got.base_url}"
        assert msgspec.structs.replace(got, base_url=want.base_url) == want, f"{got.id} differs from the demo"


# --------------------------------------------------------------------------- the rules can fail


def _service(compose: Compose, name: str) -> dict[str, Any]:
    return services(compose)[name]


def _set_arg(compose: Compose, name: str, flag: str, value: str) -> None:
    svc = _service(compose, name)
    argv = command_of(name, svc)
    argv[argv.index(flag) + 1] = value
    svc["command"] = argv


def _drop_worker(c: Compose) -> None:
    del services(c)["worker-gpu-b"]


def _wrong_node(c: Compose) -> None:
    _set_arg(c, "worker-gpu-a", "--node", "gpu-b")


def _worker_without_redis_url(c: Compose) -> None:
    _service(c, "worker-gpu-a")["environment"] = {}


def _fake_wrong_port(c: Compose) -> None:
    _set_arg(c, "fake-a", "--port", "9111")


def _fake_missing_model(c: Compose) -> None:
    _set_arg(c, "fake-c", "--models", "qwen3.6:35b-a3b-q4_K_M")


def _fake_on_loopback(c: Compose) -> None:
    _set_arg(c, "fake-b", "--host", "127.0.0.1")


def _worker_not_waiting_for_fake(c: Compose) -> None:
    del _service(c, "worker-gpu-b")["depends_on"]["fake-d"]


@pytest.mark.parametrize(
    ("mutate", "check", "message"),
    [
        (_drop_worker, "workers", "workers serve nodes"),
        (_wrong_node, "workers", "name it worker-gpu-b"),
        (_worker_without_redis_url, "workers", "IOP_REDIS_URL"),
        (_fake_wrong_port, "fakes", "fake services listen on"),
        (_fake_missing_model, "fakes", "--models"),
        (_fake_on_loopback, "fakes", "unreachable"),
        (_worker_not_waiting_for_fake, "fakes", "does not wait for the fakes"),
    ],
)
def test_topology_rules_catch(
    compose: Compose, stack_config: cfg.Config, mutate: Callable[[Compose], None], check: str, message: str
) -> None:
    broken = copy.deepcopy(compose)
    mutate(broken)
    rule = {"workers": check_workers, "fakes": check_fakes}[check]
    with pytest.raises(AssertionError, match=re.escape(message)):
        rule(broken, stack_config)


def _move_api_to_8000(c: Compose) -> None:
    """The api and its healthcheck on 8000, nginx still on 8080."""
    _set_arg(c, API_SERVICE, "--port", "8000")
    health = _service(c, API_SERVICE)["healthcheck"]
    health["test"] = [str(t).replace(":8080/", ":8000/") for t in health["test"]]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: _set_arg(c, API_SERVICE, "--port", "8000"), "GET /readyz on port 8000"),
        (_move_api_to_8000, "location / goes to [('api', 8080)], the api service listens on api:8000"),
        (lambda c: _set_arg(c, API_SERVICE, "--host", "127.0.0.1"), "listen on all interfaces"),
        (lambda c: _service(c, API_SERVICE).update(ports=["8081:8080"]), "only lb may publish"),
        (lambda c: _service(c, LB_SERVICE).update(ports=["9090:8080"]), "must publish 8080"),
        (lambda c: _service(c, API_SERVICE).update(deploy={"replicas": 1}), "replicas must be 2"),
        (lambda c: _service(c, LB_SERVICE).update(volumes=[]), "does not mount deploy/nginx.conf"),
        (lambda c: _service(c, API_SERVICE)["healthcheck"].update(test=["CMD", "true"]), "/readyz"),
    ],
)
def test_compose_port_rules_catch(
    compose: Compose, stack_config: cfg.Config, mutate: Callable[[Compose], None], message: str
) -> None:
    broken = copy.deepcopy(compose)
    mutate(broken)
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_ports_and_lb(broken, NGINX_CONF.read_text(), stack_config)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("proxy_buffering off;", "proxy_buffering on;", "proxy_buffering must be off"),
        ("server api:8080 resolve;", "server apy:8080 resolve;", "location / goes to [('apy', 8080)]"),
        ("server api:8080 resolve;", "server api:8080;", "resolves `api` once at start-up"),
        ("resolver 127.0.0.11", "resolver 8.8.8.8", "Docker's DNS"),
        ("listen 8080;", "listen 80;", "nginx's listen port 80"),
        ("proxy_http_version 1.1;", "", "proxy_http_version must be 1.1"),
        ('proxy_set_header Connection "";', "", 'Connection ""'),
        ("proxy_read_timeout 3600s;", "proxy_read_timeout 60s;", "cuts streams"),
        ("proxy_cache off;", "proxy_ignore_headers X-Accel-Buffering;", "X-Accel-Buffering"),
        ("client_max_body_size 16m;", "", "below api.max_body_bytes"),
    ],
)
def test_nginx_rules_catch(compose: Compose, stack_config: cfg.Config, old: str, new: str, message: str) -> None:
    text = NGINX_CONF.read_text()
    assert old in text
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_ports_and_lb(compose, text.replace(old, new), stack_config)


def test_nginx_rules_accept_a_variable_proxy_pass(compose: Compose, stack_config: cfg.Config) -> None:
    """The other way to re-resolve replicas: a variable in proxy_pass, resolved per request."""
    text = NGINX_CONF.read_text().replace("proxy_pass http://iop_api;", "set $api http://api:8080;\nproxy_pass $api;")
    check_ports_and_lb(compose, text, stack_config)
    with pytest.raises(AssertionError, match="resolves `api` once"):
        check_ports_and_lb(compose, text.replace("proxy_pass $api;", "proxy_pass http://api:8080;"), stack_config)


def _redis_option(c: Compose, option: str, value: str) -> None:
    argv = command_of("redis", _service(c, "redis"))
    argv[argv.index(option) + 1] = value
    _service(c, "redis")["command"] = argv


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: _redis_option(c, "--maxmemory-policy", "allkeys-lru"), "--maxmemory-policy must be noeviction"),
        (lambda c: _redis_option(c, "--appendonly", "no"), "--appendonly must be yes"),
        (lambda c: _redis_option(c, "--appendfsync", "always"), "--appendfsync must be everysec"),
        (lambda c: _service(c, "redis").update(volumes=[]), "on a volume"),
        (lambda c: _service(c, "redis").update(image="redis:6.2"), "redis:7"),
        (lambda c: _service(c, "redis").pop("healthcheck"), "redis-cli ping"),
    ],
)
def test_redis_rules_catch(compose: Compose, mutate: Callable[[Compose], None], message: str) -> None:
    broken = copy.deepcopy(compose)
    mutate(broken)
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_redis(broken)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: _service(c, "redis").update(depends_on={LB_SERVICE: {"condition": "service_healthy"}}), "cycle"),
        (lambda c: _service(c, API_SERVICE).update(depends_on=["redis"]), "condition: service_healthy"),
        (lambda c: _service(c, API_SERVICE).pop("depends_on"), "api must start after redis"),
        (lambda c: _service(c, "worker-gpu-a")["depends_on"].pop("redis"), "worker-gpu-a must start after redis"),
        (lambda c: _service(c, LB_SERVICE).pop("depends_on"), "lb must start after api"),
        (lambda c: _service(c, "fake-a").pop("healthcheck"), "service_healthy needs a healthcheck on fake-a"),
    ],
)
def test_start_order_rules_catch(compose: Compose, mutate: Callable[[Compose], None], message: str) -> None:
    broken = copy.deepcopy(compose)
    mutate(broken)
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_depends_on(broken)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: _set_arg(c, "worker-gpu-a", "--config", "/app/deploy/missing.yaml"), "does not exist"),
        (lambda c: _set_arg(c, API_SERVICE, "--config", "/etc/iop.yaml"), "not inside the image's /app"),
        (lambda c: _set_arg(c, API_SERVICE, "--config", "/app/tests/test_compose.py"), "excluded from the image"),
        (lambda c: _service(c, "fake-a").update(command=["fake-providr", "--port", "9101"]), "not a valid iop command"),
        (lambda c: _service(c, "fake-a").update(command=["iop", "fake-provider", "--port", "9101"]), "not a valid"),
        (lambda c: _service(c, "worker-gpu-a").update(entrypoint=["python"]), "overrides the image's `iop`"),
    ],
)
def test_command_rules_catch(compose: Compose, mutate: Callable[[Compose], None], message: str) -> None:
    broken = copy.deepcopy(compose)
    mutate(broken)
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_commands(broken)


def test_command_rules_catch_an_invalid_config(compose: Compose, tmp_path: Path) -> None:
    """A repo whose deploy/iop.yaml does not pass `iop config check`."""
    (tmp_path / "deploy").mkdir()
    text = DEPLOY_CONFIG.read_text()
    assert "http://fake-a:9101" in text
    (tmp_path / "deploy" / "iop.yaml").write_text(text.replace("http://fake-a:9101", "fake-a:9101"))
    (tmp_path / ".dockerignore").write_text(DOCKERIGNORE.read_text())
    with pytest.raises(AssertionError, match=re.escape("`iop config check deploy/iop.yaml` failed (exit 2)")):
        check_commands(compose, tmp_path)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("FROM python:3.11-slim\n", "FROM python:3.12-slim\n", "python:3.11"),
        ("USER 10001:10001", "USER root", "is root"),
        ("USER 10001:10001\n", "", "runs as root"),
        ('ENTRYPOINT ["iop"]', 'ENTRYPOINT ["python", "-m", "iop"]', 'must be ["iop"]'),
        ('ENTRYPOINT ["iop"]', "ENTRYPOINT iop", "exec form"),
        ("WORKDIR /app\n", "WORKDIR /srv\n", "WORKDIR must be /app"),
        ("COPY . /app\n", "COPY deploy /app/deploy\n", "copy the repo to /app"),
        ("/opt/venv/bin/pip install /src", "/opt/venv/bin/pip install iop", "no RUN pip install of the copied"),
        ("/opt/venv/bin/pip install /src", "/opt/venv/bin/pip install '/src[test]'", "test extras"),
        ("COPY --from=build /opt/venv /opt/venv", "COPY --from=python:3.11-slim /opt/venv /opt/venv", "never copies"),
    ],
)
def test_dockerfile_rules_catch(old: str, new: str, message: str) -> None:
    text = DOCKERFILE.read_text()
    assert old in text
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_dockerfile(text.replace(old, new))


@pytest.mark.parametrize(
    ("drop", "add", "message"),
    [
        (".venv", "", ".venv/bin/python"),
        ("**/__pycache__", "", "__pycache__"),
        (".mypy_cache", "", ".mypy_cache"),
        ("", "deploy", "leaves out deploy/iop.yaml"),
        ("", "*.md", "leaves out README.md"),
        ("", "lua", "leaves out lua/submit.lua"),
    ],
)
def test_dockerignore_rules_catch(drop: str, add: str, message: str) -> None:
    lines = DOCKERIGNORE.read_text().splitlines()
    if drop:
        assert drop in lines
        lines.remove(drop)
    if add:
        lines.append(add)
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_dockerignore("\n".join(lines))
