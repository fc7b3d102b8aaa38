"""Which tenant a request is (``api/auth.py`` CallerKeys): its key, or a trusted header."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from api.auth import CallerKeys, admin_guard
from dispatcher.exceptions import Unauthorized
from dispatcher.tenants import Tenants
from tests.dispatcher.tenant_config import BANDS, KEYS, config


def callers(monkeypatch: pytest.MonkeyPatch, **api: Any) -> CallerKeys:
    loaded = config(monkeypatch, **api)
    return CallerKeys(loaded, Tenants(loaded))


def test_a_key_names_its_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    t = callers(monkeypatch, keys=KEYS, priorities=BANDS, api_keys_env="T_LEGACY")
    assert t.tenant_of({"authorization": "Bearer web-secret"}).name == "web"
    assert t.tenant_of({"x-api-key": "eval-secret"}).name == "eval"
    assert t.tenant_of({"authorization": "Bearer old-2"}).name == "default"
    assert t.tenant_of({"authorization": "Bearer old-2"}).band == BANDS.index("standard")
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic web-secret"}):
        with pytest.raises(Unauthorized):
            t.tenant_of(headers)


def test_a_trusted_header_names_the_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    t = callers(monkeypatch, keys=KEYS, priorities=BANDS, api_keys_env="T_LEGACY", tenant_header="X-Tenant")
    assert t.tenant_of({"authorization": "Bearer old-1", "x-tenant": "eval"}).name == "eval"
    with pytest.raises(Unauthorized):
        t.tenant_of({"authorization": "Bearer old-1", "x-tenant": "nobody"})
    with pytest.raises(Unauthorized):  # the header does not replace the key
        t.tenant_of({"x-tenant": "eval"})


def test_a_key_whose_variable_is_unset_is_named_in_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("T_MISSING", raising=False)
    with caplog.at_level("WARNING", logger="iop.auth"):
        t = callers(monkeypatch, keys=[*KEYS, {"name": "ghost", "key_env": "T_MISSING"}], priorities=BANDS)
    assert "tenant ghost has no key: environment variable T_MISSING is unset" in caplog.text
    with pytest.raises(Unauthorized):
        t.tenant_of({"authorization": "Bearer "})



def test_an_open_api_is_the_default_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    t = callers(monkeypatch)
    assert t.tenant_of({}).name == "default"
    assert t.tenant_of({"authorization": "Bearer anything"}).name == "default"


def test_admin_keys_may_be_named_and_the_audit_never_sees_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_ADMIN", "ops:s3cret, bare-key-1")
    conf = config(monkeypatch)
    guard = admin_guard("IOP_ADMIN", CallerKeys(conf, Tenants(conf)))
    guard.check({"authorization": "Bearer s3cret"})
    assert guard.name_of({"authorization": "Bearer s3cret"}) == "ops"
    # A bare key is named by a digest of it, which does not give it away.
    bare = guard.name_of({"authorization": "Bearer bare-key-1"})
    assert bare == "key-" + hashlib.sha256(b"bare-key-1").hexdigest()[:8]
    assert "bare" not in bare
    # The name part is not a key.
    with pytest.raises(Unauthorized):
        guard.check({"authorization": "Bearer ops:s3cret"})
    with pytest.raises(Unauthorized):
        guard.check({"authorization": "Bearer ops"})


def test_without_admin_keys_control_is_named_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    conf = config(monkeypatch)
    guard = admin_guard(None, CallerKeys(conf, Tenants(conf)))
    assert guard.name_of({}) == "loopback"
