"""The CLI's progress line: what it shows after each logged step."""

import io

from rich.console import Console

from gpuforge.train.progress import RichReporter


def _record(step: int, **extra) -> dict:
    return {"step": step, "loss": 1.0 / step, "samples_per_s": 10.0, "eta_s": 5.0, "cost_usd": 0.01, **extra}


def test_the_latest_eval_stays_on_the_line_until_the_next():
    out = io.StringIO()
    reporter = RichReporter(Console(file=out, width=200))
    reporter.start(total_steps=4, start_step=0)
    reporter.step(_record(1))
    reporter.step(_record(2, eval_loss=0.7, eval_accuracy=0.625))
    reporter.step(_record(3))  # no evaluation at this step: the bar keeps step 2's
    reporter.stop()
    line = out.getvalue().strip().splitlines()[-1]
    assert line.startswith("step     3/4") and "loss 0.3333 eval acc 0.625 10.0 samples/s" in line


def test_a_causal_lm_shows_its_perplexity_and_a_job_without_eval_nothing():
    out = io.StringIO()
    reporter = RichReporter(Console(file=out, width=200))
    reporter.start(total_steps=2, start_step=0)
    reporter.step(_record(1))
    reporter.stop()
    assert "eval" not in out.getvalue()
    reporter.start(total_steps=2, start_step=1)
    reporter.step(_record(2, eval_loss=5.0, eval_perplexity=148.41))
    reporter.stop()
    assert "eval ppl 148.41" in out.getvalue()
