"""The policy-gradient loss, as small pure functions over packed token tensors."""

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor


def selective_log_softmax(logits: Float[Tensor, "seq vocab"], ids: Int[Tensor, " seq"]) -> Float[Tensor, " seq"]:
    """``log_softmax(logits)[i, ids[i]]`` for each position i, without materialising a second vocab-wide tensor
    beyond the logsumexp."""
    return logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def shifted_logprobs(
    logits: Float[Tensor, "seq vocab"], input_ids: Int[Tensor, " seq"], temperature: float
) -> Float[Tensor, " seq"]:
    """Logprob of each token given the ones before it, after temperature (position 0 gets 0).

    Naive equivalent: ``[log_softmax(logits[i - 1] / T)[input_ids[i]] for i in 1..seq-1]``, 0 prepended.
    Matches vLLM's processed logprobs, so the importance ratio at step 0 is 1.
    """
    logprobs = selective_log_softmax(logits[:-1].float() / temperature, input_ids[1:])
    return torch.cat([logprobs.new_zeros(1), logprobs])


def policy_loss(
    logprobs: Float[Tensor, " seq"],
    inference_logprobs: Float[Tensor, " seq"],
    advantages: Float[Tensor, " seq"],
    loss_mask: Bool[Tensor, " seq"],
    normalizer: int,
    mask_low: float,
    mask_high: float,
) -> tuple[Float[Tensor, ""], dict[str, Tensor]]:
    """Importance-weighted policy gradient with out-of-region tokens masked (IcePop-style).

    ``ratio = exp(logprobs - inference_logprobs)``; tokens with ``ratio`` outside ``[mask_low, mask_high]``
    get no gradient. ``loss = -sum(ratio * advantages * kept) / normalizer``, where ``normalizer`` is the number
    of loss tokens in the whole step, so summing the losses of micro-batches gives the step's token mean
    however the batch was split. Returned metrics are sums over this micro-batch's loss tokens.
    """
    log_ratio = (logprobs - inference_logprobs) * loss_mask
    ratio = torch.exp(log_ratio)
    in_region = (ratio >= mask_low) & (ratio <= mask_high)
    kept = loss_mask & in_region
    loss = -(ratio * advantages * kept).sum() / normalizer
    with torch.no_grad():
        log_ratio64 = log_ratio.double()  # ratio - 1 - log_ratio cancels to 0 in fp32 for tiny mismatches
        metrics = {
            "masked_tokens": (loss_mask & ~in_region).sum(),
            # k3 estimator of KL(inference || trainer), summed over loss tokens
            "mismatch_kl": ((log_ratio64.exp() - 1 - log_ratio64) * loss_mask).sum(),
        }
    return loss, metrics
