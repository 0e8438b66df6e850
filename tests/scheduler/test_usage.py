"""Device-time lately, by key and by project, from the store: a running job counts until now, an ended one
decays by half every half-life, one older than the horizon is not read."""

from datetime import timedelta

import pytest

from gpuforge.scheduler.usage import recent_usage
from gpuforge.store.db import session
from gpuforge.store.models import Job, JobState, Project, utcnow


def test_recent_usage_decays_by_half_a_half_life_per_key_and_per_project(engine):
    now = utcnow()
    hour = timedelta(hours=1)

    def job(owner, devices, started, finished, state, project=None):
        return Job(name="j", spec_yaml="", run_dir="/x", owner_id=owner, devices_wanted=devices,
                   started_at=started, finished_at=finished, state=state, project_id=project)  # fmt: skip

    with session(engine) as s:
        vision = Project(name="vision")
        s.add(vision)
        s.flush()
        s.add_all([
            job(None, 2, now - hour, None, JobState.RUNNING),  # 2 devices for the last hour, running
            job(None, 1, now - 2 * hour, now - hour, JobState.FINISHED),  # 1 device-hour, ended 1 h ago
            job(None, 1, now - 30 * hour, now - 29 * hour, JobState.FINISHED),  # past the horizon
            job(None, 4, None, None, JobState.QUEUED),  # never ran
            job(None, 3, now - hour, now, JobState.FINISHED, vision.id),  # vision: 3 device-hours, just ended
        ])  # fmt: skip
        project_id = vision.id
    with session(engine) as s:
        by_key, by_project = recent_usage(s, now=now, half_life_s=3600.0)
    assert by_key[None] == pytest.approx(2 * 3600 + 0.5 * 3600 + 3 * 3600)  # a key's usage: every project's
    assert by_project == {project_id: pytest.approx(3 * 3600)}  # jobs of no project count for none
