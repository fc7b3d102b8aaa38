"""Which keys a dispatch script needs, worked out once from the config.

A model group is split into *lanes*, one per set of its providers that some request can
go to: the lane of all its providers (the only one when every provider serves every
endpoint the model is asked for), the lane of the providers that serve an endpoint not
all of them serve (``rerank`` on one box of three), and a lane of one provider for the
requests that must go to it (a stored Response lives there). With priority bands
(``dispatcher/tenants.py``) each of these is split once more, one lane per band. Each
lane is a FIFO queue (fair-queued between tenants under flow control); heads of
different lanes are compared by their global submit order (under flow control: band,
then fair share), so a freed slot still goes to the request that can use it and is due
first.

A script may only touch keys it is given. Pumping a set of lanes touches each lane's
queue and, for every candidate, the provider hash and the node stream. A :class:`Plan`
holds those keys and the lanes (``dispatcher/wire.py`` LaneSpec) that tell the script
where they are (``lua/lib/pump.lua``). The lanes live in Redis under the plan's id, so a
call carries only the id and the keys: a finish of a provider in 240 lanes reads the
index of lanes that hold jobs, not 240 lanes. Plans are built once at start-up: the
request path only concatenates lists.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from dispatcher import keys, wire
from dispatcher.config import AUTO_LOAD_FLOOR, FIXED_LOAD_FLOOR, Config, ModelConfig
from dispatcher.tenants import bands, flow_control


@dataclass(frozen=True, slots=True)
class Plan:
    """The lanes one kind of script call pumps, as ``lua/lib/pump.lua`` reads them: a header
    and one JSON per lane, kept in Redis under ``keys.plan(id)`` (``lua/plan.lua`` writes it
    when a call finds it missing), so that a call sends the plan's id and its keys, not its
    lanes. ``keys``: the plan hash, its lane set, the index of lanes that hold jobs, then the
    keys its lanes name by position."""

    id: str  # a digest of everything below: plans of two configs never share a key
    keys: tuple[str, ...]
    header: bytes  # wire.PlanHeader
    lanes: tuple[tuple[str, bytes], ...]  # (queue key, wire.LaneSpec); none for a plan of one lane

    def args(self, fixed_keys: Iterable[str], lease_ms: int) -> tuple[list[str], list[bytes | str | int]]:
        """KEYS and the first three ARGV of a pumping script whose own keys are ``fixed_keys``."""
        ks = list(fixed_keys)
        offset = len(ks)
        ks.extend(self.keys)
        return ks, [self.id, offset, lease_ms]

    def upload(self, ttl_ms: int) -> tuple[list[str], list[bytes | str | int]]:
        """KEYS and ARGV of ``lua/plan.lua``, which writes this plan."""
        argv: list[bytes | str | int] = [ttl_ms, self.header]
        for queue_key, spec in self.lanes:
            argv += [queue_key, spec]
        return list(self.keys[:2]), argv


@dataclass(frozen=True, slots=True)
class Lane:
    model: str
    name: str  # "" for the lane of all the model's providers (default band); "a,b#batch" ...
    providers: tuple[str, ...]  # sorted
    band: int = 0  # rank, 0 first

    @property
    def queue(self) -> str:
        return keys.queue(self.model, self.name)


def build(config: Config, lanes: Iterable[Lane], fair: bool = False) -> Plan:
    """``fair``: flow control is on (``dispatcher/tenants.py``)."""
    node_of = {prov.id: node.id for node, prov in config.providers()}
    # ',a,b,': what lib/pump.lua's serves() looks a job's endpoint up in.
    endpoints_of = {prov.id: "," + ",".join(sorted(prov.served_endpoints)) + "," for _, prov in config.providers()}
    managed = {prov.id for _, prov in config.providers() if prov.manages_models}
    # The plan hash, its lane set and the index take the first three places; their names
    # depend on the digest, which depends on the rest: placeholders until then.
    index: dict[str, int] = {"": 1, " ": 2, keys.WAITING_LANES: 3}

    def pos(key: str) -> int:
        if key not in index:
            index[key] = len(index) + 1
        return index[key]

    specs: list[tuple[str, wire.LaneSpec]] = []
    for lane in lanes:
        model = config.model(lane.model)
        assert model is not None
        rank = {pid: len(model.preference) - i for i, pid in enumerate(model.preference)}
        cands = [
            wire.Candidate(provider=pid, served=model.providers[pid], provider_key=pos(keys.provider(pid)),
                           node_key=pos(keys.node(node_of[pid])), node=node_of[pid], endpoints=endpoints_of[pid],
                           managed=pid in managed, rank=rank.get(pid, 0))
            for pid in lane.providers
            if pid in node_of
        ]
        spec = wire.LaneSpec(
            model=lane.model, name=lane.name, queue=pos(lane.queue), band=lane.band if fair else 0,
            hold_ms=config.hold_when_unavailable_ms(model), candidates=cands)
        aff = model.affinity
        if aff.mode != "off":
            spec = msgspec.structs.replace(
                spec, load_bound=aff.load_bound,
                load_floor=FIXED_LOAD_FLOOR if aff.load_floor is None else aff.load_floor,
                load_floor_auto=AUTO_LOAD_FLOOR if aff.load_floor is None else aff.load_floor,
                index=pos(keys.affinity(model.id)),
                recency=pos(keys.affinity_recency(model.id)),
                footprint=pos(keys.affinity_footprint(model.id)), index_max=aff.index_max_blocks,
                index_ttl_ms=aff.index_ttl_s * 1000, look_ahead=aff.look_ahead, max_wait_ms=aff.max_wait_ms,
                home_queue=aff.home_queue)
        specs.append((lane.queue, spec))
    only = specs[0][1] if len(specs) == 1 else None
    stats = pos(keys.AFFINITY_STATS) if any(spec.load_bound for _, spec in specs) else 0
    copies = pos(keys.MODEL_COPIES) if any(c.managed for _, spec in specs for c in spec.candidates) else 0
    ej = config.ejection
    ejection = wire.Ejection(consecutive=ej.consecutive_5xx, rate=ej.failure_rate, window_ms=ej.window_s * 1000,
                             min_requests=ej.min_requests, base_ms=round(ej.base_s * 1000),
                             max_ms=round(ej.max_s * 1000), max_percent=ej.max_ejected_percent)
    if fair:
        head = wire.PlanHeader(
            fair=True, capped=any(k.max_in_flight for k in config.api.keys), tenants=pos(keys.TENANTS),
            limits=pos(keys.TENANT_LIMITS), vtime=pos(keys.VIRTUAL_TIME), ftags=pos(keys.FINISH_TAGS),
            park=keys.parked(""), affinity_stats=stats, rates=pos(keys.QUEUE_RATES), only=only,
            ejection=ejection, copies=copies)
    else:
        head = wire.PlanHeader(affinity_stats=stats, rates=pos(keys.QUEUE_RATES), only=only, ejection=ejection,
                               copies=copies)
    header = wire.encode(head)
    lane_specs = () if only else tuple((queue, wire.encode(spec)) for queue, spec in specs)
    key_list = list(index)
    digest = hashlib.blake2b(digest_size=10)
    for part in (header, *(b"\0".join((q.encode(), spec)) for q, spec in lane_specs), *(k.encode() for k in key_list)):
        digest.update(part)
        digest.update(b"\n")
    plan_id = digest.hexdigest()
    key_list[0], key_list[1] = keys.plan(plan_id), keys.plan_lanes(plan_id)
    return Plan(id=plan_id, keys=tuple(key_list), header=header, lanes=lane_specs)


def model_lanes(config: Config, model: ModelConfig) -> tuple[Lane, dict[str, Lane], dict[str, Lane]]:
    """The model's lane of all providers, its lane per endpoint, and its lane per provider."""
    served = {prov.id: prov.served_endpoints for _, prov in config.providers() if prov.id in model.providers}
    everyone = tuple(sorted(served))

    def lane(pids: Iterable[str]) -> Lane:
        members = tuple(sorted(pids))
        return Lane(model.id, "" if members == everyone else ",".join(members), members)

    endpoints = {ep for eps in served.values() for ep in eps}
    by_endpoint = {ep: lane(pid for pid, eps in served.items() if ep in eps) for ep in sorted(endpoints)}
    by_provider = {pid: lane([pid]) for pid in everyone}
    return lane(everyone), by_endpoint, by_provider


class Plans:
    """Every lane of every model group, and the plans that pump them."""

    def __init__(self, config: Config) -> None:
        self.fair = flow_control(config)
        self.bands = bands(config)
        default = config.api.default_priority
        self.default_band = self.bands.index(default) if default in self.bands else 0
        self.empty = build(config, [], self.fair)
        self.lanes_by_model: dict[str, list[Lane]] = {}
        self._main: dict[str, Lane] = {}
        self.endpoint_lane: dict[tuple[str, str], Lane] = {}
        self.provider_lane: dict[tuple[str, str], Lane] = {}
        for model in config.models:
            everyone, by_endpoint, by_provider = model_lanes(config, model)
            self._main[model.id] = self.banded(everyone, self.default_band)
            lanes = {everyone.name: everyone}
            for ep, ln in by_endpoint.items():
                self.endpoint_lane[(model.id, ep)] = self.banded(ln, self.default_band)
                lanes.setdefault(ln.name, ln)
            for pid, ln in by_provider.items():
                self.provider_lane[(model.id, pid)] = self.banded(ln, self.default_band)
                lanes.setdefault(ln.name, ln)
            self.lanes_by_model[model.id] = [self.banded(ln, rank) for ln in lanes.values()
                                             for rank in range(len(self.bands))]
        self.by_lane = {(ln.model, ln.name): build(config, [ln], self.fair)
                        for lanes in self.lanes_by_model.values() for ln in lanes}
        # Every queue key some plan of this config pumps (dispatcher/reaper.py rehomes the rest).
        self.by_queue = {keys.queue(model, name): plan for (model, name), plan in self.by_lane.items()}
        # The queue keys only jobs pinned to a provider belong in (the reaper looks in them for
        # jobs a reload left there: dispatcher/reaper.py rehome).
        shared = {self.banded(ln, rank).queue for ln in (*self.endpoint_lane.values(), *self._main.values())
                  for rank in range(len(self.bands))}
        self.pinned_only = frozenset(self.banded(ln, rank).queue for ln in self.provider_lane.values()
                                     for rank in range(len(self.bands))) - shared
        self.everything = build(config, [ln for lanes in self.lanes_by_model.values() for ln in lanes], self.fair)
        # The queue keys each provider's plan pumps (dispatcher/script_calls.py: what a release
        # did not pump).
        self.provider_queues = {
            prov.id: frozenset(ln.queue for lanes in self.lanes_by_model.values() for ln in lanes
                               if prov.id in ln.providers)
            for _, prov in config.providers()
        }
        self.by_provider = {
            prov.id: build(config, [ln for lanes in self.lanes_by_model.values() for ln in lanes
                                    if prov.id in ln.providers], self.fair)
            for _, prov in config.providers()
        }

    def every_plan(self) -> list[Plan]:
        """Each distinct plan of this config once."""
        unique = {plan.id: plan for plan in (self.empty, self.everything, *self.by_lane.values(),
                                             *self.by_provider.values())}
        return list(unique.values())

    def banded(self, lane: Lane, band: int) -> Lane:
        """``lane`` in priority band ``band`` (its queue is named after the band unless it is
        the default one)."""
        base = lane.name.partition("#")[0]
        name = base if band == self.default_band else f"{base}#{self.bands[band]}"
        return Lane(lane.model, name, lane.providers, band)

    def main_lane(self, model_id: str) -> Lane:
        """The lane of all the model's providers, in the default band."""
        return self._main[model_id]

    def lane_for(self, model_id: str, endpoint: str) -> Lane | None:
        """The lane of the providers of ``model_id`` that serve ``endpoint`` (default band);
        None if none does."""
        return self.endpoint_lane.get((model_id, endpoint))

    def pinned_lane(self, model_id: str, provider_id: str) -> Lane | None:
        """The lane that holds ``provider_id`` alone (default band), if it serves ``model_id``."""
        return self.provider_lane.get((model_id, provider_id))

    def home_of(self, model_id: str, lane_name: str, endpoint: str, pin: str | None) -> Lane | None:
        """Where a job waiting in lane ``lane_name`` of ``model_id`` belongs under this config:
        the lane of the providers that serve its endpoint (or of the provider it is pinned
        to), in the band its lane was in (the default band if that band is gone). None when
        no lane of this config may take it (its model, or its pinned provider, is gone)."""
        lane = self.pinned_lane(model_id, pin) if pin else self.lane_for(model_id, endpoint)
        if lane is None:
            return None
        band_name = lane_name.partition("#")[2]
        band = self.bands.index(band_name) if band_name in self.bands else self.default_band
        return self.banded(lane, band)
