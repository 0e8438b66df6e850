"""searches: hyperparameter searches, and each job's search and trial number

Revision ID: 0010
Revises: 0009

An older store's jobs belong to no search. The `pruned` job state needs no change to the schema (states are
strings). Each search's Optuna study lives in Optuna's own tables, made by Optuna where the server says
(scheduler/searches.py), not here.
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
NOW = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "searches",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("owner_id", sa.Integer(), sa.ForeignKey("api_keys.id"), nullable=True),
        sa.Column("project_id", sa.Integer(), sa.ForeignKey("projects.id"), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("tune_yaml", sa.Text(), nullable=False),
        sa.Column("job_yaml", sa.Text(), nullable=False),
        sa.Column("trial_job", sa.JSON(), nullable=False),
        sa.Column("stop_requested", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("created_at", NOW, nullable=False),
        sa.Column("finished_at", NOW, nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("jobs") as table:
        table.add_column(sa.Column("search_id", sa.Integer(), nullable=True))
        table.add_column(sa.Column("trial", sa.Integer(), nullable=True))
        table.create_foreign_key("fk_jobs_search_id", "searches", ["search_id"], ["id"])
        table.create_unique_constraint("uq_jobs_search_trial", ["search_id", "trial"])  # its lookups too


def downgrade() -> None:
    with op.batch_alter_table("jobs") as table:
        table.drop_constraint("uq_jobs_search_trial", type_="unique")
        table.drop_constraint("fk_jobs_search_id", type_="foreignkey")
        table.drop_column("trial")
        table.drop_column("search_id")
    op.drop_table("searches")
