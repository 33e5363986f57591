"""Qwen3.5-MoE's multi-token-prediction head on the hybrid engine: the draft of `draft.mode = "mtp"`.

The math is the CPU reference's (runtime/reference/mtp.py says what the head computes from the model's
final hidden state h_i and the token t_{i+1}, and how its cache slots follow the model's forwards); the
slots and kept rows live in the same `MtpCache`, here on the engine's device. The head's decoder layer
is built as the model's own (runtime/backends/hybrid_layers.py): gated attention over the head's own
KV cache and the MoE with its shared expert, the residual stream in float32.

Its routed experts stay in VRAM, outside the offload manager: the head runs once per drafted token, one
row at a time, and waiting for PCIe there would cost more than the draft saves. They are one layer's
experts, so a load asks for the head only when the draft options choose "mtp" (hybrid.load).
`MtpDrafting` is the engine's side: the slots following its forwards, the drafts, a rebuild when the
head fell behind.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from runtime import qwen35
from runtime.backends import quant_linear
from runtime.backends.hybrid_layers import AttentionLayer, MoeBlock, attention_layer, centred, moe_block
from runtime.errors import BadRequest, EngineError, InvalidModel
from runtime.modelfolder import ModelFolder


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


class MtpDrafting:
    """The engine's side of the head (HybridExl2Engine inherits it): the slots follow its forwards, the
    drafts chain the head; the bookkeeping is the reference engine's (runtime/reference/hybrid.py). The
    engine provides `mtp_head` (None without one), `mtp` (its MtpCache), `mtp_on`, `mtp_missing`, `model`,
    `spec`, `info`, `tokens`, `cache`, `position` and `_forward`; its truncate trims the head's slots."""

    @property
    def has_mtp(self) -> bool:
        return self.mtp_head is not None

    def mtp_enable(self) -> None:
        """Let the head follow every forward from now on (about one layer's work per forward)."""
        if self.mtp_head is None:
            raise BadRequest(self.mtp_missing or f"{self.info.name} has no multi-token-prediction head loaded")
        self.mtp_on = True

    def _mtp_follow(self, start: int, ids: list[int], hidden: torch.Tensor) -> None:
        """After a forward of positions start..start+T-1: fill slots start-1..start+T-2 from (h_i, t_{i+1})
        when the slots before them are filled (else they wait for mtp_draft's rebuild), keep the rows."""
        head = self.mtp
        if start == 0:
            head.slots = 0
        if start == 0 or (head.slots == start - 1 and head.has_row(start - 1)):
            h = hidden[:-1] if start == 0 else torch.cat([head.row(start - 1)[None], hidden[:-1]])
            toks = ids[1:] if start == 0 else ids
            if toks:
                dev = torch.tensor(toks, dtype=torch.long).to(self.model.device, non_blocking=True)
                self.mtp_head.run(self.model, head.kv, h, dev, max(start - 1, 0))
            head.slots = start + len(ids) - 1
        head.keep_rows(start, hidden)

    def mtp_draft(self, tokens: list[int], k: int, choose: Callable[[torch.Tensor], int]) -> list[int]:
        """Up to k draft tokens after `tokens` (the cache holds all but the last) from the MTP head;
        `choose(logits [V] float32) -> token` picks each (greedy or sampled, by the caller's rule)."""
        self.mtp_enable()
        n = len(tokens) - 1
        if n != self.position:
            raise EngineError(f"MTP draft after {len(tokens)} tokens: the cache holds {self.position}, "
                              f"not the {n} before the last")
        head, drafts = self.mtp, []
        if n == 0:
            return drafts
        with torch.inference_mode():
            if head.slots < n - 1 or not head.has_row(n - 1):
                self._mtp_rebuild(n)
            h, tok = head.row(n - 1)[None], tokens[-1]
            for pos in range(n - 1, min(n - 1 + k, head.capacity)):
                dev = torch.tensor([tok], dtype=torch.long).to(self.model.device, non_blocking=True)
                h = self.mtp_head.run(self.model, head.kv, h, dev, pos)
                logits = self.model.head(h).float()[0]
                for media in self.spec.media_tokens:        # tokens the verify would refuse: never drafted
                    if media < logits.shape[0]:
                        logits[media] = float("-inf")
                tok = choose(logits)
                drafts.append(tok)
        return drafts

    def _mtp_rebuild(self, n: int) -> None:
        """The head missed part of the conversation (it was off): run the model over it again."""
        keep = self.tokens[:n]
        self.cache.reset()
        self.tokens = []
        self.mtp.slots, self.mtp.rows = 0, None
        self._forward(keep, last_only=True)

    def place_experts(self, resident: list[list[int]]) -> None:
        """Tests and benchmarks: these experts of each layer in VRAM slots, the others read from host memory."""
        if self.offload is None:
            raise EngineError("place_experts needs a model loaded with expert offload")
        self._drop_graphs()
        self.offload.apply(resident)


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
