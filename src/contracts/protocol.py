"""The batch files between orchestrator and trainer, defined once: what ``rollouts/step_N/`` holds (one
:class:`BatchInfo` as ``batch.json`` and packed :class:`MicroBatch` tensors), written atomically and checked on
reading. Where they live, and the rest of a run's folder: :mod:`contracts.run_dir`."""

import json
import math
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from pydantic import TypeAdapter, ValidationError
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from contracts.atomic_io import atomic_dir
from contracts.errors import TridentError
from contracts.images import IMAGE_REF
from contracts.metrics import read_metrics
from contracts.run_dir import rollouts_dir, step_dirs
from contracts.sampling import NO_TRUNCATION, Truncation


@dataclass
class Sample:
    """One training sample: a prompt and what the server sampled after it, token for token.

    ``loss_mask[i]`` is True exactly where ``token_ids[i]`` was sampled by the policy; ``inference_logprobs``
    holds the server's (temperature-processed) logprob there and 0 elsewhere. ``routes`` (a mixture-of-experts
    model's, when the server returned them): the experts each token went to, ``[tokens, layers, top_k]`` uint8.
    ``weight_steps[i]``: the weights step that sampled token ``i`` (weights can change in flight, mid-completion);
    ``weight_step`` where it was not sampled, and everywhere when not given. ``weight_step`` is the oldest step
    that sampled any of its tokens. ``images``: the refs (:mod:`contracts.images`) of the images whose placeholder
    runs appear in ``token_ids``, in order of appearance (placeholders are prompt tokens, never in the loss).
    ``token_advantages``: each token's own advantage, where an algorithm gives one per token (on-policy
    distillation); None: ``advantage`` on every token. ``ce_weights``: each token's weight in the cross-entropy
    term (``-w * logprob``, docs/losses.md), where an algorithm trains tokens on their likelihood (ECHO, distillation
    from a teacher's samples); None: no token.
    """

    token_ids: list[int]
    loss_mask: list[bool]
    inference_logprobs: list[float]
    advantage: float
    reward: float
    weight_step: int  # the oldest weights step that sampled its tokens
    meta: dict = field(default_factory=dict)  # where it came from: env, task, rewards by function, ...
    routes: torch.Tensor | None = None
    weight_steps: list[int] | None = None  # per token; None: weight_step for every token
    images: list[str] = field(default_factory=list)
    token_advantages: list[float] | None = None
    ce_weights: list[float] | None = None

    def __post_init__(self):
        if self.weight_steps is None:
            self.weight_steps = [self.weight_step] * len(self.token_ids)
        if not len(self.token_ids) == len(self.loss_mask) == len(self.inference_logprobs) == len(self.weight_steps):
            raise ValueError(
                f"sample fields differ in length: {len(self.token_ids)} token ids, {len(self.loss_mask)} mask "
                f"entries, {len(self.inference_logprobs)} logprobs, {len(self.weight_steps)} weight steps"
            )
        if self.token_advantages is not None and len(self.token_advantages) != len(self.token_ids):
            raise ValueError(f"{len(self.token_advantages)} token advantages for {len(self.token_ids)} tokens")
        if self.ce_weights is not None and len(self.ce_weights) != len(self.token_ids):
            raise ValueError(f"{len(self.ce_weights)} cross-entropy weights for {len(self.token_ids)} tokens")
        if self.routes is not None and (self.routes.dim() != 3 or len(self.routes) != len(self.token_ids)):
            raise ValueError(f"routes of shape {list(self.routes.shape)} for {len(self.token_ids)} tokens")


class BatchError(TridentError):
    """A batch the trainer must not train on: unreadable, or not what the orchestrator writes."""


MICRO_BATCH_DTYPES = {  # the tensors of a micro-batch file; all but sample_lengths have one entry per token
    "input_ids": torch.long,
    "position_ids": torch.long,
    "loss_mask": torch.bool,
    "advantages": torch.float32,
    "inference_logprobs": torch.float32,
    "weight_steps": torch.long,
    "sample_lengths": torch.long,
}
MICRO_BATCH_TENSORS = tuple(MICRO_BATCH_DTYPES)
PER_TOKEN_TENSORS = tuple(name for name in MICRO_BATCH_TENSORS if name != "sample_lengths")
ROUTES_DTYPE = (
    torch.uint8
)  # routes: [tokens, layers, top_k] expert ids, only in a micro-batch whose samples all carry them
CE_WEIGHTS_DTYPE = torch.float32  # ce_weights: [tokens], only in a micro-batch where some sample has them
OPTIONAL_TENSORS = ("routes", "ce_weights")


@dataclass
class MicroBatch:
    """Samples packed end to end into one row, without padding (``position_ids`` restart per sample).

    All tensors have shape ``[tokens]``; ``sample_lengths`` (``[samples]``) gives the boundaries. Their dtypes:
    :data:`MICRO_BATCH_DTYPES`. ``weight_steps``: the weights step that sampled each token (:class:`Sample`).
    ``routes`` (``[tokens, layers, top_k]``, :data:`ROUTES_DTYPE`; None: absent) are the experts the server routed
    each token to, for routing replay: present when every sample packed in has them. ``images`` (None: no sample
    has any): each sample's image refs (:attr:`Sample.images`), in the file's metadata as JSON. ``ce_weights``
    (``[tokens]``, :data:`CE_WEIGHTS_DTYPE`; None: absent, every weight 0) are each token's weight in the
    cross-entropy term (:attr:`Sample.ce_weights`): present when some sample packed in has them, 0 for the others.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    inference_logprobs: torch.Tensor
    weight_steps: torch.Tensor
    sample_lengths: torch.Tensor
    routes: torch.Tensor | None = None
    images: list[list[str]] | None = None
    ce_weights: torch.Tensor | None = None

    @classmethod
    def pack(cls, samples: list[Sample]) -> "MicroBatch":
        def cat(name, values):
            return torch.tensor([v for s in samples for v in values(s)], dtype=MICRO_BATCH_DTYPES[name])

        routed = all(s.routes is not None for s in samples)
        return cls(
            input_ids=cat("input_ids", lambda s: s.token_ids),
            position_ids=cat("position_ids", lambda s: range(len(s.token_ids))),
            loss_mask=cat("loss_mask", lambda s: s.loss_mask),
            advantages=cat("advantages", lambda s: s.token_advantages or [s.advantage] * len(s.token_ids)),
            inference_logprobs=cat("inference_logprobs", lambda s: s.inference_logprobs),
            weight_steps=cat("weight_steps", lambda s: s.weight_steps),
            sample_lengths=cat("sample_lengths", lambda s: [len(s.token_ids)]),
            routes=torch.cat([s.routes.to(ROUTES_DTYPE) for s in samples]) if routed and samples else None,
            images=[list(s.images) for s in samples] if any(s.images for s in samples) else None,
            ce_weights=torch.tensor([w for s in samples for w in s.ce_weights or [0.0] * len(s.token_ids)],
                                    dtype=CE_WEIGHTS_DTYPE) if any(s.ce_weights for s in samples) else None,
        )  # fmt: skip

    @classmethod
    def load(cls, path: Path) -> "MicroBatch":
        """Read and check a micro-batch file; a :class:`BatchError` names the file and what is wrong with it."""
        if Path(path).is_symlink() or not Path(path).is_file():
            raise BatchError(f"{path}: not a regular file (links are refused)")
        try:
            tensors = load_file(path)
        except Exception as e:  # safetensors raises its own error types for truncated or malformed files
            raise BatchError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
        if set(tensors) - set(OPTIONAL_TENSORS) != set(MICRO_BATCH_DTYPES):
            raise BatchError(f"{path}: holds tensors {sorted(tensors)}, expected {sorted(MICRO_BATCH_DTYPES)}")
        routes = tensors.get("routes")
        if routes is not None and (routes.dtype != ROUTES_DTYPE or routes.dim() != 3):
            raise BatchError(
                f"{path}: routes is {routes.dtype} of shape {list(routes.shape)}, expected 3-d {ROUTES_DTYPE}"
            )
        ce_weights = tensors.get("ce_weights")
        if ce_weights is not None and (ce_weights.dtype != CE_WEIGHTS_DTYPE or ce_weights.dim() != 1):
            raise BatchError(f"{path}: ce_weights is {ce_weights.dtype} of shape {list(ce_weights.shape)}, "
                             f"expected 1-d {CE_WEIGHTS_DTYPE}")  # fmt: skip
        for name, dtype in MICRO_BATCH_DTYPES.items():
            tensor = tensors[name]
            if tensor.dtype != dtype or tensor.dim() != 1:
                raise BatchError(
                    f"{path}: {name} is {tensor.dtype} of shape {list(tensor.shape)}, expected 1-d {dtype}"
                )
        micro_batch = cls(**tensors, images=images_metadata(path))
        problem = micro_batch.problem()
        if problem:
            raise BatchError(f"{path}: {problem}")
        return micro_batch

    def problem(self) -> str | None:
        """What makes these tensors inconsistent (their layout, negative ids, non-finite values), or None."""
        layout = self.layout_problem()
        if layout:
            return layout
        if (self.input_ids < 0).any():
            return "input_ids holds negative token ids"
        if (self.weight_steps < 0).any():
            return "weight_steps holds negative steps"
        if not (self.advantages.isfinite().all() and self.inference_logprobs.isfinite().all()):
            return "advantages or inference_logprobs hold NaN or infinite values"
        if self.ce_weights is not None and not (self.ce_weights.isfinite().all() and (self.ce_weights >= 0).all()):
            return "ce_weights hold negative, NaN or infinite values"
        return None

    def layout_problem(self) -> str | None:
        """What keeps these tensors from splitting into samples (lengths, sample boundaries, positions), or None."""
        tokens, lengths = len(self.input_ids), self.sample_lengths
        for name in (*PER_TOKEN_TENSORS, *OPTIONAL_TENSORS):
            if getattr(self, name) is not None and len(getattr(self, name)) != tokens:
                return f"{name} has {len(getattr(self, name))} entries for {tokens} tokens"
        if len(lengths) == 0 or (lengths <= 0).any() or lengths.sum() != tokens:
            return f"sample_lengths {lengths.tolist()[:8]} do not split {tokens} tokens into samples"
        if not torch.equal(self.position_ids, torch.cat([torch.arange(n) for n in lengths.tolist()])):
            return "position_ids do not count 0, 1, ... from the start of each sample"
        if self.images is not None:
            if len(self.images) != len(lengths):
                return f"images lists {len(self.images)} samples' images for {len(lengths)} samples"
            bad = [
                ref for refs in self.images for ref in refs if not (isinstance(ref, str) and IMAGE_REF.fullmatch(ref))
            ]
            if bad:
                return f"images holds {bad[0]!r}, not an image ref (64 hex digits)"
        return None

    def samples(self) -> list["MicroBatch"]:
        """Each sample of the row as a micro-batch of its own."""
        lengths = self.sample_lengths.tolist()
        names = [*PER_TOKEN_TENSORS, *(name for name in OPTIONAL_TENSORS if getattr(self, name) is not None)]
        pieces = {name: getattr(self, name).split(lengths) for name in names}
        return [
            MicroBatch(
                **{name: pieces[name][i] for name in names},
                sample_lengths=self.sample_lengths[i : i + 1],
                images=[self.images[i]] if self.images and self.images[i] else None,
            )
            for i in range(len(lengths))
        ]

    @classmethod
    def concat(cls, micro_batches: list["MicroBatch"]) -> "MicroBatch":
        """The rows of ``micro_batches`` end to end, as one row (with routes when every row has them, with
        cross-entropy weights when some row has them)."""
        routes = [m.routes for m in micro_batches]
        images = [refs for m in micro_batches for refs in (m.images or [[]] * len(m.sample_lengths))]
        ce_weights = [m.ce_weights for m in micro_batches]
        return cls(
            **{name: torch.cat([getattr(m, name) for m in micro_batches]) for name in MICRO_BATCH_TENSORS},
            routes=torch.cat(routes) if all(r is not None for r in routes) else None,
            images=images if any(images) else None,
            ce_weights=torch.cat([m.ce_weights if m.ce_weights is not None
                                  else torch.zeros(len(m.input_ids), dtype=CE_WEIGHTS_DTYPE) for m in micro_batches])
            if any(w is not None for w in ce_weights) else None,
        )  # fmt: skip

    def ce_tokens(self) -> int:
        """The tokens with a cross-entropy weight: the cross-entropy term's normaliser counts them."""
        return 0 if self.ce_weights is None else int((self.ce_weights != 0).sum())

    def to_dict(self) -> dict[str, torch.Tensor]:
        """The tensors (what the file holds besides :meth:`metadata`)."""
        return {k: v.contiguous() for k, v in self.__dict__.items() if isinstance(v, torch.Tensor)}

    def metadata(self) -> dict[str, str] | None:
        """The file's metadata: the samples' image refs, when any sample has images."""
        return None if self.images is None else {"images": json.dumps(self.images)}

    def save(self, path: Path) -> None:
        save_file(self.to_dict(), path, metadata=self.metadata())


def images_metadata(path: Path) -> list[list[str]] | None:
    """The image refs a micro-batch file's metadata lists per sample (None: none); a :class:`BatchError` if it is not
    a list of lists of strings."""
    with safe_open(path, framework="pt") as f:
        text = (f.metadata() or {}).get("images")
    if text is None:
        return None
    try:
        images = json.loads(text)
    except json.JSONDecodeError:
        images = None
    if not (isinstance(images, list) and all(isinstance(refs, list) for refs in images)):
        raise BatchError(f"{path}: its images metadata is not a list of lists of image refs")
    return images


def pack_lengths(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of items of ``lengths`` grouped into bins of at most ``capacity`` (first fit, longest first)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True):
        n = lengths[index]
        if n > capacity:
            raise ValueError(f"a sample of {n} tokens does not fit in {capacity} tokens")
        for i, free in enumerate(room):
            if n <= free:
                bins[i].append(index)
                room[i] -= n
                break
        else:
            bins.append([index])
            room.append(capacity - n)
    return bins


def pack_samples(samples: list[Sample], seq_len: int) -> list[list[Sample]]:
    """Group samples into micro-batches of at most ``seq_len`` tokens (first fit, longest first)."""
    return [[samples[i] for i in bin] for bin in pack_lengths([len(s.token_ids) for s in samples], seq_len)]


def repack(micro_batches: list[MicroBatch], tokens: int) -> list[MicroBatch]:
    """The samples of ``micro_batches`` packed anew into micro-batches of at most ``tokens`` tokens (first fit,
    longest first), each sample's tensors unchanged."""
    samples = [sample for micro_batch in micro_batches for sample in micro_batch.samples()]
    bins = pack_lengths([len(sample.input_ids) for sample in samples], tokens)
    return [MicroBatch.concat([samples[i] for i in bin]) for bin in bins]


@dataclass
class BatchInfo:
    """What the trainer needs besides tokens, and what it logs about the batch it trained on."""

    step: int
    num_samples: int
    num_tokens: int
    num_loss_tokens: int  # sampled tokens over the whole step: the loss is normalized by this
    reward_mean: float
    temperature: float  # sampling temperature: the trainer's logprobs use the same
    truncation: Truncation = NO_TRUNCATION  # the server's top_p / top_k / min_p: the trainer's logprobs use the same
    weight_steps: list[int] = field(default_factory=list)  # weights steps that produced the samples
    metrics: dict[str, float] = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)  # per sample, in packed order: see :func:`sample_summary`
    # tokens with a cross-entropy weight over the whole step: the cross-entropy term is normalized by this (written
    # only when not 0: a batch without such tokens is the batch of before)
    num_ce_tokens: int = 0


BATCH_INFO = TypeAdapter(BatchInfo)  # reads batch.json, every field of its type


def sample_summary(sample: Sample) -> dict:
    """What ``batch.json`` records about one sample besides its tokens (for inspection tools, not training)."""
    return {"advantage": sample.advantage, "reward": sample.reward, "weight_step": sample.weight_step, **sample.meta}


def micro_batch_paths(folder: Path) -> list[Path]:
    """The micro-batch files of a rollouts folder, in order (other files are ignored)."""
    numbered = {p.stem.removeprefix("micro_batch_"): p for p in folder.glob("micro_batch_*.safetensors")}
    return [numbered[k] for k in sorted((k for k in numbered if k.isdecimal()), key=int)]


REPORTED_SAMPLE_STEPS = 2
"""The report shows the sample rollouts of the newest this many steps that logged some, their trained tokens
highlighted from the steps' batches: :func:`prune_rollouts` keeps those batches."""


def write_batch(output_dir: Path, info: BatchInfo, micro_batches: list[MicroBatch]) -> Path:
    """Write ``rollouts/step_N/`` atomically."""
    final = rollouts_dir(output_dir, info.step)
    with atomic_dir(final) as tmp:
        for i, micro_batch in enumerate(micro_batches):
            micro_batch.save(tmp / f"micro_batch_{i}.safetensors")
        record = asdict(info)
        if not record["num_ce_tokens"]:
            del record["num_ce_tokens"]
        (tmp / "batch.json").write_text(json.dumps(record, indent=1))
    return final


def prune_rollouts(output_dir: Path, step: int, keep: int | None) -> None:
    """Delete the batches older than the newest ``keep`` up to ``step`` (all kept for ``keep`` None), but for those
    of the newest :data:`REPORTED_SAMPLE_STEPS` steps with sample rollouts, whose trained tokens the report shows."""
    if keep is None:
        return
    old = [s for s in step_dirs(rollouts_dir(output_dir, 0).parent) if 1 <= s <= step - keep]
    if old:
        sampled = sorted(
            {r["step"] for r in read_metrics(output_dir, "sample_rollouts") if isinstance(r.get("step"), int)}
        )
        for s in set(old) - set(sampled[-REPORTED_SAMPLE_STEPS:]):
            shutil.rmtree(rollouts_dir(output_dir, s), ignore_errors=True)


def read_batch(output_dir: Path, step: int, vocab_size: int | None = None) -> tuple[BatchInfo, list[MicroBatch]]:
    """Read the complete batch of ``step`` and check it (token ids below ``vocab_size`` when given): a batch from
    outside is refused with a :class:`BatchError` naming the file and the fault, before anything trains on it."""
    folder = rollouts_dir(output_dir, step)
    if folder.is_symlink() or not folder.is_dir():
        raise BatchError(f"{folder}: not a folder (links are refused)")
    info_path = folder / "batch.json"
    try:
        info = BATCH_INFO.validate_json(info_path.read_bytes(), strict=True)
    except (OSError, ValidationError) as e:
        raise BatchError(f"{info_path}: not a batch description ({type(e).__name__}: {e})") from None
    if not (math.isfinite(info.temperature) and info.temperature > 0):
        raise BatchError(f"{info_path}: temperature is {info.temperature}, expected a positive number")
    if problem := info.truncation.problem():
        raise BatchError(f"{info_path}: truncation {problem}")
    micro_batches = [MicroBatch.load(f) for f in micro_batch_paths(folder)]
    counts = {
        "step": (info.step, step),
        "num_samples": (info.num_samples, sum(len(m.sample_lengths) for m in micro_batches)),
        "num_tokens": (info.num_tokens, sum(len(m.input_ids) for m in micro_batches)),
        "num_loss_tokens": (info.num_loss_tokens, sum(int(m.loss_mask.sum()) for m in micro_batches)),
        "num_ce_tokens": (info.num_ce_tokens, sum(m.ce_tokens() for m in micro_batches)),
    }
    for key, (said, found) in counts.items():
        if said != found:
            raise BatchError(f"{info_path}: {key} is {said!r}, but the micro-batch files hold {found}")
    if vocab_size is not None and any(int(m.input_ids.max()) >= vocab_size for m in micro_batches):
        raise BatchError(f"{folder}: token ids beyond the model's vocabulary of {vocab_size}")
    return info, micro_batches
