"""Generation for causal LMs: the continuous-batching engine against a plain greedy loop, stops, limits,
cancelling, backpressure, and the OpenAI-style routes on a real (tiny) trained run."""

import asyncio
import contextlib
import json
import time

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient

from gpuforge.models.tokenizers import byte_tokenizer
from gpuforge.serve.batcher import QueueFull
from gpuforge.serve.generate import (
    GenerationEngine,
    PromptTooLong,
    SamplingParams,
    _held,
    cpu_threads,
    load_engine,
)
from gpuforge.serve.openai_api import chat_prompt, create_openai_router
from gpuforge.spec import load_spec
from gpuforge.train.engine import train
from tests.helpers.specs import write_spec

GREEDY = {"temperature": 0}


@pytest.fixture(autouse=True)
def _one_thread():
    """Models this small gain nothing from a second thread, and OpenMP's spinning threads stall for
    tens of milliseconds a step when the CPUs are busy with something else (conftest restores it)."""
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def lively():
    """A random GPT-2 (2 x 64) whose greedy output varies from token to token (a freshly initialized one
    only repeats its input), kept to ASCII and without EOS: a strict test of the KV-cache bookkeeping."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    tok = byte_tokenizer()
    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=len(tok),
        n_positions=256,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )
    module = GPT2LMHeadModel(config).eval()
    other = torch.ones(len(tok), dtype=torch.bool)
    other[[tok(chr(b))["input_ids"][0] for b in range(128)]] = False
    with torch.no_grad():
        module.lm_head.weight[other] = 0  # non-ASCII bytes and EOS score 0; the best ASCII byte scores more
    return module, tok


def _greedy_alone(module, tok, prompt: str, n: int) -> list[int]:
    """Greedy tokens for one prompt, the slow obvious way: the whole sequence again at every step."""
    ids = tok(prompt)["input_ids"]
    out = []
    with torch.no_grad():
        for _ in range(n):
            token = int(module(torch.tensor([ids + out])).logits[0, -1].argmax())
            out.append(token)
            if token == tok.eos_token_id:
                break
    return out


def _engine(model, **options) -> GenerationEngine:
    module, tok = model
    engine = GenerationEngine(module, tok, "cpu", **options)
    engine.start()
    return engine


async def _finish(generation):
    text, final = "", None
    async for event in generation:
        text += event.text
        final = event
    return text, final


async def _all_events(generation):
    return [event async for event in generation]


async def _until(condition, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.002)


def test_greedy_in_a_running_batch_equals_each_prompt_alone(lively):
    module, tok = lively
    cases = [
        ("def add(a, b):", 30),
        ("x", 25),
        ("The quick brown fox jumps over the lazy dog", 20),
        ("hello", 28),
        ("import torch\nimport numpy as np\n", 18),
        ("abc" * 12, 24),
    ]

    async def main():
        engine = _engine(lively, max_batch=3)
        runs = []
        for i, (prompt, n) in enumerate(cases):
            if i >= 2:  # the first two start together; each later one joins a batch that is decoding
                steps = engine.steps
                await _until(lambda s=steps: engine.steps >= s + 3 or engine.active == 0)
            params = SamplingParams(max_tokens=n, **GREEDY)
            generation = engine.submit(prompt, params, stream=i % 2 == 0)  # every other one whole at the end
            runs.append(asyncio.ensure_future(_all_events(generation)))
        results = await asyncio.gather(*runs)
        await asyncio.to_thread(engine.stop)
        return engine, results

    engine, results = asyncio.run(main())
    for i, ((prompt, n), events) in enumerate(zip(cases, results, strict=True)):
        expected, final = _greedy_alone(module, tok, prompt, n), events[-1]
        assert list(final.token_ids) == expected, prompt
        assert "".join(e.text for e in events) == tok.decode(expected) and final.finish_reason == "length"
        assert (final.prompt_tokens, final.completion_tokens) == (len(tok(prompt)["input_ids"]), n)
        assert len(events) == (n if i % 2 == 0 else 1)  # streamed: a token a delta (ASCII); else one event
    assert engine.steps < sum(n for _, n in cases) - 40  # decode steps were shared
    assert engine.active == 0 and engine.queued == 0


def test_stop_strings_end_the_answer_before_them_and_eos_ends_it_too(lively):
    module, tok = lively
    prompt = "def add(a, b):"
    full = tok.decode(_greedy_alone(module, tok, prompt, 40))
    stop = next(full[i : i + 2] for i in range(5, 38) if full.find(full[i : i + 2]) == i)

    async def main():
        engine = _engine(lively)
        stopped = engine.submit(prompt, SamplingParams(max_tokens=40, stop=["\x00never", stop], **GREEDY))
        deltas = [event async for event in stopped]
        engine.eos_ids = {tok(full[7])["input_ids"][0]}  # the model's 8th token stands for EOS now
        eos = await engine.submit(prompt, SamplingParams(max_tokens=40, **GREEDY)).collect()
        await asyncio.to_thread(engine.stop)
        return deltas, eos

    deltas, eos = asyncio.run(main())
    text = "".join(d.text for d in deltas)
    assert text == full[: full.index(stop)] and deltas[-1].finish_reason == "stop"
    assert all(d.finish_reason is None for d in deltas[:-1])
    first = full.index(full[7])  # one byte a token
    assert (eos.text, eos.finish_reason, eos.completion_tokens) == (full[:first], "stop", first + 1)


def test_on_a_cpu_the_model_thread_leaves_a_core_to_the_event_loop():
    assert [cpu_threads(n) for n in (1, 2, 16)] == [1, 1, 15]


def test_a_stop_string_split_over_tokens_is_held_back_not_streamed():
    assert _held("answer: foo\nus", ["\nuser:"]) == 3 and _held("abc", ["x", "cd"]) == 1
    assert _held("abc", ["zz"]) == 0 and _held("", ["ab"]) == 0


def test_max_tokens_and_the_context_end_give_length(lively):
    async def main():
        engine = _engine(lively, max_context=24)
        short = await engine.submit("hello", SamplingParams(max_tokens=3, **GREEDY)).collect()
        past_context = await engine.submit("x" * 20, SamplingParams(max_tokens=50, **GREEDY)).collect()
        with pytest.raises(PromptTooLong, match="24 tokens"):
            engine.submit("x" * 24)
        with pytest.raises(ValueError, match="empty"):
            engine.submit("")
        await asyncio.to_thread(engine.stop)
        return short, past_context

    short, past_context = asyncio.run(main())
    assert (short.finish_reason, short.completion_tokens) == ("length", 3)
    assert (past_context.finish_reason, past_context.completion_tokens) == ("length", 4)


def test_a_cancelled_request_leaves_and_the_others_finish(lively):
    module, tok = lively

    async def main():
        engine = _engine(lively, max_batch=4)
        params = SamplingParams(max_tokens=60, **GREEDY)
        keep = [asyncio.ensure_future(_finish(engine.submit(p, params))) for p in ("one", "two")]
        dropped = engine.submit("three", params)
        async with contextlib.aclosing(engine.generate("four", params)) as stream:
            async for _ in stream:
                break  # the client went away: closing the stream frees its place
        dropped.cancel()
        await _until(lambda: engine.active <= 2)
        results = await asyncio.gather(*keep)
        await asyncio.to_thread(engine.stop)
        return engine, results

    engine, results = asyncio.run(main())
    assert engine.tokens < 3 * 60
    for prompt, (_, final) in zip(("one", "two"), results, strict=True):
        assert list(final.token_ids) == _greedy_alone(module, tok, prompt, 60)


def test_past_max_queue_submit_raises_queue_full_and_a_waiting_cancel_frees_its_place(lively):
    async def main():
        engine = _engine(lively, max_batch=1, max_queue=2)
        long = SamplingParams(max_tokens=200, **GREEDY)
        running = engine.submit("a", long)
        await _until(lambda: engine.active == 1)
        waiting = [engine.submit("b", long), engine.submit("c", long)]
        with pytest.raises(QueueFull) as refused:
            engine.submit("d", long)
        waiting[0].cancel()
        assert engine.queued == 1
        again = engine.submit("e", SamplingParams(max_tokens=2, **GREEDY))
        for generation in (running, waiting[1]):
            generation.cancel()
        done = await again.collect()
        await asyncio.to_thread(engine.stop)
        return refused.value, done

    refused, done = asyncio.run(main())
    assert refused.retry_after_s >= 1 and done.completion_tokens == 2


def test_sampling_is_repeatable_with_a_seed_and_top_p_near_zero_is_greedy(lively):
    module, tok = lively

    async def main():
        engine = _engine(lively)
        answers = []
        for params in ({"seed": 3}, {"seed": 3}, {"seed": 4}, {"top_p": 1e-6, "seed": 5}):
            answers.append(await engine.submit("abc", SamplingParams(max_tokens=30, **params)).collect())
        await asyncio.to_thread(engine.stop)
        return answers

    a, b, c, nucleus = asyncio.run(main())
    assert a.token_ids == b.token_ids != c.token_ids
    assert list(nucleus.token_ids) == _greedy_alone(module, tok, "abc", 30)


@pytest.fixture(scope="module")
def euro_cycle():
    """A GPT-2 whose greedy answer after "x" is the bytes of "€x€x..." (the byte tokenizer: "€" is three
    tokens, E2 82 AC): each token's embedding is a basis vector, attention and MLP add nothing, and
    lm_head points each one at the next byte of the cycle."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = byte_tokenizer()
    cycle = [tok.convert_tokens_to_ids(t) for t in tok.tokenize("x€")]
    config = GPT2Config(
        n_layer=1, n_embd=64, n_head=4, vocab_size=len(tok), n_positions=64, tie_word_embeddings=False,
        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
    )  # fmt: skip
    module = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.zero_()
        for norm in (module.transformer.ln_f, module.transformer.h[0].ln_1, module.transformer.h[0].ln_2):
            norm.weight.fill_(1)
        for i, token in enumerate(cycle):
            module.transformer.wte.weight[token, i] = 1.0
            module.lm_head.weight[cycle[(i + 1) % len(cycle)], i] = 10.0
    return module, tok


def test_a_character_split_over_tokens_is_never_streamed_as_a_replacement_character(euro_cycle):
    engine = _engine(euro_cycle)
    try:
        with TestClient(_app(lambda: engine)) as client:
            for n in range(1, 9):  # the answer ends after each byte of "€x€x..." in turn
                body = {"prompt": "x", "max_tokens": n, "temperature": 0, "stream": True}
                texts = [c["choices"][0]["text"] for c in _events(client.post("/v1/completions", json=body))]
                whole = ("€x" * 4).encode()[:n].decode(errors="ignore")  # the whole characters, no more
                assert "".join(texts) == whole and not any("\ufffd" in t for t in texts), (n, texts)
                plain = client.post("/v1/completions", json={**body, "stream": False}).json()
                assert plain["choices"][0]["text"] == whole, (n, plain)
    finally:
        engine.stop()


# -- the OpenAI-style routes on a trained run --------------------------------------------------------


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt")
    (tmp / "corpus.txt").write_text("def add(a, b):\n    return a + b\n\n" * 40)
    raw = {
        "name": "gpt-serve",
        "model": {
            "source": "bundled:gpt-tiny",
            "task": "causal-lm",
            "options": {"n_layer": 2, "n_embd": 64, "n_head": 4},
        },
        "data": {"train": str(tmp / "corpus.txt"), "max_length": 64},
        "train": {"max_steps": 3, "batch_size": 8, "precision": "fp32"},
    }
    train(load_spec(write_spec(tmp / "spec.yaml", raw)), tmp / "run")
    return tmp / "run" / "model"


def _app(get_engine, **options) -> FastAPI:
    app = FastAPI()
    app.include_router(create_openai_router(get_engine, **options))
    return app


@pytest.fixture(scope="module")
def api(lm_dir):
    engine = load_engine(lm_dir, device="cpu", precision="fp32", max_batch=4)
    engine.start()
    with TestClient(_app(lambda: engine)) as client:
        yield client, engine
    engine.stop()


def _events(response) -> list:
    lines = [line for line in response.text.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


@pytest.mark.slow
def test_completions_answer_what_the_model_says(api):
    client, engine = api
    body = {"model": "whatever", "prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    expected = _greedy_alone(engine.module, engine.tokenizer, "def add(a, b):", 12)
    assert answer["object"] == "text_completion" and answer["model"] == "gpt-serve"
    assert answer["choices"][0]["text"] == engine.tokenizer.decode(expected)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"] == {"prompt_tokens": 14, "completion_tokens": 12, "total_tokens": 26}

    streamed = client.post(
        "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert streamed.headers["content-type"].startswith("text/event-stream")
    chunks = _events(streamed)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == answer["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"] == answer["usage"]


def test_chat_completions_with_the_fallback_format_and_streaming(api):
    client, engine = api
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    body = {"messages": messages, "max_completion_tokens": 8, "temperature": 0, "seed": 1}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    prompt = "system: be brief\nuser: hi\nassistant:"
    expected = engine.tokenizer.decode(_greedy_alone(engine.module, engine.tokenizer, prompt, 8))
    expected = expected.split("\nuser:")[0]
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["role"] == "assistant"
    assert answer["choices"][0]["message"]["content"] == expected
    assert answer["usage"]["prompt_tokens"] == len(prompt)  # one byte a token

    chunks = _events(client.post("/v1/chat/completions", json={**body, "stream": True}))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_a_tokenizer_chat_template_is_used_when_there_is_one(api):
    _, engine = api
    engine.tokenizer.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    )
    try:
        ids, stops = chat_prompt(engine, [{"role": "user", "content": "hi"}])
    finally:
        engine.tokenizer.chat_template = None
    assert engine.tokenizer.decode(ids) == "<user>hi<assistant>" and stops == []


@pytest.mark.parametrize(
    ("path", "body", "code", "says"),
    [
        ("/v1/completions", {"prompt": ""}, 422, "prompt: empty"),
        ("/v1/completions", {"prompt": []}, 422, "prompt: empty"),
        ("/v1/completions", {"prompt": ["a", "b"]}, 422, "one prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 422, "greater than or equal to 1"),
        ("/v1/completions", b"prompt=hi", 422, "the body is not JSON (Expecting value)"),
        ("/v1/completions", {"prompt": "hi", "n": 2}, 422, "only n=1"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 2}, 422, "logprobs: not supported"),
        ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 422, "at most 4"),
        ("/v1/completions", {"prompt": "hi", "temperature": 3}, 422, "less than or equal to 2"),
        ("/v1/completions", {"prompt": "x" * 300}, 413, "the model's context is 256 tokens"),
        ("/v1/completions", {"prompt": [1, 999]}, 422, "token ids must be in"),
        ("/v1/chat/completions", {"messages": []}, 422, "messages: empty"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            422,
            "only text",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 422, "role"),
    ],
)
def test_bad_input_gets_a_clear_4xx(api, path, body, code, says):
    if isinstance(body, bytes):
        response = api[0].post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = api[0].post(path, json=body)
    assert response.status_code == code, response.text
    error = response.json()["error"]  # where OpenAI clients look for the reason
    assert says in error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/completions", {"prompt": "hi"}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "max_completion_tokens"),
    ],
)
def test_max_tokens_past_the_context_is_a_400_that_names_the_limit(api, path, body, field):
    client, engine = api
    prompt = 2 if path == "/v1/completions" else len("user: hi\nassistant:")  # one byte a token
    room = engine.context - prompt
    too_many = client.post(path, json={**body, field: room + 1})
    assert too_many.status_code == 400, too_many.text
    error = too_many.json()["error"]  # as OpenAI answers it
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error", field, "context_length_exceeded"
    )  # fmt: skip
    assert error["message"] == (
        f"{field}: {room + 1} after the prompt's {prompt} tokens is {engine.context + 1}, over the model's "
        f"context of {engine.context} tokens; ask for at most {room}"
    )
    fits = client.post(path, json={**body, field: room, "stop": "\n"})
    assert fits.status_code == 200, fits.text


def test_loading_gives_503_and_a_full_queue_429_with_retry_after():
    class Full:
        name, tokenizer, context = "full", byte_tokenizer(), 256

        def encode(self, text, add_special_tokens=True):
            return self.tokenizer(text)["input_ids"]

        def submit(self, prompt, params, stream=True):
            raise QueueFull(2.5)

    with TestClient(_app(lambda: None)) as loading:
        response = loading.post("/v1/completions", json={"prompt": "hi"})
        assert response.status_code == 503 and response.headers["retry-after"] == "5"
    with TestClient(_app(lambda: Full())) as full:
        response = full.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 429 and response.headers["retry-after"] == "3"
        assert response.json()["error"]["type"] == "rate_limit_error"
        assert full.get("/v1/models").json()["data"][0]["id"] == "full"


def test_the_worker_serves_a_causal_lm_through_the_openai_routes(lm_dir):
    from gpuforge.serve.options import ServeOptions
    from gpuforge.serve.worker import create_worker

    with TestClient(create_worker(lm_dir, ServeOptions(precision="fp32", max_batch=4))) as client:
        deadline = time.monotonic() + 60
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, client.get("/readyz").json()
            time.sleep(0.05)
        body = {"prompt": "def add(a, b):", "max_tokens": 5, "temperature": 0}
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1, answer.text
        assert client.post("/predict", json={"inputs": ["x"]}).status_code == 404  # not a classifier
        assert "gpuforge_serve_tokens_total" in client.get("/metrics").text

        info = client.get("/info")
        assert info.status_code == 200, info.text
        assert {k: info.json()[k] for k in ("model", "task", "context_length", "precision", "batching")} == {
            "model": "gpt-serve", "task": "causal-lm", "context_length": 256, "precision": "fp32",
            "batching": "continuous",
        }  # fmt: skip


def test_completions_are_counted_in_metrics_like_predictions(lm_dir):
    from gpuforge.serve.options import ServeOptions
    from gpuforge.serve.worker import create_worker

    with TestClient(create_worker(lm_dir, ServeOptions(precision="fp32", max_batch=4))) as client:
        deadline = time.monotonic() + 60
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, client.get("/readyz").json()
            time.sleep(0.05)
        body = {"prompt": "def add(a, b):", "max_tokens": 3}
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        form = {"content-type": "application/x-www-form-urlencoded"}  # what `curl -d` says
        for _ in range(2):
            assert client.post("/v1/completions", json=body).status_code == 200
            assert client.post("/v1/chat/completions", json={**chat, "stream": True}).status_code == 200
            assert client.post("/v1/completions", content=json.dumps(body), headers=form).status_code == 200
        assert client.post("/v1/completions", json={**body, "max_tokens": 999}).status_code == 400
        figures = dict(
            line.rsplit(" ", 1) for line in client.get("/metrics").text.splitlines() if line[:1] != "#"
        )
    assert float(figures["gpuforge_serve_request_seconds_count"]) == 6  # the 400 is not an answer
    assert float(figures["gpuforge_serve_inputs_total"]) == 6
    assert float(figures["gpuforge_serve_requests_in_flight"]) == 0
