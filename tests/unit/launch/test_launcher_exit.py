"""``rl``'s exit code survives a stop signal that arrives after the run is over: Python resets the handlers it
installed to the default while it finalizes, so without care a late SIGINT ends ``rl`` by that signal (-2) instead of
with its code (130 after a stop)."""

import signal

import pytest
from debug_configs import FILES

from launch import launcher
from launch.main import main
from launch.supervise import STOP_SIGNALS, stop_on_signals


def test_once_the_run_is_over_rl_ignores_stop_signals(monkeypatch, saved_handlers, tmp_path):
    def stopped_run(config):
        stop_on_signals()  # as run() does while its processes run
        return 130

    monkeypatch.setattr(launcher, "run", stopped_run)
    with pytest.raises(SystemExit) as exit_:
        main([*FILES, "--output-dir", str(tmp_path)])
    assert exit_.value.code == 130
    assert all(signal.getsignal(sig) is signal.SIG_IGN for sig in STOP_SIGNALS)
