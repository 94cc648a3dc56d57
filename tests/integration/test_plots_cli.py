"""trident-plot in processes of its own: its command line refuses a folder that is not a run in one line, and the
HTML report's images load in a browser (headless chromium). The plots and the report themselves are checked in
tests/unit/tools/test_plots.py."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fake_runs import fake_reported_run

from tools.plots import plot_runs

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def test_cli_refuses_a_folder_that_is_not_a_run_in_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "tools.plots", str(tmp_path / "empty")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "is not a run's output_dir" in line and str(tmp_path / "empty") in line


def test_report_images_load_in_a_browser(tmp_path, tiny_model_path):
    if not Path(CHROMIUM).is_file():  # .ci/run installs it: in CI its absence is a failure, not a skip
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)("needs chromium")
    run, _ = fake_reported_run(tmp_path / "run", tiny_model_path)
    report = plot_runs([run])
    probe = report.with_name("probe.html")  # the report, telling the width of each image once the page loaded
    script = (
        "<script>addEventListener('load', () => document.body.setAttribute('data-widths', "
        "[...document.images].map(i => i.naturalWidth).join(',')))</script></body>"
    )
    probe.write_text(report.read_text().replace("</body>", script))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run",
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000", "--dump-dom"]  # fmt: skip
    result = subprocess.run([CHROMIUM, *flags, probe.as_uri()], capture_output=True, text=True, timeout=120)
    widths = re.search(r'data-widths="([^"]*)"', result.stdout)
    assert widths, result.stderr[-2000:]
    plots = report.read_text().count("<img ")
    assert plots == len(list(report.parent.glob("*.png"))) >= 10  # the reward functions' plot is the tenth
    assert widths.group(1).split(",") == ["800"] * plots  # every plot loaded at its full width
