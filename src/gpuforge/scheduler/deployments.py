"""Deployments kept alive by the scheduling loop: each replica is a `gpuforge serve` process on loopback,
on a device of its own, restarted when it dies, stopped on undeploy.

A tick (in the loop's transaction) walks the deployments that are starting, ready or stopping:
- stopping or failing: SIGTERM every replica (it finishes what it holds), `stopped` once all are gone;
- otherwise the autoscaler (scheduler/autoscale.py) may move `replicas`, the count it wants now;
- each replica whose process is gone is started again while `restarts < max_restarts`; a live one is
  asked /readyz (50 ms at most);
- a version being rolled out (store/versions.py) first gets one replica, which measures the eval metric
  at load: more than `max_metric_drop` below the serving version's and the version is refused. Then new
  replicas replace old ones one by one: an old one is drained only once a new one is ready (or, with no
  device free for a new one, while another ready replica still serves; a lone one gives its device up,
  and the forwarder holds requests meanwhile as at a cold start). A replica no device is free for waits,
  and its entry says who holds each one ("waiting"). A drained replica leaves the
  forwarder's picks at once and gets SIGTERM DRAIN_DELAY_S later, so no request is sent to a closing
  port; the forwarder retries on another replica where one was anyway;
- the adapters added to the deployment (`deploy --into`) are registered on each loaded replica that lacks
  them, and removed from those that have one taken away: no replica restarts for it. A replica started
  since takes requests once it has them all (one that refuses an adapter says why in an event).
Workers listen on 127.0.0.1 only and want the deployment's own key: clients reach them through the
server (routes/deployments.py), which forwards each request to the least loaded ready replica.

A replica's entry in `workers`: {"index", "version", "model_dir", "pid", "port", "device", "restarts",
"loaded" (answers /readyz), "ready" (the forwarder may pick it), "eval" (launched to measure its version's
metric), "draining" (when it was drained), "signalled_at", "adapters" (the names it serves)}.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from gpuforge.errors import GpuforgeError
from gpuforge.runtime.host import free_port, is_alive
from gpuforge.scheduler import replica_calls
from gpuforge.scheduler.allocator import DeviceInfo
from gpuforge.scheduler.autoscale import Autoscaler
from gpuforge.scheduler.sharing import EPSILON, Isolation, best_fit, room
from gpuforge.serve.options import serve_flags
from gpuforge.store import outbox, states, versions
from gpuforge.store.models import LIVE_DEPLOYMENT_STATES as LIVE
from gpuforge.store.models import Deployment, DeploymentState, DeploymentVersion, VersionState

log = logging.getLogger("gpuforge.scheduler")
ReplicaEnv = Callable[[Session, Deployment, DeviceInfo, Isolation | None], dict[str, str]]
ShareIsolation = Callable[[Session, str, float], Isolation]  # (s, device id, share): what a fraction gets
STOP_GRACE_S = 30.0
DRAIN_DELAY_S = 1.0


@dataclass
class Keeper:
    """What the loop hands over: its devices, where replicas log, a replica's environment and key, the
    folder adapters may be added from (the server's runs/), and the autoscaler."""

    devices: list[DeviceInfo]
    logs_dir: Path
    replica_env: ReplicaEnv
    replica_key: Callable[[Deployment], str]
    adapters_root: Path
    autoscaler: Autoscaler
    share_isolation: ShareIsolation | None = None  # for replicas on fractions of a device
    ports: range | None = None  # where replicas listen (GPUFORGE_REPLICA_PORTS); None: any free port


def held_devices(s: Session, but: int | None = None) -> set[str]:
    """Devices the replicas of live deployments (`but` one) hold (a draining one too, until it has gone)."""
    return set(replica_holders(s, but))


def replica_holders(s: Session, but: int | None = None) -> dict[str, str]:
    """held_devices(), each with who holds it: "replica 0 (v1) of deployment topics"."""
    held = {}
    query = select(Deployment.name, Deployment.workers).where(
        Deployment.state.in_(LIVE), Deployment.id != (but or -1)
    )
    for name, workers in s.execute(query):
        for w in workers or []:
            if w.get("pid") and w.get("device"):
                held[w["device"]] = f"replica {w['index']} (v{w.get('version', 1)}) of deployment {name}"
    return held


def replica_shares(s: Session, but: int | None = None) -> dict[str, float]:
    """device -> the fraction of it the replicas of live deployments that hold fractions hold."""
    used: dict[str, float] = {}
    query = select(Deployment.device_share, Deployment.workers).where(
        Deployment.state.in_(LIVE), Deployment.id != (but or -1), Deployment.device_share.is_not(None)
    )
    for share, workers in s.execute(query):
        for w in workers or []:
            if w.get("pid") and w.get("device"):
                used[w["device"]] = used.get(w["device"], 0.0) + share
    return used


def keep(
    s: Session,
    held: dict[str, str],
    keeper: Keeper,
    shares: dict[str, float] | None = None,
    closing: set[str] = frozenset(),
) -> None:
    """One pass over the live deployments (see the module's docstring). `held`: devices jobs hold, each
    with its holder ("job 4"); `shares`: of those, the fraction of each that fractions of jobs hold;
    `closing`: those a stopping job is freeing, which no replica takes before the queue has had them.

    The loop alone writes `workers` and `replicas`; the API writes `state` (undeploy: `stopping`). So a
    state is written only by a move of store/states.py, which leaves from the state this pass read alone:
    an undeploy that lands mid-pass is never overwritten. Each launch is committed at once, so a server
    that dies next still knows the process it started."""
    rows = s.execute(select(Deployment.id, Deployment.state).where(Deployment.state.in_(LIVE))).all()
    for deployment_id, state in rows:
        deployment = s.get(Deployment, deployment_id, populate_existing=True)
        if state in (DeploymentState.STOPPING, DeploymentState.FAILING):
            workers, done = _stop(deployment)
            _write_workers(s, deployment, workers)
            if done and state == DeploymentState.STOPPING:
                states.deployment_stopped(s, deployment.id)
            elif done:
                states.deployment_failed(s, deployment.id)
            rolling = versions.of_state(s, deployment.id, VersionState.ROLLING) if done else None
            if rolling is not None:  # a rollout the deployment's end cut short
                versions.refuse(s, rolling.id, f"the deployment {state} before it rolled out")
            continue
        _Pass(s, deployment, state, held, keeper, shares or {}, closing).run()


class _Pass:
    """One deployment's replicas, for one tick."""

    def __init__(
        self,
        s: Session,
        d: Deployment,
        state: DeploymentState,
        held: dict[str, str],
        keeper: Keeper,
        shares: dict[str, float],
        closing: set[str] = frozenset(),
    ):
        self.s, self.d, self.state, self.keeper = s, d, state, keeper
        self.holders = held | replica_holders(s, but=d.id)  # device -> who holds it (a job, a replica)
        self.used = dict(shares)  # device -> the fraction of it fractions hold (jobs', other replicas')
        for device, share in replica_shares(s, but=d.id).items():
            self.used[device] = self.used.get(device, 0.0) + share
        # held whole; and this one's live replicas', once watched
        self.taken = set(self.holders) - set(self.used) | set(closing)
        self.workers = [dict(w) for w in d.workers or []]
        for w in self.workers:  # entries written before versions existed
            w.setdefault("version", d.version)
            w.setdefault("model_dir", d.model_dir)
            w.setdefault("loaded", w.get("ready", False))
        self.serving = versions.of_state(s, d.id, VersionState.SERVING)
        self.rolling = versions.of_state(s, d.id, VersionState.ROLLING)
        self.failure: str | None = None  # why the serving version cannot serve: the deployment fails

    def run(self) -> None:
        self._scale()
        self._watch()
        for w in self.workers:
            if w.get("pid") and w.get("device"):
                self._hold(w["device"])
                self.holders[w["device"]] = f"replica {w['index']} (v{w['version']}) of this deployment"
        if self.failure is None:
            self._measure()
            self._push_adapters()
            self._place()
            self._finish_rollout()
        ready = sum(1 for w in self.workers if w["ready"])
        cold = self.keeper.autoscaler.cold_start(self.d, ready)
        if cold is not None:
            versions.record(self.s, self.d.id, "cold_start", seconds=round(cold, 3))
        _write_workers(self.s, self.d, self.workers)
        _settle(self.s, self.d.id, self.state, self.failure, ready >= self.d.replicas)

    # --- what it wants ---
    def _scale(self) -> None:
        ready = sum(1 for w in self.workers if w.get("ready"))
        starting = sum(
            1 for w in self.workers if w.get("pid") and not w.get("loaded") and not w.get("draining")
        )
        decision = self.keeper.autoscaler.decide(self.d, ready, starting)
        if decision is None:
            return
        versions.record(self.s, self.d.id, "scaled", replicas_from=self.d.replicas,
                        replicas_to=decision.replicas, why=decision.why)  # fmt: skip
        log.info("deployment %s: %d -> %d replicas (%s)", self.d.name, self.d.replicas, decision.replicas,
                 decision.why)  # fmt: skip
        self.s.execute(
            update(Deployment).where(Deployment.id == self.d.id).values(replicas=decision.replicas)
        )
        self.d.replicas = decision.replicas

    # --- the processes ---
    def _watch(self) -> None:
        """Drop the drained replicas that have gone (signal those still there); ask the others whether
        they are ready; mark the dead ones for a restart, or say why their version cannot serve."""
        failed: dict[int, str] = {}  # version -> why
        kept = []
        for w in self.workers:
            alive = bool(w.get("pid")) and is_alive(w["pid"], w["model_dir"])
            if w.get("draining"):
                if alive:
                    _signal(w, DRAIN_DELAY_S)
                    kept.append(w)
                else:
                    _reap(w.get("pid"))
                continue
            kept.append(w)
            if alive:
                loaded, error = replica_calls.ready(w["port"])
                w["loaded"] = w["loaded"] or loaded
                if error:  # it answers, and says its model will not load: no restart will help
                    failed[w["version"]] = f"replica {w['index']}: {error}"
                continue
            if w.get("pid"):
                _reap(w["pid"])
                log.info("deployment %s: replica %d ended", self.d.name, w["index"])
            w.update(pid=None, loaded=False, ready=False)
            if w["restarts"] >= self.d.max_restarts:
                failed[w["version"]] = f"replica {w['index']} ended {w['restarts'] + 1} times"
        self.workers = kept
        for version, why in failed.items():
            if self.rolling is not None and version == self.rolling.version:
                self._end_rollout(versions.fail_version, f"v{version} would not serve: {why}", "failed")
            elif version == self.d.version:
                self.failure = why
            else:  # a leftover of an ended version: let it go
                self._drain([w for w in self.workers if w["version"] == version])

    def _measure(self) -> None:
        """Read the eval metric of each version whose replica measured it; refuse a rolling version whose
        metric fell too far."""
        for version in (self.serving, self.rolling):
            if version is None or version.metric is not None:
                continue
            probe = next((w for w in self._active(version.version) if w["loaded"] and w.get("eval")), None)
            if probe is None:
                continue
            try:
                found = replica_calls.eval_metric(probe["port"], self.keeper.replica_key(self.d))
            except (httpx.HTTPError, ValueError):
                continue  # asked again at the next pass
            version.metric = found or {"metric": None, "value": None, "note": "no held-out split beside it"}
            versions.measured(self.s, version.id, version.metric)
        rolling, serving = self.rolling, self.serving
        if rolling is None or not rolling.checked or rolling.metric is None or serving is None:
            return
        why = _worse(serving, rolling, self.d.max_metric_drop)
        if why is not None:
            self._end_rollout(versions.refuse, why, "refused")

    def _place(self) -> None:
        """Drain what is over the wanted counts, start what is missing (dead ones first), each on a device
        of its own. The target is the rolling version once its metric passed, else the serving one; the
        others (the serving version during a rollout, a version refused or failed after it served) keep
        serving until enough replicas of the target are ready, and go one by one as they are."""
        n, rolling, gate = self.d.replicas, self.rolling, self._gate_open()
        target = rolling.version if rolling is not None and gate else self.d.version
        probe = rolling.version if rolling is not None and not gate else None
        self.workers = [w for w in self.workers  # a dead replica of another version is not started again
                        if w.get("pid") or w.get("draining") or w["version"] in (target, probe)]  # fmt: skip
        targets, probes = self._active(target), (self._active(probe) if probe else [])
        others = [w for w in self._active() if w["version"] not in (target, probe)]
        for w in targets + probes:
            w["ready"] = w["loaded"] and self._routable(w) and self._has_adapters(w)
            w["served"] = w.get("served", False) or w["ready"]
        ready_targets = sum(w["ready"] for w in targets)
        for w in others:  # one that served before, while the target has fewer ready replicas than wanted
            w["ready"] = w["loaded"] and w.get("served", w["version"] == self.d.version) and ready_targets < n
        first_to_go = lambda w: (w["version"] == self.d.version, w["ready"], -w["index"])  # noqa: E731
        self._drain(sorted(others, key=first_to_go)[: max(0, len(others) - max(0, n - ready_targets))])
        self._drain(sorted(probes, key=first_to_go)[: max(0, len(probes) - (1 if probe else 0))])
        self._drain(sorted(targets, key=first_to_go)[: max(0, len(targets) - n)])
        lacking = None  # the version that wants a replica no device is free for
        if probe is not None and self._fill(self._active(probe), 1, probe, rolling.model_dir, True):
            lacking = probe  # the probe measures the metric first
        version = rolling if rolling is not None and gate else self.serving
        model_dir = version.model_dir if version is not None else self.d.model_dir
        measure = version is not None and version.metric is None
        if self._fill(self._active(target), n, target, model_dir, measure) and lacking is None:
            lacking = target
        ready = [w for w in self._active() if w["ready"]]
        spare = [w for w in ready if w["version"] != lacking]
        if lacking is not None and spare and not any(w.get("draining") for w in self.workers):
            # free a device from a replica of another version, while another ready one serves on; with
            # one ready replica, it gives its device up: requests wait for the new one, as at a cold start
            if len(ready) == 1:
                versions.record(self.s, self.d.id, "replaced_in_place", version=lacking,
                                replica=spare[0]["index"], why=self._no_device())  # fmt: skip
                log.info("deployment %s: replica %d (v%d) gives its device up to v%d (%s)", self.d.name,
                         spare[0]["index"], spare[0]["version"], lacking, self._no_device())  # fmt: skip
            self._drain(sorted(spare, key=first_to_go)[:1])

    def _fill(self, group: list[dict], want: int, version: int, model_dir: str, measure: bool) -> int:
        """Start the dead replicas of `group` again and add replicas up to `want`; how many could not
        start for want of a free device."""
        while len(group) < want:
            index = max((w["index"] for w in self.workers), default=-1) + 1
            entry = {"index": index, "version": version, "model_dir": model_dir, "pid": None,
                     "restarts": -1, "loaded": False, "ready": False}  # fmt: skip
            self.workers.append(entry)
            group.append(entry)
        short = 0
        for w in group:
            if w.get("pid"):
                continue
            device = self._free_device(w.get("device"))
            if device is None:
                short += 1
                w["waiting"] = self._no_device()  # waits for a device, like a queued job, and says why
                continue
            w.pop("waiting", None)
            measuring = measure and not any(x.get("eval") and x.get("pid") for x in self._active(version))
            isolation = None
            if self.d.device_share is not None and self.keeper.share_isolation is not None:
                isolation = self.keeper.share_isolation(self.s, device.id, self.d.device_share)
            env = self.keeper.replica_env(self.s, self.d, device, isolation)
            try:
                launched = _launch(self.d, w, device, self.keeper, env, measuring)
            except GpuforgeError as err:  # every port of GPUFORGE_REPLICA_PORTS taken: it waits, saying so
                self._let_go(device.id)
                w["waiting"], short = str(err), short + 1
                continue
            w.update(launched, device=device.id, loaded=False, ready=False, eval=measuring, adapters=[],
                     adapter_refusals={}, isolation=isolation.said if isolation else None)  # fmt: skip
            w["restarts"] += 1
            _write_workers(self.s, self.d, self.workers)
            self.s.commit()  # the pid is in the store before anything else can fail
        return short

    def _hold(self, device_id: str) -> None:
        if self.d.device_share is None:
            self.taken.add(device_id)
        else:
            self.used[device_id] = self.used.get(device_id, 0.0) + self.d.device_share

    def _let_go(self, device_id: str) -> None:
        if self.d.device_share is None:
            self.taken.discard(device_id)
        else:
            self.used[device_id] = self.used.get(device_id, 0.0) - self.d.device_share

    def _free_device(self, previous: str | None) -> DeviceInfo | None:
        """A device of the deployment's kind that nothing holds (for a fraction: best fit among those with
        room, scheduler/sharing.py); a dead replica's own one first."""
        share = self.d.device_share
        mine = [d for d in self.keeper.devices if d.kind == self.d.device_type and d.id not in self.taken]
        if share is None:
            free = [d for d in mine if d.id not in self.used]
            free.sort(key=lambda d: d.id != previous)
            chosen = free[0] if free else None
        else:
            by_id = {d.id: d for d in mine}
            again = previous in by_id and share <= room(self.used, previous) + EPSILON
            picked = previous if again else best_fit(list(by_id), self.used, share)
            chosen = by_id.get(picked) if picked is not None else None
        if chosen is not None:
            self._hold(chosen.id)
        return chosen

    def _no_device(self) -> str:
        """Why a replica waits: "no cpu device free: cpu:0 held by job 4"."""
        kind = self.d.device_type
        held = [f"{d.id} held by {self.holders.get(d.id, 'a replica')}"
                for d in self.keeper.devices if d.kind == kind]  # fmt: skip
        return f"no {kind} device free: " + "; ".join(held) if held else f"this server has no {kind} device"

    def _drain(self, workers: list[dict]) -> None:
        """Out of the forwarder's picks now; SIGTERM once DRAIN_DELAY_S has passed (one not running:
        simply gone)."""
        for w in workers:
            if not w.get("pid"):
                self.workers.remove(w)
                continue
            w.update(draining=time.time(), ready=False)
            log.info("deployment %s: replica %d (v%d) drained", self.d.name, w["index"], w["version"])

    # --- adapters ---
    def _push_adapters(self) -> None:
        wanted = dict(self.d.adapters or {})
        key = None
        for w in self.workers:
            if not (w["loaded"] and w.get("pid")) or w.get("draining"):
                continue
            have = set(w.get("adapters") or [])
            # a refusal holds for the adapter it was about: one taken away and added again is asked anew
            refused = {n: why for n, why in (w.get("adapter_refusals") or {}).items() if n in wanted}
            w["adapter_refusals"] = refused
            for name in sorted(set(wanted) - have - set(refused)):
                key = key or self.keeper.replica_key(self.d)
                try:
                    why = replica_calls.add_adapter(w["port"], key, name, wanted[name])
                except httpx.HTTPError:
                    continue  # asked again at the next pass
                if why is None:
                    have.add(name)
                else:
                    refused[name] = why
                    versions.record(self.s, self.d.id, "adapter_refused", adapter=name, replica=w["index"],
                                    why=why)  # fmt: skip
            for name in sorted(have - set(wanted)):
                key = key or self.keeper.replica_key(self.d)
                try:
                    replica_calls.remove_adapter(w["port"], key, name)
                except httpx.HTTPError:
                    continue
                have.discard(name)
            w["adapters"] = sorted(have)

    # --- versions ---
    def _gate_open(self) -> bool:
        """Whether the rolling version may serve: unchecked (a rollback), or its metric is known and was
        not refused (a serving version whose metric is unknown does not hold it back)."""
        rolling = self.rolling
        return rolling is not None and (not rolling.checked or rolling.metric is not None)

    def _has_adapters(self, w: dict) -> bool:
        """Whether it serves every adapter added to the deployment (or has refused one for good): a
        replica just started takes requests once they are registered, so none is answered 404."""
        done = set(w.get("adapters") or []) | set(w.get("adapter_refusals") or {})
        return set(self.d.adapters or {}) <= done

    def _routable(self, w: dict) -> bool:
        """Whether a loaded replica of the target or probe version may take requests."""
        if self.rolling is not None and w["version"] == self.rolling.version:
            return self._gate_open()
        # the serving version's first replicas are picked once its metric is read (or none was asked)
        return not (w.get("eval") and self.serving is not None and self.serving.metric is None)

    def _end_rollout(self, move: Callable[..., bool], why: str, kind: str) -> None:
        """The rolling version refused or failed: its replicas go at once if they never served, else as
        replicas of the serving version replace them (_place)."""
        rolling, served = self.rolling, self._gate_open()
        if rolling is not None and move(self.s, rolling.id, why):
            versions.record(self.s, self.d.id, kind, version=rolling.version, why=why)
            outbox.deployment_event(
                self.s, self.d.id, outbox.DEPLOYMENT_REFUSED, f"v{rolling.version} {kind}: {why}"
            )
            log.warning("deployment %s: v%d %s: %s", self.d.name, rolling.version, kind, why)
            if not served:
                self._drain(self._active(rolling.version))
        self.rolling = None

    def _finish_rollout(self) -> None:
        rolling = self.rolling
        if rolling is None or not self._gate_open():
            return
        if any(w["version"] != rolling.version for w in self.workers):
            return  # old replicas (or drained ones not gone yet) remain
        if sum(w["ready"] for w in self.workers) < self.d.replicas:
            return
        before = self.d.version
        if versions.rolled_out(self.s, self.d, rolling):
            versions.record(self.s, self.d.id, "rolled_out", version=rolling.version, replaced=before)
            log.info("deployment %s: v%d serves (was v%d)", self.d.name, rolling.version, before)
            self.s.refresh(self.d)
            self.serving, self.rolling = rolling, None

    def _active(self, version: int | None = None) -> list[dict]:
        return [w for w in self.workers
                if not w.get("draining") and (version is None or w["version"] == version)]  # fmt: skip


def _worse(serving: DeploymentVersion, rolling: DeploymentVersion, tolerance: float) -> str | None:
    """Why `rolling` is refused beside `serving` (its eval metric fell by more than `tolerance`), or None."""
    before, after = serving.metric or {}, rolling.metric or {}
    if (
        before.get("value") is None
        or after.get("value") is None
        or before.get("metric") != after.get("metric")
    ):
        return None  # nothing to compare: one of them has no held-out split
    name = after["metric"]
    drop = (after["value"] - before["value"]) if name == "perplexity" else (before["value"] - after["value"])
    if drop <= tolerance:
        return None
    return (f"eval {name} {after['value']:.4f} on its held-out split, {drop:.4f} worse than "
            f"v{serving.version}'s {before['value']:.4f} (max_metric_drop {tolerance:g})")  # fmt: skip


def _write_workers(s: Session, d: Deployment, workers: list[dict]) -> None:
    s.execute(update(Deployment).where(Deployment.id == d.id).values(workers=workers))


def _settle(
    s: Session, deployment_id: int, read_state: DeploymentState, failure: str | None, all_ready: bool
) -> None:
    """The state its replicas say: failing when one cannot serve, else ready once all it wants are."""
    if failure is not None:
        states.deployment_failing(s, deployment_id, failure)
    elif all_ready and read_state == DeploymentState.STARTING:
        states.deployment_ready(s, deployment_id)
    elif not all_ready and read_state == DeploymentState.READY:
        states.deployment_starting(s, deployment_id)


def _launch(d: Deployment, w: dict, device: DeviceInfo, keeper: Keeper, env: dict, measure: bool) -> dict:
    port = free_port(keeper.ports)
    command = [sys.executable, "-m", "gpuforge", "serve", w["model_dir"], "--port", str(port),
               "--host", "127.0.0.1", "--device", device.kind]  # fmt: skip
    options: dict[str, Any] = {
        **d.options,
        "adapters_root": str(keeper.adapters_root),
        "eval_at_load": measure,
    }
    command += serve_flags(options)
    log_path = keeper.logs_dir / d.name / f"replica-{w['index']}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True,  # outlives a server restart, like a job's runner
        )  # fmt: skip
    log.info("deployment %s: replica %d (v%d) on %s, port %d (pid %d)", d.name, w["index"], w["version"],
             device.id, port, process.pid)  # fmt: skip
    return {"pid": process.pid, "port": port}


def _signal(worker: dict, after_s: float) -> None:
    """SIGTERM a replica `after_s` after it was drained, once (a second one would cut its graceful stop
    short); SIGKILL one still there STOP_GRACE_S later."""
    now = time.time()
    if now - worker.get("draining", now) < after_s:
        return
    signalled = worker.get("signalled_at")
    if signalled is None or now - signalled > STOP_GRACE_S:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker["pid"], signal.SIGTERM if signalled is None else signal.SIGKILL)
        worker["signalled_at"] = signalled or now


def _stop(deployment: Deployment) -> tuple[list[dict], bool]:
    """SIGTERM each replica still running (see _signal). (the workers, whether none is left)."""
    workers = [dict(w) for w in deployment.workers or []]
    for worker in workers:
        worker["ready"] = False
        model_dir = worker.get("model_dir", deployment.model_dir)
        if not (worker.get("pid") and is_alive(worker["pid"], model_dir)):
            _reap(worker.get("pid"))
            worker["pid"] = None
            continue
        worker.setdefault("draining", 0.0)  # stopping: no delay
        _signal(worker, 0.0)
    return workers, not any(w.get("pid") for w in workers)


def _reap(pid: int | None) -> None:
    """Collect the exit status of a replica this server started (else it stays a zombie)."""
    if pid:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass  # started by an earlier server: its parent is gone, init collects it
