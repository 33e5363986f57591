"""Qwen3.5-MoE in the calibrated converter (convert.py): each layer's calibration runs our own forward.

transformers has no per-layer module of the hybrid stack that runs without its cache plumbing, so a
layer here is the reference engine's (runtime/reference/qwen35.py: Gated DeltaNet with its convolution
and recurrence, or gated attention with partial RoPE; then the MoE and the gated shared expert), built
in float32 from the checkpoint, with every linear wrapped to sum the Hessian 2 X^T X of its real inputs.
Each calibration row runs from position 0 with a fresh state.

Quantized (GPTQ, per Hugging Face linear; a fused projection's parts share its input's Hessian):
q/k/v/o, in_proj_qkv, in_proj_z, out_proj, the shared expert's gate/up/down, and each expert's
gate/up (the tokens routed to it) and down (its own intermediate activations), with the all-token
fallback of convert.py for experts that saw too few tokens. Kept in fp16 as stored, as EXL2 folders keep
them: norms, conv1d, A_log, dt_bias, the router, the shared expert's scalar gate and the small per-head
gates in_proj_a / in_proj_b. The MTP head (`mtp.*`), when there is one, is converted last, calibrated on
the quantized model's final hidden states and the next tokens' embeddings (what it reads as a draft).

The routed experts' weights stay on the device as the checkpoint stores them (bf16: 4.8 GB a layer at
Qwen3.5-122B's widths, where float32 took 9.7 GB of a 24 GB card); the layer's forward and GPTQ read them in
float32, which holds every bf16 value exactly, and their dequantized weights come back as fp16, which holds
every EXL2 value exactly.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from runtime import qwen35
from runtime.reference import model as ref_model
from runtime.reference import qwen35 as q35
from runtime.reference import rope
from runtime.reference.weights import Linear

from .calibrate import LayerReport, RoutedInputs
from .gptq import HessianAccumulator

PLAIN_LINEARS = ("mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_a", "linear_attn.in_proj_b")


class _Recording(Linear):
    """A float32 Linear that sums the Hessian of what it is called on."""

    def __init__(self, weight: torch.Tensor, acc: HessianAccumulator, keep: list | None = None):
        super().__init__(weight, None, "float32")
        self.acc, self.keep = acc, keep

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.acc.add(x)
        if self.keep is not None:
            self.keep.append(x)
        return super().__call__(x)


class _Rows:
    """Expert e's weight on demand, with the shape and device of the stacked tensor it stands for."""

    def __init__(self, get, shape: tuple[int, ...], device):
        self.get, self.shape, self.device = get, torch.Size(shape), device

    def __getitem__(self, e: int) -> torch.Tensor:
        return self.get(e)


class _ExpertWeights:
    """What calibrate.RoutedInputs and calibrate._quantize_experts read of an experts module, over the layer's
    per-expert weights by Hugging Face prefix (no stacked copy): gate_up_proj[e], down_proj[e], and each
    expert's parts with the setters that put the dequantized weights back for the layer's second run."""

    def __init__(self, weights: dict[str, torch.Tensor], m: str, n: int):
        self.weights, self.m, self.num_experts, self.act_fn = weights, m, n, F.silu
        gate, down = weights[f"{m}.0.gate_proj"], weights[f"{m}.0.down_proj"]
        self.gate_up_proj = _Rows(lambda e: torch.cat([weights[f"{m}.{e}.gate_proj"], weights[f"{m}.{e}.up_proj"]]),
                                  (n, 2 * gate.shape[0], gate.shape[1]), gate.device)
        self.down_proj = _Rows(lambda e: weights[f"{m}.{e}.down_proj"], (n, *down.shape), down.device)

    def parts(self, e: int) -> dict:
        def setter(name: str):              # EXL2's values are fp16 values: kept exactly, in half the memory
            return lambda d: self.weights.__setitem__(name, d.to(self.weights[name].device, torch.float16))
        names = {part: f"{self.m}.{e}.{part}" for part in ("gate_proj", "up_proj", "down_proj")}
        return {part: (self.weights[name], setter(name)) for part, name in names.items()}


class _RowState:
    """One calibration row's cache for one layer (index 0 of its kind)."""

    def __init__(self, spec: q35.Spec, length: int, device: torch.device):
        shape = (1, spec.kv_heads, length, spec.head_dim)
        self.kv = SimpleNamespace(k=torch.zeros(shape, device=device), v=torch.zeros(shape, device=device))
        self.conv = [torch.zeros(spec.conv_kernel - 1, spec.conv_channels, device=device)]
        self.recurrent = [torch.zeros(spec.lin_value_heads, spec.lin_key_dim, spec.lin_value_dim, device=device)]

    def record(self, i, mixed, g, beta) -> None:
        pass


class HybridLayers:
    """The per-layer work of convert.py for Qwen3.5-MoE checkpoints, run on `device` (the layer's weights,
    its forward, the Hessians; GPTQ runs where the Hessian is)."""

    def __init__(self, ckpt, seq_len: int, error, device: str = "cpu"):
        where = str(ckpt.path / "config.json")
        try:
            self.config = qwen35.read_config(ckpt.config, where)
        except Exception as e:                  # folder_check's errors name the key; keep the converter's type
            raise error(f"{where}: {getattr(e, 'message', e)}") from None
        self.spec = q35.Spec.from_config(self.config, where)
        self.ckpt, self.error, self.p0 = ckpt, error, qwen35.prefix(self.config)
        self.n_layers = self.spec.layers
        self.embed_name, self.norm_name = f"{self.p0}.embed_tokens.weight", f"{self.p0}.norm.weight"
        self.device = torch.device(device)
        self.cos, self.sin = (x.to(self.device) for x in rope.tables(self.spec.rope, self.spec.rotary_dim, seq_len,
                                                                      torch.float32))
        self.layout = qwen35.layout(self.config, set(ckpt.shard_of))

    # -- reading -------------------------------------------------------------------------------

    def _prefix(self, i: int) -> str:
        return f"{self.p0}.layers.{i}"

    def _get(self, name: str) -> torch.Tensor:
        """A stored tensor (float32) on the layers' device."""
        return self.ckpt.get(name).to(self.device)

    def _weights(self, p: str, lay) -> dict[str, torch.Tensor]:
        """Every linear weight of the layer at prefix p by Hugging Face prefix (stacked experts split): float32,
        the routed experts' as stored."""
        out = {}
        for name, shape in lay.linears.items():
            if name.startswith(p + "."):
                expert = name.startswith(f"{p}.mlp.experts.")
                w = self.ckpt.get_raw(f"{name}.weight").to(self.device) if expert else self._get(f"{name}.weight")
                if tuple(w.shape) != shape:
                    raise self.error(f"{self.ckpt.path}: {name}.weight has shape {list(w.shape)}, the config "
                                     f"implies {list(shape)}")
                out[name] = w
        if self.ckpt.has(f"{p}.mlp.experts.gate_up_proj"):
            m = f"{p}.mlp.experts"
            gate_up, down = (self.ckpt.get_raw(f"{m}.{t}").to(self.device) for t in ("gate_up_proj", "down_proj"))
            inter = gate_up.shape[1] // 2
            for j in range(self.spec.experts):
                out[f"{m}.{j}.gate_proj"], out[f"{m}.{j}.up_proj"] = gate_up[j, :inter], gate_up[j, inter:]
                out[f"{m}.{j}.down_proj"] = down[j]
        return out

    def _layer(self, p: str, kind: str, weights: dict[str, torch.Tensor]) -> q35.Layer:
        return q35.build_layer(kind, p, self.spec, "float32", weights.__getitem__, self._get, False)

    def plain_tensors(self, p: str, lay) -> dict[str, torch.Tensor]:
        """What the layer at prefix p keeps in fp16: its norms, convolution, decay, router and small gates."""
        out = {}
        for name in lay.plain:
            if name.startswith(p + ".") and ".mlp.experts." not in name:
                out[name] = self.ckpt.get(name).to(torch.float16)
        for name in lay.linears:
            if name.startswith(p + ".") and name[len(p) + 1:] in PLAIN_LINEARS:
                out[f"{name}.weight"] = self.ckpt.get(f"{name}.weight").to(torch.float16)
        return out

    # -- running -------------------------------------------------------------------------------

    def run(self, layer: q35.Layer, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [rows, T, H] -> the layer's outputs, each row from position 0."""
        t = hidden.shape[1]
        rot = self.cos[:t, None], self.sin[:t, None]
        mask = ref_model._mask(0, t, 0, self.spec.heads // self.spec.kv_heads, device=hidden.device)
        out = torch.empty_like(hidden)
        with torch.no_grad():
            for r in range(hidden.shape[0]):
                out[r] = q35.layer_forward(layer, self.spec, _RowState(self.spec, t, hidden.device), 0, hidden[r],
                                           rot, mask, 0, t)
        return out

    def calibrate(self, p: str, kind: str, lay, hidden: torch.Tensor, report: LayerReport | None = None,
                  after_read=lambda: None):
        """Run the layer at prefix p over the calibration rows recording every linear's input Hessian and the
        routed experts' inputs -> (weights by HF prefix, jobs for convert.py: (name, weight, hessian, set
        dequantized weight), the experts for calibrate.quantize_jobs: (RoutedInputs, their prefix)).
        `report` times the reading and the run; `after_read` is called once the weights are read."""
        spec, report = self.spec, report or LayerReport()
        with report.phase("read", self.device):
            weights = self._weights(p, lay)
        after_read()
        layer = self._layer(p, kind, weights)
        widths = (("proj", spec.hidden), ("moe", spec.hidden), ("out", layer.out.weight.shape[1]),
                  ("shared_down", layer.shared_down.weight.shape[1]))
        acc = {k: HessianAccumulator(n, device=self.device) for k, n in widths}
        moe_inputs: list[torch.Tensor] = []
        layer.proj = _Recording(layer.proj.weight, acc["proj"])
        layer.out = _Recording(layer.out.weight, acc["out"])
        layer.shared_gate_up = _Recording(layer.shared_gate_up.weight, acc["moe"], moe_inputs)
        layer.shared_down = _Recording(layer.shared_down.weight, acc["shared_down"])
        with report.phase("forward", self.device):
            self.run(layer, hidden)

        a = f"{p}.self_attn" if kind == qwen35.FULL else f"{p}.linear_attn"
        source = {f"{a}.{n}": "proj" for n in ("q_proj", "k_proj", "v_proj", "in_proj_qkv", "in_proj_z")}
        source.update({f"{a}.o_proj": "out", f"{a}.out_proj": "out", f"{p}.mlp.shared_expert.gate_proj": "moe",
                       f"{p}.mlp.shared_expert.up_proj": "moe", f"{p}.mlp.shared_expert.down_proj": "shared_down"})
        jobs = []
        for name, key in source.items():
            if name in weights:
                jobs.append((name, weights[name], acc[key],
                             lambda d, name=name: weights.__setitem__(name, d.to(self.device))))
        # the routed experts: their inputs and the router's picks kept, their Hessians summed group by group
        # when they are quantized (calibrate._quantize_experts), as for the other MoE architectures
        m = f"{p}.mlp.experts"
        inputs = RoutedInputs(_ExpertWeights(weights, m, spec.experts))
        with torch.no_grad():
            for x in moe_inputs:
                inputs.add(x, ref_model._route(layer, spec, x)[1])
        return weights, jobs, (inputs, m)

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm (1 + weight) of the calibration hidden states: what lm_head reads."""
        w = 1.0 + self._get(self.norm_name)
        return F.rms_norm(hidden, (self.spec.hidden,), w, self.spec.eps)

    def quantize_layer(self, i: int, hidden: torch.Tensor, quantize_jobs, report: LayerReport | None = None,
                       after_read=lambda: None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """-> (tensors to write for layer i, the next layer's inputs through the dequantized layer)."""
        p, kind, report = self._prefix(i), self.spec.kinds[i], report or LayerReport()
        weights, jobs, experts = self.calibrate(p, kind, self.layout, hidden, report, after_read)
        tensors = quantize_jobs(jobs, experts)
        tensors.update(self.plain_tensors(p, self.layout))
        with report.phase("forward", self.device):
            return tensors, self.run(self._layer(p, kind, weights), hidden)

    def has_mtp(self) -> bool:
        return qwen35.has_mtp(set(self.ckpt.shard_of))

    def quantize_mtp(self, ids: torch.Tensor, hidden: torch.Tensor, quantize_jobs) -> dict[str, torch.Tensor]:
        """The MTP head (reference/mtp.py), calibrated on what it reads when drafting: the quantized model's
        final hidden states h_i and the embeddings of the tokens t_{i+1} after them (ids [rows, T])."""
        lay, h, eps = qwen35.mtp_layout(self.config, set(self.ckpt.shard_of)), self.spec.hidden, self.spec.eps

        def centred(name: str) -> torch.Tensor:
            return 1.0 + self._get(f"{qwen35.MTP}.{name}.weight")
        e = F.rms_norm(F.embedding(ids[:, 1:].to(self.device), self._get(self.embed_name)), (h,),
                       centred("pre_fc_norm_embedding"), eps)
        x = torch.cat([e, F.rms_norm(self.head_input(hidden)[:, :-1], (h,), centred("pre_fc_norm_hidden"), eps)], -1)
        fc = {f"{qwen35.MTP}.fc": self._get(f"{qwen35.MTP}.fc.weight")}
        if tuple(fc[f"{qwen35.MTP}.fc"].shape) != (h, 2 * h):
            raise self.error(f"{self.ckpt.path}: {qwen35.MTP}.fc.weight has shape {list(fc[f'{qwen35.MTP}.fc'].shape)}, "
                             f"the config implies {[h, 2 * h]}")
        acc = HessianAccumulator(2 * h, device=self.device)
        acc.add(x)
        jobs = [(f"{qwen35.MTP}.fc", fc[f"{qwen35.MTP}.fc"], acc,
                 lambda d: fc.__setitem__(f"{qwen35.MTP}.fc", d.to(self.device)))]
        tensors = quantize_jobs(jobs)
        x = F.linear(x, fc[f"{qwen35.MTP}.fc"])                        # through the dequantized fc
        p = f"{qwen35.MTP}.layers.0"
        _, jobs, experts = self.calibrate(p, qwen35.FULL, lay, x)
        tensors.update(quantize_jobs(jobs, experts))
        tensors.update(self.plain_tensors(p, lay))
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            tensors[f"{qwen35.MTP}.{name}.weight"] = self.ckpt.get(f"{qwen35.MTP}.{name}.weight").to(torch.float16)
        return tensors
