"""`runtime.uploads.upload` on the CPU: the array's values, dtype and shape, contiguous or not (the GPU path
differs only in where the copy comes from)."""

import numpy as np
import torch

from specpilot.runtime.uploads import upload


def test_an_upload_holds_the_array():
    rng = np.random.default_rng(0)
    for shape, dtype in (((7,), np.int64), ((4, 13), np.int32), ((3, 5, 2), np.float32)):
        array = rng.integers(-50, 50, size=shape).astype(dtype)
        for given in (array, array.T):            # a transposed view is not contiguous
            got = upload(given, torch.device("cpu"))
            assert got.dtype == torch.from_numpy(array).dtype and tuple(got.shape) == given.shape
            assert np.array_equal(got.numpy(), given)
