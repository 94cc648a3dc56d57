"""One orchestrator step with hand-made rollouts in place of a server: what it logs, checked against the docs."""

import asyncio
import json
import re
from pathlib import Path

import httpx
from rollouts import rollout, sampled
from wandb_runs import finished_run

import orchestrator.loop.groups as groups_module
from contracts.metrics import read_metrics
from contracts.shared_config import WandbConfig
from orchestrator.config import OrchestratorConfig
from orchestrator.loop.run import Orchestrator

METRICS_DOC = Path(__file__).parents[3] / "docs" / "metrics.md"


def documented_keys(process: str) -> set[str]:
    """The keys in the table of ``process``'s section of docs/metrics.md."""
    section = METRICS_DOC.read_text().split(f"## {process}\n")[1].split("\n## ")[0]
    return set(re.findall(r"^\| `([^`]+)` \|", section, flags=re.M))


def test_a_step_logs_every_documented_key_and_a_table_of_sample_rollouts(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    config = OrchestratorConfig(  # with refill on, as its refill/* keys are documented too (no group ties here)
        output_dir=tmp_path,
        batch_size=2,
        rollouts_per_example=2,
        wandb=WandbConfig(name="run", offline=True),
        filter={"refill": True},
    )
    orchestrator = Orchestrator(config)
    served = {"step": 0, "path": "/base", "adapter": None}  # what the server's GET /weights says
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=served))
    orchestrator.servers.servers[0].client.http = httpx.AsyncClient(base_url="http://server", transport=transport)
    prompt = orchestrator.tokenizer.encode("<|im_start|>user\nReverse: abc<|im_end|>\n<|im_start|>assistant\n")
    reply = orchestrator.tokenizer.encode("cba<|im_end|>")

    async def run_group(env, task, n, ctx, limit, output_dir):
        branch = sampled(prompt + reply, len(prompt), [0.0] * len(reply))
        return [rollout(float(i), branch, rewards={"similarity": float(i)}, metrics={"edits": 2.0 * i}, turns=1,
                        env="reverse-text", setup_s=0.25) for i in range(n)]  # fmt: skip

    monkeypatch.setattr(groups_module, "run_group", run_group)
    asyncio.run(orchestrator.step(1))
    orchestrator.metrics.close()

    (record,) = read_metrics(tmp_path, "orchestrator")
    documented = documented_keys("Orchestrator")
    expected = {
        k.replace("<function>", "similarity").replace("<name>", "edits").replace("<env>", "reverse-text")
        for k in documented
        if not k.startswith("running_baseline/")
    } - {
        "probe_gap",
        "failed/<type>",
        "stream_tasks_held",
        "reverse_kl/reverse-text",
        *(k for k in documented if k.startswith(("seat/", "share/"))),
    }
    # probe_gap comes with the first reload, failed/<type> with a failed rollout, stream_tasks_held with a task
    # stream, seat/<seat>/* with several seats, share/* with a run id (test_shared_server.py), running_baseline/*
    # with a running baseline (test_running_baseline.py), reverse_kl/<env> with an environment on opd (test_distill.py)
    assert set(record) == expected
    assert record["prompt_len_max"] == len(prompt) and record["completion_len_max"] == len(reply)
    assert record["reward/similarity"] == 0.5 and record["advantage_max"] == 0.5 and record["metric/edits"] == 1.0
    assert (
        record["refill/groups"] == 0
        and record["refill/attempts_max"] == 1
        and record["refill/first_reward_mean"] == 0.5
    )

    (run_dir,) = tmp_path.glob("wandb/offline-run-*")
    data = finished_run(run_dir)
    assert [key for key in expected - {"step"} if key.encode() not in data] == []

    rows = read_metrics(tmp_path, "sample_rollouts")
    assert [(r["step"], r["reward"], r["advantage"]) for r in rows] == [(1, 0.0, -0.5), (1, 1.0, 0.5)]
    assert rows[0]["prompt"].endswith("Reverse: abc<|im_end|>\n<|im_start|>assistant\n")
    assert rows[0]["completion"] == "cba<|im_end|>"
    (table_file,) = run_dir.glob("files/media/table/sample_rollouts_1_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == list(rows[0]) and table["data"] == [list(r.values()) for r in rows]
