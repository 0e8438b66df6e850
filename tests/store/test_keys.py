"""API keys: shown once, stored as digests, the admin key written owner-only; their quotas."""

import stat

import pytest
from sqlalchemy import select, text

from gpuforge.errors import GpuforgeError
from gpuforge.store.db import connect, migrate, session
from gpuforge.store.keys import create_key, digest, ensure_admin_key, find_key, set_quotas
from gpuforge.store.models import ApiKey
from gpuforge.store.quotas import QUOTAS, limits

DEFAULTS = {q.name: q.default for q in QUOTAS}


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


def test_quotas_are_stored_as_given_and_hold_as_the_defaults_where_not(engine):
    with session(engine) as s:
        create_key(s, "alice", quotas={"max_running": 1})
        create_key(s, "root", admin=True)
        with pytest.raises(ValueError, match="admin keys have no quotas"):
            create_key(s, "root2", admin=True, quotas={"max_queued": 5})
        with pytest.raises(ValueError, match="max_gpus: no such quota"):
            create_key(s, "carol", quotas={"max_gpus": 5})
        with pytest.raises(ValueError, match="max_priority: 1001 is not in -1000..1000"):
            create_key(s, "carol", quotas={"max_priority": 1001})
    with session(engine) as s:
        keys = {k.name: k for k in s.scalars(select(ApiKey))}
        assert set(keys) == {"alice", "root"}
        assert limits(keys["alice"]) == {**DEFAULTS, "max_running": 1}
        assert limits(keys["root"]) == dict.fromkeys(DEFAULTS)
        assert set_quotas(s, "alice", {"max_running": None, "max_queued": 0}).max_queued == 0
        assert limits(keys["alice"]) == {**DEFAULTS, "max_queued": 0}
        with pytest.raises(LookupError):
            set_quotas(s, "nobody", {"max_queued": 1})
        with pytest.raises(ValueError, match="nothing to change"):
            set_quotas(s, "alice", {})
        with pytest.raises(ValueError, match="admin keys have no quotas"):
            set_quotas(s, "root", {"max_queued": 1})


def test_every_quota_is_a_column_of_api_keys():
    assert {q.name for q in QUOTAS} <= set(ApiKey.__table__.columns.keys())


def test_the_keys_of_a_0003_store_get_the_defaults_after_the_upgrade(store_url):
    engine = connect(store_url)
    try:
        migrate(engine, "0003")
        with engine.begin() as conn:
            for name, admin in (("admin", True), ("alice", False)):
                conn.execute(
                    text("INSERT INTO api_keys (name, digest, admin, created_at) VALUES (:n, :d, :a, :t)"),
                    {"n": name, "d": digest(name), "a": admin, "t": "2024-01-01 00:00:00+00:00"},
                )
        migrate(engine)
        with session(engine) as s:
            keys = {k.name: k for k in s.scalars(select(ApiKey))}
            assert [keys["alice"].max_queued, keys["alice"].max_upload_bytes] == [None, None]  # NULL: default
            assert limits(keys["alice"]) == DEFAULTS
            assert limits(keys["admin"]) == dict.fromkeys(DEFAULTS)
            set_quotas(s, "alice", {"max_upload_bytes": 2**40})  # past 32 bits: a BigInteger
        with session(engine) as s:
            assert s.scalar(select(ApiKey.max_upload_bytes).where(ApiKey.name == "alice")) == 2**40
    finally:
        engine.dispose()
