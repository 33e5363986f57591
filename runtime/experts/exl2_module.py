"""exllamav2's MoE module with the project's experts inside (imports exllamav2: CUDA machines only).

`install(model)` turns every `ExLlamaV2MoEMLP` of a freshly built (not yet loaded) model into
`OwnMoE`, before `model.load()`. exllamav2 then loads the norm and router as usual, while the experts'
EXL2 tensors are read once, as host views of the model's files (runtime/experts/st_read.py), and
repacked on the GPU a batch of experts at a time into an `ExpertLayer` (runtime/experts/layer.py);
exllamav2 never builds its per-expert matrices or its fused MoE handle. The forward keeps exllamav2's module
contract: it takes the residual stream [B, S, H] and returns it with the MoE output added.
"""
from __future__ import annotations


import torch
from exllamav2.moe_mlp import ExLlamaV2MoEMLP
from exllamav2.rmsnorm import ExLlamaV2RMSNorm
from exllamav2.stloader import STFile

from runtime import tuning
from runtime.experts.budget import MemoryBudget
from runtime.experts.layer import ExpertLayer
from runtime.experts.pack import HostArena, pack_layer
from runtime.experts.st_read import MappedFiles

EXL2_KEYS = ["q_weight", "q_invperm", "q_scale", "q_scale_max", "q_groups", "q_scale_exact"]   # the last: where stored


class OwnMoE(ExLlamaV2MoEMLP):
    experts: ExpertLayer | None = None
    host_ram: MemoryBudget | None = None      # offload: expert codes go to pinned host RAM, on this ledger
    host_arena: HostArena | None = None       # ... carved from these page-locked blocks
    renormalize: bool = True                  # top-k weights divided by their sum (runtime/backends/exl2_arch.py)

    @torch.inference_mode()
    def load(self):
        self.post_attention_layernorm.load()
        self.gate.load()
        gate_w = self.gate.get_weight_tensor_dq().T          # [E, H], stored fp16 or EXL2
        linears = {"gate_proj": self.w1, "up_proj": self.w3, "down_proj": self.w2}

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
            if self.host_ram is not None:
                self.host_ram.reserve(f"experts of {self.key}.{name}", pack.cold.numel() * 4,
                                      "raise the RAM budget, close other programs, or raise the VRAM budget")

        # gate and up packed with the intermediate in down's packed order: a cold expert can then be
        # cut between the CPU and the GPU by ranges (runtime/experts/cpu_path.py); done while packing,
        # not by moving every expert's codes from host memory to the GPU and back afterwards
        try:
            packs = pack_layer(load, self.key, device=self.device(),
                               host=self.host_arena if self.host_ram is not None else None, on_packed=reserve)
        finally:
            files.close()
        self.experts = ExpertLayer(gate_w, packs[0], packs[1], packs[2], self.num_experts_per_token,
                                   self.renormalize)
        norm_w = getattr(self.post_attention_layernorm, "weight", None)
        if norm_w is not None and not isinstance(self.post_attention_layernorm, ExLlamaV2RMSNorm):
            norm_w = None          # a LayerNorm (DBRX) also centres: the prediction is folded below
            self.experts.fold_layer_norm(self.post_attention_layernorm.weight)
        self.experts.norm_w = norm_w                       # RMSNorm's, or None
        self.q_handle = None                                 # exllamav2's fused path never runs

    def unload(self):
        self.experts = None
        self.post_attention_layernorm.unload()
        self.gate.unload()

    def scratch_space_fixed(self) -> int:
        return 0

    def scratch_space(self) -> int:
        return 0

    def forward(self, hidden_states, cache=None, attn_params=None, past_len=None,
                intermediates: bool = False, loras=None, **kwargs):
        B, S, H = hidden_states.shape
        norm = self.post_attention_layernorm
        # all in VRAM, MOEDESK_MOE_FINISH: the down kernel adds the sum into the residual (moe_finish.py)
        res = hidden_states.view(-1, H) if tuning.current().moe_finish and self.experts.offload is None else None
        if tuning.current().route == "normed" and isinstance(norm, ExLlamaV2RMSNorm):
            # the norm in the routing's launch (runtime/experts/route_normed.py)
            y = self.experts(hidden_states.view(-1, H), norm=(norm.weight.data, norm.variance_epsilon), residual=res)
        else:
            x = norm.forward(hidden_states.view(-1, H))                          # [T, H] fp16
            y = self.experts(x.half(), residual=res)                             # [T, H] fp32 (fp16 with res)
        if res is not None:
            out = y.view(B, S, H)
        elif tuning.current().moe_add == "plain":
            out = (hidden_states.view(-1, H) + y.to(hidden_states.dtype)).view(B, S, H)
        else:
            out = torch.empty_like(hidden_states)
            torch.add(hidden_states.view(-1, H), y, out=out.view(-1, H))         # one launch, rounded once
        self.experts.after_residual(out.view(-1, H))            # decode prefetch of the next layer's experts
        return out


def install(model, host_ram: MemoryBudget | None = None, host_arena: HostArena | None = None,
            renormalize: bool = True) -> int:
    """Swap exllamav2's MoE modules for `OwnMoE` before loading; returns how many were swapped.
    host_ram: load every expert's codes into page-locked host memory from `host_arena` (offload),
    accounted on this ledger. renormalize: the top-k weights divided by their sum."""
    if host_ram is not None and host_arena is None:
        raise ValueError("offload needs a host arena for the experts' codes")
    n = 0
    for m in model.modules:
        if type(m) is ExLlamaV2MoEMLP:
            m.__class__ = OwnMoE
            m.host_ram, m.host_arena, m.renormalize = host_ram, host_arena, renormalize
            n += 1
    return n


def moe_layers(model) -> list[OwnMoE]:
    return [m for m in model.modules if isinstance(m, OwnMoE)]
