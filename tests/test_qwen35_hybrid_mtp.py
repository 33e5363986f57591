"""The MTP head on the hybrid engine (runtime/backends/hybrid_mtp.py) on the CPU, against the CPU
reference engine's head (runtime/reference/mtp.py, itself checked against an oracle written from the
published model in tests/test_qwen35_mtp.py), on the `tiny-qwen3.5` synthetic EXL2 folder (it has a head).

Tolerance: max |logit difference| <= 5e-3 on logits of order 1. The engine's model is 2e-3 from the
reference (tests/test_qwen35_hybrid_engine.py: the experts' intermediate in fp16); the head adds one
more MoE with the same rounding, and a chained draft reads the head's own output. A head fed the wrong
slot or hidden state differs by far more (drafts one position off: 1.8, checked by the first test).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.backends import hybrid
from runtime.errors import BadRequest, InvalidModel, OutOfMemory
from runtime.options import DraftOptions, LoadOptions, OffloadOptions, SamplingOptions
from runtime.reference import load as reference_load
from runtime.speculative import make_decoder
from tests.test_qwen35_mtp import _greedy

TOL = 5e-3
WINDOW = 6
GREEDY = SamplingOptions(temperature=0.0)


@pytest.fixture(scope="module")
def ref(tiny_qwen35):
    engine, _ = reference_load(tiny_qwen35, precision="float32")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def eng(tiny_qwen35):
    engine, _ = hybrid.load(tiny_qwen35, LoadOptions(offload=OffloadOptions(context_length=512)), device="cpu",
                            window=WINDOW, mtp=True)
    yield engine
    engine.close()


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _drafts(engine, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor]:
    rows: list[torch.Tensor] = []
    got = engine.mtp_draft(tokens, k, lambda row: rows.append(row.clone()) or int(row.argmax()))
    return got, torch.stack(rows)


def _same_drafts(ref, eng, tokens: list[int], k: int, what: str) -> list[int]:
    want, want_rows = _drafts(ref, tokens, k)
    got, got_rows = _drafts(eng, tokens, k)
    finite = torch.isfinite(want_rows)
    assert torch.equal(finite, torch.isfinite(got_rows)), f"{what}: the refused tokens differ"
    diff = (got_rows[finite] - want_rows[finite]).abs().max().item()
    assert diff <= TOL, f"{what}: max |logit diff| {diff:.2e} > {TOL}"
    assert got == want, what
    return got


def test_drafts_match_the_reference_through_decode_verify_and_rollback(ref, eng):
    seq = _tokens(140, 1)
    for e in (ref, eng):
        e.reset()
        e.mtp_enable()
        e.forward(seq[:20])
    assert want_off_by_one_differs(ref, seq)
    for n in range(20, 24):                                       # a draft of 3 after each decode step
        _same_drafts(ref, eng, seq[:n + 1], 3, f"drafts after {n + 1} tokens")
        for e in (ref, eng):
            e.forward([seq[n]])
    for keep in (0, 2, WINDOW):                                   # a verify of WINDOW rows, then a rollback
        for e in (ref, eng):
            e.forward(seq[24:24 + WINDOW])
            e.truncate(24 + keep)
        _same_drafts(ref, eng, seq[:25 + keep], 3, f"drafts after a verify that kept {keep} rows")
        for e in (ref, eng):
            e.truncate(24)
    for e in (ref, eng):                                          # past the rows the head keeps (80)
        e.forward(seq[24:130])
        e.truncate(12)
    assert not eng.mtp.has_row(3)
    _same_drafts(ref, eng, seq[:13], 4, "drafts after a truncate before the head's kept rows")
    assert eng.position == ref.position == 12


def want_off_by_one_differs(ref, seq) -> bool:
    """The check the tolerance rests on: drafts from the slot one position off differ by far more."""
    a = _drafts(ref, seq[:21], 1)[1]
    ref.truncate(19)
    b = _drafts(ref, seq[:20], 1)[1]
    ref.forward(seq[19:20])
    finite = torch.isfinite(a)
    return (a[finite] - b[finite]).abs().max().item() > 10 * TOL


def test_a_head_switched_on_mid_conversation_catches_up(tiny_qwen35, ref):
    engine, _ = hybrid.load(tiny_qwen35, LoadOptions(offload=OffloadOptions(context_length=512)), device="cpu",
                            window=WINDOW, mtp=True)
    try:
        seq = _tokens(31, 2)
        ref.reset()                  # the head's slots emptied, then off as in a load without a drafter
        ref.mtp_on = False
        for e in (ref, engine):
            e.forward(seq[:30])
        assert not engine.mtp_on
        _same_drafts(ref, engine, seq, 2, "drafts after the head was off for the prefill")
        assert engine.mtp_on and engine.position == 30
        t = engine.telemetry()
        assert t["mtp_following"] and t["mtp_head_bytes"] > 0
    finally:
        engine.close()


def test_greedy_mtp_speculation_equals_plain_decoding(eng):
    for prompt, k in ((_tokens(9, 3), 3), (_tokens(5, 4), WINDOW - 1)):
        want, _ = _greedy(eng, prompt, 30, None)
        got, dec = _greedy(eng, prompt, 30, DraftOptions(mode="mtp", draft_tokens=k, adaptive=False))
        assert got == want
        assert dec.stats().mode == "mtp" and dec.stats().drafted_tokens > 0


def test_a_head_left_out_at_load_is_read_on_first_use(tiny_qwen35, ref, tmp_path):
    """Loaded with another draft mode, the engine leaves the head out (one layer's weights) and reads it
    when a request first drafts with it: the drafts are the reference's. Where the VRAM budget has no
    room left (offload: the placement took it), the error says to load again with the MTP draft mode.
    A folder without a head says so."""
    opts = LoadOptions(offload=OffloadOptions(context_length=256))
    plain, _ = hybrid.load(tiny_qwen35, opts, device="cpu", window=WINDOW)
    try:
        assert plain.mtp_head is None and plain.has_mtp and "mtp_head_bytes" not in plain.telemetry()
        dec = make_decoder(plain, DraftOptions(mode="mtp", draft_tokens=2, adaptive=False), GREEDY)
        assert dec is not None and plain.mtp_head is not None and plain.mtp_source is None
        seq = _tokens(21, 8)
        ref.reset()
        ref.mtp_enable()
        for e in (ref, plain):
            e.forward(seq[:20])
        _same_drafts(ref, plain, seq, 3, "drafts of a head read on first use")
    finally:
        plain.close()
    tight, _ = hybrid.load(tiny_qwen35, opts, device="cpu", window=WINDOW, host_experts=True)
    try:
        tight.setup.vram.total_bytes = tight.setup.vram.used_bytes          # the placement took it all
        with pytest.raises(OutOfMemory, match="load the model again with the draft mode 'MTP head'"):
            tight.mtp_enable()
        assert tight.mtp_head is None and tight.has_mtp                    # nothing half-made; it may try again
    finally:
        tight.close()
    bare = _edited_copy(tiny_qwen35, tmp_path / "bare", None, None)
    headless, _ = hybrid.load(bare, opts, device="cpu")
    try:
        assert not headless.has_mtp
        with pytest.raises(BadRequest, match="has no multi-token-prediction head"):
            headless.mtp_enable()
        with pytest.raises(ValueError, match="draft.mode is 'mtp' but .* has no multi-token-prediction head"):
            make_decoder(headless, DraftOptions(mode="mtp"), GREEDY)
    finally:
        headless.close()
    opts = LoadOptions(offload=OffloadOptions(context_length=256), draft=DraftOptions(mode="mtp", draft_tokens=3))
    drafting, _ = hybrid.load(tiny_qwen35, opts, device="cpu")
    try:
        assert drafting.mtp_head is not None and drafting.cache.window == 4
    finally:
        drafting.close()


def _edited_copy(src, dst, name: str | None, value: torch.Tensor | None):
    """A copy of the folder with tensor `name` replaced by `value` (None: removed; name None: every mtp.*
    tensor removed, a folder without a head)."""
    shutil.copytree(src, dst)
    index = dst / "model.safetensors.index.json"
    if name is None:
        for shard in dst.glob("*.safetensors"):
            tensors = {k: v for k, v in load_file(shard).items() if not k.startswith("mtp.")}
            save_file(tensors, shard, metadata={"format": "pt"})
        if index.exists():
            data = json.loads(index.read_text())
            data["weight_map"] = {k: v for k, v in data["weight_map"].items() if not k.startswith("mtp.")}
            index.write_text(json.dumps(data))
        return dst
    for shard in dst.glob("*.safetensors"):
        tensors = load_file(shard)
        if name in tensors:
            if value is None:                      # gone from the shard and from the index
                del tensors[name]
                if index.exists():
                    data = json.loads(index.read_text())
                    del data["weight_map"][name]
                    index.write_text(json.dumps(data))
            else:
                tensors[name] = value
            save_file(tensors, shard, metadata={"format": "pt"})
            return dst
    raise AssertionError(f"{name} not in {src}")


@pytest.mark.parametrize("name, value, message", [
    ("mtp.norm.weight", torch.zeros(3, dtype=torch.float16), "'mtp.norm.weight' has shape [3], the config implies"),
    ("mtp.pre_fc_norm_hidden.weight", None, "tensor 'mtp.pre_fc_norm_hidden.weight' is missing"),
])
def test_a_broken_head_is_refused_by_name(tiny_qwen35, tmp_path, name, value, message):
    """Checked with the folder (modelfolder.validate) as the model's own tensors are: a model whose head
    is broken is refused before anything loads, whichever engine and draft mode."""
    folder = _edited_copy(tiny_qwen35, tmp_path / "broken", name, value)
    with pytest.raises(InvalidModel) as e:
        hybrid.load(folder, LoadOptions(offload=OffloadOptions(context_length=256)), device="cpu", mtp=True)
    assert message in e.value.message


def test_the_expert_path_trial_leaves_the_heads_slots_as_they_were(ref, eng):
    """The trial's timed steps (run under hold_position) move the head's slots and kept rows past the
    conversation's end; afterwards the drafts are the reference's, with no rebuild."""
    from runtime.backends.expert_path import time_decode_steps
    seq = _tokens(40, 6)
    for e in (ref, eng):
        e.reset()
        e.mtp_enable()
        e.forward(seq[:30])
    rebuilt: list[int] = []
    rebuild = eng._mtp_rebuild
    eng._mtp_rebuild = lambda n: rebuilt.append(n) or rebuild(n)
    try:
        assert len(time_decode_steps(eng, steps=12)) == 12
        assert eng.position == 30 and eng.mtp.slots == 29
        _same_drafts(ref, eng, seq[:31], 3, "drafts after the trial")
        assert not rebuilt
    finally:
        eng._mtp_rebuild = rebuild


def test_the_decoders_never_sample_an_image_or_video_placeholder(eng):
    """The placeholders are refused as input (the language model only), so the decoders never sample them
    (runtime/engine.offered): a random model's greedy answer picked one (id 1004 here) and its next forward
    was refused mid-answer. The engine's own logits are left as they are (comparisons read them)."""
    from runtime.engine import offered
    from runtime.generate import PlainDecoder
    media = list(eng.spec.media_tokens)
    assert media and tuple(media) == eng.refused_tokens and all(t < eng.spec.vocab for t in media)
    eng.reset()
    logits = eng.forward(_tokens(6, 11))
    assert bool(torch.isfinite(logits).all())
    assert bool((offered(eng, logits)[:, media] == float("-inf")).all())
    with pytest.raises(BadRequest, match="image or video placeholder"):
        eng.forward([media[0]])
    eng.reset()                                           # a row whose argmax is a placeholder: not taken
    prompt = _tokens(6, 11)
    eng.forward(prompt[:-1])
    boosted = eng.forward
    eng.forward = lambda toks: boosted(toks).index_fill(-1, torch.tensor([media[0]]), 1e4)
    try:
        tok = PlainDecoder(eng, SamplingOptions(temperature=0.0), None).step(prompt)[0]
    finally:
        del eng.forward
    assert tok not in media
    eng.reset()


def test_no_attention_of_the_engine_or_its_head_may_run_on_cudnn(eng, monkeypatch):
    """cuDNN's attention built a new plan for every attended length on the H200 (~25 ms each: every MTP head
    run of a decode step paid it): prefill chunks, decode steps, verifies and the head's runs all leave it out."""
    from runtime.backends import hybrid_layers
    real, seen = hybrid_layers.F.scaled_dot_product_attention, []

    def sdpa(q, *a, **kw):
        seen.append((q.shape[2], torch.backends.cuda.cudnn_sdp_enabled()))
        return real(q, *a, **kw)
    monkeypatch.setattr(hybrid_layers.F, "scaled_dot_product_attention", sdpa)
    prompt = _tokens(9, 5)
    _greedy(eng, prompt, 6, DraftOptions(mode="mtp", draft_tokens=3, adaptive=False))
    assert len({rows for rows, _ in seen}) > 2, seen          # prefill, decode, verify and head rows were seen
    assert not any(cudnn for _, cudnn in seen), seen
