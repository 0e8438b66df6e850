"""Small models for tests, loaded through the `python:<file>:<fn>` source."""

import time

import torch
from torch import nn


class TinyImageNet(nn.Module):
    """Linear classifier on flattened images, with dropout so RNG state matters on resume."""

    def __init__(self, num_labels, pixels, sleep_s, nan_after, dropout, oom_above, nan_grad_after=None):
        super().__init__()
        self.nan_grad_after = nan_grad_after
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(pixels, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, num_labels)
        )
        self.sleep_s, self.nan_after, self.calls, self.oom_above = sleep_s, nan_after, 0, oom_above

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.sleep_s:
                time.sleep(self.sleep_s)  # makes a run slow enough to be killed mid-way
        hidden = self.net[:4](x)  # dropout has drawn its mask: a real OOM strikes mid-forward too
        if self.training and self.oom_above is not None and len(x) > self.oom_above:
            raise torch.OutOfMemoryError(f"injected: a batch of {len(x)} does not fit, {self.oom_above} does")
        out = self.net[4](hidden)
        if self.training and self.nan_grad_after is not None and self.calls > self.nan_grad_after:
            out = out + torch.sqrt(self.net[4].weight.sum() * 0.0)  # adds 0, but its gradient is NaN
        if self.training and self.nan_after is not None and self.calls > self.nan_after:
            out = out * float("nan")
        return out


def image_model(
    num_labels: int,
    pixels: int = 64,
    sleep_s: float = 0.0,
    nan_after: int | None = None,
    dropout: float = 0.1,
    oom_above: int | None = None,
    nan_grad_after: int | None = None,
) -> nn.Module:
    return TinyImageNet(num_labels, pixels, sleep_s, nan_after, dropout, oom_above, nan_grad_after)


class TinyTextNet(nn.Module):
    """Mean-pooled embeddings -> linear: a plain torch text classifier that uses the attention mask."""

    def __init__(self, vocab_size: int, num_labels: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 16)
        self.head = nn.Linear(16, num_labels)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(input_ids)
        if attention_mask is None:
            return self.head(h.mean(1))
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1).clamp(min=1))


def text_model(vocab_size: int, num_labels: int) -> nn.Module:
    return TinyTextNet(vocab_size, num_labels)


def not_a_module():
    return 42


def raises():
    raise RuntimeError("boom in user code")
