"""roles in a project for each key, and the audit log

Revision ID: 0011
Revises: 0010

An older store's keys become members of their project (or of none): what each could do before, but for
deploying a teammate's model, which is a maintainer's now (docs/security.md). The audit log starts empty;
triggers refuse to change or delete its rows, on SQLite and PostgreSQL alike, whoever connects.
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
NOW = sa.DateTime(timezone=True)
APPEND_ONLY = "audit_log rows are append-only"


def upgrade() -> None:
    # a plain ADD COLUMN: a batch (copy and move) would drop api_keys under the rows that refer to it
    op.add_column(
        "api_keys", sa.Column("role", sa.String(length=16), nullable=False, server_default="member")
    )
    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", NOW, nullable=False),
        sa.Column("actor", sa.String(length=100), nullable=False),
        sa.Column("actor_key_id", sa.Integer(), nullable=True),
        sa.Column("source", sa.String(length=64), nullable=False),
        sa.Column("action", sa.String(length=40), nullable=False),
        sa.Column("target", sa.String(length=200), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=True),
        sa.Column("before", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("after", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_audit_log_at", "audit_log", ["at"])
    op.create_index("ix_audit_log_action", "audit_log", ["action"])
    op.create_index("ix_audit_project_at", "audit_log", ["project_id", "at"])
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "CREATE FUNCTION audit_log_append_only() RETURNS trigger LANGUAGE plpgsql AS "
            f"$$ BEGIN RAISE EXCEPTION '{APPEND_ONLY}'; END $$"
        )
        op.execute(
            "CREATE TRIGGER audit_log_append_only BEFORE UPDATE OR DELETE ON audit_log "
            "FOR EACH ROW EXECUTE FUNCTION audit_log_append_only()"
        )
    else:
        for change in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER audit_log_no_{change.lower()} BEFORE {change} ON audit_log "
                f"BEGIN SELECT RAISE(ABORT, '{APPEND_ONLY}'); END"
            )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER audit_log_append_only ON audit_log")
        op.execute("DROP FUNCTION audit_log_append_only()")
    op.drop_table("audit_log")
    op.execute("ALTER TABLE api_keys DROP COLUMN role")  # SQLite 3.35+ and PostgreSQL: no table copy
