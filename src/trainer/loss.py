"""The policy-gradient loss, as small pure functions over packed token tensors."""

import math

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from trainer.config import LossConfig
from trainer.custom_loss import import_custom_loss


def sample_segments(sample_lengths: Int[Tensor, " samples"]) -> Int[Tensor, " seq"]:
    """The index of the sample each packed token belongs to: ``[0] * len_0 + [1] * len_1 + ...``, on the lengths'
    device (the host's, in the trainer: on a GPU its output size would have to be read back first)."""
    return torch.repeat_interleave(torch.arange(len(sample_lengths), device=sample_lengths.device), sample_lengths)


def sample_sums(values: Float[Tensor, " seq"], segment: Int[Tensor, " seq"], num: int) -> Float[Tensor, " samples"]:
    """Per-sample sums of a packed tensor: ``[values[segment == i].sum() for i in range(num)]``."""
    return values.new_zeros(num).index_add(0, segment, values)


def correction_weights(
    token_log_ratio: Float[Tensor, " seq"],
    segment: Int[Tensor, " seq"],
    tokens_per_sample: Float[Tensor, " samples"],
    config: LossConfig,
) -> tuple[Float[Tensor, " seq"], Bool[Tensor, " seq"]]:
    """The off-policy correction's importance weight at each token (no gradient), and where it was truncated or
    masked (``config.correction``, docs/losses.md).

    Naive equivalent: ``w = exp(token_log_ratio)`` per token, ``prod(w[segment == i])`` per sample
    (``sequence_``) or its ``1 / tokens_per_sample[i]``-th power (``geometric_``), then ``clamp(w, low, high)``
    (``_truncate``) or ``where(low <= w <= high, w, 0)`` (``_mask``). Computed on log weights, which neither
    overflow nor underflow over a long sample.
    """
    level, action = config.correction.split("_")
    log_weight = token_log_ratio.detach()
    if level != "token":
        per_sample = sample_sums(log_weight, segment, len(tokens_per_sample))
        if level == "geometric":
            per_sample = per_sample / tokens_per_sample.clamp(min=1)
        log_weight = per_sample[segment]
    low = math.log(config.correction_low) if config.correction_low > 0 else -math.inf
    high = math.log(config.correction_high)
    outside = (log_weight < low) | (log_weight > high)
    if action == "truncate":
        return log_weight.clamp(low, high).exp(), outside
    return torch.where(outside, 0.0, log_weight.exp()), outside


def mismatch_kl(
    logprobs: Float[Tensor, " seq"], inference_logprobs: Float[Tensor, " seq"], loss_mask: Bool[Tensor, " seq"]
) -> Float[Tensor, ""]:
    """The k3 estimate of KL(inference ‖ trainer) summed over the loss tokens, in float64 (``ratio - 1 - log_ratio``
    cancels to 0 in float32 for tiny mismatches). Naive equivalent: ``sum(r - 1 - log(r))`` over the loss tokens,
    ``r = exp(logprobs - inference_logprobs)``."""
    log_ratio = ((logprobs - inference_logprobs) * loss_mask).detach().double()
    return ((log_ratio.exp() - 1 - log_ratio) * loss_mask).sum()


def cispo_term(
    ratio: Float[Tensor, " seq"],
    logprobs: Float[Tensor, " seq"],
    advantages: Float[Tensor, " seq"],
    loss_mask: Bool[Tensor, " seq"],
    config: LossConfig,
) -> tuple[Float[Tensor, " seq"], Bool[Tensor, " seq"]]:
    """CISPO's policy term (MiniMax-M1, arXiv 2506.13585) at each token, and the loss tokens whose weight was
    clipped. Naive equivalent: ``-sg(clamp(ratio, cispo_low, cispo_high)) * A * logprobs``: every loss token keeps a
    gradient, ``-w * A * grad(logprobs)``, none is dropped. The defaults are MiniMax-M1's no lower end (0) and TRL's
    ``epsilon_high = 5`` for ``loss_type = "cispo"`` (ScaleRL's ε_max) as the upper end."""
    weight = ratio.detach().clamp(config.cispo_low, config.cispo_high)
    clipped = loss_mask & ((ratio < config.cispo_low) | (ratio > config.cispo_high))
    return -weight * advantages * logprobs * loss_mask, clipped


def sapo_term(
    ratio: Float[Tensor, " seq"], advantages: Float[Tensor, " seq"], loss_mask: Bool[Tensor, " seq"], config: LossConfig
) -> Float[Tensor, " seq"]:
    """SAPO's policy term (arXiv 2511.20347, TRL's ``loss_type = "sapo"``) at each token: the ratio through a soft
    gate instead of a clip. Naive equivalent: ``-sigmoid(tau * (ratio - 1)) * 4 / tau * A`` with ``tau =
    sapo_temperature_pos`` where ``A > 0``, else ``sapo_temperature_neg`` (defaults 1.0 and 1.05, the paper's and
    TRL's). Its gradient, ``-4 s (1 - s) ratio A grad(logprobs)`` with ``s`` the sigmoid, is the plain one at ratio 1
    and fades smoothly as the ratio leaves 1, faster for the larger temperature."""
    temperature = torch.where(advantages > 0, config.sapo_temperature_pos, config.sapo_temperature_neg)
    gate = torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature
    return -gate * advantages * loss_mask


def dppo_term(
    logprobs: Float[Tensor, " seq"],
    inference_logprobs: Float[Tensor, " seq"],
    advantages: Float[Tensor, " seq"],
    loss_mask: Bool[Tensor, " seq"],
    config: LossConfig,
) -> tuple[Float[Tensor, " seq"], Bool[Tensor, " seq"]]:
    """prime-rl's default policy term (DPPO's binary trust region by probability, arXiv 2602.04879, with Kimi K2.5's
    squared-log-ratio term, arXiv 2602.02276) at each token, and the loss tokens it masked. Naive equivalent, with
    ``d = exp(logprobs) - exp(inference_logprobs)`` (probabilities, not their ratio) and ``r = exp(logprobs -
    inference_logprobs)``: ``-r * A * keep + dppo_kl_coef * log(r) ** 2``, where ``keep`` is false at ``A > 0, d >
    dppo_high`` and at ``A < 0, d < -dppo_low``. The defaults (0.2, 0.2, 1e-3) are prime-rl's ``DefaultLossConfig``
    (its ``adv_tau``, a factor on A, is left out: 1 there)."""
    log_ratio = (logprobs - inference_logprobs) * loss_mask
    change = logprobs.detach().exp() - inference_logprobs.exp()
    masked = loss_mask & (
        ((advantages > 0) & (change > config.dppo_high)) | ((advantages < 0) & (change < -config.dppo_low))
    )
    per_token = -log_ratio.exp() * advantages * (loss_mask & ~masked) + config.dppo_kl_coef * log_ratio**2
    return per_token, masked


def cross_entropy_term(
    logprobs: Float[Tensor, " seq"], ce_weights: Float[Tensor, " seq"], num_ce_tokens: int
) -> Float[Tensor, ""]:
    """The cross-entropy component of one packed micro-batch: ``-sum(w * logprobs) / num_ce_tokens``, where
    ``num_ce_tokens`` counts the whole step's tokens with a weight (not 0), so that it is normalized over its own
    tokens whatever else the step trains, and summing the micro-batches' terms gives the step's."""
    return -(ce_weights * logprobs).sum() / max(num_ce_tokens, 1)


def policy_loss(
    logprobs: Float[Tensor, " seq"],
    inference_logprobs: Float[Tensor, " seq"],
    advantages: Float[Tensor, " seq"],
    loss_mask: Bool[Tensor, " seq"],
    sample_lengths: Int[Tensor, " samples"],
    config: LossConfig,
    num_loss_tokens: int,
    num_samples: int,
    entropy: Float[Tensor, " seq"] | None = None,
    reference_logprobs: Float[Tensor, " seq"] | None = None,
    entropy_mask: Bool[Tensor, " seq"] | None = None,
    staleness: Int[Tensor, " seq"] | None = None,
) -> tuple[Float[Tensor, ""], dict[str, Tensor]]:
    """The importance-weighted policy-gradient loss of one packed micro-batch (formulas in docs/losses.md).

    ``ratio = exp(logprobs - inference_logprobs)`` per token, or per sample as the exp of its mean token log
    ratio (``config.ratio = "sequence"``, GSPO). Bounded by masking tokens whose ratio leaves
    ``[mask_low, mask_high]`` (IcePop) or by PPO clipping to ``[1 - clip_low, 1 + clip_high]``; or, by
    ``config.bound``, :func:`cispo_term`, :func:`sapo_term` or :func:`dppo_term` is the policy term. A user's function
    named by ``config.custom`` replaces all of these: called by keyword with ``logprobs``, ``inference_logprobs``,
    ``advantages``, ``loss_mask`` (the staleness bound applied) and ``sample_lengths``, it returns the policy term at
    each token, counted at the loss tokens only. The normalizers (``num_loss_tokens``, ``num_samples``) are the whole
    step's, so summing the micro-batches' losses gives the step's loss however the batch was split. Returned metrics
    are sums over this micro-batch; ``bounded_tokens`` counts the loss tokens masked or clipped (left out with
    ``sapo``, which does neither, and with a custom term).

    With an off-policy correction (``config.correction``) the policy term weighs each token by the fixed weight of
    :func:`correction_weights` instead of the ratio (``-w * A``, gradient ``-w * A * grad(logprobs)``); bound
    ``mask`` still drops the tokens it drops. ``corrected_tokens`` and ``corrected_samples`` count the loss tokens
    whose weight was truncated or masked, and the samples holding any.

    Each loss token also gets ``- entropy_coef * entropy`` (an entropy bonus) and, given the frozen reference
    model's logprobs, ``+ kl_coef * k3`` with ``k3 = exp(ref - logprobs) - (ref - logprobs) - 1`` (a KL penalty
    towards the reference), normalized like the policy term.

    ``sample_lengths`` stay on the host (all the rest is on the device): nothing here waits for the device. The
    ``entropy`` metric sums the entropy over ``entropy_mask`` (the loss tokens when None), counted in
    ``entropy_tokens``.

    ``staleness`` (per token: steps between the weights that sampled it and the newest its step could have) drops
    the loss tokens staler than ``config.max_token_staleness`` from the loss, as if not sampled (counted in
    ``too_stale_tokens``); ``token_staleness`` and ``stale_tokens`` sum it, and count the tokens stale at all, over
    the loss tokens. Each token's ratio is against the logprob of the weights that sampled it (``inference_logprobs``),
    so corrections are per token whichever weights sampled it.
    """
    if staleness is not None:
        staleness = staleness * loss_mask
        if config.max_token_staleness is not None:
            too_stale = staleness > config.max_token_staleness
            stale_metrics = {"too_stale_tokens": too_stale.sum()}
            loss_mask = loss_mask & ~too_stale
        else:
            stale_metrics = {}
        stale_metrics |= {"token_staleness": staleness.sum(), "stale_tokens": (staleness > 0).sum()}
    segment = sample_segments(sample_lengths.cpu()).to(logprobs.device, non_blocking=True)
    token_log_ratio = (logprobs - inference_logprobs) * loss_mask
    tokens_per_sample = sample_sums(loss_mask.float(), segment, len(sample_lengths))
    log_ratio = token_log_ratio
    if config.ratio == "sequence":
        sequence_log_ratio = sample_sums(token_log_ratio, segment, len(sample_lengths)) / tokens_per_sample.clamp(min=1)
        log_ratio = sequence_log_ratio[segment] * loss_mask
    ratio = torch.exp(log_ratio)
    weight = ratio  # the policy term's importance weight, through which the gradient flows
    if config.correction != "none":
        fixed_weight, corrected = correction_weights(token_log_ratio, segment, tokens_per_sample, config)
        corrected = corrected & loss_mask
        weight = fixed_weight * torch.exp(logprobs - logprobs.detach())  # its value; gradient: fixed_weight · ∇logp
    bounded = None  # the loss tokens masked or clipped, where the term has such
    if config.custom is not None:
        custom = import_custom_loss(config.custom)
        per_token = custom(
            logprobs=logprobs,
            inference_logprobs=inference_logprobs,
            advantages=advantages,
            loss_mask=loss_mask,
            sample_lengths=sample_lengths,
        )
        per_token = per_token * loss_mask
    elif config.bound == "mask":
        bounded = loss_mask & ((ratio < config.mask_low) | (ratio > config.mask_high))
        per_token = -weight * advantages * (loss_mask & ~bounded)
    elif config.bound == "clip":
        clipped = ratio.clamp(1 - config.clip_low, 1 + config.clip_high)
        bounded = loss_mask & (clipped * advantages < ratio * advantages)  # the clipped term is the minimum
        per_token = -torch.minimum(ratio * advantages, clipped * advantages) * loss_mask
    elif config.bound == "cispo":
        per_token, bounded = cispo_term(ratio, logprobs, advantages, loss_mask, config)
    elif config.bound == "sapo":
        per_token = sapo_term(ratio, advantages, loss_mask, config)
    else:
        per_token, bounded = dppo_term(logprobs, inference_logprobs, advantages, loss_mask, config)
    if config.entropy_coef > 0:
        per_token = per_token - config.entropy_coef * entropy * loss_mask
    if reference_logprobs is not None:
        reference_log_ratio = (reference_logprobs - logprobs) * loss_mask
        reference_kl = reference_log_ratio.exp() - reference_log_ratio - 1
        per_token = per_token + config.kl_coef * reference_kl
    if config.normalization == "token":
        loss = per_token.sum() / num_loss_tokens
    elif config.normalization == "sequence":
        per_sample = sample_sums(per_token, segment, len(sample_lengths)) / tokens_per_sample.clamp(min=1)
        loss = per_sample.sum() / num_samples
    else:
        loss = per_token.sum() / (num_samples * config.norm_length)
    with torch.no_grad():
        metrics = {} if bounded is None else {"bounded_tokens": bounded.sum()}
        metrics["mismatch_kl"] = mismatch_kl(logprobs, inference_logprobs, loss_mask)
        if entropy is not None:
            entropy_mask = loss_mask if entropy_mask is None else entropy_mask
            metrics["entropy"] = (entropy * entropy_mask).sum()
            metrics["entropy_tokens"] = entropy_mask.sum()
        if reference_logprobs is not None:
            metrics["reference_kl"] = reference_kl.sum()
        if staleness is not None:
            metrics |= stale_metrics
        if config.correction != "none":
            metrics["corrected_tokens"] = corrected.sum()
            corrected_per_sample = sample_sums(corrected.float(), segment, len(sample_lengths))
            metrics["corrected_samples"] = (corrected_per_sample > 0).sum()
    return loss, metrics
