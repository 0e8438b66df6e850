"""A migrated SQLite store per test."""

import pytest

from gpuforge.store.db import connect, migrate


@pytest.fixture
def engine(tmp_path):
    engine = connect(f"sqlite:///{tmp_path / 'store.db'}")
    migrate(engine)
    yield engine
    engine.dispose()
