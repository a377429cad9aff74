"""embengine.torch.EmbeddingLayer against a hand-written torch model, and its autograd contract."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import embengine as ee
from embengine import optimizers as opt
from embengine.torch import EmbeddingLayer, KeyedJagged

VOCAB, DIM = 12, 3


def _engine(optimizer, combiner="mean", backend="numba"):
    t = ee.TableConfig(
        VOCAB,
        DIM,
        combiner=combiner,
        name="t",
        initializer=ee.initializers.RandomUniform(-0.5, 0.5),
    )
    return ee.EmbeddingEngine(
        {"a": ee.FeatureConfig(t), "b": ee.FeatureConfig(t)}, optimizer=optimizer, backend=backend
    )


class TorchReference(torch.nn.Module):
    """The same model with an nn.Embedding table and the optimizer math written in torch."""

    def __init__(self, init: np.ndarray, kind: str, lr: float, combiner: str):
        super().__init__()
        self.table = torch.nn.Embedding(VOCAB, DIM)
        with torch.no_grad():
            self.table.weight.copy_(torch.from_numpy(init))
        self.kind, self.lr, self.combiner = kind, lr, combiner
        self.acc = torch.full((VOCAB, DIM), 0.1, dtype=torch.float64)
        self.m = torch.zeros((VOCAB, DIM), dtype=torch.float64)
        self.v = torch.zeros((VOCAB, DIM), dtype=torch.float64)

    def bags(self, lists):
        ids = torch.tensor([i for s in lists for i in s], dtype=torch.long)
        bag = torch.tensor([b for b, s in enumerate(lists) for _ in s], dtype=torch.long)
        counts = torch.tensor([len(s) for s in lists], dtype=torch.float32)
        rows = self.table(ids)
        out = torch.zeros(len(lists), DIM).index_add(0, bag, rows)
        if self.combiner == "mean":
            out = out / counts.clamp(min=1)[:, None]
        return out, ids

    @torch.no_grad()
    def update(self, touched):
        g = self.table.weight.grad.double()
        w = self.table.weight.data.double()
        rows = torch.unique(touched)
        if self.kind == "sgd":
            w[rows] -= self.lr * g[rows]
        elif self.kind == "adagrad":
            self.acc[rows] += g[rows] ** 2
            w[rows] -= self.lr * g[rows] / self.acc[rows].sqrt()
        else:  # lazy Adam, TPU form
            self.m[rows] = 0.9 * self.m[rows] + 0.1 * g[rows]
            self.v[rows] = 0.999 * self.v[rows] + 0.001 * g[rows] ** 2
            w[rows] -= self.lr * self.m[rows] / (self.v[rows] + 1e-14).sqrt()
        self.table.weight.data.copy_(w.float())
        self.table.weight.grad = None


OPTIMIZERS = {"sgd": opt.SGD(0.3), "adagrad": opt.Adagrad(0.3), "adam": opt.Adam(0.05)}


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("combiner", ["mean", "sum"])
def test_matches_hand_written_torch_model(kind, combiner):
    engine = _engine(OPTIMIZERS[kind], combiner)
    layer = EmbeddingLayer(engine)
    ref = TorchReference(
        engine.embedding_tables["t"].copy(), kind, OPTIMIZERS[kind].learning_rate, combiner
    )
    dense = torch.nn.Linear(DIM, 1)
    dense_ref = torch.nn.Linear(DIM, 1)
    dense_ref.load_state_dict(dense.state_dict())
    sgd, sgd_ref = (
        torch.optim.SGD(dense.parameters(), 0.1),
        torch.optim.SGD(dense_ref.parameters(), 0.1),
    )
    rng = np.random.default_rng(0)
    for _ in range(4):
        # duplicates inside a bag, across bags and across the two features sharing the table
        a = [[1, 1, 4], [4], [], [7, 2]]
        b = [[int(x) for x in rng.integers(0, 6, rng.integers(0, 4))] for _ in range(4)]
        b[0] = [1, 4]
        y = torch.from_numpy(rng.normal(size=(4, 1)).astype(np.float32))

        out = layer({"a": a, "b": b})
        loss = ((dense(out["a"] * out["b"] + out["a"]) - y) ** 2).mean()
        sgd.zero_grad()
        loss.backward()
        sgd.step()

        ra, ids_a = ref.bags(a)
        rb, ids_b = ref.bags(b)
        loss_ref = ((dense_ref(ra * rb + ra) - y) ** 2).mean()
        sgd_ref.zero_grad()
        loss_ref.backward()
        sgd_ref.step()
        ref.update(torch.cat([ids_a, ids_b]))

        np.testing.assert_allclose(
            engine.embedding_tables["t"], ref.table.weight.detach().numpy(), rtol=1e-5, atol=1e-6
        )
        for p, q in zip(dense.parameters(), dense_ref.parameters(), strict=True):
            np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert engine.step == 4


def test_one_update_per_step_whatever_the_branches():
    engine = _engine(opt.SGD(0.5), "sum")
    layer = EmbeddingLayer(engine)
    before = engine.embedding_tables["t"].copy()
    out = layer({"a": [[3]], "b": [[5]]})
    assert all(t.requires_grad and t.dtype == torch.float32 for t in out.values())
    loss = out["a"].sum() + 2 * out["a"].sum() + out["a"].pow(2).sum() * 0  # three branches
    loss.backward(retain_graph=True)
    loss.backward()  # again on the same graph: no second update
    after = engine.embedding_tables["t"]
    np.testing.assert_allclose(after[3], before[3] - 0.5 * 3, rtol=1e-6)
    np.testing.assert_array_equal(after[5], before[5])  # "b" got no gradient: zeros
    assert engine.step == 1


def test_eval_and_no_grad_do_not_update():
    engine = _engine(opt.SGD(0.5), "sum")
    layer = EmbeddingLayer(engine)
    before = engine.embedding_tables["t"].copy()
    layer.eval()
    out = layer({"a": [[3]], "b": [[5]]})
    assert not out["a"].requires_grad
    layer.train()
    with torch.no_grad():
        out = layer({"a": [[3]], "b": [[5]]})
    assert not out["a"].requires_grad
    np.testing.assert_array_equal(engine.embedding_tables["t"], before)
    assert engine.step == 0
    # A lookup-only batch evaluates, but training on it is refused.
    batch = layer.preprocess({"a": [[3]], "b": [[5]]}, training=False)
    layer.eval()
    np.testing.assert_array_equal(layer(batch)["a"].numpy(), before[3:4])
    layer.train()
    with pytest.raises(ValueError, match="training=False"):
        layer(batch)


def test_tables_are_not_parameters_and_inputs_can_be_prepared():
    engine = _engine(opt.Adagrad(0.1))
    layer = EmbeddingLayer(engine)
    assert list(layer.parameters()) == []
    batch = layer.preprocess({"a": torch.tensor([1, 2]), "b": torch.tensor([[3, -1], [4, 4]])})
    out = layer(batch)
    out["a"].sum().backward()
    assert engine.step == 1


def test_keyed_jagged_inputs():
    engine = _engine(opt.SGD(0.1), "sum")
    layer = EmbeddingLayer(engine)
    kj = KeyedJagged(
        ["a", "b"],
        torch.tensor([1, 2, 3, 1]),
        lengths=torch.tensor([2, 1, 1, 0]),
        weights=torch.tensor([1.0, 2.0, 1.0, 1.0]),
    )
    out = layer(kj)
    table = torch.from_numpy(engine.embedding_tables["t"])
    torch.testing.assert_close(out["a"][0], table[1] + 2 * table[2])
    torch.testing.assert_close(out["b"][1], torch.zeros(DIM))
    kj2 = KeyedJagged(["a", "b"], np.array([5, 6]), offsets=np.array([0, 1, 1, 2, 2]))
    assert layer(kj2)["a"].shape == (2, DIM)
    with pytest.raises(ValueError, match="lengths sum to 3 but there are 2 values"):
        KeyedJagged(["a"], [1, 2], lengths=[1, 2])


class _TorchRecLike:
    """A KJT duck type (TorchRec's KeyedJaggedTensor is accepted without importing torchrec):
    nothing checked it when it was built."""

    def __init__(self, keys, values, lengths, weights=None):
        self._k, self._v, self._l, self._w = keys, values, lengths, weights

    def keys(self):
        return self._k

    def values(self):
        return self._v

    def lengths(self):
        return self._l

    def weights_or_none(self):
        return self._w


# 2 keys x 2 samples; the int64 sum of the lengths wraps around to 3, the number of values.
WRAPPING = [2**63 - 1, 2**63 - 1, 5, 0]


def test_keyed_jagged_lengths_that_wrap_are_refused_naming_key_and_sample():
    with pytest.raises(
        ValueError,
        match=r"KeyedJagged key 'a', sample 0: length "
        r"9223372036854775807 \(lengths\[0\]\) is more than "
        r"the number of values \(3\)",
    ):
        KeyedJagged(["a", "b"], [1, 2, 3], lengths=WRAPPING)
    with pytest.raises(
        ValueError,
        match=r"KeyedJagged key 'b', sample 1: length -1 "
        r"\(lengths\[3\]\) is negative",
    ):
        KeyedJagged(["a", "b"], [1, 2, 3], lengths=[1, 1, 2, -1])
    # offsets whose np.diff wraps to lengths >= 0
    with pytest.raises(
        ValueError,
        match=r"KeyedJagged key 'a', sample 1: offsets\[2\]="
        r"-9223372036854775808 is less than offsets\[1\]",
    ):
        KeyedJagged(["a", "b"], [1, 2, 3], offsets=[0, 2**63 - 1, -(2**63), -2, 3])
    with pytest.raises(TypeError, match="KeyedJagged values must be integers, got dtype float"):
        KeyedJagged(["a"], np.array([1.5, 2.0]), lengths=[1, 1])
    with pytest.raises(ValueError, match=r"KeyedJagged weights must have one entry per value"):
        KeyedJagged(["a"], [1, 2], lengths=[1, 1], weights=[1.0])


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(-1, 3), max_size=6),
    num_values=st.integers(0, 5),
)
@example(lengths=WRAPPING, num_values=3)
def test_any_int64_keyed_jagged_lengths_are_accepted_exactly_when_valid(lengths, num_values):
    from embengine.torch.keyed_jagged import to_feature_dict

    valid = len(lengths) % 2 == 0 and all(x >= 0 for x in lengths) and sum(lengths) == num_values
    values = torch.arange(num_values)
    for make in (
        lambda: KeyedJagged(["a", "b"], values, lengths=torch.tensor(lengths, dtype=torch.int64)),
        lambda: _TorchRecLike(["a", "b"], values, torch.tensor(lengths, dtype=torch.int64)),
    ):
        try:
            split = to_feature_dict(make())
        except ValueError:
            assert not valid
        else:
            assert valid
            b = len(lengths) // 2
            assert split["a"].lengths.tolist() == lengths[:b]
            assert split["b"].lengths.tolist() == lengths[b:]


def test_torchrec_like_inputs_are_checked_when_split():
    layer = EmbeddingLayer(_engine(opt.SGD(0.1), backend="reference"))
    bad = [
        (
            _TorchRecLike(["a", "b"], torch.tensor([1, 2, 3]), torch.tensor(WRAPPING)),
            ValueError,
            r"KeyedJagged key 'a', sample 0: length 9223372036854775807",
        ),
        (
            _TorchRecLike(["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1])),
            ValueError,
            r"KeyedJagged has 3 lengths for 2 keys",
        ),
        (
            _TorchRecLike(["a", "b"], torch.tensor([1.0, 2.0]), torch.tensor([1, 0, 1, 0])),
            TypeError,
            r"KeyedJagged values must be integers, got dtype float32",
        ),
        (
            _TorchRecLike(["a", "a"], torch.tensor([1, 2]), torch.tensor([1, 1])),
            ValueError,
            r"KeyedJagged keys must be unique",
        ),
        (
            _TorchRecLike(
                ["a", "b"], torch.tensor([1, 2]), torch.tensor([1, 0, 1, 0]), torch.tensor([1.0])
            ),
            ValueError,
            r"KeyedJagged weights must have one entry per value",
        ),
        (
            _TorchRecLike(["a", "b"], torch.tensor([1, 99]), torch.tensor([1, 0, 1, 0])),
            ValueError,
            r"feature 'b': id 99 at sample 0, position 0 \(ids\[0\]\) is out of range",
        ),
    ]
    for kjt, exc, message in bad:
        with pytest.raises(exc, match=message):
            layer(kjt)
        with pytest.raises(exc, match=message):
            layer.preprocess(kjt)
    good = _TorchRecLike(["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([2, 0, 1, 0]))
    out = layer(good)
    expected = layer({"a": [[1, 2], []], "b": [[3], []]})
    assert all(torch.equal(out[k], expected[k]) for k in expected)


def test_wrapping_keyed_jagged_lengths_never_reach_the_kernels():
    # Before: lengths whose sum wraps passed KeyedJagged's check; run in a subprocess because
    # a Ragged with such lengths crashed or hung the kernels.
    code = f"""
import torch
import embengine as ee
from embengine.torch import EmbeddingLayer, KeyedJagged
t = ee.TableConfig(10, 2, name="t")
eng = ee.EmbeddingEngine({{"a": ee.FeatureConfig(t), "b": ee.FeatureConfig(t)}},
                         optimizer=ee.optimizers.SGD(0.1))
kjt = KeyedJagged(["a", "b"], torch.tensor([1, 2, 3]), lengths=torch.tensor({WRAPPING}))
EmbeddingLayer(eng)(kjt)
print("no error", flush=True)
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    assert "ValueError: KeyedJagged key 'a', sample 0: length 9223372036854775807" in out.stderr


def test_missing_and_extra_features_are_named():
    layer = EmbeddingLayer(_engine(opt.SGD(0.1)))
    with pytest.raises(ValueError, match=r"missing \['b'\]; unknown \['c'\]"):
        layer({"a": [[1]], "c": [[2]]})


def test_dynamic_learning_rates_pass_through():
    t = ee.TableConfig(
        VOCAB,
        DIM,
        combiner="sum",
        name="t",
        initializer=ee.initializers.Zeros(),
        optimizer=opt.SGD(ee.DynamicLearningRate(0)),
    )
    engine = ee.EmbeddingEngine({"a": ee.FeatureConfig(t)})
    layer = EmbeddingLayer(engine)
    layer({"a": [[2]]}, learning_rates=[0.25])["a"].sum().backward()
    np.testing.assert_allclose(engine.embedding_tables["t"][2], -0.25)


def test_backward_updates_the_rows_of_its_own_forward_when_another_lookup_follows(monkeypatch):
    # A second thread's lookup can finish right after this forward's: the backward must still
    # update this forward's rows (the batch travels with the activations, not via the engine).
    eng = _engine(opt.SGD(1.0))
    layer = EmbeddingLayer(eng)
    before = eng.embedding_tables["t"].copy()
    real = eng.lookup_with_batch

    def then_another_lookup(features, weights=None, *, training=True):
        out = real(features, weights, training=training)
        eng.lookup({"a": [[9], [10]], "b": [[11], [9]]})  # the "other thread"
        return out

    monkeypatch.setattr(eng, "lookup_with_batch", then_another_lookup)
    out = layer({"a": [[1], [2]], "b": [[3], [1]]})
    (out["a"].sum() + out["b"].sum()).backward()
    changed = np.flatnonzero(np.any(eng.embedding_tables["t"] != before, axis=1))
    np.testing.assert_array_equal(changed, [1, 2, 3])


def test_weights_that_require_grad_are_refused_and_bfloat16_weights_read():
    """Per-id weights are constants to the engine: weights requiring grad (torchrec's
    position-weighted modules train them) are refused by name instead of losing their gradient
    silently; bfloat16 weights (which NumPy cannot hold) are read as their float32 values."""
    t = ee.TableConfig(10, 4, name="t")
    eng = ee.EmbeddingEngine({"a": ee.FeatureConfig(t)}, optimizer=opt.SGD(0.1))
    layer = EmbeddingLayer(eng).eval()
    ids, lengths = torch.tensor([1, 2, 3]), torch.tensor([2, 1])
    w = torch.tensor([0.5, 2.0, 1.0], requires_grad=True)
    with pytest.raises(ValueError, match="weights require grad.*weights.detach"):
        layer(KeyedJagged(["a"], ids, lengths=lengths, weights=w))
    want = layer(KeyedJagged(["a"], ids, lengths=lengths, weights=w.detach()))
    got = layer(KeyedJagged(["a"], ids, lengths=lengths, weights=w.detach().bfloat16()))
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # 0.5, 2 and 1 are exact in bf16


def test_a_forward_refused_for_its_output_or_learning_rates_changes_nothing():
    """output='keyed' with features of different batch sizes, and learning_rates the update
    would refuse, are refused before the training lookup: no key inserted, no batch pending."""
    t = ee.TableConfig(None, 8, name="k", combiner="sum", dynamic=ee.DynamicVocabulary())
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t), "g": ee.FeatureConfig(t)}, optimizer=opt.Adagrad(0.1)
    )
    layer = EmbeddingLayer(eng, output="keyed")
    inputs = (
        {"f": torch.tensor([1, 2, 3]), "g": torch.tensor([4, 5])},
        {"f": [[1], [2, 3]], "g": ee.Ragged(np.array([4]), lengths=[1])},
        {"f": np.array([[1, -1], [2, 3]]), "g": [9, 8, 7]},
    )
    for features in inputs:
        with pytest.raises(ValueError, match="output='keyed' needs one batch size"):
            layer(features)
    prepared = EmbeddingLayer(eng).preprocess(
        {"f": torch.tensor([1, 2, 3]), "g": torch.tensor([4, 5])}
    )
    with pytest.raises(ValueError, match="output='keyed' needs one batch size"):
        layer(prepared)
    # A sequence feature or a non-pooled output_shape, from their configs: before the lookup.
    for name, other in (
        ("s", ee.FeatureConfig(t, max_sequence_length=2)),
        ("o", ee.FeatureConfig(t, output_shape=(2, 1))),
    ):
        refused = ee.EmbeddingEngine({"f": ee.FeatureConfig(t), name: other}, optimizer=opt.SGD(1))
        with pytest.raises(ValueError, match=f"needs pooled .* feature '{name}' has shape"):
            EmbeddingLayer(refused, output="keyed")({"f": [[1], [2]], name: [[3, 4], [5]]})
        assert refused.table_contents("k")["keys"].tolist() == []
    pooled = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t), "p": ee.FeatureConfig(t, output_shape=(2,))},
        optimizer=opt.SGD(1),
    )
    out = EmbeddingLayer(pooled, output="keyed")({"f": [[1], [2]], "p": [[3], [4]]})
    assert tuple(out.values().shape) == (2, 16)  # output_shape (2,): pooled, two rows
    for bad in ([float("nan")], [True], [0.1, 0.2]):
        with pytest.raises((ValueError, TypeError), match="learning_rates"):
            EmbeddingLayer(eng)(
                {"f": torch.tensor([7, 8]), "g": torch.tensor([1, 2])}, learning_rates=bad
            )
    assert eng.table_contents("k")["keys"].tolist() == []
    with pytest.raises(ValueError, match="no batch"):
        eng.apply_gradients({"f": np.ones((3, 8)), "g": np.ones((2, 8))})
    out = layer({"f": torch.tensor([1, 2]), "g": torch.tensor([4, 5])})  # fits
    out.values().sum().backward()
    assert eng.step == 1 and eng.table_contents("k")["keys"].tolist() == [1, 2, 4, 5]


@pytest.mark.parametrize("step", [torch.tensor(3.7), torch.tensor(True), torch.tensor([1, 2])])
def test_load_state_dict_refuses_a_step_that_is_not_an_integer_scalar(step):
    """int(value.item()) took 3.7 as 3 and True as 1: the step goes to the engine's check."""
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(ee.TableConfig(100, 8, name="t"))}, optimizer=opt.SGD(0.1)
    )
    layer = EmbeddingLayer(eng)
    state = layer.state_dict()
    state["step"] = step
    with pytest.raises(RuntimeError, match=r"state\['step'\] must be an int"):
        layer.load_state_dict(state)
    assert eng.step == 0
    state["step"] = torch.tensor(5)
    layer.load_state_dict(state)
    assert eng.step == 5


def test_torch_compile_of_a_model_around_the_layer_trains_as_eager():
    """torch.compile(model) traced into the layer's forward, running the engine's NumPy code
    as torch ops, and failed inside the engine (here: '"max_values_cpu" not implemented for
    'UInt64'' in inputs.check_values; with the inductor backend: "Expected np.nditer base, got
    <class 'torch.Tensor'>"). The layer now runs eagerly and the rest is compiled: the same
    tables and dense weights as the eager twin."""

    class Model(torch.nn.Module):
        def __init__(self, engine):
            super().__init__()
            self.emb = EmbeddingLayer(engine)
            self.top = torch.nn.Linear(DIM, 1)

        def forward(self, features):
            out = self.emb(features)
            return self.top(out["a"] * out["b"] + out["a"])

    torch.manual_seed(0)
    eager, compiled = Model(_engine(opt.SGD(0.3))), Model(_engine(opt.SGD(0.3)))
    compiled.top.load_state_dict(eager.top.state_dict())
    run = torch.compile(compiled, backend="aot_eager")
    rng = np.random.default_rng(1)
    for _ in range(3):
        feats = {k: torch.from_numpy(rng.integers(0, VOCAB, (4, 2))) for k in ("a", "b")}
        for model, call in ((eager, eager), (compiled, run)):
            model.zero_grad()
            call(feats).square().mean().backward()
            with torch.no_grad():
                for p in model.top.parameters():
                    p -= 0.1 * p.grad
    for model in (eager, compiled):
        assert model.emb.engine.step == 3
    np.testing.assert_allclose(
        compiled.emb.engine.embedding_tables["t"],
        eager.emb.engine.embedding_tables["t"],
        rtol=1e-6,
        atol=1e-7,
    )
    for p, q in zip(compiled.top.parameters(), eager.top.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def _bag_reference(engine):
    """The engine's table "t" as a torch leaf, and sum-pooling of a ``[batch, ids]`` tensor."""
    w = torch.from_numpy(engine.embedding_tables["t"].copy()).requires_grad_()
    return w, lambda ids: w[ids].sum(1)


def test_outputs_can_be_modified_in_place_as_torchs_can():
    """relu_ or += on an output (an nn.EmbeddingBag's output allows both) raised torch's
    "Output 0 of _FusedLookup is a view and is being modified inplace" in training mode
    only: the outputs were views of the node's inputs. The update is torch's SGD's."""
    eng = _engine(opt.SGD(0.5), "sum")
    layer = EmbeddingLayer(eng)
    w, bag = _bag_reference(eng)
    before = eng.embedding_tables["t"].copy()
    feats = {"a": torch.tensor([[3, 4], [1, 3]]), "b": torch.tensor([[5], [3]])}
    scale = torch.tensor([[1.0, -2.0, 3.0]])
    out = layer(feats)
    out["a"].relu_()
    out["b"] += 1.0
    ((out["a"] * scale).sum() + (out["a"] * out["b"]).sum()).backward()
    ra, rb = bag(feats["a"]).relu(), bag(feats["b"]) + 1.0
    ((ra * scale).sum() + (ra * rb).sum()).backward()
    np.testing.assert_allclose(
        eng.embedding_tables["t"], before - 0.5 * w.grad.numpy(), rtol=1e-6, atol=1e-7
    )


@pytest.mark.parametrize("retain_graph", [True, False])
def test_a_second_loss_of_the_same_outputs_is_refused_not_lost(retain_graph):
    """loss_a.backward(); loss_b.backward() on one forward's outputs (multi-task training):
    the first backward updates the tables; the second brought gradients the update had run
    without, and they were dropped silently (row 5 never moved). Now it is refused, saying
    what to do; the same loss again and a zero gradient still change nothing; the losses
    summed give torch's SGD numbers."""
    eng = _engine(opt.SGD(0.5), "sum")
    layer = EmbeddingLayer(eng)
    feats = {"a": torch.tensor([[3]]), "b": torch.tensor([[5]])}
    out = layer(feats)
    loss_a, loss_b = out["a"].sum(), 2 * out["b"].sum()
    loss_a.backward(retain_graph=retain_graph)
    after_a = eng.embedding_tables["t"].copy()
    with pytest.raises(RuntimeError, match=r"features \['b'\].*\(loss_a \+ loss_b\)\.backward"):
        loss_b.backward()
    np.testing.assert_array_equal(eng.embedding_tables["t"], after_a)
    assert eng.step == 1

    out = layer(feats)
    loss = out["a"].sum()
    loss.backward(retain_graph=True)
    loss.backward(retain_graph=True)  # the same gradients again: nothing
    (0 * out["b"].sum()).backward()  # zeros: nothing
    assert eng.step == 2

    w, bag = _bag_reference(eng)
    before = eng.embedding_tables["t"].copy()
    out = layer(feats)
    (out["a"].sum() + 2 * out["b"].sum()).backward()
    (bag(feats["a"]).sum() + 2 * bag(feats["b"]).sum()).backward()
    np.testing.assert_allclose(eng.embedding_tables["t"], before - 0.5 * w.grad.numpy())


def test_a_dynamic_rate_without_its_value_is_refused_before_the_lookup():
    """A table with DynamicLearningRate and neither learning_rates= nor an lr_handle: the
    forward (a training lookup: keys inserted) went through and the backward failed with the
    engine's "pass learning_rates=[...] ... to apply_gradients", a call a torch loop never
    makes. Now the forward refuses it first, saying where the values go; eval looks up."""
    t = ee.TableConfig(
        None,
        DIM,
        combiner="sum",
        name="k",
        dynamic=ee.DynamicVocabulary(),
        optimizer=opt.SGD(ee.DynamicLearningRate(0)),
    )
    eng = ee.EmbeddingEngine({"a": ee.FeatureConfig(t)})
    layer = EmbeddingLayer(eng)
    with pytest.raises(
        ValueError, match=r"tables \['k'\] use DynamicLearningRate.*forward.*lr_handle"
    ):
        layer({"a": [[7]]})
    assert eng.step == 0 and eng.table_contents("k")["keys"].tolist() == []
    with torch.no_grad():
        layer({"a": [[7]]})  # a lookup: no update, no rate needed
    layer({"a": [[7]]}, learning_rates=[0.5])["a"].sum().backward()
    layer.lr_handle(0.5)
    layer({"a": [[7]]})["a"].sum().backward()
    assert eng.step == 2 and eng.table_contents("k")["keys"].tolist() == [7]


def test_requires_grad_false_freezes_the_tables():
    """layer.requires_grad_(False), the way to freeze an nn.EmbeddingBag, changed nothing: the
    outputs still required grad and backward updated the rows (step 1, both tables moved).
    Now the frozen layer looks up (outputs need no grad; keyed keys not inserted) and the
    dense part still trains; requires_grad_(True) trains the tables again."""
    t = ee.TableConfig(None, DIM, combiner="sum", name="k", dynamic=ee.DynamicVocabulary())
    u = ee.TableConfig(VOCAB, DIM, combiner="sum", name="t")
    eng = ee.EmbeddingEngine(
        {"a": ee.FeatureConfig(t), "b": ee.FeatureConfig(u)}, optimizer=opt.SGD(0.5)
    )
    layer = EmbeddingLayer(eng)
    dense = torch.nn.Linear(DIM, 1)
    before = eng.embedding_tables["t"].copy()
    assert layer.requires_grad_(False) is layer
    out = layer({"a": [[3]], "b": [[5]]})
    assert not any(v.requires_grad for v in out.values())
    dense(out["a"] + out["b"]).sum().backward()
    assert dense.weight.grad is not None
    assert eng.step == 0 and eng.table_contents("k")["keys"].tolist() == []
    np.testing.assert_array_equal(eng.embedding_tables["t"], before)
    layer.requires_grad_()
    out = layer({"a": [[3]], "b": [[5]]})
    dense(out["a"] + out["b"]).sum().backward()
    assert eng.step == 1 and eng.table_contents("k")["keys"].tolist() == [3]
    assert not np.array_equal(eng.embedding_tables["t"][5], before[5])


def test_a_timestamp_tensor_is_read_as_its_int():
    """A batch's time from a DataLoader is a tensor (``batch["time"].max()``): the layer
    refused it ("timestamp must be an int (seconds of data time, e.g. Unix time), got
    tensor(1000)") where it took NumPy's int64. A 0-d integer tensor is its int now; a float
    or bool tensor is still refused by name, nothing changed."""
    from conftest import keyed_engine

    a = EmbeddingLayer(keyed_engine("numba", expire_seconds=100))
    b = EmbeddingLayer(keyed_engine("numba", expire_seconds=100))
    for i, (t, ids) in enumerate(((1000, [[1]]), (1050, [[2]]), (1101, [[2]]))):
        ta = torch.tensor(t) if i % 2 == 0 else torch.tensor(t, dtype=torch.int32)
        a({"f": ids}, timestamp=ta)["f"].sum().backward()
        b({"f": ids}, timestamp=np.int64(t))["f"].sum().backward()
    assert a.engine.table_stats()["k"]["data_time"] == 1101
    got, want = a.engine.table_contents("k"), b.engine.table_contents("k")
    assert all(np.array_equal(got[n], want[n]) for n in want)
    assert a.engine.table_contents("k")["keys"].tolist() == [2]  # 1 expired at 1101
    for bad in (torch.tensor(1200.0), torch.tensor(True), torch.tensor([1200])):
        with pytest.raises(TypeError, match="timestamp must be an int"):
            a({"f": [[3]]}, timestamp=bad)
    assert a.engine.step == 3 and a.engine.table_stats()["k"]["data_time"] == 1101


def test_a_meta_timestamp_tensor_is_refused_by_name():
    """A 0-d meta tensor as the timestamp gave torch's own "Tensor.item() cannot be called
    on meta tensors" (a RuntimeError), where meta ids are refused as a TypeError naming what
    came; other meta tensors went to the engine as "timestamp must be an int". Refused here
    by name, nothing changed."""
    from conftest import keyed_engine

    a = EmbeddingLayer(keyed_engine("numba", expire_seconds=100))
    a({"f": [[1]]}, timestamp=torch.tensor(1000))["f"].sum().backward()
    for bad in (torch.tensor(1200, device="meta"), torch.empty(2, device="meta")):
        with pytest.raises(TypeError, match=r"timestamp is a meta tensor \(device 'meta', shape"):
            a({"f": [[3]]}, timestamp=bad)
    assert a.engine.step == 1 and a.engine.table_contents("k")["keys"].tolist() == [1]
    a.eval()({"f": [[3]]}, timestamp=torch.tensor(1200, device="meta"))  # evaluation: unused


def test_the_layer_s_repr_names_a_keyed_table_so():
    """A keyed table has no vocabulary size: the repr showed "k: Nonex3"."""
    k = ee.TableConfig(None, DIM, name="k", dynamic=ee.DynamicVocabulary())
    t = ee.TableConfig(VOCAB, DIM, name="t")
    layer = EmbeddingLayer(
        ee.EmbeddingEngine(
            {"a": ee.FeatureConfig(t), "b": ee.FeatureConfig(k)}, optimizer=opt.SGD(0.1)
        )
    )
    assert repr(layer) == "EmbeddingLayer(tables=[t: 12x3, k: keyedx3], backend='numba')"


def test_a_list_of_tensors_is_read_as_a_list_of_arrays():
    """Samples of different lengths collated as a list of 1-D tensors (or a list of 0-d
    tensors, one id each) were refused ("ids must be integers, got tensor([1, 2]) at ids[0]")
    where the same list of NumPy arrays is read. Weights likewise; weights that require grad
    are refused by name, as in every other form."""
    ids = [torch.tensor([1, 2]), torch.tensor([], dtype=torch.int64), torch.tensor([3])]
    weights = [torch.tensor([0.5, 2.0]), torch.tensor([]), torch.tensor([4.0])]
    numpy_ids = [np.array([1, 2]), np.array([], np.int64), np.array([3])]
    numpy_weights = [np.array([0.5, 2.0]), np.array([]), np.array([4.0])]
    a, b = (_engine(opt.SGD(0.5), "sum") for _ in range(2))
    la, lb = EmbeddingLayer(a), EmbeddingLayer(b)
    out = la({"a": ids, "b": [torch.tensor(4), torch.tensor(5), torch.tensor(6)]}, {"a": weights})
    want = lb({"a": numpy_ids, "b": [4, 5, 6]}, {"a": numpy_weights})
    for name in ("a", "b"):
        torch.testing.assert_close(out[name], want[name], rtol=0, atol=0)
    (out["a"] * out["b"]).sum().backward()
    (want["a"] * want["b"]).sum().backward()
    np.testing.assert_array_equal(a.embedding_tables["t"], b.embedding_tables["t"])
    pb = la.preprocess({"a": ids, "b": [[4], [5], [6]]}, {"a": weights}, training=False)
    la.eval()
    torch.testing.assert_close(
        la(pb)["a"], lb.eval()({"a": numpy_ids, "b": [4, 5, 6]}, {"a": numpy_weights})["a"]
    )
    la.train()
    grad = [torch.tensor([0.5, 2.0], requires_grad=True), torch.tensor([]), torch.tensor([4.0])]
    with pytest.raises(ValueError, match="feature 'a': weights require grad"):
        la({"a": ids, "b": [4, 5, 6]}, {"a": grad})
    with pytest.raises(TypeError, match="ids must be integers"):
        la({"a": [torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([3.0])], "b": [4, 5, 6]})
    assert a.step == 1


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("layout", ["strided", "jagged"])
def test_a_nested_tensor_is_read_as_its_rows(layout):
    """``torch.nested.nested_tensor(rows)`` of 1-D int rows (a jagged batch, one row per
    sample) gave "RuntimeError: Internal error: NestedTensorImpl doesn't support sizes. Please
    file an issue." (the jagged layout: ".numpy() is not supported for tensor subclasses"),
    naming no feature. It is read as the list of its rows is, in both layouts, its weights a
    nested tensor of the same row lengths; what it cannot be is refused by name."""
    lay = {"strided": torch.strided, "jagged": torch.jagged}[layout]
    rows = [torch.tensor([1, 2]), torch.tensor([], dtype=torch.int64), torch.tensor([3])]
    w = [torch.tensor([0.5, 2.0]), torch.tensor([]), torch.tensor([4.0])]
    a, b = (_engine(opt.SGD(0.5), "sum") for _ in range(2))
    la, lb = EmbeddingLayer(a), EmbeddingLayer(b)
    nested = torch.nested.nested_tensor(rows, layout=lay)
    out = la({"a": nested, "b": [4, 5, 6]}, {"a": torch.nested.nested_tensor(w, layout=lay)})
    want = lb({"a": [[1, 2], [], [3]], "b": [4, 5, 6]}, {"a": [[0.5, 2.0], [], [4.0]]})
    torch.testing.assert_close(out["a"], want["a"], rtol=0, atol=0)
    (out["a"] * out["b"]).sum().backward()
    (want["a"] * want["b"]).sum().backward()
    np.testing.assert_array_equal(a.embedding_tables["t"], b.embedding_tables["t"])
    # output="keyed" counts a nested tensor's samples (its shape is an internal error)
    keyed = EmbeddingLayer(_engine(opt.SGD(0.5), "sum"), output="keyed").eval()
    assert keyed({"a": nested, "b": [4, 5, 6]}).values().shape == (3, 2 * DIM)
    flat = lb.eval()({"a": nested, "b": [4, 5, 6]}, {"a": torch.tensor([0.5, 2.0, 4.0])})
    torch.testing.assert_close(flat["a"], lb({"a": nested, "b": [4, 5, 6]}, {"a": w})["a"])
    empty = torch.nested.nested_tensor([], dtype=torch.int64)
    assert lb({"a": empty, "b": []})["a"].shape == (0, DIM)
    with pytest.raises(TypeError, match="feature 'a': ids must be integers, got dtype float32"):
        la({"a": torch.nested.nested_tensor([torch.ones(2)], layout=lay), "b": [4]})
    two_d = torch.nested.nested_tensor([torch.ones(2, 2, dtype=torch.int64)], layout=lay)
    with pytest.raises(ValueError, match=r"feature 'a': ids is a nested tensor whose row 0 has"):
        la({"a": two_d, "b": [4]})
    short = torch.nested.nested_tensor([torch.ones(1)] * 3, layout=lay)
    with pytest.raises(ValueError, match="feature 'a': weights of sample 0 has 1 entries but"):
        la({"a": nested, "b": [4, 5, 6]}, {"a": short})
    with pytest.raises(TypeError, match="feature 'a': weights is a nested tensor but the ids"):
        la({"a": torch.tensor([1, 2, 3]), "b": [4, 5, 6]}, {"a": short})
    with pytest.raises(TypeError, match="KeyedJagged values is a torch nested tensor"):
        la(KeyedJagged(["a", "b"], nested, lengths=[1, 1, 1, 0, 0, 0]))
    assert a.step == 1


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support")
def test_tensors_numpy_cannot_read_are_refused_naming_feature_and_tensor():
    """A meta tensor gave "NotImplementedError: Cannot copy out of meta tensor; no data!",
    a bfloat16 one "Got unsupported ScalarType BFloat16", both naming no feature (a KJT: not
    that it was its values), and a sparse one advised ``to_dense()``, which makes every
    missing id 0, a real row. Each is a TypeError naming the feature and the tensor; float8
    weights are read as their float32 values, as bfloat16 ones are."""
    eng = _engine(opt.SGD(0.5), "sum")
    layer = EmbeddingLayer(eng)
    b = [4, 5]
    meta = torch.tensor([1, 2], device="meta")
    cases = [
        ({"a": meta, "b": b}, None, "feature 'a': ids is a meta tensor"),
        ({"a": [meta[0], meta[1]], "b": b}, None, "feature 'a': ids is a meta tensor"),
        ({"a": [1, 2], "b": b}, {"a": meta.float()}, "feature 'a': weights is a meta tensor"),
        ({"a": torch.tensor([1.0, 2.0]).bfloat16(), "b": b}, None, "got dtype bfloat16"),
        ({"a": torch.tensor([1, 2]).bool(), "b": b}, None, "'a': ids must be integers, got dtype"),
        ({"a": torch.tensor([[1, 2]]).to_sparse(), "b": [4]}, None, "ids is a torch.sparse_coo"),
        ({"a": torch.tensor([[1, 2]]).to_sparse_csr(), "b": [4]}, None, "torch.sparse_csr tensor"),
    ]
    before = eng.embedding_tables["t"].copy()
    for features, weights, message in cases:
        with pytest.raises(TypeError, match=message):
            layer(features, weights)
    with pytest.raises(TypeError, match="KeyedJagged values is a meta tensor"):
        layer(KeyedJagged(["a", "b"], meta, lengths=[1, 1, 0, 0]))
    np.testing.assert_array_equal(eng.embedding_tables["t"], before)
    assert eng.step == 0
    # torch.tensor([]) is float32: empty, it is no ids, as NumPy's empty float array is
    assert layer({"a": torch.tensor([]), "b": torch.tensor([])})["a"].shape == (0, DIM)
    empty = KeyedJagged(["a", "b"], torch.tensor([]), lengths=torch.tensor([0, 0]))
    assert layer(empty)["b"].shape == (1, DIM)
    w8 = torch.tensor([0.5, 2.0]).to(torch.float8_e4m3fn)
    out = layer.eval()({"a": [1, 2], "b": b}, {"a": w8})
    want = layer({"a": [1, 2], "b": b}, {"a": torch.tensor([0.5, 2.0])})
    torch.testing.assert_close(out["a"], want["a"], rtol=0, atol=0)


def test_keyed_output_counts_any_sequence_s_samples_before_the_lookup():
    """A range or an array.array of ids (1-D ids the engine reads) was not counted by
    output='keyed''s check before the training lookup: two batch sizes were refused only
    after the lookup had inserted a keyed table's keys [1, 2, 3, 4, 5]."""
    import array

    t = ee.TableConfig(None, 8, name="k", combiner="sum", dynamic=ee.DynamicVocabulary())
    for ids in (range(1, 4), array.array("q", [1, 2, 3])):
        eng = ee.EmbeddingEngine(
            {"f": ee.FeatureConfig(t), "g": ee.FeatureConfig(t)}, optimizer=opt.Adagrad(0.1)
        )
        layer = EmbeddingLayer(eng, output="keyed")
        with pytest.raises(ValueError, match="one batch size; feature 'g' has 2 samples"):
            layer({"f": ids, "g": [4, 5]})
        assert eng.table_contents("k")["keys"].tolist() == []
        layer({"f": ids, "g": [4, 5, 6]}).values().sum().backward()
        assert eng.table_contents("k")["keys"].tolist() == [1, 2, 3, 4, 5, 6]
