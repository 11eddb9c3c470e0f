"""kvctl.signals: SIGTERM/SIGHUP unwind like Ctrl-C; cleanup runs with them ignored; handlers come back."""

from __future__ import annotations

import os
import signal

import pytest

from kvctl.signals import Terminated, run_to_completion, signals_ignored, signals_interrupt


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_termination_signals_raise_and_handlers_come_back(sig):
    before = signal.getsignal(sig)
    with pytest.raises(Terminated, match=signal.Signals(sig).name):
        with signals_interrupt():
            os.kill(os.getpid(), sig)
            for _ in range(1000):  # the handler runs between bytecodes of the main thread
                pass
    assert signal.getsignal(sig) is before
    assert issubclass(Terminated, KeyboardInterrupt)  # handled exactly like Ctrl-C


def test_sigint_interrupts_even_when_inherited_as_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(KeyboardInterrupt):
            with signals_interrupt():
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):
                    pass
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_cleanup_is_not_interrupted_and_restarts_after_a_slipped_signal():
    runs = []

    def cleanup() -> None:
        runs.append(signal.getsignal(signal.SIGTERM))
        if len(runs) == 1:
            raise KeyboardInterrupt  # as if a signal arrived before the handlers were swapped
        os.kill(os.getpid(), signal.SIGTERM)  # ignored while cleanup runs

    with signals_interrupt():
        run_to_completion(cleanup)
    assert len(runs) == 2 and all(h is signal.SIG_IGN for h in runs)
    with signals_ignored():
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
