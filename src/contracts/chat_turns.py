"""A sample's tokens cut into chat turns: which role each token belongs to and which part of its turn (header,
template, content, turn end), at its chat family's markers as a tokenizer's ids. The loss-mask checker
(:mod:`tools.rollout_check`) checks masks with it; ECHO (:mod:`orchestrator.batching.echo`) weighs the environment's
turns with it."""

from dataclasses import dataclass, field

from contracts.chat_family import FAMILIES, ChatFamily, detect_family, family_by_markers, local_model_type
from contracts.errors import TridentError
from contracts.images import placeholder_runs

HEADER, SCAFFOLD, CONTENT, END, SEPARATOR, OUTSIDE = "header", "scaffold", "content", "end", "separator", "outside"


class ChatFormatError(TridentError):
    """A tokenizer without the turn markers of any (or the named) chat family."""


@dataclass
class ChatFormat:
    """A chat family's turn markers (:class:`~contracts.chat_family.ChatFamily`) as a tokenizer's ids, and cached
    per-token text."""

    tokenizer: object
    family: ChatFamily
    turn_start: int
    turn_end: int
    tool_response: int | None  # the family's tool-response token, when it is a single id of this tokenizer
    stop_ids: frozenset[int]  # tokens that end a reply besides turn_end (the server may add turn_end itself)
    vocab_size: int
    image_pad: int | None = None  # the family's image placeholder, when it has one and the tokenizer too
    _pieces: dict[int, str] = field(default_factory=dict, repr=False)

    @classmethod
    def from_tokenizer(cls, tokenizer, family: ChatFamily | None = None) -> "ChatFormat":
        """The format of ``family``; else of the family of the tokenizer's model (its folder's model_type and its
        tokens); else of the first family whose turn markers the tokenizer has."""
        name = getattr(tokenizer, "name_or_path", "")
        vocab = tokenizer.get_vocab()
        model_type = local_model_type(name) if name else None
        family = family or (model_type and detect_family(model_type, vocab)) or family_by_markers(vocab)
        if family is None:
            markers = "; ".join(f"{f.name}: {f.turn_start} {f.turn_end}" for f in FAMILIES.values())
            raise ChatFormatError(f"tokenizer {name!r} has the turn markers of no chat family ({markers})")

        def token_id(token: str | None) -> int | None:  # None when the vocabulary lacks it (it maps to unknown)
            tid = tokenizer.convert_tokens_to_ids(token) if token else None
            known = tid != tokenizer.unk_token_id or token == tokenizer.unk_token  # Qwen2's unknown is <|endoftext|>
            return tid if isinstance(tid, int) and known else None

        turn_start, turn_end = token_id(family.turn_start), token_id(family.turn_end)
        if turn_start is None or turn_end is None:
            raise ChatFormatError(
                f"tokenizer {name!r} lacks the turn markers of chat family {family.name!r}: "
                f"{family.turn_start} and {family.turn_end} as single tokens"
            )
        stops = frozenset({token_id(t) for t in (family.end_of_text, *family.other_stops)} - {None})
        return cls(tokenizer, family, turn_start, turn_end, token_id(family.tool_response), stops, len(tokenizer),
                   token_id(family.image_pad))  # fmt: skip

    def image_runs(self, token_ids: list[int]) -> list[tuple[int, int]]:
        """``(start, length)`` of each image's placeholder run (:func:`contracts.images.placeholder_runs`)."""
        return placeholder_runs(token_ids, self.image_pad) if self.image_pad is not None else []

    def text(self, token_ids: list[int]) -> str:
        """The text of consecutive tokens, decoded together (characters split over tokens come out whole)."""
        out: list[str] = []
        known: list[int] = []
        for token_id in [*token_ids, -1]:
            if 0 <= token_id < self.vocab_size:
                known.append(token_id)
                continue
            if known:
                out.append(self.tokenizer.decode(known, skip_special_tokens=False))
                known = []
            if token_id != -1:
                out.append(self.piece(token_id))
        return "".join(out)

    def piece(self, token_id: int) -> str:
        """The text of one token (special tokens included)."""
        if token_id not in self._pieces:
            if 0 <= token_id < self.vocab_size:
                self._pieces[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
            else:
                self._pieces[token_id] = f"<?{token_id}?>"
        return self._pieces[token_id]


@dataclass
class Turn:
    index: int
    role: str  # system, user, tool, assistant, or whatever the header names
    start: int  # position of its turn start (<|im_start|>, <|start_header_id|>)
    content_start: int  # first token after the header (and, for the assistant, the scaffold)
    end: int  # exclusive; includes the turn end (END) and the template after it (SEPARATOR)
    closed: bool  # False when the sample ends (or a new turn starts) before its turn end (or a reply's stop token)


@dataclass
class Segmentation:
    turns: list[Turn]
    roles: list[str]  # per token: its turn's role, "outside" between turns
    parts: list[str]  # per token: HEADER, SCAFFOLD, CONTENT, END, SEPARATOR or OUTSIDE


def _sampled_inside(i: int, token_ids: list[int], sampled: list[bool] | None, chat: ChatFormat) -> bool:
    """Whether the turn start or stop token at ``i`` is content of an open reply: the model sampled it, and after a
    stop token went on sampling (its generation config does not stop there). A turn end right after a stop token is
    read as the one the server adds, never as sampled."""
    if sampled is None or i >= len(sampled) or not sampled[i]:
        return False
    went_on = i + 1 < len(sampled) and sampled[i + 1] and token_ids[i + 1] != chat.turn_end
    return token_ids[i] == chat.turn_start or (token_ids[i] in chat.stop_ids and went_on)


def segment(token_ids: list[int], chat: ChatFormat, sampled: list[bool] | None = None) -> Segmentation:
    """Cut a sample's tokens into chat turns: which role each token belongs to, and which part of its turn.

    A ``<|im_start|>`` the model itself sampled inside its open reply (``sampled``, e.g. the loss mask) is
    content of that reply, not the header of a new turn: random or early models emit it. So is a stop token such as
    ``<|endoftext|>`` it sampled and then sampled more after (a server that stops only at ``<|im_end|>``).
    """
    n = len(token_ids)
    roles, parts = [OUTSIDE] * n, [OUTSIDE] * n
    turns: list[Turn] = []
    i = 0
    while i < n:
        if token_ids[i] != chat.turn_start:
            i += 1
            continue
        start = i
        header_end, role = _read_header(token_ids, i, chat)
        i = header_end
        if (role == "user" and _starts_tool_response(token_ids, header_end, chat)) or role in chat.family.tool_roles:
            role = "tool"
        content_start = header_end
        if role == "assistant" and chat.family.scaffold:  # the template's prefill, e.g. an empty think block
            content_start = _skip_text(token_ids, header_end, chat.family.scaffold, chat) or header_end
        # Content runs to the turn end or, in a reply, another stop token (the server may add the turn end after it).
        stops = {chat.turn_start, chat.turn_end} | (chat.stop_ids if role == "assistant" else set())
        while i < n and (
            token_ids[i] not in stops or (role == "assistant" and _sampled_inside(i, token_ids, sampled, chat))
        ):
            i += 1
        content_end = i
        closed = i < n and token_ids[i] != chat.turn_start
        end = i + 1 if closed else i
        if closed and token_ids[i] != chat.turn_end and end < n and token_ids[end] == chat.turn_end:
            end += 1
        if closed and end < n and token_ids[end] != chat.turn_start and chat.piece(token_ids[end]).isspace():
            end += 1
        turn = Turn(len(turns), role, start, content_start, end, closed)
        turns.append(turn)
        for j in range(start, end):
            roles[j] = role
            if j < content_end:
                parts[j] = HEADER if j < header_end else SCAFFOLD if j < content_start else CONTENT
            else:
                parts[j] = END if j == content_end else SEPARATOR
        i = end
    return Segmentation(turns, roles, parts)


def _read_header(token_ids: list[int], start: int, chat: ChatFormat) -> tuple[int, str]:
    """Where the header of the turn opening at ``start`` ends, and the role it names: the tokens up to and including
    the family's ``role_end`` (ChatML's newline, Llama 3's ``<|end_header_id|>`` and blank line)."""
    n, role_end = len(token_ids), chat.family.role_end
    header_text, i = "", start + 1
    while i < n and token_ids[i] not in (chat.turn_start, chat.turn_end) and role_end not in header_text:
        header_text += chat.piece(token_ids[i])
        i += 1
    return i, header_text.partition(role_end)[0].strip() or "unknown"


def _starts_tool_response(token_ids: list[int], i: int, chat: ChatFormat) -> bool:
    marker = chat.family.tool_response
    while i < len(token_ids) and chat.piece(token_ids[i]).isspace():
        i += 1
    if marker is None or i >= len(token_ids):
        return False
    if chat.tool_response is not None:
        return token_ids[i] == chat.tool_response
    return chat.piece(token_ids[i]).startswith(marker)


def _skip_text(token_ids: list[int], i: int, text: str, chat: ChatFormat) -> int | None:
    """The position after the tokens from ``i`` that spell exactly ``text``, or None."""
    seen = ""
    while seen != text:
        if i >= len(token_ids):
            return None
        seen += chat.piece(token_ids[i])
        if not text.startswith(seen):
            return None
        i += 1
    return i
