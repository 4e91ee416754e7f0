"""keras_mgpu.backend.tensorflow.collectives: host values from every worker, compiled once.

Over several workers it is exercised by the logger's and the backup's
multi-worker tests; here, the row layout on one worker's replicas.
"""

import numpy as np

from keras_mgpu.backend.tensorflow import collectives as _collectives
from tests.conftest import mirrored


def test_one_worker_gets_its_own_row_back_without_a_collective():
    row = np.array([1.5, 2.0, -3.0])
    np.testing.assert_array_equal(
        _collectives.gather_rows(mirrored(2), row, num_workers=1), [row])


def test_the_compiled_gather_keeps_each_value_in_float64():
    # Two replicas of one worker, read as two workers of one replica each:
    # both rows are the worker's own, exactly (1e-12 would round in float32).
    row = np.array([1.0 + 1e-12, 123456789.125])
    rows = _collectives.gather_rows(mirrored(2), row, num_workers=2)
    assert rows.dtype == np.float64
    np.testing.assert_array_equal(rows, [row, row])
    assert _collectives.sum_over_workers(mirrored(2), 0.25,
                                         num_workers=2) == 0.5
