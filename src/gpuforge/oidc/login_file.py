"""Where `gpuforge login` keeps a sign-in: one JSON file per server, mode 0600, in the user's config
directory ($XDG_CONFIG_HOME/gpuforge/logins/, else ~/.config/gpuforge/logins/).

The file is made 0600 before a byte is written (then moved into place, so a reader never sees half of
it), and one that others may read is refused rather than used: a refresh token is a password for as long
as it lives. Its name is a digest of the server's URL: nothing a server or a user types becomes a path.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

from gpuforge.errors import GpuforgeError


@dataclass(frozen=True)
class StoredLogin:
    server: str
    issuer: str
    client_id: str  # the CLI's client id at the issuer: a refresh is sent as it
    id_token: str
    refresh_token: str | None
    expires_at: int  # the ID token's `exp`, seconds since the epoch

    def __repr__(self) -> str:  # tokens are secrets: never in a log or a traceback
        return f"StoredLogin(server={self.server!r}, issuer={self.issuer!r}, expires_at={self.expires_at})"


def config_dir(environ: dict[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "gpuforge"


def normal_server(url: str) -> str:
    """A server's URL as logins are filed under: no trailing slash, scheme and host in lower case."""
    scheme, sep, rest = url.strip().rstrip("/").partition("://")
    host, slash, path = rest.partition("/")
    return f"{scheme.lower()}{sep}{host.lower()}{slash}{path}"


def login_path(server: str, directory: Path | None = None) -> Path:
    digest = hashlib.sha256(normal_server(server).encode()).hexdigest()[:32]
    return (directory or config_dir()) / "logins" / f"{digest}.json"


def save_login(login: StoredLogin, directory: Path | None = None) -> Path:
    """Write `login` for its server, replacing any earlier one; the file is 0600 from its first byte."""
    path = login_path(login.server, directory)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            json.dump({**asdict(login), "server": normal_server(login.server)}, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def load_login(server: str, directory: Path | None = None) -> StoredLogin | None:
    """The sign-in kept for `server`, None if there is none; a GpuforgeError for a file that group or
    others may read, that is not this user's, or that does not hold a sign-in."""
    path = login_path(server, directory)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise GpuforgeError(f"{path}: cannot read the sign-in ({err.strerror})") from None
    with os.fdopen(fd, encoding="utf-8") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise GpuforgeError(
                f"{path}: group or others may read it, or it is not yours: not used (its tokens may be "
                "known to others); gpuforge logout, then gpuforge login"
            )
        try:
            login = StoredLogin(**json.load(file))
            texts = (login.server, login.issuer, login.client_id, login.id_token)
            if not all(isinstance(t, str) for t in texts) or not isinstance(login.refresh_token, str | None):
                raise TypeError
            if not isinstance(login.expires_at, int):
                raise TypeError
        except (ValueError, TypeError):
            raise GpuforgeError(
                f"{path}: not a gpuforge sign-in; gpuforge logout, then gpuforge login"
            ) from None
    if login.server != normal_server(server):
        return None  # a digest's collision, or a file copied by hand: not this server's
    return login


def remove_login(server: str, directory: Path | None = None) -> bool:
    """Forget the sign-in kept for `server`; whether there was one."""
    try:
        login_path(server, directory).unlink()
    except FileNotFoundError:
        return False
    return True
