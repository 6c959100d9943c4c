"""A tiny randomly initialised Llama for tests and benchmarks, built offline (no download).

Greedy decoding of random weights is deterministic for a given directory, which is all a KV-connector test
needs: the same prompt must give the same tokens whether its KV was computed or loaded. Prompts are token
ids (engines run with ``skip_tokenizer_init=True``), so no tokenizer is built.
"""

from __future__ import annotations

import json
import os

TINY_CONFIG = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
               "max_position_embeddings": 16384, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
#: Llama-3-8B's KV shape per layer (8 KV heads of 128) with thin other weights and 8 layers, so that a 128-token
#: block is 8 x 512 KiB = 4 MiB in bf16, as in a real deployment: the benchmark's realistic geometry.
KV_REALISTIC_CONFIG = {**TINY_CONFIG, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 8,
                       "head_dim": 128, "num_hidden_layers": 8}
_MARKER = "kvstore-tiny-model.json"


def build_tiny_llama(directory: str, *, seed: int = 0, dtype: str = "float32", config: dict | None = None) -> str:
    """Write a tiny Llama (safetensors + config.json) into ``directory`` unless it is already there; return it.

    Needs ``transformers`` (the ``vllm`` extra). ``dtype`` is the checkpoint's torch dtype name; ``config``
    replaces :data:`TINY_CONFIG` (e.g. :data:`KV_REALISTIC_CONFIG`)."""
    config = config or TINY_CONFIG
    marker = os.path.join(directory, _MARKER)
    wanted = {"config": config, "seed": seed, "dtype": dtype}
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == wanted:
                return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config, torch_dtype=dtype)).to(getattr(torch, dtype))
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    with open(marker, "w") as f:
        json.dump(wanted, f)
    return directory


def build_tiny_tokenizer(directory: str) -> str:
    """Write a word-level tokenizer for the tiny Llama into ``directory`` (a Hugging Face fast tokenizer with a
    chat template), so that an OpenAI server can serve text prompts, chat and ``/tokenize`` on it; return it.

    Its vocabulary is the model's: ``<unk>`` (0), ``<s>`` (1), ``</s>`` (2), then the words ``w3`` … ``w1023``;
    text splits on whitespace and punctuation, and any other word is ``<unk>``. Offline, deterministic."""
    if os.path.exists(os.path.join(directory, "tokenizer.json")):
        return directory
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, TINY_CONFIG["vocab_size"])}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant:{% endif %}")
    os.makedirs(directory, exist_ok=True)
    fast.save_pretrained(directory)
    return directory
