"""projects (budgets, device caps, shares), the cost ledger, and what preemption, backfill and placement
keep on a job

Revision ID: 0007
Revises: 0006

An older store's keys and jobs belong to no project; its jobs get no rate (the ledger counts them at $0
until they are resumed with one) and are preemptible, as every job is unless an admin says otherwise.
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
NOW = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "projects",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("budget_usd_month", sa.Double(), nullable=True),
        sa.Column("max_devices", sa.Integer(), nullable=True),
        sa.Column("share", sa.Double(), nullable=False),
        sa.Column("created_at", NOW, nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    with op.batch_alter_table("api_keys") as table:
        table.add_column(sa.Column("project_id", sa.Integer(), nullable=True))
        table.create_foreign_key("fk_api_keys_project_id", "projects", ["project_id"], ["id"])
    with op.batch_alter_table("jobs") as table:
        table.add_column(sa.Column("project_id", sa.Integer(), nullable=True))
        table.add_column(sa.Column("usd_per_hour", sa.Double(), nullable=True))
        table.add_column(sa.Column("preemptible", sa.Boolean(), nullable=False, server_default=sa.true()))
        table.add_column(sa.Column("preemptions", sa.Integer(), nullable=False, server_default="0"))
        table.add_column(sa.Column("boost", sa.Integer(), nullable=False, server_default="0"))
        table.add_column(sa.Column("stop_requested", sa.String(length=16), nullable=True))
        table.add_column(sa.Column("max_time_s", sa.Double(), nullable=True))
        table.add_column(sa.Column("placement", sa.JSON(none_as_null=True), nullable=True))
        table.add_column(sa.Column("accrued_at", NOW, nullable=True))
        table.add_column(sa.Column("run_started_at", NOW, nullable=True))
        table.create_foreign_key("fk_jobs_project_id", "projects", ["project_id"], ["id"])
    op.create_index("ix_jobs_project_id", "jobs", ["project_id"])
    with op.batch_alter_table("deployments") as table:
        table.add_column(sa.Column("project_id", sa.Integer(), nullable=True))
        table.add_column(sa.Column("usd_per_hour", sa.Double(), nullable=True))
        table.add_column(sa.Column("accrued_at", NOW, nullable=True))
        table.create_foreign_key("fk_deployments_project_id", "projects", ["project_id"], ["id"])
    op.create_table(
        "ledger",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("subject", sa.String(length=40), nullable=False),
        sa.Column("minute", NOW, nullable=False),
        sa.Column("key_id", sa.Integer(), nullable=True),
        sa.Column("project_id", sa.Integer(), nullable=True),
        sa.Column("device_seconds", sa.Double(), nullable=False),
        sa.Column("usd", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(["key_id"], ["api_keys.id"]),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("subject", "minute"),
    )
    op.create_index("ix_ledger_project_minute", "ledger", ["project_id", "minute"])
    op.create_index("ix_ledger_minute", "ledger", ["minute"])


def downgrade() -> None:
    op.drop_index("ix_ledger_minute", table_name="ledger")
    op.drop_index("ix_ledger_project_minute", table_name="ledger")
    op.drop_table("ledger")
    with op.batch_alter_table("deployments") as table:
        table.drop_constraint("fk_deployments_project_id", type_="foreignkey")
        for name in ("accrued_at", "usd_per_hour", "project_id"):
            table.drop_column(name)
    op.drop_index("ix_jobs_project_id", table_name="jobs")
    with op.batch_alter_table("jobs") as table:
        table.drop_constraint("fk_jobs_project_id", type_="foreignkey")
        for name in (
            "run_started_at",
            "accrued_at",
            "placement",
            "max_time_s",
            "stop_requested",
            "boost",
            "preemptions",
            "preemptible",
            "usd_per_hour",
            "project_id",
        ):
            table.drop_column(name)
    with op.batch_alter_table("api_keys") as table:
        table.drop_constraint("fk_api_keys_project_id", type_="foreignkey")
        table.drop_column("project_id")
    op.drop_table("projects")
