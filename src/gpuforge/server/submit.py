"""Admission of a submit: every rule a job must pass before it is queued, in one place, and the job queued.

In order: the spec read with bounded work (no YAML aliases, a cap on values and nesting) and parsed; the
key's policy (admission.py: model options, files, user code); the uploads it names being its project's
own; its data and hf: model found; the devices it asks for existing here, and matching its placement;
`preemptible: false` for admin keys alone; the price it is charged filled in by the server; the key's
quotas; and an Idempotency-Key's replay (the job an earlier submit with it queued, never a second one).

A refusal is an HTTPException with the status and words the API answers; `admit` returns what the route
turns into its answer."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import yaml
from fastapi import HTTPException, status
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpuforge.admission import check_script, check_spec
from gpuforge.data.columns import check_columns
from gpuforge.errors import GpuforgeError, ModelError, SpecError
from gpuforge.launch.shipped import entry_not_sent
from gpuforge.server.pricing import prices_of
from gpuforge.server.refusals import quota_refusal
from gpuforge.server.schemas import JobCreate
from gpuforge.server.settings import Settings, job_policy
from gpuforge.spec import JobSpec, ScriptJobSpec, parse_spec
from gpuforge.store import jobs
from gpuforge.store.db import session
from gpuforge.store.ingest import in_users_names
from gpuforge.store.models import ApiKey, Job
from gpuforge.store.quotas import check_job
from gpuforge.store.uploads import may_use, split_name

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from gpuforge.scheduler.allocator import DeviceInfo
    from gpuforge.server.services import Services

MAX_SPEC_BYTES = 256 * 2**10  # a spec is a page of YAML; its data travel as uploads
MAX_SPEC_NODES = 2000  # values in a spec (a real one holds a few dozen): past it, no more work is done
MAX_SPEC_DEPTH = 32  # levels of nesting (a real spec has four)
_OPENS = (yaml.MappingStartEvent, yaml.SequenceStartEvent)
_CLOSES = (yaml.MappingEndEvent, yaml.SequenceEndEvent)


@dataclass(frozen=True)
class Server:
    """What admission reads of the server: its settings, its devices and its store."""

    settings: Settings
    devices: Sequence[DeviceInfo]
    engine: Engine
    # its jobs' ranks run on this machine (the executor launches none elsewhere): fractions of a device can
    # be isolated here, and the energy they use measured
    ranks_here: bool = True

    @classmethod
    def of(cls, state: Services) -> Server:
        scheduler = state.scheduler
        here = scheduler is None or not scheduler.executor.launches_ranks
        return cls(state.settings, state.devices, state.engine, here)


@dataclass(frozen=True)
class Admitted:
    job: Job  # read by the answer after its session closed (owner and project loaded)
    replayed: bool  # queued by an earlier submit with the same Idempotency-Key: 200, not 201


def admitted_job(body: JobCreate, key: ApiKey, server: Server) -> tuple[JobSpec | ScriptJobSpec, Job]:
    """The spec `body` sends, checked by every rule but the quotas, and the job it would queue (not
    stored: its run_dir unset); an HTTPException for any rule it fails."""
    spec = _parse(body, key, server)
    device_type = _device_type(spec, server.devices)
    _check_devices(spec, device_type, server.devices)
    _check_placement(spec, device_type, server.devices)
    if spec.resources.share is not None and not server.ranks_here:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            f"resources.devices: {spec.resources.devices}: fractions of a device run on this machine's "
            "devices; this server's executor runs ranks on a cluster's nodes, which place them on whole "
            "devices",
        )
    if not spec.resources.preemptible and not key.admin:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            "resources.preemptible: false is for admin keys (a job nobody can "
            "preempt holds its devices against every priority)",
        )
    usd_per_kwh, energy_part = _fill_price(spec, device_type, key, server)
    if not server.ranks_here:  # its ranks run on other machines: no kWh measured, the hourly rate whole
        usd_per_kwh, energy_part = None, 0.0
    priority = body.priority if body.priority is not None else spec.priority
    return spec, Job(
        name=body.name or spec.name,
        owner_id=key.id,
        project_id=key.project_id,
        priority=priority,
        device_type=device_type,
        devices_wanted=spec.resources.processes,
        device_share=spec.resources.share,
        usd_per_hour=(spec.cost.usd_per_hour - energy_part) * spec.resources.devices,
        usd_per_kwh=usd_per_kwh,
        preemptible=spec.resources.preemptible,
        max_time_s=spec.resources.max_time_s,
        placement=dict(spec.resources.placement) or None,
        spec_yaml=spec.to_yaml(),
        run_dir="",
        files=body.files,
    )


def admit(
    body: JobCreate,
    key: ApiKey,
    idempotency_key: str | None,
    server: Server,
    record: Callable[[Session, Job], None] | None = None,
) -> Admitted:
    """The job `body` asks for, queued, or the one an earlier submit with `idempotency_key` queued; an
    HTTPException for any rule it fails (nothing queued then). `record(s, job)`: called in the transaction
    that queues it (its audit row), never for a replay."""
    spec, job = admitted_job(body, key, server)
    job.idempotency_key = idempotency_key
    priority = job.priority
    if idempotency_key is not None and (earlier := _earlier(server, key, idempotency_key)) is not None:
        return _replayed(earlier, job)  # before the quotas: a job queued already counts once
    try:
        with session(server.engine) as s:
            with quota_refusal():  # max_priority (422) and max_queued (429), counted in this transaction
                check_job(s, key, priority)  # it also holds the key's row: its submits go one at a time
            earlier = jobs.submitted_with(s, key.id, idempotency_key) if idempotency_key is not None else None
            if earlier is not None:
                return _replayed(earlier, job)  # committed while this one waited for the row
            s.add(job)
            s.flush()
            job.run_dir = str(server.settings.runs_dir / f"job-{job.id}")
            if spec.kind == "script":
                make_working_copy(spec, body.script_files or {}, Path(job.run_dir))
            s.refresh(job, ["owner", "project"])  # read by the answer, after the session has closed
            if record is not None:
                record(s, job)
    except IntegrityError:  # the unique (owner, idempotency key) held against a submit at the same moment
        if idempotency_key is None or (earlier := _earlier(server, key, idempotency_key)) is None:
            raise
        return _replayed(earlier, job)
    return Admitted(job, replayed=False)


def spec_yaml(text: str) -> Any:
    """A spec's YAML, read with bounded work: its events are counted first (libyaml's parser, stopping at
    the first that passes a limit), then it is loaded; no aliases: a few hundred bytes of nested aliases
    expand to gigabytes once the spec is written back out (a 'billion laughs'), and a spec never needs
    one. SpecError past MAX_SPEC_NODES values or MAX_SPEC_DEPTH levels; yaml.YAMLError for bad YAML."""
    nodes = depth = 0
    for event in yaml.parse(text, Loader=yaml.CSafeLoader):
        if isinstance(event, yaml.AliasEvent):
            line = event.start_mark.line + 1
            raise yaml.YAMLError(f"aliases (*name) are not accepted in a spec (line {line})")
        if isinstance(event, (yaml.ScalarEvent, *_OPENS)) and (nodes := nodes + 1) > MAX_SPEC_NODES:
            raise SpecError(f"spec: more than {MAX_SPEC_NODES} values (a job spec holds a few dozen)")
        if isinstance(event, _OPENS) and (depth := depth + 1) > MAX_SPEC_DEPTH:
            line = event.start_mark.line + 1
            raise SpecError(f"spec: nested deeper than {MAX_SPEC_DEPTH} levels (line {line})")
        if isinstance(event, _CLOSES):
            depth -= 1
    return yaml.load(text, Loader=yaml.CSafeLoader)  # noqa: S506 (a safe loader)


def _parse(body: JobCreate, key: ApiKey, server: Server) -> JobSpec:
    settings = server.settings
    if len(body.spec.encode()) > MAX_SPEC_BYTES:
        raise HTTPException(
            status.HTTP_413_CONTENT_TOO_LARGE, f"spec: {len(body.spec.encode())} bytes, over {MAX_SPEC_BYTES}"
        )
    try:
        raw = spec_yaml(body.spec)
        base = settings.roots[0] if settings.roots else settings.home
        spec = parse_spec(raw, base, default_name=body.name or "job")
        if spec.kind == "script":
            return _parse_script(spec, body, key, server)
        if body.script_files:
            raise SpecError("script_files: only for a spec of kind: script")
        check_spec(job_policy(settings, key), spec)
        _check_uploads(server, key, [(f, p) for f, p in spec.file_references()])
        _check_inputs(spec)
    except yaml.YAMLError as err:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"spec: not valid YAML: {err}") from err
    except GpuforgeError as err:  # SpecError, DataError, or a ModelError of the source (no such model)
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT, in_users_names(str(err), body.files)
        ) from err
    named = {str(path) for _, path in spec.file_references()}
    if stray := sorted(set(body.files or {}) - named):  # it renames in messages only the spec's own files
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT, f"files: {stray[0]} is not a file the spec names"
        )
    return spec


def _parse_script(spec: ScriptJobSpec, body: JobCreate, key: ApiKey, server: Server) -> ScriptJobSpec:
    """A script job: user code (an admin key, or GPUFORGE_ALLOW_USER_CODE), and a working copy made of
    uploads only, each at a path inside it that `script.files` names, every name sent."""
    spec.script.workdir = ""  # always the copy this server makes beside the run directory
    check_script(job_policy(server.settings, key), spec)
    if body.files:
        raise SpecError("files: a script job sends its files as script_files")
    sent = body.script_files or {}
    uploads = server.settings.uploads_dir.resolve()
    for rel, server_path in sent.items():
        parts = PurePosixPath(rel).parts
        if not parts or PurePosixPath(rel).is_absolute() or ".." in parts or "\\" in rel:
            raise SpecError(f"script_files: {rel!r}: a path inside the working copy expected")
        if not any(rel == f or rel.startswith(f.rstrip("/") + "/") for f in spec.script.files):
            raise SpecError(f"script_files: {rel} is not under a path script.files names")
        where = Path(server_path).resolve()
        if where.parent != uploads or not where.is_file():
            raise SpecError(f"script_files: {rel}: {server_path} is not an upload of this server")
    for name in spec.script.files:
        if not any(rel == name or rel.startswith(name.rstrip("/") + "/") for rel in sent):
            raise SpecError(f"script.files: {name} was not sent")
    if (unsent := entry_not_sent(spec, set(sent))) is not None:  # it would fail at its start, not here
        raise SpecError(unsent)
    _check_uploads(server, key, [(f"script_files: {rel}", Path(path)) for rel, path in sent.items()])
    return spec


def _check_uploads(server: Server, key: ApiKey, named: list[tuple[str, Path]]) -> None:
    """Each upload a spec names must be one this key's project sent (store/uploads.py): another
    project's file is refused as if the server had none."""
    uploads = server.settings.uploads_dir.resolve()
    with session(server.engine) as s:
        for field, path in named:
            where = Path(path).resolve()
            if where.parent == uploads and not may_use(s, key, *split_name(where)):
                raise SpecError(
                    f"{field}: {path}: no such upload here (gpuforge submit sends the files a spec names)"
                )


def make_working_copy(spec: ScriptJobSpec, files: dict[str, str], run_dir: Path) -> None:
    """<run>.work: each upload at its path, linked where the file system allows (uploads never change)."""
    work = Path(f"{run_dir}.work")
    for rel, server_path in files.items():
        target = work / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(server_path, target)
        except OSError:
            shutil.copyfile(server_path, target)


def _check_inputs(spec: JobSpec) -> None:
    """What the runner would refuse in its first second, refused now instead of a job that starts and
    fails: its data files and their columns (read no further than the first record), an hf: model's
    directory (the same words as models/hf.py)."""
    check_columns(spec)
    scheme, _, rest = spec.model.source.partition(":")
    if scheme == "hf":
        if not Path(rest).is_dir():
            raise ModelError(f"model.source: {rest}: no such directory (gpuforge never downloads models)")
        if not (Path(rest) / "config.json").is_file():
            raise ModelError(f"model.source: {rest}: no config.json, not a saved transformers model")


def _device_type(spec: JobSpec, devices: Sequence[DeviceInfo]) -> str:
    wanted = spec.resources.device_type
    if wanted == "auto":
        return "cuda" if any(d.kind == "cuda" for d in devices) else "cpu"
    return wanted


def _check_devices(spec: JobSpec, device_type: str, devices: Sequence[DeviceInfo]) -> None:
    """A job asking for more devices than the server has could never start: said now, with what exists,
    rather than failed at its turn in the queue."""
    have = [d.id for d in devices if d.kind == device_type]
    if spec.resources.processes > len(have):
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            f"resources.devices: {spec.resources.devices} {device_type} devices asked for; this server has "
            f"{len(have)} ({', '.join(have) or 'none'}"
            + ("; CPU slots are set by GPUFORGE_CPU_SLOTS)" if device_type == "cpu" else ")"),
        )


def _check_placement(spec: JobSpec, device_type: str, devices: Sequence[DeviceInfo]) -> None:
    """A placement no device of this server could ever match is refused now, with the labels that exist."""
    wanted = spec.resources.placement
    if not wanted:
        return
    of_type = [d for d in devices if d.kind == device_type]
    matching = [d for d in of_type if all((k, v) in d.labels for k, v in wanted.items())]
    if len(matching) >= spec.resources.processes:
        return
    exist = sorted({f"{k}={v}" for d in of_type for k, v in d.labels})
    asked = ", ".join(f"{k}={v}" for k, v in wanted.items())
    raise HTTPException(
        status.HTTP_422_UNPROCESSABLE_CONTENT,
        f"resources.placement: {spec.resources.devices} {device_type} device(s) labelled {asked} asked for; "
        f"this server has {len(matching)}. Labels of its {device_type} devices: {', '.join(exist) or 'none'}",
    )


def _fill_price(
    spec: JobSpec | ScriptJobSpec, device_type: str, key: ApiKey, server: Server
) -> tuple[float | None, float]:
    """cost.usd_per_hour: what one device of the kind the job gets costs on this server (pricing.py:
    prices.yaml, else the catalog's price of its model), else nothing (0: no price set). A spec's own rate
    is kept for admin keys alone (docs/decisions.md): any other key's job costs what the server says,
    whatever its file says, and a budget cannot be escaped by declaring a rate of 0. Returns (what a kWh
    costs, the nominal energy part of the hourly rate) for an owned device whose price gives usd_per_kwh:
    the ledger charges the kWh measured in place of that part (never both); (None, 0) otherwise."""
    if key.admin and "usd_per_hour" in spec.cost.model_fields_set:
        return None, 0.0
    device = next((d for d in server.devices if d.kind == device_type), None)  # the first of its kind
    found = prices_of(server.settings.home, [device])[device.id] if device is not None else None
    spec.cost.usd_per_hour = found.usd_per_hour if found is not None else 0.0
    spec.cost.instance = found.source if found is not None else None
    if found is None or found.usd_per_kwh is None:
        return None, 0.0
    return found.usd_per_kwh, found.energy_usd_per_hour


def _earlier(server: Server, key: ApiKey, idempotency_key: str) -> Job | None:
    with session(server.engine) as s:
        return jobs.submitted_with(s, key.id, idempotency_key)


def _replayed(earlier: Job, asked: Job) -> Admitted:
    """The job an earlier submit with this Idempotency-Key queued, when this one asks for the same job: the
    same resolved spec, name, priority and files; 409 when it asks for another."""
    fields = ("spec_yaml", "name", "priority", "files")
    if any(getattr(earlier, f) != getattr(asked, f) for f in fields):
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"Idempotency-Key {asked.idempotency_key!r}: already used for job {earlier.id}, which asked for "
            "another spec, name or priority; send a new key for a new job",
        )
    return Admitted(earlier, replayed=True)
