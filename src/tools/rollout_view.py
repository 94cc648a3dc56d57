"""Rich renderings of checked rollouts: tokens coloured by role and loss mask, per-turn counts, conversations."""

import math
from itertools import groupby

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from contracts.chat_turns import CONTENT, END, ChatFormat, Segmentation
from contracts.sampling import NO_TRUNCATION
from tools.rollout_check import ERROR, SampleRecord, SampleReport, StepReport, StepRollouts

ROLE_COLORS = {"system": "magenta", "user": "blue", "tool": "yellow", "assistant": "green"}
OTHER_COLOR = "red"  # tokens outside turns and unknown roles
IMAGE_COLOR = "cyan"  # an image's placeholders


def role_color(role: str) -> str:
    return ROLE_COLORS.get(role, OTHER_COLOR)


def _visible(piece: str) -> str:
    """A token's text with its newlines shown (a trained newline must be visible)."""
    return piece.replace("\n", "↵\n")


def legend(brackets: bool = False) -> Text:
    if brackets:
        return Text("trained tokens are shown ⟦between brackets⟧ (colours show roles and the mask on a terminal)")
    text = Text("legend: ")
    for role, color in [*ROLE_COLORS.items(), ("outside", OTHER_COLOR)]:
        text.append(f" {role} ", style=f"bold black on {color}")
        text.append(" trained  ")
        text.append(role, style=f"dim {color}")
        text.append(" not trained  ")
    text.append(" flagged ", style="bold white on red")
    return text


def masked_tokens(report: SampleReport, chat: ChatFormat, brackets: bool = False) -> Text:
    """Every token of the sample: trained tokens on their role's colour, the rest dim, flagged ones in red.

    ``brackets`` also marks trained runs as ``⟦...⟧`` (for output without colours).
    """
    record, seg = report.record, report.segmentation
    flagged = {i for p in report.problems if p.severity == ERROR for i in p.positions}
    images = image_labels(record, report.image_runs)
    text = Text()
    previous = False
    i = 0
    while i < len(record.token_ids):
        end, piece = images.get(i, (i + 1, None))  # an image's placeholders show as one label
        trained = any(record.loss_mask[i:end])
        if brackets and trained != previous:
            text.append("⟦" if trained else "⟧", style="bold")
        previous = trained
        color = IMAGE_COLOR if piece is not None else role_color(seg.roles[i])
        if flagged.intersection(range(i, end)):
            style = "bold white on red"
        elif trained:
            style = f"black on {color}"
        else:
            style = f"dim {color}"
        text.append(piece or _visible(chat.piece(record.token_ids[i])), style=style)
        i = end
    if brackets and previous:
        text.append("⟧", style="bold")
    return text


def image_labels(record: SampleRecord, runs: list[tuple[int, int]]) -> dict[int, tuple[int, str]]:
    """Each image's placeholder run (``runs``), by its start: where it ends and its label, ``[image 3f2a9c01… 4
    tokens]`` (its ref, ``?`` when the sample names fewer images than it has runs)."""
    labels = {}
    for k, (start, length) in enumerate(runs):
        ref = f"{record.images[k][:8]}…" if k < len(record.images) else "?"
        labels[start] = (start + length, f"[image {ref} {length} tokens]")
    return labels


def turn_table(report: SampleReport) -> Table:
    table = Table(title="tokens per turn", title_justify="left", show_edge=False, pad_edge=False)
    for column in ("turn", "role", "tokens", "content", "trainable"):
        table.add_column(column, justify="right" if column != "role" else "left")
    for turn in report.turn_counts():
        table.add_row(
            str(turn["turn"]),
            Text(turn["role"] + ("" if turn["closed"] else " (unclosed)"), style=role_color(turn["role"])),
            str(turn["tokens"]),
            str(turn["content"]),
            str(turn["trainable"]),
        )
    return table


def role_line(report: SampleReport) -> Text:
    roles = ", ".join(f"{role} {c['trainable']}/{c['tokens']}" for role, c in report.role_counts().items())
    return Text(f"trainable/tokens by role: {roles}")


def sample_title(record: SampleRecord) -> str:
    """``sample 3 · micro_batch 0 · env · task · reward · advantage · ...`` from what batch.json recorded."""
    summary = record.summary
    parts = [f"sample {record.index}", f"{len(record.token_ids)} tokens"]
    if record.micro_batch >= 0:
        parts.insert(1, f"micro_batch {record.micro_batch}")
    for key in ("env", "task", "seat"):
        if key in summary:
            parts.append(f"{key} {summary[key]}")
    for key in ("reward", "advantage"):
        if isinstance(summary.get(key), int | float):
            parts.append(f"{key} {summary[key]:.4g}")
    if "weight_step" in summary:
        parts.append(f"weights step {summary['weight_step']}")
    if summary.get("truncated"):
        parts.append("truncated")
    return " · ".join(parts)


def problem_lines(report: SampleReport) -> Text:
    text = Text()
    for problem in report.problems:
        style = "red" if problem.severity == ERROR else "yellow"
        text.append(f"{problem.severity} {problem.check}: ", style=f"bold {style}")
        text.append(problem.message + "\n")
    return text


def mask_view(report: SampleReport, chat: ChatFormat, brackets: bool = False) -> Panel:
    """One sample for ``check_loss_mask``: its tokens by mask, its counts per turn, its problems."""
    parts = [masked_tokens(report, chat, brackets), Text(), turn_table(report), role_line(report)]
    if report.problems:
        parts += [Text(), problem_lines(report)]
    border = "red" if report.errors else "yellow" if report.problems else "green"
    return Panel(Group(*parts), title=sample_title(report.record), title_align="left", border_style=border)


def summary_line(report: StepReport) -> str:
    """One line for the operator: what was checked and what was found."""
    t = report.totals()
    share = t["trainable"] / t["tokens"] if t["tokens"] else 0.0
    images = f", {t['image_tokens']} image tokens in {t['images']} images" if t["images"] else ""
    head = (
        f"step {report.rollouts.step}: {t['samples']} samples, {t['tokens']} tokens, "
        f"{t['trainable']} trainable ({share:.1%}){images}, sampled at {sampling_text(report.rollouts.sampling)}"
    )
    if len(t["seats"]) > 1:  # several agents per rollout: each seat's share
        head += " (" + ", ".join(f"{seat}: {n['samples']} samples, {n['trainable']} trainable"
                                 for seat, n in t["seats"].items()) + ")"  # fmt: skip
    if report.ok:
        warned = f", {t['warnings']} warnings" if t["warnings"] else ""
        return f"{head}: loss masks OK{warned} ({report.rollouts.path})"
    bad = len({p.sample for p in report.all_problems() if p.severity == ERROR and p.sample is not None})
    by_check = ", ".join(f"{check} x{n}" for check, n in sorted(t["by_check"].items()))
    return f"{head}: {t['errors']} errors in {bad} samples [{by_check}] ({report.rollouts.path})"


def sampling_text(sampling: dict) -> str:
    """``StepRollouts.sampling`` in words: the temperature and each truncation that is on, which the trainer
    replays (docs/sampling.md)."""
    on = [
        f"{key} {value}" if key != "banned" else f"{len(value)} tokens banned"
        for key, value in sampling.items()
        if key != "temperature" and value not in (getattr(NO_TRUNCATION, key), [])
    ]
    return f"temperature {sampling['temperature']}" + (f", {', '.join(on)} (replayed)" if on else ", no truncation")


def report_json(report: StepReport, samples: list[int] | None = None) -> dict:
    """The report as one JSON document; ``samples`` limits the per-sample entries (the totals cover all)."""
    chosen = report.samples if samples is None else [report.samples[i] for i in samples]
    document = {
        "path": str(report.rollouts.path),
        "step": report.rollouts.step,
        "model": report.model,
        "ok": report.ok,
        "sampling": report.rollouts.sampling,
        **report.totals(),
        "batch_problems": [p.to_json() for p in report.problems],
        "sample_reports": [
            {
                "index": s.record.index,
                "micro_batch": s.record.micro_batch,
                "tokens": len(s.record.token_ids),
                "trainable": s.record.num_trainable,
                "images": s.record.images,
                "image_tokens": s.image_tokens,
                "summary": s.record.summary,
                "by_role": s.role_counts(),
                "turns": s.turn_counts(),
                "problems": [p.to_json() for p in s.problems],
            }
            for s in chosen
        ],
    }
    return _json_safe(document)


def _json_safe(value):
    """``value`` with non-finite floats (a NaN reward) as None, so the document is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def batch_problem_lines(report: StepReport) -> Text:
    text = Text()
    for problem in report.problems:
        text.append(f"{problem.severity} {problem.check}: ", style="bold red")
        text.append(problem.message + "\n")
    return text


# ── conversations (inspect_rollouts) ────────────────────────────────────────────────────────────────────


def step_overview(rollouts: StepRollouts) -> Text:
    info = rollouts.info
    parts = [f"step {rollouts.step}", f"{len(rollouts.samples)} samples"]
    if isinstance(info.get("reward_mean"), int | float):
        parts.append(f"reward mean {info['reward_mean']:.4g}")
    if "weight_steps" in info:
        parts.append(f"weights steps {info['weight_steps']}")
    parts.append(f"sampled at {sampling_text(rollouts.sampling)}")
    metrics = info.get("metrics") or {}
    parts += [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()]
    return Text(" · ".join(parts) + f"  ({rollouts.path})", style="bold")


def rewards_table(record: SampleRecord) -> Table | Text:
    summary = record.summary
    if not summary:
        return Text("batch.json records nothing about this sample (an older batch)", style="dim")
    table = Table(show_header=False, show_edge=False, pad_edge=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    for key in ("env", "task", "seat", "reward", "advantage", "weight_step", "truncated", "turns"):
        if key in summary:
            table.add_row(key, _format(summary[key]))
    for name, score in (summary.get("rewards") or {}).items():
        table.add_row(f"  reward {name}", _format(score))
    shown = {"env", "task", "seat", "reward", "advantage", "weight_step", "truncated", "turns", "rewards"}
    for key, value in summary.items():
        if key not in shown:
            table.add_row(key, _format(value))
    return table


def _format(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def conversation(record: SampleRecord, seg: Segmentation, chat: ChatFormat, brackets: bool = False) -> list[Panel]:
    """One panel per chat turn: its role, its decoded content (each image as one label), the trained part
    highlighted (or ``⟦...⟧``)."""
    images = image_labels(record, chat.image_runs(record.token_ids))
    panels = []
    spans = [(t.role, t.index, t.start, t.end, t.content_start) for t in seg.turns]
    if not spans:  # not chat-formatted: show the whole sample as one block
        spans = [("outside", 0, 0, len(record.token_ids), 0)]
    for role, index, start, end, content_start in spans:
        shown = [i for i in range(content_start, end) if role == "outside" or seg.parts[i] in (CONTENT, END)]
        text = Text()
        for trained, run in groupby(shown, key=lambda i: i < len(record.loss_mask) and record.loss_mask[i]):
            style = f"bold {role_color(role)}" if trained else ""
            for image, pieces in groupby(run, key=lambda i: _image_at(images, i)):
                if image is not None:
                    text.append(images[image][1], style=IMAGE_COLOR)
                    continue
                words = chat.text([record.token_ids[i] for i in pieces])
                text.append(f"⟦{words}⟧" if trained and brackets else words, style=style)
        trained = sum(record.loss_mask[start:end])
        title = f"{role} (turn {index}, tokens {start}..{end - 1}, {trained} trained)"
        panels.append(Panel(text, title=title, title_align="left", border_style=role_color(role)))
    return panels


def _image_at(images: dict[int, tuple[int, str]], i: int) -> int | None:
    """The start of the image run (of :func:`image_labels`) that position ``i`` is in, or None."""
    return next((start for start, (end, _) in images.items() if start <= i < end), None)


def conversation_view(record: SampleRecord, seg: Segmentation, chat: ChatFormat, brackets: bool = False) -> Panel:
    body = Group(rewards_table(record), *conversation(record, seg, chat, brackets))
    return Panel(body, title=sample_title(record), title_align="left")
