"""The server and its client verbs (they join `gpuforge.cli.app`):

    gpuforge server [--host 127.0.0.1] [--port 8600] [--db URL | --db-file PATH]
                    [--oidc-issuer URL --oidc-client-id ID [--oidc-client-secret-file PATH]]
    gpuforge submit SPEC.yaml [--priority N] [--name NAME] [--set k=v]... [--json]
    gpuforge jobs [--state S] [--json] | job ID [--json] | logs ID [--follow] [--tail N]
    gpuforge cancel ID [--no-wait] | resume ID [--budget USD | --no-budget] | wait ID...
    gpuforge deploy ... | deployments ... | rollback ... | undeploy ... | predict ...  (cli/deployments.py)
    gpuforge costs [--project P] [--by day|key|project] [--since DATE] [--json]
    gpuforge keys create NAME [--admin | --project P] [--max-queued N] [--max-running N]
                              [--max-upload-bytes B] [--max-deployments N] [--max-priority P]
    gpuforge keys set NAME [--project P | --no-project] [--max-...]  | keys list [--json] | keys revoke NAME
    gpuforge projects create NAME [--budget-usd-month X] [--max-devices N] [--share W]
    gpuforge projects list [--json] | projects set NAME [--budget-usd-month X | --no-budget]
                                      [--max-devices N | --no-max-devices] [--share W]

Client verbs read GPUFORGE_URL (or --url) and the API key from GPUFORGE_API_KEY or --api-key-file PATH
(its first line): never from the command line, which every local user can read (/proc/<pid>/cmdline). For
the same reason `gpuforge server` takes a store URL holding a password from GPUFORGE_DB or --db-file PATH,
never from --db.
"""

from __future__ import annotations

import functools
import inspect
import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from gpuforge.cli.app import Overrides, SpecPath, app, console, out_console, run_announced
from gpuforge.errors import GpuforgeError
from gpuforge.secret_files import read_secret_file, url_with_password_masked
from gpuforge.store.quotas import QUOTAS

Url = Annotated[str | None, typer.Option("--url", help="server URL (default: $GPUFORGE_URL)")]
KeyFile = Annotated[
    Path | None,
    typer.Option(
        "--api-key-file",
        help="a file whose first line is the API key (default: $GPUFORGE_API_KEY)",
        show_default=False,
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="machine-readable output")]
STOPPED = ("finished", "failed", "cancelled", "paused")
CANCEL_WAIT_S = 60.0  # a running job stops at its next step, after a checkpoint


def client_for(url: str | None, key_file: Path | None):
    from gpuforge.client import Client

    return Client(url, read_secret_file(key_file, "--api-key-file", "the API key") if key_file else None)


def _print_json(value) -> None:
    out_console.print(json.dumps(value), highlight=False, soft_wrap=True, markup=False)


def check_port_free(host: str, port: int) -> None:
    """A GpuforgeError naming the port when something listens on it already: said before anything is
    written, not as uvicorn's [Errno 98] after a home and an admin key were made for nothing."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # the socket uvicorn binds
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            sock.bind((host, port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise GpuforgeError(
                    f"port {port} is in use on {host}: another server listens there; stop it, or start this "
                    "one with --port N (or GPUFORGE_PORT)"
                ) from None
            why = err.strerror or str(err)
            raise GpuforgeError(f"--host {host} --port {port}: cannot listen there ({why})") from None


@app.command()
def server(
    host: Annotated[str | None, typer.Option(help="default 127.0.0.1 ($GPUFORGE_HOST)")] = None,
    port: Annotated[int | None, typer.Option(help="default 8600 ($GPUFORGE_PORT)")] = None,
    db: Annotated[
        str | None,
        typer.Option(help="store URL, with no password (default: $GPUFORGE_DB, or SQLite in $GPUFORGE_HOME)"),
    ] = None,
    db_file: Annotated[
        Path | None,
        typer.Option(
            help="a file whose first line is the store URL (for one with a password)", show_default=False
        ),
    ] = None,
    executor: Annotated[
        str | None,
        typer.Option(
            help="local (default), ray (jobs' processes on a Ray cluster) or slurm (each job a Slurm job) "
            "($GPUFORGE_EXECUTOR)"
        ),
    ] = None,
    ray_address: Annotated[
        str | None, typer.Option(help="HOST:PORT of the Ray cluster's head ($GPUFORGE_RAY_ADDRESS)")
    ] = None,
    partition: Annotated[
        str | None, typer.Option(help="Slurm partition, for --executor slurm ($GPUFORGE_SLURM_PARTITION)")
    ] = None,
    account: Annotated[
        str | None, typer.Option(help="Slurm account, for --executor slurm ($GPUFORGE_SLURM_ACCOUNT)")
    ] = None,
    qos: Annotated[
        str | None, typer.Option(help="Slurm QOS, for --executor slurm ($GPUFORGE_SLURM_QOS)")
    ] = None,
    oidc_issuer: Annotated[
        str | None,
        typer.Option(help="single sign-on: the OpenID Connect issuer's URL ($GPUFORGE_OIDC_ISSUER)"),
    ] = None,
    oidc_client_id: Annotated[
        str | None, typer.Option(help="single sign-on: gpuforge's client id there ($GPUFORGE_OIDC_CLIENT_ID)")
    ] = None,
    oidc_client_secret_file: Annotated[
        Path | None,
        typer.Option(
            help="a file whose first line is the client's secret (or $GPUFORGE_OIDC_CLIENT_SECRET; never on "
            "the command line)",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Serve the HTTP API: jobs are queued in the store and run on this machine's devices (or a Ray
    cluster's, or a Slurm partition's: docs/slurm.md)."""
    from pydantic import ValidationError

    from gpuforge.server.settings import Settings
    from gpuforge.spec import format_validation_error

    if db is not None and db_file is not None:
        raise GpuforgeError("--db and --db-file: give one of them")
    if db is not None and (shown := url_with_password_masked(db)) is not None:
        raise GpuforgeError(
            f"--db {shown}: a password on the command line can be read by every local user; put the URL in "
            "GPUFORGE_DB or in a file named by --db-file PATH"
        )
    if db_file is not None:
        db = read_secret_file(db_file, "--db-file", "the store URL")
    given = {"host": host, "port": port, "db": db, "executor": executor, "ray_address": ray_address,
             "slurm_partition": partition, "slurm_account": account, "slurm_qos": qos,
             "oidc_issuer": oidc_issuer, "oidc_client_id": oidc_client_id,
             "oidc_client_secret_file": oidc_client_secret_file}  # fmt: skip
    try:
        settings = Settings(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as err:
        raise GpuforgeError(format_validation_error(err)) from None
    from gpuforge.server.oidc import oidc_settings

    oidc_settings(settings)  # an issuer without a client id, an unreadable secret file: said now
    check_port_free(settings.host, settings.port)  # before the home, the store or a key is made
    # the app (torch, the store's tables) only once the options hold: a refusal takes a second
    from gpuforge.server.app import check_executor, check_store_and_bind, create_app

    check_store_and_bind(settings)
    executor = check_executor(settings)
    served = create_app(settings, executor)
    run_announced(served, "server", settings.host, settings.port, f"home {settings.home}")


@app.command()
def submit(
    spec: SpecPath,
    priority: Annotated[int | None, typer.Option(help="default: the spec's priority")] = None,
    name: Annotated[str | None, typer.Option(help="default: the spec's name")] = None,
    set_: Overrides = None,
    url: Url = None,
    key_file: KeyFile = None,
    as_json: AsJson = False,
) -> None:
    """Queue a job on the server (sending the local data files it names); prints its id. A lost answer
    or a server restarting is tried again a few times, and still queues one job."""
    from gpuforge.client import spec_as_written
    from gpuforge.spec import load_spec

    overrides = list(set_ or [])
    job_spec = load_spec(spec, overrides)
    if job_spec.kind == "script":  # what it uses from its folder but does not send: here, not on the server
        from gpuforge.launch.shipped import check_sent

        for warning in check_sent(job_spec):
            console.print(f"warning: {warning}", highlight=False, markup=False)
    written = spec_as_written(spec, overrides)  # a missing file is named as the user wrote it
    job = client_for(url, key_file).submit(job_spec, priority, name, as_written=written)
    if as_json:
        _print_json({"id": job["id"]})
    else:
        out_console.print(f"job {job['id']} queued", highlight=False)


@app.command()
def jobs(
    state: Annotated[str | None, typer.Option(help="only this state")] = None,
    url: Url = None,
    key_file: KeyFile = None,
    as_json: AsJson = False,
) -> None:
    """List jobs: id, name, project, state (and place in the queue), devices, step, loss, samples/s, cost,
    age; why a job waits: gpuforge job ID (its reason)."""
    rows = client_for(url, key_file).jobs(state)
    if as_json:
        _print_json(rows)
        return
    out_console.print(jobs_table(rows))


def jobs_table(rows: list[dict], title: str = "gpuforge jobs") -> Table:
    from datetime import UTC, datetime

    table = Table(title=title)
    columns = ("id", "name", "project", "state", "devices", "step", "loss", "samples/s", "cost $", "age")
    for column in columns:
        table.add_column(column)
    now = datetime.now(UTC)
    for j in rows:
        total = f"/{j['total_steps']}" if j["total_steps"] else ""  # a script job may not say its total
        step = "-" if j["step"] is None else f"{j['step']}{total}"
        devices = j["devices"] or f"{j['devices_wanted']} {j['device_type']}"
        age = (now - datetime.fromisoformat(j["created_at"])).total_seconds()
        state = j["state"] + (f" #{j['queue_position']}" if j.get("queue_position") else "")
        table.add_row(
            str(j["id"]), j["name"], j.get("project") or "-", state, devices, step,
            f"{j['loss']:.4f}" if j["loss"] is not None else "-",
            f"{j['samples_per_s']:.1f}" if j["samples_per_s"] is not None else "-",
            f"{j['cost_usd']:.4f}" if j["cost_usd"] is not None else "-",
            _age(age),
        )  # fmt: skip
    return table


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


@app.command()
def job(
    job_id: int,
    url: Url = None,
    key_file: KeyFile = None,
    as_json: AsJson = False,
    slurm_script: Annotated[
        bool, typer.Option("--slurm-script", help="the batch script its last attempt submitted to Slurm")
    ] = False,
) -> None:
    """One job, as JSON (indented; --json: on one line); or the Slurm batch script it ran."""
    if slurm_script:
        script = client_for(url, key_file).slurm_script(job_id)
        out_console.print(script, highlight=False, markup=False, end="")
        return
    found = client_for(url, key_file).job(job_id)
    if as_json:
        _print_json(found)
    else:
        out_console.print(json.dumps(found, indent=2), highlight=False, markup=False)


@app.command()
def cancel(
    job_id: int,
    wait: Annotated[
        bool, typer.Option("--wait/--no-wait", help="wait (a minute at most) for a running job to stop")
    ] = True,
    url: Url = None,
    key_file: KeyFile = None,
) -> None:
    """Cancel a job: a queued or paused one at once, a running one at its next step, after a checkpoint
    (`gpuforge resume` goes on from it)."""
    client = client_for(url, key_file)
    j = client.cancel(job_id)
    if j["state"] != "running":
        out_console.print(f"job {j['id']}: {j['state']}", highlight=False)
        return
    out_console.print(f"job {j['id']}: cancelling at its next step, after a checkpoint", highlight=False)
    if not wait:
        return
    deadline = time.monotonic() + CANCEL_WAIT_S
    while j["state"] == "running" and time.monotonic() < deadline:
        time.sleep(0.5)
        j = client.job(job_id)
    if j["state"] == "running":
        out_console.print(f"job {job_id}: still stopping after {CANCEL_WAIT_S:g} s", highlight=False)
        return
    at = f" at step {j['step']}" if j.get("step") is not None else ""
    then = f"; `gpuforge resume {job_id}` goes on from its checkpoint" if j["state"] == "cancelled" else ""
    out_console.print(f"job {job_id}: {j['state']}{at}{then}", highlight=False, markup=False)


@app.command()
def resume(
    job_id: int,
    budget: Annotated[
        float | None,
        typer.Option("--budget", help="a new cost.budget_usd above what it spent (else its own)"),
    ] = None,
    no_budget: Annotated[bool, typer.Option("--no-budget", help="lift its cost budget")] = False,
    url: Url = None,
    key_file: KeyFile = None,
) -> None:
    """Queue a paused job again (its cost budget spent: with a higher --budget), or a cancelled one that
    left a checkpoint; it goes on from its last checkpoint."""
    if budget is not None and no_budget:
        raise GpuforgeError("resume: --budget or --no-budget, not both")
    j = client_for(url, key_file).resume(job_id, budget, no_budget)
    out_console.print(f"job {j['id']}: {j['state']} ({j['reason']})", highlight=False, markup=False)


@app.command()
def logs(
    job_id: int,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="stream log and metrics lines live")] = False,
    tail: Annotated[int, typer.Option(help="log lines to show first")] = 50,
    url: Url = None,
    key_file: KeyFile = None,
) -> None:
    """A job's log; with --follow, new log and metrics lines as they come, until the job stops."""
    client = client_for(url, key_file)
    start = client.logs(job_id, tail)
    for line in start["lines"]:
        out_console.print(line, highlight=False, markup=False, soft_wrap=True)
    if not follow:
        return
    for event, data in client.follow(job_id, start["offset"]):
        if event == "log":
            out_console.print(data["line"], highlight=False, markup=False, soft_wrap=True)
        elif event == "metric":
            out_console.print(_metric_line(data), highlight=False, markup=False)
        elif event == "end":
            why = f" ({data['reason']})" if data.get("reason") else ""
            out_console.print(f"job {job_id} {data['state']}{why}", highlight=False, markup=False)


def _metric_line(m: dict) -> str:
    parts = [f"step {m.get('step')}"]
    for key, fmt in (("loss", "loss {:.4f}"), ("samples_per_s", "{:.1f} samples/s"), ("cost_usd", "${:.4f}")):
        if m.get(key) is not None:
            parts.append(fmt.format(m[key]))
    parts += [f"{k} {v:.4f}" for k, v in m.items() if k.startswith("eval_") and isinstance(v, float)]
    return "metrics: " + ", ".join(parts)


@app.command()
def wait(
    job_ids: Annotated[list[int], typer.Argument(help="job ids")],
    timeout: Annotated[float, typer.Option(help="seconds before giving up")] = 3600.0,
    url: Url = None,
    key_file: KeyFile = None,
    as_json: AsJson = False,
) -> None:
    """Wait until the jobs stop (finished, failed, cancelled, paused); exit 1 unless all finished."""
    client = client_for(url, key_file)
    deadline = time.monotonic() + timeout
    while True:
        rows = [client.job(i) for i in job_ids]
        if all(r["state"] in STOPPED for r in rows):
            break
        if time.monotonic() > deadline:
            raise GpuforgeError(f"wait: jobs still running after {timeout:g} s")
        time.sleep(1.0)
    if as_json:
        _print_json(rows)
    else:
        out_console.print(jobs_table(rows, title="jobs"))
    if any(r["state"] != "finished" for r in rows):
        raise typer.Exit(1)


def _energy_cells(kwh: float, co2e_g: float) -> tuple[str, str]:
    """kWh and gCO2e as the costs table shows them: "-" where nothing was measured (older rows) or no
    grid intensity is set, never 0 for unknown."""
    return (f"{kwh:.4f}" if kwh else "-", f"{co2e_g:.1f}" if co2e_g else "-")


@app.command()
def costs(
    project: Annotated[str | None, typer.Option(help="only this project's spend")] = None,
    by: Annotated[str, typer.Option(help="sum by day, key or project")] = "day",
    since: Annotated[
        str | None, typer.Option(help="first day, YYYY-MM-DD (UTC); default: 30 days ago")
    ] = None,
    url: Url = None,
    key_file: KeyFile = None,
    as_json: AsJson = False,
) -> None:
    """What jobs and replicas cost, from the server's ledger (charged minute by minute as they run): yours
    and your project's, or everyone's with an admin key; dollars and device-hours by day, key or project."""
    if by not in ("day", "key", "project"):
        raise GpuforgeError(f"--by {by}: give day, key or project")
    answer = client_for(url, key_file).costs(by, since, project)
    if as_json:
        _print_json(answer)
        return
    of = f", project {answer['project']}" if answer["project"] else ""
    table = Table(title=f"gpuforge costs, {answer['since']} to {answer['until']}{of}")
    for column in (by, "$", "device-hours", "kWh", "gCO2e", "jobs", "deployments"):
        table.add_column(column, justify="left" if column == by else "right")
    for g in answer["groups"]:
        name = g[by] or ("(no project)" if by == "project" else "-")
        usd = _usd_cell(g["usd"], g.get("unpriced", 0))
        energy = _energy_cells(g.get("kwh", 0.0), g.get("co2e_g", 0.0))
        table.add_row(name, usd, f"{g['device_hours']:.3f}", *energy, str(g["jobs"]), str(g["deployments"]))
    table.add_section()
    unpriced = answer.get("unpriced", [])
    total = _usd_cell(answer["total_usd"], len(unpriced))
    energy = _energy_cells(answer.get("total_kwh", 0.0), answer.get("total_co2e_g", 0.0))
    table.add_row("total", total, f"{answer['total_device_hours']:.3f}", *energy, "", "")
    out_console.print(table)
    for u in unpriced:
        out_console.print(f"no price set: {u['kind']} {u['id']} {u['name'] or ''} ran "
                          f"{u['device_hours']:.3f} {u['device_type']} device-hours, not costed",
                          highlight=False, markup=False, soft_wrap=True)  # fmt: skip
    for command in answer.get("set_price", []):
        out_console.print(f"set a price with: {command}", highlight=False, markup=False, soft_wrap=True)


def _usd_cell(usd: float, unpriced: int) -> str:
    """Dollars, never a bare $0 for time nobody priced: "no price set", or the priced part "+ N unpriced"."""
    if not unpriced:
        return f"{usd:.4f}"
    return "no price set" if usd == 0 else f"{usd:.4f} + {unpriced} unpriced"


keys_app = typer.Typer(no_args_is_help=True, help="API keys and their quotas (an admin key makes them).")
app.add_typer(keys_app, name="keys")
ProjectOption = Annotated[
    str | None,
    typer.Option("--project", help="its project (projects create NAME): members read each other's jobs"),
]
ROLES = ("viewer", "member", "maintainer")  # store/models.py Role: what each may do is docs/security.md's
RoleOption = Annotated[
    str | None,
    typer.Option(
        "--role",
        help="its role in its project: viewer (reads), member (and submits, changes its own), maintainer "
        "(and changes anyone's in the project, sets its members)",
        show_default=False,
    ),
]


def _check_role(role: str | None) -> None:
    if role is not None and role not in ROLES:
        raise GpuforgeError(f"--role: {role!r} is not one of {', '.join(ROLES)}")


def _with_quota_options(command):
    """Give a keys verb one --max-... option per quota of store/quotas.py QUOTAS (their names, bounds and
    help come from there alone); `command` receives those given as `quotas`, a dict by quota name."""
    options = [
        inspect.Parameter(
            q.name,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=None,
            annotation=Annotated[
                int | None,
                typer.Option(
                    q.option,
                    min=q.low,
                    max=q.high,
                    help=f"{q.help} (default for a non-admin key: {q.show(q.default)})",
                    show_default=False,
                ),
            ],
        )
        for q in QUOTAS
    ]
    signature = inspect.signature(command, eval_str=True)
    kept = [p for p in signature.parameters.values() if p.name != "quotas"]

    @functools.wraps(command)
    def with_quotas(**given: Any) -> None:
        quotas = {q.name: given.pop(q.name) for q in QUOTAS}
        command(**given, quotas={k: v for k, v in quotas.items() if v is not None})

    at = next((i for i, p in enumerate(kept) if p.name == "url"), len(kept))  # before the common options
    parameters = [*kept[:at], *options, *kept[at:]]
    with_quotas.__signature__ = signature.replace(parameters=parameters)  # what typer reads
    with_quotas.__annotations__ = {p.name: p.annotation for p in parameters}
    return with_quotas


def _quotas_line(k: dict) -> str:
    return ", ".join(f"{q.name} {q.show(k[q.name])}" for q in QUOTAS)


@keys_app.command("create")
@_with_quota_options
def keys_create(
    name: str,
    quotas: dict[str, int],
    admin: Annotated[
        bool, typer.Option(help="an admin key: sees all jobs, makes keys, has no quotas")
    ] = False,
    project: ProjectOption = None,
    role: RoleOption = None,
    url: Url = None,
    key_file: KeyFile = None,
    as_json: AsJson = False,
) -> None:
    """Make a key, with its quotas (those not given: the defaults), project and role (default member); it
    is printed this once and stored as a digest only."""
    if admin and project is not None:
        raise GpuforgeError("--project: an admin key belongs to no project (it sees every project already)")
    _check_role(role)
    made = client_for(url, key_file).create_key(name, admin, quotas, project, role)
    if as_json:
        _print_json(made)
    else:
        out_console.print(made["key"], highlight=False, markup=False)


@keys_app.command("set")
@_with_quota_options
def keys_set(
    name: str,
    quotas: dict[str, int],
    project: ProjectOption = None,
    no_project: Annotated[
        bool, typer.Option("--no-project", help="out of its project (its jobs made so far stay there)")
    ] = False,
    role: RoleOption = None,
    url: Url = None,
    key_file: KeyFile = None,
    as_json: AsJson = False,
) -> None:
    """Change a key's quotas, project or role (those given); they hold from its next request on."""
    if project is not None and no_project:
        raise GpuforgeError("--project and --no-project: give one of them")
    _check_role(role)
    changes: dict[str, int | str | None] = dict(quotas)
    if project is not None or no_project:
        changes["project"] = project
    if role is not None:
        changes["role"] = role
    if not changes:
        options = ", ".join(["--project", "--role", *(q.option for q in QUOTAS)])
        raise GpuforgeError(f"keys set {name}: nothing to change; give {options}")
    changed = client_for(url, key_file).set_key(name, changes)
    if as_json:
        _print_json(changed)
        return
    moved = f"project {changed['project'] or 'none'}, " if "project" in changes else ""
    moved += f"role {changed['role']}, " if "role" in changes else ""
    out_console.print(f"key {changed['name']}: {moved}{_quotas_line(changed)}", highlight=False, markup=False)


@keys_app.command("list")
def keys_list(url: Url = None, key_file: KeyFile = None, as_json: AsJson = False) -> None:
    """The keys by name (never the keys themselves), with the quotas in force ("none": no limit)."""
    rows = client_for(url, key_file).keys()
    if as_json:
        _print_json(rows)
        return
    table = Table(title="API keys")
    for column in ("id", "name", "role", "project", "created", "revoked", *(q.name for q in QUOTAS)):
        table.add_column(column)
    for k in rows:
        revoked = (k.get("revoked_at") or "")[:19]
        table.add_row(
            str(k["id"]), k["name"], "admin" if k["admin"] else k["role"], k.get("project") or "",
            k["created_at"][:19], revoked, *(q.show(k[q.name]) for q in QUOTAS),
        )  # fmt: skip
    out_console.print(table)


@keys_app.command("revoke")
def keys_revoke(name: str, url: Url = None, key_file: KeyFile = None) -> None:
    """Revoke a key: it opens nothing from now on; its jobs and deployments stay."""
    revoked = client_for(url, key_file).revoke_key(name)
    out_console.print(f"key {revoked['name']}: revoked", highlight=False, markup=False)


projects_app = typer.Typer(
    no_args_is_help=True,
    help="Projects: teams with a month's budget, a device cap and a fair share (an admin key makes them).",
)
app.add_typer(projects_app, name="projects")
Budget = Annotated[
    float | None,
    typer.Option(min=0, help="USD a month (UTC): at it, the project's jobs pause", show_default=False),
]
MaxDevices = Annotated[
    int | None, typer.Option(min=0, help="devices its jobs hold at once at most", show_default=False)
]
Share = Annotated[
    float | None,
    typer.Option(help="fair-share weight, > 0: 2 gets twice the device-time of 1", show_default=False),
]


def _check_share(share: float | None) -> None:
    if share is not None and not share > 0:  # click's ranges have no open bound for typer to pass on
        raise GpuforgeError(f"--share: must be > 0, not {share:g}")


def _project_line(p: dict) -> str:
    budget = f"${p['budget_usd_month']:g}/month" if p["budget_usd_month"] is not None else "none"
    cap = p["max_devices"] if p["max_devices"] is not None else "none"
    return f"project {p['name']}: budget {budget}, max_devices {cap}, share {p['share']:g}"


@projects_app.command("create")
def projects_create(
    name: str,
    budget_usd_month: Budget = None,
    max_devices: MaxDevices = None,
    share: Share = None,
    url: Url = None,
    key_file: KeyFile = None,
    as_json: AsJson = False,
) -> None:
    """Make a project (no budget, no cap and share 1 unless given); keys join it with --project."""
    _check_share(share)
    given = {"budget_usd_month": budget_usd_month, "max_devices": max_devices, "share": share}
    made = client_for(url, key_file).create_project(name, {k: v for k, v in given.items() if v is not None})
    if as_json:
        _print_json(made)
    else:
        out_console.print(_project_line(made), highlight=False, markup=False)


@projects_app.command("list")
def projects_list(url: Url = None, key_file: KeyFile = None, as_json: AsJson = False) -> None:
    """Projects (a member key: its own): spend this month, budget, devices held, jobs queued and running."""
    rows = client_for(url, key_file).projects()
    if as_json:
        _print_json(rows)
        return
    table = Table(title="projects")
    for column in ("name", "spent this month $", "budget $", "devices", "queued", "running", "share", "keys"):
        table.add_column(column)
    for p in rows:
        budget = f"{p['budget_usd_month']:.2f}" if p["budget_usd_month"] is not None else "none"
        devices = f"{p['devices_held']:g}/{p['max_devices'] if p['max_devices'] is not None else '-'}"
        table.add_row(
            p["name"], f"{p['spend_usd_month']:.4f}", budget, devices, str(p["jobs_queued"]),
            str(p["jobs_running"]), f"{p['share']:g}",
            ", ".join(f"{k} ({p['roles'].get(k, '?')})" for k in p["keys"]),
        )  # fmt: skip
    out_console.print(table)


@projects_app.command("member")
def projects_member(
    project: str,
    key: Annotated[str, typer.Argument(help="the key's name")],
    role: Annotated[str | None, typer.Option(help="viewer, member or maintainer", show_default=False)] = None,
    remove: Annotated[bool, typer.Option("--remove", help="take the key out of the project")] = False,
    url: Url = None,
    key_file: KeyFile = None,
    as_json: AsJson = False,
) -> None:
    """Put a key in a project with a role, change its role, or take it out (--remove): a maintainer of the
    project, or an admin key. A maintainer takes in keys that are in no project."""
    if remove == (role is not None):
        raise GpuforgeError("projects member: give --role ROLE, or --remove")
    _check_role(role)
    api = client_for(url, key_file)
    changed = api.remove_member(project, key) if remove else api.set_member(project, key, role)
    if as_json:
        _print_json(changed)
        return
    members = ", ".join(f"{k} ({changed['roles'].get(k, '?')})" for k in changed["keys"]) or "none"
    out_console.print(f"project {changed['name']}: {members}", highlight=False, markup=False)


@app.command()
def audit(
    project: Annotated[str | None, typer.Option(help="a project's rows")] = None,
    actor: Annotated[str | None, typer.Option(help="a key's rows, by its name")] = None,
    action: Annotated[str | None, typer.Option(help="one action, as jobs.cancel")] = None,
    since: Annotated[
        str | None, typer.Option(help="rows at or after: ISO 8601 (2026-12-01, 2026-12-01T09:00:00Z)")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="rows at most")] = 100,
    url: Url = None,
    key_file: KeyFile = None,
    as_json: AsJson = False,
) -> None:
    """The audit log, newest first: who changed what, when, from where, before and after (an admin key
    reads every row, a maintainer its project's)."""
    rows = client_for(url, key_file).audit(
        project=project, actor=actor, action=action, since=since, limit=limit
    )
    if as_json:
        _print_json(rows)
        return
    table = Table(title="audit log")
    for column in ("id", "at (UTC)", "actor", "from", "action", "target", "project", "change"):
        table.add_column(column)
    for r in rows:
        change = _change_text(r.get("before"), r.get("after"))
        if r["outcome"] != "done":
            change = f"{r['outcome']}: {change}"
        table.add_row(
            str(r["id"]), r["at"][:19], r["actor"], r["source"], r["action"], r["target"],
            r.get("project") or "", change,
        )  # fmt: skip
    out_console.print(table)


def _change_text(before: dict | None, after: dict | None) -> str:
    """before -> after, field by field (only those that differ where both are given)."""
    before, after = before or {}, after or {}
    fields = [k for k in {**before, **after} if before.get(k) != after.get(k) or k not in before]
    shown = []
    for field in fields:
        if field in before:
            shown.append(f"{field} {before.get(field)} -> {after.get(field)}")
        else:
            shown.append(f"{field} {after.get(field)}")
    return "; ".join(shown)


@projects_app.command("set")
def projects_set(
    name: str,
    budget_usd_month: Budget = None,
    no_budget: Annotated[bool, typer.Option("--no-budget", help="no month's budget")] = False,
    max_devices: MaxDevices = None,
    no_max_devices: Annotated[bool, typer.Option("--no-max-devices", help="no device cap")] = False,
    share: Share = None,
    url: Url = None,
    key_file: KeyFile = None,
    as_json: AsJson = False,
) -> None:
    """Change a project's budget, device cap or share (those given); the scheduler holds to them within
    seconds: a raised budget lets its paused jobs be resumed and its queued ones start."""
    _check_share(share)
    changes: dict[str, float | int | None] = {}
    for option, value, none_option, cleared in (
        ("budget_usd_month", budget_usd_month, "--no-budget", no_budget),
        ("max_devices", max_devices, "--no-max-devices", no_max_devices),
    ):
        if value is not None and cleared:
            raise GpuforgeError(f"--{option.replace('_', '-')} and {none_option}: give one of them")
        if value is not None or cleared:
            changes[option] = value
    if share is not None:
        changes["share"] = share
    if not changes:
        raise GpuforgeError(
            f"projects set {name}: nothing to change; give --budget-usd-month, --no-budget, --max-devices, "
            "--no-max-devices or --share"
        )
    changed = client_for(url, key_file).set_project(name, changes)
    if as_json:
        _print_json(changed)
    else:
        out_console.print(_project_line(changed), highlight=False, markup=False)
