"""jobs: the lines of events.jsonl and metrics.jsonl read so far, for the line numbers of `unreadable`
events (an events line is no longer always one stored event: unreadable ones past a limit are counted);
upload_grants: the projects (or keys without one) that may name each upload

Revision ID: 0009
Revises: 0008

An older store's jobs stored one event a line: their events lines are their events read; their metrics
lines count from 0 (a running job's next unreadable metrics line is numbered from where it was read). Its
uploads are held by the project of the key charged for each (or that key).
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"


def upgrade() -> None:
    with op.batch_alter_table("jobs") as table:
        table.add_column(sa.Column("events_lines", sa.BigInteger(), nullable=False, server_default="0"))
        table.add_column(sa.Column("metrics_lines", sa.BigInteger(), nullable=False, server_default="0"))
    op.execute("UPDATE jobs SET events_lines = events_read")
    op.create_table(
        "upload_grants",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("suffix", sa.String(length=24), nullable=False),
        sa.Column("holder", sa.String(length=32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("sha256", "suffix", "holder"),
    )
    op.execute(
        "INSERT INTO upload_grants (sha256, suffix, holder, created_at) "
        "SELECT u.sha256, u.suffix, CASE WHEN k.project_id IS NULL THEN 'key:' || CAST(k.id AS VARCHAR(16)) "
        "ELSE 'project:' || CAST(k.project_id AS VARCHAR(16)) END, u.created_at "
        "FROM uploads u JOIN api_keys k ON k.id = u.key_id"
    )


def downgrade() -> None:
    op.drop_table("upload_grants")
    with op.batch_alter_table("jobs") as table:
        table.drop_column("metrics_lines")
        table.drop_column("events_lines")
