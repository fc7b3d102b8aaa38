"""bench/redis_capacity.py --dispatch-cost: Redis commands and µs per submit / finish by
lanes and tenants, from INFO commandstats around batches of real script calls. A few calls
per batch against the tests' private redis-server: the shape of the result and what holds
on any machine. Nothing here asserts a duration, nor how the cost grows with the lanes
(that is the benchmark's to report)."""

from __future__ import annotations

import pytest

from bench.redis_capacity import (
    COST_CALLS,
    FINISH_FAIR,
    FINISH_HANDOFF,
    FINISH_IDLE,
    SUBMIT_DISPATCH,
    SUBMIT_QUEUE,
    command_line,
    dispatch_cost_table,
    dispatch_costs,
    parser,
)
from iop.redis_server import RedisServer

pytestmark = pytest.mark.anyio

CALLS, REPEAT = 4, 2


async def test_dispatch_cost_rows_and_counts(redis_server: RedisServer) -> None:
    costs = await dispatch_costs(redis_server.url, calls=CALLS, repeat=REPEAT, lanes=[1, 10], idle_lanes=[],
                                 tenants=[2])
    rows = {(c.call, c.lanes, c.tenants): c for c in costs}
    assert list(rows) == [  # in the table's order: by call, then lanes (tenants)
        (SUBMIT_DISPATCH, 1, None), (SUBMIT_DISPATCH, 10, None),
        (SUBMIT_QUEUE, 1, None), (SUBMIT_QUEUE, 10, None),
        (FINISH_IDLE, 1, None), (FINISH_IDLE, 10, None),
        (FINISH_HANDOFF, 1, None), (FINISH_HANDOFF, 10, None),
        (FINISH_FAIR, 1, 2),
    ]
    for cost in costs:
        assert cost.call in COST_CALLS
        assert len(cost.batches) == REPEAT
        for batch in cost.batches:
            assert batch.calls == CALLS
            # Counted commands: whole numbers, each a command the scripts ran, never the
            # measured EVALSHAs, the INFO that reads the counters, or the batch's own reads.
            assert batch.commands
            assert all(isinstance(n, int) and n > 0 for n in batch.commands.values())
            assert not {"evalsha", "evalsha_ro", "info"} & set(batch.commands)
            assert "time" in batch.commands  # every script asks the server's clock
            assert isinstance(batch.usec, int)
            assert batch.usec >= 0
        assert cost.commands_per_call > 0
        assert cost.us_per_call >= 0
        assert cost.top_commands()
    for lanes in (1, 10):
        # Handing the slot on is a dispatch on top of the release. A dispatching submit (its
        # lane's queue empty) never enters the queue: one ZADD per call, its lease's, where
        # a queueing one makes two (the queue, the deadlines) and never reads a head.
        assert (rows[(FINISH_HANDOFF, lanes, None)].commands_per_call
                > rows[(FINISH_IDLE, lanes, None)].commands_per_call)
        dispatching = rows[(SUBMIT_DISPATCH, lanes, None)].batches[0].commands
        assert dispatching["zadd"] == CALLS
        assert "zrange" not in dispatching
        assert rows[(SUBMIT_QUEUE, lanes, None)].batches[0].commands["zadd"] == 2 * CALLS
        # Only a finish that hands the slot on writes a node stream entry.
        assert "xadd" in rows[(SUBMIT_DISPATCH, lanes, None)].batches[0].commands
    # The batch's own XRANGE (which job holds the slot) is not counted: no script reads a stream.
    assert "xrange" not in rows[(FINISH_HANDOFF, 10, None)].batches[0].commands
    assert "xrange" not in rows[(FINISH_FAIR, 1, 2)].batches[0].commands

    table = dispatch_cost_table(costs)
    assert table.count("\n") == 2 + len(costs)
    assert f"| {FINISH_FAIR} | 1 | 2 |" in table


def test_dispatch_cost_command_line() -> None:
    """The mode is one flag, and the command recorded with the table reproduces the run."""
    assert command_line(parser().parse_args(["--dispatch-cost"])) == "python -m bench.redis_capacity --dispatch-cost"
    args = parser().parse_args(["--dispatch-cost", "--cost-calls", "500", "--cost-lanes", "1,2"])
    assert (args.cost_calls, args.cost_lanes, args.cost_idle_lanes) == (500, [1, 2], [240])
    assert command_line(args) == "python -m bench.redis_capacity --dispatch-cost --cost-calls 500 --cost-lanes 1,2"
    assert not parser().parse_args([]).dispatch_cost
