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
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec
import pytest
import yaml

from api.auth import is_loopback
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


def host_address(entry: Any) -> str | None:
    """The host address a ``ports`` entry binds, short or long syntax; None: every interface."""
    if isinstance(entry, dict):
        address = entry.get("host_ip")
        return str(address) if address else None
    parts = str(entry).split("/")[0].rsplit(":", 2)
    return parts[0].strip("[]") if len(parts) == 3 and parts[0] else None


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


# --------------------------------------------------------------------------- monitoring helpers


MONITORING_PROFILE = "monitoring"
PROMETHEUS_IMAGE = "prom/prometheus"
GRAFANA_IMAGES = ("grafana/grafana", "grafana/grafana-oss")
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus.yml"
GRAFANA_DIR = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA_DIR / "dashboards" / "iop.json"
METRICS_SOURCE = ROOT / "api" / "metrics.py"
# What the dashboard must show (issue 14): queues, provider load and health, errors,
# latency, time to first byte, tokens, tenants and draining providers.
REQUIRED_SERIES = frozenset({
    "iop_model_queued", "iop_model_oldest_wait_seconds", "iop_queue_wait_seconds_bucket",
    "iop_provider_in_flight", "iop_provider_capacity", "iop_provider_available", "iop_provider_draining",
    "iop_requests_total", "iop_request_duration_seconds_bucket", "iop_stream_first_byte_seconds_bucket",
    "iop_tokens_total", "iop_provider_tokens_per_second", "iop_tenant_queued", "iop_tenant_in_flight",
})


@dataclass(frozen=True)
class Series:
    """A sample name /metrics can expose."""

    family: str
    kind: str  # counter | histogram | summary | gauge
    # A prometheus_client metric of the process (summed over replicas), or a family the
    # scrape-time collector reads from Redis (the same on every replica).
    per_process: bool


_METRIC_DEFINITION = re.compile(
    r"\b(Counter|Histogram|Summary|Gauge|\w*MetricFamily)\(\s*(?:name\s*=\s*)?[\"'](iop_\w+)[\"']")


def exposed_series(source: str) -> dict[str, Series]:
    """Every sample name of the metrics ``source`` (api/metrics.py) defines, as prometheus_client
    names them: counters end in ``_total``, histograms expose ``_bucket``, ``_sum`` and ``_count``."""
    out: dict[str, Series] = {}
    for ctor, name in _METRIC_DEFINITION.findall(source):
        kind = ctor.removesuffix("MetricFamily").lower() or "gauge"
        per_process = not ctor.endswith("MetricFamily")
        if kind == "counter":
            base = name.removesuffix("_total")
            samples = [f"{base}_total", f"{base}_created"]
        elif kind in ("histogram", "summary"):
            samples = [f"{name}_sum", f"{name}_count", f"{name}_created"]
            samples.append(f"{name}_bucket" if kind == "histogram" else name)
        else:
            kind = "gauge"
            samples = [name]
        for sample in samples:
            out[sample] = Series(name, kind, per_process)
    return out


def image_name(svc: dict[str, Any]) -> tuple[str, str]:
    """(repository, tag) of a service's image."""
    image = str(svc.get("image", "")).split("@")[0]
    repo, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "")
    return repo, tag


def bind_mounts(svc: dict[str, Any]) -> list[tuple[str, str]]:
    """(host path, container path) of every bind mount, short or long syntax."""
    out = []
    for entry in svc.get("volumes") or []:
        if isinstance(entry, dict):
            if entry.get("type") == "bind":
                out.append((str(entry["source"]), str(entry["target"])))
            continue
        parts = str(entry).split(":")
        if len(parts) >= 2 and parts[0].startswith((".", "/")):
            out.append((parts[0], parts[1]))
    return out


def host_path(svc: dict[str, Any], container_path: str, root: Path) -> Path | None:
    """The repo file or directory behind ``container_path`` through the service's bind mounts."""
    best: tuple[str, str] | None = None
    for source, target in bind_mounts(svc):
        target = target.rstrip("/")
        if (container_path == target or container_path.startswith(target + "/")) and (
                best is None or len(target) > len(best[1])):
            best = (source, target)
    if best is None:
        return None
    rest = container_path[len(best[1]):].lstrip("/")
    base = root / best[0]
    return base / rest if rest else base


def flag_value(argv: list[str], flag: str, default: str) -> str:
    """``--flag=value`` or ``--flag value`` of a command line."""
    for i, word in enumerate(argv):
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
        if word == flag and i + 1 < len(argv):
            return argv[i + 1]
    return default


_PROMQL_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_PROMQL_BLANKED = re.compile(r"\{[^}]*\}|\[[^\]]*\]|\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_PROMQL_WORD = re.compile(r"(?<![\w$.:])([A-Za-z_:][\w:]*)(\s*\()?")
_PROMQL_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
                              "group_left", "group_right", "inf", "nan", "Inf", "NaN"})
# What may wrap a series directly: rate-like functions for counters and histograms, an
# aggregation that does not add up replicas for the gauges every replica reports alike.
_RATE_PREFIX = re.compile(r"\b(?:rate|irate|increase)\(\s*$")
_ONE_REPLICA_PREFIX = re.compile(r"\b(?:max|min|avg)\s*(?:(?:by|without)\s*\([^()]*\)\s*)?\(\s*$")
_GRAFANA_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


def promql_series(expr: str) -> list[tuple[str, int]]:
    """The series names an expression selects, with their offsets: every identifier that is not
    a function, an aggregation, a keyword, a label or a value inside ``{}`` / ``[]``."""
    blank = _PROMQL_STRING.sub(lambda m: " " * len(m.group()), expr)
    blank = _PROMQL_BLANKED.sub(lambda m: " " * len(m.group()), blank)
    return [(m.group(1), m.start(1)) for m in _PROMQL_WORD.finditer(blank)
            if not m.group(2) and m.group(1) not in _PROMQL_KEYWORDS]


def dashboard_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    out = []
    for panel in dashboard.get("panels") or []:
        out.append(panel)
        out += panel.get("panels") or []
    return out



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

    # Services of a profile (monitoring) are opt-in; check_monitoring has their rules.
    publishers = {name for name, svc in svcs.items() if svc.get("ports") and not svc.get("profiles")}
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
    # Without caller keys anyone who reaches the API may use every model: keep it on loopback.
    if not config.api.api_keys_env and not config.api.keys:
        for entry in lb.get("ports") or []:
            assert is_loopback(host_address(entry)), (
                f"{LB_SERVICE} publishes {entry} beyond the host's loopback, and the config sets no caller keys: "
                "anyone who reaches the host could use every model (docs/DEPLOY.md, \"Opening it to the network\")"
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
            # A target may name extras: "/src[otel]".
            targets = [w.strip("'\"").split("[")[0] for w in rest.split("pip install", 1)[1].split()
                       if not w.startswith("-")]
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


def _monitoring_service(svcs: dict[str, dict[str, Any]], images: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    found = [(name, svc) for name, svc in svcs.items() if image_name(svc)[0] in images]
    assert len(found) == 1, f"expected one service running {' or '.join(images)}, got {[n for n, _ in found]}"
    return found[0]


def check_monitoring(compose: Compose, root: Path = ROOT) -> tuple[str, Path]:
    """Prometheus and Grafana behind the ``monitoring`` profile, wired to the api replicas and to
    each other through files that exist. Returns Grafana's Prometheus datasource uid and the
    dashboard directory it loads."""
    svcs = services(compose)
    prom_name, prom = _monitoring_service(svcs, (PROMETHEUS_IMAGE,))
    graf_name, graf = _monitoring_service(svcs, GRAFANA_IMAGES)
    for name, svc in ((prom_name, prom), (graf_name, graf)):
        assert svc.get("profiles") == [MONITORING_PROFILE], (
            f"{name} must run only with --profile {MONITORING_PROFILE}, has profiles {svc.get('profiles')}"
        )
        repo, tag = image_name(svc)
        assert re.fullmatch(r"v?\d+\.\d+\.\d+", tag), f"{name}: pin {repo} to a release, not {tag or 'latest'!r}"
        for entry in svc.get("ports") or []:
            assert str(entry).startswith("127.0.0.1:"), (
                f"{name} publishes {entry} beyond the host's loopback: it asks for no key"
            )
    core = [API_SERVICE, LB_SERVICE, "redis", *parsed_by_role(compose, "worker"),
            *parsed_by_role(compose, "fake-provider")]
    for name in core:
        assert not svcs[name].get("profiles"), f"{name} has profiles: plain `docker compose up` would not start it"
    for name, svc in svcs.items():
        for source, _ in bind_mounts(svc):
            assert (root / source).exists(), f"{name} mounts {source}, which does not exist"

    # Prometheus: its config file is ours, and it scrapes every api replica.
    command = prom.get("command") or []
    prom_argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    config_path = flag_value(prom_argv, "--config.file", "/etc/prometheus/prometheus.yml")
    prom_file = host_path(prom, config_path, root)
    assert prom_file is not None, f"{prom_name} reads {config_path}, which no volume mounts"
    assert prom_file.is_file(), f"{prom_name} reads {config_path}, which no volume mounts"
    prom_config = yaml.safe_load(prom_file.read_text())
    scrape_interval = check_scrape(compose, prom_config)
    prom_port = int(flag_value(prom_argv, "--web.listen-address", ":9090").rsplit(":", 1)[1])

    # Grafana: provisioned with that Prometheus and with the dashboard directory.
    env = environment(graf)
    provisioning_path = env.get("GF_PATHS_PROVISIONING", "/etc/grafana/provisioning")
    provisioning = host_path(graf, provisioning_path, root)
    missing = f"{graf_name}: nothing is mounted at its provisioning directory {provisioning_path}"
    assert provisioning is not None, missing
    assert provisioning.is_dir(), missing
    sources = [ds for f in sorted((provisioning / "datasources").glob("*.y*ml"))
               for ds in (yaml.safe_load(f.read_text()) or {}).get("datasources") or []]
    proms = [ds for ds in sources if ds.get("type") == "prometheus"]
    assert len(proms) == 1, f"{graf_name}: expected one provisioned prometheus datasource, got {len(proms)}"
    url = urlsplit(str(proms[0].get("url", "")))
    assert (url.hostname, url.port) == (prom_name, prom_port), (
        f"grafana's datasource url {proms[0].get('url')} is not the {prom_name} service ({prom_name}:{prom_port})"
    )
    uid = proms[0].get("uid")
    assert uid, "the provisioned datasource needs a fixed uid for the dashboard to name"
    time_interval = (proms[0].get("jsonData") or {}).get("timeInterval")
    assert time_interval == scrape_interval, (
        f"datasource timeInterval {time_interval!r} differs from Prometheus' scrape_interval {scrape_interval!r}: "
        "$__rate_interval would be wrong"
    )
    dirs = []
    for f in sorted((provisioning / "dashboards").glob("*.y*ml")):
        for provider in (yaml.safe_load(f.read_text()) or {}).get("providers") or []:
            path = str((provider.get("options") or {}).get("path", ""))
            found = host_path(graf, path, root)
            assert found is not None, f"{graf_name} loads dashboards from {path}, where no directory is mounted"
            assert found.is_dir(), f"{graf_name} loads dashboards from {path}, where no directory is mounted"
            dirs.append(found)
    assert dirs, f"{graf_name}: no dashboard provider in {provisioning_path}/dashboards"
    dashboards = [d for d in dirs if any(d.glob("*.json"))]
    assert dashboards, f"{graf_name}: the dashboard directories {dirs} hold no JSON dashboard"
    home = env.get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        found = host_path(graf, home, root)
        assert found is not None, f"{graf_name}: the home dashboard {home} is not mounted"
        assert found.is_file(), f"{graf_name}: the home dashboard {home} is not mounted"
    assert prom_name in depends_on(graf), f"{graf_name} must start after {prom_name}"
    return str(uid), dashboards[0]


def check_scrape(compose: Compose, prom_config: dict[str, Any]) -> str:
    """Every target is a compose service; the api replicas are found one by one. Returns the
    scrape interval."""
    svcs = services(compose)
    api_port = parse_iop(API_SERVICE, command_of(API_SERVICE, svcs[API_SERVICE])).port
    every_replica = False
    for job in prom_config.get("scrape_configs") or []:
        name = job.get("job_name")
        path = job.get("metrics_path", "/metrics")
        for static in job.get("static_configs") or []:
            for target in static.get("targets") or []:
                host = str(target).rpartition(":")[0]
                assert host in svcs, f"scrape job {name}: {host} is not a compose service"
                assert host != LB_SERVICE, f"scrape job {name} scrapes through {LB_SERVICE}: one replica per scrape"
                assert host != API_SERVICE, (
                    f"scrape job {name}: static target {target} reaches one replica per scrape; "
                    "use dns_sd_configs of type A"
                )
        for sd in job.get("dns_sd_configs") or []:
            for host in sd.get("names") or []:
                assert host in svcs, f"scrape job {name}: {host} is not a compose service"
                assert host != LB_SERVICE, f"scrape job {name} scrapes through {LB_SERVICE}: one replica per scrape"
                if host == API_SERVICE:
                    found = (sd.get("type"), sd.get("port"), path)
                    assert found == ("A", api_port, "/metrics"), (
                        f"scrape job {name}: the api replicas answer GET /metrics on port {api_port} "
                        f"(dns_sd_configs type A), not {found}"
                    )
                    every_replica = True
    assert every_replica, (
        f"no scrape job finds every api replica: dns_sd_configs type A, names [{API_SERVICE}], port {api_port}"
    )
    return str((prom_config.get("global") or {}).get("scrape_interval", "1m"))


def check_dashboard(dashboard: dict[str, Any], series: dict[str, Series], datasource_uid: str) -> None:
    """A Grafana dashboard over the series /metrics really exposes, aggregated the way each
    kind must be across replicas, on the provisioned datasource."""
    for key in ("uid", "title"):
        assert dashboard.get(key), f"dashboard: no {key}"
    assert int(dashboard.get("schemaVersion", 0)) >= 36, f"dashboard: schemaVersion {dashboard.get('schemaVersion')}"
    variables = {v.get("name"): v for v in (dashboard.get("templating") or {}).get("list") or []}
    ds_variables = {n for n, v in variables.items() if v.get("type") == "datasource" and v.get("query") == "prometheus"}
    for name in ds_variables:
        current = (variables[name].get("current") or {}).get("value")
        assert current in (None, datasource_uid), (
            f"dashboard: variable {name} defaults to {current!r}, the provisioned datasource is {datasource_uid!r}"
        )
    allowed_uids = {datasource_uid, *(f"${{{n}}}" for n in ds_variables), *(f"${n}" for n in ds_variables)}

    def check_datasource(where: str, ds: Any) -> None:
        uid = ds.get("uid") if isinstance(ds, dict) else ds
        assert uid in allowed_uids, (
            f"{where}: datasource {uid!r} is neither the provisioned {datasource_uid!r} nor a datasource variable"
        )

    for name, var in variables.items():
        if var.get("type") == "query":
            check_datasource(f"variable {name}", var.get("datasource"))
            query = var.get("query")
            text = query.get("query", "") if isinstance(query, dict) else str(query or "")
            for metric in re.findall(r"\b(iop_\w+)", text):
                assert metric in series, f"variable {name}: {metric} is not a series api/metrics.py defines"

    ids: set[int] = set()
    cells: dict[tuple[int, int], str] = {}
    used: set[str] = set()
    panels = dashboard_panels(dashboard)
    assert panels, "dashboard: no panels"
    for panel in panels:
        title = panel.get("title", "?")
        assert isinstance(panel.get("id"), int), f"panel {title!r}: id missing or repeated"
        assert panel["id"] not in ids, f"panel {title!r}: id missing or repeated"
        ids.add(panel["id"])
        pos = panel.get("gridPos") or {}
        assert all(isinstance(pos.get(k), int) for k in "hwxy"), f"panel {title!r}: gridPos {pos}"
        assert min(pos["w"], pos["h"]) > 0, f"panel {title!r}: gridPos {pos} is empty"
        assert 0 <= pos["x"] <= 24 - pos["w"], f"panel {title!r}: gridPos {pos} is outside the 24 columns"
        if panel.get("type") == "row":
            continue
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"panel {title!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = title
        check_datasource(f"panel {title!r}", panel.get("datasource"))
        targets = panel.get("targets") or []
        assert targets, f"panel {title!r}: no queries"
        ref_ids = [t.get("refId") for t in targets]
        assert all(ref_ids), f"panel {title!r}: refIds {ref_ids}"
        assert len(set(ref_ids)) == len(ref_ids), f"panel {title!r}: refIds {ref_ids}"
        for target in targets:
            expr = str(target.get("expr") or "")
            where = f"panel {title!r} ({target.get('refId')})"
            assert expr.strip(), f"{where}: empty expr"
            if "datasource" in target:
                check_datasource(where, target["datasource"])
            check_expr(where, expr, series, set(variables))
            used.update(name for name, _ in promql_series(expr))
    missing = sorted(REQUIRED_SERIES - used)
    assert not missing, f"dashboard: no panel shows {missing}"


def check_expr(where: str, expr: str, series: dict[str, Series], variables: set[str]) -> None:
    for groups in _GRAFANA_VARIABLE.findall(expr):
        name = next(g for g in groups if g)
        assert name.startswith("__") or name in variables, f"{where}: ${name} is not a dashboard variable"
    found = promql_series(expr)
    assert found, f"{where}: {expr!r} selects no series"
    for name, offset in found:
        known = series.get(name)
        assert known is not None, f"{where}: {name} is not a series api/metrics.py defines"
        before = expr[:offset]
        if known.kind in ("counter", "histogram", "summary") and not name.endswith("_created"):
            assert _RATE_PREFIX.search(before), f"{where}: {name} is a counter: take its rate() or increase()"
        if known.kind == "gauge" and not known.per_process:
            assert _ONE_REPLICA_PREFIX.search(before), (
                f"{where}: every replica reports {name} alike: aggregate it with max by (...), "
                "a sum over replicas counts it once per replica"
            )
        if name.endswith("_bucket"):
            quantile = "histogram_quantile(" in expr and re.search(r"\bby\s*\([^)]*\ble\b", expr)
            assert quantile, f"{where}: {name} needs histogram_quantile over sum by (le, ...)"


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


@pytest.fixture(scope="module")
def series() -> dict[str, Series]:
    return exposed_series(METRICS_SOURCE.read_text())


def test_series_read_from_the_source_are_those_prometheus_client_exposes(series: dict[str, Series]) -> None:
    """The per-process metrics as the registry names them, and the collector's gauges as families."""
    from api.metrics import RequestMetrics

    families = list(RequestMetrics().registry.collect())
    assert families
    for family in families:
        sample = {"counter": "_total", "histogram": "_bucket"}.get(family.type, "")
        assert family.name + sample in series, family.name
        assert series[family.name + sample].per_process
    assert {s.family for s in series.values() if s.per_process} == {f.name for f in families}
    assert "iop_requests" not in series  # a counter is only exposed with _total
    for gauge in ("iop_provider_in_flight", "iop_model_queued", "iop_tenant_queued"):
        assert series[gauge] == Series(gauge, "gauge", per_process=False)


def test_monitoring_profile(compose: Compose) -> None:
    uid, dashboards = check_monitoring(compose)
    assert dashboards.resolve() == DASHBOARD.parent.resolve()
    assert uid == "iop-prometheus"


def test_dashboard_shows_real_series(compose: Compose, series: dict[str, Series]) -> None:
    uid, _ = check_monitoring(compose)
    check_dashboard(json.loads(DASHBOARD.read_text()), series, uid)


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


def test_lb_publishes_on_loopback(compose: Compose) -> None:
    assert [host_address(entry) for entry in services(compose)[LB_SERVICE]["ports"]] == ["127.0.0.1"]


@pytest.mark.parametrize("ports", [
    ["8080:8080"], ["0.0.0.0:8080:8080"], ["192.0.2.2:8080:8080"], ["[::]:8080:8080"], ["8080:8080/tcp"],
    [{"target": 8080, "published": 8080}], [{"target": 8080, "published": "8080", "host_ip": "0.0.0.0"}],
    ["127.0.0.1:8080:8080", "8080:8080"],
])
def test_an_open_api_is_published_on_loopback_only(
    compose: Compose, stack_config: cfg.Config, ports: list[Any]
) -> None:
    opened = copy.deepcopy(compose)
    _service(opened, LB_SERVICE)["ports"] = ports
    with pytest.raises(AssertionError, match="beyond the host's loopback, and the config sets no caller keys"):
        check_ports_and_lb(opened, NGINX_CONF.read_text(), stack_config)
    # With caller keys the operator may open it.
    keyed = msgspec.structs.replace(stack_config, api=msgspec.structs.replace(stack_config.api,
                                                                             api_keys_env="IOP_API_KEYS"))
    check_ports_and_lb(opened, NGINX_CONF.read_text(), keyed)


@pytest.mark.parametrize("ports", [["127.0.0.1:8080:8080"], ["[::1]:8080:8080"], ["127.0.0.2:8080:8080/tcp"],
                                   [{"target": 8080, "published": 8080, "host_ip": "127.0.0.1"}]])
def test_loopback_publishes_pass(compose: Compose, stack_config: cfg.Config, ports: list[Any]) -> None:
    loopback = copy.deepcopy(compose)
    _service(loopback, LB_SERVICE)["ports"] = ports
    check_ports_and_lb(loopback, NGINX_CONF.read_text(), stack_config)


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
        ('/opt/venv/bin/pip install "/src[otel]"', "/opt/venv/bin/pip install iop", "no RUN pip install of the copied"),
        ('/opt/venv/bin/pip install "/src[otel]"', "/opt/venv/bin/pip install '/src[test]'", "test extras"),
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


# --- monitoring


def _monitoring_mount(c: Compose, name: str, index: int, value: str) -> None:
    _service(c, name)["volumes"][index] = value


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: _service(c, "prometheus").pop("profiles"), "prometheus must run only with --profile monitoring"),
        (lambda c: _service(c, API_SERVICE).update(profiles=["monitoring"]), "api has profiles"),
        (lambda c: _service(c, "grafana").update(image="grafana/grafana:latest"), "pin grafana/grafana to a release"),
        (lambda c: _service(c, "grafana").update(image="grafana/grafana"), "not 'latest'"),
        (lambda c: _service(c, "prometheus").update(ports=["9090:9090"]), "beyond the host's loopback"),
        (lambda c: _service(c, API_SERVICE).update(ports=["127.0.0.1:8081:8080"]), None),
        (lambda c: _monitoring_mount(c, "prometheus", 0, "./deploy/prometheus.yaml:/etc/prometheus/prometheus.yml:ro"),
         "mounts ./deploy/prometheus.yaml, which does not exist"),
        (lambda c: _monitoring_mount(c, "prometheus", 0, "./deploy/prometheus.yml:/etc/prometheus/other.yml:ro"),
         "reads /etc/prometheus/prometheus.yml, which no volume mounts"),
        (lambda c: _monitoring_mount(c, "grafana", 1, "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro"),
         "loads dashboards from /etc/grafana/dashboards/iop, where no directory is mounted"),
        (lambda c: _monitoring_mount(c, "grafana", 0, "./deploy/grafana:/etc/grafana/provisioning:ro"),
         "expected one provisioned prometheus datasource, got 0"),
        (lambda c: _service(c, "grafana").pop("depends_on"), "grafana must start after prometheus"),
        (lambda c: services(c).pop("prometheus"), "expected one service running prom/prometheus"),
        (lambda c: _service(c, "prometheus").update(command=["--config.file=/etc/prometheus/p.yml"]),
         "reads /etc/prometheus/p.yml, which no volume mounts"),
    ],
)
def test_monitoring_rules_catch(compose: Compose, mutate: Callable[[Compose], None], message: str | None) -> None:
    broken = copy.deepcopy(compose)
    mutate(broken)
    if message is None:  # a core service publishing is check_ports_and_lb's business
        check_monitoring(broken)
        return
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_monitoring(broken)


@pytest.mark.parametrize(
    ("file", "old", "new", "message"),
    [
        ("prometheus.yml", "names: [api]", "names: [lb]", "scrapes through lb"),
        ("prometheus.yml", "names: [api]", "names: [apii]", "apii is not a compose service"),
        ("prometheus.yml", "port: 8080", "port: 8000", "answer GET /metrics on port 8080"),
        ("prometheus.yml", "type: A", "type: SRV", "answer GET /metrics on port 8080"),
        ("prometheus.yml", "    metrics_path: /metrics\n", "    metrics_path: /prometheus\n", "GET /metrics"),
        ("prometheus.yml", "    dns_sd_configs:\n      - names: [api]",
         "    static_configs:\n      - targets: ['api:8080']\n    dns_sd_configs:\n      - names: [redis]",
         "static target api:8080 reaches one replica per scrape"),
        ("prometheus.yml", '["prometheus:9090"]', '["promethus:9090"]', "promethus is not a compose service"),
        ("prometheus.yml", "scrape_interval: 10s", "scrape_interval: 15s", "differs from Prometheus' scrape_interval"),
        ("grafana/provisioning/datasources/prometheus.yaml", "http://prometheus:9090", "http://prometheus:9091",
         "is not the prometheus service (prometheus:9090)"),
        ("grafana/provisioning/datasources/prometheus.yaml", "    uid: iop-prometheus\n", "", "a fixed uid"),
        ("grafana/provisioning/dashboards/iop.yaml", "path: /etc/grafana/dashboards/iop",
         "path: /etc/grafana/dashboards/other", "where no directory is mounted"),
    ],
)
def test_monitoring_file_rules_catch(compose: Compose, tmp_path: Path, file: str, old: str, new: str,
                                     message: str) -> None:
    shutil.copytree(ROOT / "deploy", tmp_path / "deploy")
    path = tmp_path / "deploy" / file
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_monitoring(compose, tmp_path)


def test_monitoring_rules_catch_an_empty_dashboard_directory(compose: Compose, tmp_path: Path) -> None:
    shutil.copytree(ROOT / "deploy", tmp_path / "deploy")
    (tmp_path / "deploy" / "grafana" / "dashboards" / "iop.json").rename(tmp_path / "iop.json")
    with pytest.raises(AssertionError, match="hold no JSON dashboard"):
        check_monitoring(compose, tmp_path)


# The dashboard rules on their own: the real series, plus the three being added alongside this
# dashboard (token usage, drain) in case api/metrics.py does not define them yet. Once it does,
# its definitions win; test_dashboard_shows_real_series never uses these.
_ALONGSIDE = {
    "iop_tokens_total": Series("iop_tokens", "counter", per_process=True),
    "iop_provider_tokens_per_second": Series("iop_provider_tokens_per_second", "gauge", per_process=False),
    "iop_provider_draining": Series("iop_provider_draining", "gauge", per_process=False),
}


def _edit_panel(title: str, edit: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def mutate(d: dict[str, Any]) -> None:
        edit(next(p for p in dashboard_panels(d) if p.get("title") == title))
    return mutate


def _drop_panels_with(name: str) -> Callable[[dict[str, Any]], None]:
    def mutate(d: dict[str, Any]) -> None:
        d["panels"] = [p for p in d["panels"] if name not in json.dumps(p)]
    return mutate


def _set_expr(title: str, expr: str) -> Callable[[dict[str, Any]], None]:
    return _edit_panel(title, lambda p: p["targets"][0].update(expr=expr))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_set_expr("Queue depth per model", 'max by (model) (iop_model_queue{model=~"$model"})'),
         "iop_model_queue is not a series api/metrics.py defines"),
        (_set_expr("Requests/s", "sum(rate(iop_requests[5m]))"), "iop_requests is not a series"),
        (_set_expr("Queue depth per model", "sum by (model) (iop_model_queued)"), "aggregate it with max by"),
        (_set_expr("In flight per tenant", "sum(iop_tenant_in_flight) by (tenant)"), "aggregate it with max by"),
        (_set_expr("Queue depth per model", "iop_model_queued"), "aggregate it with max by"),
        (_set_expr("Requests/s", "sum(iop_requests_total)"), "iop_requests_total is a counter: take its rate()"),
        (_set_expr("Tokens/s", "sum(iop_tokens_total)"), "iop_tokens_total is a counter"),
        (_set_expr("Queue wait p50 / p95 per model",
                   "histogram_quantile(0.5, sum by (model) (rate(iop_queue_wait_seconds_bucket[5m])))"),
         "needs histogram_quantile over sum by (le, ...)"),
        (_set_expr("Queue wait p50 / p95 per model", "sum by (le) (rate(iop_queue_wait_seconds_bucket[5m]))"),
         "needs histogram_quantile"),
        (_set_expr("Queue depth per model", 'max by (model) (iop_model_queued{model=~"$modle"})'),
         "$modle is not a dashboard variable"),
        (_set_expr("Queue depth per model", 'max by (model) (iop_model_queued{model=~"${modle}"})'),
         "$modle is not a dashboard variable"),
        (_set_expr("Queue depth per model", "  "), "empty expr"),
        (_set_expr("Queue depth per model", "vector(1)"), "selects no series"),
        (_edit_panel("Queue depth per model", lambda p: p.update(datasource={"type": "prometheus", "uid": "prom"})),
         "datasource 'prom' is neither the provisioned"),
        (_edit_panel("Queue depth per model", lambda p: p["targets"][0].update(datasource={"uid": "${DS_PROM}"})),
         "datasource '${DS_PROM}' is neither"),
        (_edit_panel("Queue depth per model", lambda p: p.update(id=1)), "id missing or repeated"),
        (_edit_panel("Oldest wait per model", lambda p: p["gridPos"].update(x=4)), "overlaps 'Queue depth per model'"),
        (_edit_panel("Oldest wait per model", lambda p: p["gridPos"].update(x=20)), "outside the 24 columns"),
        (_edit_panel("In flight vs capacity per provider", lambda p: p.update(targets=[])), "no queries"),
        (_edit_panel("In flight vs capacity per provider", lambda p: p["targets"][1].update(refId="A")), "refIds"),
        (_drop_panels_with("iop_provider_draining"), "no panel shows ['iop_provider_draining']"),
        (_drop_panels_with("iop_tokens_total"), "no panel shows ['iop_tokens_total']"),
        (lambda d: d["templating"]["list"][0]["current"].update(value="other"), "defaults to 'other'"),
        (lambda d: d["templating"]["list"][1]["query"].update(query="label_values(iop_model_q, model)"),
         "variable model: iop_model_q is not a series"),
        (lambda d: d.pop("schemaVersion"), "schemaVersion"),
        (lambda d: d.pop("uid"), "dashboard: no uid"),
    ],
)
def test_dashboard_rules_catch(series: dict[str, Series], mutate: Callable[[dict[str, Any]], None],
                               message: str) -> None:
    known = {**_ALONGSIDE, **series}
    dashboard = json.loads(DASHBOARD.read_text())
    check_dashboard(copy.deepcopy(dashboard), known, "iop-prometheus")
    mutate(dashboard)
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_dashboard(dashboard, known, "iop-prometheus")


def test_promql_series_skips_functions_labels_and_keywords() -> None:
    expr = ('histogram_quantile(0.95, sum by (le, model) (rate(iop_x_bucket{status=~"5..", model=~"$m"}'
            '[$__rate_interval]))) / on (model) group_left max without (node) (iop_y offset 5m) > bool 0 and iop_z')
    assert [name for name, _ in promql_series(expr)] == ["iop_x_bucket", "iop_y", "iop_z"]
