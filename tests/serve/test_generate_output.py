"""Generation's output processing alone, without a model, on the byte tokenizer (one byte a token):
the text each token adds, stop strings and EOS, multi-byte characters, the counts of the last event,
sampling, and the caller's async iterator."""

import asyncio

import pytest
import torch

from gpuforge.models.tokenizers import byte_tokenizer
from gpuforge.serve.generation.output import (
    DETOKENIZE_CONTEXT,
    Generation,
    OutputProcessor,
    eos_ids,
    held,
    sample,
    sampler_for,
    top_p_sample,
)
from gpuforge.serve.generation.request import GenerationEvent, SamplingParams, SequenceState

TOK = byte_tokenizer()
EOS = TOK.eos_token_id


def _ids(text: str) -> list[int]:
    return TOK(text)["input_ids"]


def _seq(prompt: str, cap: int = 32, stream: bool = True, **params) -> SequenceState:
    ids = _ids(prompt)
    sampling = SamplingParams(max_tokens=cap, **{"temperature": 0, **params})
    return SequenceState(
        ids,
        len(ids),
        sampling,
        cap,
        asyncio.get_running_loop(),
        asyncio.Queue(),
        sampler_for(sampling),
        prefix_offset=max(0, len(ids) - DETOKENIZE_CONTEXT),
        read_offset=len(ids),
        stream=stream,
    )


def _drain(seq: SequenceState) -> list[GenerationEvent]:
    events = []
    while not seq.queue.empty():
        events.append(seq.queue.get_nowait())
    return events


def _feed(prompt: str, tokens: list[int], stream: bool = True, **params):
    """Tokens into a fresh sequence, as the model thread gives them: the events sent, the sequences
    finished (on_finish), whether each token ended it, the sequence and the processor."""

    async def main():
        finished = []
        output = OutputProcessor(TOK, {EOS}, finished.append)
        seq = _seq(prompt, stream=stream, **params)
        ends = []
        for token in tokens:  # the model thread gives an ended sequence no more tokens
            ends.append(output.advance(seq, token))
            if ends[-1]:
                break
        await asyncio.sleep(0)  # call_soon_threadsafe: the events land on the next turn of the loop
        return _drain(seq), finished, ends, seq, output

    return asyncio.run(main())


def test_each_token_streams_its_text_and_the_last_event_carries_the_counts():
    events, finished, ends, seq, output = _feed("say: ", _ids(" hello"), cap=6)
    assert [e.text for e in events] == [" ", "h", "e", "l", "l", "o"]
    assert all(e.finish_reason is None for e in events[:-1])
    last = events[-1]
    assert (last.finish_reason, last.prompt_tokens, last.completion_tokens) == ("length", 5, 6)
    assert list(last.token_ids) == _ids(" hello")
    assert ends == [False] * 5 + [True] and finished == [seq] and output.tokens == 6


def test_eos_ends_with_stop_counts_the_eos_token_and_leaves_it_out_of_the_text():
    events, finished, ends, seq, _ = _feed("x", [*_ids("ab"), EOS, *_ids("cd")])
    assert "".join(e.text for e in events) == "ab" and events[-1].finish_reason == "stop"
    assert list(events[-1].token_ids) == [*_ids("ab"), EOS] and events[-1].completion_tokens == 3
    assert seq.ids == _ids("xab") and ends == [False, False, True] and finished == [seq]

    events, _, ends, _, _ = _feed("x", [*_ids("a"), EOS, *_ids("b")], cap=3, ignore_eos=True)
    assert ends == [False, False, True] and events[-1].finish_reason == "length"


def test_a_stop_string_is_held_back_while_it_may_begin_and_the_answer_ends_before_it():
    events, _, ends, _, _ = _feed("q", _ids("ab\nuser: more"), stop=["\nuser:"])
    streamed = [e.text for e in events]
    assert "".join(streamed) == "ab" and events[-1].finish_reason == "stop"
    assert not any("\n" in t for t in streamed)  # "\n", "\nu", ... were never sent
    assert ends == [False] * 7 + [True]  # ends at the ":" (the 8th token); " more" never comes

    events, _, _, _, _ = _feed("q", _ids("a\nux!"), cap=5, stop=["\nuser:"])
    assert [e.text for e in events] == ["a", "\nux", "!"]  # "\n" and "\nu" waited for the next byte
    assert events[-1].finish_reason == "length"


def test_an_answer_not_streamed_is_decoded_once_as_it_ends_and_sent_as_one_event():
    async def main():
        output = OutputProcessor(TOK, {EOS}, lambda seq: None)
        seq = _seq("say: ", cap=6, stream=False)
        texts = []
        for token in _ids(" hello"):
            output.advance(seq, token)
            texts.append(seq.text)
        await asyncio.sleep(0)
        return texts, _drain(seq)

    texts, events = asyncio.run(main())
    assert texts == [""] * 5 + [" hello"]  # no text while it runs: nobody reads it
    assert [(e.text, e.finish_reason, e.completion_tokens) for e in events] == [(" hello", "length", 6)]

    events, _, ends, _, _ = _feed("x", [*_ids("ab"), EOS], stream=False)
    assert [(e.text, e.finish_reason) for e in events] == [("ab", "stop")] and ends == [False, False, True]
    events, _, _, _, _ = _feed("x", _ids("€")[:2], cap=2, stream=False)  # it ends inside a character
    assert [e.text for e in events] == [""]


def test_an_answer_not_streamed_still_ends_before_a_stop_string_at_the_same_token():
    for stops in (["\nuser:"], ["zz", "b\nu"], ["ab\nuser: more"]):
        streamed, _, ends, _, _ = _feed("q", _ids("ab\nuser: more"), stop=stops)
        whole, _, whole_ends, _, _ = _feed("q", _ids("ab\nuser: more"), stream=False, stop=stops)
        assert len(whole) == 1 and whole[0].text == "".join(e.text for e in streamed), stops
        assert whole[0].finish_reason == streamed[-1].finish_reason == "stop" and whole_ends == ends


def test_held_counts_the_end_that_may_begin_a_stop_string():
    assert held("answer: foo\nus", ["\nuser:"]) == 3 and held("abc", ["x", "cd"]) == 1
    assert held("abc", ["zz"]) == 0 and held("", ["ab"]) == 0


def test_a_multibyte_character_is_sent_whole_and_never_as_a_replacement_character():
    euro = _ids("€")  # three byte tokens
    events, _, _, _, _ = _feed("x", [*euro, *_ids("y")])
    assert [e.text for e in events] == ["€", "y"]

    events, _, ends, _, _ = _feed("x", euro[:2], cap=2)  # the answer ends inside the character
    assert ends == [False, True] and [e.text for e in events] == [""]
    assert events[-1].finish_reason == "length" and list(events[-1].token_ids) == euro[:2]


def test_a_cancelled_sequence_ends_at_its_next_token_without_a_last_event():
    async def main():
        finished = []
        output = OutputProcessor(TOK, {EOS}, finished.append)
        seq = _seq("x")
        seq.cancelled = True
        ended = output.advance(seq, _ids("a")[0])
        await asyncio.sleep(0)
        return ended, finished, _drain(seq)

    ended, finished, events = asyncio.run(main())
    assert ended and finished == [] and all(e.finish_reason is None for e in events)


def test_greedy_takes_the_argmax_and_a_seed_repeats_a_sampled_answer():
    logits = torch.randn(4, 257, generator=torch.Generator().manual_seed(0))

    async def main():
        greedy = _seq("a")
        seeded = [_seq("a", temperature=1.0, seed=7) for _ in range(2)]
        nucleus = _seq("a", temperature=1.0, top_p=1e-6, seed=1)  # only the likeliest token stays
        return [sample(logits, [greedy, s, nucleus, _seq("b")]) for s in seeded]

    first, second = asyncio.run(main())
    best = logits.argmax(-1).tolist()
    assert first[0] == best[0] and first[2] == best[2] and first[3] == best[3]
    assert first[1] == second[1]  # the same seed, the same token


def test_sampling_follows_the_temperature_softened_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    params = SamplingParams(temperature=0.5, seed=3)
    generator = sampler_for(params)
    counts = torch.bincount(torch.tensor([top_p_sample(logits, params, generator) for _ in range(4000)]))
    expected = torch.softmax(logits / 0.5, -1)
    assert torch.allclose(counts.float() / 4000, expected, atol=0.03), counts


def test_the_async_iterator_ends_at_the_last_event_and_cancel_runs_once():
    async def main():
        cancelled = []
        seq = _seq("x")
        generation = Generation(seq, cancelled.append)
        for event in (GenerationEvent("a"), GenerationEvent("b", "stop", 1, 2, (5, 6))):
            seq.queue.put_nowait(event)
        whole = await generation.collect()
        generation.cancel()  # finished: nothing to cancel

        failing = _seq("y")
        failed = Generation(failing, cancelled.append)
        failing.queue.put_nowait(RuntimeError("the step failed"))
        with pytest.raises(RuntimeError, match="the step failed"):
            await anext(failed)
        open_ = Generation(_seq("z"), cancelled.append)
        open_.cancel()
        open_.cancel()
        return whole, cancelled, open_

    whole, cancelled, open_ = asyncio.run(main())
    assert whole == GenerationEvent("ab", "stop", 1, 2, (5, 6))
    assert cancelled == [open_._seq] and open_.prompt_tokens == 1


def test_eos_ids_come_from_the_tokenizer_and_the_models_generation_config():
    class Module(torch.nn.Module):
        class generation_config:  # noqa: N801 (as transformers names it)
            eos_token_id = [3, 4]

    assert eos_ids(TOK, Module()) == {EOS, 3, 4} and eos_ids(TOK, torch.nn.Linear(1, 1)) == {EOS}
