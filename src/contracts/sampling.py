"""How the server sampled each token, beyond temperature: the truncation the trainer replays when it scores it.

vLLM 0.32's sampler (``vllm/v1/sample/sampler.py``) divides the logits by the temperature, applies ``min_p``
(a logits processor), then ``top_k`` and ``top_p`` (``ops/topk_topp_sampler.py``), and samples from the
softmax of what is left; with ``--logprobs-mode processed_logprobs`` the logprob it returns is the token's under
that truncated, renormalised distribution. docs/sampling.md says how the trainer replays it and what it costs.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Truncation:
    """Which tokens the server's sampler kept at each position, after temperature, in vLLM's order: ``min_p``
    (tokens less likely than ``min_p`` times the likeliest), then ``top_k`` (the ``top_k`` likeliest), then
    ``top_p`` (the likeliest whose mass reaches ``top_p``); it sampled from the kept tokens renormalised, and the
    trainer scores each token the same way. The defaults (1, 0, 0) keep every token. ``banned``: token ids the
    server never samples (vLLM's ``bad_words``, set to -inf before all else: a vision-language model's image
    markers, which a reply must not hold)."""

    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # in [0, 1)
    banned: tuple[int, ...] = ()

    @property
    def on(self) -> bool:
        """Whether any token is ever dropped."""
        return self.top_p < 1 or self.top_k > 0 or self.min_p > 0 or bool(self.banned)

    def problem(self) -> str | None:
        """What is out of range, or None."""
        if not 0 < self.top_p <= 1:
            return f"top_p is {self.top_p}, expected a number in (0, 1]"
        if self.top_k < 0:
            return f"top_k is {self.top_k}, expected 0 (off) or a positive count"
        if not 0 <= self.min_p < 1:
            return f"min_p is {self.min_p}, expected a number in [0, 1)"
        if any(token < 0 for token in self.banned):
            return f"banned holds {min(self.banned)}, expected token ids"
        return None


NO_TRUNCATION = Truncation()  # every token kept: the server samples from the whole softmax
