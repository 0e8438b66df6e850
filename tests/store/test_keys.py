"""API keys: shown once, stored as digests, the admin key written owner-only."""

import stat

import pytest
from sqlalchemy import select

from gpuforge.errors import GpuforgeError
from gpuforge.store.db import session
from gpuforge.store.keys import create_key, digest, ensure_admin_key, find_key
from gpuforge.store.models import ApiKey


def test_a_key_is_found_by_itself_and_never_stored(engine):
    with session(engine) as s:
        key = create_key(s, "alice")
    with session(engine) as s:
        stored = s.scalars(select(ApiKey)).one()
        assert stored.digest == digest(key) and key not in (stored.digest, stored.name)
        assert find_key(s, key).name == "alice"
        for wrong in (None, "", key[:-1] + ("A" if key[-1] != "A" else "B"), "Bearer " + key):
            assert find_key(s, wrong) is None
        with pytest.raises(GpuforgeError, match="named 'alice' exists already"):
            create_key(s, "alice")


def test_the_first_start_writes_one_admin_key_readable_by_its_owner_only(engine, tmp_path):
    home = tmp_path / "home"
    with session(engine) as s:
        key = ensure_admin_key(s, home)
    path = home / "admin.key"
    assert path.read_text().strip() == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with session(engine) as s:
        assert find_key(s, key).admin
        assert ensure_admin_key(s, home) is None  # a second start makes no other admin key
    assert path.read_text().strip() == key


def test_a_configured_admin_key_on_a_store_that_has_one_is_reported_not_silently_dropped(
    engine, tmp_path, caplog
):
    with session(engine) as s:
        ensure_admin_key(s, tmp_path)
    with caplog.at_level("WARNING", logger="gpuforge.server"), session(engine) as s:
        assert ensure_admin_key(s, tmp_path, "gf_" + "x" * 40) is None
    assert "GPUFORGE_ADMIN_KEY is not used" in caplog.text
