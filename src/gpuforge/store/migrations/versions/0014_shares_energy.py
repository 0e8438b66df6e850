"""fractions of a device (jobs and deployments), what a share got, and the energy each run used

Revision ID: 0014
Revises: 0013

Every existing job and deployment holds whole devices (device_share null); the ledger's earlier minutes
measured no energy (kwh 0), which its readers show as not measured, never as none used.
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"

JOB_COLUMNS = (
    sa.Column("device_share", sa.Double(), nullable=True),
    sa.Column("isolation", sa.Text(), nullable=True),
    sa.Column("usd_per_kwh", sa.Double(), nullable=True),
    sa.Column("energy_kwh", sa.Double(), nullable=True),
    sa.Column("energy_source", sa.String(length=300), nullable=True),
    sa.Column("co2e_g", sa.Double(), nullable=True),
)


def upgrade() -> None:
    for column in JOB_COLUMNS:
        op.add_column("jobs", column)
    op.add_column("deployments", sa.Column("device_share", sa.Double(), nullable=True))
    op.add_column("ledger", sa.Column("kwh", sa.Double(), nullable=False, server_default="0"))
    op.add_column("ledger", sa.Column("co2e_g", sa.Double(), nullable=False, server_default="0"))


def downgrade() -> None:
    for table, column in [("ledger", "co2e_g"), ("ledger", "kwh"), ("deployments", "device_share")] + [
        ("jobs", c.name) for c in reversed(JOB_COLUMNS)
    ]:
        op.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
