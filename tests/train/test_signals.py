"""The stop flag of a training loop (train/signals.py): a SIGTERM that reaches a rank while it is still
setting up is kept, and the loop's flag stops it at the first step."""

import os
import signal

from gpuforge.train import signals
from gpuforge.train.signals import StopFlag, hold_until_the_loop


def test_a_sigterm_during_set_up_is_held_for_the_loops_flag():
    before = signal.getsignal(signal.SIGTERM)
    try:
        hold_until_the_loop()
        os.kill(os.getpid(), signal.SIGTERM)  # the process lives on: the signal is only kept
        flag = StopFlag()
        assert flag.signal_number is None
        with flag.installed():
            assert flag.signal_name == "SIGTERM"
        assert StopFlag().signal_number is None  # a new flag before installing reads nothing yet
    finally:
        signal.signal(signal.SIGTERM, before)
        signals._held.clear()


def test_without_a_held_signal_the_flag_waits_for_one():
    flag = StopFlag()
    with flag.installed():
        assert flag.signal_number is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.signal_name == "SIGTERM"
