"""Turn the spec's data section into in-memory task data sets, tokenized once, ready to batch.

Text classification keeps each example at its own length and pads per batch (to the longest in that
batch, not to max_length): on short sentences that is most of the compute saved. Causal-LM text is
packed into fixed-length blocks, so nothing is padded at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpuforge.data.sources import Images, read_source
from gpuforge.errors import DataError
from gpuforge.spec import DataSpec


class TextClassification:
    def __init__(self, ids: list[list[int]] | list[np.ndarray], labels: np.ndarray, pad_id: int):
        # each example's ids as an int32 array: a batch is then built by copies of memory, where Python
        # lists of ints were converted one int at a time (long documents: most of a step, measured)
        self.ids = [np.asarray(seq, dtype=np.int32) for seq in ids]
        self.lengths = [len(seq) for seq in self.ids]  # evaluation batches examples of similar length
        self.labels, self.pad_id = torch.as_tensor(labels, dtype=torch.long), pad_id

    def __len__(self) -> int:
        return len(self.ids)

    def collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        seqs = [self.ids[i] for i in indices]
        longest = max(len(seq) for seq in seqs)
        input_ids = np.full((len(seqs), longest), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(seqs), longest), dtype=np.int64)
        for row, seq in enumerate(seqs):
            input_ids[row, : len(seq)] = seq
            mask[row, : len(seq)] = 1
        return {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(mask),
            "labels": self.labels[indices],
        }

    def subset(self, indices: np.ndarray) -> TextClassification:
        return TextClassification([self.ids[i] for i in indices], self.labels.numpy()[indices], self.pad_id)


class PackedBlocks:
    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[indices]}

    def subset(self, indices: np.ndarray) -> PackedBlocks:
        return PackedBlocks(self.blocks[torch.as_tensor(indices)])


class ImageClassification:
    def __init__(self, pixels: torch.Tensor, labels: torch.Tensor):
        self.pixels, self.labels = pixels, labels

    def __len__(self) -> int:
        return len(self.pixels)

    def collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.pixels[indices], "labels": self.labels[indices]}

    def subset(self, indices: np.ndarray) -> ImageClassification:
        idx = torch.as_tensor(indices)
        return ImageClassification(self.pixels[idx], self.labels[idx])


TaskData = TextClassification | PackedBlocks | ImageClassification


@dataclass
class PreparedData:
    task: str
    train: TaskData
    eval: TaskData | None
    labels: list[str] | None  # class names, index = class id
    sample_shape: tuple[int, ...] | None = None  # one image's C x H x W


def _column(records: list[dict[str, Any]], field: str, setting: str, where: str, ref: str) -> list[Any]:
    """One field of every record; `setting` (data.text_field / data.label_field) is named in errors."""
    if field not in records[0]:
        columns = ", ".join(map(str, records[0]))
        raise DataError(f"{setting}: '{field}' not found in {ref} (columns: {columns})")
    is_text = setting == "data.text_field"
    values = []
    for number, r in enumerate(records, 1):
        value = r.get(field)
        blank = value is None or (isinstance(value, str) and not value.strip())
        if blank or (is_text and not isinstance(value, str)):
            what = f"'{field}' is missing or not text" if is_text else f"label '{field}' is missing"
            raise DataError(f"{where}: {ref} record {number}: {what}")
        values.append(value)
    return values


def _label_names(train_labels: list[Any], num_labels: int | None) -> list[str]:
    """Class names: sorted distinct strings, or 0..max for integer labels (CSV gives digits as text)."""
    as_text = [str(v).strip() for v in train_labels]
    if all(t.lstrip("-").isdigit() for t in as_text):
        ids = [int(t) for t in as_text]
        if min(ids) < 0:
            raise DataError("data.label_field: integer labels must be >= 0")
        count = max(max(ids) + 1, num_labels or 0)
        return [str(i) for i in range(count)]
    return sorted(set(as_text))


def _encode_labels(raw: list[Any], names: list[str], where: str, ref: str) -> np.ndarray:
    index = {name: i for i, name in enumerate(names)}
    out = np.empty(len(raw), dtype=np.int64)
    for number, value in enumerate(raw):
        key = str(value).strip()
        if key not in index:
            raise DataError(
                f"{where}: {ref} record {number + 1}: label '{key}' is not among the training labels"
            )
        out[number] = index[key]
    return out


def _tokenize_examples(tokenizer, texts: list[str], max_length: int) -> list[list[int]]:
    return tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]


def _pack(tokenizer, texts: list[str], block: int, where: str, ref: str) -> torch.Tensor:
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    stream: list[int] = []
    for start in range(0, len(texts), 1024):
        for ids in tokenizer(texts[start : start + 1024], add_special_tokens=False)["input_ids"]:
            stream.extend(ids)
            if eos is not None:
                stream.append(eos)
    n_blocks = len(stream) // block
    if n_blocks == 0:
        raise DataError(
            f"{where}: {ref}: {len(stream)} tokens, fewer than one block of data.max_length={block}"
        )
    return torch.as_tensor(stream[: n_blocks * block], dtype=torch.long).view(n_blocks, block)


def _split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    n_eval = int(round(n * fraction)) if fraction > 0 else 0
    n_eval = min(max(n_eval, 1 if fraction > 0 and n >= 2 else 0), n - 1)
    return np.sort(order[n_eval:]), np.sort(order[:n_eval])


def _build(
    task: str,
    spec: DataSpec,
    ref: str,
    where: str,
    tokenizer,
    labels: list[str] | None,
    num_labels: int | None,
):
    """One source -> (task data, label names)."""
    source = read_source(ref, where, spec.max_records)
    if task == "image-classification":
        if not isinstance(source, Images):
            raise DataError(f"{where}: {ref}: image-classification needs images (.npz or sklearn:digits)")
        names = labels or [str(i) for i in range(max(int(source.labels.max()) + 1, num_labels or 0))]
        if source.labels.min() < 0 or source.labels.max() >= len(names):
            raise DataError(f"{where}: {ref}: labels outside 0..{len(names) - 1}")
        return ImageClassification(torch.from_numpy(source.pixels), torch.from_numpy(source.labels)), names
    if isinstance(source, Images):
        raise DataError(f"{where}: {ref}: holds images, but model.task is {task}")
    if task == "causal-lm":
        texts = (
            [source]
            if isinstance(source, str)
            else _column(source, spec.text_field, "data.text_field", where, ref)
        )
        return PackedBlocks(_pack(tokenizer, texts, spec.max_length, where, ref)), None
    if isinstance(source, str):
        raise DataError(f"{where}: {ref}: plain text has no labels; {task} needs jsonl/csv/parquet records")
    texts = _column(source, spec.text_field, "data.text_field", where, ref)
    raw = _column(source, spec.label_field, "data.label_field", where, ref)
    names = labels or _label_names(raw, num_labels)
    data = TextClassification(
        _tokenize_examples(tokenizer, texts, spec.max_length),
        _encode_labels(raw, names, where, ref),
        tokenizer.pad_token_id or 0,
    )
    return data, names


def prepare_data(
    spec: DataSpec, task: str, tokenizer, seed: int, num_labels: int | None = None
) -> PreparedData:
    """Read, tokenize and split the job's data. Every problem is a DataError naming the field and file."""
    if task != "image-classification" and tokenizer is None:
        raise DataError(
            "data.tokenizer: this model brings no tokenizer; set data.tokenizer "
            "(bytes, hf:<dir> or bundled:minilm)"
        )
    train, labels = _build(task, spec, spec.train, "data.train", tokenizer, None, num_labels)
    if labels is not None and num_labels is not None and len(labels) > num_labels:
        raise DataError(f"model.num_labels: {num_labels}, but the training data has {len(labels)} labels")
    if labels is not None and num_labels is not None:  # more classes than the data shows: keep their slots
        labels = labels + [f"unseen_{i}" for i in range(len(labels), num_labels)]
    if spec.eval is not None:
        evaluation, _ = _build(task, spec, spec.eval, "data.eval", tokenizer, labels, num_labels)
    else:
        train_idx, eval_idx = _split(len(train), spec.eval_fraction, seed)
        train, evaluation = train.subset(train_idx), (train.subset(eval_idx) if len(eval_idx) else None)
    if len(train) == 0:
        raise DataError(f"data.train: {spec.train}: no training examples left")
    shape = tuple(train.pixels.shape[1:]) if isinstance(train, ImageClassification) else None
    return PreparedData(task, train, evaluation, labels, shape)
