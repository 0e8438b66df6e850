"""The sender on a real store against real receivers on 127.0.0.1 (no HTTP or SMTP layer faked): each
event delivered once per target and signed, a receiver that is down gets each event once it is back, two
senders on one store never send the same row, tries are bounded and keep their last error, redirects are
not followed, a stalled receiver is cut off, email goes through a real SMTP server."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from email import message_from_bytes

import pytest
from sqlalchemy import select

from gpuforge.notify.transport import Limits, Smtp
from gpuforge.notify.worker import Notifier, NotifierOptions, retry_after_s
from gpuforge.store import states
from gpuforge.store.db import session
from gpuforge.store.models import ApiKey, DeliveryState, Job, JobState, NotificationDelivery
from gpuforge.store.notification_targets import create_target
from tests.helpers.receivers import SmtpInbox, WebhookReceiver, signature_holds

FAST = NotifierOptions(first_retry_s=0.05, max_retry_s=0.2, poll_s=0.05, limits=Limits(read_s=2, total_s=5))


@pytest.fixture
def receiver():
    made = WebhookReceiver()
    yield made
    made.close()


def _key(engine, name: str = "ada") -> int:
    with session(engine) as s:
        key = ApiKey(name=name, digest=name[0] * 64)
        s.add(key)
        s.flush()
        return key.id


def _target(engine, key_id: int, url: str, format: str = "json") -> tuple[int, str]:
    with session(engine) as s:
        target, secret = create_target(s, key_id, format, url)
        return target.id, secret


def _finish_jobs(engine, key_id: int, count: int = 1, ending: str = "finished") -> list[int]:
    """Jobs of the key's that just ended, each moved as the loop moves them (its event in the outbox)."""
    ids = []
    with session(engine) as s:
        for _ in range(count):
            job = Job(name="digits", spec_yaml="", run_dir="/tmp/r", owner_id=key_id, state=JobState.RUNNING)
            s.add(job)
            s.flush()
            assert states.end(s, job.id, ending, "CUDA error" if ending == "failed" else None)
            ids.append(job.id)
    return ids


def _deliveries(engine) -> list[NotificationDelivery]:
    with session(engine) as s:
        return list(s.scalars(select(NotificationDelivery).order_by(NotificationDelivery.id)))


def _until(condition, timeout: float = 30.0, step=None):
    """Wait for `condition()` (calling `step()` between looks, if given); its last value past `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        found = condition()
        if found or time.monotonic() > deadline:
            return found
        if step is not None:
            step()
        else:
            time.sleep(0.02)


def test_an_event_is_posted_once_to_each_target_signed_and_slack_gets_its_text(engine, receiver):
    key = _key(engine)
    json_target, json_secret = _target(engine, key, receiver.url("/json"))
    slack_target, slack_secret = _target(engine, key, receiver.url("/slack"), "slack")
    (job_id,) = _finish_jobs(engine, key)
    notifier = Notifier(engine, FAST)
    assert notifier.send_due() == 2
    assert notifier.send_due() == 0  # nothing due any more: sent once
    by_path = {r.path: r for r in receiver.received}
    assert sorted(by_path) == ["/json", "/slack"] and len(receiver.received) == 2
    sent = by_path["/json"]
    assert signature_holds(json_secret, sent.headers["X-Gpuforge-Signature"], sent.body)
    assert not signature_holds(slack_secret, sent.headers["X-Gpuforge-Signature"], sent.body)  # its own key
    assert not signature_holds(json_secret, sent.headers["X-Gpuforge-Signature"], sent.body + b" ")
    body = sent.json()
    assert (body["kind"], body["subject"], body["job"]["id"], body["job"]["state"]) == (
        "job.finished", f"job:{job_id}", job_id, "finished",
    )  # fmt: skip
    assert (
        sent.headers["X-Gpuforge-Event"] == "job.finished"
        and sent.headers["Content-Type"] == "application/json"
    )
    assert sent.headers["X-Gpuforge-Event-Id"] == str(body["id"])
    slack = by_path["/slack"]
    assert slack.json() == {
        "text": f"gpuforge: job {job_id} (digits) finished"
    }  # an incoming webhook's shape
    assert signature_holds(slack_secret, slack.headers["X-Gpuforge-Signature"], slack.body)
    rows = _deliveries(engine)
    assert [(d.target_id, d.state, d.attempts, d.last_error) for d in rows] == [
        (json_target, "delivered", 1, None), (slack_target, "delivered", 1, None),
    ]  # fmt: skip
    assert all(d.claimed_by is None and d.delivered_at is not None for d in rows)


def test_a_receiver_down_then_back_gets_each_event_exactly_once(engine):
    down = WebhookReceiver(listening=False)  # its port bound, nothing accepted: connections refused
    key = _key(engine)
    _target(engine, key, down.url())
    jobs = _finish_jobs(engine, key, count=3)
    notifier = Notifier(engine, FAST)
    notifier.start()  # the server's thread, as the server runs it
    try:
        tried = _until(lambda: all(d.attempts >= 2 and d.last_error for d in _deliveries(engine)))
        assert tried, [(d.attempts, d.last_error) for d in _deliveries(engine)]
        assert all(d.state == "pending" and "ConnectError" in d.last_error for d in _deliveries(engine))
        assert all(down.url() not in d.last_error for d in _deliveries(engine))  # the URL is a secret
        down.listen()
        assert _until(lambda: all(d.state == "delivered" for d in _deliveries(engine)))
    finally:
        notifier.stop()
        down.close()
    assert sorted(r.json()["job"]["id"] for r in down.received) == sorted(jobs)  # each once


def test_two_senders_on_one_store_never_send_the_same_row(engine, receiver):
    """Two server processes' senders, passing at once over the same due rows: each row is claimed by one."""
    key = _key(engine)
    _target(engine, key, receiver.url("/a"))
    _target(engine, key, receiver.url("/b"))
    _finish_jobs(engine, key, count=6)
    first, second = Notifier(engine, FAST), Notifier(engine, FAST)
    with ThreadPoolExecutor(2) as passes:  # each pass of the two at the same moment, over the same due rows
        assert _until(
            lambda: all(d.state == "delivered" for d in _deliveries(engine)),
            step=lambda: list(passes.map(lambda sender: sender.send_due(), [first, second])),
        )
    sent = sorted((r.path, r.headers["X-Gpuforge-Event-Id"]) for r in receiver.received)
    assert len(sent) == 12 and len(set(sent)) == 12  # 6 events x 2 targets, none twice
    assert all(d.attempts == 1 for d in _deliveries(engine))


def test_tries_are_bounded_and_a_failed_delivery_keeps_its_last_error(engine):
    failing = WebhookReceiver(answers=[500] * 10)
    key = _key(engine)
    _target(engine, key, failing.url())
    _finish_jobs(engine, key, ending="failed")
    notifier = Notifier(engine, NotifierOptions(max_attempts=3, first_retry_s=0.01, max_retry_s=0.02))
    try:
        assert _until(lambda: _deliveries(engine)[0].state == "failed", step=notifier.send_due)
    finally:
        failing.close()
    (row,) = _deliveries(engine)
    assert (row.attempts, row.last_error) == (3, "answered 500") and len(failing.received) == 3
    assert notifier.send_due() == 0  # failed for good: not tried again


def test_a_redirect_is_an_answer_not_followed(engine):
    moving = WebhookReceiver(answers=[302])
    key = _key(engine)
    _target(engine, key, moving.url("/old"))
    _finish_jobs(engine, key)
    try:
        assert Notifier(engine, FAST).send_due() == 1
    finally:
        moving.close()
    assert [r.path for r in moving.received] == ["/old"]  # /redirected never asked for
    (row,) = _deliveries(engine)
    assert row.state == "pending" and "302" in row.last_error and "not followed" in row.last_error


def test_a_receiver_that_never_answers_is_cut_off_at_the_read_timeout(engine):
    stalled = WebhookReceiver(stall=True)
    key = _key(engine)
    _target(engine, key, stalled.url())
    _finish_jobs(engine, key)
    notifier = Notifier(engine, NotifierOptions(limits=Limits(read_s=0.3, total_s=1)))
    began = time.monotonic()
    try:
        assert notifier.send_due() == 1
    finally:
        stalled.close()
    assert time.monotonic() - began < 10  # bounded (the test machine may be slow: not 0.3 s exactly)
    (row,) = _deliveries(engine)
    assert row.state == "pending" and "ReadTimeout" in row.last_error


@pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS")  # a test server on loopback
def test_an_email_target_gets_a_message_through_a_real_smtp_server(engine):
    inbox = SmtpInbox(login=("notifier", "s3cret"))
    key = _key(engine)
    _target(engine, key, "mailto:ada@example.com", "email")
    (job_id,) = _finish_jobs(engine, key, ending="failed")
    smtp = Smtp("127.0.0.1", "gpuforge@example.com", inbox.port, "notifier", "s3cret", starttls=False)
    try:
        assert Notifier(engine, NotifierOptions(smtp=smtp)).deliver(_deliveries(engine)[0].id) == "delivered"
    finally:
        inbox.close()
    ((recipients, raw),) = inbox.messages
    message = message_from_bytes(raw)
    assert recipients == ["ada@example.com"] and message["From"] == "gpuforge@example.com"
    assert message["Subject"] == f"gpuforge: job {job_id} (digits) failed: CUDA error"
    assert "s3cret" not in repr(smtp)


def test_an_email_target_without_smtp_settings_says_what_to_set(engine):
    key = _key(engine)
    _target(engine, key, "ada@example.com", "email")
    _finish_jobs(engine, key)
    assert Notifier(engine, FAST).send_due() == 1
    assert "GPUFORGE_SMTP_HOST" in _deliveries(engine)[0].last_error


def test_the_backoff_doubles_up_to_its_cap():
    options = NotifierOptions(first_retry_s=10, max_retry_s=60)
    assert [retry_after_s(n, options) for n in range(1, 6)] == [10, 20, 40, 60, 60]
    assert DeliveryState.PENDING == "pending"
