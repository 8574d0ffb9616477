"""Atomic writes: the old file or the new one, never half of one; a crash mid-write leaves no stray file."""

from __future__ import annotations

import os
import stat

import pytest

from specpilot.core.files import atomic_write_bytes, atomic_write_text


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
