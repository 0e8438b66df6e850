"""Alembic's entry point: runs the migrations on the engine store/db.py hands over."""

from alembic import context

from gpuforge.store.models import Base

engine = context.config.attributes["engine"]
with engine.begin() as connection:
    context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
    context.run_migrations()
