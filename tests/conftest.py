"""Shared fixtures: tiny models and data on disk, a per-session cache, state reset after each test."""

from __future__ import annotations

import os
import random
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from gpuforge.distributed.ranks import leave_process_group
from tests.helpers.paths import TOPICS
from tests.helpers.postgres import postgres_required

pytest_plugins = ("tests.helpers.oidc_provider",)  # start_provider, oidc_provider: a real OpenID provider


def pytest_configure(config):
    # One cache (measured matmul peaks, gathered corpora) for the whole session, never the user's.
    cache = Path(os.environ.get("PYTEST_GPUFORGE_CACHE", "/tmp/gpuforge-test-cache"))
    os.environ["GPUFORGE_CACHE_DIR"] = str(cache)
    os.environ["HF_HUB_OFFLINE"] = "1"


def pytest_collection_modifyitems(config, items):
    _heaviest_modules_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run by scripts/gpu_check.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _heaviest_modules_first(items: list[pytest.Item]) -> None:
    """Modules with the most slow tests first, each module whole: scripts/test.sh splits the run in two
    halves, one a worker, each module mostly on one (--dist worksteal: the server a module's tests share is
    started once), and the long modules are not the last to start."""
    slow: dict[str, int] = {}
    for item in items:
        slow[item.module.__name__] = slow.get(item.module.__name__, 0) + (
            item.get_closest_marker("slow") is not None
        )
    order = {name: place for place, name in enumerate(slow)}
    items.sort(key=lambda item: (-slow[item.module.__name__], order[item.module.__name__]))


@pytest.fixture(autouse=True)
def _reset_state():
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    yield
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)
    random.seed()
    np.random.seed()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    leave_process_group(peers_done=False)  # a group a test left behind: no peers to wait for


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path) -> Iterator[str]:
    """A store URL for an empty database, once on SQLite and once on PostgreSQL.

    PostgreSQL: a fresh database per test on the server GPUFORGE_TEST_POSTGRES_URL names (scripts/postgres.sh
    starts one), dropped afterwards. Without that URL the PostgreSQL case is skipped, or fails when CI or
    GPUFORGE_REQUIRE_POSTGRES=1 says it must run."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'store.db'}"
        return
    base = os.environ.get("GPUFORGE_TEST_POSTGRES_URL", "").strip()
    if not base:
        reason = "GPUFORGE_TEST_POSTGRES_URL is unset (start a server with: bash scripts/postgres.sh)"
        if postgres_required():
            pytest.fail(f"{reason}, and CI or GPUFORGE_REQUIRE_POSTGRES=1 requires PostgreSQL", pytrace=False)
        pytest.skip(reason)
    from sqlalchemy import create_engine, make_url, text  # here: the GPU machine runs tests without it
    from sqlalchemy.pool import NullPool

    name = f"gpuforge_test_{uuid.uuid4().hex[:16]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        yield make_url(base).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:  # connections a test left open must not keep its database alive
            conn.execute(
                text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"), {"n": name}
            )
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
        admin.dispose()


@pytest.fixture
def engine(store_url):
    """A migrated store, on SQLite and on PostgreSQL (store_url)."""
    from gpuforge.store.db import connect, migrate  # here: the GPU machine runs tests without SQLAlchemy

    engine = connect(store_url)
    migrate(engine)
    yield engine
    engine.dispose()


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory) -> Path:
    """A 2-layer, 32-wide BERT saved like any local transformers model, with a small WordPiece vocabulary
    of its own (so it needs no package's files, also on the GPU machine)."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    out = tmp_path_factory.mktemp("tiny-bert")
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789.,!?'-")
    words = list(dict.fromkeys(re.findall(r"[a-z]+", TOPICS.read_text().lower())))[:400]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *letters, *(f"##{c}" for c in letters), *words]
    # the vocabulary itself, not a file: transformers 5 ignores `vocab_file` and left 5 tokens (all [UNK])
    tokenizer = BertTokenizerFast(vocab={token: i for i, token in enumerate(dict.fromkeys(vocab))})
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    BertForSequenceClassification(config).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


@pytest.fixture
def small_topics(tmp_path) -> Path:
    """The first 96 labelled sentences of the shipped topics set."""
    lines = TOPICS.read_text().splitlines()[:96]
    path = tmp_path / "topics.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path
