"""TorchRec interop: KeyedJaggedTensor in every form TorchRec makes (variable batch per
feature included), EmbeddingLayer's state_dict, torch LR schedulers, KeyedTensor output and
TorchRec's configs. Tests marked with a torchrec fixture compare against torchrec's own classes
and are skipped where it is not installed (``make test`` installs it); the others use our
KeyedJagged or a duck type, and run everywhere."""

import io

import numpy as np
import pytest
import torch

import embengine as ee
from embengine import optimizers as opt
from embengine.keyed_jagged import keyed_jagged_to_features
from embengine.torch import (
    EmbeddingLayer,
    KeyedJagged,
    KeyedTensor,
    LearningRateHandle,
    feature_configs_from_torchrec,
)


@pytest.fixture(scope="module")
def trj():
    """torchrec.sparse.jagged_tensor, or skip."""
    return pytest.importorskip("torchrec.sparse.jagged_tensor")


def _engine(optimizer=None, combiner="sum", seed=0, dims=(3, 2), lr=None, backend="numba"):
    def table(name, vocab, dim):
        o = None if lr is None else type(optimizer)(lr)
        return ee.TableConfig(
            vocab,
            dim,
            name=name,
            combiner=combiner,
            optimizer=o,
            initializer=ee.initializers.RandomUniform(-0.5, 0.5),
        )

    t, u = table("t", 12, dims[0]), table("u", 10, dims[1])
    return ee.EmbeddingEngine(
        {"a": ee.FeatureConfig(t), "b": ee.FeatureConfig(u)},
        optimizer=optimizer,
        seed=seed,
        backend=backend,
    )


class _DuckKJT:
    """What a TorchRec KeyedJaggedTensor shows of itself, with nothing checked."""

    def __init__(self, keys, values, lengths, weights=None, stride_per_key=None, inverse=None):
        self._k, self._v, self._l, self._w = keys, values, lengths, weights
        self._s, self._i = stride_per_key, inverse

    def keys(self):
        return self._k

    def values(self):
        return self._v

    def lengths(self):
        return self._l

    def weights_or_none(self):
        return self._w

    def variable_stride_per_key(self):
        return self._s is not None

    def stride_per_key(self):
        return self._s

    def inverse_indices_or_none(self):
        return self._i


# A variable batch per feature: key "a" has 2 samples, key "b" 3; the batch has 4 samples.
VBE = {
    "keys": ["a", "b"],
    "values": [1, 2, 3, 4, 5, 6, 7],
    "lengths": [1, 2, 1, 0, 3],
    "weights": [1.0, 0.5, 2.0, 1.5, 1.0, 3.0, 0.25],
    "stride_per_key": [2, 3],
    "inverse": [[0, 1, 1, 0], [2, 1, 0, 2]],
}
# The same batch with every key expanded to the 4 samples by the inverse indices.
EXPANDED_IDS = {"a": [[1], [2, 3], [2, 3], [1]], "b": [[5, 6, 7], [], [4], [5, 6, 7]]}
EXPANDED_WEIGHTS = {
    "a": [[1.0], [0.5, 2.0], [0.5, 2.0], [1.0]],
    "b": [[1.0, 3.0, 0.25], [], [1.5], [1.0, 3.0, 0.25]],
}


def _vbe(kind, weighted, trj=None, inverse_keys=("a", "b")):
    v = VBE
    inv_rows = [v["inverse"][v["keys"].index(k)] for k in inverse_keys]
    weights = torch.tensor(v["weights"]) if weighted else None
    if kind == "ours":
        return KeyedJagged(
            v["keys"],
            torch.tensor(v["values"]),
            lengths=torch.tensor(v["lengths"]),
            weights=weights,
            stride_per_key=v["stride_per_key"],
            inverse_indices=(list(inverse_keys), torch.tensor(inv_rows)),
        )
    if kind == "duck":
        return _DuckKJT(
            v["keys"],
            torch.tensor(v["values"]),
            torch.tensor(v["lengths"]),
            weights,
            v["stride_per_key"],
            (list(inverse_keys), torch.tensor(inv_rows)),
        )
    return trj.KeyedJaggedTensor(
        keys=v["keys"],
        values=torch.tensor(v["values"]),
        lengths=torch.tensor(v["lengths"]),
        weights=weights,
        stride_per_key_per_rank=[[s] for s in v["stride_per_key"]],
        inverse_indices=(list(inverse_keys), torch.tensor(inv_rows)),
    )


def _vbe_kinds(trj_or_none):
    return ["ours", "duck"] + (["torchrec"] if trj_or_none is not None else [])


def _maybe_trj():
    try:
        import torchrec.sparse.jagged_tensor as m
    except ImportError:
        return None
    return m


# -- KeyedJaggedTensor: a variable batch per feature ---------------------------------------------


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("kind", ["ours", "duck", "torchrec"])
def test_vbe_kjt_is_the_batch_expanded_by_its_inverse_indices(kind, weighted):
    trj = _maybe_trj()
    if kind == "torchrec" and trj is None:
        pytest.skip("torchrec is not installed")
    kjt = _vbe(kind, weighted, trj)
    split = keyed_jagged_to_features(kjt)
    for key in ("a", "b"):
        r = split[key]
        got = [r.ids[r.offsets[j] : r.offsets[j + 1]].tolist() for j in range(4)]
        assert got == EXPANDED_IDS[key]
        if weighted:
            w = [r.weights[r.offsets[j] : r.offsets[j + 1]].tolist() for j in range(4)]
            assert w == EXPANDED_WEIGHTS[key]
    # Trained on: the same forward and the same update as the expanded batch, bit for bit.
    eng, ref = _engine(opt.Adagrad(0.2)), _engine(opt.Adagrad(0.2))
    out = EmbeddingLayer(eng)(kjt)
    expected = EmbeddingLayer(ref)(
        {k: ee.Ragged(split[k].ids, offsets=split[k].offsets) for k in ("a", "b")}
        if not weighted
        else EXPANDED_IDS,
        EXPANDED_WEIGHTS if weighted else None,
    )
    for key in ("a", "b"):
        assert out[key].shape[0] == 4
        torch.testing.assert_close(out[key], expected[key], rtol=0, atol=0)
    g = torch.arange(4 * 3, dtype=torch.float32).reshape(4, 3) / 7
    (out["a"] * g).sum().backward()
    (expected["a"] * g).sum().backward()
    for name in ("t", "u"):
        np.testing.assert_array_equal(eng.embedding_tables[name], ref.embedding_tables[name])
        for slot, arr in eng.slots(name).items():
            np.testing.assert_array_equal(arr, ref.slots(name)[slot])


@pytest.mark.parametrize("kind", ["ours", "duck", "torchrec"])
def test_inverse_indices_rows_are_picked_by_key_name(kind):
    trj = _maybe_trj()
    if kind == "torchrec" and trj is None:
        pytest.skip("torchrec is not installed")
    split = keyed_jagged_to_features(_vbe(kind, False, trj, inverse_keys=("b", "a")))
    r = split["b"]
    assert [r.ids[r.offsets[j] : r.offsets[j + 1]].tolist() for j in range(4)] == EXPANDED_IDS["b"]


def test_vbe_without_inverse_indices_is_refused_naming_the_keys():
    v = VBE
    message = (
        r"KeyedJagged has a variable batch per key \{'a': 2, 'b': 3\} \(stride_per_key\) "
        r"and no inverse_indices.*Pass inverse_indices="
    )
    with pytest.raises(ValueError, match=message):
        KeyedJagged(v["keys"], v["values"], lengths=v["lengths"], stride_per_key=[2, 3])
    duck = _DuckKJT(
        v["keys"], torch.tensor(v["values"]), torch.tensor(v["lengths"]), stride_per_key=[2, 3]
    )
    layer = EmbeddingLayer(_engine(opt.SGD(0.1)))
    with pytest.raises(ValueError, match=message):
        layer(duck)
    with pytest.raises(ValueError, match=message):
        layer.preprocessor()(duck)
    # stride_per_key [1, 3]: 4 lengths for 2 keys look like a batch of 2 (it was read so, the
    # ids of "b"'s first sample given to "a", with no error).
    duck = _DuckKJT(
        ["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([1, 1, 0, 1]), stride_per_key=[1, 3]
    )
    with pytest.raises(ValueError, match=r"\{'a': 1, 'b': 3\}"):
        layer(duck)
    # Every key with the same number of samples needs no inverse indices.
    same = KeyedJagged(["a", "b"], [1, 2], lengths=[1, 0, 0, 1], stride_per_key=[2, 2])
    assert keyed_jagged_to_features(same)["b"].lengths.tolist() == [0, 1]


def test_vbe_torchrec_kjt_without_inverse_indices_is_refused(trj):
    kjt = trj.KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor([1, 2, 3]),
        lengths=torch.tensor([1, 1, 0, 1]),
        stride_per_key_per_rank=[[1], [3]],
    )
    with pytest.raises(ValueError, match=r"variable batch per key \{'a': 1, 'b': 3\}"):
        EmbeddingLayer(_engine(opt.SGD(0.1)))(kjt)


def test_bad_vbe_layouts_are_refused_naming_the_key():
    v = VBE
    inv = (["a", "b"], torch.tensor(v["inverse"]))
    with pytest.raises(
        ValueError,
        match=r"key 'b': inverse index 3 at sample 0 is out of range "
        r"\[0, 3\) \(the key has 3 samples\)",
    ):
        KeyedJagged(
            v["keys"],
            v["values"],
            lengths=v["lengths"],
            stride_per_key=[2, 3],
            inverse_indices=(["a", "b"], torch.tensor([[0, 1, 1, 0], [3, 1, 0, 2]])),
        )
    with pytest.raises(ValueError, match=r"key 'b' has no row in inverse_indices"):
        KeyedJagged(
            v["keys"],
            v["values"],
            lengths=v["lengths"],
            stride_per_key=[2, 3],
            inverse_indices=(["a"], torch.tensor([[0, 1, 1, 0]])),
        )
    with pytest.raises(
        ValueError,
        match=r"stride_per_key \{'a': 2, 'b': 2\} adds up to 4 "
        r"samples but there are 5 lengths",
    ):
        KeyedJagged(
            v["keys"], v["values"], lengths=v["lengths"], stride_per_key=[2, 2], inverse_indices=inv
        )
    with pytest.raises(ValueError, match=r"KeyedJagged key 'b', sample 2: length -1"):
        KeyedJagged(
            v["keys"], [1, 2], lengths=[1, 1, 0, 1, -1], stride_per_key=[2, 3], inverse_indices=inv
        )
    with pytest.raises(ValueError, match=r"key 'b', sample 1: offsets\[4\]=1 is less"):
        KeyedJagged(
            v["keys"],
            [1, 2, 3],
            offsets=[0, 1, 2, 3, 1, 3],
            stride_per_key=[2, 3],
            inverse_indices=inv,
        )


def test_stride_per_key_may_be_a_tensor_or_an_array():
    """``stride_per_key=torch.tensor([2, 3])`` was refused ("must be integers, got tensor(2)":
    ``list()`` of a tensor gives 0-d tensors); a tensor or an array is read as the list."""
    v = VBE
    inv = (["a", "b"], torch.tensor(v["inverse"]))
    want = keyed_jagged_to_features(_vbe("ours", weighted=False))
    for spk in (torch.tensor([2, 3]), np.array([2, 3], dtype=np.int32), (2, 3)):
        kj = KeyedJagged(
            v["keys"], v["values"], lengths=v["lengths"], stride_per_key=spk, inverse_indices=inv
        )
        assert kj.stride_per_key() == [2, 3]
        for key, r in keyed_jagged_to_features(kj).items():
            np.testing.assert_array_equal(r.ids, want[key].ids)
            np.testing.assert_array_equal(r.offsets, want[key].offsets)
    with pytest.raises(ValueError, match=r"stride_per_key must be 1-D .* got shape \[1, 2\]"):
        KeyedJagged(
            v["keys"],
            v["values"],
            lengths=v["lengths"],
            stride_per_key=torch.tensor([[2, 3]]),
            inverse_indices=inv,
        )
    with pytest.raises(TypeError, match="stride_per_key must be integers, got dtype float32"):
        KeyedJagged(
            v["keys"],
            v["values"],
            lengths=v["lengths"],
            stride_per_key=torch.tensor([2.0, 3.0]),
            inverse_indices=inv,
        )


def test_vbe_over_several_ranks(trj):
    # stride_per_key_per_rank [[1, 1], [2, 1]]: "a" has 2 samples, "b" 3, rank by rank.
    kjt = trj.KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor([1, 2, 3, 4, 5]),
        lengths=torch.tensor([1, 2, 0, 1, 1]),
        stride_per_key_per_rank=[[1, 1], [2, 1]],
        inverse_indices=(["a", "b"], torch.tensor([[1, 0], [2, 0]])),
    )
    split = keyed_jagged_to_features(kjt)
    assert split["a"].ids.tolist() == [2, 3, 1] and split["a"].lengths.tolist() == [2, 1]
    assert split["b"].ids.tolist() == [5] and split["b"].lengths.tolist() == [1, 0]


def _ebc(trj_module, eng, pooling, weighted):
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    p = PoolingType.SUM if pooling == "sum" else PoolingType.MEAN
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                num_embeddings=12, embedding_dim=3, name="t", feature_names=["a"], pooling=p
            ),
            EmbeddingBagConfig(
                num_embeddings=10, embedding_dim=2, name="u", feature_names=["b"], pooling=p
            ),
        ],
        is_weighted=weighted,
    )
    with torch.no_grad():
        for name in ("t", "u"):
            ebc.embedding_bags[name].weight.copy_(torch.from_numpy(eng.embedding_tables[name]))
    return ebc


# torch's embedding_bag takes per-sample weights with sum pooling only
@pytest.mark.parametrize(("pooling", "weighted"), [("sum", False), ("mean", False), ("sum", True)])
def test_vbe_matches_torchrecs_embedding_bag_collection(trj, pooling, weighted):
    """Forward and an SGD step from a VBE KJT: embengine against TorchRec's own
    EmbeddingBagCollection (which pools each key over its own samples, then expands)."""
    eng = _engine(opt.SGD(0.5), combiner=pooling)
    ebc = _ebc(trj, eng, pooling, weighted)
    kjt = _vbe("torchrec", weighted, trj)
    layer = EmbeddingLayer(eng, output="keyed")
    ours, theirs = layer(kjt), ebc(kjt)
    assert ours.keys() == theirs.keys() and ours.length_per_key() == theirs.length_per_key()
    torch.testing.assert_close(ours.values(), theirs.values(), rtol=1e-6, atol=1e-7)
    g = torch.linspace(-1, 1, 4 * 5).reshape(4, 5)
    (ours.values() * g).sum().backward()
    (theirs.values() * g).sum().backward()
    with torch.no_grad():
        for p in ebc.parameters():
            p -= 0.5 * p.grad
    for name in ("t", "u"):
        np.testing.assert_allclose(
            eng.embedding_tables[name],
            ebc.embedding_bags[name].weight.detach().numpy(),
            rtol=1e-6,
            atol=1e-7,
        )


# -- KeyedJaggedTensor: the other forms TorchRec makes ---------------------------------------------


def _kjt_forms(trj):
    KJT, JT = trj.KeyedJaggedTensor, trj.JaggedTensor
    keys, values, lengths = ["a", "b"], torch.tensor([1, 2, 3, 4, 5]), torch.tensor([2, 0, 1, 2])
    weights = torch.tensor([0.5, 1.0, 2.0, 1.0, 3.0])
    base = KJT.from_lengths_sync(keys, values, lengths)
    return {
        "from_lengths_sync": base,
        "from_offsets_sync": KJT.from_offsets_sync(keys, values, torch.tensor([0, 2, 2, 3, 5])),
        "int32": KJT(keys=keys, values=values.int(), lengths=lengths.int()),
        "weighted": KJT.from_lengths_sync(keys, values, lengths, weights=weights),
        "from_jt_dict": KJT.from_jt_dict(
            {"a": JT(values[:2], lengths=lengths[:2]), "b": JT(values[2:], lengths=lengths[2:])}
        ),
        "permuted": KJT.from_lengths_sync(
            ["b", "a"], torch.tensor([3, 4, 5, 1, 2]), torch.tensor([1, 2, 2, 0])
        ).permute([1, 0]),
        "concat": KJT.concat(
            [
                KJT.from_lengths_sync(["a"], values[:2], lengths[:2]),
                KJT.from_lengths_sync(["b"], values[2:], lengths[2:]),
            ]
        ),
        "split": KJT.from_lengths_sync(
            ["c", "a", "b"],
            torch.cat([torch.tensor([9]), values]),
            torch.tensor([1, 0, *lengths.tolist()]),
        ).split([1, 2])[1],
        "stride_per_key_per_rank_uniform": KJT(
            keys=keys,
            values=values,
            lengths=lengths,
            stride_per_key_per_rank=[[1, 1], [1, 1]],
            inverse_indices=(keys, torch.tensor([[0, 1], [0, 1]])),
        ),
    }


@pytest.mark.parametrize(
    "form",
    [
        "from_lengths_sync",
        "from_offsets_sync",
        "int32",
        "weighted",
        "from_jt_dict",
        "permuted",
        "concat",
        "split",
        "stride_per_key_per_rank_uniform",
    ],
)
def test_every_torchrec_kjt_form_reads_as_our_keyed_jagged(trj, form):
    kjt = _kjt_forms(trj)[form]
    weights = [0.5, 1.0, 2.0, 1.0, 3.0] if form == "weighted" else None
    ours = KeyedJagged(["a", "b"], [1, 2, 3, 4, 5], lengths=[2, 0, 1, 2], weights=weights)
    layer = EmbeddingLayer(_engine(opt.SGD(0.1)))
    got, expected = layer(kjt), layer(ours)
    assert list(got) == list(expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0)


# -- state_dict ------------------------------------------------------------------------------------


class Model(torch.nn.Module):
    def __init__(self, engine):
        super().__init__()
        self.emb = EmbeddingLayer(engine)
        self.dense = torch.nn.Linear(4 + 4 + 2, 1)

    def forward(self, kjt):
        out = self.emb(kjt)
        return self.dense(torch.cat([out["a"], out["b"], out["c"]], dim=1))


def _packed_engine(seed):
    # "t" and "u" (dim 4, Adam) share one physical table (low-dimensional packing); "v" not.
    t = ee.TableConfig(30, 4, name="t", combiner="sum")
    u = ee.TableConfig(20, 4, name="u", combiner="mean")
    v = ee.TableConfig(25, 2, name="v", optimizer=opt.Adagrad(0.1))
    return ee.EmbeddingEngine(
        {"a": ee.FeatureConfig(t), "b": ee.FeatureConfig(u), "c": ee.FeatureConfig(v)},
        optimizer=opt.Adam(0.05, low_dimensional_packing_status=True),
        seed=seed,
    )


def _batches(n, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        lengths = rng.integers(0, 4, size=3 * 4)
        vocab = np.repeat([30, 20, 25], 4)
        values = np.concatenate(
            [rng.integers(0, v, size=k) for v, k in zip(vocab, lengths, strict=True)]
        )
        y = torch.from_numpy(rng.normal(size=(4, 1)).astype(np.float32))
        yield KeyedJagged(["a", "b", "c"], torch.from_numpy(values), lengths=lengths), y


def _train(model, dense_opt, batches):
    for kjt, y in batches:
        loss = ((model(kjt) - y) ** 2).mean()
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()


def test_state_dict_holds_tables_slots_and_step_sharing_memory():
    eng = _packed_engine(0)
    assert eng.storage_plan.to_json()  # the plan exists; t and u are packed:
    assert any(len(p.tables) == 2 for p in eng.storage_plan.physical_tables)
    model = Model(eng)
    sd = model.state_dict()
    expected = {"emb.step"} | {
        f"emb.tables.{t}.{e}" for t in ("t", "u") for e in ("weights", "momenta", "velocities")
    }
    expected |= {"emb.tables.v.weights", "emb.tables.v.accumulators"}
    assert set(sd) == expected | {"dense.weight", "dense.bias"}
    assert sd["emb.step"].item() == 0
    w = sd["emb.tables.t.weights"]
    assert w.dtype == torch.float32 and w.shape == (30, 4)
    np.testing.assert_array_equal(w.numpy(), eng.embedding_tables["t"])
    # Live, as a Parameter's entry: one training step shows in the tensors already taken.
    _train(model, torch.optim.SGD(model.dense.parameters(), 0.1), _batches(1))
    np.testing.assert_array_equal(w.numpy(), eng.embedding_tables["t"])
    np.testing.assert_array_equal(
        sd["emb.tables.t.velocities"].numpy(), eng.slots("t")["velocities"]
    )
    # One storage per physical table: torch.save writes the tables' memory once.
    buf = io.BytesIO()
    torch.save(model.emb.state_dict(), buf)
    assert len(buf.getvalue()) < eng.storage_bytes + 8192
    storages = {t.untyped_storage().data_ptr() for k, t in sd.items() if ".tables." in k}
    assert len(storages) == 2


def test_int32_slots_are_copies():
    t = ee.TableConfig(10, 1, name="t", optimizer=opt.FrequencyEstimator(0.1))
    eng = ee.EmbeddingEngine({"a": ee.FeatureConfig(t)})
    layer = EmbeddingLayer(eng)
    slot = next(s for s in eng.slots("t") if eng.slots("t")[s].dtype == np.int32)
    sd = layer.state_dict()
    assert sd[f"tables.t.{slot}"].dtype == torch.int32
    layer({"a": [[3]]})["a"].sum().backward()
    assert eng.slots("t")[slot][3, 0] != sd[f"tables.t.{slot}"][3, 0].item()
    layer.load_state_dict(layer.state_dict())  # round trip of an int32 slot


def test_torch_save_round_trip_continues_training_bit_exactly(tmp_path):
    batches = list(_batches(6, seed=1))
    torch.manual_seed(0)
    straight = Model(_packed_engine(0))
    init_dense = {k: v.clone() for k, v in straight.dense.state_dict().items()}
    straight_opt = torch.optim.Adam(straight.dense.parameters(), 0.01)
    _train(straight, straight_opt, batches)

    first = Model(_packed_engine(0))
    first.dense.load_state_dict(init_dense)
    first_opt = torch.optim.Adam(first.dense.parameters(), 0.01)
    _train(first, first_opt, batches[:3])
    torch.save({"model": first.state_dict(), "opt": first_opt.state_dict()}, tmp_path / "m.pt")

    resumed = Model(_packed_engine(seed=7))  # other initial values, all replaced by the load
    saved = torch.load(tmp_path / "m.pt")
    assert resumed.load_state_dict(saved["model"]) is not None
    resumed_opt = torch.optim.Adam(resumed.dense.parameters(), 0.01)
    resumed_opt.load_state_dict(saved["opt"])
    assert resumed.emb.engine.step == 3
    for name in ("t", "u", "v"):
        np.testing.assert_array_equal(
            resumed.emb.engine.embedding_tables[name], first.emb.engine.embedding_tables[name]
        )
    _train(resumed, resumed_opt, batches[3:])
    a, b = resumed.emb.engine.state_dict(), straight.emb.engine.state_dict()
    assert a["step"] == b["step"] == 6
    for name, entries in b["tables"].items():
        for entry, array in entries.items():
            np.testing.assert_array_equal(
                a["tables"][name][entry], array, err_msg=f"{name}.{entry}"
            )
    for p, q in zip(resumed.dense.parameters(), straight.dense.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_load_state_dict_checks_everything_before_changing_anything():
    src, dst = Model(_packed_engine(0)), Model(_packed_engine(3))
    _train(src, torch.optim.SGD(src.dense.parameters(), 0.1), _batches(2))
    before = {k: v.clone() for k, v in dst.emb.state_dict().items()}

    def unchanged():
        for k, v in dst.emb.state_dict().items():
            torch.testing.assert_close(v, before[k], rtol=0, atol=0)

    good = src.state_dict()
    missing = {k: v for k, v in good.items() if k != "emb.tables.v.accumulators"}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*emb\.tables\.v\.accumulators"):
        dst.load_state_dict(missing)
    unchanged()
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*emb\.tables\.w\.weights"):
        dst.load_state_dict({**good, "emb.tables.w.weights": torch.zeros(3, 4)})
    unchanged()
    bad_shape = {**good, "emb.tables.v.weights": torch.zeros(24, 2)}
    with pytest.raises(
        RuntimeError,
        match=r"state\['tables'\]\['v'\]\['weights'\] is float32 "
        r"\[24, 2\], table 'v' holds float32 \[25, 2\]",
    ):
        dst.load_state_dict(bad_shape)
    unchanged()
    with pytest.raises(RuntimeError, match=r"state\['step'\] must be an int in \[0, 2\*\*63\)"):
        dst.load_state_dict({**good, "emb.step": torch.tensor(-1)})
    unchanged()
    # strict=False: all or nothing too (torch does not tell a module whether it is strict);
    # the missing key is reported and the engine is unchanged.
    result = dst.load_state_dict(missing, strict=False)
    assert result.missing_keys == ["emb.tables.v.accumulators"]
    unchanged()
    assert dst.emb.engine.step == 0
    dst.load_state_dict(good)
    assert dst.emb.engine.step == 2


# -- learning-rate schedulers ----------------------------------------------------------------------


def _dynamic_engine(kind="sgd"):
    mk = {"sgd": opt.SGD, "adagrad": opt.Adagrad}[kind]
    t = ee.TableConfig(
        12,
        3,
        name="t",
        combiner="sum",
        optimizer=mk(ee.DynamicLearningRate(0)),
        initializer=ee.initializers.RandomUniform(-0.5, 0.5),
    )
    u = ee.TableConfig(
        10,
        2,
        name="u",
        combiner="sum",
        optimizer=mk(ee.DynamicLearningRate(1)),
        initializer=ee.initializers.RandomUniform(-0.5, 0.5),
    )
    return ee.EmbeddingEngine({"a": ee.FeatureConfig(t), "b": ee.FeatureConfig(u)})


def _step(layer, i, **kwargs):
    rng = np.random.default_rng(i)
    a = [[int(x) for x in rng.integers(0, 12, rng.integers(1, 4))] for _ in range(3)]
    b = [[int(x) for x in rng.integers(0, 10, rng.integers(0, 3))] for _ in range(3)]
    out = layer({"a": a, "b": b}, **kwargs)
    (out["a"].pow(2).sum() + out["b"].sum()).backward()


@pytest.mark.parametrize("sched", ["step", "lambda"])
def test_torch_lr_schedulers_drive_the_tables_learning_rates(sched):
    scheduled, explicit = (
        EmbeddingLayer(_dynamic_engine("adagrad")),
        EmbeddingLayer(_dynamic_engine("adagrad")),
    )
    handle = scheduled.lr_handle(lr=[0.4, 0.2])
    assert isinstance(handle, torch.optim.Optimizer) and isinstance(handle, LearningRateHandle)
    assert [(g["tag"], g["tables"]) for g in handle.param_groups] == [(0, ["t"]), (1, ["u"])]
    if sched == "step":
        scheduler = torch.optim.lr_scheduler.StepLR(handle, step_size=2, gamma=0.5)
        expected = [[0.4 * 0.5 ** (i // 2), 0.2 * 0.5 ** (i // 2)] for i in range(5)]
    else:
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            handle, [lambda e: 1 / (e + 1), lambda e: 1.0 + e]
        )
        expected = [[0.4 / (i + 1), 0.2 * (1 + i)] for i in range(5)]
    for i in range(5):
        lrs = handle.learning_rates()
        assert lrs == pytest.approx(expected[i], rel=1e-12)
        _step(scheduled, i)
        handle.step()
        scheduler.step()
        _step(explicit, i, learning_rates=lrs)
        for name in ("t", "u"):
            np.testing.assert_array_equal(
                scheduled.engine.embedding_tables[name], explicit.engine.embedding_tables[name]
            )
    assert scheduled.engine.step == 5
    # The handle's and the scheduler's states restore the schedule in a fresh layer.
    fresh = EmbeddingLayer(_dynamic_engine("adagrad"))
    h2 = fresh.lr_handle(lr=[1.0, 1.0])
    h2.load_state_dict(handle.state_dict())
    assert h2.learning_rates() == handle.learning_rates()


def test_lr_handle_reads_the_rate_when_the_update_runs():
    layer = EmbeddingLayer(_dynamic_engine())
    handle = layer.lr_handle(lr=0.5)
    before = layer.engine.embedding_tables["t"].copy()
    out = layer({"a": [[2]], "b": [[1]]})
    handle.param_groups[0]["lr"] = 0.25  # set between forward and backward: used
    out["a"].sum().backward()
    np.testing.assert_allclose(layer.engine.embedding_tables["t"][2], before[2] - 0.25)
    # learning_rates= given to forward overrides the handle
    layer({"a": [[3]], "b": [[1]]}, learning_rates=[1.0, 1.0])["a"].sum().backward()
    np.testing.assert_allclose(layer.engine.embedding_tables["t"][3], before[3] - 1.0)
    assert layer.lr_handle() is handle
    with pytest.raises(ValueError, match="has its lr_handle already"):
        layer.lr_handle(lr=0.1)


def test_lr_handle_errors_and_callable_tags():
    with pytest.raises(ValueError, match="the engine has no dynamic learning rate"):
        EmbeddingLayer(_engine(opt.SGD(0.1))).lr_handle(lr=0.1)
    with pytest.raises(ValueError, match=r"tables \['t'\] use DynamicLearningRate\(0\).*lr="):
        EmbeddingLayer(_dynamic_engine()).lr_handle()
    with pytest.raises(ValueError, match="lr has 1 values but the engine has 2"):
        EmbeddingLayer(_dynamic_engine()).lr_handle(lr=[0.1])
    t = ee.TableConfig(
        12,
        3,
        name="t",
        combiner="sum",
        optimizer=opt.SGD(lambda step: 0.3),
        initializer=ee.initializers.Zeros(),
    )
    layer = EmbeddingLayer(ee.EmbeddingEngine({"a": ee.FeatureConfig(t)}))
    handle = layer.lr_handle()  # starts at the callable's value
    assert handle.learning_rates() == [0.3]
    scheduler = torch.optim.lr_scheduler.StepLR(handle, step_size=1, gamma=0.1)
    layer({"a": [[1]]})["a"].sum().backward()
    handle.step()
    scheduler.step()
    layer({"a": [[1]]})["a"].sum().backward()
    np.testing.assert_allclose(layer.engine.embedding_tables["t"][1], -0.3 - 0.03, rtol=1e-6)
    other = EmbeddingLayer(_dynamic_engine()).lr_handle(lr=0.1)
    with pytest.raises(ValueError, match=r"param groups are \(tag, tables\)"):
        other.load_state_dict(handle.state_dict())


# -- KeyedTensor output ----------------------------------------------------------------------------


def test_keyed_output_and_its_gradients():
    keyed, plain = (
        EmbeddingLayer(_engine(opt.SGD(0.5)), output="keyed"),
        EmbeddingLayer(_engine(opt.SGD(0.5))),
    )
    features = {"a": [[1, 2], [3], []], "b": [[4], [], [5, 5]]}
    kt, d = keyed(features), plain(features)
    assert isinstance(kt, KeyedTensor)
    assert kt.keys() == ["a", "b"] and kt.length_per_key() == [3, 2]
    assert kt.offset_per_key() == [0, 3, 5] and kt.key_dim() == 1
    assert kt.values().shape == (3, 5) and kt.values().requires_grad
    torch.testing.assert_close(kt.values(), torch.cat([d["a"], d["b"]], dim=1), rtol=0, atol=0)
    torch.testing.assert_close(kt["b"], d["b"], rtol=0, atol=0)
    assert list(kt.to_dict()) == ["a", "b"]
    torch.testing.assert_close(kt.to_dict()["a"], d["a"], rtol=0, atol=0)
    (kt["a"].sum() * 2 + kt.to_dict()["b"].pow(2).sum()).backward()
    (d["a"].sum() * 2 + d["b"].pow(2).sum()).backward()
    for name in ("t", "u"):
        np.testing.assert_array_equal(
            keyed.engine.embedding_tables[name], plain.engine.embedding_tables[name]
        )
    assert keyed.engine.step == 1
    with pytest.raises(KeyError, match="KeyedTensor has no key 'c'"):
        kt["c"]
    keyed.eval()
    assert not keyed(features).values().requires_grad


def test_keyed_output_refuses_what_a_keyed_tensor_cannot_hold():
    with pytest.raises(ValueError, match="output must be one of"):
        EmbeddingLayer(_engine(opt.SGD(0.5)), output="kt")
    layer = EmbeddingLayer(_engine(opt.SGD(0.5)), output="keyed")
    with pytest.raises(ValueError, match=r"feature 'b' has 1 samples, feature 'a' has 2"):
        layer({"a": [[1], [2]], "b": [[3]]})
    t = ee.TableConfig(12, 3, name="t")
    seq = ee.EmbeddingEngine(
        {"s": ee.FeatureConfig(t, max_sequence_length=2)}, optimizer=opt.SGD(0.1)
    )
    with pytest.raises(ValueError, match=r"feature 's' has shape \[1, 2, 3\].*output='dict'"):
        EmbeddingLayer(seq, output="keyed")({"s": [[1, 2]]})


def test_keyed_output_matches_torchrecs_keyed_tensor(trj):
    layer = EmbeddingLayer(_engine(opt.SGD(0.5)), output="keyed")
    ours = layer({"a": [[1, 2], [3]], "b": [[4], []]})
    theirs = trj.KeyedTensor.from_tensor_list(["a", "b"], [ours["a"], ours["b"]])
    assert ours.keys() == theirs.keys()
    assert ours.length_per_key() == theirs.length_per_key()
    assert ours.offset_per_key() == theirs.offset_per_key()
    assert ours.key_dim() == theirs.key_dim()
    torch.testing.assert_close(ours.values(), theirs.values(), rtol=0, atol=0)
    for key in ("a", "b"):
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0)
        torch.testing.assert_close(ours.to_dict()[key], theirs.to_dict()[key], rtol=0, atol=0)
    # TorchRec's regroup reads our KeyedTensor as its own.
    grouped = trj.KeyedTensor.regroup([ours], [["b"], ["a"]])
    torch.testing.assert_close(grouped[0], ours["b"], rtol=0, atol=0)


def test_keyed_output_has_every_method_of_torchrecs_keyed_tensor(trj):
    """Ours had no ``_key_indices``, ``regroup``, ``regroup_as_dict``, ``size_in_bytes`` nor
    ``record_stream``: TorchRec's own ``KeyedTensor.regroup`` of a group using a key twice
    (its slow path) failed on ours with "AttributeError: 'KeyedTensor' object has no
    attribute '_key_indices'". Every public method of TorchRec's class is ours too, and each
    gives what TorchRec's gives for the same values; regrouping passes gradients back."""
    public = {n for n in dir(trj.KeyedTensor) if not n.startswith("_")}
    assert public <= set(dir(KeyedTensor)), public - set(dir(KeyedTensor))
    layer = EmbeddingLayer(_engine(opt.SGD(0.5)), output="keyed")
    ours = layer({"a": [[1, 2], [3]], "b": [[4], []]})
    theirs = trj.KeyedTensor.from_tensor_list(["a", "b"], [ours["a"].detach(), ours["b"].detach()])
    assert ours._key_indices() == theirs._key_indices() == {"a": 0, "b": 1}
    assert ours.size_in_bytes() == theirs.size_in_bytes() == 2 * 5 * 4
    assert ours.device() == theirs.device()
    groups = [["b", "a"], ["a"], []]
    want = trj.KeyedTensor.regroup([theirs], groups)
    for got in (
        trj.KeyedTensor.regroup([ours], groups),  # torchrec's slow path on ours
        KeyedTensor.regroup([ours], groups),
        list(KeyedTensor.regroup_as_dict([ours], groups, ["x", "y", "z"]).values()),
        list(trj.KeyedTensor.regroup_as_dict([ours], groups, ["x", "y", "z"]).values()),
    ):
        assert len(got) == len(want) == 3
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    # a mix of ours and TorchRec's, and cat_dim as TorchRec's from_tensor_list takes it
    c = trj.KeyedTensor.from_tensor_list(["c"], [torch.ones(2, 4)], key_dim=1, cat_dim=1)
    mixed = KeyedTensor.regroup([ours, c], [["c", "a"], ["b"]])
    torch.testing.assert_close(mixed[0], torch.cat([c["c"], ours["a"]], 1), rtol=0, atol=0)
    kt = KeyedTensor.from_tensor_list(["x", "y"], [torch.ones(1, 2), torch.zeros(1, 3)], 1, 1)
    assert kt.offset_per_key() == [0, 2, 5]
    with pytest.raises(KeyError, match="key 'q' of group \\['q'\\] is in none"):
        KeyedTensor.regroup([ours], [["q"]])
    with pytest.raises(ValueError, match="2 groups and 1 keys"):
        KeyedTensor.regroup_as_dict([ours], [["a"], ["b"]], ["x"])
    (mixed[0].sum() * 3 + KeyedTensor.regroup([ours], [["a", "b"]])[0].sum()).backward()
    plain = EmbeddingLayer(_engine(opt.SGD(0.5)))
    d = plain({"a": [[1, 2], [3]], "b": [[4], []]})
    (d["a"].sum() * 4 + d["b"].sum()).backward()
    for name in ("t", "u"):
        np.testing.assert_array_equal(
            layer.engine.embedding_tables[name], plain.engine.embedding_tables[name]
        )


# -- TorchRec's configs and its pooling default ----------------------------------------------------


class _BagConfig:
    """TorchRec's EmbeddingBagConfig fields (duck type)."""

    def __init__(self, name, num_embeddings, embedding_dim, feature_names, pooling="SUM"):
        self.name, self.num_embeddings, self.embedding_dim = name, num_embeddings, embedding_dim
        self.feature_names, self.pooling = feature_names, pooling
        self.weight_init_min = self.weight_init_max = None


def test_feature_configs_from_torchrec_pool_by_sum_by_default():
    features = feature_configs_from_torchrec(
        [_BagConfig("t", 100, 4, ["a", "b"]), _BagConfig("u", 10, 2, ["c"], pooling="MEAN")],
        optimizer=opt.SGD(0.1),
    )
    assert list(features) == ["a", "b", "c"]
    assert features["a"].table is features["b"].table
    assert features["a"].table.combiner == "sum" and features["c"].table.combiner == "mean"
    assert features["a"].table.initializer == ee.initializers.RandomUniform(-0.1, 0.1)
    eng = ee.EmbeddingEngine(features)
    assert eng.table_names == ("t", "u")
    with pytest.raises(ValueError, match=r"table 'v': pooling 'NONE' has no embengine combiner"):
        feature_configs_from_torchrec([_BagConfig("v", 10, 2, ["d"], pooling="NONE")])
    with pytest.raises(ValueError, match=r"feature 'a' is in two tables"):
        feature_configs_from_torchrec(
            [_BagConfig("t", 10, 2, ["a"]), _BagConfig("u", 10, 2, ["a"])]
        )


def test_torchrec_configs_keep_init_fn_and_data_type_and_refuse_unpooled_tables(trj):
    """An init_fn is applied to the whole table, as TorchRec applies it; data_type FP16 / BF16
    make 16-bit tables; integer data types and an EmbeddingConfig (TorchRec's unpooled
    EmbeddingCollection, which became a sum-pooled bag) are refused by name."""
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig

    def rows(weight):  # in place, as torch.nn.init functions work: row r holds r
        weight.copy_(torch.arange(weight.shape[0], dtype=torch.float32)[:, None])

    tables = [
        EmbeddingBagConfig(
            num_embeddings=70_000, embedding_dim=64, name="t", feature_names=["a"], init_fn=rows
        ),
        EmbeddingBagConfig(
            num_embeddings=10,
            embedding_dim=4,
            name="h",
            feature_names=["b"],
            data_type=DataType.FP16,
        ),
        EmbeddingBagConfig(
            num_embeddings=10,
            embedding_dim=4,
            name="g",
            feature_names=["c"],
            data_type=DataType.BF16,
        ),
    ]
    eng = ee.EmbeddingEngine(feature_configs_from_torchrec(tables, opt.SGD(0.1)))
    np.testing.assert_array_equal(eng.embedding_tables["t"][:, 0], np.arange(70_000))
    assert eng.table_configs["h"].weights_dtype == "float16"
    assert eng.table_configs["g"].weights_dtype == "bfloat16"
    int8 = EmbeddingBagConfig(
        num_embeddings=10, embedding_dim=4, name="q", feature_names=["d"], data_type=DataType.INT8
    )
    with pytest.raises(ValueError, match="table 'q': data_type .* has no embengine table dtype"):
        feature_configs_from_torchrec([int8])
    unpooled = EmbeddingConfig(num_embeddings=10, embedding_dim=4, name="e", feature_names=["x"])
    with pytest.raises(ValueError, match="table 'e' is an EmbeddingConfig"):
        feature_configs_from_torchrec([unpooled])


def test_torchrecs_default_init_fn_is_read_as_its_uniform_bounds(trj):
    """TorchRec's EmbeddingBagConfig sets init_fn = partial(torch.nn.init.uniform_, a=, b=)
    when given none, so every real config went through FromFunction: the tables were torch's
    RNG draws (two engines with the same seed differed) and from_spec(engine.spec()) asked
    for the initializer back. Now it is RandomUniform of those bounds, decided by the seed."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    def tables(**bounds):
        return [
            EmbeddingBagConfig(
                num_embeddings=100, embedding_dim=4, name="t", feature_names=["a"], **bounds
            )
        ]

    assert callable(tables()[0].init_fn)  # what TorchRec sets
    features = feature_configs_from_torchrec(tables(), opt.SGD(0.1))
    assert features["a"].table.initializer == ee.initializers.RandomUniform(-0.1, 0.1)
    features = feature_configs_from_torchrec(tables(weight_init_min=-0.5, weight_init_max=0.25))
    assert features["a"].table.initializer == ee.initializers.RandomUniform(-0.5, 0.25)
    one, two = (
        ee.EmbeddingEngine(feature_configs_from_torchrec(tables(), opt.SGD(0.1)), seed=3)
        for _ in range(2)
    )
    np.testing.assert_array_equal(one.embedding_tables["t"], two.embedding_tables["t"])
    again = ee.EmbeddingEngine.from_spec(one.spec())
    np.testing.assert_array_equal(again.embedding_tables["t"], one.embedding_tables["t"])


def test_torchrec_configs_give_torchrecs_pooled_output(trj):
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    tables = [
        EmbeddingBagConfig(num_embeddings=12, embedding_dim=3, name="t", feature_names=["a"]),
        EmbeddingBagConfig(num_embeddings=10, embedding_dim=2, name="u", feature_names=["b"]),
    ]
    eng = ee.EmbeddingEngine(feature_configs_from_torchrec(tables, opt.SGD(0.1)))
    ebc = EmbeddingBagCollection(tables=tables)
    bound = (1 / 12) ** 0.5
    assert np.abs(eng.embedding_tables["t"]).max() <= bound
    with torch.no_grad():
        for name in ("t", "u"):
            ebc.embedding_bags[name].weight.copy_(torch.from_numpy(eng.embedding_tables[name]))
    kjt = trj.KeyedJaggedTensor.from_lengths_sync(
        ["a", "b"], torch.tensor([1, 2, 3, 4, 5]), torch.tensor([2, 1, 0, 2])
    )
    ours, theirs = EmbeddingLayer(eng, output="keyed")(kjt), ebc(kjt)
    torch.testing.assert_close(ours.values(), theirs.values(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bad", [True, "0.5", -1.0, float("nan")])
def test_lr_handle_refuses_a_rate_float_would_misread(bad):
    """``float`` reads True as 1.0 and parses "0.5": the handle's rates (its lr= and its
    param groups' "lr", which schedulers and users set) are checked as the engine's are, by
    name, before any update."""
    layer = EmbeddingLayer(_dynamic_engine())
    kind = TypeError if isinstance(bad, bool | str) else ValueError
    with pytest.raises(kind, match=r"lr\[1\]"):
        layer.lr_handle(lr=[0.5, bad])
    handle = layer.lr_handle(lr=0.5)
    handle.param_groups[1]["lr"] = bad
    with pytest.raises(kind, match=r"param_groups\[1\]\['lr'\] \(tag 1\)"):
        handle.learning_rates()
    before = layer.engine.embedding_tables["t"].copy()
    out = layer({"a": [[2]], "b": [[1]]})
    with pytest.raises(kind, match=r"param_groups\[1\]"):
        out["a"].sum().backward()
    assert (layer.engine.embedding_tables["t"] == before).all()


def test_lr_handle_reads_lr_as_forward_reads_learning_rates():
    """``lr="0.5"`` was read as a sequence of three characters ("lr has 3 values but the
    engine has 2 dynamic learning-rate tags"), and one value per tag as an array or a tensor,
    which ``forward(learning_rates=...)`` takes, was refused ("lr must be a number, got
    array([0.4, 0.2])"). A string is refused by name; arrays and tensors are read as lists."""
    with pytest.raises(TypeError, match="lr must be a number .* got the string '0.5'"):
        EmbeddingLayer(_dynamic_engine()).lr_handle(lr="0.5")
    for lr in (np.array([0.4, 0.2]), torch.tensor([0.4, 0.2], dtype=torch.float64)):
        assert EmbeddingLayer(_dynamic_engine()).lr_handle(lr=lr).learning_rates() == [0.4, 0.2]
    for one in (np.float64(0.3), np.array(0.3), torch.tensor(0.3, dtype=torch.float64)):
        assert EmbeddingLayer(_dynamic_engine()).lr_handle(lr=one).learning_rates() == [0.3, 0.3]
    with pytest.raises(ValueError, match="lr has 3 values but the engine has 2"):
        EmbeddingLayer(_dynamic_engine()).lr_handle(lr=np.array([0.1, 0.2, 0.3]))
    with pytest.raises(ValueError, match=r"lr must be one number, or one per tag \(a 1-D"):
        EmbeddingLayer(_dynamic_engine()).lr_handle(lr=np.ones((2, 1)))
    with pytest.raises(ValueError, match=r"lr\[1\] must be a finite number >= 0, got -0.2"):
        EmbeddingLayer(_dynamic_engine()).lr_handle(lr=torch.tensor([0.4, -0.2]))


def test_a_torchrec_virtual_table_becomes_a_keyed_table(trj):
    """``use_virtual_table=True`` is TorchRec's table over an id space like 2^50 whose rows are
    made as ids train. It was ported as a dense table of num_embeddings rows: the engine's
    allocation failed ("MemoryError: Unable to allocate 16.0 PiB"). Now it is a keyed table
    (rows made as ids train, TorchRec's uniform bounds); an eviction policy, which has no
    mapping, is refused by name."""
    from torchrec.modules.embedding_configs import CountBasedEvictionPolicy, EmbeddingBagConfig

    def tables(**kw):
        return [
            EmbeddingBagConfig(
                num_embeddings=2**50, embedding_dim=4, name="v", feature_names=["a"], **kw
            ),
            EmbeddingBagConfig(num_embeddings=12, embedding_dim=2, name="t", feature_names=["b"]),
        ]

    features = feature_configs_from_torchrec(tables(use_virtual_table=True), opt.SGD(0.5))
    v = features["a"].table
    assert v.keyed and v.dynamic == ee.DynamicVocabulary() and v.combiner == "sum"
    assert not features["b"].table.keyed  # not a virtual table: dense, as before
    layer = EmbeddingLayer(ee.EmbeddingEngine(features))
    ids = [[2**49 + 3, 7], [2**50 - 1]]
    out = layer({"a": ids, "b": [[1], [2]]})
    out["a"].sum().backward()
    assert layer.engine.table_contents("v")["keys"].tolist() == [7, 2**49 + 3, 2**50 - 1]
    assert "tables.v.keys" in layer.state_dict()
    with pytest.raises(ValueError, match="table 'v': virtual_table_eviction_policy .* has no"):
        feature_configs_from_torchrec(
            tables(use_virtual_table=True, virtual_table_eviction_policy=CountBasedEvictionPolicy())
        )


def test_torchrec_jagged_tensors_are_read_as_the_kjt_they_come_from(trj):
    """``kjt.to_dict()`` and ``{k: kjt[k]}`` give TorchRec JaggedTensors, which this page's
    own advice builds KJTs from: a dict of them was refused with "feature 'a': ids must be
    integers, got dtype object". Each is read as a Ragged of its values, offsets and weights
    and looks up (and trains) as the KJT does; their errors name the feature."""
    kjt = trj.KeyedJaggedTensor.from_lengths_sync(
        ["b", "a"],
        torch.tensor([1, 2, 3, 4, 5, 6]),
        torch.tensor([2, 0, 1, 1, 1, 1]),
        weights=torch.tensor([1.0, 0.5, 2.0, 1.0, 3.0, 0.25]),
    )
    a, b = EmbeddingLayer(_engine(opt.SGD(0.5))), EmbeddingLayer(_engine(opt.SGD(0.5)))
    out, want = a(kjt.to_dict()), b(kjt)
    for name in ("a", "b"):
        torch.testing.assert_close(out[name], want[name], rtol=0, atol=0)
    (out["a"].sum() + out["b"].pow(2).sum()).backward()
    (want["a"].sum() + want["b"].pow(2).sum()).backward()
    for name in ("t", "u"):
        np.testing.assert_array_equal(
            a.engine.embedding_tables[name], b.engine.embedding_tables[name]
        )
    bad = trj.JaggedTensor(values=torch.tensor([1, 40]), lengths=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="feature 'a': id 40 at sample 1"):
        a({"a": bad, "b": kjt["b"]})
    grad = trj.JaggedTensor(
        values=torch.tensor([1, 2]),
        lengths=torch.tensor([1, 1]),
        weights=torch.tensor([1.0, 2.0], requires_grad=True),
    )
    with pytest.raises(ValueError, match=r"feature 'a': \(a JaggedTensor\) weights require grad"):
        a({"a": grad, "b": kjt["b"]})
    assert a.engine.step == 1


def test_a_kjt_s_offsets_lengths_and_stride_must_agree(trj):
    """Only a TorchRec KJT's ``lengths()`` were read: one holding offsets that disagree with
    its lengths (or offsets from 1, whose differences are valid lengths) was looked up by the
    lengths, silently, where TorchRec reads offsets too; its ``stride()`` was not compared
    (TorchRec's EBC fails: "shape '[2, 2]' is invalid for input of size 6"); an offsets-only
    KJT's bad offsets were named as the lengths TorchRec computed from them. A JaggedTensor
    likewise; ``JaggedTensor.empty()`` (empty offsets) was refused, and is no samples."""
    kjt, jt = trj.KeyedJaggedTensor, trj.JaggedTensor
    layer = EmbeddingLayer(_engine(opt.SGD(0.5)))
    v, lengths = torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([2, 0, 1, 1, 1, 1])
    good = torch.tensor([0, 2, 2, 3, 4, 5, 6])
    want = layer.eval()(kjt(["a", "b"], v, lengths=lengths))
    for same in (
        kjt(["a", "b"], v, offsets=good),
        kjt(["a", "b"], v, lengths=lengths, offsets=good),
    ):
        got = layer(same)
        for key in ("a", "b"):
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
    cases = [
        (
            kjt(["a", "b"], v, lengths=lengths, offsets=torch.tensor([0, 1, 2, 3, 4, 5, 6])),
            r"key 'a', sample 0: offsets\[1\]=1 but its lengths give 2; a KJT's offsets and",
        ),
        (kjt(["a", "b"], v, offsets=torch.tensor([1, 3, 3, 4, 5, 6, 7])), r"offsets\[0\]=1 must"),
        (
            kjt(["a", "b"], v, offsets=torch.tensor([0, 3, 2, 3, 4, 5, 6])),
            r"key 'a', sample 1: offsets\[2\]=2 is less than offsets\[1\]=3",
        ),
        (kjt(["a", "b"], v, offsets=torch.tensor([0, 2, 2, 3, 4, 5, 5])), "offsets end at 5"),
        (kjt(["a", "b"], v, lengths=lengths, stride=2), r"stride\(\) is 2 but its 6 lengths"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            layer(bad)
    b = jt(values=v[:3], lengths=torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match=r"feature 'a': \(a JaggedTensor\) offsets\[1\]=1 but"):
        layer({"a": jt(v[:3], lengths=lengths[:3], offsets=torch.tensor([0, 1, 2, 3])), "b": b})
    with pytest.raises(ValueError, match=r"'a': \(a JaggedTensor\) offsets\[0\]=1 must be 0"):
        layer({"a": jt(v[:3], offsets=torch.tensor([1, 2, 2, 3])), "b": b})
    empty = layer({"a": jt.empty(), "b": jt.empty()})
    assert empty["a"].shape == (0, 3) and empty["b"].shape == (0, 2)


def test_keyed_output_refuses_jagged_tensors_of_two_batch_sizes_before_the_lookup(trj):
    """output='keyed' counts each feature's samples before the training lookup, so that two
    batch sizes are refused with nothing changed; a JaggedTensor's were not counted, and the
    refusal came after the lookup had inserted a keyed table's keys [1, 2, 3, 4, 5]."""
    t = ee.TableConfig(None, 8, name="k", combiner="sum", dynamic=ee.DynamicVocabulary())
    eng = ee.EmbeddingEngine(
        {"f": ee.FeatureConfig(t), "g": ee.FeatureConfig(t)}, optimizer=opt.Adagrad(0.1)
    )
    layer = EmbeddingLayer(eng, output="keyed")
    f = trj.JaggedTensor(values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1]))
    g = trj.JaggedTensor(values=torch.tensor([4, 5]), offsets=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="one batch size; feature 'g' has 2 samples, feature"):
        layer({"f": f, "g": g})
    assert eng.table_contents("k")["keys"].tolist() == []
    g = trj.JaggedTensor(values=torch.tensor([4, 5]), lengths=torch.tensor([1, 0, 1]))
    layer({"f": f, "g": g}).values().sum().backward()
    assert eng.step == 1 and eng.table_contents("k")["keys"].tolist() == [1, 2, 3, 4, 5]


def test_a_kjt_as_one_feature_s_ids_is_refused_saying_what_to_pass(trj):
    """``{"a": kjt}`` (a KJT where one feature's ids go) was refused as "feature 'a': ids
    must be integers, got dtype object", which says neither what came nor what to pass."""
    layer = EmbeddingLayer(_engine(opt.SGD(0.5)))
    kjt = trj.KeyedJaggedTensor(["a"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    ours = KeyedJagged(["a"], [1, 2], lengths=[1, 1])
    for value, name in ((kjt, "KeyedJaggedTensor"), (ours, "KeyedJagged")):
        with pytest.raises(TypeError, match=f"feature 'a': ids are a {name} .*kjt\\[key\\]"):
            layer({"a": value, "b": [3, 4]})
    torch.testing.assert_close(
        layer.eval()({"a": kjt["a"], "b": [3, 4]})["a"], layer({"a": [1, 2], "b": [3, 4]})["a"]
    )


def test_a_kjt_s_length_and_offset_per_key_must_agree_with_its_lengths(trj):
    """TorchRec splits a KJT's values by its ``length_per_key`` (given, or kept from an
    earlier call); the keys were split here by the lengths, so a KJT built with
    ``length_per_key=[2, 4]`` for lengths adding up to [3, 3] gave key 'a' ids [1, 2, 3]
    where TorchRec's ``to_dict()`` gives [1, 2], silently. It is refused, naming both."""
    kjt = trj.KeyedJaggedTensor
    layer = EmbeddingLayer(_engine(opt.SGD(0.5))).eval()
    v, lengths = torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([2, 0, 1, 1, 1, 1])
    with pytest.raises(ValueError, match=r"length_per_key is \[2, 4\] but its lengths give \[3, 3"):
        layer(kjt(["a", "b"], v, lengths=lengths, length_per_key=[2, 4]))
    with pytest.raises(ValueError, match=r"offset_per_key is \[0, 2, 6\] but its lengths give"):
        layer(kjt(["a", "b"], v, lengths=lengths, offset_per_key=[0, 2, 6]))
    want = layer(kjt(["a", "b"], v, lengths=lengths))
    agreeing = kjt(["a", "b"], v, lengths=lengths, length_per_key=[3, 3], offset_per_key=[0, 3, 6])
    used = kjt(["a", "b"], v, lengths=lengths)
    used.to_dict()  # TorchRec keeps the length_per_key it computed
    for same in (agreeing, used):
        got = layer(same)
        for key in ("a", "b"):
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)


def test_a_kjt_s_cached_jt_dict_and_index_per_key_must_agree_with_it(trj):
    """TorchRec's EmbeddingBagCollection reads a KJT's ``to_dict()``, which returns its
    ``_jt_dict`` when it holds one (given to the constructor, or kept from an earlier call),
    and ``kjt[key]`` picks a key by its ``_index_per_key`` and ``_lengths_offset_per_key``.
    None was checked: ``jt_dict=`` another batch's dict gave TorchRec key 'a' ids [7, 8, 9]
    and us [1, 2, 3], ``index_per_key={"a": 1, "b": 0}`` gave ``kjt["a"]`` key 'b''s ids,
    silently. They are refused, naming the key and the first difference."""
    kjt, jt = trj.KeyedJaggedTensor, trj.JaggedTensor
    layer = EmbeddingLayer(_engine(opt.SGD(0.5))).eval()
    v, lengths = torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([2, 0, 1, 1, 1, 1])
    w = torch.tensor([0.5, 1.0, 2.0, 3.0, 4.0, 5.0])
    other = kjt(["a", "b"], torch.tensor([1, 2, 9, 4, 5, 6]), lengths=lengths).to_dict()
    assert kjt(["a", "b"], v, lengths=lengths, jt_dict=other).to_dict()["a"].values()[2] == 9
    shifted = kjt(["a", "b"], v, lengths=torch.tensor([1, 1, 1, 1, 1, 1])).to_dict()
    weighted = kjt(["a", "b"], v, weights=w, lengths=lengths)
    w2 = w.clone()
    w2[4] = -4.0
    two, b = torch.tensor([2, 0]), other["b"]
    cases = [
        (
            kjt(["a", "b"], v, lengths=lengths, jt_dict=other),
            r"key 'a': its cached to_dict\(\)\['a'\] \(jt_dict\) has id 9 at sample 2, position 0 "
            r"but its values give 3",
        ),
        (
            kjt(["a", "b"], v, lengths=lengths, jt_dict=shifted),
            r"key 'a': .* has length 1 at sample 0 but its lengths give 2",
        ),
        (
            kjt(["a", "b"], v, lengths=lengths, jt_dict={"a": other["a"]}),
            r"jt_dict \(its cached to_dict\(\)\) has keys \['a'\] but the KJT has keys",
        ),
        (
            kjt(["a", "b"], v, lengths=lengths, jt_dict=weighted.to_dict()),
            r"key 'a': .*: the cache has weights and the KJT has none",
        ),
        (
            kjt(["a", "b"], v, weights=w2, lengths=lengths, jt_dict=weighted.to_dict()),
            r"key 'b': .* has weight 4.0 at sample 1, position 0 but its weights give -4.0",
        ),
        (
            kjt(["a", "b"], v, lengths=lengths, jt_dict={"a": jt(v[:2], lengths=two), "b": b}),
            r"key 'a': .* has 2 samples but its lengths give 3",
        ),
        (
            kjt(["a", "b"], v, lengths=lengths, index_per_key={"a": 1, "b": 0}),
            r"index_per_key is \{'a': 1, 'b': 0\} but its keys give \{'a': 0, 'b': 1\}",
        ),
        (
            kjt(["a", "b"], v, lengths=lengths, lengths_offset_per_key=[0, 2, 6]),
            r"lengths_offset_per_key is \[0, 2, 6\] but its lengths give \[0, 3, 6\]",
        ),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            layer(bad)
    want = layer(kjt(["a", "b"], v, lengths=lengths))
    used = kjt(["a", "b"], v, lengths=lengths)
    used.to_dict(), used["a"]  # TorchRec keeps its jt_dict, index_per_key, lengths_offset_per_key
    assert used._jt_dict is not None and used._index_per_key is not None
    given = kjt(
        ["a", "b"],
        v,
        lengths=lengths,
        jt_dict=kjt(["a", "b"], v, lengths=lengths).to_dict(),
        index_per_key={"b": 1, "a": 0},
        lengths_offset_per_key=[0, 3, 6],
    )
    for same in (used, given):
        got = layer(same)
        for key in ("a", "b"):
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
    # a weighted VBE KJT's cache holds each key's own samples (compared before the expansion)
    want = layer(_vbe("torchrec", True, trj))
    vbe = _vbe("torchrec", True, trj)
    vbe.to_dict()
    got = layer(vbe)
    for key in ("a", "b"):
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
    vbe._jt_dict["b"] = jt(vbe._jt_dict["b"].values(), lengths=vbe._jt_dict["b"].lengths())
    with pytest.raises(ValueError, match=r"key 'b': .*: the KJT has weights and the cache has"):
        layer(vbe)


def test_a_kjt_s_integer_weights_float32_cannot_hold_are_refused_naming_key_and_sample(trj):
    """Integer weights past 2**24 rounded silently in the cast to float32 (TorchRec's EBC
    refuses integer weights outright); refused, named by key, sample and position, as a
    float64 weight past float32's range now is too (it was named "KeyedJagged weights[3]")."""
    rounds = 2**24 + 1
    v, lengths = torch.tensor([1, 2, 3, 4]), torch.tensor([1, 1, 2, 0])
    at = r"integer -16777217 at key 'b', sample 0, position 1 \(weights\[3\]\) would round"
    for w in ([1, 1, 1, -rounds], torch.tensor([1, 1, 1, -rounds])):
        with pytest.raises(ValueError, match=at):
            KeyedJagged(["a", "b"], v, lengths=lengths, weights=w)
    w = torch.tensor([1, 1, 1, -rounds])
    with pytest.raises(ValueError, match=at):
        keyed_jagged_to_features(trj.KeyedJaggedTensor(["a", "b"], v, w, lengths=lengths))
    w = torch.tensor([1.0, 1e39, 1.0, 1.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"1e\+39 at key 'a', sample 1, position 0 \(weights"):
        keyed_jagged_to_features(trj.KeyedJaggedTensor(["a", "b"], v, w, lengths=lengths))
    exact = torch.tensor([2**24, -(2**25), 3 * 2**40, 7])
    got = keyed_jagged_to_features(trj.KeyedJaggedTensor(["a", "b"], v, exact, lengths=lengths))
    assert got["b"].weights.tolist() == [3 * 2**40, 7]


def test_a_kjt_s_stride_per_key_must_agree_with_its_lengths(trj):
    """A KJT without a variable batch per key returns the ``stride_per_key`` it was built
    with, unchecked. TorchRec's unsharded modules do not read it there, but its sharded
    EmbeddingBagCollection's input dist sends each rank the lengths by it (``dist_splits``):
    ``[2, 4]`` for 3 samples a key failed there ("shape '[-1, 3]' is invalid"), or crashed the
    process. It was not compared here; a VBE KJT's ``stride_per_key`` (which ``to_dict()``
    splits by) against its ``stride_per_key_per_rank`` (which ``split()`` splits by) neither;
    a uniform KJT's ``stride()`` was not compared when it carried inverse indices, where
    TorchRec's to_dict() still views the lengths by it. All refused, naming both."""
    kjt = trj.KeyedJaggedTensor
    layer = EmbeddingLayer(_engine(opt.SGD(0.5))).eval()
    v, lengths = torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([2, 0, 1, 1, 1, 1])
    want = layer(kjt(["a", "b"], v, lengths=lengths))
    bad = kjt(["a", "b"], v, lengths=lengths, stride_per_key=[2, 4])
    assert not bad.variable_stride_per_key() and bad.stride_per_key() == [2, 4]
    assert bad.dist_splits([1, 1])[0] == [2, 4]  # the lengths the sharded input dist sends
    with pytest.raises(
        ValueError,
        match=r"stride_per_key\(\) is \[2, 4\] but its 6 lengths for 2 keys give \[3, 3\] .*"
        r"variable_stride_per_key\(\) is False",
    ):
        layer(bad)
    with pytest.raises(ValueError, match=r"stride_per_key\(\) is \[1, 5\] but"):
        layer(kjt(["a", "b"], v, lengths=lengths, stride_per_key=[1, 5]))
    # stride_per_key_per_rank of a KJT told it has no variable batch: read as its stride
    told = kjt(["a", "b"], v, lengths=lengths, stride_per_key_per_rank=[[1], [5]])
    told._variable_stride_per_key = False  # TorchRec's legacy switch
    with pytest.raises(ValueError, match=r"stride\(\) is 5 but its 6 lengths"):
        layer(told)
    identity = (["a", "b"], torch.tensor([[0, 1, 2], [0, 1, 2]]))
    with pytest.raises(ValueError, match=r"stride\(\) is 4 but its 6 lengths"):
        layer(kjt(["a", "b"], v, lengths=lengths, stride=4, inverse_indices=identity))
    # a VBE KJT: stride_per_key [3, 2] given, its stride_per_key_per_rank adds up to [2, 3]
    vbe = VBE
    inv = (["a", "b"], torch.tensor([[0, 1, 1, 0], [1, 1, 0, 1]]))

    def mixed():
        return kjt(
            ["a", "b"],
            torch.tensor(vbe["values"]),
            lengths=torch.tensor(vbe["lengths"]),
            stride_per_key_per_rank=[[2], [3]],
            stride_per_key=[3, 2],
            inverse_indices=inv,
        )

    assert mixed().to_dict()["a"].lengths().tolist() == [1, 2, 1]
    with pytest.raises(RuntimeError, match="split_with_sizes"):
        [part.to_dict() for part in mixed().split([1, 1])]
    with pytest.raises(
        ValueError,
        match=r"stride_per_key\(\) is \[3, 2\] but its stride_per_key_per_rank "
        r"\[\[2\], \[3\]\] adds up to \[2, 3\]",
    ):
        layer(mixed())
    # agreeing numbers read as before
    for same in (
        kjt(["a", "b"], v, lengths=lengths, stride_per_key=[3, 3]),
        kjt(["a", "b"], v, lengths=lengths, stride=3, inverse_indices=identity),
    ):
        got = layer(same)
        for key in ("a", "b"):
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
    two_ranks = kjt(
        ["a", "b"],
        torch.tensor(vbe["values"]),
        lengths=torch.tensor(vbe["lengths"]),
        stride_per_key_per_rank=[[1, 1], [2, 1]],
        stride_per_key=[2, 3],
        inverse_indices=inv,
    )
    assert layer(two_ranks)["a"].shape == (4, 3)


@pytest.mark.parametrize(("pooling", "weighted"), [("sum", False), ("mean", False), ("sum", True)])
def test_inverse_indices_on_a_kjt_without_a_variable_batch_are_refused(trj, pooling, weighted):
    """TorchRec's EmbeddingBagCollection expands its outputs by a KJT's inverse indices
    whether or not the KJT has a variable batch per key; its sharded EmbeddingBagCollection
    expands only a variable batch (the EmbeddingCollection none): the same KJT gave the EBC 4
    samples and the sharded EBC (DistributedModelParallel, one rank) 3. We expanded it,
    silently picking one. Refused unless the indices are the identity (every module serves
    the same batch); the same batch as a VBE KJT is what both EBCs expand, and gives the
    EBC's outputs."""
    eng = _engine(opt.SGD(0.5), combiner=pooling)
    ebc = _ebc(trj, eng, pooling, weighted)
    layer = EmbeddingLayer(eng, output="keyed").eval()
    v, lengths = torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([2, 0, 1, 1, 1, 1])
    w = torch.tensor([0.5, 1.0, 2.0, 3.0, 4.0, 5.0]) if weighted else None
    inv = (["b", "a"], torch.tensor([[2, 2, 0, 1], [0, 1, 1, 2]]))

    def kjt(**kw):
        return trj.KeyedJaggedTensor(["a", "b"], v, weights=w, lengths=lengths, **kw)

    assert not kjt(inverse_indices=inv).variable_stride_per_key()
    expanded = ebc(kjt(inverse_indices=inv))  # the EBC expands it: 4 samples
    assert expanded.values().shape == (4, 5)
    message = (
        r"KeyedJagged has inverse_indices \(a batch of 4 samples\) but no variable batch per "
        r"key \(each of its 2 keys has 3 samples.*stride_per_key_per_rank=\[\[3\], \[3\]\]"
    )
    with pytest.raises(ValueError, match=message):
        layer(kjt(inverse_indices=inv))
    with pytest.raises(ValueError, match=message):
        KeyedJagged(["a", "b"], v, lengths=lengths, weights=w, inverse_indices=inv)
    identity = (["a", "b"], torch.tensor([[0, 1, 2], [0, 1, 2]]))
    for same, theirs in (
        (kjt(stride_per_key_per_rank=[[3], [3]], inverse_indices=inv), expanded),  # VBE form
        (
            KeyedJagged(
                ["a", "b"],
                v,
                lengths=lengths,
                weights=w,
                stride_per_key=[3, 3],
                inverse_indices=inv,
            ),
            expanded,
        ),
        (kjt(inverse_indices=identity), ebc(kjt())),
    ):
        ours = layer(same)
        assert ours.keys() == theirs.keys()
        torch.testing.assert_close(ours.values(), theirs.values(), rtol=1e-6, atol=1e-7)


def test_what_we_read_of_a_torchrec_kjt_exists_and_means_what_we_assume(trj):
    """keyed_jagged_to_features reads a KJT's optional methods and private caches where present
    (``TORCHREC_KJT_READS``): one torchrec renamed would read as not held and its check would
    be skipped, silently. Each is asserted here on a real KJT: that it exists, and that it is
    what the check takes it for (a cache given to the constructor is that object, and is what
    TorchRec's to_dict() / kjt[key] then read); and every name keyed_jagged.py reads of a KJT
    is in the list."""
    import inspect
    import re

    from embengine import keyed_jagged

    KJT, JT = trj.KeyedJaggedTensor, trj.JaggedTensor
    keys, v = ["a", "b"], torch.tensor([1, 2, 3, 4, 5, 6])
    lengths, offsets = torch.tensor([2, 0, 1, 1, 1, 1]), torch.tensor([0, 2, 2, 3, 4, 5, 6])
    w = torch.tensor([0.5, 1.0, 2.0, 3.0, 4.0, 5.0])

    def fresh(**kw):
        return KJT(keys, v, lengths=lengths, **kw)

    def lengths_or_none():
        assert fresh().lengths_or_none() is lengths
        assert KJT(keys, v, offsets=offsets).lengths_or_none() is None

    def offsets_or_none():
        assert KJT(keys, v, offsets=offsets).offsets_or_none() is offsets
        assert fresh().offsets_or_none() is None

    def weights_or_none():
        assert fresh(weights=w).weights_or_none() is w and fresh().weights_or_none() is None

    def variable_stride_per_key():
        assert fresh().variable_stride_per_key() is False
        assert fresh(stride_per_key_per_rank=[[2], [4]]).variable_stride_per_key() is True

    def stride_per_key():  # returned as given, even where it disagrees
        assert fresh(stride_per_key=[2, 4]).stride_per_key() == [2, 4]
        assert fresh().stride_per_key() == [3, 3]
        assert fresh(stride_per_key_per_rank=[[1, 1], [4, 0]]).stride_per_key() == [2, 4]

    def stride_per_key_per_rank():
        assert fresh().stride_per_key_per_rank() == []
        assert fresh(stride_per_key_per_rank=[[1, 1], [4, 0]]).stride_per_key_per_rank() == [
            [1, 1],
            [4, 0],
        ]

    def inverse_indices_or_none():
        inv = (keys, torch.tensor([[0, 1], [1, 0]]))
        assert fresh(inverse_indices=inv).inverse_indices_or_none() is inv
        assert fresh().inverse_indices_or_none() is None

    def stride():  # returned as given
        assert fresh(stride=4).stride() == 4 and fresh().stride() == 3

    def length_per_key_or_none():
        assert fresh().length_per_key_or_none() is None
        assert fresh(length_per_key=[2, 4]).length_per_key_or_none() == [2, 4]
        used = fresh()
        used.to_dict()
        assert used.length_per_key_or_none() == [3, 3]

    def offset_per_key_or_none():
        assert fresh().offset_per_key_or_none() is None
        assert fresh(offset_per_key=[0, 2, 6]).offset_per_key_or_none() == [0, 2, 6]

    def _jt_dict():
        assert "_jt_dict" in vars(fresh()) and fresh()._jt_dict is None
        other = KJT(keys, torch.tensor([9, 8, 7, 6, 5, 4]), lengths=lengths).to_dict()
        given = fresh(jt_dict=other)
        assert given._jt_dict is other and given.to_dict() is other  # what the EBC reads
        used = fresh()
        assert used.to_dict() is used._jt_dict

    def _index_per_key():
        assert "_index_per_key" in vars(fresh()) and fresh()._index_per_key is None
        swapped = {"a": 1, "b": 0}
        given = fresh(index_per_key=swapped)
        assert given._index_per_key is swapped
        assert given["a"].values().tolist() == [4, 5, 6]  # kjt[key] picks by it
        used = fresh()
        used["a"]
        assert used._index_per_key == {"a": 0, "b": 1}

    def _lengths_offset_per_key():
        assert "_lengths_offset_per_key" in vars(fresh())
        assert fresh()._lengths_offset_per_key is None
        given = fresh(lengths_offset_per_key=[0, 2, 6])
        assert given._lengths_offset_per_key == [0, 2, 6]
        assert given["b"].lengths().tolist() == [1, 1, 1, 1]  # kjt[key] picks by it
        used = fresh()
        used["a"]
        assert used._lengths_offset_per_key == [0, 3, 6]

    checks = {
        f.__name__: f
        for f in (
            lengths_or_none,
            offsets_or_none,
            weights_or_none,
            variable_stride_per_key,
            stride_per_key,
            stride_per_key_per_rank,
            inverse_indices_or_none,
            stride,
            length_per_key_or_none,
            offset_per_key_or_none,
            _jt_dict,
            _index_per_key,
            _lengths_offset_per_key,
        )
    }
    assert sorted(checks) == sorted(keyed_jagged.TORCHREC_KJT_READS)
    for name, check in checks.items():
        assert hasattr(KJT, name) or name in vars(fresh()), name
        check()
    # every name keyed_jagged.py reads of a KJT (kjt.x(), _optional(kjt, "x"),
    # getattr(kjt, "x")) is listed, or one added later would go unasserted
    src = inspect.getsource(keyed_jagged)
    read = set(re.findall(r"\bkjt\.(\w+)", src))
    read |= set(re.findall(r"(?:_optional|getattr)\(kjt, \"(\w+)\"", src))
    assert read - {"keys", "values", "lengths"} == set(keyed_jagged.TORCHREC_KJT_READS)
    # a JaggedTensor's (inputs._from_jagged): the same *_or_none methods
    jt = JT(values=v[:3], lengths=lengths[:3])
    assert jt.lengths_or_none() is not None and jt.offsets_or_none() is None
    assert JT(values=v[:3], offsets=offsets[:4]).offsets_or_none() is not None
    assert JT(values=v[:3], lengths=lengths[:3], weights=w[:3]).weights_or_none() is not None


def test_torchrec_config_fields_without_a_mapping_are_refused_by_name(trj):
    """A field of TorchRec's EmbeddingBagConfig embengine does not read, set away from its
    default, was dropped silently: the table trained as if it were not set. Every field of the
    real dataclass is either read, without effect (need_pos), or refused when set; a field a
    later torchrec adds is refused until mapped (it fails this test's first assertion)."""
    import dataclasses

    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    from embengine.torch import porting

    fields = {f.name for f in dataclasses.fields(EmbeddingBagConfig)}
    unmapped = fields - porting._READ - porting._NO_EFFECT
    assert unmapped == {
        "num_embeddings_post_pruning",
        "input_dim",
        "total_num_buckets",
        "enable_embedding_update",
        "stash_weights",
    }

    def config(**extra):
        return EmbeddingBagConfig(
            num_embeddings=10, embedding_dim=4, name="t", feature_names=["a"], **extra
        )

    set_to = {
        "num_embeddings_post_pruning": 5,
        "input_dim": 1000,
        "total_num_buckets": 4,
        "enable_embedding_update": True,
        "stash_weights": True,
    }
    for name, value in set_to.items():
        with pytest.raises(
            ValueError,
            match=rf"table 't': EmbeddingBagConfig\.{name} = {value!r} has no embengine mapping",
        ):
            feature_configs_from_torchrec([config(**{name: value})], opt.SGD(0.1))
    # at their defaults, and need_pos set, the table is built as before
    features = feature_configs_from_torchrec([config(need_pos=True)], opt.SGD(0.1))
    assert features["a"].table.vocabulary_size == 10
    # an object with the fields but no dataclass (a duck type) is read as before
    assert feature_configs_from_torchrec([_BagConfig("d", 10, 2, ["d"])], opt.SGD(0.1))
