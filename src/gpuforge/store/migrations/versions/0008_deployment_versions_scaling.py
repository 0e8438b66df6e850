"""deployments' versions (rolling updates, rollback), their events, autoscaling bounds and the adapters
added to a running one

Revision ID: 0008
Revises: 0007

An older store's deployments serve their model as version 1, with a fixed number of replicas (min = max =
replicas) and no adapters added.
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
NOW = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("deployments") as table:
        table.add_column(sa.Column("version", sa.Integer(), nullable=False, server_default="1"))
        table.add_column(sa.Column("min_replicas", sa.Integer(), nullable=False, server_default="1"))
        table.add_column(sa.Column("max_replicas", sa.Integer(), nullable=False, server_default="1"))
        table.add_column(sa.Column("target_queue", sa.Double(), nullable=False, server_default="4"))
        table.add_column(sa.Column("scale_down_after_s", sa.Double(), nullable=False, server_default="300"))
        table.add_column(sa.Column("max_metric_drop", sa.Double(), nullable=False, server_default="0.01"))
        table.add_column(sa.Column("adapters", sa.JSON(), nullable=True))
    op.execute("UPDATE deployments SET min_replicas = replicas, max_replicas = replicas")
    op.create_table(
        "deployment_versions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=True),
        sa.Column("model_dir", sa.String(length=1000), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("metric", sa.JSON(), nullable=True),
        sa.Column("checked", sa.Boolean(), nullable=False, server_default=sa.true()),
        sa.Column("created_at", NOW, nullable=False),
        sa.Column("ended_at", NOW, nullable=True),
        sa.ForeignKeyConstraint(["deployment_id"], ["deployments.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("deployment_id", "version"),
    )
    op.execute(
        "INSERT INTO deployment_versions (deployment_id, version, job_id, model_dir, state, created_at) "
        "SELECT id, 1, job_id, model_dir, 'serving', created_at FROM deployments"
    )
    op.create_table(
        "deployment_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("ts", sa.Double(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["deployment_id"], ["deployments.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_deployment_events_deployment_id", "deployment_events", ["deployment_id"])


def downgrade() -> None:
    op.drop_index("ix_deployment_events_deployment_id", table_name="deployment_events")
    op.drop_table("deployment_events")
    op.drop_table("deployment_versions")
    with op.batch_alter_table("deployments") as table:
        for name in ("adapters", "max_metric_drop", "scale_down_after_s", "target_queue", "max_replicas",
                     "min_replicas", "version"):  # fmt: skip
            table.drop_column(name)
