"""The key a deployment's replicas want: derived, never stored.

Replicas listen on loopback and want a key, so that another local user cannot reach the model behind the
server's back. The server derives each deployment's key from a secret of its own (<home>/worker.secret,
mode 0600, made on first start) and the deployment's identity, hands it to the replicas in their
environment and sends it when it forwards; the store keeps only its digest, so a copy of the store opens
no replica.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import tempfile
from pathlib import Path

from gpuforge.errors import GpuforgeError
from gpuforge.store.keys import PREFIX
from gpuforge.store.models import Deployment

SECRET_FILE = "worker.secret"


def load_secret(home: Path) -> bytes:
    """This server's secret, made on its first start: written whole to a private file (0600 from its
    creation) and linked into place, so a second server starting at once reads it whole or makes none."""
    path = home / SECRET_FILE
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=home, prefix=".worker-secret-")  # mode 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_bytes(32).hex() + "\n")
            os.link(tmp, path)
        except FileExistsError:
            pass  # another server made it first: use theirs
        finally:
            os.unlink(tmp)
    secret = bytes.fromhex(path.read_text().strip())
    if len(secret) < 32:
        raise GpuforgeError(f"{path}: not a secret of 32 bytes (delete it to make a new one)")
    return secret


def worker_key(secret: bytes, deployment: Deployment) -> str:
    """The key of `deployment`'s replicas (stable across server restarts: re-attached replicas still
    answer)."""
    identity = f"{deployment.id}:{deployment.name}:{deployment.created_at.timestamp():.6f}"
    return PREFIX + hmac.new(secret, identity.encode(), hashlib.sha256).hexdigest()


def replicas_key(secret: bytes, deployment: Deployment) -> str:
    """The key `deployment`'s replicas were given: the derived one, or, for a deployment an older server
    made (its column holds the key itself, `gf_...`, where now a digest stands), that one until it is
    deployed again."""
    if deployment.worker_key.startswith(PREFIX):
        return deployment.worker_key
    return worker_key(secret, deployment)
