"""``iop catalog`` and runtime control (issue 48): an overridden value is marked, with the
config's value, who set it and until when; a disabled provider reads as such in its row and
among a model group's candidates. Against catalog documents shaped as ``GET /catalog``
answers them (the override fields of docs/DESIGN.md), and as an older iop's, without them."""

from __future__ import annotations

from typing import Any

from iop.catalog_cli import WIDTH, YELLOW, override_lines, render

# 2026-05-01 13:04:00 UTC: the server's clock in these documents.
NOW = 1_777_640_640_000
MINUTE = 60_000


def provider(pid: str, capacity: int = 2, **extra: Any) -> dict[str, Any]:
    """One ``providers[]`` entry of ``GET /catalog`` (dispatcher/catalog.py ``ProviderView``)."""
    return {"id": pid, "node_id": "n", "type": "vllm", "category": "local_inference", "health": "available",
            "reason": "", "capacity": capacity, "in_flight": 0, "load_ratio": 0.0, "models": ["m"],
            "reported_models": ["m"], "missing_models": [], "loaded_models": None, "queued": 0,
            "lifecycle_capabilities": {}, "heartbeat_age_ms": 100, "model_groups": ["g"],
            "endpoints": ["chat/completions"], "slots": None, "enabled": True, "override": {}, **extra}


def model(mid: str, providers: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """One ``models[]`` entry, its candidates the given providers."""
    return {"id": mid, "display_name": mid.upper(), "queued": 0, "oldest_wait_ms": None, "available_slots": 1,
            "candidates": [{"provider": p["id"], "served_name": "m", "node_id": "n", "health": p["health"],
                            "capacity": p["capacity"], "in_flight": 0, "load_ratio": 0.0} for p in providers],
            "tenants": [], "fallbacks": [], "preference": [p["id"] for p in providers], "override": {}, **extra}


def doc(providers: list[dict[str, Any]], models: list[dict[str, Any]]) -> dict[str, Any]:
    return {"server_time_ms": NOW, "providers": providers, "models": models,
            "nodes": [{"id": "n", "providers": [p["id"] for p in providers]}], "tenants": []}


def override(value: Any, config: Any, until: int | None = None, by: str = "ops") -> dict[str, Any]:
    """One field of a catalog ``override``: ``{"value", "config", "by", "at", "until"}``."""
    return {"value": value, "config": config, "by": by, "at": NOW - 5 * MINUTE, "until": until}


def row(text: str, pid: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("  ") and line.split()[0] == pid)


def under(text: str, start: str) -> list[str]:
    """The lines under the first line that starts with ``start``, up to the next less indented."""
    lines = text.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith(start))
    indent = len(lines[i]) - len(lines[i].lstrip()) + 2
    out = []
    for line in lines[i + 1:]:
        if not line.startswith(" " * indent):
            break
        out.append(line)
    return out


def overridden() -> dict[str, Any]:
    """gpu1 disabled for an hour; api capped at 2 (config 6) until 14:03 UTC; auto's bounds
    narrowed until cleared; 'chat' with fallbacks and preference overridden; 'plain' without."""
    gpu1 = provider("gpu1", enabled=False, override={"enabled": override(False, True, NOW + 60 * MINUTE)})
    api = provider("api", 2, override={"capacity": override(2, 6, NOW + 59 * MINUTE)})
    auto = provider("auto", 4, capacity_mode="auto", capacity_bounds=[1, 8],
                    override={"capacity_bounds": override({"min": 1, "max": 8}, {"min": 1, "max": 16}, by="alice")})
    plain = provider("plain")
    chat = model("chat", [api, gpu1], fallbacks=["small", "tiny"], preference=["api", "gpu1"],
                 override={"fallbacks": override(["small", "tiny"], ["small"], NOW + 2 * 24 * 60 * MINUTE),
                           "preference": override(["api", "gpu1"], ["gpu1", "api"])})
    return doc([gpu1, api, auto, plain], [chat, model("plain", [plain, auto])])


def test_a_disabled_provider_reads_as_disabled_with_until_when() -> None:
    text = render(overridden(), colour=False)
    assert "available (disabled)" in row(text, "gpu1")
    # Its config value goes without saying (a provider is enabled unless disabled).
    assert "    disabled (override by ops, until 14:04 UTC, 1h00m left)" in text.splitlines()
    assert "disabled" not in row(text, "plain")


def test_an_overridden_capacity_shows_the_config_value_and_until_when() -> None:
    text = render(overridden(), colour=False)
    lines = text.splitlines()
    assert "░ 0/2 0.00" in row(text, "api")  # the effective capacity, as before
    assert "    capacity 2 (override by ops, config 6, until 14:03 UTC, 59m left)" in lines
    # Bounds of capacity: auto; an override without an expiry lasts until cleared.
    assert "    capacity bounds 1-8 (override by alice, config 1-16)" in lines
    # No override: no line.
    assert not [line for line in lines if "override" in line and "plain" in line]


def test_a_model_groups_overridden_fallbacks_and_preference() -> None:
    text = render(overridden(), colour=False)
    group = under(text, "  chat (CHAT)")
    # Another day than the server's: the date too.
    assert group[:2] == [
        "    fallbacks small, tiny (override by ops, config small, until 2026-05-03 13:04 UTC, 2d0h left)",
        "    preference api, gpu1 (override by ops, config gpu1, api)"]
    # A disabled candidate gets no new job: said beside its health, as a drained one.
    assert group[2:] == ["    api -> m  available  0/2", "    gpu1 -> m  available (disabled)  0/2"]
    # A group without overrides shows none of it.
    assert under(text, "  plain (PLAIN)") == ["    plain -> m  available  0/2", "    auto -> m  available  0/4"]


def test_drain_and_disable_together() -> None:
    both = provider("both", enabled=False, drain="draining", override={"enabled": override(False, True)})
    text = render(doc([both], [model("g", [both])]), colour=False)
    assert "available (disabled, draining)" in row(text, "both")
    assert "    both -> m  available (disabled, draining)  0/2" in text.splitlines()
    assert "    disabled (override by ops)" in text.splitlines()


def test_override_lines_are_coloured_not_dimmed() -> None:
    coloured = render(overridden(), colour=True).splitlines()
    assert f"    {YELLOW}capacity 2 (override by ops, config 6, until 14:03 UTC, 59m left)\033[0m" in coloured


def test_an_override_about_to_lapse_and_an_unknown_field() -> None:
    lines = override_lines({"weight": override(3, 1, NOW + 40_000), "capacity": override(1, 4, NOW - 1)}, NOW)
    # Known fields first; one already past its expiry (the lapse is a second away) says 0s.
    assert lines == ["capacity 1 (override by ops, config 4, until 13:03 UTC, 0s left)",
                     "weight 3 (override by ops, config 1, until 13:04 UTC, 40s left)"]
    assert override_lines({"fallbacks": override([], ["a"])}, NOW) == [
        "fallbacks none (override by ops, config a)"]
    assert override_lines(None, NOW) == override_lines({}, NOW) == []


def test_an_older_iops_catalog_without_the_fields() -> None:
    """No ``enabled``, ``override``, ``fallbacks``, ``preference``: the table of a catalog whose
    providers are enabled and nothing overridden."""
    def strip(d: dict[str, Any], *fields: str) -> dict[str, Any]:
        return {k: v for k, v in d.items() if k not in fields}

    plain = [provider(pid) for pid in ("a", "b")]
    current = doc(plain, [model("g", plain, fallbacks=["h"])])
    old = doc([strip(p, "enabled", "override") for p in plain],
              [strip(m, "fallbacks", "preference", "override") for m in current["models"]])
    text = render(old, colour=False)
    assert text == render(current, colour=False)
    assert "override" not in text
    assert "disabled" not in text


def test_a_long_override_wraps_to_the_width() -> None:
    many = [f"fallback-model-{i}" for i in range(12)]
    p = provider("p")
    text = render(doc([p], [model("g", [p], override={"fallbacks": override(many, many[:1])})]), colour=False)
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    wrapped = under(text, "    fallbacks ")
    assert wrapped
    assert all(line.startswith("      ") for line in wrapped)
    assert " ".join(line.strip() for line in [*under(text, "  g (G)")[:len(wrapped) + 1]]).startswith(
        "fallbacks " + ", ".join(many) + " (override by ops, config fallback-model-0)")
