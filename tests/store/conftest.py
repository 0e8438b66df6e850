"""A migrated store per test, on SQLite and on PostgreSQL (the `store_url` fixture in tests/conftest.py)."""

import pytest

from gpuforge.store.db import connect, migrate


@pytest.fixture
def engine(store_url):
    engine = connect(store_url)
    migrate(engine)
    yield engine
    engine.dispose()
