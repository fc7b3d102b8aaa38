from __future__ import annotations

from dispatcher.backoff import Backoff


def test_delays_double_up_to_the_cap_and_start_over_after_a_reset() -> None:
    backoff = Backoff(first=0.1, cap=0.5)
    assert [backoff.next() for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    backoff.reset()
    assert backoff.next() == 0.1
