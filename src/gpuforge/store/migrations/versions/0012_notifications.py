"""notifications: targets (webhooks, email), the outbox of events, and one delivery per event and target

Revision ID: 0012
Revises: 0011

An older store has no targets: nothing is sent until someone adds one (`gpuforge notifications add`).
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
NOW = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "notification_targets",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("owner_id", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=True),
        sa.Column("format", sa.String(length=8), nullable=False),
        sa.Column("destination", sa.Text(), nullable=False),
        sa.Column("events", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("secret", sa.String(length=64), nullable=False),
        sa.Column("created_at", NOW, nullable=False),
        sa.ForeignKeyConstraint(["owner_id"], ["api_keys.id"]),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_notification_targets_owner_id", "notification_targets", ["owner_id"])
    op.create_index("ix_notification_targets_project_id", "notification_targets", ["project_id"])
    op.create_table(
        "notification_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("subject", sa.String(length=40), nullable=False),
        sa.Column("owner_id", sa.Integer(), nullable=True),
        sa.Column("project_id", sa.Integer(), nullable=True),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.Column("once", sa.String(length=100), nullable=True),
        sa.Column("created_at", NOW, nullable=False),
        sa.ForeignKeyConstraint(["owner_id"], ["api_keys.id"]),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("once"),
    )
    op.create_table(
        "notification_deliveries",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("event_id", sa.Integer(), nullable=False),
        sa.Column("target_id", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", NOW, nullable=False),
        sa.Column("claimed_by", sa.String(length=32), nullable=True),
        sa.Column("claimed_until", NOW, nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("delivered_at", NOW, nullable=True),
        sa.Column("created_at", NOW, nullable=False),
        sa.ForeignKeyConstraint(["event_id"], ["notification_events.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["target_id"], ["notification_targets.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("event_id", "target_id"),
    )
    op.create_index("ix_notification_deliveries_due", "notification_deliveries", ["state", "next_attempt_at"])
    op.create_index("ix_notification_deliveries_target_id", "notification_deliveries", ["target_id"])


def downgrade() -> None:
    op.drop_table("notification_deliveries")  # its indexes go with it
    op.drop_table("notification_events")
    op.drop_table("notification_targets")
