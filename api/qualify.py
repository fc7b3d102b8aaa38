"""Qualification runs over HTTP (``iop qualify``; docs/QUALIFY.md).

    POST   /admin/qualifications/{model}/runs    start a run: its bounds, the model's providers,
                                                 their lifecycle (declared / verified)
    DELETE /admin/qualifications/runs/{run}      cancel it: its later requests are refused
    POST   /admin/qualifications/{model}         store a finished run's report (ends the run; its knees
                                                 seed capacity: auto, {iop}:qual:cap)
    GET    /qualifications/{model}               the latest report (``?index=N``: the Nth before)
    GET    /qualifications/{model}/runs          every kept run, newest first
    GET    /qualifications/{model}/markdown      the latest report as Markdown (``?index=``,
                                                 ``?against=N``: compared with an earlier one)
    GET    /ui/qualifications                    the comparison page

A run's requests are ordinary ``/v1`` calls with the admin key and ``x-iop-qualify: <run>``,
``x-iop-provider: <provider>``: they run as tenant ``iop-qualify`` in the band below every
other, pinned to that provider, never more at once than the run's share of the model's slots
(``{iop}:tenant:limits``), and only while the run is neither cancelled, nor past its time,
nor past its tokens (``qualification_of``). The writes take the control guard (admin keys; on
an API without keys, loopback only), the reads the catalog's.
"""

from __future__ import annotations

import math
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

import msgspec
from litestar import Request, Response, Router, delete, get, post, route
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery
from redis.exceptions import RedisError

from api.gateway import Gateway
from api.head import GET_AND_HEAD, page
from api.intake import Intake
from api.request_headers import headers_of
from api.runtime import Runtime
from dispatcher import keys, qualifications
from dispatcher.config import QUALIFY_TENANT
from dispatcher.control import audit_once
from dispatcher.exceptions import InvalidRequest, ModelNotFound, RedisUnavailable, RequestError
from dispatcher.lifecycle_probe import probe
from dispatcher.qualifications import LifecycleCheck, Report

RUN_HEADER = "x-iop-qualify"
PROVIDER_HEADER = "x-iop-provider"
_UI = (Path(__file__).resolve().parent / "qualify.html").read_bytes()


# Each is the caller's (or the operator's) to fix, so each answers with a client-side type.
class QualifyRefused(RequestError):
    status = 409
    type = "invalid_request_error"
    code = "qualification_refused"


class QualifyOff(RequestError):
    status = 404
    type = "invalid_request_error"
    code = "qualification_off"


class ReportNotFound(RequestError):
    status = 404
    type = "invalid_request_error"
    code = "qualification_not_found"


# How to turn qualification on, for every answer that finds it off.
ENABLE = ("add a `qualify:` section to the config (`qualify: {}` takes the defaults; docs/QUALIFY.md) "
          "and restart iop")


def version() -> str:
    try:
        return metadata.version("iop")
    except metadata.PackageNotFoundError:
        return "unknown"


class RunRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    providers: list[str] = []  # empty: every provider of the model
    lifecycle_delete: bool = False  # call delete too (an empty one, which deletes nothing)


class RunProvider(msgspec.Struct, frozen=True):
    provider: str
    served_name: str
    type: str
    node: str
    capacity: int
    lifecycle: dict[str, LifecycleCheck]


class Run(msgspec.Struct, frozen=True):
    run: str
    model: str
    started_ms: int
    max_in_flight: int  # the run's share of the model's slots
    share: float
    max_seconds: int
    max_tokens: int
    iop_version: str
    providers: list[RunProvider]


def _enabled(rt: Runtime) -> None:
    if rt.config.qualify is None:
        raise QualifyOff(f"Qualification runs are off in this iop: its config has no `qualify:` section. To run "
                         f"them, {ENABLE}.")


async def _capacity(gw: Gateway, provider: str, default: int) -> int:
    raw = await gw.redis.hget(keys.provider(provider), "capacity")
    return int(raw) if raw is not None and raw.isdigit() else default


@post("/admin/qualifications/{model_id:str}/runs", status_code=201, summary="Start a qualification run")
async def start_run(request: Request[Any, Any, Any], gw: NamedDependency[Gateway],
                    model_id: FromPath[str]) -> Response[bytes]:
    data = await request.body()
    rt = gw.runtime
    _enabled(rt)
    qc = rt.config.qualify
    assert qc is not None
    model = rt.models.get(model_id)
    if model is None:
        raise ModelNotFound(model_id)
    try:
        asked = msgspec.json.decode(data or b"{}", type=RunRequest)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the run's options: {exc}") from None
    unknown = [p for p in asked.providers if p not in model.providers]
    if unknown:
        raise InvalidRequest(f"{', '.join(unknown)}: not a provider of '{model_id}' (its providers: "
                             f"{', '.join(model.providers)})", param="providers")
    chosen = asked.providers or list(model.providers)
    nodes = {prov.id: (node.id, prov) for node, prov in rt.config.providers()}
    try:
        providers = []
        total = 0
        for pid in model.providers:
            node_id, prov = nodes[pid]
            cap = await _capacity(gw, pid, prov.fixed_capacity)
            total += cap
            if pid in chosen:
                providers.append(RunProvider(pid, model.providers[pid], prov.type, node_id, cap,
                                             await probe(prov, delete=asked.lifecycle_delete)))
        share_slots = max(1, math.floor(qc.share * total))
        sec, usec = await gw.redis.time()
        now = int(sec) * 1000 + int(usec) // 1000
        run = Run(uuid.uuid4().hex[:12], model_id, now, share_slots, qc.share, qc.max_seconds, qc.max_tokens,
                  version(), providers)
        async with gw.redis.pipeline(transaction=True) as pipe:
            pipe.hset(keys.qualification_run(run.run), mapping={
                "model": model_id, "expires_ms": now + qc.max_seconds * 1000, "max_tokens": qc.max_tokens,
                "asked": 0, "cancelled": 0})
            pipe.pexpire(keys.qualification_run(run.run), qc.max_seconds * 1000 + 60_000)
            pipe.hset(keys.TENANT_LIMITS, QUALIFY_TENANT, share_slots)
            await pipe.execute()
        # A qualification run loads the model's providers: audited with the other control actions.
        via = request.headers.get("x-iop-via", "").strip().lower()
        await audit_once(rt.calls, "qualify", f"model/{model_id}", None,
                         {"run": run.run, "providers": [p.provider for p in providers], "share_slots": share_slots},
                         rt.admin.name_of(request.headers), via if via in ("cli", "ui") else "http")
    except RedisError as exc:
        raise RedisUnavailable(f"Redis is unavailable: {exc}") from None
    return Response(msgspec.json.encode(run), status_code=201, media_type="application/json")


async def _end(gw: Gateway, run_id: str, cancelled: bool) -> None:
    async with gw.redis.pipeline(transaction=True) as pipe:
        if cancelled:
            pipe.hset(keys.qualification_run(run_id), "cancelled", 1)
        else:
            pipe.delete(keys.qualification_run(run_id))
        pipe.hset(keys.TENANT_LIMITS, QUALIFY_TENANT, 1)
        await pipe.execute()


@delete("/admin/qualifications/runs/{run_id:str}", status_code=200, summary="Cancel a qualification run")
async def cancel_run(gw: NamedDependency[Gateway], run_id: FromPath[str]) -> Response[bytes]:
    try:
        if not await gw.redis.exists(keys.qualification_run(run_id)):
            raise QualifyRefused(f"no qualification run {run_id!r} is under way")
        await _end(gw, run_id, cancelled=True)
    except RedisError as exc:
        raise RedisUnavailable(f"Redis is unavailable: {exc}") from None
    return Response(msgspec.json.encode({"run": run_id, "cancelled": True}), media_type="application/json")


@post("/admin/qualifications/{model_id:str}", status_code=201, summary="Store a qualification report")
async def store_report(request: Request[Any, Any, Any], gw: NamedDependency[Gateway],
                       model_id: FromPath[str]) -> Response[bytes]:
    data = await request.body()
    rt = gw.runtime
    _enabled(rt)
    qc = rt.config.qualify
    assert qc is not None
    try:
        report = qualifications.decode_report(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidRequest(f"the report: {exc}") from None
    if report.model != model_id:
        raise InvalidRequest(f"the report is of model {report.model!r}, not {model_id!r}", param="model")
    try:
        await qualifications.store(gw.redis, report, qc.keep_reports)
        await qualifications.seed_capacity(gw.redis, report)
        if report.run:
            await _end(gw, report.run, cancelled=False)
    except RedisError as exc:
        raise RedisUnavailable(f"Redis is unavailable: {exc}") from None
    return Response(msgspec.json.encode({"model": model_id, "run": report.run, "stored": True}), status_code=201,
                    media_type="application/json")


async def _report(gw: Gateway, model_id: str, index: int) -> Report:
    try:
        found = await qualifications.read(gw.redis, model_id, index)
    except RedisError as exc:
        raise RedisUnavailable(f"Redis is unavailable: {exc}") from None
    if found is None:
        if model_id not in gw.runtime.models and index == 0:
            raise ModelNotFound(model_id)
        if index == 0:
            how = f"`iop qualify --model {model_id}` makes one"
            if gw.runtime.config.qualify is None:
                how = f"qualification runs are off in this iop: {ENABLE}, then {how}"
            raise ReportNotFound(f"No qualification report of '{model_id}' yet: {how} (docs/QUALIFY.md)")
        raise ReportNotFound(f"No qualification report {index} of '{model_id}' is kept (0 is the latest; "
                             f"GET /qualifications/{model_id}/runs lists the kept ones)")
    return found


@route("/qualifications/{model_id:str}", http_method=GET_AND_HEAD, summary="The latest qualification report")
async def latest(request: Request[Any, Any, Any], gw: NamedDependency[Gateway], model_id: FromPath[str],
                 index: FromQuery[int] = 0) -> Response[bytes]:
    return page(request, qualifications.encode(await _report(gw, model_id, index)), "application/json")


@get("/qualifications/{model_id:str}/runs", summary="The kept qualification runs of a model, newest first")
async def runs(gw: NamedDependency[Gateway], model_id: FromPath[str]) -> Response[bytes]:
    try:
        found = await qualifications.history(gw.redis, model_id)
    except RedisError as exc:
        raise RedisUnavailable(f"Redis is unavailable: {exc}") from None
    return Response(msgspec.json.encode(found), media_type="application/json")


@get("/qualifications/{model_id:str}/markdown", summary="A qualification report as Markdown")
async def as_markdown(gw: NamedDependency[Gateway], model_id: FromPath[str],
                      index: FromQuery[int] = 0, against: FromQuery[int | None] = None) -> Response[str]:
    report = await _report(gw, model_id, index)
    earlier = await _report(gw, model_id, against) if against is not None else None
    return Response(qualifications.markdown(report, earlier), media_type="text/markdown; charset=utf-8")


@route("/ui/qualifications", http_method=GET_AND_HEAD, include_in_schema=False,
       summary="Qualification reports: a model's providers side by side, and a run against an earlier one")
async def ui(request: Request[Any, Any, Any]) -> Response[bytes]:
    return page(request, _UI, "text/html; charset=utf-8")


def qualification_of(request: Request[Any, Any, Any], rt: Runtime) -> str | None:
    """The run a request belongs to (its ``x-iop-qualify``), checked: the admin key, qualification
    on, the run under way, in time and within its tokens (what the request may ask, its
    ``max_tokens``/``max_completion_tokens``, is counted when it arrives). None: a caller's."""
    run_id = headers_of(request).get(RUN_HEADER)
    if run_id is None:
        return None
    client = request.client
    rt.admin.check_control(headers_of(request), client.host if client else None)
    _enabled(rt)
    return run_id


async def admit(gw: Gateway, rt: Runtime, run_id: str, intake: Intake, provider: str) -> Intake:
    """The qualification request ``intake`` as it runs: its run's tokens counted, pinned to
    ``provider`` in the qualification band."""
    if provider not in intake.model.providers:
        raise InvalidRequest(f"{PROVIDER_HEADER}: {provider!r} is not a provider of '{intake.model.id}'",
                             param=PROVIDER_HEADER)
    lane = rt.plans.pinned_lane(intake.model.id, provider)
    if lane is None or rt.tenants.qualify is None:
        raise QualifyRefused(f"no lane of '{intake.model.id}' holds {provider!r} alone")
    asked = _asked_tokens(intake.body)
    key = keys.qualification_run(run_id)
    try:
        async with gw.redis.pipeline(transaction=True) as pipe:
            pipe.hincrby(key, "asked", asked)
            pipe.hgetall(key)
            pipe.time()
            _, run, (sec, usec) = await pipe.execute()
    except RedisError as exc:
        raise RedisUnavailable(f"Redis is unavailable: {exc}") from None
    fields = {k.decode(): v.decode() for k, v in run.items()}
    now = int(sec) * 1000 + int(usec) // 1000
    if "model" not in fields:
        raise QualifyRefused(f"no qualification run {run_id!r} is under way (ended, or past its time)")
    if fields["model"] != intake.model.id:
        raise QualifyRefused(f"run {run_id!r} qualifies '{fields['model']}', not '{intake.model.id}'")
    if fields.get("cancelled") == "1":
        raise QualifyRefused(f"run {run_id!r} was cancelled")
    if now > int(fields["expires_ms"]):
        raise QualifyRefused(f"run {run_id!r} is past its time (qualify.max_seconds)")
    if int(fields["asked"]) > int(fields["max_tokens"]):
        raise QualifyRefused(f"run {run_id!r} is past its tokens (qualify.max_tokens: {fields['max_tokens']})")
    return msgspec.structs.replace(intake, lane=rt.plans.banded(lane, rt.tenants.qualify.band), pinned=True,
                                   tenant=rt.tenants.qualify, limits=None, blocks=())


def _asked_tokens(body: bytes) -> int:
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return 0
    if not isinstance(doc, dict):
        return 0
    for name in ("max_completion_tokens", "max_tokens"):
        value = doc.get(name)
        if isinstance(value, int) and value > 0:
            return value
    return 256  # unbounded asks count as a modest answer; the run's own requests always say


def qualify_routers(read_guards: list[Any], write_guards: list[Any]) -> list[Router]:
    return [Router(path="/", route_handlers=[start_run, cancel_run, store_report], guards=write_guards),
            Router(path="/", route_handlers=[latest, runs, as_markdown], guards=read_guards)]


OPEN_HANDLERS = [ui]
