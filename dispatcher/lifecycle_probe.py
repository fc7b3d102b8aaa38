"""Which lifecycle actions a provider's runtime really answers (``iop qualify``), found with
safe calls: a read for ``list``, and for the others a call on the action's route with an empty
body, which a runtime that has the route refuses as incomplete (400 / 422) without doing
anything, and one that lacks it answers 404 / 405 / 501. ``delete`` is never called unless asked
(even an empty one); an ``unload`` whose empty call could act (Lemonade's unloads whatever is
loaded) is not called at all. The API process makes these calls, so a provider it cannot reach
is reported unverified, not absent.
"""

from __future__ import annotations

import asyncio
import os

import aiohttp

from dispatcher.capability_flags import flags_for
from dispatcher.config import ProviderConfig
from dispatcher.qualifications import LifecycleCheck

ACTIONS = ("list", "load", "unload", "pull", "delete")
# type -> action -> (method, path) of the safe call; absent: no safe call exists.
ROUTES: dict[str, dict[str, tuple[str, str]]] = {
    "ollama": {"list": ("GET", "/api/tags"), "load": ("POST", "/api/generate"),
               "unload": ("POST", "/api/generate"), "pull": ("POST", "/api/pull"),
               "delete": ("DELETE", "/api/delete")},
    "lemonade": {"list": ("GET", "/api/v1/models"), "load": ("POST", "/api/v1/load"),
                 "pull": ("POST", "/api/v1/pull"), "delete": ("POST", "/api/v1/delete")},
    "llamacpp": {"list": ("GET", "/v1/models"), "load": ("POST", "/models/load"),
                 "unload": ("POST", "/models/unload")},
    "vllm": {"list": ("GET", "/v1/models"), "load": ("POST", "/v1/load_lora_adapter"),
             "unload": ("POST", "/v1/unload_lora_adapter")},
    "sglang": {"list": ("GET", "/v1/models"), "load": ("POST", "/update_weights_from_disk")},
    "openai_api": {"list": ("GET", "/v1/models")},
}
ANSWERS = frozenset({200, 201, 204, 400, 422})
LACKS = frozenset({404, 405, 501})
_FLAG = {"list": "list_models", "load": "load_model", "unload": "unload_model", "pull": "pull_model",
         "delete": "delete_model"}


def _root(prov: ProviderConfig) -> str:
    base = (prov.base_url or "").rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


async def _call(session: aiohttp.ClientSession, prov: ProviderConfig, method: str, path: str) -> LifecycleCheck:
    headers = {}
    if prov.api_key_env and os.environ.get(prov.api_key_env):
        headers["Authorization"] = f"Bearer {os.environ[prov.api_key_env]}"
    try:
        async with session.request(method, _root(prov) + path, json=None if method == "GET" else {},
                                   headers=headers) as resp:
            status = resp.status
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return LifecycleCheck(False, None, f"{method} {path}: unreachable from the API ({type(exc).__name__})")
    verified = True if status in ANSWERS else False if status in LACKS else None
    return LifecycleCheck(False, verified, f"{method} {path} -> {status}")


async def probe(prov: ProviderConfig, delete: bool = False, timeout_s: float = 5.0) -> dict[str, LifecycleCheck]:
    """Each action of ``prov``: declared (its type's flag) and verified by its safe call."""
    flags = flags_for(prov.type, prov.manages_models)
    routes = ROUTES.get(prov.type, {})
    out: dict[str, LifecycleCheck] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        calls = {}
        for action in ACTIONS:
            route = routes.get(action)
            if route is None or not prov.base_url or (action == "delete" and not delete):
                continue
            calls[action] = asyncio.ensure_future(_call(session, prov, *route))
        for action in ACTIONS:
            declared = bool(getattr(flags, _FLAG[action]))
            if action in calls:
                c = await calls[action]
                out[action] = LifecycleCheck(declared, c.verified, c.how)
            elif action == "delete" and action in routes:
                out[action] = LifecycleCheck(declared, None, "not called (iop qualify --lifecycle-delete asks)")
            else:
                out[action] = LifecycleCheck(declared, None, "no safe call for this type")
    return out
