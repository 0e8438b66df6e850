"""Energy per run: the readers on recorded sysfs and /proc trees (in the kernel's own format) and on this
machine's /proc, and the meter's three rules end to end. Figures from recorded or injected inputs are
compared exactly; anything timed on this shared machine only within generous bounds."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuforge.hardware.energy import (
    EnergyMeter,
    Holder,
    NvmlReader,
    RaplReader,
    StepEnergy,
    machine_busy_seconds,
    tree_cpu_seconds,
)

DATA = Path(__file__).parent / "data"
TICK = os.sysconf("SC_CLK_TCK")
RANGE_UJ = 262143328850  # the recorded packages' max_energy_range_uj
ROOT, CHILD, GRANDCHILD = 10774, 10784, 10785  # the recorded process tree; pid 1 and 2 are not in it
NO_SUCH_GPU = 999  # NVML answers None for it, with or without a driver: the estimate is used everywhere


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _copy(tmp_path: Path) -> tuple[Path, Path]:
    shutil.copytree(DATA / "powercap", tmp_path / "powercap")
    shutil.copytree(DATA / "proc", tmp_path / "proc")
    return tmp_path / "powercap", tmp_path / "proc"


def _add_uj(powercap: Path, zone: str, uj: int) -> None:
    path = powercap / zone / "energy_uj"
    path.write_text(f"{int(path.read_text()) + uj}\n")


def _add_ticks(stat: Path, field: int, ticks: int) -> None:
    """Adds ticks to one field, numbered as proc(5) numbers them, of a stat file's first line: /proc/stat's
    cpu line (1: user) or /proc/<pid>/stat (14: utime, 15: stime)."""
    lines = stat.read_text().splitlines()
    head, paren, tail = lines[0].rpartition(")")
    if paren:  # <pid>/stat: the fields after the command name start at field 3
        fields, i = tail.split(), field - 3
    else:
        head, fields, i = "cpu ", lines[0].split()[1:], field - 1
    fields[i] = str(int(fields[i]) + ticks)
    lines[0] = f"{head}{paren} {' '.join(fields)}"
    stat.write_text("\n".join(lines) + "\n")


def cpu_holder(subject: str, pids: tuple[int, ...], watts: float | None = 100.0, cores: int = 1) -> Holder:
    return Holder(subject, "cpu", (), 0.5, pids, cores, watts, "prices.yaml cpu" if watts else None)


# --- RAPL ------------------------------------------------------------------------------------------------


def test_rapl_reads_the_packages_of_a_recorded_tree_not_their_dram_subzones():
    rapl = RaplReader(DATA / "powercap")
    assert rapl.available()
    assert rapl.read() == {"package-0": 87563453120, "package-1": 140012345678}


def test_rapl_delta_and_a_counter_that_wrapped(tmp_path):
    powercap, _ = _copy(tmp_path)
    rapl = RaplReader(powercap)
    before = rapl.read()
    _add_uj(powercap, "intel-rapl:0", 5_000_000)
    _add_uj(powercap, "intel-rapl:1", 2_500_000)
    _add_uj(powercap, "intel-rapl:0:0", 9_999_999)  # dram: a sub-zone, not charged
    after = rapl.read()
    assert rapl.delta_uj(before, after) == 7_500_000
    # package-0 passes its range and begins again from 0: 1 J before the end, 3 J after
    (powercap / "intel-rapl:0" / "energy_uj").write_text(f"{RANGE_UJ - 1_000_000}\n")
    near_end = rapl.read()
    (powercap / "intel-rapl:0" / "energy_uj").write_text("3000000\n")
    assert rapl.delta_uj(near_end, rapl.read()) == 4_000_000


def test_an_unreadable_counter_is_unavailable_not_an_error(tmp_path):
    powercap, _ = _copy(tmp_path)
    for zone in ("intel-rapl:0", "intel-rapl:1"):
        (powercap / zone / "energy_uj").chmod(0)
    try:
        (powercap / "intel-rapl:0" / "energy_uj").read_text()
        pytest.skip("this user reads a mode-000 file anyway (root, or a sandbox that ignores modes)")
    except PermissionError:
        pass
    rapl = RaplReader(powercap)
    assert not rapl.available() and rapl.read() == {}


def test_no_powercap_or_no_counter_is_unavailable(tmp_path):
    assert not RaplReader(tmp_path / "absent").available() and not RaplReader(tmp_path).available()
    powercap, _ = _copy(tmp_path)
    for zone in ("intel-rapl:0", "intel-rapl:1"):
        (powercap / zone / "energy_uj").unlink()  # a zone with no counter to read
    assert not RaplReader(powercap).available()


# --- /proc -----------------------------------------------------------------------------------------------


def test_proc_parsing_on_a_recorded_proc():
    # the recorded cpu line: user nice system idle iowait irq softirq steal guest guest_nice; busy leaves
    # out idle (424023) and iowait (8428)
    user, nice, system, irq, softirq, steal = 1939715, 18061, 238123, 0, 4662, 4805
    assert machine_busy_seconds(DATA / "proc") == pytest.approx(
        (user + nice + system + irq + softirq + steal) / TICK
    )
    # the root's own 19+16 ticks and the 11+10 of a child it waited for; the child (its command name holds
    # spaces and parentheses) 9+9; the grandchild 0; pid 1's large counts are not in the tree
    assert tree_cpu_seconds([ROOT], DATA / "proc") == pytest.approx((19 + 16 + 11 + 10 + 9 + 9) / TICK)
    assert tree_cpu_seconds([CHILD], DATA / "proc") == pytest.approx(18 / TICK)
    assert tree_cpu_seconds([ROOT, CHILD], DATA / "proc") == tree_cpu_seconds([ROOT], DATA / "proc")
    assert tree_cpu_seconds([424242], DATA / "proc") == 0.0  # gone: 0, never an error
    assert machine_busy_seconds(DATA / "absent") == 0.0 and tree_cpu_seconds([1], DATA / "absent") == 0.0


BUSY_CHILD = """
import sys, time
print("ready", flush=True)
sys.stdin.readline()
start = time.process_time()
while time.process_time() - start < float(sys.argv[1]):
    pass
print("spun", flush=True)
sys.stdin.readline()
"""


def _busy_child(seconds: float, pin: bool = False) -> subprocess.Popen:
    """A child that spins `seconds` of CPU time when told, and says when it is idle again."""
    pinned = "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n" if pin else ""
    child = subprocess.Popen(
        [sys.executable, "-c", pinned + BUSY_CHILD, str(seconds)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdout.readline().strip() == "ready"
    return child


def _spin(child: subprocess.Popen) -> None:
    child.stdin.write("go\n")
    child.stdin.flush()
    assert child.stdout.readline().strip() == "spun"


def test_a_busy_child_raises_this_process_trees_cpu_time_alive_and_once_waited_for():
    child = _busy_child(0.3)
    try:
        before = tree_cpu_seconds([os.getpid()])
        _spin(child)
        alive = tree_cpu_seconds([os.getpid()]) - before  # a live descendant, walked to by its ppid
        child.communicate("end\n", timeout=10)  # ended and waited for: in our cutime now
        waited = tree_cpu_seconds([os.getpid()]) - before
    finally:
        child.kill()
    assert 0.28 <= alive <= 1.5
    assert alive - 0.02 <= waited <= 1.5


# --- the meter -------------------------------------------------------------------------------------------


def test_meter_estimates_a_cpu_job_from_its_watts_and_utilisation(tmp_path):
    clock = Clock()
    meter = EnergyMeter(rapl=RaplReader(tmp_path), clock=clock)  # no RAPL here: the estimate
    child = _busy_child(0.3, pin=True)
    try:
        holder = cpu_holder("job:7", (child.pid,))
        start = tree_cpu_seconds([child.pid])  # the child waits on its stdin: the meter sees the same
        assert meter.measure([holder]) == {}  # the first call sets the baseline
        _spin(child)
        used = tree_cpu_seconds([child.pid]) - start
        clock.now += 2.0
        reading = meter.measure([holder])["job:7"]
    finally:
        child.kill()
    total = meter.total_cores
    utilisation = used / (1 * 2.0)
    assert 0.12 <= utilisation <= 0.9  # 0.3 CPU-s in 2 s, and the child's reads of its stdin
    assert reading.source == "estimated"
    assert reading.joules == pytest.approx(100.0 * (1 / total) * utilisation * 2.0, rel=1e-9)
    assert reading.rule.startswith(f"estimated: 100 W x 1/{total} cores x {utilisation:.2f} utilisation")
    assert reading.rule.endswith("x 2.0 s (watts: prices.yaml cpu)")


def test_meter_splits_the_rapl_packages_by_busy_time(tmp_path):
    powercap, proc = _copy(tmp_path)
    clock = Clock()
    meter = EnergyMeter(rapl=RaplReader(powercap), proc=proc, clock=clock, total_cores=2)
    job, other = cpu_holder("job:1", (ROOT,)), cpu_holder("deployment:2", (1,), watts=None)
    assert meter.measure([job, other]) == {}
    _add_uj(powercap, "intel-rapl:0", 30_000_000)
    _add_uj(powercap, "intel-rapl:1", 10_000_000)
    _add_ticks(proc / "stat", 1, 8 * TICK)  # the machine: 8 busy CPU-seconds
    _add_ticks(proc / str(ROOT) / "stat", 14, TICK)  # the job's root 1 s, its child 1 s: 2 of 8
    _add_ticks(proc / str(CHILD) / "stat", 15, TICK)
    _add_ticks(proc / "1" / "stat", 14, 3 * TICK)  # pid 1 (the deployment here): 3 of 8
    clock.now += 2.0
    readings = meter.measure([job, other])
    assert readings["job:1"].source == "rapl" and readings["job:1"].joules == pytest.approx(40.0 * 0.25)
    assert readings["job:1"].rule == (
        "RAPL package-0+package-1 x 0.25 (the job's share of the machine's busy CPU time: 2.00 of 8.00 CPU-s)"
    )
    # RAPL needs no watts: a holder without them is measured too
    assert readings["deployment:2"].joules == pytest.approx(40.0 * 3 / 8)
    assert "the deployment's share" in readings["deployment:2"].rule


def test_meter_estimates_a_gpu_without_a_counter_and_says_what_it_assumed(tmp_path):
    clock = Clock()
    meter = EnergyMeter(rapl=RaplReader(tmp_path), clock=clock)
    gpu = Holder(
        "job:3", "cuda", (NO_SUCH_GPU,), 0.5, (os.getpid(),), 0, 700.0, "catalog NVIDIA H100 80GB HBM3"
    )
    unpriced = Holder("job:4", "cuda", (NO_SUCH_GPU,), 1.0, (os.getpid(),), 0, None, None)
    assert meter.measure([gpu, unpriced]) == {}
    clock.now += 1.5
    readings = meter.measure([gpu, unpriced])
    assert "job:4" not in readings  # no counter and no watts: no figure, never an invented one
    assert readings["job:3"].source == "estimated" and readings["job:3"].joules == pytest.approx(
        700 * 0.5 * 1.5
    )
    assert readings["job:3"].rule == (
        "estimated: 700 W x 0.5 (the job's share) x 1.00 utilisation x 1.5 s; utilisation not measured:"
        " assumed 100% (watts: catalog NVIDIA H100 80GB HBM3)"
    )


def test_meter_forgets_subjects_gone_and_starts_again_when_a_holders_processes_change(tmp_path):
    clock = Clock()
    meter = EnergyMeter(rapl=RaplReader(tmp_path), clock=clock)
    job = cpu_holder("job:5", (os.getpid(),))
    meter.measure([job])
    clock.now += 1.0
    assert "job:5" in meter.measure([job])
    meter.measure([])  # gone: forgotten
    assert meter.measure([job]) == {}
    restarted = cpu_holder("job:5", (os.getppid(),))
    assert meter.measure([restarted]) == {}  # another process: a new baseline, not a jump
    clock.now += 1.0
    assert "job:5" in meter.measure([restarted])


# --- the runner's side and NVML without a GPU ------------------------------------------------------------


def test_step_energy_reads_what_the_server_set():
    env = {
        "CUDA_VISIBLE_DEVICES": "3,GPU-5b1c",
        "GPUFORGE_DEVICE_SHARE": "0.5",
        "GPUFORGE_DEVICE_WATTS": "700",
        "GPUFORGE_DEVICE_WATTS_FROM": "catalog NVIDIA H100 80GB HBM3",
    }
    gpu = StepEnergy.from_environment(env).holder
    assert (gpu.kind, gpu.indices, gpu.share, gpu.pids) == ("cuda", (3,), 0.5, (os.getpid(),))
    assert (gpu.watts, gpu.watts_from) == (700.0, "catalog NVIDIA H100 80GB HBM3")
    cpu = StepEnergy.from_environment({"CUDA_VISIBLE_DEVICES": "", "GPUFORGE_CPU_CORES": "0,1"}).holder
    assert (cpu.kind, cpu.indices, cpu.cores, cpu.watts, cpu.share) == ("cpu", (), 2, None, 1.0)
    with pytest.raises(ValueError, match="GPUFORGE_DEVICE_WATTS='lots'"):
        StepEnergy.from_environment({"GPUFORGE_DEVICE_WATTS": "lots"})
    with pytest.raises(ValueError, match="GPUFORGE_DEVICE_SHARE"):
        StepEnergy.from_environment({"GPUFORGE_DEVICE_SHARE": "2"})


def test_step_energy_windows_on_this_machine():
    env = {"CUDA_VISIBLE_DEVICES": "", "GPUFORGE_CPU_CORES": "0", "GPUFORGE_DEVICE_WATTS": "65"}
    step = StepEnergy.from_environment(env)
    assert step.window() is None  # the baseline
    sum(i * i for i in range(200_000))
    reading = step.window()
    assert reading is not None and reading.joules >= 0 and reading.source in ("rapl", "estimated")
    if reading.source == "estimated":
        assert "(watts: GPUFORGE_DEVICE_WATTS)" in reading.rule  # unnamed watts: the variable is the source


def test_nvml_without_a_driver_or_a_gpu_answers_none():
    nvml = NvmlReader()
    assert nvml.energy_j(NO_SUCH_GPU) is None and nvml.utilisation(NO_SUCH_GPU) is None
    if not nvml.available():  # no pynvml, no driver: unavailable, never an error
        assert nvml.device_count() == 0 and nvml.energy_j(0) is None
