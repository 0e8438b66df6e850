"""The serving options are defined once (serve/options.py): `gpuforge serve`'s flags, the deploy API's body
and a replica's command line all agree with ServeOptions."""

import re

import pytest
import typer
from pydantic import ValidationError

from gpuforge.cli import app
from gpuforge.serve.options import ServeOptions, flag, lower_bound, refusal, serve_flags
from gpuforge.server.schemas import DeploymentCreate

CLI_ONLY = {"model_dir", "host", "port", "api_key_file", "adapter"}  # where and how to listen, whose key


def _serve_command():
    return typer.main.get_command(app).commands["serve"]


def test_every_option_is_a_flag_of_gpuforge_serve_with_its_default_help_and_bound():
    params = {p.name: p for p in _serve_command().params}
    assert set(params) - CLI_ONLY == set(ServeOptions.model_fields)
    for name, field in ServeOptions.model_fields.items():
        param = params[name]
        assert param.opts == [flag(name)]
        assert (param.default, param.help) == (field.default, field.description), name
        value_type = param.type_descriptor.annotation  # typer's, without `| None`
        assert field.annotation in (value_type, value_type | None), name
        assert (param.min, param.max) == (lower_bound(name), None), name


def test_a_deployment_s_options_come_back_whole_from_the_replica_s_command_line(tmp_path):
    options = {"max_batch": 8, "max_wait_ms": 2.5, "max_queue": 64, "timeout_s": 0.5, "quantize": "int8",
               "precision": "fp32", "max_length": 128}  # fmt: skip
    body = DeploymentCreate(job_id=1, name="x", options=options)
    flags = serve_flags(body.options.model_dump(exclude_none=True))
    parsed = _serve_command().make_context("serve", [str(tmp_path), *flags]).params
    assert {name: parsed[name] for name in options} == options
    assert serve_flags({"max_batch": 8, "quantize": None}) == ["--max-batch", "8"]


def test_the_deploy_body_takes_the_deployable_options_each_optional_and_bounded():
    fields = DeploymentCreate.model_fields["options"].annotation.model_fields
    assert list(fields) == ["max_batch", "max_wait_ms", "max_queue", "timeout_s", "quantize", "precision",
                            "max_length"]  # fmt: skip
    assert all(f.default is None for f in fields.values())
    refused = {
        "max_batch": (1025, "less than or equal to 1024"),
        "timeout_s": (0.05, "greater than or equal to 0.1"),  # as `gpuforge serve` would refuse it
        "max_length": (0, "greater than or equal to 1"),
        "quantize": ("int3", "String should match pattern '^(int8|int4|int8-dynamic)$'"),
        "device": ("cpu", "Extra inputs are not permitted"),  # the scheduler picks it
    }
    for name, (value, message) in refused.items():
        with pytest.raises(ValidationError, match=re.escape(message)):
            DeploymentCreate(job_id=1, name="x", options={name: value})
    assert ServeOptions(max_batch=5000).max_batch == 5000  # the API's ceiling is not the worker's


def test_a_value_outside_its_choices_is_refused_in_the_flag_s_words():
    with pytest.raises(ValidationError) as caught:
        ServeOptions(quantize="int3", precision="fp8")
    assert [refusal(e) for e in caught.value.errors()] == [
        "--quantize int3: expected int8, int4 or int8-dynamic",
        "--precision fp8: expected auto, bf16, fp16 or fp32",
    ]


def test_a_bool_option_is_a_bare_flag_when_true_and_left_out_when_false(tmp_path):
    assert serve_flags({"eval_at_load": True, "max_batch": 8}) == ["--max-batch", "8", "--eval-at-load"]
    assert serve_flags({"eval_at_load": False, "adapters_root": "/runs"}) == ["--adapters-root", "/runs"]
    for value in (True, False):
        flags = serve_flags({"eval_at_load": value})
        parsed = _serve_command().make_context("serve", [str(tmp_path), *flags]).params
        assert parsed["eval_at_load"] is value
