"""What one config means to an API process, built once: :class:`Runtime`.

The gateway (``api/gateway.py``) holds the process's lasting parts -- its Redis clients,
its reply reader, its metrics -- and one reference to the current runtime. A reload
builds a new runtime from the new config and swaps that reference: a request reads the
reference once when it starts and finishes with what it read (its model, its lane, its
tenant, its timings), whatever a reload does meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from api.auth import CallerKeys, KeyGuard, admin_guard
from api.waiting import WaitRules
from dispatcher.api_side import ApiSide
from dispatcher.config import Config, ModelConfig
from dispatcher.plans import Plans
from dispatcher.script_calls import ScriptCalls
from dispatcher.scripts import Scripts
from dispatcher.tenants import Tenants


@dataclass(frozen=True, slots=True)
class Runtime:
    config: Config
    models: dict[str, ModelConfig]
    # The scripts' calls with this config, as this replica makes them.
    jobs: ApiSide
    # The same calls, as any process makes them (the reaper's, the operator's).
    calls: ScriptCalls
    # The lanes of each model group under this config (the script calls' own).
    plans: Plans
    tenants: Tenants
    # Who a request is: its caller key (or the trusted tenant header), checked here.
    callers: CallerKeys
    # The operator surfaces' keys.
    admin: KeyGuard
    # The timings every job wait of this config keeps.
    wait_rules: WaitRules

    @classmethod
    def build(cls, config: Config, scripts: Scripts, redis: Redis, replica_id: str) -> Runtime:
        tenants = Tenants(config)
        callers = CallerKeys(config, tenants)
        calls = ScriptCalls(scripts, config, Plans(config))
        jobs = ApiSide(calls, redis, replica_id)
        # The submit's own table of each model's queue timeout (and its queue's length), so that
        # a requeued job's wait and its submit never disagree.
        limits = calls._queue_limits
        default_timeout_ms = config.queue.queue_timeout_ms

        def queue_timeout_ms(model_id: str) -> int:
            found = limits.get(model_id)
            # A reload may have removed the model: its waiting jobs still time out.
            return default_timeout_ms if found is None else found[0]

        return cls(
            config=config,
            models={m.id: m for m in config.models},
            jobs=jobs,
            calls=calls,
            plans=calls.plans,
            tenants=tenants,
            callers=callers,
            admin=admin_guard(config.api.admin_keys_env, callers),
            wait_rules=WaitRules(watch_s=config.dispatch.lease_ms / 1000, hold_s=jobs.hold_s,
                                 queue_timeout_ms=queue_timeout_ms),
        )

