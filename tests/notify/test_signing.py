"""The signature a receiver checks: over the exact bytes and the time, refused when either changed or when
it is old (a replay)."""

import time

from gpuforge.notify.signing import signature, verify
from tests.helpers.receivers import signature_holds


def test_a_signature_holds_for_its_body_and_time_alone():
    body, now = b'{"kind":"job.finished"}', int(time.time())
    header = signature("gfs_secret", body, now)
    assert verify("gfs_secret", header, body) and signature_holds("gfs_secret", header, body)
    assert not verify("gfs_other", header, body)
    assert not verify("gfs_secret", header, body + b"\n")
    assert not verify("gfs_secret", header.replace(f"t={now}", f"t={now + 1}"), body)  # the time is signed
    assert not verify("gfs_secret", signature("gfs_secret", body, now - 3600), body)  # a replay, an hour on
    assert not verify("gfs_secret", "v1=abc", body) and not verify("gfs_secret", "", body)
