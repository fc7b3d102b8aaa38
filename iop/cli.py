"""``iop``: the command line.

    iop up [--config FILE]                 everything on one machine (embedded Redis if none is set)
    iop api --config FILE [--host H] [--port P] [--workers N]
    iop worker --config FILE --node NODE_ID
    iop config check FILE
    iop config migrate FILE                print the pool-shape equivalent of a legacy-shape config
    iop catalog [--url URL] [--json]       --url: the API's base URL ($IOP_URL, else http://127.0.0.1:8080)
    iop reload [--port P | --pid PID]      make a running iop read its config file again (SIGHUP)
    iop provider drain ID [--wait]         stop new dispatch to a provider; --wait: until its jobs are done
    iop provider resume ID                 let it take jobs again
    iop provider disable ID [--for D]      no new dispatch to it anywhere (an override; D: 90s, 15m, 1h, 2d)
    iop provider enable ID                 clear that override
    iop provider capacity ID N [--for D]   override its capacity; --min A --max B: the bounds of capacity: auto;
                                           --clear: back to the config's
    iop provider load|unload ID MODEL      load / unload a served model on a managed provider
    iop model fallbacks ID A,B [--for D]   override a model's fallbacks (--clear: the config's)
    iop model prefer ID P1,P2 [--for D]    its providers P1, P2 first while they have a free slot (--clear)
    iop overrides [--json]                 every override in force: who set it, until when
    iop audit [--since D|MS] [--limit N]   the control actions, newest first
    iop fake-provider --port P [--delay-ms D] [--tokens N] [--token-interval-ms T]
                      [--models a,b] [--max-loaded K] [--load-ms L] [--keep-alive-s S]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from dispatcher import config as cfg
from dispatcher.exceptions import ConfigError
from iop.control_cli import audit_limit, capacity, parse_duration, since_ms
from iop.logs import FORMATS

DEMO_CONFIG = Path(__file__).resolve().parent / "demo.yaml"
# Where the client commands (catalog, qualify, provider) find a running iop without --url:
# an `iop up --port 9090` is then one `export IOP_URL=http://127.0.0.1:9090` away.
URL_ENV = "IOP_URL"
DEFAULT_URL = "http://127.0.0.1:8080"
PROVIDER_ID_HELP = "the provider id (nodes[].providers[].id)"


def _add_url(parser: argparse.ArgumentParser) -> None:
    # Read when the parser is built, which is when the command runs.
    parser.add_argument("--url", default=os.environ.get(URL_ENV) or DEFAULT_URL,
                        help=f"the API's base URL (default: ${URL_ENV}, else {DEFAULT_URL})")


def _load(path: str) -> cfg.Config:
    try:
        loaded = cfg.load(path)
    except ConfigError as exc:
        _exit_with_problems(path, exc)
    return loaded.logged()


def _exit_with_problems(path: str, exc: ConfigError) -> NoReturn:
    print(f"{path}: {len(exc.problems)} problem(s)", file=sys.stderr)
    for problem in exc.problems:
        print(f"  {problem}", file=sys.stderr)
    raise SystemExit(2) from None


def _exit_unless_redis_answers(config: cfg.Config) -> None:
    from iop.redis_reach import unreachable

    problem = unreachable(config.redis)
    if problem is not None:
        print(problem, file=sys.stderr)
        raise SystemExit(1)


def cmd_config_check(args: argparse.Namespace) -> int:
    try:
        config, warnings = cfg.load(args.file)
    except ConfigError as exc:
        _exit_with_problems(args.file, exc)
    if warnings:
        print(f"{args.file}: {len(warnings)} warning(s)", file=sys.stderr)
        for warning in warnings:
            print(f"  {warning}", file=sys.stderr)
    providers = list(config.providers())
    capacity = sum(p.fixed_capacity for _, p in providers if not p.auto)
    learning = sum(1 for _, p in providers if p.auto)
    print(f"{args.file}: OK - {len(config.models)} model(s), {len(config.nodes)} node(s), "
          f"{len(providers)} provider(s), total capacity {capacity}"
          + (f" + {learning} learning theirs (capacity: auto)" if learning else ""))
    for model in config.models:
        pool = ", ".join(f"{pid} -> {served}" for pid, served in model.providers.items())
        print(f"  {model.id}: {pool} (max_queue {config.max_queue(model)}, "
              f"queue_timeout_ms {config.queue_timeout_ms(model)})")
    return 0


def cmd_config_migrate(args: argparse.Namespace) -> int:
    from iop.migrate import migrate

    try:
        text = migrate(args.file)
    except ConfigError as exc:
        _exit_with_problems(args.file, exc)
    sys.stdout.write(text)
    return 0


def cmd_api(args: argparse.Namespace) -> int:
    from iop.serve import serve_api

    config = _load(args.config)  # report config problems here, not in every server process
    _exit_unless_redis_answers(config)
    serve_api(config, args.config, host=args.host, port=args.port, workers=args.workers, log_level=args.log_level,
              log_format=args.log_format)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from iop.serve import serve_worker

    config = _load(args.config)
    if config.node(args.node) is None:
        known = ", ".join(n.id for n in config.nodes) or "none"
        print(f"{args.config}: no node {args.node!r} (nodes: {known})", file=sys.stderr)
        return 2
    _exit_unless_redis_answers(config)
    serve_worker(config, args.node, log_level=args.log_level, log_format=args.log_format,
                 config_path=os.path.abspath(args.config))
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from iop.up import run_up

    config_path = args.config or str(DEMO_CONFIG)
    config = _load(config_path)
    if args.log_format:
        os.environ["IOP_LOG_FORMAT"] = args.log_format  # its API and workers inherit it
    return run_up(config, config_path, host=args.host, port=args.port, api_workers=args.api_workers)


def cmd_fake_provider(args: argparse.Namespace) -> int:
    from iop.fake_provider import FakeOptions, run

    options = FakeOptions(
        delay_ms=args.delay_ms,
        tokens=args.tokens,
        token_interval_ms=args.token_interval_ms,
        models=[m for m in args.models.split(",") if m] if args.models else ["fake-model"],
        api_key=os.environ.get(args.api_key_env) if args.api_key_env else None,
        parallel=args.parallel,
        word=args.word,
        max_loaded=args.max_loaded,
        load_ms=args.load_ms,
        keep_alive_s=args.keep_alive_s,
    )
    run(args.host, args.port, options)
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 1")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text}: must not be negative")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"{text}: must be a non-negative number")
    return value


def cmd_catalog(args: argparse.Namespace) -> int:
    from iop.catalog_cli import main as catalog_main

    return catalog_main(args.url, args.json, args.key_env, args.colour)


def cmd_qualify(args: argparse.Namespace) -> int:
    from iop.qualify.run import main as qualify_main

    return qualify_main(args)


def cmd_provider(args: argparse.Namespace) -> int:
    from iop.provider_cli import main as provider_main

    return provider_main(args.provider_command, args.provider_id, args.url, os.environ.get(args.key_env),
                         wait=getattr(args, "wait", False), wait_timeout=getattr(args, "wait_timeout", None),
                         as_json=args.json)


def cmd_control(args: argparse.Namespace) -> int:
    from iop.control_cli import main as control_main

    return control_main(args, os.environ.get(args.key_env), usage_error=args.usage_error)


def _add_client(parser: argparse.ArgumentParser, control: str) -> None:
    """What every runtime-control command takes, and where it goes."""
    _add_url(parser)
    parser.add_argument("--key-env", default="IOP_ADMIN_KEY", help="env var holding an admin key, if one is needed")
    parser.add_argument("--json", action="store_true", help="print the raw JSON")
    # usage_error: argparse's own, for combinations it cannot check (capacity N with --clear).
    parser.set_defaults(func=cmd_control, control=control, usage_error=parser.error)


def _add_for(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--for", dest="for_s", type=parse_duration, metavar="DURATION",
                        help="the override lapses by itself after this: 90s, 15m, 1h, 2d, or seconds "
                        "(default: until cleared)")


def cmd_reload(args: argparse.Namespace) -> int:
    from iop.reload_target import config_file, process_at
    from iop.up import pid_file

    stale = ""
    if args.pid is not None:
        pid = args.pid
    else:
        path = pid_file(args.port)
        try:
            pid = int(path.read_text().strip())
        except (OSError, ValueError):
            print(f"no `iop up` on port {args.port} ({path} is missing or unreadable); "
                  "use --pid with an `iop up`, `iop api` or `iop worker` process", file=sys.stderr)
            return 2
        stale = f" ({path} is left from an `iop up` that is gone?)"
    try:
        found = process_at(pid)
    except FileNotFoundError:
        print(f"no process {pid}{stale}; nothing sent", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"cannot tell what process {pid} is (/proc/{pid}: {exc.strerror}); nothing sent", file=sys.stderr)
        return 2
    if found.command is None:
        # SIGHUP would most likely end it: the default action of a process that does not catch it.
        print(f"process {pid} is not an `iop up`, `iop api` or `iop worker`{stale}: {found}; nothing sent",
              file=sys.stderr)
        return 2
    # The file is checked here, where the operator sees the answer: a process sent SIGHUP
    # over a broken file keeps its config and says why only in its own log.
    try:
        config_path = config_file(pid, found, DEMO_CONFIG)
    except OSError as exc:
        print(f"cannot tell which config file process {pid} reads ({exc.strerror}); nothing sent", file=sys.stderr)
        return 2
    if config_path is None:
        print(f"cannot tell which config file process {pid} reads: its command line has no --config; "
              "nothing sent", file=sys.stderr)
        return 2
    try:
        _, warnings = cfg.load(config_path)
    except ConfigError as exc:
        print(f"{config_path}: {len(exc.problems)} problem(s); nothing sent (process {pid} keeps its config)",
              file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return 2
    for warning in warnings:
        print(f"{config_path}: warning: {warning}", file=sys.stderr)
    try:
        os.kill(pid, signal.SIGHUP)
    except OSError as exc:
        print(f"could not signal process {pid}: {exc.strerror}", file=sys.stderr)
        return 2
    print(f"sent SIGHUP to {pid} (iop {found.command}): it reads {config_path} again, which has no problems "
          "(its log says what changed)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iop", description="One OpenAI-compatible API over a pool of LLM providers.")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run Redis (embedded unless IOP_REDIS_URL is set), API, workers, fake providers")
    up.add_argument("--config", help="config file (default: the bundled demo config)")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8080)
    up.add_argument("--api-workers", type=int, default=1, help="API processes")
    up.add_argument("--log-format", choices=FORMATS, help="text (default) or json: one object per line")
    up.set_defaults(func=cmd_up)

    api = sub.add_parser("api", help="run API processes")
    api.add_argument("--config", required=True)
    api.add_argument("--host", default="127.0.0.1")
    api.add_argument("--port", type=int, default=8080)
    api.add_argument("--workers", type=int, default=1, help="API processes sharing the port")
    api.add_argument("--log-level", default="info")
    api.add_argument("--log-format", choices=FORMATS, help="text (default) or json: one object per line")
    api.set_defaults(func=cmd_api)

    worker = sub.add_parser("worker", help="run one node's worker")
    worker.add_argument("--config", required=True)
    worker.add_argument("--node", required=True, help="the node id (nodes[].id) this worker serves")
    worker.add_argument("--log-level", default="info")
    worker.add_argument("--log-format", choices=FORMATS, help="text (default) or json: one object per line")
    worker.set_defaults(func=cmd_worker)

    config = sub.add_parser("config", help="config tools")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser("check", help="validate a config file, listing every problem")
    check.add_argument("file")
    check.set_defaults(func=cmd_config_check)
    migrate = config_sub.add_parser(
        "migrate", help="print the pool-shape (models[], nodes[].providers[]) equivalent of a legacy-shape config"
    )
    migrate.add_argument("file")
    migrate.set_defaults(func=cmd_config_migrate)

    catalog = sub.add_parser("catalog", help="show the provider catalog of a running iop")
    _add_url(catalog)
    catalog.add_argument("--json", action="store_true", help="print the raw JSON")
    catalog.add_argument("--key-env", default="IOP_ADMIN_KEY", help="env var holding an admin key, if one is needed")
    catalog.add_argument("--colour", "--color", dest="colour", action=argparse.BooleanOptionalAction, default=None,
                         help="colour the health column (default: when printing to a terminal)")
    catalog.set_defaults(func=cmd_catalog)

    qualify = sub.add_parser("qualify", help="benchmark, lifecycle-check and compare a model's providers "
                             "through a running iop (docs/QUALIFY.md)")
    _add_url(qualify)
    qualify.add_argument("--model", required=True, help="the model id (models[].id)")
    qualify.add_argument("--provider", action="append", help="only this provider (repeatable; default: all)")
    qualify.add_argument("--json", action="store_true", help="print the report as stored (GET /qualifications/M)")
    qualify.add_argument("--markdown", action="store_true", help="print the report as Markdown")
    qualify.add_argument("--prompts", help="a JSON file of more agreement prompts: [{id, messages}, ...]")
    qualify.add_argument("--max-tokens", type=int, default=64, help="completion tokens per benchmark request")
    qualify.add_argument("--requests", type=int, default=8,
                         help="benchmark requests per concurrency step (at least twice the concurrency)")
    qualify.add_argument("--max-concurrency", type=int, help="stop the sweep here (it stops at the run's share anyway)")
    qualify.add_argument("--lifecycle-delete", action="store_true",
                         help="check delete too, with an empty call that deletes nothing")
    qualify.add_argument("--key-env", default="IOP_ADMIN_KEY", help="env var holding an admin key, if one is needed")
    qualify.set_defaults(func=cmd_qualify)

    provider = sub.add_parser("provider", help="runtime control of a provider of a running iop (admin endpoints): "
                              "drain, resume, disable, enable, capacity, load, unload")
    provider_sub = provider.add_subparsers(dest="provider_command", required=True)
    for action, text in (("drain", "stop new dispatch to the provider, fleet-wide; its running jobs finish"),
                         ("resume", "let a drained provider take jobs again")):
        one = provider_sub.add_parser(action, help=text)
        one.add_argument("provider_id", metavar="ID", help="the provider id (nodes[].providers[].id)")
        _add_url(one)
        one.add_argument("--key-env", default="IOP_ADMIN_KEY", help="env var holding an admin key, if one is needed")
        one.add_argument("--json", action="store_true", help="print the raw JSON")
        if action == "drain":
            one.add_argument("--wait", action="store_true", help="return once nothing runs on it any more (drained)")
            one.add_argument("--wait-timeout", type=float, metavar="S", help="give up waiting after S seconds (exit 3)")
        one.set_defaults(func=cmd_provider)

    # Overrides over the config, kept in Redis and applied fleet-wide (iop/control_cli.py).
    disable = provider_sub.add_parser("disable", help="no new dispatch to the provider anywhere, until enabled or "
                                      "--for lapses; its running requests finish")
    disable.add_argument("id", metavar="ID", help=PROVIDER_ID_HELP)
    _add_for(disable)
    _add_client(disable, "disable")
    enable = provider_sub.add_parser("enable", help="clear a disable")
    enable.add_argument("id", metavar="ID", help=PROVIDER_ID_HELP)
    _add_client(enable, "enable")
    fixed = provider_sub.add_parser(
        "capacity", help="override the provider's capacity (N), or the bounds of its capacity: auto "
        "(--min A --max B); --clear: back to the config's")
    fixed.add_argument("id", metavar="ID", help=PROVIDER_ID_HELP)
    fixed.add_argument("capacity", metavar="N", nargs="?", type=capacity, help="a fixed capacity")
    fixed.add_argument("--min", type=capacity, metavar="A", help="lower bound of capacity: auto")
    fixed.add_argument("--max", type=capacity, metavar="B", help="upper bound of capacity: auto")
    fixed.add_argument("--clear", action="store_true", help="drop the capacity override (N or bounds)")
    _add_for(fixed)
    _add_client(fixed, "capacity")
    for action, text in (("load", "load a model on a managed provider (its runtime's own API); answers at once"),
                         ("unload", "unload a model from a managed provider; answers at once")):
        one = provider_sub.add_parser(action, help=text)
        one.add_argument("id", metavar="ID", help=PROVIDER_ID_HELP)
        one.add_argument("model", metavar="MODEL", help="the served name, as the provider knows it "
                         "(nodes[].providers[].models)")
        _add_client(one, action)

    model = sub.add_parser("model", help="runtime control of a model of a running iop (admin endpoints): "
                           "fallbacks, preference")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    for action, what, text in (
        ("fallbacks", "A,B", "override the models its requests fall back to, in order ('' for none)"),
        ("prefer", "P1,P2", "send its requests to these providers first, in this order, while they have a free "
         "slot; the others after them, by load"),
    ):
        one = model_sub.add_parser(action, help=text + "; --clear: back to the config's")
        one.add_argument("id", metavar="ID", help="the model id (models[].id)")
        one.add_argument("ids", metavar=what, nargs="?", help="comma-separated " +
                         ("model ids" if action == "fallbacks" else "provider ids"))
        one.add_argument("--clear", action="store_true", help="drop the override")
        _add_for(one)
        _add_client(one, action)

    overrides = sub.add_parser("overrides", help="every override in force in a running iop: who set it, until when")
    _add_client(overrides, "overrides")
    audit = sub.add_parser("audit", help="the control actions taken on a running iop, newest first")
    audit.add_argument("--since", type=since_ms, metavar="DURATION|MS",
                       help="only entries since this long ago (1h, 2d...), or since a time in ms since the epoch")
    audit.add_argument("--limit", type=audit_limit, metavar="N", help="at most N entries (1-1000; default: the "
                       "API's, 100)")
    _add_client(audit, "audit")

    reload = sub.add_parser("reload", help="make a running iop read its config file again (SIGHUP)")
    target = reload.add_mutually_exclusive_group()
    target.add_argument("--port", type=int, default=8080, help="the API port of the `iop up` to reload")
    target.add_argument("--pid", type=int, help="an `iop up`, `iop api` or `iop worker` process to reload "
                        "(another process is refused)")
    reload.set_defaults(func=cmd_reload)

    fake = sub.add_parser("fake-provider", help="run the fake OpenAI-compatible upstream (tests, demo, benchmarks)")
    fake.add_argument("--host", default="127.0.0.1")
    fake.add_argument("--port", type=int, required=True)
    fake.add_argument("--delay-ms", type=int, default=0, help="wait before answering / before the first chunk")
    fake.add_argument("--tokens", type=int, default=16, help="tokens per answer (stream chunks)")
    fake.add_argument("--token-interval-ms", type=int, default=0, help="pause between stream chunks")
    fake.add_argument("--models", default="", help="comma-separated model names it reports")
    fake.add_argument("--api-key-env", help="env var holding the key it requires")
    fake.add_argument("--parallel", type=int, default=0, help="answers generated at once, the rest wait (0: no limit)")
    fake.add_argument("--word", default="tok", help="the stem of its words (another stem: another model's answers)")
    # Ollama's model lifecycle: on when any of the three is given, off (every model always loaded) otherwise.
    fake.add_argument("--max-loaded", type=_positive_int, default=None,
                      help="Ollama lifecycle: models loaded at once, LRU idle one evicted (default: no limit)")
    fake.add_argument("--load-ms", type=_non_negative_int, default=None,
                      help="Ollama lifecycle: how long loading a model takes")
    fake.add_argument("--keep-alive-s", type=_non_negative_float, default=None,
                      help="Ollama lifecycle: an idle model is unloaded after this (Ollama: 300; default: never)")
    fake.set_defaults(func=cmd_fake_provider)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
