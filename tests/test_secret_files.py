"""Secrets from files, and store URLs shown without their passwords."""

import pytest

from gpuforge.errors import GpuforgeError
from gpuforge.secret_files import read_secret_file, shown_url, url_with_password_masked

KEY = "gf_worker-key-0123456789abcdef"


def test_a_key_file_that_gives_no_key_is_one_clear_line(tmp_path):
    (tmp_path / "key").write_text(f"{KEY}\r\n")
    assert read_secret_file(tmp_path / "key", "--api-key-file", "the API key") == KEY
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00")
    for path, says in [
        (tmp_path / "missing", "cannot read it (No such file or directory)"),
        (tmp_path, "cannot read it (Is a directory)"),
        (tmp_path / "empty", "its first line is empty; it should hold the API key"),
        (tmp_path / "binary", "not UTF-8 text"),
    ]:
        with pytest.raises(GpuforgeError) as raised:
            read_secret_file(path, "--api-key-file", "the API key")
        assert str(raised.value).startswith(f"--api-key-file {path}: {says}")
        assert "\n" not in str(raised.value)


def test_a_password_is_never_shown_wherever_the_url_holds_it():
    assert url_with_password_masked("postgresql+psycopg://u@h/db") is None
    for url in (
        "postgresql+psycopg://u:s3cret@h/db",
        "postgresql+psycopg://u@h/db?password=s3cret",
        "postgresql+psycopg://u@h/db?sslpassword=s3cret&sslmode=require",
        "not a url://u:s3cret@h",
    ):
        shown = shown_url(url)
        assert "s3cret" not in shown and shown != url, (url, shown)
    assert shown_url("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"
