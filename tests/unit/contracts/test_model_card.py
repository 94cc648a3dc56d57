"""Each fact about a model is read in one place: only the model card's module (contracts/model_card.py) opens a
model's config.json or asks transformers for a model's config; every process and the launcher read the card."""

import ast
from pathlib import Path

SRC = Path(__file__).parents[3] / "src"
CARD = Path("contracts/model_card.py")
# a module that writes a model's config.json, and reads no fact from it: the trainer's file transport (it records the
# dtype of the weights it wrote)
WRITERS = {Path("trainer/transports/files.py")}


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring constants of ``tree``'s module, classes and functions."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
        ):
            found.add(id(body[0].value))
    return found


def config_readers(source: str) -> list[str]:
    """What in ``source`` reads a model's config: the name ``config.json`` in code (not in a docstring), or
    ``AutoConfig.from_pretrained``."""
    tree = ast.parse(source)
    skipped = docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) not in skipped and isinstance(node.value, str):
            if node.value.endswith("config.json") and not node.value.endswith(("_config.json", "adapter_config.json")):
                found.append(f"line {node.lineno}: {node.value!r}")
        if isinstance(node, ast.Attribute) and node.attr == "from_pretrained":
            if isinstance(node.value, ast.Name) and node.value.id == "AutoConfig":
                found.append(f"line {node.lineno}: AutoConfig.from_pretrained")
    return found


def test_only_the_model_card_reads_a_models_config():
    readers = {}
    for path in sorted(SRC.rglob("*.py")):
        module = path.relative_to(SRC)
        if module in {CARD, *WRITERS}:
            continue
        if found := config_readers(path.read_text()):
            readers[str(module)] = found
    assert readers == {}, f"read a model's config outside {CARD} (read its ModelCard instead): {readers}"
    assert config_readers((SRC / CARD).read_text())  # the scan finds the card's own reads


def test_the_scan_finds_each_way_of_reading_a_config():
    assert config_readers('json.loads((Path(folder) / "config.json").read_text())')
    assert config_readers("AutoConfig.from_pretrained(path).model_type")
    assert not config_readers('def f():\n    """Reads config.json."""\n')
    assert not config_readers('folder / "tokenizer_config.json"')
