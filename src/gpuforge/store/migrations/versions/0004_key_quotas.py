"""api key quotas, and the uploads each key made the server store

Revision ID: 0004
Revises: 0003

The keys of an older store get NULL quotas: the defaults of store/quotas.py for a non-admin key, none for
an admin key. Files uploaded before it are charged to nobody.
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
QUOTA_COLUMNS = ("max_queued", "max_running", "max_upload_bytes", "max_deployments", "max_priority")


def upgrade() -> None:
    # batch: SQLite cannot ALTER a table in place for every change; PostgreSQL takes it as a plain ALTER
    with op.batch_alter_table("api_keys") as table:
        for name in QUOTA_COLUMNS:
            kind = sa.BigInteger() if name == "max_upload_bytes" else sa.Integer()
            table.add_column(sa.Column(name, kind, nullable=True))
    op.create_table(
        "uploads",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("suffix", sa.String(length=24), nullable=False),
        sa.Column("key_id", sa.Integer(), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["key_id"], ["api_keys.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("sha256", "suffix"),
    )
    op.create_index("ix_uploads_key_id", "uploads", ["key_id"])


def downgrade() -> None:
    op.drop_index("ix_uploads_key_id", table_name="uploads")
    op.drop_table("uploads")
    with op.batch_alter_table("api_keys") as table:
        for name in reversed(QUOTA_COLUMNS):
            table.drop_column(name)
