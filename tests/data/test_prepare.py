import json

import pytest

from gpuforge.data import prepare_data
from gpuforge.data.batches import BatchOrder, eval_batches, micro_batches
from gpuforge.errors import DataError
from gpuforge.models.tokenizers import byte_tokenizer
from gpuforge.spec import DataSpec


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_classification_pads_per_batch_not_to_max_length(tmp_path):
    rows = [{"text": "ab", "label": "x"}, {"text": "abcdefgh", "label": "y"}, {"text": "abcd", "label": "x"}]
    spec = DataSpec(train=_jsonl(tmp_path / "d.jsonl", rows), eval_fraction=0.0, max_length=100)
    data = prepare_data(spec, "sequence-classification", byte_tokenizer(), seed=0)
    assert data.labels == ["x", "y"] and data.eval is None
    batch = data.train.collate([0, 2])
    assert batch["input_ids"].shape == (2, 4)  # longest of the two, not 100
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch["labels"].tolist() == [0, 0]
    truncated = prepare_data(
        DataSpec(train=spec.train, eval_fraction=0.0, max_length=5),
        "sequence-classification",
        byte_tokenizer(),
        seed=0,
    )
    assert max(len(ids) for ids in truncated.train.ids) == 5


def test_integer_labels_and_a_separate_eval_file(tmp_path):
    train = _jsonl(tmp_path / "t.jsonl", [{"t": "a", "y": 0}, {"t": "b", "y": 2}])
    evaluation = _jsonl(tmp_path / "e.jsonl", [{"t": "c", "y": 1}])
    data = prepare_data(
        DataSpec(train=train, eval=evaluation, text_field="t", label_field="y"),
        "sequence-classification",
        byte_tokenizer(),
        seed=0,
    )
    assert data.labels == ["0", "1", "2"] and len(data.eval) == 1
    assert data.eval.collate([0])["labels"].tolist() == [1]


def test_causal_lm_packs_text_into_full_blocks(tmp_path):
    (tmp_path / "c.txt").write_text("x" * 1000)
    data = prepare_data(
        DataSpec(train=str(tmp_path / "c.txt"), max_length=64, eval_fraction=0.1),
        "causal-lm",
        byte_tokenizer(),
        seed=0,
    )
    total = len(data.train) + len(data.eval)
    assert total == 1001 // 64  # 1000 bytes + end-of-text, in whole blocks
    assert data.train.collate([0, 1])["input_ids"].shape == (2, 64)


def test_images_split_and_shape():
    data = prepare_data(
        DataSpec(train="sklearn:digits", eval_fraction=0.25), "image-classification", None, seed=3
    )
    assert len(data.train) + len(data.eval) == 1797 and abs(len(data.eval) - 449) <= 1
    assert data.sample_shape == (1, 8, 8) and len(data.labels) == 10


def test_split_is_seeded():
    a = prepare_data(DataSpec(train="sklearn:digits"), "image-classification", None, seed=1)
    b = prepare_data(DataSpec(train="sklearn:digits"), "image-classification", None, seed=1)
    assert (a.eval.labels == b.eval.labels).all()


@pytest.mark.parametrize(
    "rows, field, message",
    [
        ([{"text": "a", "topic": "x"}], {}, "data.label_field: 'label' not found"),
        ([{"body": "a", "label": "x"}], {}, "data.text_field: 'text' not found"),
        ([{"text": "a", "label": "x"}, {"text": "", "label": "y"}], {}, "record 2: 'text' is missing"),
        (
            [{"text": "a", "label": "x"}, {"text": "b", "label": None}],
            {},
            "record 2: label 'label' is missing",
        ),
    ],
)
def test_missing_fields_are_named(tmp_path, rows, field, message):
    spec = DataSpec(train=_jsonl(tmp_path / "d.jsonl", rows), eval_fraction=0.0, **field)
    with pytest.raises(DataError, match=message):
        prepare_data(spec, "sequence-classification", byte_tokenizer(), seed=0)


def test_eval_label_unseen_in_training(tmp_path):
    spec = DataSpec(
        train=_jsonl(tmp_path / "t.jsonl", [{"text": "a", "label": "x"}]),
        eval=_jsonl(tmp_path / "e.jsonl", [{"text": "b", "label": "z"}]),
    )
    with pytest.raises(DataError, match="label 'z' is not among the training labels"):
        prepare_data(spec, "sequence-classification", byte_tokenizer(), seed=0)


def test_wrong_kind_of_data_for_the_task(tmp_path):
    (tmp_path / "c.txt").write_text("some text")
    with pytest.raises(DataError, match="plain text has no labels"):
        prepare_data(DataSpec(train=str(tmp_path / "c.txt")), "sequence-classification", byte_tokenizer(), 0)
    with pytest.raises(DataError, match="needs images"):
        prepare_data(DataSpec(train=str(tmp_path / "c.txt")), "image-classification", None, 0)
    with pytest.raises(DataError, match="fewer than one block"):
        prepare_data(
            DataSpec(train=str(tmp_path / "c.txt"), max_length=512), "causal-lm", byte_tokenizer(), 0
        )
    with pytest.raises(DataError, match="brings no tokenizer"):
        prepare_data(DataSpec(train=str(tmp_path / "c.txt")), "causal-lm", None, 0)


def test_batch_order_is_a_pure_function_of_position():
    order = BatchOrder(10, 3, seed=5)
    assert order.steps_per_epoch == 3
    first = [order.batch(p) for p in range(7)]
    again = BatchOrder(10, 3, seed=5)
    assert [again.batch(p) for p in (6, 2, 0)] == [first[6], first[2], first[0]]  # any order, same batches
    epoch0 = sorted(i for b in first[:3] for i in b)
    assert len(set(epoch0)) == 9  # no repeats inside an epoch
    assert first[3] != first[0]  # a new shuffle each epoch
    assert BatchOrder(2, 8, seed=0).batch(0) in ([0, 1], [1, 0])  # a set smaller than a batch is one batch
    assert list(eval_batches(5, 2)) == [[0, 1], [2, 3], [4]]
    assert micro_batches([5, 6, 7, 8, 9], 2) == [[5, 6], [7, 8], [9]]
