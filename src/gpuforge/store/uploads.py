"""Which keys may name an upload: uploads belong to the project of the key that sent them (to the key
itself where it has none). Content is kept once on disk, by its SHA-256; a project holds it once one of
its keys has sent its bytes (a hash alone proves nothing), and admins may name any."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuforge.store.models import ApiKey, UploadGrant

SHA256_HEX = 64


def holder(key: ApiKey) -> str:
    return f"project:{key.project_id}" if key.project_id is not None else f"key:{key.id}"


def split_name(path: Path) -> tuple[str, str]:
    """(sha256, suffix) of an upload's file name: <sha256><suffix>."""
    return path.name[:SHA256_HEX], path.name[SHA256_HEX:]


def may_use(s: Session, key: ApiKey, sha256: str, suffix: str) -> bool:
    if key.admin:
        return True
    found = select(UploadGrant.id).where(
        UploadGrant.sha256 == sha256, UploadGrant.suffix == suffix, UploadGrant.holder == holder(key)
    )
    return s.scalar(found) is not None


def grant(s: Session, key: ApiKey, sha256: str, suffix: str) -> None:
    """`key`'s project (or the key) holds this upload from now on (in the caller's transaction; two grants
    at the same moment: the second one's commit raises IntegrityError, and the grant stands)."""
    mine = holder(key)
    found = select(UploadGrant.id).where(
        UploadGrant.sha256 == sha256, UploadGrant.suffix == suffix, UploadGrant.holder == mine
    )
    if s.scalar(found) is None:
        s.add(UploadGrant(sha256=sha256, suffix=suffix, holder=mine))
