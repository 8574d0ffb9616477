"""Atomic writes: the old file or the new one, never half of one; a crash mid-write leaves no stray file."""

from __future__ import annotations

import json
import os
import stat

import pytest

from specpilot.core.files import atomic_save_tensors, atomic_write_bytes, atomic_write_text, copy_tree_atomic


def test_replaces_whole_and_keeps_ordinary_permissions(tmp_path):
    path = tmp_path / "sub" / "manifest.json"
    atomic_write_text(path, "first")
    atomic_write_text(path, "second")
    assert path.read_text() == "second" and os.listdir(path.parent) == ["manifest.json"]
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "profile.json"
    atomic_write_text(path, "good")

    class Boom:      # not bytes: the write fails after the temporary file exists
        def __len__(self):
            return 1
    with pytest.raises(TypeError):
        atomic_write_bytes(path, Boom())
    assert path.read_text() == "good" and os.listdir(tmp_path) == ["profile.json"]


def test_caches_a_crashed_writer_left_are_rebuilt_not_fatal(tmp_path, monkeypatch, capsys):
    """A W12 pack cache entry that is a folder, and a CPU-peaks file cut short: both rebuilt."""
    import torch

    from specpilot.core import costs
    from specpilot.core.w12 import encode, encode_cached
    weight = torch.randn(6, 40).to(torch.bfloat16)
    cache = tmp_path / "cache"
    first = encode_cached(weight, cache)
    (entry,) = (cache / "w12").glob("*.safetensors")
    entry.unlink()
    entry.mkdir()                                   # what a half-finished writer could leave
    again = encode_cached(weight, cache)
    assert torch.equal(again.hi, first.hi) and torch.equal(again.hi, encode(weight).hi) and entry.is_file()
    assert "not a cached W12 pack" in capsys.readouterr().err
    peaks = tmp_path / "cpu-peaks.json"
    peaks.write_text('{"flops": 1e1')
    monkeypatch.setattr(costs, "measure_cpu_peaks", lambda: (3.0, 5.0))
    assert costs._cpu_peaks_cached(str(peaks)) == (3.0, 5.0)
    assert json.loads(peaks.read_text()) == {"flops": 3.0, "bandwidth": 5.0}


def test_a_tree_copy_replaces_the_old_tree_whole(tmp_path):
    first, second, out = tmp_path / "a", tmp_path / "b", tmp_path / "out" / "final"
    (first / "params").mkdir(parents=True)
    (first / "params" / "w.bin").write_bytes(b"1")
    (first / "stale.txt").write_text("only in the first")
    (second / "params").mkdir(parents=True)
    (second / "params" / "w.bin").write_bytes(b"2")
    copy_tree_atomic(first, out)
    copy_tree_atomic(second, out)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == ["params", "params/w.bin"]
    assert (out / "params" / "w.bin").read_bytes() == b"2" and os.listdir(out.parent) == ["final"]


def test_a_failed_tree_copy_leaves_the_old_tree_and_no_staging(tmp_path):
    good, out = tmp_path / "good", tmp_path / "final"
    good.mkdir()
    (good / "manifest.json").write_text("{}")
    copy_tree_atomic(good, out)
    with pytest.raises(FileNotFoundError):
        copy_tree_atomic(tmp_path / "missing", out)
    assert (out / "manifest.json").read_text() == "{}" and sorted(os.listdir(tmp_path)) == ["final", "good"]


def test_tensors_are_saved_whole_or_the_old_file_stays(tmp_path):
    import torch
    from safetensors.torch import load_file
    path = tmp_path / "model.safetensors"
    atomic_save_tensors(path, {"w": torch.arange(6.0).reshape(2, 3)}, {"format": "pt"})
    atomic_save_tensors(path, {"w": torch.ones(2, 3)}, {"format": "pt"})
    assert torch.equal(load_file(path)["w"], torch.ones(2, 3)) and os.listdir(tmp_path) == ["model.safetensors"]
    with pytest.raises(Exception):
        atomic_save_tensors(path, {"w": "not a tensor"})
    assert torch.equal(load_file(path)["w"], torch.ones(2, 3)) and os.listdir(tmp_path) == ["model.safetensors"]
