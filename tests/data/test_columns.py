"""The cheap look at a data file's columns the server takes at submit (data/columns.py)."""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gpuforge.data.columns import check_columns, first_columns
from gpuforge.errors import DataError
from gpuforge.spec import parse_spec


def test_the_first_record_gives_the_columns_of_every_record_format(tmp_path):
    files = {
        "a.jsonl": '\n{"text": "hi", "label": 1}\n{broken\n',  # only the first record is read
        "a.json": '[{"text": "hi", "label": 1}, {"broken": ',
        "a.csv": "\ufefftext,label\nhi,1\n",  # a spreadsheet's BOM is not part of the first column
        "a.tsv": "text\tlabel\nhi\t1\n",
        "notes.txt": "plain text has no columns",
    }
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    pq.write_table(pa.table({"text": ["hi"], "label": [1]}), tmp_path / "a.parquet")
    for name in ("a.jsonl", "a.json", "a.csv", "a.tsv", "a.parquet"):
        assert first_columns(tmp_path / name) == ["text", "label"], name
    assert first_columns(tmp_path / "notes.txt") is None
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert first_columns(tmp_path / "bad.jsonl") is None  # left for the runner, which says where


def test_a_missing_file_or_column_is_named_by_its_field(tmp_path):
    (tmp_path / "train.csv").write_text("sentence,label\nhi,1\n")
    (tmp_path / "eval.jsonl").write_text(json.dumps({"sentence": "hi", "topic": 1}) + "\n")

    def spec(task: str, **data):
        model = {"source": "bundled:gpt-tiny" if task == "causal-lm" else "bundled:minilm", "task": task}
        return parse_spec({"model": model, "data": data}, tmp_path)

    missing_text = r"^data.text_field: 'text' not found in .*train.csv \(columns: sentence, label\)$"
    with pytest.raises(DataError, match=missing_text):
        check_columns(spec("sequence-classification", train="train.csv"))
    check_columns(spec("sequence-classification", train="train.csv", text_field="sentence"))
    with pytest.raises(DataError, match=r"^data.label_field: 'label' not found in .*eval.jsonl"):
        check_columns(
            spec("sequence-classification", train="train.csv", eval="eval.jsonl", text_field="sentence")
        )
    check_columns(
        spec("causal-lm", train="eval.jsonl", text_field="sentence")
    )  # a language model reads no labels
    with pytest.raises(DataError, match=r"^data.train: .*gone.csv: no such file$"):
        check_columns(spec("sequence-classification", train="gone.csv"))


def test_the_check_imports_no_torch():
    """The server runs it at every submit, and the server never imports torch."""
    code = "import sys, gpuforge.data.columns; print('torch' in sys.modules)"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert found.stdout.strip() == "False", found.stderr
