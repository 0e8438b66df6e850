"""Whether a job may run under a policy: its model options (python: models and trust_remote_code need
user code) and every file it names. Checked by the server at submit and by the runner when it starts.

Here, above both policy.py and models/, because the options' allow-list is the models' own.
"""

from __future__ import annotations

from gpuforge.policy import Policy
from gpuforge.spec import JobSpec


def check_spec(policy: Policy, spec: JobSpec) -> None:
    """A SpecError naming the field unless the spec holds to `policy`."""
    from gpuforge.models import checked_options  # here: models/ imports torch, which the server need not load

    checked_options(spec.model.source, spec.model.options, policy.user_code)
    for field, path in spec.file_references():
        policy.check_path(field, path)
