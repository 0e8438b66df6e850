"""A real OpenID provider per test (tests/helpers/oidc_provider.py), with gpuforge's two clients."""

import pytest

from tests.helpers.oidc_provider import running_provider

DASHBOARD, CLI, SECRET = "gpuforge", "gpuforge-cli", "dashboard-secret"


@pytest.fixture
def provider():
    with running_provider() as provider:
        provider.register_client(DASHBOARD, secret=SECRET, redirect_uris=["http://testserver/auth/oidc/callback"])
        provider.register_client(CLI, redirect_uris=["http://127.0.0.1/callback"])
        yield provider
