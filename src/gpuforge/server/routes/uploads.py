"""Data files sent with `gpuforge submit`, stored once by content: <home>/uploads/<sha256><suffix>.

The client hashes each local file a spec names, asks whether the server has it (GET), sends it only if
not (PUT, the raw bytes), and names the returned server path in the spec it submits. The suffix is kept
because readers pick the format by it (.jsonl, .csv, .parquet, .txt, .npz, .py). A body whose hash is not
the one in the URL is refused and nothing is kept.

Uploads belong to the project of the key that sent them (store/uploads.py): another project's key is
answered 404 for content the server has, sends the bytes like anyone without them, and then holds it too
(the content is not stored twice, nor charged twice); a spec naming an upload its project does not hold is
refused (server/submit.py). Admins see all.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request, status
from sqlalchemy.exc import IntegrityError
from starlette.concurrency import run_in_threadpool

from gpuforge.server.auth import Key
from gpuforge.server.permissions import audited, permit
from gpuforge.server.refusals import quota_refusal
from gpuforge.server.schemas import UploadPublic
from gpuforge.server.services import services
from gpuforge.store.db import session
from gpuforge.store.models import ApiKey
from gpuforge.store.quotas import charge_upload, upload_allowance
from gpuforge.store.uploads import grant, may_use, split_name

router = APIRouter(prefix="/api/v1/uploads", tags=["uploads"])
SHA256 = r"^[0-9a-f]{64}$"
Name = Annotated[str, Query(max_length=255, description="the file's name; its suffix is kept")]


def _target(request: Request, sha256: str, name: str) -> Path:
    if not re.fullmatch(SHA256, sha256):
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, "sha256: 64 lowercase hex digits expected")
    suffix = "".join(Path(name).suffixes)[-24:]
    if not re.fullmatch(r"(\.[A-Za-z0-9_]+)*", suffix):
        suffix = ""
    return services(request).settings.uploads_dir / f"{sha256}{suffix}"


def _public(path: Path, sha256: str) -> UploadPublic:
    return UploadPublic(sha256=sha256, size=path.stat().st_size, path=str(path.resolve()))


def _held(request: Request, key: ApiKey, path: Path) -> bool:
    """Whether `key` may name this stored upload: its project (or it) sent these bytes, or it is an admin."""
    with session(services(request).engine) as s:
        return may_use(s, key, *split_name(path))


def _grant(request: Request, key: ApiKey, path: Path, size: int) -> None:
    """Let the key's project name the file, with the upload's audit row in the same transaction."""
    try:
        with session(services(request).engine) as s:
            grant(s, key, *split_name(path))
            audited(s, request, key, f"upload {path.name}", key.project_id, after={"bytes": size})
    except IntegrityError:
        pass  # granted at the same moment by another request of the same project


@router.get("/{sha256}", response_model=UploadPublic, dependencies=[permit("uploads.read")])
def find_upload(sha256: str, request: Request, key: Key, name: Name = "") -> UploadPublic:
    """Where the server keeps this content, if this key's project has sent it (404 otherwise: another
    project's upload is not this one's to know of, even by its hash)."""
    path = _target(request, sha256, name)
    if not path.exists() or not _held(request, key, path):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no upload {sha256}")
    return _public(path, sha256)


@router.put("/{sha256}", response_model=UploadPublic, dependencies=[permit("uploads.write")])
async def upload(sha256: str, request: Request, key: Key, name: Name = "") -> UploadPublic:
    """Store the request body (raw bytes) under its SHA-256, charged to its key's max_upload_bytes: past
    it, 429 before the body is read (by its Content-Length) or as soon as it passes, and nothing is kept.
    Content the server has already costs nothing."""
    path = _target(request, sha256, name)
    stored = path.exists()
    if stored and await run_in_threadpool(_held, request, key, path):
        return _public(path, sha256)
    engine = services(request).engine

    def allowance():
        with session(engine) as s:
            return upload_allowance(s, key)

    def keep(tmp: str, size: int) -> None:
        # charged first, then kept: a server that dies between the two has a row and no file, which the
        # next upload of that content puts right (a file with no row would be nobody's)
        try:
            with session(engine) as s:
                charge_upload(s, key, sha256, path.name[len(sha256) :], size)
        except IntegrityError:
            pass  # another key stored the same content at the same moment: charged to it, as if first
        os.replace(tmp, path)  # whole or absent: a reader never sees half a file
        _grant(request, key, path, size)

    allowed = await run_in_threadpool(allowance)  # the store off the event loop: it may wait for a lock
    length = request.headers.get("content-length", "")
    if not stored:  # content the server has costs nothing: its bytes are only checked, never kept again
        with quota_refusal():
            allowed.check(int(length) if length.isdigit() else 0)
    limit = services(request).settings.max_body_bytes
    path.parent.mkdir(parents=True, exist_ok=True)
    digest, size = hashlib.sha256(), 0
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".upload-")
    try:
        with quota_refusal(), os.fdopen(fd, "wb") as f:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise HTTPException(
                        status.HTTP_413_CONTENT_TOO_LARGE, f"upload is over the {limit} bytes allowed"
                    )
                if not stored:
                    allowed.check(size, partial=True)  # a body sent without a Content-Length
                digest.update(chunk)
                f.write(chunk)
        if digest.hexdigest() != sha256:
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT,
                f"the body's sha256 is {digest.hexdigest()}, not the {sha256} named in the URL",
            )
        if stored:  # another project's content: this one proved it has the bytes, and holds it too
            await run_in_threadpool(_grant, request, key, path, size)
        else:
            with quota_refusal():
                await run_in_threadpool(keep, tmp, size)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return _public(path, sha256)
