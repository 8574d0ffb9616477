"""W12: bit-exact round trips (every bf16 pattern, odd shapes, special values), the nested
8-bit view's error bound, pack files with checksums, and the stats command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specpilot.core import w12
from specpilot.core.errors import CheckpointError, SpecPilotError


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def test_all_65536_bit_patterns_round_trip():
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    for shape in [(256, 256), (65536, 1), (1, 65536), (1024, 64)]:
        w = every.reshape(shape)
        assert same_bits(w12.decode(w12.encode(w)), w)
    shuffled = every[torch.randperm(65536, generator=torch.Generator().manual_seed(0))].reshape(128, 512)
    assert same_bits(w12.decode(w12.encode(shuffled)), shuffled)


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (7, 129), (33, 1), (64, 4097), (5, 3, 7), (17,)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("scale", [0.02, 1.0, 300.0])
def test_random_tensors_round_trip(shape, scale):
    g = torch.Generator().manual_seed(hash((shape, scale)) % 2**31)
    w = (torch.randn(shape, generator=g) * scale).to(torch.bfloat16)
    pack = w12.encode(w)
    assert same_bits(w12.decode(pack), w)
    assert pack.hi.dtype == torch.uint8 and pack.lo.numel() == (pack.numel + 1) // 2


def test_special_values_go_to_the_escape_list_and_come_back():
    specials = torch.tensor([0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7FC1, 0xFFFF, 0x7F81],
                            dtype=torch.int32).to(torch.int16)       # ±0, subnormals, ±inf, NaNs with payloads
    row = torch.full((64,), 0x3F80, dtype=torch.int16)              # 1.0
    row[:9] = specials
    row[20], row[21] = 0x5F00, 0x1F00                               # far outliers above and below the window
    w = row.view(torch.bfloat16).reshape(1, -1)
    pack = w12.encode(w)
    assert set(pack.escape_index.tolist()) == set(range(9)) | {20, 21}
    assert same_bits(w12.decode(pack), w)


def test_nested_view_is_the_hi_plane_within_two_to_the_minus_four():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(61, 333, generator=g) * 0.05).to(torch.bfloat16)
    pack = w12.encode(w)
    view = w12.decode_hi(pack).float()
    exact = w.float()
    normal = exact.abs() > 0
    rel = ((view - exact).abs() / exact.abs())[normal]
    assert rel.max() <= 2 ** -4 and rel.mean() < 2 ** -5
    # the view depends on the hi plane alone: destroying the lo plane changes nothing
    pack.lo.zero_()
    assert torch.equal(w12.decode_hi(pack).float(), view)


def test_bytes_ratio_is_three_quarters_plus_metadata():
    w = (torch.randn(512, 1024) * 0.02).to(torch.bfloat16)
    pack = w12.encode(w)
    assert 0.75 < pack.nbytes / (2 * pack.numel) < 0.752


def test_rejects_non_bf16():
    with pytest.raises(SpecPilotError, match="W12 packs bf16 weights"):
        w12.encode(torch.randn(4, 4))


def test_pack_file_round_trip_and_corruption(tmp_path):
    g = torch.Generator().manual_seed(2)
    packs = {"a.weight": w12.encode((torch.randn(31, 45, generator=g)).to(torch.bfloat16)),
             "b.weight": w12.encode((torch.randn(8, 8, generator=g) * 1e-3).to(torch.bfloat16))}
    path = tmp_path / "model.w12.safetensors"
    w12.save_pack(packs, path)
    loaded = w12.load_pack(path)
    for name, p in packs.items():
        assert same_bits(w12.decode(loaded[name]), w12.decode(p))
    # flip one bit of a stored plane: the checksum of the decoded source no longer matches
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open
    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    tensors["a.weight::hi"][3, 4] ^= 0x10
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(CheckpointError, match="a.weight does not decode to its source"):
        w12.load_pack(path)
    path.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot read W12 pack"):
        w12.load_pack(path)


def test_stats_cli_json(run_cli):
    spec = Path(__file__).resolve().parents[2] / "examples" / "tiny-hybrid.yaml"
    code, out, _ = run_cli("w12", "stats", spec, "--json")
    result = json.loads(out)
    assert code == 0 and result["bit_exact"] is True
    assert set(result) >= {"bytes_ratio", "escape_rate", "bit_exact", "tensors"}
    assert 0.75 < result["bytes_ratio"] < 0.8
    assert all(t["bit_exact"] for t in result["tensors"])
    names = {t["name"] for t in result["tensors"]}
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in names and "model.norm.weight" not in names


def test_stats_of_weights_that_are_not_bf16_values_are_not_bit_exact(run_cli, tmp_path):
    import yaml
    data = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "tiny-llama.yaml").read_text())
    data["target"]["init"] = {"seed": 7}                 # float32 draws, not rounded to bf16
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(data))
    code, out, _ = run_cli("w12", "stats", tmp_path / "m.yaml")
    assert code == 1 and "bit-exact round trip: False" in out and "not bf16 values" in out   # 1: not exact


def test_packs_are_converted_once_and_cached_by_content(tmp_path, capsys):
    w = (torch.randn(33, 70, generator=torch.Generator().manual_seed(8)) * 0.1).to(torch.bfloat16)
    first = w12.encode_cached(w, cache=tmp_path)
    files = list((tmp_path / "w12").iterdir())
    assert len(files) == 1 and files[0].name == f"{first.source_sha256}.safetensors"
    stamp = files[0].stat().st_mtime_ns
    again = w12.encode_cached(w, cache=tmp_path)
    assert files[0].stat().st_mtime_ns == stamp          # read back, not rebuilt
    assert torch.equal(w12.decode(again).view(torch.int16), w.view(torch.int16))
    other = w.clone()
    other[0, 0] = 1.0
    w12.encode_cached(other, cache=tmp_path)             # other bits: another entry
    assert len(list((tmp_path / "w12").iterdir())) == 2
    data = bytearray(files[0].read_bytes())              # a corrupt entry is noticed and rebuilt
    data[-3] ^= 0x55
    files[0].write_bytes(bytes(data))
    rebuilt = w12.encode_cached(w, cache=tmp_path)
    assert "rebuilding" in capsys.readouterr().err
    assert torch.equal(w12.decode(rebuilt).view(torch.int16), w.view(torch.int16))
    assert w12.encode_cached(w, cache=tmp_path).source_sha256 == first.source_sha256


def test_cache_can_be_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CACHE_DIR", "off")
    assert w12.cache_dir() is None
    w = torch.ones(4, 4, dtype=torch.bfloat16)
    assert torch.equal(w12.decode(w12.encode_cached(w)).view(torch.int16), w.view(torch.int16))
