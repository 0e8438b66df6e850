"""Routes are thin (DESIGN: a route parses, checks the key, calls one service, answers): the route modules
hold no SQL of their own. Their queries are named functions of the store (store/jobs.py, deployments.py,
keys.py, projects.py, versions.py, costs.py); what a submit must pass is server/submit.py's."""

from __future__ import annotations

import ast
from pathlib import Path

import gpuforge.server.routes

ROUTES = Path(gpuforge.server.routes.__file__).parent
QUERIES = {"execute", "scalar", "scalars", "query"}  # Session methods that run a statement
STATEMENTS = {"select", "update", "delete", "insert", "text"}  # SQLAlchemy's statement builders
# what is left on purpose, and why
IMPORTS_LEFT = {
    # a grant or charge of the same upload at the same moment fails at the commit, the end of the session
    # the route opens: it is the route that ignores it (no query of its own)
    ("uploads.py", "sqlalchemy.exc"): "a concurrent grant's unique row, found at the route's commit",
}
FETCHES_LEFT = {
    # s.get(Model, id): the fetch of the object the path addresses, by its primary key, beside the check
    # of who may read it; a store function would only rename Session.get
    ("jobs.py", "state"): "a followed job's state, read again each poll of its stream",
    ("deployments.py", "finished_model"): "the job whose model is deployed",
}


def _findings(path: Path) -> tuple[set[tuple[str, str]], set[tuple[str, str]], list[str]]:
    """(sqlalchemy imports, s.get fetches by the function that holds them, queries found) of one module."""
    imports, fetches, queries = set(), set(), []

    def visit(node: ast.AST, function: str) -> None:
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function = node.name
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sqlalchemy"):
            imports.add((path.name, node.module))
        if isinstance(node, ast.Import):
            imports.update((path.name, a.name) for a in node.names if a.name.startswith("sqlalchemy"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in STATEMENTS:
            queries.append(f"{where}: {node.func.id}(...)")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in QUERIES:
                queries.append(f"{where}: .{node.func.attr}(...)")
            on_session = isinstance(node.func.value, ast.Name) and node.func.value.id == "s"
            if node.func.attr == "get" and on_session:
                fetches.add((path.name, function))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(path.read_text(), filename=str(path)), "<module>")
    return imports, fetches, sorted(queries)


def test_the_route_modules_hold_no_sql_of_their_own():
    modules = sorted(ROUTES.glob("*.py"))
    assert len(modules) > 5, f"no route modules in {ROUTES}?"
    imports, fetches, queries = set(), set(), []
    for path in modules:
        found = _findings(path)
        imports |= found[0]
        fetches |= found[1]
        queries += found[2]
    assert queries == [], "a query in a route: make it a named function of the store"
    assert imports - set(IMPORTS_LEFT) == set(), "SQLAlchemy in a route: its use belongs to the store"
    assert fetches - set(FETCHES_LEFT) == set(), "a Session.get in a route beyond the addressed object's"
    # an allowance nothing needs any more goes: the list says what is left, not what once was
    assert set(IMPORTS_LEFT) <= imports and set(FETCHES_LEFT) <= fetches


def test_the_check_finds_a_query_written_in_a_route(tmp_path):
    """The check itself can fail: the forms the route modules once held are each found."""
    route = tmp_path / "some_route.py"
    route.write_text(
        "from sqlalchemy import select\n"
        "def listed(s, key):\n"
        "    s.get(Job, 1)\n"
        "    rows = s.scalars(select(Job).where(Job.owner_id == key.id))\n"
        "    return s.execute(select(Job.id)).all(), s.scalar(select(Job.id))\n"
    )
    imports, fetches, queries = _findings(route)
    assert imports == {("some_route.py", "sqlalchemy")}
    assert fetches == {("some_route.py", "listed")}
    assert len(queries) == 6  # three select(...), .scalars, .execute and .scalar
