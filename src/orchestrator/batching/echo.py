"""ECHO-style cross-entropy on the environment's tokens: besides the policy loss on its sampled tokens, a rollout
trains the policy to predict what the environment answered (tool results, by default), read off its chat turns by
message role as the loss-mask checker reads them (:func:`contracts.chat_turns.segment`)."""

from contracts.chat_turns import CONTENT, ChatFormat, segment
from orchestrator.batching.rollout import Rollout


def echo_weights(token_ids: list[int], loss_mask: list[bool], chat: ChatFormat, roles: list[str],
                 coef: float) -> list[float]:  # fmt: skip
    """Each token's cross-entropy weight: ``coef`` on the content of a turn whose role is in ``roles`` (``tool``: a
    tool's answer, however the template wraps it), 0 on turn headers and template, sampled tokens and the first
    token (it has no context)."""
    seg = segment(token_ids, chat, loss_mask)
    return [coef if i and not sampled and seg.roles[i] in roles and seg.parts[i] == CONTENT else 0.0
            for i, sampled in enumerate(loss_mask)]  # fmt: skip


def set_echo_weights(groups: list[list[Rollout]], chat: ChatFormat, roles: list[str], coef: float) -> None:
    """Set ``ce_weights`` (:func:`echo_weights`) on every branch of the finished rollouts of ``groups``."""
    for branch in (b for group in groups for r in group if r.ok for b in r.branches):
        branch.ce_weights = echo_weights(branch.token_ids, branch.loss_mask, chat, roles, coef)
        branch.ce_roles = list(roles)
