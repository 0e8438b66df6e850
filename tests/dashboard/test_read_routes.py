"""The job read routes exist once (dashboard/read_routes.py): the server and `gpuforge dashboard` mount the
same ones, the same code over two sources of jobs, and neither holds a second copy of any."""

from fastapi.routing import APIRoute

from gpuforge.dashboard.local import create_local_app
from gpuforge.dashboard.read_routes import read_routes
from gpuforge.server.app import create_app
from gpuforge.server.settings import Settings
from tests.helpers.routes import flat_routes


def _api_routes(routes) -> dict[tuple[str, str], APIRoute]:
    return {
        (route.path, method): route
        for route in flat_routes(routes)
        if route.path.startswith("/api/")
        for method in route.methods
    }


def test_the_server_and_the_local_dashboard_mount_one_copy_of_the_read_routes(tmp_path):
    shared = _api_routes(read_routes(lambda: None).routes)
    local = _api_routes(create_local_app(tmp_path).routes)
    server_app = create_app(Settings(home=tmp_path / "home", schedule=False))
    server = _api_routes(server_app.routes)
    assert len(shared) >= 13, sorted(shared)
    assert set(local) == set(shared), "the local dashboard answers the read routes and nothing else"
    assert set(shared) <= set(server), f"the server lacks {sorted(set(shared) - set(server))}"
    for where in shared:  # the same function's code, not a copy that looks alike
        code = shared[where].endpoint.__code__
        assert local[where].endpoint.__code__ is code and server[where].endpoint.__code__ is code, where
    # and no module of the server answers one of them a second time (FastAPI would answer with the first)
    mounted = [(r.path, m) for r in flat_routes(server_app.routes) for m in r.methods]
    assert sorted(mounted) == sorted(set(mounted)), "a route mounted twice"
