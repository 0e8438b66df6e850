"""jobs: the submit's idempotency key (unique per owner), and the user's names of its uploaded files

Revision ID: 0005
Revises: 0004

The jobs of an older store get NULL for both: no key (NULLs never collide under the unique constraint),
and no names (their reasons show the server's paths, as before).
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"


def upgrade() -> None:
    # batch: SQLite cannot add a constraint to a table in place; PostgreSQL takes it as a plain ALTER
    with op.batch_alter_table("jobs") as table:
        table.add_column(sa.Column("idempotency_key", sa.String(length=200), nullable=True))
        table.add_column(sa.Column("files", sa.JSON(), nullable=True))
        table.create_unique_constraint("uq_jobs_owner_idempotency_key", ["owner_id", "idempotency_key"])


def downgrade() -> None:
    with op.batch_alter_table("jobs") as table:
        table.drop_constraint("uq_jobs_owner_idempotency_key", type_="unique")
        table.drop_column("files")
        table.drop_column("idempotency_key")
