"""The server's own record of when Slurm jobs held their nodes (executors/slurm_holding.py), read from a
sequence of squeue answers on a clock the test moves, and the union the ledger charges."""

from datetime import UTC, datetime, timedelta

from gpuforge.executors.slurm_holding import STALE_S, SeenHolding, union
from gpuforge.runs import SLURM_RUNS_KEPT as KEPT

T0 = datetime(2026, 12, 3, 8, 0, tzinfo=UTC)


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


class _Squeue:
    """squeue's answers in turn, each taking 0.1 s, on a clock the test sets."""

    def __init__(self, answers: list[set[str] | None]):
        self.answers, self.now = list(answers), T0

    def clock(self) -> datetime:
        return self.now

    def answer(self) -> set[str] | None:
        self.now += timedelta(seconds=0.1)
        return self.answers.pop(0)


def _read_each_second(answers: list[set[str] | None]) -> tuple[SeenHolding, _Squeue]:
    squeue = _Squeue(answers)
    watch = SeenHolding(squeue.answer, clock=squeue.clock)
    for second in range(len(answers)):
        squeue.now = _at(second)
        watch.read()
    return watch, squeue


def test_runs_are_what_squeue_showed_and_an_unanswered_read_ends_none():
    watch, _ = _read_each_second([{"/r/a"}, {"/r/a", "/r/b"}, None, {"/r/b"}, set(), {"/r/a"}])
    # a run starts when an answer shows it (asked + 0.1 s) and was last seen when the last one was asked
    # a: seen at 0 and 1 (the unanswered read at 2 changes nothing), gone at 3, seen again at 5
    assert watch.spans("/r/a") == [(_at(0.1), _at(1)), (_at(5.1), None)]
    assert watch.spans("/r/b") == [(_at(1.1), _at(3))]  # last seen at 3, gone at 4
    assert watch.spans("/r/a", since=_at(2)) == [(_at(5.1), None)]  # an attempt begun at 2: not the first
    assert watch.spans("/r/never") == []
    # squeue unanswered for longer than STALE_S: the open run ends where it was last seen
    assert watch.spans("/r/a", now=_at(5.1 + STALE_S + 0.5)) == [(_at(0.1), _at(1)), (_at(5.1), _at(5.1))]


def test_keep_only_forgets_ended_jobs_and_keeps_a_long_job_s_first_run():
    answers = [{"/r/a"} if i % 2 == 0 else set() for i in range(2 * KEPT + 4)]
    watch, _ = _read_each_second(answers)
    watch.keep_only(["/r/a"])
    spans = watch.spans("/r/a")
    assert len(spans) == KEPT and spans[0] == (_at(0.1), _at(0.1))
    assert spans[-1][0] == _at(len(answers) - 2 + 0.1)
    watch.keep_only([])
    assert watch.spans("/r/a") == []
    squeue = _Squeue([{"/r/a"}])
    watch = SeenHolding(squeue.answer, clock=squeue.clock)
    watch.keep_only([])  # no job runs: squeue is not asked
    watch.read()
    assert squeue.answers == [{"/r/a"}] and watch.spans("/r/a") == []
    watch.keep_only(["/r/a"])
    watch.read()
    assert squeue.answers == [] and watch.spans("/r/a") == [(_at(0.1), None)]


def test_union_merges_overlaps_and_an_open_span_takes_what_follows():
    written = [(_at(0), _at(10)), (_at(20), _at(25))]
    seen = [(_at(2), _at(8)), (_at(9), _at(12)), (_at(24), None)]
    assert union(written, seen) == [(_at(0), _at(12)), (_at(20), None)]
    assert union([], seen) == [(_at(2), _at(8)), (_at(9), _at(12)), (_at(24), None)]
    forged = [(datetime(1970, 1, 1, tzinfo=UTC), datetime(1970, 1, 1, 0, 0, 1, tzinfo=UTC))]
    assert union(forged, [(_at(3), None)])[-1] == (_at(3), None)  # what was seen is charged all the same
