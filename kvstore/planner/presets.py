"""Named models, accelerators and links, each figure with its public source.

Model geometry comes from each model's ``config.json`` on Hugging Face; parameter counts from the model
card (and are cross-checked against the geometry in tests/test_planner.py). GPU figures are NVIDIA's
datasheet values for the SXM parts, BF16 *dense* (the datasheets print the 2:4-sparsity figure, twice
this). Link rates are one direction's line rate from the interface specs; link latencies are *assumed*
per-transfer setup costs (handshake + completion), not spec values, and are marked so.

The small CPU engine of ``benchmarks/pd`` ("pd-tiny" on "cpu-2core", link "shm") is described by a cost
model rather than datasheet figures: its numbers are placeholders of the right order until
``kvstore plan --calibrate DIR --save FILE`` replaces them with fitted ones (``--cost-model FILE``).
"""

from __future__ import annotations

from kvstore.planner.costmodel import CostModel, TransferModel, from_specs
from kvstore.planner.specs import Efficiency, GPUSpec, LinkSpec, ModelSpec

GB = 1e9
_HF = "https://huggingface.co/{}/blob/main/config.json"

MODELS: dict[str, ModelSpec] = {
    # hidden_size 4096, intermediate_size 14336, num_hidden_layers 32, num_attention_heads 32,
    # num_key_value_heads 8, vocab_size 128256, max_position_embeddings 8192, torch_dtype bfloat16.
    # 8.03B parameters (model card).
    "llama-3-8b": ModelSpec(
        name="llama-3-8b", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128,
        params=8.03e9, active_params=8.03e9, ffn_dim=14336, vocab=128256, max_context=8192,
        source=_HF.format("meta-llama/Meta-Llama-3-8B")),
    # hidden_size 8192, intermediate_size 28672, num_hidden_layers 80, num_attention_heads 64,
    # num_key_value_heads 8, vocab_size 128256, max_position_embeddings 8192. 70.6B parameters (model card).
    "llama-3-70b": ModelSpec(
        name="llama-3-70b", layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128,
        params=70.55e9, active_params=70.55e9, ffn_dim=28672, vocab=128256, max_context=8192,
        source=_HF.format("meta-llama/Meta-Llama-3-70B")),
    # hidden_size 3584, intermediate_size 18944, num_hidden_layers 28, num_attention_heads 28,
    # num_key_value_heads 4 (head_dim 3584/28 = 128), vocab_size 152064, max_position_embeddings 131072.
    # 7.61B parameters (model card).
    "qwen2.5-7b": ModelSpec(
        name="qwen2.5-7b", layers=28, hidden=3584, heads=28, kv_heads=4, head_dim=128,
        params=7.61e9, active_params=7.61e9, ffn_dim=18944, vocab=152064, max_context=131072,
        source=_HF.format("Qwen/Qwen2.5-7B")),
    # hidden_size 7168, num_hidden_layers 61, num_attention_heads 128, kv_lora_rank 512,
    # qk_rope_head_dim 64, qk_nope_head_dim 128 (qk 192), v_head_dim 128, n_routed_experts 256,
    # num_experts_per_tok 8, moe_intermediate_size 2048, first_k_dense_replace 3, max_position_embeddings
    # 163840; weights shipped in FP8 (quantization_config fmt e4m3). 671B total / 37B activated parameters
    # (model card / DeepSeek-V3 report, arXiv:2412.19437). Routed experts: 58 MoE layers x 256 experts x
    # 3 x 7168 x 2048 = 654B. KV cache (latent 512 + rope 64) kept in BF16.
    "deepseek-v3": ModelSpec(
        name="deepseek-v3", layers=61, hidden=7168, heads=128, kv_heads=128, head_dim=128,
        params=671e9, active_params=37e9, weight_dtype_bytes=1.0, kv_dtype_bytes=2.0,
        qk_head_dim=192, v_head_dim=128, mla_latent_dim=512, mla_rope_dim=64,
        experts=256, experts_per_token=8, expert_params=58 * 256 * 3 * 7168 * 2048, ffn_dim=18432,
        vocab=129280, max_context=163840,
        source=_HF.format("deepseek-ai/DeepSeek-V3")),
    # The default model of benchmarks/pd (benchmarks/pd/model.py ModelConfig): a Llama-style decoder in
    # fp32 on CPU, vocab 4096, hidden 256, 4 layers, 8 heads / 2 KV heads of 32, MLP 704, untied
    # embeddings: 4.92M parameters (19,670,016 weight bytes, as its runs' summary.json reports).
    "pd-tiny": ModelSpec(
        name="pd-tiny", layers=4, hidden=256, heads=8, kv_heads=2, head_dim=32,
        params=4_917_504, active_params=4_917_504, weight_dtype_bytes=4.0, kv_dtype_bytes=4.0,
        ffn_dim=704, vocab=4096, max_context=8192, source="benchmarks/pd/model.py (ModelConfig defaults)"),
}

GPUS: dict[str, GPUSpec] = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5: 80 GB HBM3, 3.35 TB/s, BF16 1,979 TFLOPS with sparsity
    # -> 989 TFLOPS dense. https://www.nvidia.com/en-us/data-center/h100/
    "h100": GPUSpec(name="h100", memory_bytes=80 * GB, hbm_bytes_per_s=3.35e12, bf16_flops=989e12,
                    source="https://www.nvidia.com/en-us/data-center/h100/"),
    # NVIDIA H200 datasheet, SXM: 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS with sparsity -> 989 dense.
    # https://www.nvidia.com/en-us/data-center/h200/
    "h200": GPUSpec(name="h200", memory_bytes=141 * GB, hbm_bytes_per_s=4.8e12, bf16_flops=989e12,
                    source="https://www.nvidia.com/en-us/data-center/h200/"),
    # The 2-core development machine benchmarks/pd runs on: a KV budget of 4 GB, ~10 GB/s of DRAM
    # bandwidth and ~50 GFLOP/s fp32 from two AVX2 cores. Its cost model is CALIBRATED below, not derived.
    "cpu-2core": GPUSpec(name="cpu-2core", memory_bytes=4 * GB, hbm_bytes_per_s=10e9, bf16_flops=50e9,
                         source="assumed; replaced by calibration against benchmarks/pd runs"),
}

LINKS: dict[str, LinkSpec] = {
    # PCI Express Base Specification 5.0: 32 GT/s per lane, 128b/130b encoding, x16 -> 63 GB/s per
    # direction. Latency: assumed 10 us per transfer (DMA setup + completion).
    "pcie-gen5": LinkSpec(name="pcie-gen5", bytes_per_s=32e9 * 16 / 8 * 128 / 130, latency_s=10e-6,
                          per_gpu=True, source="PCIe Base Specification 5.0 (32 GT/s, x16, 128b/130b)"),
    # NVLink 4 (Hopper): 18 links x 50 GB/s bidirectional = 900 GB/s per GPU -> 450 GB/s per direction.
    # https://www.nvidia.com/en-us/data-center/nvlink/ . Latency: assumed 5 us.
    "nvlink-4": LinkSpec(name="nvlink-4", bytes_per_s=450e9, latency_s=5e-6, per_gpu=True,
                         source="https://www.nvidia.com/en-us/data-center/nvlink/ (900 GB/s bidirectional)"),
    # RDMA NICs (InfiniBand EDR/HDR/NDR or RoCE, IEEE 802.3 100/200/400GBASE): line rate / 8, one NIC per
    # GPU as in DGX H100 (ConnectX-7 400 Gb/s per GPU). Latency: assumed 20 us (queue-pair post + completion
    # + the control message that announces the transfer).
    "rdma-100g": LinkSpec(name="rdma-100g", bytes_per_s=100e9 / 8, latency_s=20e-6, per_gpu=True,
                          source="IEEE 802.3 / InfiniBand EDR 100 Gb/s line rate"),
    "rdma-200g": LinkSpec(name="rdma-200g", bytes_per_s=200e9 / 8, latency_s=20e-6, per_gpu=True,
                          source="IEEE 802.3 / InfiniBand HDR 200 Gb/s line rate"),
    "rdma-400g": LinkSpec(name="rdma-400g", bytes_per_s=400e9 / 8, latency_s=20e-6, per_gpu=True,
                          source="IEEE 802.3 / InfiniBand NDR 400 Gb/s line rate (ConnectX-7)"),
    # 10GBASE (IEEE 802.3ae): 10 Gb/s, one port per node, TCP. Latency: assumed 100 us (TCP round trip).
    "10gbe": LinkSpec(name="10gbe", bytes_per_s=10e9 / 8, latency_s=100e-6, per_gpu=False,
                      source="IEEE 802.3ae 10 Gb/s Ethernet"),
    # The small engine's hand-off through a same-host kvstore daemon: publish inside the prefill worker's
    # step, fetch inside the decode worker's (staged). Rough figures from its runs here (~5 ms per
    # hand-off of a few hundred KB, about half of it publishing); refit with --calibrate.
    "shm": LinkSpec(name="shm", bytes_per_s=1e9, latency_s=5e-3, per_gpu=False, publish_share=0.5,
                    source="benchmarks/pd runs on this machine (rough; kvstore plan --calibrate refits it)"),
}

# Cost models that come from measurement rather than from datasheets, keyed by (model, gpu).
# pd-tiny on cpu-2core: round figures from quiet benchmarks/pd runs on this 2-core machine (one torch
# thread per worker): a decode step of 1-4 sequences takes ~4-6 ms, a 150-token prefill ~35 ms. The
# machine is shared, so step costs vary 2-3x between runs: refit with --calibrate and plan with
# --cost-model. KV room: 4096 blocks x 16 tokens per worker (the engine's defaults).
CALIBRATED: dict[tuple[str, str], CostModel] = {
    ("pd-tiny", "cpu-2core"): CostModel(
        name="pd-tiny@cpu-2core (rough, from quiet runs)",
        base_s=3e-3, weight_s=0.0, token_s=2e-4, seq_s=6e-4, pair_s=2e-8, ctx_s=2e-7,
        kv_bytes_per_token=MODELS["pd-tiny"].kv_bytes_per_token,
        weight_bytes=MODELS["pd-tiny"].weight_bytes,
        kv_capacity_tokens=4096 * 16),
}


def _lookup(table: dict, kind: str, name: str):
    if not isinstance(name, str):
        raise TypeError(f"{kind} name must be a string, got {type(name).__name__} {name!r}")
    try:
        return table[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; choose one of {', '.join(sorted(table))}") from None


def get_model(name: str) -> ModelSpec:
    return _lookup(MODELS, "model", name)


def get_gpu(name: str) -> GPUSpec:
    return _lookup(GPUS, "gpu", name)


def get_link(name: str) -> LinkSpec:
    return _lookup(LINKS, "link", name)


def cost_model_for(model: ModelSpec, gpu: GPUSpec, tp: int = 1, eff: Efficiency | None = None) -> CostModel:
    """The calibrated cost model for (model, gpu) if there is one, else one derived from the specs."""
    calibrated = CALIBRATED.get((model.name, gpu.name))
    if calibrated is not None:
        if tp != 1:
            raise ValueError(f"{model.name} on {gpu.name} is calibrated for tp=1 only, got tp={tp}")
        return calibrated
    return from_specs(model, gpu, tp, eff)


def transfer_for(link: LinkSpec, tp: int = 1) -> TransferModel:
    return TransferModel.from_link(link, tp)
