"""Browsing against the fake hub on loopback: search, branches, bits per weight, sizes, offline, gated."""
import pytest
from fakehub import Branch, Repo, fake_hub, tiny_exl2_repo  # noqa: F401 (fake_hub is a fixture)

from app.hub.browse import HubClient, parse_branch_bpw
from app.hub.errors import HubAccessError, HubOffline


@pytest.mark.parametrize("branch, expected", [
    ("4.0bpw", (4.0, None)), ("6_5", (6.5, None)), ("3bpw", (3.0, None)), ("8.0bpw-h8", (8.0, 8.0)),
    ("5.0bpw_h6", (5.0, 6.0)), ("4.25bpw", (4.25, None)), ("main", (None, None)), ("2024", (None, None)),
    ("v1.0-rc", (None, None)), ("0_5", (None, None)),
])
def test_branch_names(branch, expected):
    assert parse_branch_bpw(branch) == expected


def test_search_finds_tagged_and_named_exl2_repos(fake_hub):
    fake_hub.add(Repo("other/Named-exl2", {"main": Branch("main", {"a.txt": b"x"})}, tags=[], downloads=5))
    fake_hub.add(Repo("other/Plain-model", {"main": Branch("main", {"a.txt": b"x"})}, tags=[], downloads=99))
    ids = [r.repo_id for r in HubClient().search("")]
    assert ids == ["tester/Tiny-MoE-exl2", "other/Named-exl2"]
    assert [r.repo_id for r in HubClient().search("tiny")] == ["tester/Tiny-MoE-exl2"]


def test_quants_list_branches_with_bpw_and_sizes(fake_hub):
    repo = fake_hub.repos["tester/Tiny-MoE-exl2"]
    quants = HubClient().quants("tester/Tiny-MoE-exl2")
    assert [q.branch for q in quants] == ["4.0bpw", "6_5"]          # main holds no weights: not a quant
    for q in quants:
        branch = repo.branches[q.branch]
        assert q.commit == branch.commit
        assert q.size_bytes == sum(len(d) for d in branch.files.values())
        assert q.config["num_experts"] == 8
        weights = next(f for f in q.files if f.path == "model.safetensors")
        assert weights.sha256 is not None and weights.size == len(branch.files["model.safetensors"])
    assert (quants[0].bpw, quants[0].head_bits) == (4.0, 6.0)       # from quantization_config
    assert (quants[1].bpw, quants[1].head_bits) == (6.5, 6.0)


def test_bpw_falls_back_to_the_branch_name(fake_hub):
    b = tiny_exl2_repo().branches["4.0bpw"]
    files = dict(b.files, **{"config.json": b'{"architectures": ["Qwen3MoeForCausalLM"]}'})
    fake_hub.add(Repo("x/NoQc-exl2", {"3_5": Branch("3_5", files)}, tags=["exl2"]))
    (q,) = HubClient().quants("x/NoQc-exl2")
    assert (q.bpw, q.head_bits) == (3.5, None)


def test_offline_hub_is_reported_in_words(monkeypatch, fake_hub):
    assert HubClient().search("tiny")                 # online first: a kept-alive connection exists
    fake_hub.stop()
    with pytest.raises(HubOffline, match="cannot be reached.*Local models keep working"):
        HubClient().search("tiny")


def test_offline_mode_is_reported_too(monkeypatch, fake_hub):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubOffline):
        HubClient().quants("tester/Tiny-MoE-exl2")


def test_missing_repo_says_private_or_missing(fake_hub):
    with pytest.raises(HubAccessError, match="does not exist, or it is private"):
        HubClient().quants("nobody/nothing")
