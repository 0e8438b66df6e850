"""jobs: the latest MFU and ETA, copied from metrics like the other figures (the dashboard lists them)

Revision ID: 0006
Revises: 0005

An older store's jobs get NULL for both until their runner logs again: shown as unknown.
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"


def upgrade() -> None:
    with op.batch_alter_table("jobs") as table:
        table.add_column(sa.Column("mfu", sa.Double(), nullable=True))
        table.add_column(sa.Column("eta_s", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as table:
        table.drop_column("eta_s")
        table.drop_column("mfu")
