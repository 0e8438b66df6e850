"""A small CNN for 8x8 grey digits: the `python:` model source in action (a function returning nn.Module)."""

from torch import nn


def build(num_labels: int, channels: int = 32) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1),
        nn.BatchNorm2d(channels),
        nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 3, padding=1),
        nn.BatchNorm2d(2 * channels),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 8x8 -> 4x4
        nn.Flatten(),
        nn.Dropout(0.1),
        nn.Linear(2 * channels * 4 * 4, num_labels),
    )
