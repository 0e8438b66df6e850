"""Notifications sent: the worker that takes the outbox's deliveries (store/outbox.py, store/deliveries.py)
and sends each to its target, signed, with bounded requests, retried with backoff (worker.py); what each
format's body is (messages.py); how a body is signed and checked (signing.py); the HTTP and SMTP sends
(transport.py). What happened, and who hears of it, is decided in the store, in the transaction of the
change; this package only sends."""
