"""The API alone on the real app (no scheduling), with the admin key its first start made."""

import pytest
from fastapi.testclient import TestClient

from gpuforge.server.app import create_app
from gpuforge.server.settings import Settings


@pytest.fixture
def server(tmp_path, store_url):
    settings = Settings(home=tmp_path / "home", db=store_url, schedule=False)
    with TestClient(create_app(settings)) as client:
        admin = (tmp_path / "home" / "admin.key").read_text().strip()
        yield client, admin
