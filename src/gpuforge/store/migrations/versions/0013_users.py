"""users (single sign-on), their memberships, and what ties a key to a user

Revision ID: 0013
Revises: 0012

An older store has no users; its keys stay plain keys (kind `key`), that never expire.
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
NOW = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "users",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("issuer", sa.String(length=500), nullable=False),
        sa.Column("subject", sa.String(length=255), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=True),
        sa.Column("email", sa.String(length=320), nullable=True),
        sa.Column("admin", sa.Boolean(), nullable=False),
        sa.Column("created_at", NOW, nullable=False),
        sa.Column("last_sign_in_at", NOW, nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("issuer", "subject"),
    )
    op.create_table(
        "memberships",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("user_id", sa.Integer(), sa.ForeignKey("users.id", ondelete="CASCADE"), nullable=False),
        sa.Column(
            "project_id", sa.Integer(), sa.ForeignKey("projects.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("source", sa.String(length=8), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("user_id", "project_id", "source"),
    )
    op.create_index("ix_memberships_user_id", "memberships", ["user_id"])
    # plain ADD COLUMNs (ADD COLUMN ... REFERENCES on SQLite): a batch (copy and move) would drop api_keys
    # under the rows that refer to it
    if op.get_bind().dialect.name == "sqlite":  # which alembic declines outside a batch
        op.execute("ALTER TABLE api_keys ADD COLUMN user_id INTEGER REFERENCES users (id)")
    else:
        op.add_column(
            "api_keys", sa.Column("user_id", sa.Integer(), sa.ForeignKey("users.id"), nullable=True)
        )
    op.add_column("api_keys", sa.Column("kind", sa.String(length=8), nullable=False, server_default="key"))
    op.add_column("api_keys", sa.Column("expires_at", NOW, nullable=True))
    op.create_index("ix_api_keys_user_id", "api_keys", ["user_id"])


def downgrade() -> None:
    op.drop_index("ix_api_keys_user_id", "api_keys")
    for column in ("expires_at", "kind", "user_id"):
        op.execute(f"ALTER TABLE api_keys DROP COLUMN {column}")
    op.drop_index("ix_memberships_user_id", "memberships")
    op.drop_table("memberships")
    op.drop_table("users")
