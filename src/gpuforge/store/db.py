"""Engine, sessions and schema migrations for the store.

    engine = connect("sqlite:////home/me/.gpuforge/gpuforge.db")   # or postgresql+psycopg://...
    migrate(engine)                                                  # alembic upgrade head
    with session(engine) as s: ...

SQLite gets write-ahead logging (readers do not block the one writer), foreign keys and a busy timeout;
the schema always comes from the migrations in migrations/versions, never from create_all, so a store
made by an older release is brought up to date the same way a new one is made.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def connect(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(url, pool_pre_ping=True)


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")  # with WAL: durable at checkpoints, fast commits
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def alembic_config(engine: Engine):
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["engine"] = engine
    return config


def migrate(engine: Engine, revision: str = "head") -> None:
    """Bring the schema to `revision` (default: the newest)."""
    from alembic import command

    command.upgrade(alembic_config(engine), revision)


@contextmanager
def session(engine: Engine) -> Iterator[Session]:
    """A session that commits when the block ends normally and rolls back when it raises."""
    factory = sessionmaker(engine, expire_on_commit=False)
    with factory() as s:
        try:
            yield s
            s.commit()
        except BaseException:
            s.rollback()
            raise


def answers(engine: Engine) -> None:
    """Ask the store the simplest question; its driver's error when it does not answer."""
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))
