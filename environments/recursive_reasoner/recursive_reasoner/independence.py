"""How independent a plan's subproblems are: the mean pairwise dissimilarity of their texts, in [0, 1].

- Lexical (the default): the dissimilarity of two subproblems is ``1 - |A ∩ B| / |A ∪ B|`` (Jaccard distance),
  where A and B are their sets of words (lower-cased runs of letters and digits, so numbers count). Two texts
  without words are identical (0).
- Embeddings (``embedding_model_path`` set): ``1 - cos(u, v)`` of their sentence embeddings, clipped to [0, 1].
  The model is a local sentence-transformers folder, loaded with the optional ``sentence-transformers`` package
  (installed separately: ``uv pip install sentence-transformers``) on first use and kept for the process.

Fewer than two subproblems have no pairs: their independence is 0.
"""

import functools
import math
import re
import statistics
from collections.abc import Callable, Sequence
from itertools import combinations
from typing import TypeVar

T = TypeVar("T")
Measure = Callable[[Sequence[str]], float]
"""Independence of a list of subproblems."""

_WORD = re.compile(r"[^\W_]+")


def word_set(text: str) -> frozenset[str]:
    """The text's words, lower-cased: ``"Ben buys 5 pens."`` -> ``{"ben", "buys", "5", "pens"}``."""
    return frozenset(_WORD.findall(text.lower()))


def jaccard_distance(a: frozenset[str], b: frozenset[str]) -> float:
    """``1 - |a ∩ b| / |a ∪ b|``; 0 for two empty sets."""
    union = a | b
    return 1.0 - len(a & b) / len(union) if union else 0.0


def cosine_distance(u: Sequence[float], v: Sequence[float]) -> float:
    """``1 - cos(u, v)`` clipped to [0, 1]; 1 when either vector is zero."""
    norms = math.sqrt(math.fsum(x * x for x in u)) * math.sqrt(math.fsum(y * y for y in v))
    if norms == 0.0:
        return 1.0
    return min(1.0, max(0.0, 1.0 - math.fsum(x * y for x, y in zip(u, v, strict=True)) / norms))


def mean_pairwise(items: Sequence[T], distance: Callable[[T, T], float]) -> float:
    """The mean ``distance`` over all unordered pairs of ``items``; 0 with fewer than two items."""
    pairs = list(combinations(items, 2))
    return statistics.fmean(distance(a, b) for a, b in pairs) if pairs else 0.0


def lexical_independence(subproblems: Sequence[str]) -> float:
    return mean_pairwise([word_set(s) for s in subproblems], jaccard_distance)


def embedding_independence(embeddings: Sequence[Sequence[float]]) -> float:
    return mean_pairwise(embeddings, cosine_distance)


@functools.cache
def independence_measure(embedding_model_path: str | None) -> Measure:
    """The lexical measure, or the embedding one with the model at ``embedding_model_path`` (loaded once)."""
    if embedding_model_path is None:
        return lexical_independence
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        raise ImportError(
            "embedding_model_path needs the sentence-transformers package (uv pip install sentence-transformers), "
            "or leave embedding_model_path unset for the lexical measure"
        ) from None
    model = SentenceTransformer(embedding_model_path, local_files_only=True)

    def measure(subproblems: Sequence[str]) -> float:
        if len(subproblems) < 2:
            return 0.0
        return embedding_independence([[float(x) for x in row] for row in model.encode(list(subproblems))])

    return measure


__all__ = [
    "Measure",
    "cosine_distance",
    "embedding_independence",
    "independence_measure",
    "jaccard_distance",
    "lexical_independence",
    "mean_pairwise",
    "word_set",
]
