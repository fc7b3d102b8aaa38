from __future__ import annotations

import pytest

from api.stream_slots import StreamSlots
from dispatcher.exceptions import Overloaded


def test_a_full_process_refuses_until_a_stream_releases_its_slot() -> None:
    slots = StreamSlots(2)
    first = slots.acquire()
    slots.acquire()
    with pytest.raises(Overloaded):
        slots.acquire()
    assert slots.in_use == 2
    first()
    assert slots.in_use == 1
    slots.acquire()


def test_a_release_frees_its_slot_once() -> None:
    slots = StreamSlots(2)
    release = slots.acquire()
    other = slots.acquire()
    release()
    release()
    assert slots.in_use == 1
    other()
    assert slots.in_use == 0
