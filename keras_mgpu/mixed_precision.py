"""Mixed precision: pick a policy, audit a model for it, watch the loss scale.

`LossScaleMonitor` and `loss_scale` live in
`keras_mgpu.callbacks.loss_scale_monitor` and are importable from here too.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import keras
import tensorflow as tf

from keras_mgpu import compat
# Loss-scale telemetry lives with the other callbacks; both names stay
# importable from here.
from keras_mgpu.callbacks.loss_scale_monitor import LossScaleMonitor  # noqa: F401
from keras_mgpu.callbacks.loss_scale_monitor import loss_scale  # noqa: F401
from keras_mgpu.layers.fp32_output_head import FP32OutputHead

__all__ = [
    "set_policy", "choose_policy", "audit", "Finding",
    "gpu_compute_capabilities", "LossScaleMonitor", "loss_scale",
]

logger = logging.getLogger(__name__)

VALID_POLICIES = ("auto", "float32", "mixed_float16", "mixed_bfloat16")
HALF_DTYPES = ("float16", "bfloat16")

# Activations that overflow, underflow or lose the tails of a distribution in
# half precision (exp of 12 overflows float16; softmax of a float16 logit
# vector saturates to exact 0s and 1s).
SENSITIVE_ACTIVATIONS = (
    "softmax",
    "log_softmax",
    "sigmoid",
    "log_sigmoid",
    "exponential",
    "softplus",
)
_CROSSENTROPY_LOSSES = {
    "categorical_crossentropy": "softmax",
    "sparse_categorical_crossentropy": "softmax",
    "binary_crossentropy": "sigmoid",
}


# --- Policy choice -----------------------------------------------------------


def choose_policy(
    compute_capabilities: Sequence[tuple[int, int] | None],
) -> tuple[str, str]:
    """The policy "auto" picks for these GPUs, and why. A pure function.

    Every replica must use the same policy, so the weakest GPU decides.

    Args:
        compute_capabilities: One `(major, minor)` per visible GPU, as
            `tf.config.experimental.get_device_details(gpu)
            ["compute_capability"]` gives it (`None` where unknown). Empty
            means no GPU.

    Returns:
        `(policy_name, reason)`.

    Example:

    >>> from keras_mgpu import mixed_precision
    >>> mixed_precision.choose_policy([(8, 0), (9, 0)])[0]
    'mixed_bfloat16'
    >>> mixed_precision.choose_policy([(7, 5)])[0]
    'mixed_float16'
    >>> mixed_precision.choose_policy([])[0]
    'float32'
    """
    if not compute_capabilities:
        return "float32", (
            "no GPU visible: mixed precision is slower than float32 on most "
            "CPUs; pass an explicit policy to force it"
        )
    if any(cc is None for cc in compute_capabilities):
        return "float32", (
            "a GPU did not report its compute capability, so half-precision "
            "support is unknown"
        )
    weakest = min(tuple(cc) for cc in compute_capabilities if cc is not None)
    shown = f"{weakest[0]}.{weakest[1]}"
    if weakest >= (8, 0):
        return "mixed_bfloat16", (
            f"weakest GPU has compute capability {shown} >= 8.0: bfloat16 "
            "tensor cores, float32's range, no loss scaling needed"
        )
    if weakest >= (7, 0):
        return "mixed_float16", (
            f"weakest GPU has compute capability {shown}: float16 tensor "
            "cores (7.0+) but no fast bfloat16 (8.0+); loss scaling is used"
        )
    return "float32", (
        f"weakest GPU has compute capability {shown} < 7.0: no tensor cores, "
        "so mixed precision would gain little"
    )


def gpu_compute_capabilities() -> list[tuple[int, int] | None]:
    """The compute capability of each visible physical GPU."""
    return [
        tf.config.experimental.get_device_details(gpu).get("compute_capability")
        for gpu in tf.config.list_physical_devices("GPU")
    ]


def set_policy(policy: str = "auto", *, verbose: bool = False) -> str:
    """Sets Keras's global dtype policy, choosing it from the GPUs for "auto".

    Call it before building the model: layers take the global policy when
    they are created.

    Args:
        policy: Defaults to `"auto"`: `mixed_bfloat16` when every GPU has
            compute capability 8.0 or more, `mixed_float16` when every GPU
            has 7.0 or more, otherwise (and on CPU) `float32`. Or one of
            `"float32"`, `"mixed_float16"`, `"mixed_bfloat16"`.
        verbose: Defaults to `False`. If `True`, prints the policy and why.

    Returns:
        The name of the policy set.

    Example:

    >>> import keras
    >>> from keras_mgpu import mixed_precision
    >>> mixed_precision.set_policy("mixed_bfloat16")
    'mixed_bfloat16'
    >>> keras.mixed_precision.set_global_policy("float32")
    """
    if policy not in VALID_POLICIES:
        raise ValueError(
            f"Unknown dtype policy {policy!r}. Valid policies: "
            f"{', '.join(repr(p) for p in VALID_POLICIES)}."
        )
    if policy == "auto":
        policy, reason = choose_policy(gpu_compute_capabilities())
    else:
        reason = "requested explicitly"
    keras.mixed_precision.set_global_policy(policy)
    message = f"keras_mgpu: dtype policy {policy} ({reason})"
    logger.info(message)
    if verbose:
        print(message)
    return policy


# --- Audit -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Finding:
    """One mixed-precision problem that `audit` found.

    Args:
        layer: Name of the layer concerned (or of the model, for the
            optimizer).
        problem: What is wrong.
        fix: How to fix it.
    """

    layer: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.layer}: {self.problem} Fix: {self.fix}"


def audit(model: keras.Model, *, strict: bool = False) -> list[Finding]:
    """Lists what in `model` loses precision or overflows under mixed precision.

    Checks:
    - model outputs that are not float32;
    - softmax, sigmoid, log- and exp-type activations computed in float16 or
      bfloat16;
    - a cross-entropy loss with `from_logits=False` whose loss would clip
      probabilities where logits were available: fed by a half-precision
      softmax/sigmoid (the cast to float32 before the loss hides the
      logits), by a float32 one after half-precision layers on a backend
      whose losses do not recover Keras's own activations' logits (JAX),
      or by an `FP32OutputHead` whose logits this Keras's losses cannot be
      given (measured on the active backend);
    - under float16, a compiled optimizer that is not a `LossScaleOptimizer`;
    - custom layers computing in half precision that read float32 variables
      without casting them (`autocast=False` on the layer or the variable).

    Args:
        model: A built Keras model, compiled or not (compile it to check the
            loss and optimizer). A `GradientAccumulationModel` is audited
            through its inner model.
        strict: Defaults to `False`. If `True`, raises `ValueError` listing
            the findings when there are any.

    Returns:
        The findings, empty for a clean model.

    Example:

    >>> import keras
    >>> from keras_mgpu import mixed_precision
    >>> keras.mixed_precision.set_global_policy("mixed_float16")
    >>> model = keras.Sequential([keras.Input((4,)),
    ...                           keras.layers.Dense(3, activation="softmax")])
    >>> keras.mixed_precision.set_global_policy("float32")
    >>> [f.problem.split(":")[0] for f in mixed_precision.audit(model)]
    ['output is float16, not float32', 'softmax computed in float16']
    """
    layers = [model] + compat.sublayers(model)
    findings = []
    findings += _check_outputs(model)
    findings += _check_activations(layers)
    findings += _check_loss(model, layers)
    findings += _check_optimizer(model, layers)
    findings += _check_custom_variables(layers)
    if strict and findings:
        raise ValueError(
            f"Mixed-precision audit of {model.name!r} found "
            f"{len(findings)} problem(s):\n"
            + "\n".join(f"- {finding}" for finding in findings)
        )
    return findings


def _outputs(model) -> list:
    inner = getattr(model, "inner", None)
    if isinstance(inner, keras.Model):
        return _outputs(inner)
    try:
        return list(keras.tree.flatten(model.outputs))
    except (AttributeError, ValueError):
        # Subclassed models have no symbolic outputs to inspect.
        return []


def _check_outputs(model) -> list[Finding]:
    findings = []
    for output in _outputs(model):
        dtype = keras.backend.standardize_dtype(output.dtype)
        if keras.backend.is_float_dtype(dtype) and dtype != "float32":
            layer = compat.producing_layer(output)
            findings.append(
                Finding(
                    layer=layer.name if layer else model.name,
                    problem=(
                        f"output is {dtype}, not float32: losses and metrics "
                        "get a half-precision value"
                    ),
                    fix=(
                        "make the last layer keras_mgpu.layers.FP32OutputHead, "
                        "or give it dtype='float32'"
                    ),
                )
            )
    return findings


def _activation_name(layer) -> str | None:
    if isinstance(layer, keras.layers.Softmax):
        return "softmax"
    activation = getattr(layer, "activation", None)
    if activation is None:
        return None
    return getattr(activation, "__name__", None)


def _check_activations(layers) -> list[Finding]:
    findings = []
    for layer in layers:
        if isinstance(layer, FP32OutputHead):
            continue
        name = _activation_name(layer)
        dtype = getattr(layer, "compute_dtype", None)
        if name in SENSITIVE_ACTIVATIONS and dtype in HALF_DTYPES:
            findings.append(
                Finding(
                    layer=layer.name,
                    problem=(
                        f"{name} computed in {dtype}: it saturates or "
                        "overflows in half precision"
                    ),
                    fix=(
                        "compute it in float32: FP32OutputHead for a final "
                        "layer, or a separate keras.layers.Activation("
                        f"'{name}', dtype='float32')"
                    ),
                )
            )
    return findings


def _loss_entries(loss) -> list:
    if isinstance(loss, dict):
        return list(loss.values())
    if isinstance(loss, (list, tuple)):
        return list(loss)
    return [loss]


def _crossentropy_kind(loss) -> tuple[str | None, bool]:
    """(activation whose logits the loss wants, whether from_logits is set)."""
    if isinstance(loss, str):
        return _CROSSENTROPY_LOSSES.get(loss), False
    if isinstance(loss, keras.losses.Loss) and hasattr(loss, "fn"):
        # Keras's loss classes wrap the function of the same name.
        name = getattr(loss.fn, "__name__", "")
        from_logits = bool(loss.get_config().get("from_logits", False))
        return _CROSSENTROPY_LOSSES.get(name), from_logits
    name = getattr(loss, "__name__", "")
    return _CROSSENTROPY_LOSSES.get(name), False


def _check_loss(model, layers) -> list[Finding]:
    loss = getattr(model, "loss", None)
    if loss is None:
        return []
    outputs = _outputs(model)
    findings = []
    for output, entry in zip(outputs, _loss_entries(loss)):
        wants, from_logits = _crossentropy_kind(entry)
        layer = compat.producing_layer(output)
        if wants is None or from_logits or layer is None:
            continue
        activation = _activation_name(layer)
        if activation not in ("softmax", "sigmoid"):
            continue
        finding = _clipped_probabilities(layer, activation, layers)
        if finding is not None:
            findings.append(finding)
    return findings


def _clipped_probabilities(layer, activation, layers) -> Finding | None:
    """The finding for a cross-entropy (`from_logits=False`) fed by
    `layer`'s `activation` output, if that loss clips probabilities where
    the logits were available; else None."""
    fix = ("use keras_mgpu.layers.FP32OutputHead(units, "
           f"activation='{activation}'), or a linear last layer with "
           "from_logits=True")
    if isinstance(layer, FP32OutputHead):
        problem = compat.attached_logits_problem()
        if problem is None:
            return None
        return Finding(
            layer=layer.name,
            problem=(
                "loss gets the head's probabilities, not its float32 "
                f"logits: {problem}, so the cross-entropy clips "
                "probabilities"
            ),
            fix=("give the head activation=None and the loss "
                 "from_logits=True, or install a Keras keras-mgpu was "
                 "tested with"),
        )
    dtype = getattr(layer, "compute_dtype", None)
    if dtype in HALF_DTYPES:
        return Finding(
            layer=layer.name,
            problem=(
                f"loss gets {dtype} probabilities where logits were "
                "available: the cast to float32 hides the logits, so the "
                "cross-entropy clips probabilities"
            ),
            fix=fix,
        )
    # A float32 softmax/sigmoid after half-precision layers: on a backend
    # whose losses do not recover Keras's own activations' logits (JAX),
    # its loss clips float32 probabilities where the head's would not.
    mixed = any(getattr(other, "compute_dtype", None) in HALF_DTYPES
                for other in layers)
    if mixed and not compat.activation_logits_recovered():
        return Finding(
            layer=layer.name,
            problem=(
                "loss gets float32 probabilities where logits were "
                f"available: on Keras's {keras.backend.backend()} backend "
                f"the cross-entropy does not recover a {activation} "
                "layer's logits, so it clips probabilities"
            ),
            fix=fix,
        )
    return None


def _check_optimizer(model, layers) -> list[Finding]:
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not getattr(model, "compiled", False):
        return []
    uses_float16 = any(
        getattr(layer, "compute_dtype", None) == "float16" for layer in layers
    )
    if not uses_float16 or isinstance(
        optimizer, keras.optimizers.LossScaleOptimizer
    ):
        return []
    return [
        Finding(
            layer=model.name,
            problem=(
                f"layers compute in float16 but the optimizer "
                f"({type(optimizer).__name__}) is not a LossScaleOptimizer: "
                "small gradients flush to zero"
            ),
            fix=(
                "set the mixed_float16 global policy before building and "
                "compiling (compile then wraps the optimizer), or wrap it in "
                "keras.optimizers.LossScaleOptimizer"
            ),
        )
    ]


def _check_custom_variables(layers) -> list[Finding]:
    findings = []
    for layer in layers:
        # Keras's own layers (BatchNormalization, LayerNormalization...)
        # keep float32 statistics on purpose and cast them themselves.
        if type(layer).__module__.startswith("keras."):
            continue
        dtype = getattr(layer, "compute_dtype", None)
        if dtype not in HALF_DTYPES:
            continue
        stuck = [
            v.path
            for v in compat.own_variables(layer)
            if keras.backend.standardize_dtype(v.dtype) == "float32"
            and not (layer.autocast and compat.variable_autocasts(v))
        ]
        if stuck:
            findings.append(
                Finding(
                    layer=layer.name,
                    problem=(
                        f"computes in {dtype} but reads float32 variables "
                        f"without autocast ({', '.join(stuck)}): its call "
                        "mixes dtypes or silently runs in float32"
                    ),
                    fix=(
                        "let the layer autocast its variables (autocast=True, "
                        "and no autocast=False in add_weight), or give the "
                        "whole layer dtype='float32'"
                    ),
                )
            )
    return findings
