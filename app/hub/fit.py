"""Will this model fit? One function, `estimate_fit`, from config.json figures, bits per weight and memory sizes.

Assumptions (what the estimate models; figures in GiB = 2^30 bytes, as everywhere in the app):
- On the GPU, always: attention weights and any dense MLP at `bpw`; norms and the MoE router in FP16
  (exllamav2 does not quantize them); the output head at `head_bits`; the KV cache for the whole context;
  a fixed margin `OVERHEAD_BYTES` for the CUDA context, scratch buffers and fragmentation.
- In host RAM, always: the input embedding table in FP16 (exllamav2 keeps embeddings on the CPU), plus
  `RAM_RESERVE_BYTES` for the OS, the app and the worker process.
- Experts (every layer is MoE, as exllamav2 assumes) are at `bpw` and fill what VRAM is left; the rest of
  them sit in host RAM ("expert offload").
- KV cache bytes per element: fp16 2; quantized caches 1, 0.75 or 0.5 plus one FP16 scale per 32 elements.
- Tied embeddings still get a quantized head copy on the GPU (the EXL2 converter writes `lm_head`).
- Hybrid models (Qwen3.5-MoE): only the full-attention layers keep a KV cache; each Gated DeltaNet layer
  keeps instead a fixed recurrent state per sequence (float32) and convolution state (FP16), counted in
  the KV figure whatever the context. Their projections, the attention output gates and the shared
  experts are quantized like attention; their small per-head tensors stay FP16 like the norms.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from runtime import qwen35
from runtime.modelfolder import CONFIG_BOUNDS, ModelFolderError, flat_config

GB = 1024 ** 3
OVERHEAD_BYTES = 1.0e9
RAM_RESERVE_BYTES = 4.0e9
FP16 = 2.0
KV_BYTES_PER_ELEMENT = {"fp16": 2.0, "q8": 1.0 + 2 / 32, "q6": 0.75 + 2 / 32, "q4": 0.5 + 2 / 32}


class FitError(ValueError):
    """config.json lacks a field the estimate needs, or a figure is out of range."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0              # 0 = dense model
    experts_per_token: int = 0
    expert_size: int = 0          # intermediate size of one expert
    intermediate: int = 0         # dense MLP intermediate size (used when experts == 0)
    tie_embeddings: bool = False
    qk_norm: bool = False
    kv_layers: int = 0            # layers with a KV cache (0: all); hybrid models have fewer
    gated_q: bool = False         # q_proj also gives an output gate per head (twice the rows)
    dense_extra: int = 0          # other weights quantized like attention (DeltaNet, shared experts)
    small_extra: int = 0          # other small FP16 tensors (DeltaNet convolution, decay, norms)
    state_bytes: int = 0          # per-sequence state that does not grow with the context

    @classmethod
    def from_config(cls, config: dict) -> "ModelShape":
        config = flat_config(config)                  # DBRX nests its sizes
        archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
        if archs and archs[0] in qwen35.ARCHITECTURES:
            return cls._hybrid(config)

        def need(key: str) -> int:
            """A positive integer within the bounds model-folder validation uses (CONFIG_BOUNDS)."""
            value, top = config.get(key), CONFIG_BOUNDS[key]
            if type(value) is not int or not 0 < value <= top:
                raise FitError(f"config.json: `{key}` is missing or not a positive integer of at most {top} "
                               f"(got {value!r})", key)
            return value

        def may(key: str, default: int) -> int:
            return need(key) if config.get(key) else default

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        experts = may("num_experts", 0) or may("num_local_experts", 0)
        shape = cls(
            layers=need("num_hidden_layers"), hidden=hidden, heads=heads,
            kv_heads=may("num_key_value_heads", heads),
            head_dim=may("head_dim", hidden // heads),
            vocab=need("vocab_size"), experts=experts,
            experts_per_token=need("num_experts_per_tok") if experts else 0,
            expert_size=may("moe_intermediate_size", may("intermediate_size", 0)) if experts else 0,
            intermediate=may("intermediate_size", 0),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            qk_norm=any(str(a).startswith("Qwen3") for a in archs),
        )
        if experts and not shape.expert_size:
            raise FitError("config.json: MoE model without `moe_intermediate_size`", "moe_intermediate_size")
        if not experts and not shape.intermediate:
            raise FitError("config.json: `intermediate_size` is missing", "intermediate_size")
        return shape

    @classmethod
    def _hybrid(cls, config: dict) -> "ModelShape":
        """Qwen3.5-MoE: sizes read and checked as model-folder validation reads them (runtime/qwen35.py)."""
        try:
            c = qwen35.read_config(config, "config.json")
        except ModelFolderError as e:
            raise FitError(f"config.json: {e.problem}") from None
        full, linear = qwen35.kv_layers(c), c["num_hidden_layers"] - qwen35.kv_layers(c)
        hv, cd = c["linear_num_value_heads"], qwen35.conv_dim(c)
        deltanet = (cd + 2 * qwen35.value_dim(c) + 2 * hv) * c["hidden_size"]        # in_proj_*, out_proj
        shared = (3 * c["shared_expert_intermediate_size"] + 1) * c["hidden_size"]   # + its gate
        small = cd * c["linear_conv_kernel_dim"] + 2 * hv + c["linear_value_head_dim"]
        return cls(layers=c["num_hidden_layers"], hidden=c["hidden_size"], heads=c["num_attention_heads"],
                    kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"], vocab=c["vocab_size"],
                    experts=c["num_experts"], experts_per_token=c["num_experts_per_tok"],
                    expert_size=c["moe_intermediate_size"], tie_embeddings=bool(c.get("tie_word_embeddings")),
                    qk_norm=True, kv_layers=full, gated_q=True,
                    dense_extra=linear * deltanet + c["num_hidden_layers"] * shared,
                    small_extra=linear * small, state_bytes=qwen35.state_bytes(c))
        return shape

    # Parameter counts (weights, not bytes)
    def attention_params(self) -> int:
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q_rows = 2 * q_out if self.gated_q else q_out
        return (self.kv_layers or self.layers) * (self.hidden * q_rows + 2 * self.hidden * kv_out + q_out * self.hidden)

    def norm_params(self) -> int:
        qk = (self.kv_layers or self.layers) * 2 * self.head_dim if self.qk_norm else 0
        return self.layers * 2 * self.hidden + qk + self.hidden + self.small_extra    # + final norm

    def router_params(self) -> int:
        return self.layers * self.hidden * self.experts

    def expert_params(self) -> int:
        return self.layers * self.experts * 3 * self.hidden * self.expert_size

    def dense_mlp_params(self) -> int:
        return (0 if self.experts else self.layers * 3 * self.hidden * self.intermediate) + self.dense_extra

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def total_params(self) -> int:
        head = 0 if self.tie_embeddings else self.embedding_params()
        return (self.attention_params() + self.norm_params() + self.router_params() + self.expert_params()
                + self.dense_mlp_params() + self.embedding_params() + head)

    def kv_elements(self, context: int) -> int:
        return 2 * (self.kv_layers or self.layers) * self.kv_heads * self.head_dim * context


class Verdict(str, Enum):
    FITS_VRAM = "fits_vram"
    FITS_OFFLOAD = "fits_offload"
    DOES_NOT_FIT = "does_not_fit"


@dataclass(frozen=True)
class FitEstimate:
    verdict: Verdict
    gpu_fixed_bytes: float        # what must be on the GPU whatever happens
    expert_bytes: float           # all experts at bpw
    ram_fixed_bytes: float        # embeddings + reserve
    kv_bytes: float
    experts_in_ram_bytes: float   # 0 unless offloading
    vram_short_bytes: float       # > 0 only when it does not fit
    ram_short_bytes: float

    @property
    def text(self) -> str:
        if self.verdict is Verdict.FITS_VRAM:
            return "fits in VRAM"
        if self.verdict is Verdict.FITS_OFFLOAD:
            return f"fits with expert offload — {self.experts_in_ram_bytes / GB:.1f} GiB of experts in RAM"
        parts = []
        if self.vram_short_bytes > 0:
            parts.append(f"{self.vram_short_bytes / GB:.1f} GiB more VRAM")
        if self.ram_short_bytes > 0:
            parts.append(f"{self.ram_short_bytes / GB:.1f} GiB more RAM")
        return "does not fit — needs " + " and ".join(parts)

    @property
    def assumptions(self) -> str:
        return (f"GPU always holds {self.gpu_fixed_bytes / GB:.1f} GiB: attention, norms, router, head, "
                f"KV cache {self.kv_bytes / GB:.1f} GiB and a {OVERHEAD_BYTES / GB:.0f} GiB margin; "
                f"experts ({self.expert_bytes / GB:.1f} GiB) fill the rest of VRAM, the remainder goes to RAM; "
                f"RAM keeps the embeddings and {RAM_RESERVE_BYTES / GB:.0f} GiB for the system.")


def estimate_fit(shape: ModelShape, bpw: float, context: int, kv_cache: str, vram_bytes: float,
                 ram_bytes: float, head_bits: float = 6.0, expert_bpw: float | None = None) -> FitEstimate:
    """Where the weights and KV cache go for `context` tokens, and whether that fits (see the module docstring).
    `expert_bpw`: the experts' own bits per weight where they differ from the rest (an imported GPTQ build's)."""
    expert_bpw = bpw if expert_bpw is None else expert_bpw
    if not (1.0 <= bpw <= 16.0 and 1.0 <= expert_bpw <= 16.0):
        raise FitError(f"bits per weight must be between 1 and 16 (got {bpw}, experts {expert_bpw})", "bpw")
    if kv_cache not in KV_BYTES_PER_ELEMENT:
        raise FitError(f"KV cache type must be one of {sorted(KV_BYTES_PER_ELEMENT)} (got {kv_cache!r})", "kv_cache")
    if context <= 0:
        raise FitError(f"context length must be positive (got {context})", "context")

    # What must stay on the GPU
    kv = shape.kv_elements(context) * KV_BYTES_PER_ELEMENT[kv_cache] + shape.state_bytes
    quantized = (shape.attention_params() + shape.dense_mlp_params()) * bpw / 8
    fp16_small = (shape.norm_params() + shape.router_params()) * FP16
    head = shape.embedding_params() * head_bits / 8
    gpu_fixed = quantized + fp16_small + head + kv + OVERHEAD_BYTES

    # What lives in RAM whatever happens, and the experts that move between the two
    ram_fixed = shape.embedding_params() * FP16 + RAM_RESERVE_BYTES
    experts = shape.expert_params() * expert_bpw / 8

    vram_left = vram_bytes - gpu_fixed
    if vram_left >= experts:
        return FitEstimate(Verdict.FITS_VRAM, gpu_fixed, experts, ram_fixed, kv, 0.0, 0.0, 0.0)
    in_ram = experts - max(vram_left, 0.0)
    vram_short = max(-vram_left, 0.0)
    ram_short = max(in_ram + ram_fixed - ram_bytes, 0.0)
    if vram_short == 0 and ram_short == 0:   # (a dense model has no experts: it never gets here)
        return FitEstimate(Verdict.FITS_OFFLOAD, gpu_fixed, experts, ram_fixed, kv, in_ram, 0.0, 0.0)
    return FitEstimate(Verdict.DOES_NOT_FIT, gpu_fixed, experts, ram_fixed, kv, in_ram, vram_short, ram_short)


def exl2_size_bytes(shape: ModelShape, bpw: float, head_bits: float = 6.0) -> int:
    """What an EXL2 quant of this shape weighs on disk: attention, MLP and experts at `bpw`, the head at
    `head_bits`, the input embeddings, norms and router in FP16 (the converter's layout; an estimate)."""
    emb = shape.embedding_params()
    body = shape.attention_params() + shape.expert_params() + shape.dense_mlp_params()
    small = shape.norm_params() + shape.router_params()
    return int(body * bpw / 8 + emb * head_bits / 8 + (emb + small) * FP16)


def detect_memory() -> tuple[float, float, str]:
    """(VRAM bytes of GPU 0, total RAM bytes, GPU name or a note). No GPU is a state: VRAM 0."""
    import psutil
    ram = float(psutil.virtual_memory().total)
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            return float(pynvml.nvmlDeviceGetMemoryInfo(handle).total), ram, name
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:   # no driver, no GPU: not an error for the estimate
        from app.telemetry import no_driver_words
        return 0.0, ram, f"No NVIDIA GPU ({no_driver_words(exc)})"
