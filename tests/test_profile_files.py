"""profile_files.py: the request a server writes for a running job (taken once, whole, and only when it is
this attempt's), and reports read back only when they are ones gpuforge wrote. The reports here are
written by hand: what a damaged or planted file holds, which a real run never writes."""

import json
import os
import time

import pytest

from gpuforge.profile_files import REQUEST_FILE, ProfileError, ask, read_profile, take_request


def _report(rank: int = 0, steps=(3, 4), mean: float = 0.01, **more) -> dict:
    parts = {"forward": {"seconds": mean / 2, "share": 0.5}, "sync": {"seconds": mean / 2, "share": 0.5}}
    return {
        "rank": rank,
        "mean_step_s": mean,
        "steps": [{"step": s} for s in steps],
        "breakdown": parts,
        **more,
    }


def _write(run, name: str, report) -> None:
    (run / "profile").mkdir(exist_ok=True)
    (run / "profile" / name).write_text(report if isinstance(report, str) else json.dumps(report))


def test_a_request_is_taken_once_and_a_bad_or_earlier_one_is_dropped(tmp_path):
    ask(tmp_path, 5)
    assert take_request(tmp_path) == 5 and take_request(tmp_path) is None  # once
    assert not list(tmp_path.iterdir())  # nothing left behind
    for text in ("{not json", '{"steps": 0}', '{"steps": 51}', '{"steps": true}', "[5]"):
        (tmp_path / REQUEST_FILE).write_text(text)
        assert take_request(tmp_path) is None and not (tmp_path / REQUEST_FILE).exists(), text
    ask(tmp_path, 3)
    old = time.time() - 60
    os.utime(tmp_path / REQUEST_FILE, (old, old))  # written before this attempt began
    assert take_request(tmp_path, not_before=time.time() - 1) is None
    with pytest.raises(ProfileError, match="between 1 and 50"):
        ask(tmp_path, 51)


def test_the_slowest_rank_is_the_busiest_of_rank_0s_window_and_bad_reports_are_refused(tmp_path):
    assert read_profile(tmp_path) is None
    _write(tmp_path, "profile.json", _report(0, all_reduce={"seconds": 0.004, "share": 0.4, "bytes": 10}))
    _write(tmp_path, "profile.rank1.json", _report(1, all_reduce={"seconds": 0.0, "share": 0.0, "bytes": 10}))
    _write(tmp_path, "profile.rank2.json", _report(2, steps=(9, 10), mean=0.5))  # another window's
    slowest = read_profile(tmp_path)["slowest_rank"]
    assert (slowest["rank"], slowest["ranks"]) == (1, 2) and slowest["busy_s"] == pytest.approx(0.005)

    for text, why in (
        ('{"mean_step_s": NaN, "breakdown": {}}', "NaN is no figure"),
        ('{"mean_step_s": 1' + "0" * 400 + ', "breakdown": {}}', "mean_step_s is not a number"),
        (json.dumps(_report(memory="x")), "memory is not"),
        (json.dumps(_report(memory={"kept_by": [{"bytes": "many"}]})), "memory is not"),
        ("[]", "not a JSON object"),
    ):
        _write(tmp_path, "profile.json", text)
        with pytest.raises(ProfileError, match=why):
            read_profile(tmp_path)
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps(_report()))
    (tmp_path / "profile" / "profile.json").unlink()
    (tmp_path / "profile" / "profile.json").symlink_to(outside)
    with pytest.raises(ProfileError, match="a link"):  # never read through a link out of the run
        read_profile(tmp_path)
