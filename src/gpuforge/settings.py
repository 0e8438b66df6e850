"""Every GPUFORGE_* environment variable in one table: its type, default, meaning and who reads it.

    from gpuforge.settings import current
    current().cpu_slots          # as this process's environment holds it now, parsed as the table says

`Environment`'s fields are the table; README.md's "Environment variables" section is rendered from it
(`python -m gpuforge.settings` prints it; tests/test_settings.py fails when they differ). `gpuforge server`
reads its options at once through `ServerOptions` (server/settings.py builds on it). Every other read goes
through `current()`, which parses a variable only when it is asked for: a bad value is an error only in a
process that uses it (`gpuforge submit` has no use for GPUFORGE_PORT), and what a test or a parent process
changed shows at the next read. An empty variable reads as unset (but GPUFORGE_CONFINE_ROOTS: no roots).

Internal variables are how gpuforge tells the processes it starts (a job's runner, its ranks, a replica)
what they may do and which attempt they belong to; `as_environment()` writes them in the form `current()`
reads back. No module sets a variable to tell another module of its own process something: it passes the
value.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, cast, get_args, get_origin

from pydantic import AfterValidator, BeforeValidator, Field, SecretStr, TypeAdapter, ValidationError
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpuforge.errors import GpuforgeError

PREFIX = "GPUFORGE_"
LOOPBACK, SERVER_PORT = "127.0.0.1", 8600
Kind = Literal["user", "internal", "development"]
KIND_TITLES: dict[Kind, str] = {
    "user": "Set by you",
    "internal": "Set by gpuforge for the processes it starts (internal: to explain what a child is told)",
    "development": "Read by scripts/ and tests/ only, never by gpuforge itself",
}


def setting(
    default: Any = PydanticUndefined,
    *,
    meaning: str,
    read_by: str,
    kind: Kind = "user",
    shown_default: str | None = None,
    empty_is_unset: bool = True,
    **field: Any,
) -> Any:
    """One row of the table. `shown_default` is how README shows a default computed at run time;
    `empty_is_unset=False` keeps an empty value as a value (no roots at all, rather than none given)."""
    extra = dict(read_by=read_by, kind=kind, shown_default=shown_default, empty_is_unset=empty_is_unset)
    return Field(default, description=meaning, json_schema_extra=extra, **field)


def _expanded(path: Path) -> Path:
    return path.expanduser().absolute()


def _paths(value: Any) -> Any:
    """An os.pathsep-separated string ("a:b", empty parts skipped) as paths; others as pydantic takes them."""
    return tuple(Path(p) for p in value.split(os.pathsep) if p) if isinstance(value, str) else value


def _is_yes(value: Any) -> Any:
    """What `--verbose` took from its variable as yes (click's words); anything else is no."""
    return value.strip().lower() in ("1", "true", "t", "yes", "y", "on") if isinstance(value, str) else value


def _not_zero(value: Any) -> Any:
    return value != "0" if isinstance(value, str) else value


class ServerOptions(BaseSettings):
    """What `gpuforge server` reads (its options override them); validated together when it starts."""

    model_config = SettingsConfigDict(env_prefix=PREFIX, env_ignore_empty=True)  # as current() reads them

    home: Annotated[Path, AfterValidator(_expanded)] = setting(
        Path("~/.gpuforge"),
        validate_default=True,
        meaning="the server's store (SQLite), runs/, uploads/ and admin.key, made mode 0700; "
        "with a Ray cluster, on a filesystem every node sees",
        read_by="`gpuforge server`",
    )
    host: str = setting(
        LOOPBACK,
        meaning="the address it listens on; beyond loopback only once the store has an admin key",
        read_by="`gpuforge server`",
    )
    port: int = setting(SERVER_PORT, meaning="the TCP port it listens on", read_by="`gpuforge server`")
    db: str | None = setting(
        None,
        meaning="the store's URL (one with a password here or in --db-file, never on the command line)",
        read_by="`gpuforge server`",
        shown_default="SQLite in GPUFORGE_HOME",
    )
    data_roots: str = setting(
        "",
        meaning="the directories (os.pathsep-separated) a spec may read data and models from",
        read_by="`gpuforge server`",
    )
    max_body_bytes: int = setting(
        64 * 2**20, meaning="an upload over it is refused (413)", read_by="`gpuforge server`"
    )
    max_request_bytes: int = setting(
        2**20,
        meaning="any other request body over it is refused (413): a spec (256 KiB at most), predictions",
        read_by="`gpuforge server`",
    )
    max_streams_per_key: int = setting(
        8, meaning="live log/metrics streams one key may hold open (429 past it)", read_by="`gpuforge server`"
    )
    public_metrics: bool = setting(
        False,
        meaning="/metrics, /docs and /openapi.json answer without a key",
        read_by="`gpuforge server`, `gpuforge serve`",
    )
    schedule: bool = setting(
        True,
        meaning="run queued jobs (false: an API-only server, for tests of the API alone)",
        read_by="`gpuforge server`",
    )
    admin_key: str | None = setting(
        None,
        meaning="the admin key of a new store, instead of making admin.key (gf_ and 32+ characters)",
        read_by="`gpuforge server`",
    )
    allow_user_code: bool = setting(
        False,
        meaning="any key may submit python: models and trust_remote_code (they run as the server's user)",
        read_by="`gpuforge server`",
    )
    replica_ports: str | None = setting(
        None,
        pattern=r"^\d{1,5}-\d{1,5}$",
        meaning="the loopback ports deployment replicas listen on, FIRST-LAST (e.g. 41000-41099), for a "
        "firewall or a port plan",
        read_by="`gpuforge server`",
        shown_default="any free port",
    )
    fair_share_half_life_s: float = setting(
        3600.0,
        gt=0,
        meaning="fair share: a job's device-time weighs half as much for each of these seconds since it ran",
        read_by="`gpuforge server`",
    )
    device_labels: str = setting(
        "",
        meaning="labels of this machine's devices for placement, e.g. site=onprem,gpu=h100 (all of them), "
        "or cuda:0=gpu=h100;cpu=site=edge (per device id or kind, `;`-separated)",
        read_by="`gpuforge server`",
    )
    max_preemptions: int = setting(
        3,
        ge=0,
        meaning="a job preempted this many times in a row is lifted to the priority of the job that last "
        "preempted it",
        read_by="`gpuforge server`",
    )
    executor: Literal["local", "ray", "slurm"] = setting(
        "local",
        meaning="where jobs' processes run: on this machine, on a Ray cluster, or as Slurm jobs",
        read_by="`gpuforge server`, its job runners",
    )
    ray_address: str | None = setting(
        None,
        meaning="HOST:PORT of the Ray cluster's head, for executor ray",
        read_by="`gpuforge server`, its job runners",
    )
    slurm_partition: str | None = setting(
        None, meaning="the Slurm partition jobs are submitted to (executor slurm; default: Slurm's)",
        read_by="`gpuforge server` (its devices), its job runners",
    )  # fmt: skip
    slurm_account: str | None = setting(
        None,
        meaning="the Slurm account jobs are charged to (executor slurm)",
        read_by="`gpuforge server`, its job runners",
    )
    slurm_qos: str | None = setting(
        None,
        meaning="the Slurm QOS jobs are submitted with (executor slurm)",
        read_by="`gpuforge server`, its job runners",
    )
    oidc_issuer: str | None = setting(
        None,
        meaning="single sign-on: the OpenID Connect issuer's URL, exactly as its discovery document names it "
        "(https; http only on loopback)",
        read_by="`gpuforge server`",
        shown_default="unset: API keys only",
    )
    oidc_client_id: str | None = setting(
        None,
        meaning="single sign-on: gpuforge's client id at the issuer (the dashboard's, a confidential client)",
        read_by="`gpuforge server`",
    )
    oidc_cli_client_id: str | None = setting(
        None,
        meaning="single sign-on: the client id `gpuforge login` signs in as (a public client, no secret)",
        read_by="`gpuforge server`",
        shown_default="GPUFORGE_OIDC_CLIENT_ID",
    )
    oidc_client_secret: SecretStr | None = setting(
        None,
        meaning="single sign-on: the dashboard client's secret (or --oidc-client-secret-file; never on the "
        "command line)",
        read_by="`gpuforge server`",
    )
    oidc_client_secret_file: Path | None = setting(
        None,
        meaning="single sign-on: a file whose first line is that secret",
        read_by="`gpuforge server`",
    )
    oidc_scopes: str = setting(
        "openid profile email",
        meaning="single sign-on: the scopes asked for (space-separated; openid is always among them)",
        read_by="`gpuforge server`",
    )
    oidc_groups_claim: str = setting(
        "groups",
        meaning="single sign-on: the ID token's claim that lists the user's groups",
        read_by="`gpuforge server`",
    )
    oidc_roles: str = setting(
        "",
        meaning="single sign-on: projects and roles from the groups claim, `GROUP=PROJECT:ROLE` or "
        "`GROUP=admin`, comma-separated (`ml-team=vision:member,ml-leads=vision:maintainer,ops=admin`)",
        read_by="`gpuforge server`",
        shown_default="none: the server's own table alone (`gpuforge projects member`)",
    )
    oidc_redirect_uri: str | None = setting(
        None,
        meaning="single sign-on: the dashboard's callback URL as registered at the issuer, for a server "
        "behind a proxy",
        read_by="`gpuforge server`",
        shown_default="the request's own URL of /auth/oidc/callback",
    )

    smtp_host: str | None = setting(
        None,
        meaning="the SMTP server email notifications are handed to (docs/notifications.md); none: email "
        "targets' deliveries fail saying so",
        read_by="`gpuforge server`",
    )
    smtp_port: int = setting(587, ge=1, le=65535, meaning="its port", read_by="`gpuforge server`")
    smtp_from: str | None = setting(
        None, meaning="the From address of email notifications", read_by="`gpuforge server`"
    )
    smtp_user: str | None = setting(
        None, meaning="the user it logs in as (none: no login)", read_by="`gpuforge server`"
    )
    smtp_password: str | None = setting(
        None,
        meaning="that user's password, from the environment (or GPUFORGE_SMTP_PASSWORD_FILE), never a "
        "command line",
        read_by="`gpuforge server`",
    )
    smtp_password_file: Path | None = setting(
        None, meaning="a file whose first line is that password", read_by="`gpuforge server`"
    )
    smtp_starttls: bool = setting(
        True,
        meaning="upgrade the SMTP connection with STARTTLS before logging in and sending (false: a relay "
        "on a trusted network that has none)",
        read_by="`gpuforge server`",
    )


class Environment(ServerOptions):
    """The whole table: the server's options and every other variable. Read it through `current()`."""

    cpu_slots: int | None = setting(
        None,
        meaning="CPU jobs that run at once, each on an equal share of the cores (on Ray: a cap on the slots)",
        read_by="`gpuforge server`",
        shown_default="1; on a Ray cluster, its cores",
    )
    mps: Annotated[bool, BeforeValidator(_is_yes)] = setting(
        False,
        meaning="the admin runs NVIDIA's MPS control daemon: a job on a fraction of a GPU gets that share of "
        "its compute through MPS (else the fractions are time-sliced)",
        read_by="`gpuforge server`",
    )
    grid_gco2e_per_kwh: str | None = setting(
        None,
        meaning="the grid's carbon intensity in gCO2e/kWh, for the CO2e beside each run's energy: one "
        "number, or per site label `onprem=350,edge=50` (a device's `site` label picks; `*=` any other)",
        read_by="`gpuforge server`",
    )
    url: str = setting(
        f"http://{LOOPBACK}:{SERVER_PORT}",
        meaning="the server the client verbs talk to (or --url)",
        read_by="client verbs (`submit`, `jobs`, ...)",
    )
    api_key: str | None = setting(
        None,
        meaning="the key the client verbs present, and the one `gpuforge serve` asks for "
        "(or --api-key-file; never on the command line)",
        read_by="client verbs, `gpuforge serve`",
    )
    verbose: Annotated[bool, BeforeValidator(_is_yes)] = setting(
        False,
        meaning="third-party warnings, log lines and progress bars too (as --verbose)",
        read_by="every command",
    )
    cache_dir: Path = setting(
        default_factory=lambda: Path.home() / ".cache" / "gpuforge",
        meaning="where each machine's measured device speed is kept",
        read_by="commands that train",
        shown_default="~/.cache/gpuforge",
    )
    user_code: Annotated[bool, BeforeValidator(_not_zero)] = setting(
        True,
        meaning="0: no python: models and no trust_remote_code (a job or replica of a key that is not admin)",
        read_by="job runners, replicas",
        kind="internal",
    )
    confine_roots: Annotated[tuple[Path, ...] | None, BeforeValidator(_paths)] = setting(
        None,
        meaning="the only directories (os.pathsep-separated) whose files it may read; empty: none at all",
        read_by="job runners, replicas",
        kind="internal",
        shown_default="unset: any file",
        empty_is_unset=False,
    )
    confine_excluded: Annotated[tuple[Path, ...], BeforeValidator(_paths)] = setting(
        (),
        meaning="places inside those roots it may not read (the server's home), but for a root inside them",
        read_by="job runners, replicas",
        kind="internal",
    )
    restart: int | None = setting(
        None,
        meaning="which restart of a job's ranks this is",
        read_by="ranks",
        kind="internal",
        shown_default="TORCHELASTIC_RESTART_COUNT, else 0",
    )
    attempt: str | None = setting(
        None,
        meaning="the launch attempt's id, in summary.json: tells this attempt's summary from an older one",
        read_by="ranks",
        kind="internal",
    )
    torch: str = setting(
        "torch==2.13.0",
        meaning="the torch requirement installed first (a CPU build here; set to taste elsewhere)",
        read_by="scripts/setup.sh",
        kind="development",
    )
    venv: str = setting(
        ".venv",
        meaning="the virtual environment the scripts set up and use",
        read_by="scripts/setup.sh, test.sh, demo.sh",
        kind="development",
    )
    unlocked: str | None = setting(
        None,
        meaning="1: install the newest versions pyproject.toml admits, not the lock's (.ci/run --latest)",
        read_by="scripts/setup.sh",
        kind="development",
    )
    test_postgres_url: str | None = setting(
        None,
        meaning="a PostgreSQL server the store's tests run on too; set but empty: those cases are skipped",
        read_by="scripts/test.sh, tests",
        kind="development",
        shown_default="unset: scripts/test.sh starts one (scripts/postgres.sh)",
    )
    require_postgres: str | None = setting(
        None,
        meaning="1: the PostgreSQL cases fail, rather than skip, without a server (as under CI)",
        read_by="tests",
        kind="development",
    )
    require_browser: str | None = setting(
        None,
        meaning="1: the dashboard's browser tests fail, rather than skip, without Chromium (as under CI)",
        read_by="tests",
        kind="development",
    )
    require_opencl: str | None = setting(
        None,
        meaning="1: the OpenCL tests fail, rather than skip, without an OpenCL device (as under CI)",
        read_by="tests",
        kind="development",
    )
    require_tensorflow: str | None = setting(
        None,
        meaning="1: the Keras script job's test fails, rather than skips, without tensorflow (as under CI)",
        read_by="tests",
        kind="development",
    )
    require_slurm: str | None = setting(
        None,
        meaning="1: the Slurm tests fail, rather than skip, where scripts/slurm.sh cannot start a cluster "
        "(as under CI)",
        read_by="tests",
        kind="development",
    )
    run_dir: str | None = setting(
        None,
        meaning="a script job's run directory, set by its runner (where gpuforge.track writes)",
        read_by="script jobs (gpuforge.track)",
        kind="internal",
    )
    job_id: int | None = setting(
        None,
        meaning="the server's id of the job, set by the server for its runner (track.job_id(); a paused "
        "job's log names `gpuforge resume ID`)",
        read_by="job runners, script jobs (gpuforge.track)",
        kind="internal",
    )
    cpu_cores: str | None = setting(
        None,
        meaning="the cores a job or replica on a fraction of a CPU slot is pinned to (set by the server; "
        "the process pins itself at start)",
        read_by="job runners, replicas",
        kind="internal",
    )
    cpu_nice: str | None = setting(
        None,
        meaning="the nice a training job on a share of a CPU slot runs at (set by the server: serving and "
        "the server's own threads go first on shared cores)",
        read_by="job runners",
        kind="internal",
    )
    device_share: str | None = setting(
        None,
        meaning="the fraction of its device a job or replica holds (set by the server): its energy per step",
        read_by="job runners, replicas",
        kind="internal",
    )
    cuda_memory_fraction: str | None = setting(
        None,
        meaning="a fraction of a GPU: the cap PyTorch's allocator is given in every rank (set by the server)",
        read_by="job runners",
        kind="internal",
    )
    cuda_memory_cap: str | None = setting(
        None,
        meaning="the same cap in bytes, named when a job runs out of memory under it (set by the server)",
        read_by="job runners",
        kind="internal",
    )
    device_watts: str | None = setting(
        None,
        meaning="what the job's whole device draws under load, for an energy estimate per step (set by the "
        "server from prices.yaml or the catalog)",
        read_by="job runners",
        kind="internal",
    )
    device_watts_from: str | None = setting(
        None,
        meaning="where those watts come from (set by the server), named beside every estimate",
        read_by="job runners",
        kind="internal",
    )
    pg_dir: str | None = setting(
        None,
        meaning="the directory of the tests' PostgreSQL cluster",
        read_by="scripts/postgres.sh",
        kind="development",
        shown_default="$TMPDIR/gpuforge-pg-<owner>",
    )
    pg_port: int = setting(
        55432, meaning="its port (or the next free one)", read_by="scripts/postgres.sh", kind="development"
    )
    slurm_dir: str | None = setting(
        None,
        meaning="the directory of the tests' one-node Slurm cluster (its slurm.conf, state, logs)",
        read_by="scripts/slurm.sh",
        kind="development",
        shown_default="$TMPDIR/gpuforge-slurm",
    )


@dataclass(frozen=True)
class Variable:
    """One row of the table, as README shows it."""

    name: str  # GPUFORGE_CPU_SLOTS
    field: str  # cpu_slots: the attribute of current()
    type: str
    default: str
    meaning: str
    read_by: str
    kind: Kind

    @property
    def internal(self) -> bool:
        return self.kind == "internal"


def env_name(field: str) -> str:
    """The variable a field of the table is read from: cpu_slots -> GPUFORGE_CPU_SLOTS."""
    if field not in Environment.model_fields:
        raise KeyError(f"{field}: not a gpuforge setting (see gpuforge/settings.py)")
    return PREFIX + field.upper()


def variables() -> tuple[Variable, ...]:
    return tuple(
        Variable(
            env_name(field),
            field,
            _type_name(info.annotation),
            info.json_schema_extra["shown_default"] or _shown(info.get_default(call_default_factory=True)),
            info.description,
            info.json_schema_extra["read_by"],
            info.json_schema_extra["kind"],
        )
        for field, info in Environment.model_fields.items()
    )


class _Now:
    """Environment's fields as attributes, each read from `environ` and parsed when it is asked for."""

    def __init__(self, environ: Mapping[str, str]):
        self._environ = environ

    def __getattr__(self, field: str) -> Any:
        if field not in Environment.model_fields:
            raise AttributeError(field)
        info, name = Environment.model_fields[field], env_name(field)
        raw = self._environ.get(name)
        if raw is None or (raw == "" and info.json_schema_extra["empty_is_unset"]):
            default = info.get_default(call_default_factory=True)
            return _parser(field).validate_python(default) if info.validate_default else default
        try:
            return _parser(field).validate_python(raw)
        except ValidationError as err:  # the variable, not pydantic's name for the field; never the value
            raise GpuforgeError(f"{name}: {err.errors()[0]['msg']}") from None


def current(environ: Mapping[str, str] | None = None) -> Environment:
    """The variables as `environ` (default: this process's environment) holds them at each read."""
    # a stand-in that reads each attribute as Environment declares it, but only when asked for (module doc)
    return cast(Environment, _Now(os.environ if environ is None else environ))


def as_environment(**values: Any) -> dict[str, str]:
    """Fields of the table as the variables a child process is given, in the form `current()` reads back:
    booleans as 1/0, paths os.pathsep-joined; a None is left out (the child reads the default)."""
    env = {}
    for field, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            text = "1" if value else "0"
        elif isinstance(value, tuple | list):
            text = os.pathsep.join(map(str, value))
        else:
            text = str(value)
        env[env_name(field)] = text
    return env


def markdown_table() -> str:
    """README's tables of the variables, one per kind."""
    header = "| Variable | Default | Type | Read by | Meaning |\n|---|---|---|---|---|"
    tables = []
    for kind, title in KIND_TITLES.items():
        rows = "".join(
            f"\n| `{v.name}` | {v.default} | {v.type} | {v.read_by} | {v.meaning} |"
            for v in variables()
            if v.kind == kind
        )
        tables.append(f"{title}:\n\n{header}{rows}")
    return "\n\n".join(tables)


@cache
def _parser(field: str) -> TypeAdapter:
    info = Environment.model_fields[field]  # its type, with the validators Annotated gave it
    return TypeAdapter(Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation)


def _shown(default: Any) -> str:
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return "`true`" if default else "`false`"
    if default in ("", ()):
        return "empty"
    return f"`{default}`"


def _type_name(annotation: Any) -> str:
    if get_origin(annotation) in (Union, UnionType):  # X | None: None is "unset"
        return " or ".join(_type_name(a) for a in get_args(annotation) if a is not type(None))
    if get_origin(annotation) is Literal:
        return " or ".join(f"`{a}`" for a in get_args(annotation))
    if get_origin(annotation) is tuple:
        return "paths"
    names = {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        Path: "path",
        SecretStr: "secret",
    }
    return names[annotation]


if __name__ == "__main__":
    print(markdown_table())
