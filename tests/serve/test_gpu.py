"""CUDA paths of serving; skipped without CUDA, run by scripts/gpu_check.sh."""

import pytest
import torch

from gpuforge.artifact import Manifest
from gpuforge.runtime.precision import choose_precision
from gpuforge.serve.generate import GenerationEngine, SamplingParams
from gpuforge.serve.predict import Predictor

pytestmark = pytest.mark.gpu


def test_a_classifier_batch_runs_on_cuda_in_bf16():
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "bad", "film"]
    tok = BertTokenizerFast(vocab_file=_vocab(vocab))
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, num_labels=2)  # fmt: skip
    model = BertForSequenceClassification(config)
    device = torch.device("cuda")
    manifest = Manifest(format="transformers", kind="full", task="sequence-classification", source="hf:x",
                        labels=["neg", "pos"], num_labels=2)  # fmt: skip
    predictor = Predictor(
        model.to(device).eval(), tok, manifest, device, choose_precision("auto", device), 16
    )
    outputs = predictor.run_batch([(None, "good film"), (None, "bad film " * 20)])
    assert [set(o["scores"]) for o in outputs] == [{"neg", "pos"}] * 2 and outputs[1]["truncated"]
    # auto on the GPU: bf16 (or fp16) timed against fp32 on this model, the weights cast once
    from gpuforge.serve.batch_precision import plan_precision

    candidate = choose_precision("auto", device)
    plan = plan_precision("auto", candidate, predictor.module, predictor.time_batch, 8)
    assert sorted(plan.measured_ms) == [1, 2, 4, 8] and plan.describe()["rule"]
    predictor.module, predictor.precision, predictor.plan = plan.module, plan.precision, plan
    planned = predictor.run_batch([(None, "good film")] * 8)
    assert len(planned) == 8 and all(o == planned[0] for o in planned)  # one batch, one answer for one input


def test_continuous_batching_on_cuda_matches_one_prompt_at_a_time():
    import asyncio

    from transformers import GPT2Config, GPT2LMHeadModel

    from gpuforge.models.tokenizers import byte_tokenizer

    torch.manual_seed(0)
    tok = byte_tokenizer()
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=len(tok), n_positions=128))
    device = torch.device("cuda")
    engine = GenerationEngine(model.to(device).eval(), tok, device, choose_precision("fp32", device), 4, 16)
    engine.start()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    prompts = ("ab", "hello there", "x")

    async def one(prompt):
        return (await engine.submit(prompt, params).collect()).token_ids

    async def together():
        return await asyncio.gather(*(one(p) for p in prompts))

    try:
        joint = asyncio.run(together())
        alone = [asyncio.run(one(p)) for p in prompts]
    finally:
        engine.stop()
    assert joint == alone


def _vocab(words):
    import tempfile

    path = tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False)
    path.write("\n".join(words) + "\n")
    path.close()
    return path.name
