"""``dispatcher/exceptions.py``: an error reported by its code comes back as its own class."""

from __future__ import annotations

import pytest

from dispatcher import exceptions
from dispatcher.exceptions import ProviderError, ProviderUnreachable, RequestError, error_from_code


def _every_class(cls: type[RequestError]) -> list[type[RequestError]]:
    return [cls, *(c for sub in cls.__subclasses__() for c in _every_class(sub))]


# The errors that may cross Redis are this module's; the API's own (api/qualify.py) never do.
CLASSES = [c for c in _every_class(RequestError) if c.__module__ == exceptions.__name__]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_code_maps_back_to_its_class(cls: type[RequestError]) -> None:
    assert cls.code is not None
    exc = error_from_code(cls.code, "as the worker said it")
    # ProviderError's code is ProviderUnreachable's too, which it stands for (the next test).
    assert type(exc) is (ProviderUnreachable if cls is ProviderError else cls)
    assert exc.message == "as the worker said it"
    assert str(exc) == "as the worker said it"
    assert exc.status == type(exc).status
    assert exc.headers == {}


def test_codes_are_one_class_each_but_the_provider_errors() -> None:
    codes = [c.code for c in CLASSES]
    shared = {code for code in codes if codes.count(code) > 1}
    assert shared == {ProviderError.code}
    assert type(error_from_code(ProviderError.code or "", "m")) is ProviderUnreachable


def test_an_unknown_code_is_a_provider_that_failed() -> None:
    assert type(error_from_code("no_such_code", "m")) is ProviderUnreachable
