"""exllamav2's MoE module with the project's experts inside (imports exllamav2: CUDA machines only).

`install(model)` puts an `OwnMoE` in place of every `ExLlamaV2MoEMLP` in a freshly built (not yet loaded)
model's module list, before `model.load()`: a module of exllamav2's kind (`ExLlamaV2Module`, as exllamav2's
own `Intervention` wraps one) around the stock one, which keeps its norm and router and is never loaded
itself. exllamav2 then loads the norm and router through the wrapper, while the experts' EXL2 tensors are
read once, as host views of the model's files (runtime/experts/st_read.py), and repacked on the GPU a batch
of experts at a time into an `ExpertLayer` (runtime/experts/layer.py); exllamav2 never builds its
per-expert matrices or its fused MoE handle. The forward keeps exllamav2's module contract: it takes the
residual stream [B, S, H] and returns it with the MoE output added; a layer all in VRAM after an RMSNorm
hands the experts the residual stream and the norm (one launch routes, two compute and add).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from exllamav2.module import ExLlamaV2Module
from exllamav2.moe_mlp import ExLlamaV2MoEMLP
from exllamav2.rmsnorm import ExLlamaV2RMSNorm
from exllamav2.stloader import STFile

from runtime.experts.layer import ExpertLayer
from runtime.experts.pack import HostArena, pack_layer
from runtime.experts.st_read import MappedFiles
from runtime.tuning import Tuning

EXL2_KEYS = ["q_weight", "q_invperm", "q_scale", "q_scale_max", "q_groups", "q_scale_exact"]   # the last: where stored


class OwnMoE(ExLlamaV2Module):
    """In the model's module list in place of `stock` (an ExLlamaV2MoEMLP, whose norm and router it loads).
    on_host(what, bytes): offload, the expert codes going to page-locked host memory from `host_arena`,
    each stack accounted as it is packed (the RAM ledger); renormalize: the top-k weights divided by their
    sum (runtime/backends/exl2_arch.py); tuning: the kernels' launch shapes."""

    name: str = "MoE MLP (own experts)"

    def __init__(self, stock: ExLlamaV2MoEMLP, on_host: Optional[Callable[[str, int], None]] = None,
                 host_arena: Optional[HostArena] = None, renormalize: bool = True, tuning: Tuning = Tuning()):
        super().__init__(stock.model, stock.key, stock.archparams)
        if on_host is not None and host_arena is None:
            raise ValueError("offload needs a host arena for the experts' codes")
        self.stock = stock
        self.layer_idx = stock.layer_idx
        self.post_attention_layernorm, self.gate = stock.post_attention_layernorm, stock.gate
        self.submodules = [self.post_attention_layernorm, self.gate]
        self.num_experts_per_token = stock.num_experts_per_token
        self.on_host, self.host_arena, self.renormalize, self.tuning = on_host, host_arena, renormalize, tuning
        self.experts: Optional[ExpertLayer] = None
        if hasattr(stock, "device_idx"):
            self.device_idx = stock.device_idx

    def numel(self) -> int:
        return self.stock.numel()

    def weight_footprint(self) -> int:
        return self.stock.weight_footprint()

    def set_device_idx(self, idx: Optional[int]) -> None:
        self.stock.set_device_idx(idx)
        super().set_device_idx(idx)

    @torch.inference_mode()
    def load(self):
        self.post_attention_layernorm.load()
        self.gate.load()
        gate_w = self.gate.get_weight_tensor_dq().T          # [E, H], stored fp16 or EXL2
        linears = {"gate_proj": self.stock.w1, "up_proj": self.stock.w3, "down_proj": self.stock.w2}

        files = MappedFiles()

        def read(key: str) -> dict:
            """exllamav2's load_multi without its per-tensor GPU copy and waits: host views of the file."""
            config, t = self.model.config, {}
            for k in EXL2_KEYS:
                filename = config.tensor_file_map.get(f"{key}.{k}")
                if filename is not None:
                    st = STFile.open(filename, keymap=config.arch.keymap)
                    t[k] = files.tensor(st.filename, st.header_size, st.header[f"{key}.{k}"], f"{key}.{k}")
            return t

        def load(name: str) -> list:
            tensors = []
            for lin in linears[name]:
                t = read(lin.key)
                if "q_weight" not in t:
                    raise ValueError(f"{lin.key}: not an EXL2 tensor (q_weight missing); "
                                     "only EXL2-quantized experts are supported")
                tensors.append(t)
            return tensors

        def reserve(name: str, pack) -> None:
            if self.on_host is not None:
                self.on_host(f"experts of {self.key}.{name}", pack.cold.numel() * 4)

        # gate and up packed with the intermediate in down's packed order: a cold expert can then be
        # cut between the CPU and the GPU by ranges (runtime/cpu/path.py); done while packing,
        # not by moving every expert's codes from host memory to the GPU and back afterwards
        try:
            packs = pack_layer(load, self.key, device=self.device(),
                               host=self.host_arena if self.on_host is not None else None, on_packed=reserve)
        finally:
            files.close()
        self.experts = ExpertLayer(gate_w, packs[0], packs[1], packs[2], self.num_experts_per_token,
                                   self.renormalize, self.tuning.grouped, self.tuning.splitk)
        norm_w = getattr(self.post_attention_layernorm, "weight", None)
        if norm_w is not None and not isinstance(self.post_attention_layernorm, ExLlamaV2RMSNorm):
            norm_w = None          # a LayerNorm (DBRX) also centres: the prediction is folded below
            self.experts.fold_layer_norm(self.post_attention_layernorm.weight)
        self.experts.norm_w = norm_w                       # RMSNorm's, or None

    def unload(self):
        self.experts = None
        self.post_attention_layernorm.unload()
        self.gate.unload()

    def scratch_space_fixed(self) -> int:
        return 0

    def scratch_space(self) -> int:
        return 0

    def scratch_space_tp(self) -> int:
        return 0

    def forward(self, hidden_states, cache=None, attn_params=None, past_len=None,
                intermediates: bool = False, loras=None, **kwargs):
        B, S, H = hidden_states.shape
        h = hidden_states.view(-1, H)
        norm = self.post_attention_layernorm
        if (self.experts.offload is None and isinstance(norm, ExLlamaV2RMSNorm) and H % 32 == 0
                and hidden_states.dtype == torch.float16):
            # all in VRAM: the norm in the routing's launch, the sum added into the residual by down's kernel
            out = self.experts(h, norm=(norm.weight.data, norm.variance_epsilon), residual=h).view(B, S, H)
        else:
            y = self.experts(norm.forward(h).half())                               # [T, H] fp32
            out = torch.empty_like(hidden_states)
            torch.add(h, y, out=out.view(-1, H))                                   # one launch, rounded once
        self.experts.after_residual(out.view(-1, H))            # decode prefetch of the next layer's experts
        return out


def install(model, on_host: Optional[Callable[[str, int], None]] = None, host_arena: Optional[HostArena] = None,
            renormalize: bool = True, tuning: Tuning = Tuning()) -> int:
    """Put an `OwnMoE` around each of exllamav2's MoE modules before loading; returns how many. on_host,
    host_arena: offload (see OwnMoE); renormalize: the top-k weights divided by their sum; tuning: the
    kernels' launch shapes."""
    n = 0
    for i, m in enumerate(model.modules):
        if type(m) is ExLlamaV2MoEMLP:
            model.modules[i] = OwnMoE(m, on_host, host_arena, renormalize, tuning)
            n += 1
    return n


def moe_layers(model) -> list[OwnMoE]:
    return [m for m in model.modules if isinstance(m, OwnMoE)]
