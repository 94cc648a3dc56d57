"""What the trainer refuses to run, for a model card and its model config (torch-free): the trainer checks these at
its start, and ``rl`` the same before it starts anything (:func:`launch.rl_config.resolve_shared`).

Each refusal is a :class:`Refusal` of one line that names the key at fault as the caller's config spells it (``prefix``:
``"trainer."`` in ``rl``'s, nothing in the trainer's own) and the trainer's ranks as the caller knows them
(``ranks_named``: ``rl``'s ``--trainer-gpu-ids``, the trainer's count). A card whose shape this machine does not know
(a hub model not downloaded here), or no card (``rl`` before it builds a tiny model), skips what needs it; the
trainer reads the hub's config first, so it checks all.
"""

from contracts.config import ConfigError
from contracts.errors import TridentError
from contracts.model_card import ModelCard
from trainer.config import TrainerModelConfig


class Refusal(ConfigError, TridentError):
    """A config the trainer cannot run: a config mistake to ``rl``, a user error to the trainer; one line."""


def check_trainer_model(
    card: ModelCard | None, model: TrainerModelConfig, ranks: int, ranks_named: str, prefix: str
) -> None:
    """Refuse an expert or context parallelism the trainer cannot run on ``ranks`` ranks, and a LoRA target module
    that names no linear layer of the model."""
    if model.parallel.ep > 1:
        check_expert_parallel(card, model, ranks, ranks_named, prefix)
    if model.parallel.cp > 1:
        check_context_parallel(card, model, ranks, ranks_named, prefix)
    check_lora_targets(card, model, prefix)


def split_over_ranks(model: TrainerModelConfig, kind: str, ranks: int, ranks_named: str, prefix: str) -> None:
    """Refuse a ``model.parallel`` degree (``kind``: ``ep`` or ``cp``) above 1 that does not divide the trainer's
    ranks, or on a 4-bit base (which trains on one rank)."""
    degree = getattr(model.parallel, kind)
    key = f"{prefix}model.parallel.{kind} = {degree}"
    if model.experimental.load_in_4bit:
        raise Refusal(f"{key}: {prefix}model.experimental.load_in_4bit trains on one rank; set {kind} = 1")
    if ranks % degree:
        raise Refusal(f"{key} must divide the trainer's {ranks_named}")


def check_expert_parallel(
    card: ModelCard | None, model: TrainerModelConfig, ranks: int, ranks_named: str, prefix: str
) -> None:
    """``ep`` must divide the trainer's ranks and the model's experts, and needs a mixture of experts and a
    full-precision base."""
    ep, name = model.parallel.ep, model.name
    key = f"{prefix}model.parallel.ep = {ep}"
    split_over_ranks(model, "ep", ranks, ranks_named, prefix)
    if card is None:
        return
    if card.experts == 0:
        raise Refusal(f"{key}: model {name!r} is dense (no experts to split); set ep = 1")
    if card.experts is not None and card.experts % ep:
        raise Refusal(f"{key} must divide the {card.experts} experts of model {name!r}")


def check_context_parallel(
    card: ModelCard | None, model: TrainerModelConfig, ranks: int, ranks_named: str, prefix: str
) -> None:
    """``cp`` must divide the trainer's ranks and the model's attention heads (each rank attends with ``heads /
    cp``), on a dense text model (a mixture of experts' routing statistics and replayed routes are per micro-batch, a
    vision-language model's image features are placed by token) with a full-precision base."""
    cp, name, shape = model.parallel.cp, model.name, card.shape if card is not None else None
    key = f"{prefix}model.parallel.cp = {cp}"
    split_over_ranks(model, "cp", ranks, ranks_named, prefix)
    if shape is None:
        return
    if shape.num_experts:
        raise Refusal(f"{key}: model {name!r} is a mixture of experts, not split over ranks by tokens yet; set cp = 1")
    if shape.vision:
        raise Refusal(
            f"{key}: model {name!r} is a vision-language model, not split over ranks by tokens yet; set cp = 1"
        )
    if shape.num_attention_heads % cp:
        raise Refusal(f"{key} must divide the {shape.num_attention_heads} attention heads of model {name!r}")


def check_lora_targets(card: ModelCard | None, model: TrainerModelConfig, prefix: str) -> None:
    """Refuse a LoRA target module that names no linear layer of the model, where the card knows them (an
    architecture of :data:`contracts.model_card.KNOWN_LINEARS`); the trainer checks any model's own once loaded."""
    lora, linears = model.experimental.lora, card.linears if card is not None else ()
    if lora is None or not linears:
        return
    if missing := [t for t in lora.target_modules if t.split(".")[-1] not in linears]:
        raise Refusal(
            f"{prefix}model.experimental.lora.target_modules: no linear layer {', '.join(map(repr, missing))} in the "
            f"{card.model_type} model {model.name!r}; its linear layers: {', '.join(sorted(linears))}"
        )
