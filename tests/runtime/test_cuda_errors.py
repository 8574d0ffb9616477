"""The CUDA last-error check after a build's calls on the GPU, against a stand-in libcudart (no GPU here)."""

import logging

import pytest

from specpilot.core.errors import SpecPilotError
from specpilot.runtime.cuda_errors import LastError, loaded_cudart

NAMES = {2: b"cudaErrorMemoryAllocation", 700: b"cudaErrorIllegalAddress"}


class FakeCudart:
    """cudaGetLastError returning the queued codes in turn (then 0), and cudaGetErrorName."""

    def __init__(self, codes):
        self.codes = list(codes)

        def get():
            return self.codes.pop(0) if self.codes else 0

        def name(code):
            return NAMES[code]
        self.cudaGetLastError, self.cudaGetErrorName = get, name


def test_a_recovered_allocation_is_cleared_and_other_errors_are_raised_by_name(caplog):
    calls = []
    fake = FakeCudart([0, 2, 2, 700])
    last = LastError(fake)
    verify = last.wrap("target_verify", lambda *a: calls.append(a) or len(calls))
    with caplog.at_level(logging.WARNING, logger="specpilot.runtime.cuda_errors"):
        assert [verify(1, 2), verify(3), verify()] == [1, 2, 3]
    assert last.recovered == 2 and calls == [(1, 2), (3,), ()]
    assert len(caplog.records) == 1 and "target_verify" in caplog.records[0].getMessage()
    with pytest.raises(SpecPilotError, match=r"target_verify: CUDA error cudaErrorIllegalAddress \(700\)"):
        verify()
    assert len(calls) == 4 and fake.codes == []          # the call ran; its error was read once
    assert verify() == 5 and last.recovered == 2


def test_the_loaded_libcudart_is_found_in_the_process_maps():
    maps = "\n".join([
        "7f0000000000-7f0000001000 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6",
        "7f0000002000-7f0000003000 rw-p 00000000 00:00 0",
        "7f0000004000-7f0000005000 r-xp 00000000 08:01 2 /opt/py/nvidia/cu13/lib/libcudart.so.13",
    ])
    assert loaded_cudart(maps) == "/opt/py/nvidia/cu13/lib/libcudart.so.13"
    assert loaded_cudart(maps.rsplit("\n", 1)[0]) is None
    spaced = "7f0000004000-7f0000005000 r-xp 00000000 08:01 2 /opt/my env/lib/libcudart.so.12 (deleted)"
    assert loaded_cudart(spaced) == "/opt/my env/lib/libcudart.so.12"
