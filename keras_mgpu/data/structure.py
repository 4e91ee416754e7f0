"""The element structure of `write_tfrecords` shards: a tree of tuples and
dicts encoded as `spec.json`'s `structure`, and back."""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np
import tensorflow as tf

# Tuples, lists and dicts nested deeper are refused: walking them (and
# decoding spec.json) recurses once per level.
_MAX_DEPTH = 100


def _check_depth(data, what: str) -> None:
    if _depth_beyond(data, _MAX_DEPTH):
        raise ValueError(
            f"write_tfrecords: {what} is nested more than {_MAX_DEPTH} levels "
            "deep (tuples, lists and dicts inside one another, or a "
            "structure that contains itself). spec.json records the "
            "structure, and reading it back walks every level: flatten it, "
            "e.g. into a dict of arrays."
        )


def _depth_beyond(node, limit: int, spec_tree: bool = False) -> bool:
    """Whether tuples, lists and mappings nest in `node` deeper than `limit`
    (`spec_tree`: the `{"tuple": [...]}` and `{"dict": [[key, value], ...]}`
    nodes of a spec's structure; what is malformed counts as a leaf, for
    `_flat_names` to name). Walks without recursing."""
    stack = [(node, 0)]
    children: Optional[Sequence]
    while stack:
        node, depth = stack.pop()
        if spec_tree:
            children = _spec_children(node)
        elif isinstance(node, Mapping):
            children = list(node.values())
        elif isinstance(node, (tuple, list)):
            children = node
        else:
            children = None
        if children is None:
            continue
        if depth >= limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _skeleton(node, path: str, leaves: list):
    """The JSON structure of `node`, and its `(path, leaf)`s appended to `leaves`.

    Leaves are named `f0`, `f1`, ... in order: dict items in their order,
    then tuple and list items. Lists are recorded as tuples.
    """
    if isinstance(node, Mapping):
        pairs = []
        for key, value in node.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"Dict keys must be str, got {key!r} in {_field(path)}. "
                    "spec.json stores keys as JSON strings."
                )
            pairs.append([key, _skeleton(value, _key_path(path, key),
                                         leaves)[0]])
        return {"dict": pairs}, leaves
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        raise TypeError(
            f"{_field(path, first=True)} is a namedtuple "
            f"({type(node).__name__}): write_tfrecords reads back tuples "
            "and dicts only. Convert it, e.g. `value._asdict()` (or "
            "`tuple(value)`), in `dataset.map` for a dataset."
        )
    if isinstance(node, (tuple, list)):
        return {"tuple": [_skeleton(v, f"{path}[{i}]", leaves)[0]
                          for i, v in enumerate(node)]}, leaves
    leaves.append((path, node))
    return f"f{len(leaves) - 1}", leaves


def _key_path(path: str, key: str) -> str:
    if key.isidentifier():
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"


def _field(path: str, first: bool = False) -> str:
    """`path` in a message (`first`: at the start of a sentence)."""
    what = f"field {path}" if path else "the element"
    return what[0].upper() + what[1:] if first else what


def _as_array(path: str, leaf):
    if isinstance(leaf, (tf.RaggedTensor, tf.SparseTensor)):
        _check_spec(path, tf.type_spec_from_value(leaf))
    array = leaf if isinstance(leaf, (tf.Tensor, np.ndarray)) else (
        np.asarray(leaf))
    if isinstance(array, np.ndarray) and array.dtype.kind in "OV":
        raise TypeError(
            f"{_field(path, first=True)} is an array of dtype "
            f"{array.dtype}: write_tfrecords writes bool, integer, floating, "
            "complex and string arrays of one shape per example. Convert it "
            "(e.g. `np.asarray(x, dtype='float32')`), padding rows of "
            "different lengths to one."
        )
    if len(array.shape) == 0:
        raise ValueError(
            f"{_field(path, first=True)} is a scalar ({leaf!r}): every array "
            "needs a first dimension, one row per example. To write a tuple "
            "or list of numbers as one array, pass `np.asarray(...)`."
        )
    return array


def _check_spec(path: str, spec) -> None:
    what = _field(path, first=True)
    if isinstance(spec, (tf.RaggedTensorSpec, tf.SparseTensorSpec)):
        kind = ("ragged" if isinstance(spec, tf.RaggedTensorSpec)
                else "sparse")
        fix = ("`x.to_tensor()`" if kind == "ragged"
               else "`tf.sparse.to_dense(x)`")
        raise TypeError(
            f"{what} is a {kind} tensor ({spec}): write_tfrecords writes "
            f"dense tensors of one shape per example. Convert it with {fix} "
            "(padding to one shape), e.g. in `dataset.map`."
        )
    if not isinstance(spec, tf.TensorSpec):
        raise TypeError(
            f"{what} is {spec!r}: write_tfrecords writes tensors nested in "
            "tuples, lists and dicts."
        )
    dtype = spec.dtype
    if dtype.is_quantized or not (
            dtype.is_bool or dtype.is_integer or dtype.is_floating
            or dtype.is_complex or dtype == tf.string):
        raise TypeError(
            f"{what} has dtype {dtype.name}: write_tfrecords writes bool, "
            "integer, floating, complex and string tensors."
        )
    if spec.shape.rank and spec.shape[0] is None:
        raise ValueError(
            f"{what} has shape {tuple(spec.shape.as_list())} in the "
            "dataset's element_spec: an unknown first dimension is what "
            "`dataset.batch()` gives, and write_tfrecords writes one example "
            "per element. Pass `dataset.unbatch()`; if each element really "
            "is one example of one fixed shape, declare it (`tf.ensure_shape` "
            "in `dataset.map`, or the `output_signature` of `from_generator`)."
        )


def _flat_names(structure) -> list:
    """The feature names in `structure`, in order; `ValueError` if malformed."""
    if isinstance(structure, str):
        return [structure]
    if isinstance(structure, dict) and len(structure) == 1:
        items = structure.get("tuple")
        if isinstance(items, list):
            return [n for item in items for n in _flat_names(item)]
        pairs = structure.get("dict")
        if isinstance(pairs, list) and all(
                isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                for p in pairs) and len({p[0] for p in pairs}) == len(pairs):
            return [n for _, value in pairs for n in _flat_names(value)]
    raise ValueError(
        f"{structure!r} is not a feature name, {{'tuple': [...]}} or "
        "{'dict': [[key, ...], ...]} with distinct keys")


def _leaf_paths(structure, path: str = "") -> dict:
    """Each feature name of a spec's `structure` and its field's path, as
    `_skeleton` names it (`[0]`, `b.c`; `""` for a single array)."""
    if isinstance(structure, str):
        return {structure: path}
    if "tuple" in structure:
        return {n: p for i, item in enumerate(structure["tuple"])
                for n, p in _leaf_paths(item, f"{path}[{i}]").items()}
    return {n: p for key, value in structure["dict"]
            for n, p in _leaf_paths(value, _key_path(path, key)).items()}


def _spec_children(node) -> Optional[list]:
    """The items of a spec's tuple or dict node; None for anything else."""
    if not isinstance(node, dict) or len(node) != 1:
        return None
    if isinstance(node.get("tuple"), list):
        return node["tuple"]
    pairs = node.get("dict")
    if isinstance(pairs, list) and all(
            isinstance(p, list) and len(p) == 2 for p in pairs):
        return [value for _, value in pairs]
    return None


def _pack(structure, values: Mapping):
    """The nested value of `structure`, its leaves taken from `values` by name."""
    if isinstance(structure, str):
        return values[structure]
    if "tuple" in structure:
        return tuple(_pack(item, values) for item in structure["tuple"])
    return {key: _pack(value, values) for key, value in structure["dict"]}
