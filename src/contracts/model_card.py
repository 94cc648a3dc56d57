"""A model card: the facts about a model every process and the launcher read, from its ``config.json`` (the one
module that opens it) or, for a hub model not on this machine, from a table of known shapes; torch-free.

:meth:`ModelCard.of` builds a model's card once per process (again only if its config.json changes): what
transformers and vLLM load (a tiny model's build, a local folder or a hub id), the folder it is in on this machine,
its architecture (``model_type``) and its shape (layers, heads, key-value heads, head dim, hidden size, vocabulary,
tied embeddings, experts and top-k, shared expert, vision tower), and a vision-language model's marker tokens. The
parameter counts here (the model's, an adapter's) are what the trainer's and the server's memory plans sum.
"""

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path

from contracts.errors import TridentError
from contracts.model_path import TINY_MODEL_IDS, known_model, tiny_model_path

CONFIG_FILE = "config.json"
GIB = 2**30  # bytes in a GiB: the unit of the processes' memory figures
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
# The linear layers of a decoder layer in the dense architectures known by their config.json's model_type, without
# loading the model (the trainer checks any model's own at start)
KNOWN_LINEARS = dict.fromkeys(("llama", "mistral", "qwen2", "qwen3"), LINEARS)
# The key of a config.json that counts a mixture of experts' routed experts, by family: Qwen2-MoE's and the hub's
# Qwen3-MoE files; Mixtral, gpt-oss and transformers 5's own Qwen3-MoE files; DeepSeek-V2/V3 and GLM-4.5.
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
# A vision-language model's marker tokens, by their config.json keys (the Qwen-VL families'): placeholders and fences.
VISION_MARKER_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def resolve_model_path(name: str) -> str:
    """Map a model name to what transformers and vLLM load: a tiny model's built folder, else ``name``.

    Raises a TridentError for a ``trident/`` name that is no tiny model, or for a tiny model not built yet."""
    try:
        known_model(name)
    except ValueError as e:
        raise TridentError(f"model {e}") from None
    if name not in TINY_MODEL_IDS:
        return name
    path = tiny_model_path(name)
    if not is_model_folder(path):
        raise TridentError(f"model {name!r} is not built yet: a process started alone needs it built first, with "
                           f"`uv run --no-sync build-tiny-model {name}` (rl builds it itself)")  # fmt: skip
    return str(path)


def is_model_folder(folder: str | Path) -> bool:
    """Whether ``folder`` holds a model (its config.json)."""
    return (Path(folder).expanduser() / CONFIG_FILE).is_file()


def local_model_folder(path: str) -> str | None:
    """The folder the model at ``path`` (what :func:`resolve_model_path` gives) loads from when it is on this
    machine (a local folder, a tiny model, a hub id in the local cache); None for a hub id not downloaded here.
    Never goes to the network."""
    if Path(path).expanduser().is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(path, local_files_only=True)
    except Exception:  # not in the cache (or not a hub id)
        return None


def routed_experts(config: dict) -> int:
    """How many routed experts each sparse layer of the model of ``config`` (a config.json's fields; a multimodal
    model's are its text model's) has: 0 for a dense model."""
    config = config.get("text_config", config)
    return next((config[key] for key in EXPERT_KEYS if config.get(key)), 0)


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a decoder-only transformer: Qwen2/3 and Llama layouts, and their mixture-of-experts
    variants (Qwen2-MoE, Qwen3-MoE), where ``sparse_layers`` of the layers have ``num_experts`` routed experts of
    ``moe_intermediate_size`` (``num_experts_per_tok`` of them per token), a router, and maybe a shared expert."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # of the dense layers' MLP
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    sparse_layers: int = 0
    vision: "VisionShape | None" = None  # a vision-language model's vision tower

    @classmethod
    def from_config(cls, config: dict) -> "ModelShape":
        """The shape of a ``config.json``; a vision-language model's (Qwen3-VL's) language model from its
        ``text_config``, with its vision tower from its ``vision_config``."""
        if "vision_config" in config:
            text = {"tie_word_embeddings": config.get("tie_word_embeddings", False), **config["text_config"]}
            return replace(cls.from_config(text), vision=VisionShape.from_config(config["vision_config"]))
        heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            **experts_of(config),
        )

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of a dense decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip

    @property
    def attention_parameters(self) -> int:
        """A decoder layer's attention and its two norms (Qwen3's q/k norms, 2 × head_dim, left out)."""
        linears = self.linear_shapes()
        return sum(n_in * n_out for name, (n_in, n_out) in linears.items() if name not in MLP_LINEARS) + (
            2 * self.hidden_size
        )

    @property
    def sparse_mlp_parameters(self) -> int:
        """A mixture-of-experts MLP: every routed expert, the router (hidden × experts), the shared expert and its
        gate (hidden × 1)."""
        h, shared = self.hidden_size, self.shared_expert_intermediate_size
        experts = self.num_experts * 3 * h * self.moe_intermediate_size + self.num_experts * h
        return experts + (3 * h * shared + h if shared else 0)

    @property
    def layer_experts(self) -> int:
        """A sparse layer's routed experts (gate, up and down of each): what expert parallelism splits."""
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def expert_parameters(self) -> int:
        """The routed experts of every sparse layer."""
        return self.sparse_layers * self.layer_experts

    @property
    def layer_parameters(self) -> int:
        """The largest decoder layer's parameters."""
        return self.gathered_layer_parameters(ep=1)

    def gathered_layer_parameters(self, ep: int) -> int:
        """The largest decoder layer's parameters FSDP gathers: all of them, or under expert parallelism (``ep`` > 1)
        all but the routed experts, which each rank holds its share of itself."""
        dense = 3 * self.hidden_size * self.intermediate_size
        sparse = self.sparse_mlp_parameters - (self.layer_experts if ep > 1 else 0)
        return self.attention_parameters + max(dense if self.sparse_layers < self.num_hidden_layers else 0,
                                               sparse if self.sparse_layers else 0)  # fmt: skip

    @property
    def root_parameters(self) -> int:
        """Embeddings, the output layer unless tied, the final norm, and a vision tower (what FSDP holds in the
        model's root, outside the decoder layers)."""
        vision = self.vision.parameters if self.vision else 0
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2) + self.hidden_size + vision

    @property
    def vision_parameters(self) -> int:
        """The vision tower's parameters (0: a text model)."""
        return self.vision.parameters if self.vision else 0

    @property
    def parameters(self) -> int:
        """All parameters, every expert counted."""
        dense_layers = self.num_hidden_layers - self.sparse_layers
        mlps = dense_layers * 3 * self.hidden_size * self.intermediate_size
        mlps += self.sparse_layers * self.sparse_mlp_parameters
        return self.root_parameters + self.num_hidden_layers * self.attention_parameters + mlps

    @property
    def largest_tensor(self) -> int:
        """Elements of the largest weight tensor: the embeddings, a dense MLP's matrix, or a MoE layer's fused
        gate-and-up experts (experts × 2 · moe_intermediate_size × hidden, transformers' layout)."""
        h = self.hidden_size
        return max(self.vocab_size * h, h * self.intermediate_size if self.sparse_layers < self.num_hidden_layers
                   else 0, self.num_experts * 2 * self.moe_intermediate_size * h)  # fmt: skip


@dataclass(frozen=True)
class VisionShape:
    """A Qwen3-VL vision tower (transformers' ``Qwen3VLVisionModel``, from a ``vision_config``): a patch embedding
    of ``in_channels × temporal_patch_size × patch_size²`` features, learned position embeddings, ``depth`` blocks
    (layer norms, attention on a fused qkv, an MLP of ``intermediate_size``), and a patch merger plus one DeepStack
    merger per ``deepstack_visual_indexes`` entry, each taking ``spatial_merge_size²`` patches to one image token of
    ``out_hidden_size``."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_features: int
    num_position_embeddings: int
    spatial_merge_size: int
    out_hidden_size: int
    deepstack_mergers: int

    @classmethod
    def from_config(cls, config: dict) -> "VisionShape":
        return cls(
            depth=config["depth"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_heads=config["num_heads"],
            patch_features=config.get("in_channels", 3) * config["temporal_patch_size"] * config["patch_size"] ** 2,
            num_position_embeddings=config["num_position_embeddings"],
            spatial_merge_size=config["spatial_merge_size"],
            out_hidden_size=config["out_hidden_size"],
            deepstack_mergers=len(config.get("deepstack_visual_indexes") or []),
        )

    @property
    def merged_features(self) -> int:
        """Features of the ``spatial_merge_size²`` patches a merger takes as one image token."""
        return self.hidden_size * self.spatial_merge_size**2

    @property
    def parameters(self) -> int:
        h, i, merged = self.hidden_size, self.intermediate_size, self.merged_features
        embedding = (self.patch_features + 1) * h + self.num_position_embeddings * h
        block = 4 * h + (h + 1) * 3 * h + (h + 1) * h + (h + 1) * i + (i + 1) * h  # 2 norms, qkv, proj, MLP
        merger = (merged + 1) * merged + (merged + 1) * self.out_hidden_size  # two linears, and a norm:
        norms = 2 * h + self.deepstack_mergers * 2 * merged  # before the merge, or (DeepStack) after it
        return embedding + self.depth * block + (1 + self.deepstack_mergers) * merger + norms


def experts_of(config: dict) -> dict[str, int]:
    """The mixture-of-experts fields of a ``config.json`` (none for a dense model; the experts counted by
    :func:`routed_experts`): experts ``moe_intermediate_size`` wide (Mixtral's and gpt-oss's:
    ``intermediate_size``), a shared expert of Qwen-MoE's ``shared_expert_intermediate_size`` or DeepSeek's
    ``n_shared_experts`` of expert width."""
    experts = routed_experts(config)
    if not experts:
        return {}
    size = config.get("moe_intermediate_size") or config["intermediate_size"]
    shared = config.get("shared_expert_intermediate_size") or (config.get("n_shared_experts") or 0) * size
    return {
        "num_experts": experts,
        "num_experts_per_tok": config["num_experts_per_tok"],
        "moe_intermediate_size": size,
        "shared_expert_intermediate_size": shared,
        "sparse_layers": len(sparse_layer_ids(config)),
    }


def sparse_layer_ids(config: dict) -> list[int]:
    """The decoder layers of a mixture-of-experts ``config`` whose MLP is sparse: Qwen-MoE's every
    ``decoder_sparse_step``-th layer but its ``mlp_only_layers``, after DeepSeek's ``first_k_dense_replace``."""
    step, dense = config.get("decoder_sparse_step") or 1, set(config.get("mlp_only_layers") or [])
    first = config.get("first_k_dense_replace") or 0
    layers = range(config["num_hidden_layers"])
    return [i for i in layers if i >= first and i not in dense and (i + 1) % step == 0]


# Shapes of common hub models, for planning where the hub cannot be reached (keyed by the id's last part).
KNOWN_SHAPES = {
    "Qwen3-0.6B": ModelShape(151_936, 1024, 3072, 28, 16, 8, 128, True),
    "Qwen3-1.7B": ModelShape(151_936, 2048, 6144, 28, 16, 8, 128, True),
    "Qwen3-4B": ModelShape(151_936, 2560, 9728, 36, 32, 8, 128, True),
    "Qwen3-8B": ModelShape(151_936, 4096, 12_288, 36, 32, 8, 128, False),
    "Qwen3-14B": ModelShape(151_936, 5120, 17_408, 40, 40, 8, 128, False),
    "Qwen3-30B-A3B": ModelShape(
        151_936,
        2048,
        6144,
        48,
        32,
        4,
        128,
        False,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        sparse_layers=48,
    ),  # fmt: skip
    "Qwen2.5-7B-Instruct": ModelShape(152_064, 3584, 18_944, 28, 28, 4, 128, False),
    "Llama-3.1-8B-Instruct": ModelShape(128_256, 4096, 14_336, 32, 32, 8, 128, False),
}


def lora_parameters(shape: ModelShape, targets: list[str], rank: int) -> int:
    """Parameters of a LoRA adapter of ``rank`` on the ``targets`` linear layers of every decoder layer.

    In a mixture-of-experts layer the MLP targets adapt the shared expert's linears and, as peft converts them
    for transformers' fused experts (Qwen3-MoE), each routed expert: gate and up together at twice the rank
    (``2·rank × (hidden + 2·moe_intermediate_size)`` each), down at the rank. For MoE models whose experts peft
    leaves alone (Qwen2-MoE) this is an upper bound.
    """
    linears, h = shape.linear_shapes(), shape.hidden_size
    attention = sum(rank * sum(linears[t]) for t in targets if t in linears and t not in MLP_LINEARS)
    dense = sum(rank * sum(linears[t]) for t in targets if t in MLP_LINEARS)
    shared = sum(rank * (h + shape.shared_expert_intermediate_size) for t in targets
                 if t in MLP_LINEARS and shape.shared_expert_intermediate_size)  # fmt: skip
    dense_layers = shape.num_hidden_layers - shape.sparse_layers
    return (
        shape.num_hidden_layers * attention
        + dense_layers * dense
        + shape.sparse_layers * (shared + expert_lora_parameters(shape, targets, rank))
    )


def adapted_experts(shape: ModelShape, targets: list[str]) -> dict[str, tuple[int, int]]:
    """The fused routed-expert weights a LoRA on ``targets`` adapts, with their (in, out) features per expert:
    ``gate_up_proj`` when gate and up are both targets, ``down_proj`` when down is."""
    h, size = shape.hidden_size, shape.moe_intermediate_size
    fused = {"gate_up_proj": (h, 2 * size)} if {"gate_proj", "up_proj"} <= set(targets) else {}
    return fused | ({"down_proj": (size, h)} if "down_proj" in targets and shape.num_experts else {})


def expert_lora_parameters(shape: ModelShape, targets: list[str], rank: int) -> int:
    """Parameters of a LoRA adapter on one sparse layer's routed experts, as peft builds it for fused experts: gate
    and up together at twice the rank, down at the rank, per expert."""
    ranks = {"gate_up_proj": 2 * rank, "down_proj": rank}
    fused = adapted_experts(shape, targets)
    return sum(shape.num_experts * ranks[name] * (n_in + n_out) for name, (n_in, n_out) in fused.items())


@dataclass(frozen=True)
class ModelCard:
    """The facts about model ``name`` (:meth:`of`). ``shape`` is None where this machine cannot tell without the
    network (a hub model neither downloaded here nor in :data:`KNOWN_SHAPES`); ``model_type`` is None where no
    config.json was read."""

    name: str
    path: str  # what transformers and vLLM load: a tiny model's build, a local folder, or the hub id
    folder: str | None  # the folder it is in on this machine (a hub id's in the local cache); None: not here
    model_type: str | None
    shape: ModelShape | None
    experts: int | None  # routed experts of each sparse layer (0: dense); None where not known here
    vision_language: bool  # takes images (a config.json's vision_config: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, ...)
    marker_ids: tuple[int, ...] = ()  # a vision-language model's image and video marker tokens

    @classmethod
    def of(cls, name: str) -> "ModelCard":
        """The card of model ``name``, read once per process (again where its config.json changed). Raises a
        TridentError for a ``trident/`` name that is no tiny model, or a tiny model not built yet."""
        path = resolve_model_path(name)
        folder = local_model_folder(path)
        config_file = Path(folder).expanduser() / CONFIG_FILE if folder is not None else None
        stamp = config_file.stat().st_mtime_ns if config_file is not None and config_file.is_file() else None
        return _read_card(name, path, folder, stamp)

    @property
    def is_mixture_of_experts(self) -> bool:
        """Whether the model routes each token to some of its experts (False where it is not known here)."""
        return bool(self.experts)

    @property
    def linears(self) -> tuple[str, ...]:
        """The linear layers of a decoder layer, for an architecture of :data:`KNOWN_LINEARS`; else none."""
        return KNOWN_LINEARS.get(self.model_type, ())

    def vision_markers(self) -> dict[int, str]:
        """The image and video marker tokens (id: text), which only a prompt may hold: the orchestrator bans them
        from sampling (a sampled placeholder would read as an image). Empty for a text model; the texts come from
        its tokenizer.json."""
        if not self.marker_ids:
            return {}
        added = json.loads((Path(self.folder).expanduser() / "tokenizer.json").read_text()).get("added_tokens", [])
        return {token["id"]: token["content"] for token in added if token["id"] in self.marker_ids}

    def hub(self) -> "ModelCard":
        """This card, or where no config.json was read here, one read from the hub's (transformers, the network):
        for a process about to download the model anyway."""
        if self.model_type is not None:
            return self
        from transformers import AutoConfig

        return card_of_config(self.name, self.path, self.folder, AutoConfig.from_pretrained(self.path).to_dict())

    def hub_shape(self) -> ModelShape:
        """:attr:`shape`, else read from the hub's config (:meth:`hub`); a TridentError where neither can be read."""
        if self.shape is not None:
            return self.shape
        try:
            shape = self.hub().shape
        except Exception as e:
            raise TridentError(
                f"model.name = {self.name!r}: cannot read its config.json to plan memory ({e})"
            ) from None
        if shape is None:
            raise TridentError(f"model.name = {self.name!r}: cannot read its config.json to plan memory (no shape)")
        return shape


@functools.cache
def _read_card(name: str, path: str, folder: str | None, stamp: int | None) -> ModelCard:
    """The card of ``name`` from its config.json in ``folder`` (``stamp``: the file's modification time; None:
    there is none), else from :data:`KNOWN_SHAPES`."""
    if stamp is None:
        known = KNOWN_SHAPES.get(name.split("/")[-1])
        experts = known.num_experts if known is not None else None
        return ModelCard(name, path, folder, None, known, experts, known is not None and known.vision is not None)
    return card_of_config(name, path, folder, json.loads((Path(folder).expanduser() / CONFIG_FILE).read_text()))


def card_of_config(name: str, path: str, folder: str | None, config: dict) -> ModelCard:
    """The card of model ``name`` from the fields of its config.json."""
    vision = "vision_config" in config
    markers = sorted({config[key] for key in VISION_MARKER_KEYS if isinstance(config.get(key), int)}) if vision else []
    try:
        shape = ModelShape.from_config(config)
    except KeyError:  # a config.json without the fields of a decoder-only transformer's shape
        shape = None
    model_type = config.get("model_type", "")
    return ModelCard(name, path, folder, model_type, shape, routed_experts(config), vision, tuple(markers))
