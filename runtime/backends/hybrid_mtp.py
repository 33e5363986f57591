"""Qwen3.5-MoE's multi-token-prediction head on the hybrid engine: the draft of `draft.mode = "mtp"`.

The math is the CPU reference's (runtime/reference/mtp.py says what the head computes from the model's
final hidden state h_i and the token t_{i+1}, and how its cache slots follow the model's forwards); the
slots and kept rows live in the same `MtpCache`, here on the engine's device. The head's decoder layer
is built as the model's own (runtime/backends/hybrid_layers.py): gated attention over the head's own
KV cache and the MoE with its shared expert, the residual stream in float32.

Its routed experts stay in VRAM, outside the offload manager: the head runs once per drafted token, one
row at a time, and waiting for PCIe there would cost more than the draft saves. They are one layer's
experts, so a load reads the head only when the draft options choose "mtp" (hybrid.load), else on first
use (`MtpHooks`).
The engine's side (the slots following its forwards, the drafts, a rebuild when the head fell behind) is
the reference engine's, shared (runtime/reference/mtp.MtpDrafting); `MtpHooks` runs it on the GPU.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from runtime import qwen35
from runtime.backends import quant_linear
from runtime.backends.hybrid_layers import AttentionLayer, MoeBlock, attention_layer, centred, moe_block
from runtime.errors import InvalidModel
from runtime.modelfolder import ModelFolder
from runtime.reference.mtp import MtpCache, MtpDrafting


class MtpHead:
    def __init__(self, spec, fc, norm_embedding: torch.Tensor, norm_hidden: torch.Tensor, attn_norm: torch.Tensor,
                 attn: AttentionLayer, mlp_norm: torch.Tensor, moe: MoeBlock, norm: torch.Tensor, dtype: torch.dtype):
        self.spec, self.fc, self.dtype = spec, fc, dtype               # fc [H, 2H]: embedding first
        self.norm_embedding, self.norm_hidden, self.norm = norm_embedding, norm_hidden, norm
        self.attn_norm, self.attn, self.mlp_norm, self.moe = attn_norm, attn, mlp_norm, moe

    def run(self, model, kv, hidden: torch.Tensor, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """hidden [T, H] (h_i, or the head's own output m_i) and the tokens after them [T] (device) -> m
        [T, H] in the activation dtype for slots start..start+T-1, their keys and values written to `kv`
        (an MtpCache's); model.head(m) gives the next tokens' logits."""
        s, t = self.spec, tokens.shape[0]
        e = F.rms_norm(F.embedding(tokens, model.embed).float(), (s.hidden,), self.norm_embedding, s.eps)
        h = F.rms_norm(hidden.float(), (s.hidden,), self.norm_hidden, s.eps)
        x = self.fc(torch.cat([e, h], dim=-1).to(self.dtype)).float()
        positions = torch.arange(start, start + t, device=x.device)
        a = F.rms_norm(x, (s.hidden,), self.attn_norm, s.eps).to(self.dtype)
        x = x + self.attn(a, kv, positions, model.cos, model.sin, start + t, None).float()
        x = x + self.moe(F.rms_norm(x, (s.hidden,), self.mlp_norm, s.eps).to(self.dtype))
        return F.rms_norm(x, (s.hidden,), self.norm, s.eps).to(self.dtype)

    def nbytes(self) -> int:
        """Weight bytes the head holds on its device (every routed expert's included)."""
        moe = self.moe
        return (self.fc.nbytes() + self.attn.proj.nbytes() + self.attn.out.nbytes() + moe.shared_gate_up.nbytes()
                + moe.shared_down.nbytes() + moe.shared_gate.nbytes() + moe.experts.weight_bytes())


class MtpHooks(MtpDrafting):
    """The GPU engine's hooks for the shared drafting side (runtime/reference/mtp.MtpDrafting): the head
    run on the engine's device, the model's head for the logits, the engine's own forward.
    The engine provides `mtp_head` (an MtpHead, None without one), `model`, `cache` and `setup` besides.

    A head the load left out (the draft mode was not "mtp" then) is read on first use (`mtp_source`, the
    folder): all in VRAM it usually fits; under offload the placement took the budget, and the error
    says to load the model again with the MTP draft mode, which places the experts around the head."""

    mtp_source = None               # the folder whose head was left out at load

    @property
    def has_mtp(self) -> bool:
        return self.mtp is not None or self.mtp_source is not None

    def mtp_enable(self) -> None:
        if self.mtp is None and self.mtp_source is not None:
            self._load_head_now()
        super().mtp_enable()

    def _load_head_now(self) -> None:
        from runtime.errors import OutOfMemory
        from runtime.budget import BudgetError
        again = ("load the model again with the draft mode 'MTP head' (the experts are then placed around "
                 "the head)")
        folder, head, cache = ModelFolder(self.mtp_source), None, None
        try:
            with torch.inference_mode():
                head = load(folder, self.spec, self.model.device, self.model.dtype)
                cache = MtpCache(self.spec, self.cache.capacity, self.model.dtype, self.model.device)
            if self.offload is not None and self.setup is not None:      # the ledger the placement filled
                self.setup.vram.reserve("MTP head", head.nbytes() + cache.nbytes(), again)
        except (torch.cuda.OutOfMemoryError, BudgetError) as e:
            head = cache = None
            raise OutOfMemory(f"no GPU memory left for {self.info.name}'s multi-token-prediction head, which this "
                              f"load left out: {again}", str(e)) from None
        finally:
            folder.close()
        self.mtp_head, self.mtp, self.mtp_source = head, cache, None

    def _mtp_run(self, hidden: torch.Tensor, tokens: list[int], start: int) -> torch.Tensor:
        dev = torch.tensor(tokens, dtype=torch.long).to(self.model.device, non_blocking=True)
        return self.mtp_head.run(self.model, self.mtp.kv, hidden, dev, start)

    def _mtp_logits(self, m: torch.Tensor) -> torch.Tensor:
        return self.model.head(m).float()[0]

    def _mtp_forward(self, tokens: list[int]) -> None:
        self._forward(tokens, last_only=True)


def load(folder: ModelFolder, spec, device: torch.device, dtype: torch.dtype) -> Optional[MtpHead]:
    """The folder's MTP head (`mtp.*`), or None when it has none; its tensors' shapes were checked when the
    folder was opened (modelfolder.validate, qwen35.mtp_layout)."""
    present = set(folder.info.shard_of)
    if not qwen35.has_mtp(present):
        return None
    h = spec.hidden
    if f"{qwen35.MTP}.layers.0.mlp.experts.gate_up_proj" in present:
        raise InvalidModel(folder.path, "the MTP head stores its experts stacked (a bf16 release): the GPU engine "
                                        "runs EXL2 folders only")
    p = f"{qwen35.MTP}.layers.0"
    fc = quant_linear.build(folder, [f"{qwen35.MTP}.fc"], [h], device, dtype)
    quant_linear.check_width(fc, h, 2 * h, f"{folder.path}: {qwen35.MTP}.fc")
    mlp_norm = centred(folder, f"{p}.post_attention_layernorm.weight", device)
    norms = [centred(folder, f"{qwen35.MTP}.{n}.weight", device)
             for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")]
    return MtpHead(spec, fc, norms[0], norms[1], centred(folder, f"{p}.input_layernorm.weight", device),
                   attention_layer(folder, f"{p}.self_attn", spec, 0, device, dtype), mlp_norm,
                   moe_block(folder, f"{p}.mlp", spec, mlp_norm, device, dtype, None, None, "the MTP head"),
                   norms[2], dtype)
