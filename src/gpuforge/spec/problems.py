"""What a spec's validation errors say: each problem by its dotted path, in plain words, with a "did you
mean" for an unknown key, and blamed on the `--set` that made it."""

from __future__ import annotations

import difflib
import re
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from gpuforge.spec.jobs import JobSpec

# pydantic names the branch of a union in an error's location (`int`, `literal['auto']`): not a field
_UNION_TAG = re.compile(r"int|str|bool|float|literal\[.*\]|function-\w+\[.*\]")
# what a value of the wrong type should have been, by pydantic's error type
_EXPECTED = {
    "int_parsing": "an integer",
    "int_type": "an integer",
    "int_from_float": "a whole number",
    "float_parsing": "a number",
    "float_type": "a number",
    "bool_parsing": "true or false",
    "bool_type": "true or false",
    "string_type": "a string",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "list_type": "a list",
}
# names other tools use for a field, by the name it has here (suggested when the section has that field)
ALIASES = {
    "learning_rate": "lr",
    "learningrate": "lr",
    "epoch": "epochs",
    "num_epochs": "epochs",
    "num_train_epochs": "epochs",
    "n_epochs": "epochs",
    "batch": "batch_size",
    "bs": "batch_size",
    "per_device_train_batch_size": "batch_size",
    "micro_batch_size": "batch_size",
    "steps": "max_steps",
    "num_steps": "max_steps",
    "total_steps": "max_steps",
    "train_steps": "max_steps",
    "max_grad_norm": "grad_clip",
    "gradient_clipping": "grad_clip",
    "clip_grad_norm": "grad_clip",
    "dtype": "precision",
    "mixed_precision": "precision",
    "warmup": "warmup_steps",
    "eval_steps": "eval_every",
    "save_steps": "checkpoint_every",
    "logging_steps": "log_every",
    "save_total_limit": "keep_checkpoints",
    "rank": "r",
    "lora_r": "r",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "text_column": "text_field",
    "label_column": "label_field",
    "max_seq_length": "max_length",
    "max_seq_len": "max_length",
    "seq_len": "max_length",
    "train_file": "train",
    "eval_file": "eval",
    "validation": "eval",
    "gpus": "devices",
    "num_gpus": "devices",
    "device": "device_type",
}


def section_at(path: tuple) -> type[BaseModel] | None:
    """The section model at a dotted path of JobSpec (`("adapt", "lora")` -> LoraSpec), if there is one."""
    section: type[BaseModel] = JobSpec
    for part in path:
        field = section.model_fields.get(str(part))
        if field is None:
            return None
        kinds = [t for t in (field.annotation, *get_args(field.annotation)) if isinstance(t, type)]
        section = next((t for t in kinds if issubclass(t, BaseModel)), None)
        if section is None:
            return None
    return section


def suggest_key(path: tuple) -> str | None:
    """The field an unknown key probably meant: a close spelling of a field of its section, or of another
    tool's name for one (learning_rate -> lr)."""
    section = section_at(path[:-1])
    if section is None:
        return None
    fields = list(section.model_fields)
    names = {f: f for f in fields} | {a: f for a, f in ALIASES.items() if f in fields}
    close = difflib.get_close_matches(str(path[-1]).lower(), list(names), n=1, cutoff=0.7)
    return ".".join([*(str(p) for p in path[:-1]), names[close[0]]]) if close else None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


MAX_PROBLEMS = 10  # told one by one (with their suggestions); past them, a count: a request buys no more work


def problem_paths(err: ValidationError) -> dict[str, list[dict]]:
    """The errors by dotted path (union branches' tags left out), in the order pydantic found them."""
    by_path: dict[str, list[dict]] = {}
    for e in err.errors(include_url=False):
        loc = tuple(p for p in e["loc"] if not _UNION_TAG.fullmatch(str(p)))
        by_path.setdefault(".".join(str(p) for p in loc), []).append({**e, "loc": loc})
    return by_path


def validation_problems(
    err: ValidationError, limit: int | None = None, by_path: dict[str, list[dict]] | None = None
) -> list[tuple[str, str]]:
    """(dotted path, what is wrong) a problem, for the first `limit` paths (all by default; `by_path`:
    problem_paths(err), where the caller has it); the branches of a union that all refused a value's type
    are one problem (`must be an integer or 'auto', got 'x'`)."""
    by_path = problem_paths(err) if by_path is None else by_path
    problems = []
    for path, errors in list(by_path.items())[:limit]:
        expected = [
            e["ctx"]["expected"] if e["type"] == "literal_error" else _EXPECTED.get(e["type"]) for e in errors
        ]
        if all(expected):
            problems.append(
                (path, f"must be {' or '.join(dict.fromkeys(expected))}, got {_shown(errors[0]['input'])}")
            )
            continue
        for e in errors:
            msg = e["msg"].removeprefix("Value error, ")
            msg = (
                msg.replace("Extra inputs are not permitted", "unknown key")
                .replace("Input should be greater than or equal to", "must be >=")
                .replace("Input should be greater than", "must be >")
                .replace("Input should be less than or equal to", "must be <=")
                .replace("Input should be less than", "must be <")
                .replace("Input should be", "must be")
            )
            if e["type"] == "extra_forbidden" and (suggestion := suggest_key(e["loc"])):
                msg += f" (did you mean {suggestion}?)"
            problems.append((path, msg))
    return list(dict.fromkeys(problems))


def _blamed(path: str, msg: str, set_by: dict[str, str]) -> str | None:
    """The `--set` assignment that made this problem: it set the value at `path` or one above it, or, for
    an unknown key, one below it (`--set trian.lr=1` makes the unknown section `trian`)."""
    for key, assignment in set_by.items():
        if (
            path == key
            or path.startswith(key + ".")
            or (msg.startswith("unknown key") and key.startswith(path + "."))
        ):
            return assignment
    return None


def format_validation_error(
    err: ValidationError, overrides: list[str] = (), origin: str | None = None
) -> str:
    """The problems, `; `-separated, each naming its dotted path: `train.lr: must be > 0`. The file's
    problems come first, after `origin` (the spec file) where given; then those of values a `--set` made,
    each naming it: `--set train.lr=abc: must be a number, got 'abc'`."""
    set_by = {a.partition("=")[0].strip(): a for a in overrides}
    in_file, in_overrides = [], []
    by_path = problem_paths(err)
    more = len(by_path) - MAX_PROBLEMS
    for path, msg in validation_problems(err, MAX_PROBLEMS, by_path):
        assignment = _blamed(path, msg, set_by) if path else None
        if assignment is not None:
            in_overrides.append(f"--set {assignment}: {msg}")
        else:
            in_file.append(f"{path}: {msg}" if path else msg)
    if in_file and origin:
        in_file[0] = f"{origin}: {in_file[0]}"
    told = "; ".join(in_file + in_overrides)
    return told if more <= 0 else f"{told}; ... and {more:,} more"
