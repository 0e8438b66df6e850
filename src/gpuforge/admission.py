"""Whether a job may run under a policy: its model options (python: models and trust_remote_code need
user code), every file it names and where it tracks to (tracking.mlflow.uri). Checked by the server at
submit and by the runner when it starts.

Here, above both policy.py and models/, because the options' allow-list is the models' own.
"""

from __future__ import annotations

from urllib.parse import urlparse

from gpuforge.errors import SpecError
from gpuforge.policy import Policy
from gpuforge.spec import JobSpec, mlflow_local_path


def check_spec(policy: Policy, spec: JobSpec) -> None:
    """A SpecError naming the field unless the spec holds to `policy`."""
    from gpuforge.models import checked_options  # here: models/ imports torch, which the server need not load

    checked_options(spec.model.source, spec.model.options, policy.user_code)
    for field, path in spec.file_references():
        policy.check_path(field, path)
    if spec.tracking.mlflow is not None:
        _check_mlflow_uri(policy, spec.tracking.mlflow.uri)


def _check_mlflow_uri(policy: Policy, uri: str) -> None:
    """A file store or SQLite database inside the roots; a server (or any other store) only for user
    code: it would make the runner send requests wherever the spec says."""
    field = "tracking.mlflow.uri"
    path = mlflow_local_path(uri)
    if path is not None:
        if policy.roots is not None and ("?" in uri or "#" in uri):  # sqlite's ?uri=true opens another file
            raise SpecError(f"{field}: {uri}: no query or fragment on a server's job")
        policy.check_path(field, path)
        return
    scheme = urlparse(uri).scheme
    if not policy.user_code:
        what = "an MLflow server" if scheme in ("http", "https") else f"a {scheme}: tracking store"
        raise SpecError(
            f"{field}: {what} needs an admin key (the job would make the server send requests to it); "
            "use a file: or sqlite:/// URI inside the data roots"
        )
