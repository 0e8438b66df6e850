"""Whether a job may run under a policy: its model options (python: models and trust_remote_code need
user code), every file it names and where it tracks to (tracking.mlflow.uri). Checked by the server at
submit and by the runner when it starts.

Here, above both policy.py and models/, because the options' allow-list is the models' own.
"""

from __future__ import annotations

from pathlib import Path

from gpuforge.errors import SpecError
from gpuforge.policy import Policy
from gpuforge.spec import JobSpec, ScriptJobSpec


def check_spec(policy: Policy, spec: JobSpec) -> None:
    """A SpecError naming the field unless the spec holds to `policy`."""
    from gpuforge.models import checked_options  # here: models/ imports torch, which the server need not load

    checked_options(spec.model.source, spec.model.options, policy.user_code)
    for field, path in spec.file_references():
        policy.check_path(field, path)
    if spec.tracking.mlflow is not None:
        _check_mlflow_uri(policy, spec.tracking.mlflow.uri)


def check_script(policy: Policy, spec: ScriptJobSpec) -> None:
    """A script job runs the team's own code as the server's user: only where user code is allowed (an
    admin's key, or GPUFORGE_ALLOW_USER_CODE), and its working copy and interpreter inside the roots (an
    empty workdir is the copy the server made of the files sent: its own)."""
    if not policy.user_code:
        raise SpecError(
            "kind: script runs your own command: it needs an admin key (or a server started with "
            "GPUFORGE_ALLOW_USER_CODE=1), as python: models do"
        )
    if spec.script.workdir:
        policy.check_path("script.workdir", Path(spec.script.workdir))
    if spec.script.python:
        policy.check_path("script.python", Path(spec.script.python))


def _check_mlflow_uri(policy: Policy, uri: str) -> None:
    """MLflow writes wherever its URI says (a directory, a database, a server), through code of its own
    that decodes the URI its own way: logging to it from a server's job is user code, for an admin's key
    (or GPUFORGE_ALLOW_USER_CODE). A person at their own shell may log anywhere."""
    if policy.roots is None or policy.user_code:
        return
    raise SpecError(
        f"tracking.mlflow.uri: {uri}: logging to MLflow from a server's job needs an admin key (MLflow "
        "writes wherever its URI says); tracking.tensorboard writes into the run directory and needs none"
    )
