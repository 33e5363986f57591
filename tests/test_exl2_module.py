"""exllamav2's MoE modules with the project's experts inside (runtime/experts/exl2_module.py), on the CPU with
exllamav2 stood in for (its import needs CUDA): `install` puts a wrapper in the model's module list and leaves
exllamav2's object as it was; the wrapper's forward takes the measured one-launch set where it applies (a layer
all in VRAM after an RMSNorm: the residual stream, the norm and the residual handed to the experts) and the
norm, the experts and one add elsewhere (offloaded layers, a LayerNorm before)."""
from __future__ import annotations

import sys
import types

import pytest
import torch


class _Module:
    def __init__(self, model, key, archparams=None):
        self.model, self.key, self.archparams, self.submodules = model, key, archparams, []

    def set_device_idx(self, idx):
        self.device_idx = idx


class _RMSNorm(_Module):
    def __init__(self, w):
        super().__init__(None, "norm")
        self.weight, self.variance_epsilon = torch.nn.Parameter(w, requires_grad=False), 1e-6

    def forward(self, h):
        hf = h.float()
        return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight.float()).half()


class _LayerNorm(_Module):
    def __init__(self, w):
        super().__init__(None, "norm")
        self.weight, self.variance_epsilon = torch.nn.Parameter(w, requires_grad=False), 1e-6

    def forward(self, h):
        return torch.nn.functional.layer_norm(h.float(), h.shape[-1:], self.weight.float()).half()


class _MoEMLP(_Module):
    def __init__(self, model, key, layer_idx, norm):
        super().__init__(model, key, "arch")
        self.layer_idx, self.num_experts_per_token = layer_idx, 2
        self.post_attention_layernorm, self.gate = norm, _Module(model, key + ".gate")
        self.w1 = self.w2 = self.w3 = []

    def numel(self):
        return 1234

    def weight_footprint(self):
        return 5678

    def set_device_idx(self, idx):
        super().set_device_idx(idx)
        self.post_attention_layernorm.set_device_idx(idx)
        self.gate.set_device_idx(idx)


@pytest.fixture
def exl2_module(monkeypatch):
    mods = {"exllamav2": types.ModuleType("exllamav2"),
            "exllamav2.module": types.SimpleNamespace(ExLlamaV2Module=_Module),
            "exllamav2.moe_mlp": types.SimpleNamespace(ExLlamaV2MoEMLP=_MoEMLP),
            "exllamav2.rmsnorm": types.SimpleNamespace(ExLlamaV2RMSNorm=_RMSNorm),
            "exllamav2.stloader": types.SimpleNamespace(STFile=None)}
    for name, m in mods.items():
        monkeypatch.setitem(sys.modules, name, m)
    monkeypatch.delitem(sys.modules, "runtime.experts.exl2_module", raising=False)
    import runtime.experts.exl2_module as module
    yield module
    sys.modules.pop("runtime.experts.exl2_module", None)


class _Experts:
    """The ExpertLayer's contract as the wrapper calls it, recorded: y = 2 x (fp32), or residual + 2 x (fp16)."""

    def __init__(self, offload=None):
        self.offload, self.calls, self.after = offload, [], []

    def __call__(self, x, norm=None, residual=None):
        self.calls.append((x.clone(), norm, residual))
        if residual is not None:
            return (residual.float() + 2 * x.float()).half()
        return 2 * x.float()

    def after_residual(self, h):
        self.after.append(h.clone())


def test_install_wraps_exllamavs_moe_modules_and_leaves_them_as_they_were(exl2_module):
    model = types.SimpleNamespace()
    stock = [_MoEMLP(model, f"model.layers.{i}.mlp", i, _RMSNorm(torch.ones(8))) for i in range(2)]
    other = _Module(model, "model.layers.0.self_attn")
    model.modules = [object(), other, stock[0], stock[1]]
    assert exl2_module.install(model) == 2
    wrapped = model.modules[2:]
    assert model.modules[1] is other
    assert all(type(w) is exl2_module.OwnMoE and w.stock is s for w, s in zip(wrapped, stock))
    assert all(type(s) is _MoEMLP for s in stock), "exllamav2's objects keep their class"
    assert exl2_module.moe_layers(model) == wrapped
    w = wrapped[0]
    assert (w.key, w.layer_idx, w.numel(), w.weight_footprint(), w.scratch_space()) == \
        ("model.layers.0.mlp", 0, 1234, 5678, 0)
    assert w.submodules == [stock[0].post_attention_layernorm, stock[0].gate]
    w.set_device_idx(0)
    assert w.device_idx == stock[0].device_idx == stock[0].post_attention_layernorm.device_idx == 0
    assert exl2_module.install(model) == 0                     # wrapped already: nothing of exllamav2's left
    with pytest.raises(ValueError, match="host arena"):
        exl2_module.OwnMoE(stock[0], on_host=lambda what, n: None)


H = 32                 # a hidden size the routing's launch takes (a multiple of 32)


def _wrapped(exl2_module, norm, offload=None):
    model = types.SimpleNamespace()
    model.modules = [_MoEMLP(model, "model.layers.0.mlp", 0, norm)]
    exl2_module.install(model)
    moe = model.modules[0]
    moe.experts = _Experts(offload)
    return moe


def test_a_layer_all_in_vram_after_an_rmsnorm_routes_the_residual_stream_and_adds_in_the_kernels(exl2_module):
    """The one-launch set, with no switch: the experts get the residual stream (not a normed copy), the
    RMSNorm's weight and eps (normed in the routing's launch) and the residual (added by down's kernel); their
    output is the block's."""
    norm = _RMSNorm(torch.rand(H) + 0.5)
    moe = _wrapped(exl2_module, norm)
    h = torch.randn(1, 3, H).half()
    out = moe.forward(h)
    (x, given_norm, residual), = moe.experts.calls
    assert torch.equal(x, h.view(3, H)) and residual is not None and torch.equal(residual, h.view(3, H))
    assert torch.equal(given_norm[0], norm.weight) and given_norm[1] == norm.variance_epsilon
    assert torch.equal(out.view(3, H), (h.view(3, H).float() * 3).half()) and out.shape == h.shape
    assert torch.equal(moe.experts.after[0], out.view(3, H))


@pytest.mark.parametrize("case", ["offloaded", "layernorm"])
def test_other_layers_norm_first_and_add_the_experts_sum_once(exl2_module, case):
    """An offloaded layer (its kernels add nothing; the CPU cut, staging) or a LayerNorm before the experts
    (DBRX): exllamav2's norm, the experts on the normed rows, one add rounded once."""
    norm = _LayerNorm(torch.rand(H) + 0.5) if case == "layernorm" else _RMSNorm(torch.rand(H) + 0.5)
    moe = _wrapped(exl2_module, norm, offload=object() if case == "offloaded" else None)
    h = torch.randn(1, 3, H).half()
    out = moe.forward(h)
    (x, given_norm, residual), = moe.experts.calls
    assert given_norm is None and residual is None and torch.equal(x, norm.forward(h.view(3, H)))
    assert torch.equal(out.view(3, H), (h.view(3, H).float() + 2 * x.float()).half())
