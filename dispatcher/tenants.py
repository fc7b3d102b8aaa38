"""Who is asking: tenants (named caller keys), their priority bands, weights, model
allow-lists and limits, as the config gives them.

A request's tenant is the name of the key it presented; the keys of ``api.api_keys_env``
(or an open API) are tenant ``default``. Flow control -- priority bands, weighted fair
queuing between tenants, per-tenant limits (``lua/lib/pump.lua``) -- is on only when
there is something to control: more than one tenant, more than one band, or a limit.
Otherwise dispatch is the plain FIFO it always was, at the same cost.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase

from dispatcher.config import DEFAULT_TENANT, QUALIFY_TENANT, Config, KeyLimits
from dispatcher.exceptions import InvalidRequest

# QUALIFY_TENANT: the tenant a qualification's requests run as (``iop qualify``, api/qualify.py),
# in the lowest band, at most the config's share of a model's slots; its jobs are kept out of
# the live figures and counted apart in /metrics. Config validation keeps the name from keys.


def is_qualification(job_id: str) -> bool:
    """Is a job a qualification's: its id names its tenant (flow control is on with one)."""
    return job_id.startswith(QUALIFY_TENANT + "~")


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    band: int  # rank in the bands, 0 first
    weight: float = 1.0
    models: tuple[str, ...] | None = None  # globs; None = every model
    max_queued: int | None = None
    max_in_flight: int | None = None
    limits: KeyLimits | None = None  # rate limits and budget (lua/lib/limits.lua)

    def allows(self, model_id: str) -> bool:
        return self.models is None or any(fnmatchcase(model_id, p) for p in self.models)

    def job_id(self, job: str) -> str:
        """A flow-controlled job's id names its tenant (``lua/lib/pump.lua`` reads it)."""
        return f"{self.name}~{job}"


def bands(config: Config) -> list[str]:
    """The priority bands, first first; with ``qualify`` configured, one more below them all,
    the qualification runs' own (``QUALIFY_TENANT``): their jobs run only on slots no caller's
    job waits for."""
    named = list(config.api.priorities) or [config.api.default_priority]
    return [*named, QUALIFY_TENANT] if config.qualify is not None else named


def flow_control(config: Config) -> bool:
    if config.qualify is not None:
        return True
    api = config.api
    tenants = {k.name for k in api.keys} | ({DEFAULT_TENANT} if api.api_keys_env or not api.keys else set())
    limited = any(k.max_queued or k.max_in_flight for k in api.keys)
    return len(tenants) > 1 or len(bands(config)) > 1 or limited or api.tenant_header is not None


class Tenants:
    """The tenants of a config: their bands, weights, allow-lists and limits. Which one a
    request is -- its caller key, or a trusted tenant header -- is ``api/auth.py``'s."""

    def __init__(self, config: Config) -> None:
        api = config.api
        self.bands = bands(config)
        self.default_band = self.bands.index(api.default_priority) if api.default_priority in self.bands else 0
        self.flow_control = flow_control(config)
        self.default = Tenant(DEFAULT_TENANT, self.default_band)
        self.by_name: dict[str, Tenant] = {DEFAULT_TENANT: self.default}
        for key in api.keys:
            self.by_name[key.name] = Tenant(
                key.name,
                self.bands.index(key.priority) if key.priority else self.default_band,
                key.weight,
                tuple(key.models) if key.models is not None else None,
                key.max_queued,
                key.max_in_flight,
                key.limits if key.limits and (key.limits.requests_per_minute or key.limits.tokens_per_minute
                                              or key.limits.tokens_per_day) else None,
            )
        self.qualify: Tenant | None = None
        if config.qualify is not None:
            # Its max_in_flight is a run's (api/qualify.py sets it for the run's model); 1
            # until a run starts, and again whenever the API publishes the config's limits.
            self.qualify = Tenant(QUALIFY_TENANT, len(self.bands) - 1, max_in_flight=1)

    def band_for(self, tenant: Tenant, headers: Mapping[str, str]) -> int:
        """The band of a request: its tenant's, or a lower one it asks for (x-iop-priority)."""
        asked = headers.get("x-iop-priority")
        if asked is None:
            return tenant.band
        if asked not in self.bands:
            raise InvalidRequest(f"x-iop-priority: {asked!r} is not one of {self.bands}", param="x-iop-priority")
        return max(tenant.band, self.bands.index(asked))  # lower only, never higher

    def limits(self) -> dict[str, int]:
        """Tenant -> max_in_flight, as dispatch reads them from Redis."""
        limits = {t.name: t.max_in_flight for t in self.by_name.values() if t.max_in_flight}
        if self.qualify is not None:
            limits[QUALIFY_TENANT] = 1
        return limits
