"""The server's sampling truncation (banned tokens, top_p, top_k, min_p), replayed on the trainer's logits.

vLLM 0.32 samples each token from the softmax of the kept tokens only, and returns its logprob under that
renormalised distribution (``processed_logprobs``). The trainer scores the token the same way: it finds the kept
set from its own logits by vLLM's rules, in vLLM's order, and normalises over that set. The sampled token always
counts as kept: where the trainer's logits differ from the server's (another dtype, newer weights), a token the
server kept may fall just outside the trainer's set, and its logprob must stay finite.
"""

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from contracts.sampling import Truncation


def kept_tokens(logits: Float[Tensor, "... vocab"], truncation: Truncation) -> Bool[Tensor, "... vocab"]:
    """Which tokens vLLM keeps, from logits already divided by the temperature.

    Naive equivalent, per position: drop the banned tokens; then (``p = softmax`` of the rest) drop
    ``p < min_p * max(p)``; of the rest, drop those below the ``top_k``-th largest logit; of the rest, sorted by
    logit ascending and renormalised, drop those whose running sum is at most ``1 - top_p`` (the likeliest always
    stays). As vLLM's
    ``MinPLogitsProcessor`` and ``apply_top_k_top_p_pytorch`` compute them, so that boundaries agree to rounding.
    """
    logits = logits.detach()  # a set of tokens: no gradient flows through it
    keep = torch.ones_like(logits, dtype=torch.bool)
    if truncation.banned:
        keep[..., list(truncation.banned)] = False
        logits = logits.masked_fill(~keep, -torch.inf)
    if truncation.min_p > 0:
        probs = logits.softmax(-1)
        keep &= probs >= probs.amax(-1, keepdim=True) * truncation.min_p
    if 0 < truncation.top_k < logits.shape[-1]:
        kth = logits.masked_fill(~keep, -torch.inf).topk(truncation.top_k, -1).values[..., -1:]
        keep &= logits >= kth
    if truncation.top_p < 1:
        ascending, order = logits.masked_fill(~keep, -torch.inf).sort(-1)
        dropped = ascending.softmax(-1).cumsum(-1) <= 1 - truncation.top_p
        dropped[..., -1] = False
        keep &= ~dropped.scatter(-1, order, dropped)
    return keep


def truncated_logits(
    logits: Float[Tensor, "... vocab"], targets: Int[Tensor, "..."], truncation: Truncation
) -> tuple[Float[Tensor, "... vocab"], Bool[Tensor, "..."]]:
    """``logits`` (after temperature) with the tokens the server dropped at ``-inf``, each target kept: their
    ``log_softmax`` is the distribution the server sampled from. Gradients flow through the kept logits. Also
    whether each target lay outside the kept set (kept all the same)."""
    keep = kept_tokens(logits, truncation)
    outside = ~keep.gather(-1, targets[..., None])[..., 0]
    keep.scatter_(-1, targets[..., None], True)
    return logits.masked_fill(~keep, -torch.inf), outside
