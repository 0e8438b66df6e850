"""Which precision a classifier's batches run in: weights cast once, and auto's measured switch."""

import time

import pytest
import torch

from gpuforge.runtime.precision import Precision
from gpuforge.serve.batch_precision import batch_sizes, lowered, measured_plan, plan_precision, takes_over
from gpuforge.serve.predict import load_predictor
from tests.serve.tiny_runs import train_topics


@pytest.fixture(scope="module")
def text_model(tmp_path_factory, tiny_bert_dir):
    return train_topics(tmp_path_factory.mktemp("batch-precision"), tiny_bert_dir)


def test_the_cast_copy_shares_all_but_the_linear_weights_and_answers_as_autocast_does(text_model):
    from gpuforge.artifact import load_artifact

    module, tokenizer, _ = load_artifact(text_model)
    low = lowered(module, torch.bfloat16)
    linear = [n for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)]
    assert linear and all(low.get_submodule(n).weight.dtype == torch.bfloat16 for n in linear)
    assert all(module.get_submodule(n).weight.dtype == torch.float32 for n in linear)  # left as it was
    word_embeddings = module.get_input_embeddings().weight
    assert low.get_input_embeddings().weight.data_ptr() == word_embeddings.data_ptr()  # not copied
    texts = ["rain and wind today", "the match ended late"]
    batch = dict(tokenizer(texts, padding=True, return_tensors="pt"))
    with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16):
        cast_each_forward, cast_once = module(**batch).logits, low(**batch).logits
    assert torch.equal(cast_each_forward, cast_once)


def _timed_by(ms):
    """A batch that takes ms(precision name, size) milliseconds."""

    def timed(module, precision, size):
        time.sleep(ms(precision.name, size) / 1000)

    return timed


BF16 = Precision("bf16", "the candidate")


def test_auto_serves_the_lower_precision_only_from_the_size_at_which_it_wins_for_good():
    fp32, low = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    # bf16 loses at 1 and 2, wins at 4, loses at 8 (noise, or a shape it handles badly), wins from 16
    wins = {1: False, 2: False, 4: True, 8: False, 16: True, 32: True}
    plan = measured_plan(BF16, fp32, low, _timed_by(lambda p, n: 2 if (p == "bf16") == wins[n] else 12), 32)
    assert sorted(plan.measured_ms) == batch_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert plan.switch == 16 and plan.precision.name == "bf16"
    assert plan.for_batch(8) == (fp32, Precision("fp32", "")) and plan.for_batch(15)[0] is fp32
    assert plan.for_batch(16) == (low, plan.precision) and plan.for_batch(32)[0] is low
    assert plan.describe()["rule"] == "fp32 for batches under 16 inputs, bf16 from 16"


def test_auto_keeps_one_copy_where_one_precision_wins_everywhere_or_adapters_need_one():
    fp32, low = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    everywhere = measured_plan(BF16, fp32, low, _timed_by(lambda p, n: 2 if p == "bf16" else 12), 8)
    assert everywhere.small is None and everywhere.for_batch(1)[0] is low
    assert everywhere.describe()["rule"] == "bf16 for every batch"
    nowhere = measured_plan(BF16, fp32, low, _timed_by(lambda p, n: 12 if p == "bf16" else 2), 8)
    assert nowhere.precision.name == "fp32" and nowhere.for_batch(8)[0] is fp32
    large_only = _timed_by(lambda p, n: (2 if n >= 4 else 20) if p == "bf16" else 10)
    adapters = measured_plan(BF16, fp32, low, large_only, 8, alone=True)
    assert adapters.precision.name == "fp32" and "adapters" in adapters.precision.reason


def test_takes_over_reads_the_table():
    table = {1: {"fp32": 1, "bf16": 2}, 2: {"fp32": 2, "bf16": 1}, 4: {"fp32": 3, "bf16": 1}}
    assert takes_over(table, "bf16") == 2
    assert takes_over({1: {"fp32": 1, "bf16": 2}}, "bf16") is None
    assert batch_sizes(1) == [1] and batch_sizes(12) == [1, 2, 4, 8, 12]
    assert batch_sizes(1024)[-2:] == [128, 256]  # a deployment's largest is not timed: its load stays short
    barely = {1: {"fp32": 10, "bf16": 9.8}}  # 2% is noise: no second copy of the model for it
    assert takes_over(barely, "bf16") is None


def test_an_asked_for_precision_is_not_measured_and_fp32_is_not_cast():
    module = torch.nn.Sequential(torch.nn.Linear(2, 2))

    def never(*_):
        raise AssertionError("an asked-for precision is not timed")

    bf16 = plan_precision("bf16", Precision("bf16", "asked for"), module, never, 32)
    assert bf16.module[0].weight.dtype == torch.bfloat16 and module[0].weight.dtype == torch.float32
    fp32 = plan_precision("fp32", Precision("fp32", "asked for"), module, never, 32)
    assert fp32.module is module and fp32.describe()["rule"] == "fp32 for every batch"


def test_a_served_bf16_classifier_answers_as_autocast_over_its_fp32_weights(text_model):
    texts = ["rain and wind today", "the match ended late", "a new phone"]
    served = load_predictor(text_model, device="cpu", precision="bf16", max_batch=4)
    assert served.plan.describe()["rule"] == "bf16 for every batch"
    reference = load_predictor(text_model, device="cpu", precision="fp32", max_batch=4)
    reference.precision = served.precision  # the same forward under autocast, over fp32 weights
    reference.plan = None
    assert served.run_batch([(None, t) for t in texts]) == reference.run_batch([(None, t) for t in texts])


def test_auto_at_load_says_what_it_chose_and_the_timings_that_chose_it(text_model):
    predictor = load_predictor(text_model, device="cpu", precision="auto", max_batch=4)
    choice = predictor.plan.describe()
    assert choice["reason"].startswith("auto:") and predictor.precision is predictor.plan.precision
    if choice["measured_ms"] is not None:  # a CPU whose bf16 matmul is faster: timed on the served model
        assert sorted(choice["measured_ms"]) == [1, 2, 4]
        assert all(set(ms) == {"fp32", "bf16"} for ms in choice["measured_ms"].values())
    else:  # bf16 slower in the matmul already: fp32 without timing the model
        assert choice["rule"] == "fp32 for every batch"
    outputs = predictor.run_batch([(None, "rain and wind today")] * 3)
    assert len(outputs) == 3 and outputs[0] == outputs[2]


def test_a_linear_tied_to_an_embedding_is_left_as_it_is():
    embedding, head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight  # tied, as a language model's head often is
    model = torch.nn.ModuleDict({"embedding": embedding, "head": head, "other": torch.nn.Linear(4, 4)})
    low = lowered(model, torch.bfloat16)
    assert model["embedding"].weight.dtype == torch.float32 and low["head"].weight.dtype == torch.float32
    assert low["other"].weight.dtype == torch.bfloat16 and model["other"].weight.dtype == torch.float32


def test_adapters_served_in_bf16_answer_as_autocast_over_fp32_weights(three_adapters):
    own, b, c = three_adapters
    items = [(None, "the striker scored twice"), ("b", "shares fell sharply"), ("c", "rain all week"),
             (None, "a new phone was launched")]  # fmt: skip
    served = load_predictor(own, device="cpu", precision="bf16", adapters={"b": b, "c": c}, max_batch=4)
    reference = load_predictor(own, device="cpu", precision="fp32", adapters={"b": b, "c": c}, max_batch=4)
    reference.precision, reference.plan = served.precision, None  # autocast over the fp32 weights
    assert served.run_batch(items) == reference.run_batch(items)  # one batch, rows through their adapter
