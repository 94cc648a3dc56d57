"""Read a step's rollouts back into per-sample records and check their loss masks against the chat format.

The operator's tools (``scripts/check_loss_mask.py``, ``scripts/inspect_rollouts.py``, ``scripts/verify_env.py``)
share this module. The batch itself is checked by the trainer's own reader (:func:`contracts.protocol.read_batch`);
its sound micro-batches are split back into samples (:meth:`contracts.protocol.MicroBatch.samples`). Each sample's
tokens are cut into chat turns at its chat family's markers (:class:`contracts.chat_turns.ChatFormat` over a
:class:`contracts.chat_family.ChatFamily`: ChatML's ``<|im_start|>ROLE\\n ... <|im_end|>``, Llama 3's header turns,
or any family's entry), and the loss mask must cover sampled tokens only: assistant content after the header and
the generation-prompt scaffold, up to and including the turn end (``<|im_end|>``, ``<|eot_id|>``) the model sampled.
A vision-language family's image placeholders (``<|image_pad|>``, N per image) are prompt tokens: each run of them
is one image, which the micro-batch names by ref (:attr:`contracts.protocol.Sample.images`).

Checks (``Problem.check``), errors unless marked:

- ``trainer_rejects``: the trainer's reader refuses the batch (missing or extra tensors, other dtypes, lengths or
  positions that disagree, NaN or infinite advantages or logprobs, counts ``batch.json`` gets wrong, ...): the run
  would stop there. A micro-batch whose tensors cannot be split into samples is not checked further.
- ``sample_count_mismatch``: ``batch.json``'s per-sample records (``samples``) disagree in number with the tensors.
- ``advantage_mismatch``: a sample's advantage is not constant or differs from ``batch.json``; for a distilled
  sample (``algorithm = "opd"`` in ``batch.json``, one advantage per token), one on an untrained token or a mean
  over its trained tokens that differs from ``batch.json``'s.
- ``empty_mask``: a sample with no trainable token (sampled, or with a cross-entropy weight).
- ``ce_on_<part>`` (``first_token``, ``template``, ``image``, ``outside_turn``): cross-entropy weights
  (:attr:`contracts.protocol.Sample.ce_weights`) where the sample must not train: its first token (no context to
  score it from), a turn's header or template, image placeholders, outside any turn; ``ce_in_<role>_turn``: in a turn
  of a role its algorithm does not train by cross-entropy (``ce_roles`` in ``batch.json``: ECHO's environment roles,
  distillation's ``assistant``).
- ``missing_logprob``: trained tokens whose inference logprob is not finite or positive, or is exactly 0.0 across
  a whole run of trained tokens (a lone 0.0 among real logprobs is the warning ``zero_logprob``: vLLM reports 0.0
  for tokens sampled with probability 1, e.g. under structured outputs).
- ``token_out_of_vocab``: an id the tokenizer does not have (usually the wrong ``--model``).
- ``mask_in_<role>_turn`` (``system``, ``user``, ``tool``, ...): trainable tokens in a turn the model did not write.
- ``mask_outside_turn``: trainable tokens outside any chat turn.
- ``mask_on_template``: trainable template tokens of an assistant turn: its header, the generation-prompt
  scaffold (Qwen3's empty ``<think>\\n\\n</think>\\n\\n``), the whitespace after the turn end, a turn end the
  server added after a sampled end-of-text token.
- ``mask_on_image``: trainable image placeholder tokens (reported as such, not by the turn they sit in).
- ``image_count_mismatch``: a sample's placeholder runs and the images its micro-batch names differ in number: the
  trainer would put images at the wrong tokens.
- ``image_missing``: an image the batch names is not in the run's image store (``images/<ref>``).
- warnings: ``zero_logprob`` (above), ``mask_gap`` (untrained tokens before or inside a trained assistant reply),
  ``stop_token_in_reply`` (a stop token such as ``<|endoftext|>`` the model sampled and then sampled more after, in
  a reply that goes on to its turn end: a server whose generation config stops only at the turn end),
  ``unmasked_turn_end`` (a trained reply whose closing turn end is not trained), ``no_chat_format`` (no turn start
  in the sample: roles cannot be checked).
"""

import json
import math
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from safetensors.torch import load_file

from contracts.chat_family import FAMILIES
from contracts.chat_turns import (
    CONTENT,
    END,
    HEADER,
    OUTSIDE,
    SCAFFOLD,
    SEPARATOR,
    ChatFormat,
    ChatFormatError,
    Segmentation,
    segment,
)
from contracts.errors import TridentError
from contracts.images import image_path
from contracts.protocol import (
    CE_WEIGHTS_DTYPE,
    MICRO_BATCH_DTYPES,
    BatchError,
    MicroBatch,
    images_metadata,
    micro_batch_paths,
    read_batch,
)
from contracts.run_dir import configs_dir, rollouts_dir, step_dirs
from contracts.sampling import NO_TRUNCATION
from orchestrator.config import DISTILLED

ERROR, WARNING = "error", "warning"
# Token parts: where a token sits in its turn. Only assistant "content" and "end" tokens may be trainable. END is
# the turn end (or, in a reply, another stop token) closing the content; SEPARATOR the template after it: the
# whitespace, and a turn end the server adds after a sampled stop token.
MAX_POSITIONS = 20  # positions listed per problem in messages and JSON


class RolloutReadError(TridentError):
    """A rollouts folder that is missing or cannot be read: the tools print it as one line and exit 2."""


# ── reading ─────────────────────────────────────────────────────────────────────────────────────────────


@dataclass
class Problem:
    check: str
    message: str
    severity: str = ERROR
    sample: int | None = None  # None: the whole batch
    positions: list[int] = field(default_factory=list)  # token offsets within the sample

    def to_json(self) -> dict:
        return {
            "check": self.check,
            "severity": self.severity,
            "sample": self.sample,
            "message": self.message,
            "positions": self.positions[:MAX_POSITIONS],
            "num_positions": len(self.positions),
        }


@dataclass
class SampleRecord:
    """One sample cut back out of its micro-batch, with what ``batch.json`` says about it (``summary``)."""

    index: int  # in packed order over the whole step
    micro_batch: int
    token_ids: list[int]
    loss_mask: list[bool]
    inference_logprobs: list[float]
    advantages: list[float]
    position_ids: list[int]
    summary: dict = field(default_factory=dict)  # reward, advantage, weight_step, env, task, rewards, ...
    images: list[str] = field(default_factory=list)  # refs of its images, one per placeholder run, in order
    ce_weights: list[float] = field(default_factory=list)  # per token, where its micro-batch has them; else empty

    @property
    def num_trainable(self) -> int:
        return sum(self.loss_mask)

    @classmethod
    def from_tokens(
        cls,
        index: int,
        token_ids: list[int],
        loss_mask: list[bool],
        logprobs: list[float],
        summary: dict | None = None,
        images: list[str] | None = None,
    ) -> "SampleRecord":
        """A record of a sample that was never packed (e.g. a rollout's branch, straight from the environment)."""
        n = len(token_ids)
        return cls(index, -1, list(token_ids), list(loss_mask), list(logprobs), [0.0] * n, list(range(n)),
                   summary or {}, list(images or []))  # fmt: skip


@dataclass
class StepRollouts:
    path: Path
    step: int
    info: dict  # batch.json as written (old batches may lack keys)
    samples: list[SampleRecord]  # those of the micro-batches that split into samples

    @property
    def sampling(self) -> dict:
        """How the server sampled the batch's tokens, which the trainer replays: ``temperature`` and the
        truncation's ``top_p``, ``top_k``, ``min_p``, ``banned`` (a batch from before they existed: none)."""
        truncation = self.info.get("truncation")
        recorded = truncation if isinstance(truncation, dict) else {}
        return (
            {"temperature": self.info.get("temperature")}
            | {key: recorded.get(key, getattr(NO_TRUNCATION, key)) for key in ("top_p", "top_k", "min_p")}
            | {"banned": list(recorded.get("banned", ()))}
        )


def rollout_steps(output_dir: Path) -> list[int]:
    """Steps with a complete ``rollouts/step_N/`` folder, ascending."""
    return [step for step, path in step_dirs(Path(output_dir) / "rollouts").items() if path.is_dir()]


def read_step(output_dir: Path, step: int | None = None) -> StepRollouts:
    """Read ``rollouts/step_N/`` (the newest step when ``step`` is None) into per-sample records."""
    root = Path(output_dir) / "rollouts"
    if not root.is_dir():
        raise RolloutReadError(f"no rollouts folder at {root} (is --output-dir the run's output_dir?)")
    steps = rollout_steps(output_dir)
    if step is None:
        if not steps:
            raise RolloutReadError(f"no rollouts/step_N folders in {root}")
        step = steps[-1]
    folder = rollouts_dir(output_dir, step)
    if not folder.is_dir():
        have = f"steps on disk: {steps[0]}..{steps[-1]}" if steps else "no steps on disk"
        raise RolloutReadError(f"no rollouts for step {step}: {folder} does not exist ({have})")
    info_path = folder / "batch.json"
    try:
        info = json.loads(info_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RolloutReadError(f"cannot read {info_path}: {e}") from None
    if not isinstance(info, dict):
        raise RolloutReadError(f"{info_path} holds {type(info).__name__}, expected a JSON object")
    files = micro_batch_paths(folder)
    if not files:
        raise RolloutReadError(f"no micro_batch_*.safetensors files in {folder}")
    summaries = info.get("samples") if isinstance(info.get("samples"), list) else []
    samples: list[SampleRecord] = []
    index = 0  # of the micro-batch's first sample over the whole step
    for k, path in enumerate(files):
        try:
            tensors = load_file(path)
        except Exception as e:  # safetensors raises several types for a damaged file
            raise RolloutReadError(f"cannot read {path}: {e}") from None
        samples += _split_micro_batch(k, tensors, index, summaries, _images_of(path))
        index += len(tensors["sample_lengths"]) if "sample_lengths" in tensors else 0
    return StepRollouts(folder, step, info, samples)


def _images_of(path: Path) -> list[list[str]] | None:
    """The image refs a micro-batch file names per sample; None when it names none, or names them so that the
    trainer's reader refuses it (``trainer_rejects`` says why)."""
    try:
        return images_metadata(path)
    except BatchError:
        return None


def _split_micro_batch(
    k: int, tensors: dict, first_index: int, summaries: list, images: list[list[str]] | None
) -> list[SampleRecord]:
    """The samples of a micro-batch, read as the protocol's dtypes (so that float or NaN ids still split), with the
    image refs of each (``images``); none when a tensor is missing or the layout does not split (the trainer's
    reader names the fault: ``trainer_rejects``)."""
    if set(MICRO_BATCH_DTYPES) - set(tensors):
        return []
    micro_batch = MicroBatch(**{key: tensors[key].to(dtype).flatten() for key, dtype in MICRO_BATCH_DTYPES.items()})
    if "ce_weights" in tensors:
        micro_batch.ce_weights = tensors["ce_weights"].to(CE_WEIGHTS_DTYPE).flatten()
    if micro_batch.layout_problem():
        return []
    records = []
    for j, sample in enumerate(micro_batch.samples()):
        index = first_index + j
        summary = summaries[index] if index < len(summaries) and isinstance(summaries[index], dict) else {}
        records.append(
            SampleRecord(
                index=index,
                micro_batch=k,
                token_ids=sample.input_ids.tolist(),
                loss_mask=sample.loss_mask.tolist(),
                inference_logprobs=sample.inference_logprobs.tolist(),
                advantages=sample.advantages.tolist(),
                position_ids=sample.position_ids.tolist(),
                summary=summary,
                images=list(images[j]) if images and j < len(images) else [],
                ce_weights=sample.ce_weights.tolist() if sample.ce_weights is not None else [],
            )
        )
    return records


def run_model_setting(output_dir: Path, key: str) -> str | None:
    """A ``[model]`` value the run's orchestrator used (``configs/orchestrator.toml``), if recorded."""
    path = configs_dir(output_dir) / "orchestrator.toml"
    try:
        with path.open("rb") as f:
            value = tomllib.load(f).get("model", {}).get(key)
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return value if isinstance(value, str) else None


def load_tokenizer(output_dir: Path, model: str | None = None):
    """The tokenizer of ``model``, else of the run's model; a one-line :class:`RolloutReadError` if neither loads."""
    from transformers import AutoTokenizer

    from tools.tiny_model import built_model_path

    name = model or run_model_setting(output_dir, "name")
    if name is None:
        path = configs_dir(output_dir) / "orchestrator.toml"
        raise RolloutReadError(f"no model name in {path}: pass --model NAME_OR_PATH (the run's [model] name)")
    try:
        return AutoTokenizer.from_pretrained(built_model_path(name))
    except Exception as e:  # transformers raises OSError, ValueError, ... for a missing or broken tokenizer
        raise RolloutReadError(f"cannot load the tokenizer of model {name!r}: {e}") from None


# ── segmenting tokens into chat turns ───────────────────────────────────────────────────────────────────


@dataclass
class SampleReport:
    record: SampleRecord
    segmentation: Segmentation
    problems: list[Problem]
    image_runs: list[tuple[int, int]] = field(default_factory=list)  # (start, length) of each image's placeholders

    @property
    def image_tokens(self) -> int:
        return sum(length for _, length in self.image_runs)

    def role_counts(self) -> dict[str, dict[str, int]]:
        """Per role: tokens and trainable tokens (roles in the order they first appear)."""
        counts: dict[str, dict[str, int]] = {}
        for role, trainable in zip(self.segmentation.roles, self.record.loss_mask, strict=False):
            entry = counts.setdefault(role, {"tokens": 0, "trainable": 0})
            entry["tokens"] += 1
            entry["trainable"] += trainable
        return counts

    def turn_counts(self) -> list[dict]:
        """Per turn: role, span, tokens, content tokens and trainable tokens."""
        mask = self.record.loss_mask
        out = []
        for turn in self.segmentation.turns:
            span = range(turn.start, min(turn.end, len(mask)))
            out.append(
                {
                    "turn": turn.index,
                    "role": turn.role,
                    "start": turn.start,
                    "end": turn.end,
                    "tokens": turn.end - turn.start,
                    "content": sum(self.segmentation.parts[j] in (CONTENT, END) for j in range(turn.start, turn.end)),
                    "trainable": sum(mask[j] for j in span),
                    "closed": turn.closed,
                }
            )
        return out

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == ERROR]


@dataclass
class StepReport:
    rollouts: StepRollouts
    samples: list[SampleReport]
    problems: list[Problem]  # about the whole batch
    model: str = ""  # the tokenizer the tokens were read with

    def all_problems(self) -> list[Problem]:
        return self.problems + [p for s in self.samples for p in s.problems]

    @property
    def num_errors(self) -> int:
        return sum(p.severity == ERROR for p in self.all_problems())

    @property
    def num_warnings(self) -> int:
        return sum(p.severity == WARNING for p in self.all_problems())

    @property
    def ok(self) -> bool:
        return self.num_errors == 0

    def seat_counts(self) -> dict[str, dict[str, int]]:
        """Per seat of the environment that played them (batch.json's ``seat``, in order of first appearance):
        samples and trainable tokens. Samples of a batch that records no seat count under ``""``."""
        counts: dict[str, dict[str, int]] = {}
        for s in self.samples:
            entry = counts.setdefault(str(s.record.summary.get("seat", "")), {"samples": 0, "trainable": 0})
            entry["samples"] += 1
            entry["trainable"] += s.record.num_trainable
        return counts

    def totals(self) -> dict:
        return {
            "samples": len(self.samples),
            "seats": self.seat_counts(),
            "tokens": sum(len(s.record.token_ids) for s in self.samples),
            "trainable": sum(s.record.num_trainable for s in self.samples),
            "images": sum(len(s.image_runs) for s in self.samples),
            "image_tokens": sum(s.image_tokens for s in self.samples),
            "errors": self.num_errors,
            "warnings": self.num_warnings,
            "by_check": dict(Counter(p.check for p in self.all_problems())),
        }


def check_step(rollouts: StepRollouts, chat: ChatFormat) -> StepReport:
    """Check every sample of a step and the batch as a whole."""
    reports = [check_sample(record, chat) for record in rollouts.samples]
    model = str(getattr(chat.tokenizer, "name_or_path", ""))
    problems = _check_as_the_trainer(rollouts) or _check_sample_records(rollouts)  # records of a sound batch
    return StepReport(rollouts, reports, problems + _check_images_stored(rollouts), model)


def _check_images_stored(rollouts: StepRollouts) -> list[Problem]:
    """The images the batch names that are not in the run's image store, as one problem."""
    output_dir = rollouts.path.parents[1]
    refs = dict.fromkeys(ref for s in rollouts.samples for ref in s.images)
    missing = [ref for ref in refs if not image_path(output_dir, ref).is_file()]
    if not missing:
        return []
    shown = ", ".join(ref[:12] for ref in missing[:MAX_POSITIONS])
    message = f"{len(missing)} of the {len(refs)} images the batch names are not in {output_dir / 'images'}: {shown}"
    return [Problem("image_missing", message)]


def _check_as_the_trainer(rollouts: StepRollouts) -> list[Problem]:
    """What the trainer's reader refuses in this batch (the protocol's own checks), as one problem."""
    try:
        read_batch(rollouts.path.parents[1], rollouts.step)
    except BatchError as e:
        return [Problem("trainer_rejects", f"the trainer would refuse this batch: {e}")]
    return []


def _check_sample_records(rollouts: StepRollouts) -> list[Problem]:
    """``batch.json``'s per-sample records (for the tools; the trainer reads none) against the samples."""
    recorded, samples = rollouts.info.get("samples"), rollouts.samples
    if isinstance(recorded, list) and recorded and len(recorded) != len(samples):
        message = f"batch.json lists {len(recorded)} samples but the micro-batches hold {len(samples)}"
        return [Problem("sample_count_mismatch", message)]
    return []


def _span(positions: list[int]) -> str:
    shown = ", ".join(map(str, positions[:MAX_POSITIONS]))
    return f"{len(positions)} at [{shown}{', ...' if len(positions) > MAX_POSITIONS else ''}]"


def check_sample(record: SampleRecord, chat: ChatFormat) -> SampleReport:
    """Check one sample's advantage, logprobs and token ids, and its loss mask against its chat turns."""
    problems: list[Problem] = []

    def add(check: str, message: str, positions: list[int] | None = None, severity: str = ERROR) -> None:
        problems.append(Problem(check, message, severity, record.index, positions or []))

    ids, mask, logprobs = record.token_ids, record.loss_mask, record.inference_logprobs
    _check_advantage(record, add)
    if not any(mask) and not any(record.ce_weights):
        add("empty_mask", f"no trainable token in {len(ids)} tokens: the sample adds nothing to the loss")
    _check_logprobs(mask, logprobs, add)
    unknown = [i for i, t in enumerate(ids) if not 0 <= t < chat.vocab_size]
    if unknown:
        add("token_out_of_vocab", f"ids outside the tokenizer's {chat.vocab_size} tokens: {_span(unknown)}", unknown)

    seg = segment(ids, chat, record.loss_mask)
    if not seg.turns:
        add("no_chat_format", "no turn-start token: roles cannot be checked (wrong --model?)", severity=WARNING)
    runs = chat.image_runs(ids)
    if len(runs) != len(record.images):
        add(
            "image_count_mismatch",
            f"{len(runs)} image placeholder runs but {len(record.images)} images named for the sample: the trainer "
            "would put images at the wrong tokens",
            [start for start, _ in runs],
        )
    image_tokens = {i for start, length in runs for i in range(start, start + length)}
    trainable = [i for i in range(min(len(ids), len(mask))) if mask[i]]
    by_check: dict[str, list[int]] = {}
    for i in trainable:
        role, part = seg.roles[i], seg.parts[i]
        if i in image_tokens:
            by_check.setdefault("mask_on_image", []).append(i)
        elif part == OUTSIDE:
            by_check.setdefault("mask_outside_turn", []).append(i)
        elif role != "assistant":
            by_check.setdefault(f"mask_in_{role}_turn", []).append(i)
        elif part in (HEADER, SCAFFOLD, SEPARATOR):
            by_check.setdefault("mask_on_template", []).append(i)
    inside = [i for i in trainable if seg.parts[i] == CONTENT and ids[i] in chat.stop_ids]
    if inside:
        tokens = ", ".join(sorted({chat.piece(ids[i]) for i in inside}))
        message = (
            f"the model sampled {tokens} inside its reply and went on (the server does not stop there: its "
            f"generation config?); trained as the reply: {_span(inside)}"
        )
        add("stop_token_in_reply", message, inside, WARNING)
    for check, positions in by_check.items():
        where = {
            "mask_outside_turn": "outside any chat turn",
            "mask_on_image": "on image placeholders (prompt tokens)",
            "mask_on_template": "on template tokens (turn header, generation-prompt scaffold, whitespace after "
            f"{chat.family.turn_end})",
        }.get(check, f"in {check.removeprefix('mask_in_').removesuffix('_turn')} turns")
        add(check, f"trainable tokens {where}: {_span(positions)}", positions)
    _check_assistant_turns(seg, mask, chat, add)
    _check_ce_weights(record, seg, image_tokens, add)
    return SampleReport(record, seg, problems, runs)


def _check_ce_weights(record: SampleRecord, seg: Segmentation, image_tokens: set[int], add) -> None:
    """Cross-entropy weights only on the content of turns of the roles ``batch.json``'s ``ce_roles`` names, never
    on a sample's first token (the trainer cannot score it)."""
    roles = record.summary.get("ce_roles") or []
    by_check: dict[str, list[int]] = {}
    for i in (i for i, w in enumerate(record.ce_weights) if w):
        if i == 0:
            check = "ce_on_first_token"
        elif i in image_tokens:
            check = "ce_on_image"
        elif seg.parts[i] == OUTSIDE:
            check = "ce_on_outside_turn"
        elif seg.parts[i] not in (CONTENT, END):
            check = "ce_on_template"
        elif seg.roles[i] not in roles:
            check = f"ce_in_{seg.roles[i]}_turn"
        else:
            continue
        by_check.setdefault(check, []).append(i)
    for check, positions in by_check.items():
        add(check, f"cross-entropy weights where the sample must not train ({check}; ce_roles {roles}): "
                   f"{_span(positions)}", positions)  # fmt: skip


def _check_logprobs(mask: list[bool], logprobs: list[float], add) -> None:
    """Trained tokens need the server's logprob. Not finite or positive is never one; exactly 0.0 is missing when a
    whole trained run has it, but alone it can be a token sampled with probability 1 in float32 (a warning)."""
    invalid = [i for i, (m, lp) in enumerate(zip(mask, logprobs, strict=False)) if m and not _finite_logprob(lp)]
    missing, zero = [], []
    for run in _trained_runs(mask[: len(logprobs)]):
        zeros = [i for i in run if logprobs[i] == 0.0]
        (missing if len(zeros) == len(run) else zero).extend(zeros)
    if invalid or missing:
        positions = sorted(invalid + missing)
        add(
            "missing_logprob",
            f"trained tokens without an inference logprob (not finite, positive, or 0.0 over a whole trained "
            f"span): {_span(positions)}",
            positions,
        )
    if zero:
        add(
            "zero_logprob",
            f"trained tokens with logprob exactly 0.0 among real ones (sampled with probability 1?): {_span(zero)}",
            zero,
            WARNING,
        )


def _finite_logprob(value: float) -> bool:
    return math.isfinite(value) and value <= 0.0


def _trained_runs(mask: list[bool]) -> list[list[int]]:
    """Maximal runs of consecutive trained positions."""
    runs: list[list[int]] = []
    for i, trained in enumerate(mask):
        if trained:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
    return runs


def _check_advantage(record: SampleRecord, add) -> None:
    values = record.advantages
    if record.summary.get("algorithm") in DISTILLED:
        _check_token_advantages(record, add)
        return
    if values and max(values) - min(values) > 1e-6:
        add("advantage_mismatch", f"advantages vary within the sample ({min(values):.4g} to {max(values):.4g})")
    recorded = record.summary.get("advantage")
    if values and isinstance(recorded, int | float) and not math.isclose(values[0], recorded, abs_tol=1e-5):
        add("advantage_mismatch", f"advantage {values[0]:.6g} in the tensors, {recorded:.6g} in batch.json")


def _check_token_advantages(record: SampleRecord, add) -> None:
    """A distilled sample's advantages (one per token: opd, opsd): 0 on every untrained token, and
    ``batch.json``'s advantage their mean over the trained ones."""
    values, mask = record.advantages, record.loss_mask
    if untrained := [i for i, (v, m) in enumerate(zip(values, mask, strict=True)) if v and not m]:
        add("advantage_mismatch", f"advantages on untrained tokens: {_span(untrained)}", untrained)
    trained = [v for v, m in zip(values, mask, strict=True) if m]
    recorded = record.summary.get("advantage")
    if trained and isinstance(recorded, int | float) and not math.isclose(sum(trained) / len(trained), recorded,
                                                                          abs_tol=1e-5):  # fmt: skip
        add("advantage_mismatch", f"mean advantage {sum(trained) / len(trained):.6g} in the tensors, "
                                  f"{recorded:.6g} in batch.json")  # fmt: skip


def _check_assistant_turns(seg: Segmentation, mask: list[bool], chat: ChatFormat, add) -> None:
    """Warnings about replies trained only in part: holes in the mask, an untrained turn end."""
    gaps: list[int] = []
    unmasked_ends: list[int] = []
    for turn in seg.turns:
        if turn.role != "assistant":
            continue
        content = [j for j in range(turn.content_start, min(turn.end, len(mask))) if seg.parts[j] in (CONTENT, END)]
        trained = [j for j in content if mask[j]]
        if not trained:
            continue
        gaps += [j for j in content if j < trained[-1] and not mask[j]]  # holes, and untrained leading tokens
        end = next((j for j in content if seg.parts[j] == END), None)
        if end is not None and not mask[end]:
            unmasked_ends.append(end)
    if gaps:
        add("mask_gap", f"untrained tokens before or inside a trained assistant reply: {_span(gaps)}", gaps, WARNING)
    if unmasked_ends:
        add(
            "unmasked_turn_end",
            f"a trained assistant reply whose {chat.family.turn_end} is not trained: {_span(unmasked_ends)}",
            unmasked_ends,
            WARNING,
        )


def open_step(output_dir: Path, step: int | None = None, model: str | None = None) -> tuple[StepRollouts, ChatFormat]:
    """What the tools start from: a step's samples and the run's chat format (errors: :class:`RolloutReadError`)."""
    rollouts = read_step(output_dir, step)
    family = FAMILIES.get(run_model_setting(output_dir, "chat_family") or "")  # the run's, unless "auto"
    try:
        return rollouts, ChatFormat.from_tokenizer(load_tokenizer(output_dir, model), family)
    except ChatFormatError as e:
        raise RolloutReadError(str(e)) from None


def choose_samples(count: int, wanted: list[int] | None, limit: int | None, default: list[int]) -> list[int]:
    """Which samples a tool shows: ``wanted`` (checked against ``count``) or ``default``, at most ``limit``."""
    if wanted:
        outside = [i for i in wanted if not 0 <= i < count]
        if outside:
            raise RolloutReadError(f"--sample {outside[0]} is out of range: the step has samples 0..{count - 1}")
        chosen = list(dict.fromkeys(wanted))
    else:
        chosen = default
    return chosen if limit is None else chosen[:limit]
