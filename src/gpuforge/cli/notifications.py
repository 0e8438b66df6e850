"""Notification verbs (they join `gpuforge.cli.app`; docs/notifications.md):

    gpuforge notifications [--state S] [--limit N] [--json]     (the deliveries to your targets, newest first)
    gpuforge notifications add --url URL | --url-file PATH [--format json|slack|email] [--project P]
                               [--events KIND,...] [--server-url URL]
    gpuforge notifications targets [--json] | remove ID | test ID

`add` takes --url for the webhook's URL (or, for email, the address), so the server's URL is --server-url
here (or GPUFORGE_URL, as everywhere). A webhook URL is a secret (whoever holds it can post to the channel):
on a machine shared with others, --url-file PATH keeps it out of the process list.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from gpuforge.cli.app import out_console
from gpuforge.cli.server import AsJson, KeyFile, Url, _print_json, app, client_for
from gpuforge.errors import GpuforgeError
from gpuforge.secret_files import read_secret_file

notifications_app = typer.Typer(
    invoke_without_command=True,
    help="Notifications: webhooks (JSON, Slack) and email when your jobs end, pause or are preempted, a "
    "deployment fails, a project's budget runs out. Alone: the deliveries and their state.",
)
app.add_typer(notifications_app, name="notifications")
KINDS = (
    "job.finished, job.failed, job.preempted, job.paused_budget, job.paused_max_time, deployment.refused, "
    "deployment.failed, budget.80, budget.100"
)  # written out: the CLI imports no store (the server checks them: store/outbox.py EVENT_KINDS)


def _print(line: str) -> None:
    out_console.print(line, highlight=False, markup=False, soft_wrap=True)


@notifications_app.callback()
def notifications(
    ctx: typer.Context,
    state: Annotated[str | None, typer.Option(help="only pending, delivered or failed ones")] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="the latest N")] = 50,
    url: Url = None,
    key_file: KeyFile = None,
    as_json: AsJson = False,
) -> None:
    """The deliveries to your targets (an admin key: all), newest first, with their state and last error."""
    if ctx.invoked_subcommand is not None:
        return
    rows = client_for(url, key_file).notification_deliveries(state, limit)
    if as_json:
        _print_json(rows)
        return
    table = Table(title="notifications")
    for column in ("id", "target", "kind", "state", "tries", "when", "what"):
        table.add_column(column)
    for d in rows:
        when = datetime.fromisoformat(d["delivered_at"] or d["created_at"]).strftime("%Y-%m-%d %H:%M:%S")
        said = d["text"] or d["subject"]
        if d["last_error"]:
            retry = f"; next try {d['next_attempt_at'][:19]}" if d["state"] == "pending" else ""
            said = f"{said} ({d['last_error']}{retry})"
        table.add_row(
            str(d["id"]), str(d["target_id"]), d["kind"], d["state"], str(d["attempts"]), when, said
        )
    out_console.print(table)


@notifications_app.command("add")
def add(
    target_url: Annotated[
        str | None, typer.Option("--url", help="the webhook's http(s) URL; for --format email, the address")
    ] = None,
    url_file: Annotated[
        Path | None,
        typer.Option("--url-file", help="a file whose first line is that URL", show_default=False),
    ] = None,
    format: Annotated[str, typer.Option("--format", help="json, slack or email")] = "json",
    project: Annotated[
        str | None, typer.Option(help="a project's target (admin key): its events; else your own")
    ] = None,
    events: Annotated[
        list[str] | None, typer.Option(help=f"the kinds it hears of, comma-separated (default: all): {KINDS}")
    ] = None,
    server_url: Annotated[
        str | None, typer.Option("--server-url", help="server URL (default: $GPUFORGE_URL)")
    ] = None,
    key_file: KeyFile = None,
    as_json: AsJson = False,
) -> None:
    """Add a target; its signing secret is printed this once (receivers check X-Gpuforge-Signature)."""
    if (target_url is None) == (url_file is None):
        raise GpuforgeError("notifications add: give --url URL or --url-file PATH")
    if url_file is not None:
        target_url = read_secret_file(url_file, "--url-file", "the target's URL")
    kinds = [k.strip() for given in events or [] for k in given.split(",") if k.strip()] or None
    made = client_for(server_url, key_file).add_notification_target(target_url, format, project, kinds)
    if as_json:
        _print_json(made)
        return
    of = f"project {made['project']}" if made["project"] else f"key {made['owner']}"
    _print(f"notification target {made['id']} made ({made['format']}, {of}, events: "
           f"{', '.join(made['events'] or ['all'])})")  # fmt: skip
    _print(f"its signing secret, shown this once: {made['secret']}")


@notifications_app.command("targets")
def targets(url: Url = None, key_file: KeyFile = None, as_json: AsJson = False) -> None:
    """Your targets (an admin key: all), never their secrets."""
    rows = client_for(url, key_file).notification_targets()
    if as_json:
        _print_json(rows)
        return
    table = Table(title="notification targets")
    for column in ("id", "format", "of", "events", "url"):
        table.add_column(column)
    for t in rows:
        of = f"project {t['project']}" if t["project"] else f"key {t['owner']}"
        table.add_row(str(t["id"]), t["format"], of, ", ".join(t["events"] or ["all"]), t["url"])
    out_console.print(table)


@notifications_app.command("remove")
def remove(target_id: int, url: Url = None, key_file: KeyFile = None) -> None:
    """Remove a target: nothing more is sent to it."""
    client_for(url, key_file).remove_notification_target(target_id)
    _print(f"notification target {target_id}: removed")


@notifications_app.command("test")
def test(target_id: int, url: Url = None, key_file: KeyFile = None, as_json: AsJson = False) -> None:
    """Send a test event to a target now; exit 1 unless it was delivered (it is tried again later, as any)."""
    sent = client_for(url, key_file).test_notification_target(target_id)
    if as_json:
        _print_json(sent)
    elif sent["state"] == "delivered":
        _print(f"notification target {target_id}: test delivered")
    else:
        _print(f"notification target {target_id}: test {sent['state']}: {sent['last_error']}")
    if sent["state"] != "delivered":
        raise typer.Exit(1)
