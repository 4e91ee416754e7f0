"""`python -m keras_mgpu.compat`: the shapes of the installed Keras's
originals of the functions keras-mgpu runs a copy of, for `_KNOWN_SHAPES`
(keras_mgpu/compat/_core.py)."""

import keras

from keras_mgpu.compat._core import _lookup, _shape_of
from keras_mgpu.compat.keras_trainer import _copied_originals

for _name, (_owner, _) in _copied_originals().items():
    _function = _lookup(_owner, _name)
    _function = getattr(_function, "keras_stock", _function)
    print(f"{_name}: {_shape_of(_function)}  # Keras {keras.__version__}")
