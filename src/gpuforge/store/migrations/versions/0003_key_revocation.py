"""api key revocation

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"


def upgrade() -> None:
    # batch: SQLite cannot ALTER a table in place for every change; PostgreSQL takes it as a plain ALTER
    with op.batch_alter_table("api_keys") as table:
        table.add_column(sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as table:
        table.drop_column("revoked_at")
