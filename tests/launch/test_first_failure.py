"""Which rank a failed local attempt blames (launch/job.py), from the ProcessFailures torch's agent reports.

Seen once in four loaded runs of test_ddp_train.py: rank 1 killed by SIGKILL, rank 0 raised on the lost
connection and wrote its error file in second T, the agent noticed rank 1 in second T+1, stopped rank 0
with SIGTERM, and torch's smallest-timestamp rule blamed rank 0."""

import signal
from dataclasses import dataclass

from gpuforge.launch.job import _failed, _first_failure


@dataclass
class Failure:  # the two fields of torch's ProcessFailure that the choice reads
    exitcode: int
    timestamp: int


def test_a_rank_killed_outright_is_blamed_over_a_peer_that_raised_earlier_and_was_stopped():
    failures = {1: Failure(-signal.SIGKILL, 101), 0: Failure(-signal.SIGTERM, 100)}
    rank, failure = _first_failure(failures)
    assert rank == 1 and _failed(rank, failure.exitcode).failure == "rank 1 was killed by SIGKILL"
    assert _first_failure({0: Failure(1, 100), 1: Failure(-signal.SIGKILL, 101)})[0] == 1


def test_an_error_exit_is_blamed_over_the_ranks_the_agent_stopped_whatever_their_timestamps():
    failures = {0: Failure(-signal.SIGTERM, 99), 1: Failure(128 + signal.SIGTERM, 99), 2: Failure(2, 100)}
    assert _first_failure(failures)[0] == 2


def test_within_one_kind_the_earliest_timestamp_then_the_agents_order():
    assert _first_failure({0: Failure(1, 101), 1: Failure(1, 100)})[0] == 1
    assert _first_failure({1: Failure(1, 100), 0: Failure(1, 100)})[0] == 1
    assert _first_failure({0: Failure(-signal.SIGTERM, 100)})[0] == 0  # a rank stopped alone is still blamed
