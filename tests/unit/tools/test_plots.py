"""trident-plot: PNGs of two fake runs' metrics, checked for content and axis ranges; the HTML report. Its command
line's errors and the report in a browser (each run in a process of their own) are checked in
tests/integration/test_plots_cli.py."""

import html
import re
from pathlib import Path

import pytest
from fake_runs import STEPS, fake_reported_run, fake_run
from matplotlib.figure import Figure
from matplotlib.image import imread
from rollouts import rollout

from contracts.metrics import MetricsWriter
from contracts.run_dir import configs_dir
from launch.supervise import write_plots_or_warn
from orchestrator.metrics.failed_rollouts import write_failed_rollouts
from tools.plots import draw, eval_spec, load_run, plot_runs, seats_spec, write_plots
from tools.report import write_report


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
    assert set(plots) == {"reward", "reward_functions", "eval", "loss", "entropy", "mismatch", "lengths",
                          "truncation", "rollouts_per_s", "tokens_per_s"}  # fmt: skip
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
    components = plots["reward_functions"].series  # what reward_mean is made of, a judge's verdicts among them
    assert set(components) == {f"{run} reward/{name}" for run in ("run_a", "run_b") for name in ("correct", "judge")}
    assert components["run_a reward/judge"] == (list(range(STEPS)), [0.5] * STEPS)
    assert plots["eval"].series["run_b"][0] == [0, 2, 4]  # one key: labelled by run
    assert len(plots["eval"].series) == 2  # a line per run: neither failures nor seconds are scores


def test_a_multi_agent_run_has_a_plot_of_each_seats_reward(tmp_path):
    run = fake_run(tmp_path / "duel", 0.1)
    writer = MetricsWriter(run, "orchestrator")
    for step in range(STEPS, STEPS + 2):
        writer.write({"step": step, "seat/player0/reward_mean": 0.5, "seat/player1/reward_mean": -0.5,
                      "seat/player1/sampled_tokens": 4, "env/duel/seat/player0/reward_mean": 0.5})  # fmt: skip
    writer.write_eval({"step": STEPS, "eval/duel/player0/pass@4": 0.5, "eval/duel/player0/failed": 1})
    runs, out = [load_run(run)], tmp_path / "out"
    out.mkdir()
    plots = {spec.name: draw(spec, runs, out) for spec in (seats_spec(runs), eval_spec(runs))}  # as write_plots does
    assert plots["seats"].series == {
        "seat/player0/reward_mean": ([STEPS, STEPS + 1], [0.5, 0.5]),
        "seat/player1/reward_mean": ([STEPS, STEPS + 1], [-0.5, -0.5]),
    }
    assert_not_blank(plots["seats"].path)
    assert set(plots["eval"].series) == {"eval/gsm8k/reward_mean", "eval/duel/player0/pass@4"}  # a seat's score too


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


def test_default_out_is_the_first_runs_plots_folder(runs):
    report = plot_runs(runs)
    assert report == runs[0] / "plots" / "report.html"
    assert (runs[0] / "plots" / "reward.png").is_file()


# ── the HTML report ─────────────────────────────────────────────────────────────────────────────────────


@pytest.fixture
def reported_run(tmp_path, tiny_model_path) -> tuple[Path, tuple[str, str]]:
    """:func:`fake_runs.fake_reported_run` in the test's folder."""
    return fake_reported_run(tmp_path / "run", tiny_model_path)


def test_report_has_images_configs_and_highlighted_trained_tokens(reported_run):
    run, (first, second) = reported_run
    report = plot_runs([run])
    page = report.read_text()
    images = re.findall(r"<img src='([^']+)'", page)
    assert "reward.png" in images and "reward_functions.png" in images and len(images) == 10
    assert all((report.parent / image).is_file() for image in images)  # relative to the report
    assert "name = &quot;a&lt;b &amp; c&gt;&quot;" in page and "a<b" not in page  # configs escaped
    assert "orchestrator.toml" in page and "inference.toml" not in page  # only the configs that exist

    step_5 = page[page.index("<h4>Step 5</h4>") : page.index("<h4>Step 0</h4>")]
    marked = re.findall(r"<mark class='trained'>(.*?)</mark>", step_5, re.S)
    assert marked == ["highlighted", html.escape(first), html.escape(second)]  # the legend, then both replies
    assert "<|im_end|>" not in page  # every text escaped
    assert "&lt;tool_response&gt;\n42" in step_5  # the tool result is shown, not highlighted
    assert "What is 6 x 7? Use &lt; and &gt;" in step_5  # the prompt, escaped
    assert "rewards: correct 1, judge 0" in step_5  # each reward function's score: the judge said no
    assert "task t1 · seat solver · reward 1" in step_5  # the seat of the environment that played it

    step_0 = page[page.index("<h4>Step 0</h4>") :]
    assert "no longer on disk" in step_0 and "<mark class='trained'>I" not in step_0
    assert "I will compute 6 x 7.&lt;|im_end|&gt;" in step_0  # the row's decoded text instead


def test_report_without_a_tokenizer_shows_the_text(reported_run):
    run, _ = reported_run
    (configs_dir(run) / "orchestrator.toml").unlink()  # no model name: nothing to decode tokens with
    page = write_report(run, [("run", run)], []).read_text()
    assert "<mark class='trained'>I" not in page and "I will compute 6 x 7." in page
    assert "No metrics to plot yet." in page and "Failed rollouts" not in page  # none failed: no section


def test_report_counts_failed_rollouts_by_cause_with_the_first_full_error(tmp_path):
    run = fake_run(tmp_path / "run", 0.1)
    git = "HarnessError: exited 128: Cloning into '/tmp/tmp{}/repo'...\nfatal: repository <r> not found\n"
    stack = 'Traceback (most recent call last):\n  File "<harness>", line 1\nHarnessError: exited 128'
    for step in (2, 3):
        failed = [rollout(0.0, ok=False, error=git.format(f"{step}{i}"), env="swe", task=f"t{i}", traceback=stack)
                  for i in range(2)]  # fmt: skip
        write_failed_rollouts(run, step, [failed, [rollout(0.0, ok=False, error="TaskError: no data", env="swe")]])
    held_out = rollout(0.0, ok=False, error="TaskError: no data", env="swe-eval", task="e0")
    write_failed_rollouts(run, 2, [[held_out]], evaluation=True)
    page = write_report(run, [("run", run)], []).read_text()
    section = page[page.index("<h3>Failed rollouts</h3>") :]
    assert "<p>7 failed rollouts, 3 causes</p>" in section
    assert "<td>4</td><td>HarnessError: fatal: repository &lt;r&gt; not found</td><td>2..3</td>" in section
    assert "<td>2</td><td>TaskError: no data</td><td>2..3</td>" in section
    assert "<td>1</td><td>TaskError: no data (in evaluation)</td><td>2</td>" in section  # an evaluation's, apart
    first = html.escape(f"{git.format('20').rstrip()}\n{stack}")
    assert f"the first, step 2 · env swe · task t0</summary><pre>{first}</pre>" in section  # in full, escaped
    assert "the first, evaluation of weights step 2 · env swe-eval · task e0</summary>" in section


def test_rl_writes_the_report_and_only_warns_when_it_cannot(runs, tmp_path, caplog):
    write_plots_or_warn(runs[0])
    assert (runs[0] / "plots" / "report.html").is_file()
    write_plots_or_warn(tmp_path / "not_a_run")  # does not raise: the run has succeeded
    assert "could not write the run's plots and report" in caplog.text


def test_a_sweeps_folder_compares_its_runs_in_one_report(tmp_path):
    sweep = tmp_path / "sweep"
    fake_run(sweep / "lr=1e-05", 0.1)
    fake_run(sweep / "lr=0.0001", 0.3)
    (sweep / "lr=0.0001" / "summary.json").write_text('{"status": "failed"}')
    (sweep / "logs").mkdir()  # the sweep's own folders hold no run
    report = plot_runs([sweep])
    assert report == sweep / "plots" / "report.html"
    page = report.read_text()
    rows = re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td><td>(\d+)</td><td>(.*?)</td><td>(.*?)</td></tr>", page)
    assert [(run, status, steps) for run, status, steps, _, _ in rows] == [
        ("lr=0.0001", "failed", "6"),  # by name
        ("lr=1e-05", "-", "6"),  # no summary.json
    ]
    assert [float(last) for *_, last, _ in rows] == pytest.approx([0.3 + 0.5, 0.1 + 0.5])
    assert "<h2>Run lr=1e-05</h2>" in page and "<h2>Run lr=0.0001</h2>" in page
