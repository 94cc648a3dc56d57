"""trident-plot: PNGs of two fake runs' metrics, checked for content and axis ranges; the HTML report; CLI errors."""

import html
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.figure import Figure
from matplotlib.image import imread
from transformers import AutoTokenizer

from contracts.metrics import MetricsWriter
from contracts.model_path import TINY_MODEL_ID
from contracts.protocol import BatchInfo, MicroBatch, Sample, sample_summary, write_batch
from contracts.run_dir import configs_dir
from launch.launcher import write_plots_or_warn
from tools.plots import load_run, plot_runs, write_plots
from tools.report import write_report

STEPS = 6
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def fake_run(output_dir: Path, reward_start: float, with_entropy: bool = True, with_evals: bool = True) -> Path:
    """Metrics of a run whose reward rises by 0.1 a step from ``reward_start``."""
    trainer, orchestrator = MetricsWriter(output_dir, "trainer"), MetricsWriter(output_dir, "orchestrator")
    for step in range(STEPS):
        record = {"step": step, "reward_mean": reward_start + 0.1 * step, "truncated_rate": 0.5 - 0.05 * step,
                  "completion_len_mean": 20.0 + step, "completion_len_max": 40 + 2 * step, "rollouts_per_s": 3.0,
                  "sampled_tokens_per_s": 100.0 + step}  # fmt: skip
        if step > 0:
            record["probe_gap"] = 0.01 / step  # absent until the first reload
        orchestrator.write(record)
        if with_evals and step % 2 == 0:  # the scores are plotted, not the failures or the seconds
            orchestrator.write_eval({"step": step, "eval/gsm8k/reward_mean": 0.2 + 0.05 * step,
                                     "eval/gsm8k/failed": 1, "eval/seconds": 30.0})  # fmt: skip
        trained = {"step": step, "loss": 0.3 - 0.1 * step, "mismatch_kl": 1e-3, "tokens_per_s": 500.0 - step}
        if with_entropy:
            trained["entropy"] = 2.0 - 0.2 * step
        trainer.write(trained)
    return output_dir


@pytest.fixture
def runs(tmp_path) -> list[Path]:
    return [fake_run(tmp_path / "run_a", 0.1), fake_run(tmp_path / "run_b", 0.3, with_entropy=False)]


def assert_not_blank(path: Path) -> None:
    pixels = imread(path)
    assert pixels.shape[:2] == (400, 800)
    assert pixels[..., :3].var() > 1e-3  # lines, text and axes, not one flat colour


def test_plots_of_two_runs_have_content_and_the_metrics_range(runs, tmp_path):
    out = tmp_path / "out"
    plots = {plot.name: plot for plot in write_plots([load_run(r) for r in runs], out)}
    assert set(plots) == {"reward", "eval", "loss", "entropy", "mismatch", "lengths", "truncation",
                          "rollouts_per_s", "tokens_per_s"}  # fmt: skip
    for plot in plots.values():
        assert plot.path == out / f"{plot.name}.png" and plot.path.is_file()
        assert_not_blank(plot.path)

    reward = plots["reward"]
    assert reward.series["run_a"] == (list(range(STEPS)), pytest.approx([0.1 + 0.1 * s for s in range(STEPS)]))
    values = [v for _, series in reward.series.values() for v in series]
    low, high = reward.ylim
    span = max(values) - min(values)
    assert low <= min(values) and high >= max(values)  # every point is inside the axes
    assert high - low <= 1.2 * span  # and the axes are fitted to them (matplotlib's margins are 5% a side)

    assert set(plots["entropy"].series) == {"run_a"}  # run_b logged no entropy: skipped for it alone
    assert plots["mismatch"].series["run_a probe_gap"][0] == list(range(1, STEPS))
    assert set(plots["tokens_per_s"].series) == {
        f"{run} {key}" for run in ("run_a", "run_b") for key in ("sampled_tokens_per_s", "tokens_per_s")
    }
    assert plots["eval"].series["run_b"][0] == [0, 2, 4]  # one key: labelled by run
    assert len(plots["eval"].series) == 2  # a line per run: neither failures nor seconds are scores


def test_step_ticks_are_whole_steps(runs, tmp_path, monkeypatch):
    """A 6-step run: matplotlib's default ticks would fall at 0.5, 1.5, ..."""
    ticks = {}

    def savefig(figure, path, *args, **kwargs):
        ticks[Path(path).stem] = list(figure.axes[0].get_xticks())

    monkeypatch.setattr(Figure, "savefig", savefig)
    write_plots([load_run(r) for r in runs], tmp_path / "out")
    assert ticks and all(t == int(t) for plot_ticks in ticks.values() for t in plot_ticks), ticks


def test_a_plot_without_data_is_not_written(tmp_path):
    run = load_run(fake_run(tmp_path / "run", 0.1, with_entropy=False, with_evals=False))
    plots = {plot.name for plot in write_plots([run], tmp_path / "out")}
    assert "eval" not in plots and "entropy" not in plots and "reward" in plots
    assert not (tmp_path / "out" / "eval.png").exists()


def test_one_run_is_labelled_by_key(tmp_path):
    (plot, *_) = write_plots([load_run(fake_run(tmp_path / "run", 0.1))], tmp_path / "out")
    assert plot.name == "reward" and set(plot.series) == {"reward_mean"}


def test_cli_refuses_a_folder_that_is_not_a_run_in_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "tools.plots", str(tmp_path / "empty")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "is not a run's output_dir" in line and str(tmp_path / "empty") in line


def test_default_out_is_the_first_runs_plots_folder(runs):
    report = plot_runs(runs)
    assert report == runs[0] / "plots" / "report.html"
    assert (runs[0] / "plots" / "reward.png").is_file()


# ── the HTML report ─────────────────────────────────────────────────────────────────────────────────────


def rollout_with_tool_call(tokenizer) -> tuple[list[int], list[bool], str, str]:
    """Token ids and loss mask of a chat: a prompt, a sampled reply, a tool result, a second sampled reply.
    Also the texts of the two replies."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 6 x 7? Use < and > if you like."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    first, tool, second = "I will compute 6 x 7.<|im_end|>", "\n<|im_start|>user\n<tool_response>\n42", "It is 42."
    pieces = [(prompt, False), (first, True), (tool, False), (second, True)]
    token_ids, mask = [], []
    for text, trained in pieces:
        ids = tokenizer.encode(text, add_special_tokens=False)
        token_ids += ids
        mask += [trained] * len(ids)
    return token_ids, mask, first, second


def write_rollouts(output_dir: Path, tokenizer, step: int, keep_batch: bool) -> tuple[str, str]:
    """A sample-rollouts row for ``step`` and, with ``keep_batch``, its batch ``rollouts/step_N/``."""
    token_ids, mask, first, second = rollout_with_tool_call(tokenizer)
    meta = {"env": "calc", "task": "t1"}
    sample = Sample(token_ids, mask, [-0.5 if m else 0.0 for m in mask], 0.25, 1.0, step, meta)
    prompt_len = mask.index(True)
    row = {"step": step, **meta, "prompt": tokenizer.decode(token_ids[:prompt_len], skip_special_tokens=False),
           "completion": tokenizer.decode(token_ids[prompt_len:], skip_special_tokens=False), "reward": 1.0,
           "advantage": 0.25, "truncated": False}  # fmt: skip
    MetricsWriter(output_dir, "orchestrator").write_table("sample_rollouts", step, [row])
    if keep_batch:
        info = BatchInfo(step, 1, len(token_ids), sum(mask), 1.0, 1.0, [step], samples=[sample_summary(sample)])
        write_batch(output_dir, info, [MicroBatch.pack([sample])])
    return first, second


@pytest.fixture
def reported_run(tmp_path, tiny_model_path) -> tuple[Path, tuple[str, str]]:
    """A fake run with configs, an old sample step whose batch is gone and a last one whose batch is on disk."""
    run = fake_run(tmp_path / "run", 0.1)
    configs_dir(run).mkdir()
    (configs_dir(run) / "orchestrator.toml").write_text(f'[model]\nname = "{TINY_MODEL_ID}"\n')
    (configs_dir(run) / "trainer.toml").write_text('[wandb]\nname = "a<b & c>"\n')
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    write_rollouts(run, tokenizer, 0, keep_batch=False)
    return run, write_rollouts(run, tokenizer, 5, keep_batch=True)


def test_report_has_images_configs_and_highlighted_trained_tokens(reported_run):
    run, (first, second) = reported_run
    report = plot_runs([run])
    page = report.read_text()
    images = re.findall(r"<img src='([^']+)'", page)
    assert "reward.png" in images and len(images) == 9
    assert all((report.parent / image).is_file() for image in images)  # relative to the report
    assert "name = &quot;a&lt;b &amp; c&gt;&quot;" in page and "a<b" not in page  # configs escaped
    assert "orchestrator.toml" in page and "inference.toml" not in page  # only the configs that exist

    step_5 = page[page.index("<h4>Step 5</h4>") : page.index("<h4>Step 0</h4>")]
    marked = re.findall(r"<mark class='trained'>(.*?)</mark>", step_5, re.S)
    assert marked == ["highlighted", html.escape(first), html.escape(second)]  # the legend, then both replies
    assert "<|im_end|>" not in page  # every text escaped
    assert "&lt;tool_response&gt;\n42" in step_5  # the tool result is shown, not highlighted
    assert "What is 6 x 7? Use &lt; and &gt;" in step_5  # the prompt, escaped

    step_0 = page[page.index("<h4>Step 0</h4>") :]
    assert "no longer on disk" in step_0 and "<mark class='trained'>I" not in step_0
    assert "I will compute 6 x 7.&lt;|im_end|&gt;" in step_0  # the row's decoded text instead


def test_report_without_a_tokenizer_shows_the_text(reported_run):
    run, _ = reported_run
    (configs_dir(run) / "orchestrator.toml").unlink()  # no model name: nothing to decode tokens with
    page = write_report(run, [("run", run)], []).read_text()
    assert "<mark class='trained'>I" not in page and "I will compute 6 x 7." in page
    assert "No metrics to plot yet." in page


def test_report_images_load_in_a_browser(reported_run, tmp_path):
    if not Path(CHROMIUM).is_file():  # .ci/run installs it: in CI its absence is a failure, not a skip
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)("needs chromium")
    run, _ = reported_run
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
    assert widths.group(1).split(",") == ["800"] * 9  # every plot loaded at its full width


def test_rl_writes_the_report_and_only_warns_when_it_cannot(runs, tmp_path, caplog):
    write_plots_or_warn(runs[0])
    assert (runs[0] / "plots" / "report.html").is_file()
    write_plots_or_warn(tmp_path / "not_a_run")  # does not raise: the run has succeeded
    assert "could not write the run's plots and report" in caplog.text
