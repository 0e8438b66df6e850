"""Whether this run must test on PostgreSQL (CI, or GPUFORGE_REQUIRE_POSTGRES=1) rather than skip it."""

import os


def postgres_required() -> bool:
    ci = os.environ.get("CI", "").strip().lower()
    return os.environ.get("GPUFORGE_REQUIRE_POSTGRES") == "1" or ci not in ("", "0", "false", "no")
