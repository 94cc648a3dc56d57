"""A step has one number everywhere: step N is the N-th optimizer update, 1..max_steps, in the batch folders, both
processes' metrics, the sample rollouts, the weights and checkpoints, the console line, the plots and the report."""

import asyncio

import httpx
from rollouts import group, sampled

import orchestrator.loop.groups as groups_module
from contracts.metrics import read_metrics
from contracts.protocol import read_batch
from contracts.run_dir import complete_checkpoints, configs_dir, rollouts_dir, step_dirs
from launch.launcher import step_line
from orchestrator.config import OrchestratorConfig
from orchestrator.loop.run import Orchestrator
from tools.plots import load_run, write_plots
from tools.report import write_report
from tools.rollout_check import read_step
from trainer.config import TrainerConfig
from trainer.train import train

MAX_STEPS = 3


def test_a_run_numbers_its_steps_1_to_max_steps_everywhere(tmp_path, monkeypatch, tiny_model_path):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    shared = {"output_dir": tmp_path, "max_steps": MAX_STEPS, "ckpt": {"interval": 2}}
    # async_level 2: no step waits for trained weights, so the orchestrator runs first, the trainer after
    config = OrchestratorConfig(
        **shared, model={"name": tiny_model_path}, batch_size=2, rollouts_per_example=2, async_level=2,
        sample_rollouts_every=2,
    )  # fmt: skip
    orchestrator = Orchestrator(config)
    served = {"step": 0, "path": "/base", "adapter": None, "seconds": 0.0}  # the server's answer to every route
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=served))
    orchestrator.servers.servers[0].client.http = httpx.AsyncClient(base_url="http://server", transport=transport)
    prompt = orchestrator.tokenizer.encode("<|im_start|>user\nReverse: abc<|im_end|>\n<|im_start|>assistant\n")
    reply = orchestrator.tokenizer.encode("cba<|im_end|>")

    async def run_group(env, task, n, ctx, limit, output_dir):
        branch = sampled(prompt + reply, len(prompt), [-7.6] * len(reply))  # the server's logprobs of the sampled
        return group(range(n), branch, env="reverse-text")

    monkeypatch.setattr(groups_module, "run_group", run_group)
    asyncio.run(orchestrator.run())
    train(TrainerConfig(**shared, model={"name": tiny_model_path}))

    steps = list(range(1, MAX_STEPS + 1))
    assert list(step_dirs(tmp_path / "rollouts")) == steps  # rollouts/step_N: the batch step N trains on
    assert [read_batch(tmp_path, step)[0].step for step in steps] == steps
    assert read_step(tmp_path).step == MAX_STEPS  # what the rollout tools' --step reads
    trainer, orch = read_metrics(tmp_path, "trainer"), read_metrics(tmp_path, "orchestrator")
    assert [r["step"] for r in trainer] == [r["step"] for r in orch] == steps
    assert [r["step"] for r in read_metrics(tmp_path, "sample_rollouts")] == [1, 1, 3, 3]  # every 2 steps, from 1
    assert [r["staleness"] for r in orch] == [0, 1, 2]  # all sampled by weights 0: step N - 1 is on-policy
    assert list(step_dirs(tmp_path / "weights")) == steps  # weights N: the result of step N
    assert complete_checkpoints(tmp_path) == [2, 3]  # after steps 2 and 3 (the last)
    lines = [step_line(r, o, MAX_STEPS) for r, o in zip(trainer, orch, strict=True)]
    assert [line.split(" | ")[0] for line in lines] == ["step 1/3", "step 2/3", "step 3/3"]

    written = write_plots([load_run(tmp_path)], tmp_path / "plots")
    x_values = {plot.name: [x for x, _ in plot.series.values()] for plot in written}
    assert {"reward", "loss"} <= set(x_values)
    assert all(x == steps for xs in x_values.values() for x in xs), x_values  # every line of every plot
    configs_dir(tmp_path).mkdir()  # as rl writes it: the report reads the run's tokenizer from it
    (configs_dir(tmp_path) / "orchestrator.toml").write_text(f'[model]\nname = "{tiny_model_path}"\n')
    page = write_report(tmp_path / "plots", [("run", tmp_path)], [plot.path for plot in written]).read_text()
    assert "<h4>Step 3</h4>" in page and "<h4>Step 1</h4>" in page
    assert rollouts_dir(tmp_path, 3).is_dir() and "<mark class='trained'>" in page  # step 3's batch, highlighted
