"""The model step alone, on a random tiny GPT-2 and without a tokenizer: prompts of different lengths
prefilled together, a second group merged into a batch that is decoding, and sequences leaving, each step's
logits equal to the whole sequence run alone; the cache written in place, grown and slid back."""

import random

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
    assert step.running == [] and step.mask is None and step.cache.rows == 0


def _tensors(step) -> list[int]:
    return [t.data_ptr() for t in [*step.cache.keys, *step.cache.values, step.cache.mask]]


def test_joining_stepping_and_leaving_write_the_cache_in_place(module):
    step = ModelStep(module, torch.device("cpu"), pad_id=0)
    first = [_seq([1, 2, 3, 4, 5, 6]), _seq([7, 8])]
    with torch.inference_mode():
        prefilled = step.prefill(first)
        _take_greedy(first, prefilled.logits)
        step.join(prefilled, first, [True, True])
        allocated = _tensors(step)
        step.feed(_take_greedy(step.running, step.decode()))
        newcomers = [_seq([3, 3, 3]), _seq([4])]
        prefilled = step.prefill(newcomers)
        _take_greedy(newcomers, prefilled.logits)
        step.join(prefilled, newcomers, [True, True])  # rows 2 and 3 of the 4 the first prefill made room for
        logits = step.decode()
        _assert_alone(module, step.running, logits)
        step.feed(_take_greedy(step.running, logits))
        step.leave([True, False, False, False])  # the last row moves into the first
        assert step.running == [newcomers[1], first[1], newcomers[0]]
        logits = step.decode()
        _assert_alone(module, step.running, logits)
    assert _tensors(step) == allocated  # the same tensors throughout: nothing concatenated or copied whole


def test_a_long_mix_of_joins_and_leaves_grows_and_slides_the_cache_and_stays_exact(module):
    """Random prompts join in groups (some longer than the batch so far, some ending at once) and leave
    at random, past the first tensors' rows and columns: every step's logits are each sequence's own."""
    rng = random.Random(0)
    step = ModelStep(module, torch.device("cpu"), pad_id=0)
    shapes = set()
    with torch.inference_mode():
        for _ in range(300):
            if rng.random() < 0.3 or not step.running:
                group = [_seq([rng.randrange(1, 50) for _ in range(rng.randint(1, 20))]) for _ in range(3)]
                prefilled = step.prefill(group)
                _assert_alone(module, group, prefilled.logits)
                _take_greedy(group, prefilled.logits)
                step.join(prefilled, group, [rng.random() < 0.9 for _ in group])
            if step.running:
                logits = step.decode()
                _assert_alone(module, step.running, logits)
                step.feed(_take_greedy(step.running, logits))
                step.leave([len(s.ids) >= 60 or rng.random() < 0.08 for s in step.running])
            shapes.add(tuple(step.cache.mask.shape))
    assert len(shapes) > 1  # the tensors grew on the way


def test_the_context_comes_from_whichever_field_the_config_names():
    class Config:
        n_positions = None
        max_position_embeddings = 2048

    assert context_length(Config()) == 2048
    with pytest.raises(ValueError, match="names no context length; pass max_context"):
        context_length(object())
