"""`hf:<local dir>`: a transformers model saved on disk. Never downloads: a missing dir is an error."""

from __future__ import annotations

from pathlib import Path

from gpuforge.errors import ModelError
from gpuforge.models.base import BuiltModel, ModelRequest
from gpuforge.models.options import TRANSFORMERS
from gpuforge.models.tokenizers import hf_tokenizer
from gpuforge.policy import current
from gpuforge.quiet import verbose

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _model_dir(source: str) -> Path:
    path = Path(source.partition(":")[2])
    current().check_path("model.source", path)  # a server's job or replica: inside its roots, every file
    if not path.is_dir():
        raise ModelError(f"model.source: {path}: no such directory (gpuforge never downloads models)")
    if not (path / "config.json").exists():
        raise ModelError(f"model.source: {path}: no config.json, not a saved transformers model")
    return path


def options(source: str) -> dict:
    return TRANSFORMERS


def tokenizer(source: str):
    return hf_tokenizer(_model_dir(source), "model.source")


def build(request: ModelRequest) -> BuiltModel:
    path = _model_dir(request.source)  # checked once: it walks the directory under a server's roots
    return load_transformers_model(path, request, f"hf:{path}")


def load_transformers_model(path: Path, request: ModelRequest, name: str) -> BuiltModel:
    """Load (or, with pretrained: false, freshly initialise) a transformers model for the task."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    if not verbose():  # --verbose shows what transformers says
        transformers.logging.set_verbosity_error()  # "newly initialized head": expected, we say it ourselves
        transformers.utils.logging.disable_progress_bar()  # no shard bars inside our own progress display
    auto = {
        "sequence-classification": AutoModelForSequenceClassification,
        "causal-lm": AutoModelForCausalLM,
    }.get(request.task)
    if auto is None:
        raise ModelError(f"model.task: {request.task} is not supported by {name} (a transformers text model)")
    # request.options were checked against TRANSFORMERS by build_model; trust_remote_code only ever
    # reaches transformers as a plain bool, False unless the policy allowed user code and the spec asked
    kwargs = dict(request.options)
    kwargs["trust_remote_code"] = kwargs.get("trust_remote_code") is True
    if request.task == "sequence-classification":
        kwargs["num_labels"] = request.num_labels
        kwargs["ignore_mismatched_sizes"] = True  # a saved head of another label count is replaced, not fatal
        if request.labels:
            kwargs["id2label"] = dict(enumerate(request.labels))
            kwargs["label2id"] = {label: i for i, label in enumerate(request.labels)}
    has_weights = any((path / f).exists() for f in WEIGHT_FILES)
    pretrained = request.pretrained is not False  # a dir without weights must be asked to start from scratch
    if pretrained and not has_weights:
        raise ModelError(
            f"model.source: {path}: holds no weights; set model.pretrained: false to train from scratch"
        )
    try:
        if pretrained:
            module = auto.from_pretrained(str(path), local_files_only=True, **kwargs)
        else:
            kwargs.pop("ignore_mismatched_sizes", None)
            config = AutoConfig.from_pretrained(str(path), local_files_only=True, **kwargs)
            module = auto.from_config(config, trust_remote_code=kwargs["trust_remote_code"])
    except (OSError, ValueError, TypeError, RuntimeError) as err:
        raise ModelError(
            f"model.source: {name}: cannot load for {request.task}: {str(err).splitlines()[0]}"
        ) from None
    how = "pretrained weights" if pretrained else "random init"
    note = ", new classification head" if pretrained and request.task == "sequence-classification" else ""
    return BuiltModel(
        module, True, f"{name} ({type(module).__name__}, {how}{note})", {"pretrained": pretrained}
    )
