"""ByteDance Monolith's optimizer, initializer and compressor names, on embengine.

Each optimizer factory takes Monolith's arguments and defaults (``None`` means the default of
Monolith's optimizer.proto) and returns the embengine optimizer with Monolith's semantics:

- weight decay is added to the gradient (``weight_decay_mode="l2"``: ``g += f * w``);
- Adagrad has no epsilon; Adam and AMSGrad correct bias per id (``bias_correction="per_row"``,
  each id's own update count) with epsilon outside the square root;
- Momentum keeps the learning rate inside the velocity; RMSProp is ``n = rho n + (1-rho) g^2,
  w -= lr g / (sqrt(n) + 1)`` with Monolith's ``momentum`` as rho and its static learning rate;
  RMSPropV2 drops the ``1-rho`` (``n = rho n + g^2``) and is RMSProp on ``(1-rho) n``;
- ``warmup_steps = W > 0`` ramps the learning rate linearly from 0: ``lr * min(step, W) / W``
  (what Monolith's Python layer does when no learning-rate function is given);
- BatchSoftmax keeps, per id, the estimated number of steps between two sightings.

Where Monolith's C++ has a known defect we implement the intended math:

- FTRL multiplies l1 by ``std::signbit(z)`` (0 or 1) instead of ``sign(z)``, which skips the l1
  shrinkage for positive z and applies it with the wrong sign for negative z; embengine uses
  ``sign(z)``. Monolith's ``l2_regularization`` enters its denominator once (``sqrt(n) + beta +
  l2 * lr``), i.e. TF's l2 with a factor 2: it maps to ``l2_regularization_strength = l2 / 2``.
- Adam's restore writes both beta powers into the same slot; embengine stores each id's update
  count ("steps") and derives the powers, so a restored table continues exactly.
- Adagrad's AVX path steps with the raw gradient when weight decay is on; embengine follows
  Monolith's scalar path (the decayed gradient feeds both the accumulator and the step).
- ``hessian_compression_times`` is accepted but ignored by Monolith's C++; embengine implements
  it by default (one accumulator per k dims, fed the mean of g^2 over the group), and
  ``AdagradOptimizer(..., hessian_compression="monolith")`` ignores it as Monolith does.

Not ported, of what Monolith's entry.py and optimizer.proto offer:

- ``MovingAverageOptimizer`` (``w = m w + (1 - m) g``: the "gradient" is the value averaged
  in) and ``AdaGradWithGroupLassoOptimizer`` (one accumulator per row fed ``max_i g_i^2``,
  then a group-lasso step that zeroes the row): each needs its own row math.
- ``FTRLWithGroupSparsityOptimizer`` and ``DynamicWdAdagradOptimizer``: Monolith's C++ throws
  "optimizer is not implemented yet" for both.
- ``DcOptimizer`` (delay compensation, ``g + lambda g^2 (w - w_latest)``): not in entry.py,
  and it corrects asynchronous staleness, which the engine's synchronous updates lack.
- ``StochasticRoundingFloat16OptimizerWrapper``: the nearest equivalent is
  ``TableConfig(weights_dtype="float16")`` (updates stored with stochastic rounding).
- ``OneBitCompressor`` (HashNet): no 1-bit export format.

Compressors (``embengine.Compressor`` subclasses) attach to a table as in Monolith,
``TableConfig(..., compressor=Fp16Compressor())``, and say how ``embengine export`` stores it
(the export's per-table argument still wins, its default applies to tables without one);
FixedR8's ``quantization_config()`` also simulates its 8-bit values in training lookups
(gradients pass straight through).

Monolith's per-slot ``occurrence_threshold`` and ``expire_time`` (days of data time) become a
keyed table's rules with ``dynamic_vocabulary`` (``TableConfig(None, dim, dynamic=...)``), with
Monolith's zero lookup before a key's first update (``insert_on="apply"``). Where we differ:

- Admission counts are exact (earlier steps' occurrences, ``DynamicVocabulary``); Monolith
  counts in a 4-bit sliding sketch whose counts cap at 15 and collide between keys, so there
  a threshold above 15 admits no key at all (a key passes when its earlier count, at most
  15, reaches the threshold; runtime/hash_filter/hash_filter.h, ``ShouldBeFiltered``).
- We count every occurrence. Monolith's distributed tables deduplicate a batch's ids before
  the update (distributed_ps.py, ``tf.unique`` then ``enable_dedup=False``), so there a key
  counts once per step it appears in: a key seen T times in each step is admitted at step 1
  here, at step T there. (A single local Monolith table counts every occurrence, one at a
  time, and admits a key within the step its count reaches T, from that occurrence on.)
- A row expires when the data time is *more* than ``expire_time`` days past its last touch;
  Monolith evicts at ``>=``. The data time is the newest timestamp a table has trained on
  (Monolith's ``max_update_time``); a row's time is the newest timestamp that touched it,
  where Monolith sets it to each update's time, so an out-of-order (older) batch makes a
  Monolith row older, never ours. Expiry runs before every training lookup, where Monolith
  evicts in a periodic pass (``feature_evict_every_n_hours``, when enabled) and leaves stale
  rows out of its checkpoints, so its stale rows serve until then.
- Timestamps come per training call (``lookup(..., timestamp=)``, ``apply_gradients(...,
  timestamp=)``: Monolith's ``req_time``), in seconds; without them, ``steps_per_day`` maps
  days to steps. The default ``expire_time`` (Monolith's 36500 days) sets no expiry: no
  timestamps needed.
- The rules are a table's: Monolith sets them per slot (a feature's FIDs carry their slot in
  the high bits) within one hash table; slots with different rules become tables of their
  own (one ``TableConfig`` each), which also keeps their rows apart.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass

from . import initializers as _init
from . import optimizers as _opt
from .config import MAX_EXPIRE_STEPS, Compressor, DynamicVocabulary, QuantizationConfig
from .learning_rates import Warmup
from .optimizers import _checks

__all__ = [
    "Warmup",
    "SgdOptimizer",
    "AdagradOptimizer",
    "AdamOptimizer",
    "AmsgradOptimizer",
    "MomentumOptimizer",
    "RmspropOptimizer",
    "RmspropV2Optimizer",
    "AdadeltaOptimizer",
    "FtrlOptimizer",
    "BatchSoftmaxOptimizer",
    "ZerosInitializer",
    "ConstantsInitializer",
    "RandomUniformInitializer",
    "BatchSoftmaxInitializer",
    "Fp16Compressor",
    "Fp32Compressor",
    "FixedR8Compressor",
    "DEFAULT_EXPIRE_TIME",
    "dynamic_vocabulary",
]

# Monolith's default expire_time: 100 years, in days.
DEFAULT_EXPIRE_TIME = 36500
SECONDS_PER_DAY = 86400
UINT32_MAX = 2**32 - 1


def dynamic_vocabulary(
    occurrence_threshold: int = 0,
    expire_time: int | None = None,
    *,
    steps_per_day: int | None = None,
    max_rows: int | None = None,
    eviction: str = "lru",
) -> DynamicVocabulary:
    """A keyed table's rules from a Monolith slot's ``occurrence_threshold`` and
    ``expire_time`` (days of data time), inserting on the update as Monolith does (a new key
    looks up as zeros until its first update).

    ``expire_time`` days become ``expire_seconds = expire_time * 86400``, counted in data
    time: every training lookup then carries ``timestamp=`` (seconds). Without timestamps,
    steps count: ``steps_per_day=k`` maps it to ``expire_steps = expire_time * k``. None
    (the default) is Monolith's default of ``DEFAULT_EXPIRE_TIME`` days, 100 years: no row
    ever expires, so no expiry rule is set and training lookups need no ``timestamp``.
    ``max_rows`` and ``eviction`` are embengine's (Monolith has no row bound)."""
    _checks.integer("dynamic_vocabulary", "occurrence_threshold", occurrence_threshold, minimum=0)
    if expire_time is not None:
        _checks.integer("dynamic_vocabulary", "expire_time", expire_time, minimum=1)
    if expire_time is not None and expire_time > UINT32_MAX:  # past int64 once in seconds
        raise ValueError(
            f"dynamic_vocabulary: expire_time must be at most {UINT32_MAX} days (Monolith's "
            f"uint32 field), got {expire_time!r}"
        )
    if steps_per_day is not None:
        _checks.integer("dynamic_vocabulary", "steps_per_day", steps_per_day, minimum=1)
    if expire_time is None:  # Monolith's 100 years: never
        timing = {}
    elif steps_per_day is not None:
        steps = int(expire_time) * int(steps_per_day)
        if steps > MAX_EXPIRE_STEPS:
            raise ValueError(
                f"dynamic_vocabulary: expire_time * steps_per_day = {expire_time} * "
                f"{steps_per_day} = {steps} steps, more than expire_steps allows (at most "
                f"{MAX_EXPIRE_STEPS}, 3 * 2^30 - 1); give a smaller steps_per_day"
            )
        timing = dict(expire_steps=steps)
    else:
        timing = dict(expire_seconds=int(expire_time) * SECONDS_PER_DAY)
    return DynamicVocabulary(
        occurrence_threshold=int(occurrence_threshold),
        max_rows=max_rows,
        eviction=eviction,
        insert_on="apply",
        **timing,
    )


def _proto_defaults(factory):
    """``factory`` with every argument given as None taken at its default (Monolith's
    optimizer.proto default), as Monolith's Python layer skips None fields; arguments whose
    default is None keep handling None themselves."""
    signature = inspect.signature(factory)

    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        for name, value in list(bound.arguments.items()):
            default = signature.parameters[name].default
            if value is None and default is not inspect.Parameter.empty:
                bound.arguments[name] = default
        return factory(*bound.args, **bound.kwargs)

    return wrapper


def _lr(value, default: float, warmup_steps: int = 0, owner: str = ""):
    """The learning rate (``default`` for None), a ``Warmup`` of it for ``warmup_steps > 0``;
    ``owner`` (the factory) names a bad warmup_steps, or a rate the warm-up cannot ramp (the
    optimizer checks a rate, but not the one inside a Warmup: ``float()`` read "0.5" and True,
    and -1 failed at the second step)."""
    lr = default if value is None else value
    if not _checks.is_integer(warmup_steps) or warmup_steps < 0:
        raise ValueError(f"{owner}: warmup_steps must be an int >= 0, got {warmup_steps!r}")
    if warmup_steps and not callable(lr):
        if isinstance(lr, _opt.DynamicLearningRate):
            raise ValueError(
                f"{owner}: warmup_steps={warmup_steps!r} ramps a constant learning rate; "
                f"{lr!r} has its values given per step (learning_rates=): ramp them there, "
                "and leave warmup_steps=0"
            )
        _checks.non_negative(owner, "learning_rate", lr)
        return Warmup(float(lr), int(warmup_steps))
    return lr


def _betas(owner: str, beta1, beta2) -> None:
    """Adam's and AMSGrad's betas, checked under Monolith's names (the optimizers would name
    their own, beta_1 and beta_2, which the caller never gave)."""
    _checks.unit_interval(owner, "beta1", beta1)
    _checks.unit_interval(owner, "beta2", beta2)


def _decay(weight_decay_factor: float) -> dict:
    if weight_decay_factor is None or weight_decay_factor == 0:
        return {}
    return dict(weight_decay_factor=weight_decay_factor, weight_decay_mode="l2")


@_proto_defaults
def SgdOptimizer(learning_rate=None) -> _opt.SGD:  # noqa: N802 (Monolith's names)
    """``w -= lr * g``; learning rate default 0.01."""
    return _opt.SGD(_lr(learning_rate, 0.01))


HESSIAN_COMPRESSION = ("embengine", "monolith")


@_proto_defaults
def AdagradOptimizer(
    learning_rate=None,
    initial_accumulator_value=None,  # noqa: N802
    hessian_compression_times=1,
    warmup_steps=0,
    weight_decay_factor=0.0,
    hessian_compression="embengine",
) -> _opt.Adagrad:
    """Adagrad without epsilon, decay added to the gradient; defaults lr 0.001, accumulator 0.1.

    ``hessian_compression_times = k``: Monolith's proto documents it as one accumulator per k
    dimensions, but its C++ never reads it (every dimension keeps its own accumulator).
    ``hessian_compression="embengine"`` (default) implements the documented reading: the
    accumulator of a group of k dims is fed the mean of g^2 over the group,
    ``n += mean_group(g^2); w -= lr g / sqrt(n)`` (k = dim: row-wise Adagrad).
    ``hessian_compression="monolith"`` does what Monolith's code does: k is accepted and
    ignored, so results match a Monolith job bit for bit in its semantics (k = 1)."""
    _checks.choice(
        "AdagradOptimizer", "hessian_compression", hessian_compression, HESSIAN_COMPRESSION
    )
    if hessian_compression == "monolith":
        # Checked as Adagrad checks it, then dropped: Monolith's C++ accepts it, never reads it.
        _checks.integer(
            "AdagradOptimizer", "hessian_compression_times", hessian_compression_times, minimum=1
        )
        hessian_compression_times = 1
    return _opt.Adagrad(
        _lr(learning_rate, 0.001, warmup_steps, "AdagradOptimizer"),
        0.1 if initial_accumulator_value is None else initial_accumulator_value,
        hessian_compression_times,
        **_decay(weight_decay_factor),
    )


@_proto_defaults
def AdamOptimizer(
    learning_rate=None,
    beta1=0.9,
    beta2=0.99,
    use_beta1_warmup=False,  # noqa: N802
    weight_decay_factor=0.0,
    use_nesterov=False,
    epsilon=0.01,
    warmup_steps=0,
) -> _opt.Adam:
    """Adam with per-id bias correction and epsilon outside the sqrt (lr default 0.01).
    ``use_beta1_warmup`` is accepted (a bool) and, as in Monolith, has no effect."""
    _checks.flag("AdamOptimizer", "use_beta1_warmup", use_beta1_warmup)
    _betas("AdamOptimizer", beta1, beta2)
    return _opt.Adam(
        _lr(learning_rate, 0.01, warmup_steps, "AdamOptimizer"),
        beta1,
        beta2,
        epsilon,
        sum_inside_sqrt=False,
        use_nesterov=use_nesterov,
        bias_correction="per_row",
        **_decay(weight_decay_factor),
    )


@_proto_defaults
def AmsgradOptimizer(
    learning_rate=None,
    beta1=0.9,
    beta2=0.99,
    weight_decay_factor=0.0,  # noqa: N802
    use_nesterov=False,
    epsilon=0.01,
    warmup_steps=0,
) -> _opt.AMSGrad:
    """AMSGrad: Adam (as above) dividing by the running maximum of v."""
    _betas("AmsgradOptimizer", beta1, beta2)
    return _opt.AMSGrad(
        _lr(learning_rate, 0.01, warmup_steps, "AmsgradOptimizer"),
        beta1,
        beta2,
        epsilon,
        sum_inside_sqrt=False,
        use_nesterov=use_nesterov,
        bias_correction="per_row",
        **_decay(weight_decay_factor),
    )


@_proto_defaults
def MomentumOptimizer(
    learning_rate=None,
    weight_decay_factor=0.0,
    use_nesterov=False,  # noqa: N802
    momentum=0.9,
    warmup_steps=0,
) -> _opt.Momentum:
    """Momentum with the learning rate inside the velocity (lr default 0.01)."""
    return _opt.Momentum(
        _lr(learning_rate, 0.01, warmup_steps, "MomentumOptimizer"),
        momentum,
        use_nesterov,
        velocity_includes_learning_rate=True,
        **_decay(weight_decay_factor),
    )


@_proto_defaults
def RmspropOptimizer(
    learning_rate=None,
    weight_decay_factor=0.0,  # noqa: N802
    momentum=0.9,
) -> _opt.RMSProp:
    """Monolith's RMSProp: ``n = m n + (1 - m) g^2; w -= lr g / (sqrt(n) + 1)`` with
    ``m = momentum``; its learning rate is static (lr default 0.01): a number, never a
    learning-rate function (Monolith's C++ reads the configured rate, not the step's)."""
    lr = _lr(learning_rate, 0.01)
    if not _checks.is_number(lr):
        raise ValueError(
            f"RmspropOptimizer: learning_rate must be a number, got {lr!r}: Monolith's RMSProp "
            "steps with its static learning rate and never reads a learning-rate function; "
            "pass the rate itself"
        )
    _checks.unit_interval("RmspropOptimizer", "momentum", momentum)
    return _opt.RMSProp(
        lr,
        rho=momentum,
        momentum=0.0,
        epsilon=1.0,
        sum_inside_sqrt=False,
        initial_ms_value=0.0,
        **_decay(weight_decay_factor),
    )


@_proto_defaults
def RmspropV2Optimizer(  # noqa: N802
    learning_rate: float | None = None,
    weight_decay_factor: float = 0.0,
    momentum: float = 0.9,
) -> _opt.RMSProp:
    """Monolith's RMSPropV2: its accumulator sums the squares without the ``1 - m`` factor::

        g' = g + f w;   n <- m n + g'^2;   w <- w - lr g' / (sqrt(n) + 1)

    with ``m = momentum`` (default 0.9), ``f = weight_decay_factor``, lr default 0.01, ``n``
    starting at 0 (Monolith's rmsprop_optimizer.cc, ``RmspropV2Optimizer::OptimizeNormal``).
    It is embengine's RMSProp on the rescaled accumulator ``ms = (1 - m) n``, which follows
    RMSProp's ``ms <- m ms + (1 - m) g'^2``; then ``sqrt(n) = sqrt(ms) / c`` with
    ``c = sqrt(1 - m)``, and the step is ``(c lr) g' / (sqrt(ms) + c)``: RMSProp with
    ``rho = m``, learning rate ``c lr`` and epsilon ``c`` outside the square root. The same
    update, but the stored slot "ms" is ``(1 - m)`` times Monolith's ``n``.

    ``momentum`` must be in [0, 1): at 1 the rescaling has ``c = 0`` (Monolith's update is then
    Adagrad's sum with 1 added outside its root). The learning rate is a number (its scaled
    value is what the optimizer holds): Monolith's ``learning_rate`` is a float of the proto."""
    lr = _lr(learning_rate, 0.01)
    if callable(lr) or isinstance(lr, _opt.DynamicLearningRate):
        raise ValueError(
            f"RmspropV2Optimizer: learning_rate must be a number, got {lr!r}: the port scales "
            "it by sqrt(1 - momentum), which a learning-rate function would not be"
        )
    _checks.non_negative("RmspropV2Optimizer", "learning_rate", lr)
    _checks.unit_interval("RmspropV2Optimizer", "momentum", momentum)
    c = math.sqrt(1.0 - float(momentum))
    return _opt.RMSProp(
        float(lr) * c,
        rho=momentum,
        momentum=0.0,
        epsilon=c,
        sum_inside_sqrt=False,
        initial_ms_value=0.0,
        **_decay(weight_decay_factor),
    )


@_proto_defaults
def AdadeltaOptimizer(
    learning_rate=None,
    weight_decay_factor=0.0,
    averaging_ratio=0.9,  # noqa: N802
    epsilon=0.01,
    warmup_steps=0,
) -> _opt.Adadelta:
    """Adadelta with rho = averaging_ratio (lr default 0.01)."""
    _checks.unit_interval("AdadeltaOptimizer", "averaging_ratio", averaging_ratio)
    return _opt.Adadelta(
        _lr(learning_rate, 0.01, warmup_steps, "AdadeltaOptimizer"),
        averaging_ratio,
        epsilon,
        **_decay(weight_decay_factor),
    )


@_proto_defaults
def FtrlOptimizer(
    learning_rate=None,
    initial_accumulator_value=None,
    beta=None,  # noqa: N802
    warmup_steps=0,
    l1_regularization=None,
    l2_regularization=None,
) -> _opt.FTRL:
    """FTRL-proximal ``w = lr (sign(z) l1 - z) / (sqrt(n) + beta + l2 lr)`` (lr default 0.01;
    see the module docstring for the sign fix and the l2 mapping). No ``warmup_steps``: the
    warm-up's rate is 0 at step 0, and FTRL divides by it (Monolith's C++ would divide by
    zero). Zero accumulators (``initial_accumulator_value=0``) are allowed, as in Monolith."""
    _checks.integer("FtrlOptimizer", "warmup_steps", warmup_steps, minimum=0)
    if warmup_steps:
        raise ValueError(
            f"FtrlOptimizer: warmup_steps={warmup_steps!r} makes the learning rate 0 at step 0 "
            "(lr * min(step, W) / W), and FTRL divides by it (Monolith's C++ divides by zero "
            "there); leave warmup_steps=0, or pass a learning-rate function > 0 from step 0"
        )
    l1 = 0.0 if l1_regularization is None else l1_regularization
    l2 = 0.0 if l2_regularization is None else l2_regularization
    # Checked under Monolith's names here: FTRL would name its own, and l2 halved, and advise
    # its own switches (allow_zero_accumulator, multiply_linear_by_learning_rate), which
    # FtrlOptimizer has not.
    _checks.non_negative("FtrlOptimizer", "l1_regularization", l1)
    _checks.non_negative("FtrlOptimizer", "l2_regularization", l2)
    a0 = 0.1 if initial_accumulator_value is None else initial_accumulator_value
    _checks.non_negative("FtrlOptimizer", "initial_accumulator_value", a0)
    lr = 0.01 if learning_rate is None else learning_rate
    if _checks.is_number(lr) and not (math.isfinite(lr) and lr > 0):
        raise ValueError(
            "FtrlOptimizer: learning_rate must be a finite number > 0 (FTRL divides by it), "
            f"got {lr!r}"
        )
    return _opt.FTRL(
        _lr(learning_rate, 0.01, warmup_steps, "FtrlOptimizer"),
        l1_regularization_strength=l1,
        l2_regularization_strength=l2 / 2.0,
        beta=0.0 if beta is None else beta,
        initial_accumulator_value=a0,
        # Monolith's FTRL takes a zero start (the default of its GroupFtrl proto, whose C++
        # the open-source Monolith leaves unimplemented); only then is it set,
        # so that every other configuration stays the spec it was.
        allow_zero_accumulator=bool(_checks.is_number(a0) and a0 == 0),
    )


@_proto_defaults
def BatchSoftmaxOptimizer(learning_rate=None) -> _opt.BatchSoftmax:  # noqa: N802
    """Streaming estimate of the steps between sightings of an id (alpha default 0.1)."""
    return _opt.BatchSoftmax(_lr(learning_rate, 0.1))


def ZerosInitializer() -> _init.Zeros:  # noqa: N802
    return _init.Zeros()


def _finite(owner: str, name: str, value) -> None:
    if not (_checks.is_number(value) and math.isfinite(value)):
        raise ValueError(f"{owner}: {name} must be a finite number, got {value!r}")


def ConstantsInitializer(constant: float) -> _init.Constant:  # noqa: N802
    _finite("ConstantsInitializer", "constant", constant)
    return _init.Constant(constant)


def RandomUniformInitializer(minval=None, maxval=None) -> _init.RandomUniform:  # noqa: N802
    """Uniform in [minval, maxval], defaults -0.05 and 0.05."""
    minval = -0.05 if minval is None else minval
    maxval = 0.05 if maxval is None else maxval
    _finite("RandomUniformInitializer", "minval", minval)
    _finite("RandomUniformInitializer", "maxval", maxval)
    return _init.RandomUniform(minval, maxval)


def BatchSoftmaxInitializer(init_step_interval: float) -> _init.Constant:  # noqa: N802
    """The starting estimate of steps between sightings (>= 1)."""
    if not _checks.is_number(init_step_interval):
        raise ValueError(
            f"BatchSoftmaxInitializer: init_step_interval must be a number >= 1, got "
            f"{init_step_interval!r}"
        )
    if init_step_interval < 1:
        raise ValueError(f"init_step_interval should be >= 1, while got {init_step_interval}")
    return _init.Constant(float(init_step_interval))


# The compressors take Monolith's arguments (init=False): none, and FixedR8's fixed_range
# first. The dataclass's own __init__ would take Compressor's field order, (compression,
# fixed_range): FixedR8Compressor(0.5) was read as compression=0.5 and refused.


@dataclass(frozen=True, init=False)
class Fp32Compressor(Compressor):
    """Serve the table as float32 (no compression)."""

    compression: str = "fp32"

    def __init__(self):
        object.__setattr__(self, "compression", "fp32")
        object.__setattr__(self, "fixed_range", 1.0)
        self.__post_init__()


@dataclass(frozen=True, init=False)
class Fp16Compressor(Compressor):
    """Serve the table as float16 (round to nearest even)."""

    compression: str = "fp16"

    def __init__(self):
        object.__setattr__(self, "compression", "fp16")
        object.__setattr__(self, "fixed_range", 1.0)
        self.__post_init__()


@dataclass(frozen=True, init=False)
class FixedR8Compressor(Compressor):
    """8-bit fixed point in ``[-r, 127 r / 128]``, step ``r / 128`` (``r = fixed_range``).

    Attach it to a table as Monolith does (``TableConfig(..., compressor=c)``): ``embengine
    export`` then stores the table's rows as int8 codes of range r. Monolith also quantizes the
    training lookups to those values (gradients unchanged); here that is the table's
    ``quantization_config=c.quantization_config()``, given beside it. (Monolith rounds halves
    away from zero; TF's simulated quantization, used here, rounds them up.)
    """

    fixed_range: float = 1.0
    compression: str = "fixed_r8"

    def __init__(self, fixed_range: float | None = 1.0):
        object.__setattr__(self, "compression", "fixed_r8")
        # None: Monolith's default, as its None fields take
        object.__setattr__(self, "fixed_range", 1.0 if fixed_range is None else fixed_range)
        self.__post_init__()

    def quantization_config(self) -> QuantizationConfig:
        r = float(self.fixed_range)
        return QuantizationConfig(num_buckets=256, lower=-r, upper=r * 127.0 / 128.0)
