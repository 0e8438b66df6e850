"""The one table of GPUFORGE_* variables (gpuforge/settings.py): README shows it as it is, every name the
code mentions is in it, each variable parses as it always did, and what gpuforge tells a child reads back."""

import os
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from gpuforge.errors import GpuforgeError
from gpuforge.executors import build as build_executor
from gpuforge.scheduler.allocator import DeviceInfo, cluster_inventory
from gpuforge.scheduler.loop import Scheduler, SchedulerOptions
from gpuforge.server.settings import Settings
from gpuforge.settings import Environment, as_environment, current, env_name, markdown_table, variables
from gpuforge.spec import format_validation_error
from tests.helpers.paths import ROOT

README = ROOT / "README.md"
TABLE_START, TABLE_END = "<!-- settings table: start -->\n", "\n<!-- settings table: end -->"
# a variable's name where it stands alone (not PYTEST_GPUFORGE_CACHE, nor the GPUFORGE_* of prose)
MENTIONED = re.compile(r"(?<![A-Za-z0-9_])GPUFORGE_[A-Z0-9_]*[A-Z0-9]")
SCANNED = ("src", "scripts", "benchmarks", "tests", "docs", "examples")
TEXT_SUFFIXES = {".py", ".sh", ".md", ".toml", ".yaml", ".yml", ".txt", ".cfg", ".ini"}


def test_the_readme_shows_the_table_as_the_module_has_it():
    readme = README.read_text()
    assert TABLE_START in readme and TABLE_END in readme, "README.md lost its settings table markers"
    shown = readme.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0]
    assert shown == markdown_table(), (
        "README.md's environment variables differ from gpuforge/settings.py: paste the output of "
        "`python -m gpuforge.settings` between its settings table markers"
    )


def test_every_variable_is_in_the_readme_with_its_default():
    readme = README.read_text()
    missing = [v.name for v in variables() if f"| `{v.name}` | {v.default} |" not in readme]
    assert not missing, f"not in README.md with their defaults: {missing}"


def test_every_gpuforge_variable_the_code_mentions_is_in_the_table():
    known = {v.name for v in variables()}
    files = [README, ROOT / "pyproject.toml"] + [
        path
        for top in SCANNED
        for path in (ROOT / top).rglob("*")
        if path.suffix in TEXT_SUFFIXES and path.is_file() and path != Path(__file__)
    ]
    unknown = {
        f"{name} ({path.relative_to(ROOT)})"
        for path in files
        for name in MENTIONED.findall(path.read_text(errors="replace"))
        if name not in known
    }
    assert not unknown, f"add these to gpuforge/settings.py's table: {sorted(unknown)}"


def test_internal_variables_are_marked_and_the_rest_are_not():
    internal = {v.name for v in variables() if v.internal}
    assert internal == {
        "GPUFORGE_USER_CODE",
        "GPUFORGE_CONFINE_ROOTS",
        "GPUFORGE_CONFINE_EXCLUDED",
        "GPUFORGE_RESTART",
        "GPUFORGE_ATTEMPT",
        "GPUFORGE_RUN_DIR",
        "GPUFORGE_JOB_ID",
        "GPUFORGE_CPU_CORES",
        "GPUFORGE_CPU_NICE",
        "GPUFORGE_DEVICE_SHARE",
        "GPUFORGE_CUDA_MEMORY_FRACTION",
        "GPUFORGE_CUDA_MEMORY_CAP",
        "GPUFORGE_DEVICE_WATTS",
        "GPUFORGE_DEVICE_WATTS_FROM",
    }
    assert all(v.meaning and v.read_by and v.type for v in variables())


@pytest.mark.parametrize(
    "field, raw, expected",
    [
        # --verbose's words (click's): yes in any case, anything else no
        *[("verbose", raw, True) for raw in ("1", "true", "TRUE", "t", "yes", "Y ", "on")],
        *[("verbose", raw, False) for raw in ("0", "false", "no", "off", "", "junk")],
        # a child of the server is told 0 or 1; only 0 takes user code away
        ("user_code", "0", False),
        *[("user_code", raw, True) for raw in ("1", "", "no")],
        ("confine_roots", None, None),  # unset: any file (a person at their own shell)
        ("confine_roots", "", ()),  # set but empty: no file at all
        ("confine_roots", f"/a{os.pathsep}{os.pathsep}/b", (Path("/a"), Path("/b"))),
        ("confine_excluded", "", ()),
        ("cpu_slots", None, None),
        ("cpu_slots", "", None),
        ("cpu_slots", "3", 3),
        ("url", "", "http://127.0.0.1:8600"),
        ("url", "http://gpu-box:9000", "http://gpu-box:9000"),
        ("api_key", "", None),
        ("executor", "", "local"),
        ("executor", "ray", "ray"),
        ("ray_address", None, None),
        ("public_metrics", "TRUE", True),
        ("public_metrics", "0", False),
        ("restart", None, None),  # the rank falls back on torchrun's own count
        ("restart", "2", 2),
        ("cache_dir", None, Path.home() / ".cache" / "gpuforge"),
        ("home", "~/elsewhere", Path.home() / "elsewhere"),
    ],
)
def test_each_variable_parses_as_it_did(field, raw, expected):
    environ = {} if raw is None else {env_name(field): raw}
    assert getattr(current(environ), field) == expected


def test_a_bad_value_is_an_error_naming_it_only_where_it_is_read():
    environ = {"GPUFORGE_PORT": "86OO", "GPUFORGE_CPU_SLOTS": "two", "GPUFORGE_URL": "http://h:1"}
    assert current(environ).url == "http://h:1"  # a client has no use for the port
    with pytest.raises(GpuforgeError, match=r"^GPUFORGE_CPU_SLOTS: Input should be a valid integer"):
        getattr(current(environ), "cpu_slots")  # noqa: B009 (the read itself is what is tested)
    with pytest.raises(AttributeError):
        getattr(current(environ), "no_such_setting")  # noqa: B009 (as above)


def test_each_read_sees_the_environment_as_it_is_then(monkeypatch):
    monkeypatch.setenv("GPUFORGE_CPU_SLOTS", "2")
    now = current()
    assert now.cpu_slots == 2
    monkeypatch.setenv("GPUFORGE_CPU_SLOTS", "5")
    assert now.cpu_slots == 5 and current().cpu_slots == 5
    monkeypatch.delenv("GPUFORGE_CPU_SLOTS")
    assert current().cpu_slots is None


def test_what_gpuforge_tells_a_child_reads_back_the_same(tmp_path):
    told = {
        "user_code": False,
        "confine_roots": (tmp_path / "data", tmp_path / "home" / "uploads"),
        "confine_excluded": (tmp_path / "home",),
        "restart": 2,
        "attempt": "0f3a",
        "executor": "ray",
        "ray_address": "head:6379",
        "verbose": True,
        "api_key": "gf_replica",
    }
    environ = as_environment(**told)
    assert all(name.startswith("GPUFORGE_") and isinstance(v, str) for name, v in environ.items())
    assert {field: getattr(current(environ), field) for field in told} == told
    assert as_environment(confine_roots=None, user_code=True) == {"GPUFORGE_USER_CODE": "1"}
    with pytest.raises(KeyError, match="not a gpuforge setting"):
        as_environment(no_such_setting=1)


def test_the_server_takes_its_options_from_the_table(monkeypatch):
    for field, info in Settings.model_fields.items():
        row = Environment.model_fields[field]
        assert (info.default, info.description) == (row.default, row.description), field
    monkeypatch.setenv("GPUFORGE_PORT", "9001")
    monkeypatch.setenv("GPUFORGE_PUBLIC_METRICS", "on")
    settings = Settings(host="0.0.0.0")  # an option wins over its variable
    assert (settings.port, settings.public_metrics, settings.host) == (9001, True, "0.0.0.0")
    assert settings.home == Path("~/.gpuforge").expanduser().absolute()
    with pytest.raises(ValidationError) as refused:  # the same line as ever, naming the option
        Settings(port="x", executor="k8s")
    assert format_validation_error(refused.value) == (
        "port: must be an integer, got 'x'; executor: must be 'local', 'ray' or 'slurm', got 'k8s'"
    )


def test_the_server_tells_its_runners_where_jobs_run_and_sets_nothing_in_its_own_environment(monkeypatch):
    monkeypatch.delenv("GPUFORGE_EXECUTOR", raising=False)
    monkeypatch.delenv("GPUFORGE_RAY_ADDRESS", raising=False)
    device = DeviceInfo("cpu:0", "cpu", "a CPU slot", threads=1)
    for settings, told in [
        (Settings(executor="ray", ray_address="head:6379"), {"ray", "head:6379"}),
        (Settings(), {"local"}),
    ]:
        options = SchedulerOptions(runner_env=settings.runner_environment)
        scheduler = Scheduler(None, [device], build_executor(settings), options)
        env = scheduler.child_env(None, None, [device.id])
        assert {v for k, v in env.items() if k in ("GPUFORGE_EXECUTOR", "GPUFORGE_RAY_ADDRESS")} == told
    assert "GPUFORGE_EXECUTOR" not in os.environ


@pytest.mark.parametrize("raw, slots", [(None, 4), ("2", 2), ("0", 0), ("9", 4)])
def test_cpu_slots_cap_a_ray_clusters_cores(monkeypatch, raw, slots):
    monkeypatch.delenv("GPUFORGE_CPU_SLOTS", raising=False)
    if raw is not None:
        monkeypatch.setenv("GPUFORGE_CPU_SLOTS", raw)
    assert len(cluster_inventory({"gpus": 0, "cpus": 4})) == slots
