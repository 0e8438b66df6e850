"""`model.options`: the keys each source documents, with their types; nothing else reaches a builder.

transformers' from_pretrained takes keyword arguments that read other files (`_configuration_file`,
`subfolder`, `cache_dir`, `gguf_file`) or import a model directory's own Python (`trust_remote_code`,
`code_revision`), so an open dict there hands a job's author the server. Sources list what they take
(`OPTIONS` in each source's module); `python:` models take anything, since they are user code already and
need an admin key. `trust_remote_code` is listed for transformers sources, and is refused unless the
policy allows user code (gpuforge/policy.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, TypeAdapter, ValidationError

from gpuforge.errors import SpecError

Rate = Annotated[float, Field(ge=0, lt=1)]  # a dropout probability
Size = Annotated[int, Field(ge=1, le=65536)]

TRANSFORMERS: dict[str, Any] = {
    "hidden_dropout_prob": Rate,
    "attention_probs_dropout_prob": Rate,
    "classifier_dropout": Rate,
    "attention_dropout": Rate,
    "dropout": Rate,
    "resid_pdrop": Rate,
    "embd_pdrop": Rate,
    "attn_pdrop": Rate,
    "attn_implementation": Literal["eager", "sdpa"],
    # sizes: a config's own, for a model trained from scratch (pretrained: false)
    "num_hidden_layers": Size,
    "hidden_size": Size,
    "num_attention_heads": Size,
    "num_key_value_heads": Size,
    "intermediate_size": Size,
    "max_position_embeddings": Size,
    "trust_remote_code": StrictBool,  # only where user code is allowed (admin keys)
}
USER_CODE_OPTIONS = ("trust_remote_code",)

_adapters: dict[int, TypeAdapter] = {}


def _adapter(kind: Any) -> TypeAdapter:
    key = id(kind)
    if key not in _adapters:
        _adapters[key] = TypeAdapter(kind)
    return _adapters[key]


def check_options(
    source: str, options: dict[str, Any], allowed: dict[str, Any] | None, user_code: bool
) -> dict[str, Any]:
    """`options` validated against `allowed` (None: anything goes), as the builder should take them; a
    SpecError naming each key that is unknown, of the wrong type, or needs user code."""
    if allowed is None:
        return dict(options)
    problems, checked = [], {}
    for key, value in options.items():
        if key not in allowed:
            known = ", ".join(sorted(allowed)) or "none"
            problems.append(f"model.options.{key}: unknown for {source} (it takes: {known})")
            continue
        if key in USER_CODE_OPTIONS and value and not user_code:
            problems.append(
                f"model.options.{key}: runs the model directory's own Python as the server's user; only an "
                "admin key may ask for it"
            )
            continue
        try:
            checked[key] = _adapter(allowed[key]).validate_python(value)
        except ValidationError as err:
            reason = err.errors()[0]["msg"].replace("Input should be", "must be")
            problems.append(f"model.options.{key}: {reason}")
    if problems:
        raise SpecError("; ".join(problems))
    return checked
