"""jobs: the lines of events.jsonl and metrics.jsonl read so far, for the line numbers of `unreadable`
events (an events line is no longer always one stored event: unreadable ones past a limit are counted)

Revision ID: 0009
Revises: 0008

An older store's jobs stored one event a line: their events lines are their events read; their metrics
lines count from 0 (a running job's next unreadable metrics line is numbered from where it was read).
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


def downgrade() -> None:
    with op.batch_alter_table("jobs") as table:
        table.drop_column("metrics_lines")
        table.drop_column("events_lines")
