import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gpuforge.data.sources import Images, read_source
from gpuforge.errors import DataError

ROWS = [{"text": "a good day", "label": "pos"}, {"text": "a bad day", "label": "neg"}]


def test_jsonl_csv_tsv_parquet_json_read_the_same_records(tmp_path):
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    (tmp_path / "d.csv").write_text("text,label\na good day,pos\na bad day,neg\n")
    (tmp_path / "d.tsv").write_text("text\tlabel\na good day\tpos\na bad day\tneg\n")
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    for name in ("d.jsonl", "d.json", "d.csv", "d.tsv", "d.parquet"):
        assert read_source(str(tmp_path / name), "data.train") == ROWS, name


def test_text_npz_and_builtins(tmp_path):
    (tmp_path / "t.txt").write_text("hello corpus")
    assert read_source(str(tmp_path / "t.txt"), "data.train") == "hello corpus"
    np.savez(tmp_path / "i.npz", x=np.zeros((5, 6, 6, 3), dtype=np.uint8) + 255, y=np.arange(5))
    images = read_source(str(tmp_path / "i.npz"), "data.train")
    assert isinstance(images, Images) and images.pixels.shape == (5, 3, 6, 6) and images.pixels.max() == 1.0
    digits = read_source("sklearn:digits", "data.train")
    assert digits.pixels.shape == (1797, 1, 8, 8) and set(digits.labels.tolist()) == set(range(10))
    corpus = read_source("stdlib:docstrings", "data.train", max_records=50)
    assert isinstance(corpus, str) and len(corpus.split("\n\n")) == 50


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("absent.jsonl", None, "no such file"),
        ("empty.jsonl", "", "holds no records"),
        ("empty.txt", "  \n", "is empty"),
        ("bad.jsonl", '{"text": "ok"}\n{oops\n', "line 2: invalid JSON"),
        ("list.jsonl", "[1, 2]\n", "line 1: expected a JSON object"),
        ("data.xlsx", "x", "unknown file type"),
        ("bad.parquet", "not parquet", "not a readable parquet"),
    ],
)
def test_bad_files_are_named(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError, match=message) as err:
        read_source(str(path), "data.train")
    assert str(err.value).startswith("data.train: ")


def test_npz_without_known_arrays(tmp_path):
    np.savez(tmp_path / "i.npz", pics=np.zeros((2, 4, 4)))
    with pytest.raises(DataError, match="expected arrays 'x' and 'y'"):
        read_source(str(tmp_path / "i.npz"), "data.train")


def test_unknown_builtin():
    with pytest.raises(DataError, match="unknown built-in data set 'sklearn:iris'"):
        read_source("sklearn:iris", "data.train")


def test_the_digits_read_without_sklearn_are_load_digits():
    """sklearn:digits is read from scikit-learn's own file, without importing it (a second of CPU a
    process): the same pixels and labels as load_digits()."""
    from sklearn.datasets import load_digits

    digits, reference = read_source("sklearn:digits", "data.train", max_records=1000), load_digits()
    assert np.array_equal(digits.pixels[:, 0], (reference.images[:1000] / 16.0).astype(np.float32))
    assert np.array_equal(digits.labels, reference.target[:1000])
