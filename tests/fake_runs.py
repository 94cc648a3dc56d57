"""Fake runs for the tests of trident-plot and its HTML report: metrics of a run whose reward rises step by step, and
a run with configs and sample rollouts (one step's batch still on disk) to report on."""

from pathlib import Path

from transformers import AutoTokenizer

from contracts.metrics import MetricsWriter
from contracts.model_path import TINY_MODEL_ID
from contracts.protocol import BatchInfo, MicroBatch, Sample, sample_summary, write_batch
from contracts.run_dir import configs_dir

STEPS = 6


def fake_run(output_dir: Path, reward_start: float, with_entropy: bool = True, with_evals: bool = True) -> Path:
    """Metrics of a run whose reward rises by 0.1 a step from ``reward_start``."""
    trainer, orchestrator = MetricsWriter(output_dir, "trainer"), MetricsWriter(output_dir, "orchestrator")
    for step in range(STEPS):
        record = {
            "step": step,
            "reward_mean": reward_start + 0.1 * step,
            "truncated_rate": 0.5 - 0.05 * step,
            "completion_len_mean": 20.0 + step,
            "completion_len_max": 40 + 2 * step,
            "rollouts_per_s": 3.0,
            "sampled_tokens_per_s": 100.0 + step,
            "reward/correct": 0.1 * step,  # each reward function's mean score, a judge's among them
            "reward/judge": 0.5,
        }
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
    meta = {"env": "calc", "task": "t1", "seat": "solver"}
    sample = Sample(token_ids, mask, [-0.5 if m else 0.0 for m in mask], 0.25, 1.0, step, meta)
    prompt_len = mask.index(True)
    row = {"step": step, **meta, "prompt": tokenizer.decode(token_ids[:prompt_len], skip_special_tokens=False),
           "completion": tokenizer.decode(token_ids[prompt_len:], skip_special_tokens=False), "reward": 1.0,
           "rewards": {"correct": 1.0, "judge": 0.0}, "advantage": 0.25, "truncated": False}  # fmt: skip
    MetricsWriter(output_dir, "orchestrator").write_table("sample_rollouts", step, [row])
    if keep_batch:
        info = BatchInfo(step, 1, len(token_ids), sum(mask), 1.0, 1.0, [step], samples=[sample_summary(sample)])
        write_batch(output_dir, info, [MicroBatch.pack([sample])])
    return first, second


def fake_reported_run(output_dir: Path, tiny_model_path: str) -> tuple[Path, tuple[str, str]]:
    """A fake run with configs, an old sample step whose batch is gone and a last one whose batch is on disk; also
    the texts of the last step's two replies."""
    run = fake_run(output_dir, 0.1)
    configs_dir(run).mkdir()
    (configs_dir(run) / "orchestrator.toml").write_text(f'[model]\nname = "{TINY_MODEL_ID}"\n')
    (configs_dir(run) / "trainer.toml").write_text('[wandb]\nname = "a<b & c>"\n')
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    write_rollouts(run, tokenizer, 0, keep_batch=False)
    return run, write_rollouts(run, tokenizer, 5, keep_batch=True)
