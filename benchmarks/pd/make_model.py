"""``python -m benchmarks.pd make-model``: a local random-weight Llama for the vLLM comparison (no download).

The model is sized so that on a CPU core a long prompt's prefill costs what it should relative to a decode
step (the ratio is what the prefill/decode question is about; the absolute speed is the machine's). Weights
are seeded, so greedy outputs are a function of the directory; prompts are token ids (engines run with
``skip_tokenizer_init=True``), so no tokenizer is written.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

_MARKER = "benchmarks-pd-model.json"


@dataclass(frozen=True, slots=True)
class LlamaShape:
    layers: int = 4
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 1408
    vocab: int = 4096
    max_position: int = 8192
    seed: int = 0
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "max_position"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model {name} must be a positive int, got {value!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden ({self.hidden}) must divide by heads ({self.heads}) and heads by "
                             f"kv_heads ({self.kv_heads})")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {self.dtype!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def hf_config(self) -> dict:
        return {"vocab_size": self.vocab, "hidden_size": self.hidden, "intermediate_size": self.intermediate,
                "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
                "max_position_embeddings": self.max_position, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}

    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * (4 if self.dtype == "float32" else 2)


def make_model(shape: LlamaShape, out: str | Path) -> Path:
    """Write ``shape`` as a Llama checkpoint (safetensors + config.json) into ``out`` unless it is already
    there; returns the directory. Needs ``transformers`` (the ``vllm`` extra)."""
    out = Path(out)
    marker = out / _MARKER
    wanted = dataclasses.asdict(shape)
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(shape.seed)
    model = LlamaForCausalLM(LlamaConfig(**shape.hf_config(), torch_dtype=shape.dtype))
    model = model.to(getattr(torch, shape.dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    marker.write_text(json.dumps(wanted) + "\n")
    return out


def read_shape(model_dir: str | Path) -> dict:
    """The Hugging Face config of a model directory (vocab size, layers, ...) for sizing traces."""
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{model_dir} is not a model directory (no readable config.json: {exc})") from None


def add_parser(sub) -> None:
    p = sub.add_parser("make-model", help="write a local random-weight Llama for --engine vllm")
    d = LlamaShape()
    for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "max_position", "seed"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    p.add_argument("--dtype", default=d.dtype, choices=["bfloat16", "float16", "float32"])
    p.add_argument("--out", type=Path, required=True)


def main_make_model(args) -> int:
    shape = LlamaShape(args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate, args.vocab,
                       args.max_position, args.seed, args.dtype)
    out = make_model(shape, args.out)
    n = sum(1 for _ in out.glob("*.safetensors"))
    print(f"{out}: Llama {shape.layers} layers x {shape.hidden} hidden, {shape.heads}/{shape.kv_heads} heads, "
          f"vocab {shape.vocab}, {shape.dtype}; {shape.kv_bytes_per_token()} KV bytes/token; {n} safetensors file(s)")
    return 0
