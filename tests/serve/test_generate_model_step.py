"""The model step alone, on a random tiny GPT-2 and without a tokenizer: prompts of different lengths
prefilled together, a second group merged into a batch that is decoding, and sequences leaving, each step's
logits equal to the whole sequence run alone."""

import pytest
import torch

from gpuforge.serve.generation.model_step import ModelStep, context_length
from gpuforge.serve.generation.request import SamplingParams, SequenceState


@pytest.fixture(scope="module")
def module():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=64, initializer_range=0.2)
    return GPT2LMHeadModel(config).eval()


def _seq(ids: list[int]) -> SequenceState:
    # the model step reads the token ids alone: no event loop, queue or generator
    return SequenceState(list(ids), len(ids), SamplingParams(temperature=0), 32, None, None, None)


def _alone(module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return module(torch.tensor([ids])).logits[0, -1]


def _take_greedy(seqs, logits) -> list[int]:
    """What output processing does with the logits: a token a sequence, appended to its ids."""
    tokens = logits.argmax(-1).tolist()
    for seq, token in zip(seqs, tokens, strict=True):
        seq.ids.append(token)
    return tokens


def _assert_alone(module, seqs, logits):
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(logits[i], _alone(module, seq.ids), atol=1e-4, rtol=1e-4)


def test_prefill_merge_decode_and_leave_give_each_sequence_its_own_logits(module):
    step = ModelStep(module, torch.device("cpu"), pad_id=0)
    short, long, ends_at_once = _seq([5, 6, 7]), _seq([1, 2, 3, 4, 5, 6]), _seq([9, 9])
    with torch.inference_mode():
        first = step.prefill([short, long, ends_at_once])
        _assert_alone(module, [short, long, ends_at_once], first.logits)
        _take_greedy([short, long, ends_at_once], first.logits)
        step.join(first, [short, long, ends_at_once], [True, True, False])  # the third ended on its 1st
        assert step.running == [short, long]

        for _ in range(2):
            logits = step.decode()
            _assert_alone(module, step.running, logits)
            step.feed(_take_greedy(step.running, logits))

        newcomer = _seq(list(range(10, 21)))  # longer than the batch so far: both sides are padded
        joined = step.prefill([newcomer])
        _assert_alone(module, [newcomer], joined.logits)
        _take_greedy([newcomer], joined.logits)
        step.join(joined, [newcomer], [True])
        assert step.running == [short, long, newcomer]

        logits = step.decode()
        _assert_alone(module, step.running, logits)
        step.feed(_take_greedy(step.running, logits))
        step.leave([False, False, True])  # the longest leaves: the padding only it needed goes too
        assert step.running == [short, long]
        assert step.mask.shape[1] == max(len(s.ids) for s in step.running) - 1  # the last is `next`

        logits = step.decode()
        _assert_alone(module, step.running, logits)
        step.leave([True, True])
    assert step.running == [] and step.cache is None and step.mask is None


def test_the_context_comes_from_whichever_field_the_config_names():
    class Config:
        n_positions = None
        max_position_embeddings = 2048

    assert context_length(Config()) == 2048
    with pytest.raises(ValueError, match="names no context length; pass max_context"):
        context_length(object())
