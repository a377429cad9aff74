"""The training job: the ``embengine train`` command, resuming, the torch baseline and the
EmbeddingLayer contract it relies on."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import embengine as ee
from embengine import cli
from embengine import optimizers as opt
from embengine.torch import EmbeddingLayer, KeyedJagged
from embengine.training.loop import ENGINE_OPTIMIZERS, TrainConfig, train
from embengine.training.models import MODELS
from embengine.training.sources import DATASETS

# Small and fast: 26 vocabularies of at most 1000 rows, 5000 examples an epoch.
SYN_ARGS = [
    "--dataset",
    "synthetic",
    "--batch-size",
    "256",
    "--epoch-examples",
    "5000",
    "--test-examples",
    "5000",
    "--vocabulary-scale",
    "0.01",
    "--no-progress",
]
SYN = {"examples_per_epoch": 2048, "test_examples": 2048, "vocabulary_scale": 0.01}


def _quiet(_msg: str) -> None:
    pass


def _cfg(**kw) -> TrainConfig:
    base = dict(
        dataset="synthetic", model="dlrm", batch_size=256, dim=8, progress=False, synthetic=SYN
    )
    base.update(kw)
    return TrainConfig(**base)


def _final_auc(stdout: str) -> float:
    found = re.findall(r"^test AUC (\d\.\d+)", stdout, flags=re.M)
    assert found, stdout
    return float(found[-1])


# -- the command line ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, bad, valid",
    [
        ("--dataset", "criteo", list(DATASETS)),
        ("--model", "wide_deep", list(MODELS)),
        ("--optimizer", "adamw", list(ENGINE_OPTIMIZERS)),
        ("--embeddings", "jax", ["engine", "torch"]),
    ],
)
def test_cli_unknown_name_exits_2_listing_valid_names(capsys, flag, bad, valid):
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", flag, bad, *SYN_ARGS])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert bad in err
    for name in valid:
        assert name in err, (name, err)


def test_cli_resume_needs_checkpoint_dir(capsys):
    assert cli.main(["train", *SYN_ARGS, "--steps", "1", "--resume"]) == 2
    out = capsys.readouterr()
    assert "--resume" in out.err and "--checkpoint-dir" in out.err
    assert "test AUC" not in out.out  # nothing was trained


def test_cli_epochs_and_steps_are_exclusive(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", *SYN_ARGS, "--steps", "3", "--epochs", "2"])
    assert exc.value.code == 2


def test_cli_vocabulary_above_10_to_the_8_is_an_error(capsys):
    assert (
        cli.main(
            [
                "train",
                *SYN_ARGS[:-3],
                "--vocabulary-scale",
                "20000",
                "--no-progress",
                "--steps",
                "1",
            ]
        )
        == 2
    )
    assert "10^8" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--plot", "out.txt"], "unknown image format 'txt'"),
        (["--plot", "nodir/x.png"], "folder nodir does not exist"),
        (["--keep", "0"], "--keep must be >= 1, got 0"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--lr", "0"], "--lr must be > 0, got 0.0"),
        (["--lr", "nan"], "--lr must be > 0, got nan"),
        (["--dense-lr", "-1"], "--dense-lr must be > 0, got -1.0"),
        (["--patience", "-1"], "--patience must be >= 0"),
        (["--epochs", "0"], "--epochs must be >= 1, got 0"),
        (["--epoch-examples", "0"], "--epoch-examples must be >= 1, got 0"),
        (["--vocabulary-scale", "0"], "--vocabulary-scale must be > 0"),
        (["--baseline", "--embeddings", "torch", "--optimizer", "sgd"], "--baseline"),
        (["--nproc-per-node", "0"], "--nproc-per-node must be an int >= 1, got 0"),
        (
            ["--vocabulary", "dynamic", "--embeddings", "torch", "--optimizer", "sgd"],
            "--vocabulary dynamic makes the engine's keyed tables",
        ),
        (["--max-restarts", "1"], "--max-restarts restarts the ranks: give --nproc-per-node"),
        (["--nproc-per-node", "2", "--max-restarts", "1"], "--max-restarts without --resume"),
        (["--nproc-per-node", "2", "--max-restarts", "-1"], "--max-restarts must be an int >= 0"),
        (
            ["--nproc-per-node", "2", "--embeddings", "torch", "--optimizer", "sgd"],
            "--embeddings torch runs in one process",
        ),
        (["--nproc-per-node", "2", "--baseline"], "--baseline runs in one process"),
        (["--nproc-per-node", "300"], "--batch-size 256 is smaller than the 300 ranks"),
        (["--sharding", "table"], "--sharding table shards the tables over ranks; this run"),
        (
            ["--nproc-per-node", "2", "--sharding", "auto", "--vocabulary", "dynamic"],
            "--sharding auto: --vocabulary dynamic makes keyed tables",
        ),
    ],
)
def test_cli_checks_every_option_before_any_work(capsys, monkeypatch, tmp_path, args, message):
    """A bad option is an error naming it before the job reads data or trains a step."""
    import embengine.training.loop as loop

    def no_work(*a, **k):
        raise AssertionError("the job started despite a bad option")

    monkeypatch.setattr(loop, "train", no_work)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", *SYN_ARGS, *args]) == 2
    err = capsys.readouterr().err
    assert message in err, err


@pytest.mark.parametrize(
    "flag, value",
    [("--epoch-examples", "1000"), ("--test-examples", "10"), ("--vocabulary-scale", "2")],
)
def test_cli_synthetic_options_on_movielens_are_an_error(capsys, flag, value):
    """The synthetic data's options with --dataset movielens-100k: an error naming the flag,
    before any work (was: ignored, --epoch-examples 1000 trained MovieLens' 297 batches)."""
    assert cli.main(["train", "--steps", "1", "--no-progress", flag, value]) == 2
    err = capsys.readouterr().err
    assert f"{flag} is for --dataset synthetic" in err, err


def test_cli_resume_without_the_synthetic_options_uses_their_defaults(capsys, tmp_path):
    """A resume leaving out --epoch-examples is a run of the default 1000000, refused against
    a checkpoint of 5000 with the flag and both numbers."""
    ckpt = ["--checkpoint-dir", str(tmp_path)]
    assert cli.main(["train", *SYN_ARGS, "--steps", "2", *ckpt]) == 0
    at = SYN_ARGS.index("--epoch-examples")
    short = SYN_ARGS[:at] + SYN_ARGS[at + 2 :]
    assert cli.main(["train", *short, "--steps", "4", *ckpt, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--epoch-examples 5000, this run asks for 1000000" in err, err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize(
    "flag, path", [("--checkpoint-dir", "/proc/embengine-ckpt"), ("--plot", "/proc/embengine.png")]
)
def test_cli_an_output_that_cannot_be_written_is_refused_before_any_work(capsys, flag, path):
    """A --checkpoint-dir or --plot where nothing can be created (/proc refuses even root) is
    an error naming the flag before training (was: "[Errno 2] No such file or directory" after
    the first epoch, or for --plot after the whole run, its results lost)."""
    assert cli.main(["train", *SYN_ARGS, "--steps", "1", flag, path]) == 2
    out, err = capsys.readouterr()
    assert f"{flag} {path}: cannot write" in err and "epoch 1" not in out, err


def test_cli_checkpoint_dir_that_is_a_file_is_an_error(capsys, tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    assert cli.main(["train", *SYN_ARGS, "--checkpoint-dir", str(path)]) == 2
    assert "is a file" in capsys.readouterr().err


def test_cli_a_run_whose_model_diverges_says_to_lower_the_lr(capsys):
    """A model whose gradients turn NaN (SGD at lr 1e37) ends the run with an error and exit 2
    that says to lower --lr (was: the engine's advice about nonfinite_gradients='skip_row', an
    option the CLI does not have)."""
    args = ["train", *SYN_ARGS, "--steps", "20", "--optimizer", "sgd", "--lr", "1e37"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "is not finite" in err and "the model's gradients diverged" in err, err
    assert "a smaller --lr than 1e+37" in err and "Traceback" not in err, err


def test_cli_a_diverging_run_is_an_error_saying_what_to_do(capsys):
    """Tables whose update overflows (float16 weights, SGD at lr 1e6) end the run with an
    error and exit 2 that says to lower --lr (was: a NonFiniteUpdateError traceback, exit 1)."""
    args = ["train", *SYN_ARGS, "--steps", "3", "--optimizer", "sgd", "--lr", "1e6"]
    assert cli.main([*args, "--weights-dtype", "float16"]) == 2
    err = capsys.readouterr().err
    assert "embengine train: error: step " in err and "non-finite" in err, err
    assert "a smaller --lr than 1e+06" in err and "Traceback" not in err, err


def test_cli_a_resume_the_ranks_would_refuse_is_refused_before_launching_them(capsys, tmp_path):
    """--nproc-per-node 2 --resume with another --weights-dtype than the checkpoint's: one
    error and exit 2 from the command, no rank launched (was: each rank's error, interleaved
    on one line, then torchrun's ChildFailedError traceback and exit 1)."""
    ckpt = ["--checkpoint-dir", str(tmp_path)]
    assert cli.main(["train", *SYN_ARGS, "--steps", "2", *ckpt]) == 0
    capsys.readouterr()
    again = ["--steps", "4", *ckpt, "--resume", "--weights-dtype", "bfloat16"]
    assert cli.main(["train", *SYN_ARGS, *again, "--nproc-per-node", "2"]) == 2
    out, err = capsys.readouterr()
    assert err.count("error:") == 1 and "--weights-dtype float32, this run" in err, err
    assert "ChildFailedError" not in err + out


@pytest.mark.parametrize("model", ["dlrm", "fm"])
def test_cli_short_synthetic_run_learns(capsys, tmp_path, model):
    plot = tmp_path / "curves.png"
    code = cli.main(["train", *SYN_ARGS, "--model", model, "--steps", "60", "--plot", str(plot)])
    assert code == 0
    out = capsys.readouterr().out
    assert _final_auc(out) > 0.55
    assert "60 steps" in out
    assert re.search(r"epoch 1: step \d+, train loss [\d.]+, valid AUC [\d.]+, test AUC", out)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.stat().st_size > 1000


def test_cli_resume_continues_the_run(capsys, tmp_path):
    args = ["train", *SYN_ARGS, "--dim", "8", "--epoch-examples", "2048"]
    assert cli.main([*args, "--epochs", "2"]) == 0
    straight = capsys.readouterr().out
    ckpt = str(tmp_path / "ckpt")
    assert cli.main([*args, "--epochs", "1", "--checkpoint-dir", ckpt]) == 0
    capsys.readouterr()
    assert cli.main([*args, "--epochs", "2", "--checkpoint-dir", ckpt, "--resume"]) == 0
    resumed = capsys.readouterr().out
    assert "resumed from" in resumed
    assert "epoch 1:" not in resumed  # the first epoch was not trained again
    assert straight.splitlines()[-1].split(", ")[:2] == resumed.splitlines()[-1].split(", ")[:2]


def test_progress_bar_run(capsys):
    result = train(_cfg(steps=3, progress=True), log=print)
    assert result.steps == 3
    captured = capsys.readouterr()
    assert "epoch 1" in captured.err  # tqdm's bar
    assert "test AUC" in captured.out


# -- resuming = training straight ----------------------------------------------------------------


@pytest.mark.parametrize("model, optimizer", [("dlrm", "adagrad"), ("fm", "adam")])
def test_resume_by_epochs_equals_straight_run(tmp_path, model, optimizer):
    kw = dict(model=model, optimizer=optimizer)
    straight = train(_cfg(epochs=3, **kw), log=_quiet)
    first = train(_cfg(epochs=2, checkpoint_dir=str(tmp_path), **kw), log=_quiet)
    assert first.steps == 16
    logs: list[str] = []
    resumed = train(
        _cfg(epochs=3, checkpoint_dir=str(tmp_path), resume=True, **kw), log=logs.append
    )
    assert any("resumed" in m for m in logs)
    assert sum(m.startswith("epoch ") for m in logs) == 1  # only epoch 3 was trained
    assert resumed.steps == straight.steps == 24
    assert resumed.test_auc == pytest.approx(straight.test_auc, abs=1e-6)
    assert resumed.test_logloss == pytest.approx(straight.test_logloss, abs=1e-6)
    assert len(resumed.history) == len(straight.history) == 3
    for a, b in zip(resumed.history, straight.history, strict=True):
        assert a["test_auc"] == pytest.approx(b["test_auc"], abs=1e-6)


def test_resume_mid_epoch_by_steps_equals_straight_run(tmp_path):
    """--steps stops mid-epoch (5 of 8 batches); the checkpoint remembers the data position."""
    straight = train(_cfg(steps=20), log=_quiet)
    train(_cfg(steps=5, checkpoint_dir=str(tmp_path)), log=_quiet)
    resumed = train(_cfg(steps=20, checkpoint_dir=str(tmp_path), resume=True), log=_quiet)
    assert resumed.steps == straight.steps == 20
    assert resumed.test_auc == pytest.approx(straight.test_auc, abs=1e-6)
    assert resumed.test_logloss == pytest.approx(straight.test_logloss, abs=1e-6)


def test_resume_after_steps_ending_on_an_epoch_boundary(tmp_path):
    """--steps 8 is exactly one epoch here (2048 examples / 256). Resuming must continue with the
    next epoch like the straight run does."""
    straight = train(_cfg(steps=20), log=_quiet)
    train(_cfg(steps=8, checkpoint_dir=str(tmp_path)), log=_quiet)
    resumed = train(_cfg(steps=20, checkpoint_dir=str(tmp_path), resume=True), log=_quiet)
    assert resumed.steps == 20
    assert resumed.test_auc == pytest.approx(straight.test_auc, abs=1e-6)
    assert resumed.test_logloss == pytest.approx(straight.test_logloss, abs=1e-6)


def test_resume_with_the_step_count_already_reached_trains_nothing(tmp_path):
    """--steps is the total: resuming a run that has done its 5 steps must not do a 6th."""
    done = train(_cfg(steps=5, checkpoint_dir=str(tmp_path)), log=_quiet)
    again = train(_cfg(steps=5, checkpoint_dir=str(tmp_path), resume=True), log=_quiet)
    assert again.steps == done.steps == 5


def test_resume_of_a_finished_run_reports_its_metrics(tmp_path):
    """Resuming a run whose epochs are all done trains nothing and still reports the final test
    AUC / logloss, not NaN."""
    done = train(_cfg(epochs=1, checkpoint_dir=str(tmp_path)), log=_quiet)
    again = train(_cfg(epochs=1, checkpoint_dir=str(tmp_path), resume=True), log=_quiet)
    assert again.steps == done.steps
    assert np.isfinite(again.test_auc) and np.isfinite(again.test_logloss)
    assert again.test_auc == pytest.approx(done.test_auc, abs=1e-6)


def test_a_new_run_refuses_a_folder_holding_another_runs_checkpoints(tmp_path):
    """Without --resume, a --checkpoint-dir holding checkpoints is refused before any work:
    this run's saves would prune them (--keep)."""
    train(_cfg(steps=3, checkpoint_dir=str(tmp_path)), log=_quiet)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match="holds checkpoints of an earlier run .* --resume"):
        train(_cfg(steps=3, dim=4, keep=1, checkpoint_dir=str(tmp_path)), log=_quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("resume", [True, False])
def test_a_checkpoint_dir_that_is_a_checkpoint_or_inside_one_is_refused(tmp_path, resume):
    """--checkpoint-dir naming one checkpoint (as inspect and export accept) or a folder inside
    one is refused before any work: a resumed run found no checkpoint in it, trained from step
    0 and wrote its checkpoints inside the old one."""
    train(_cfg(steps=3, checkpoint_dir=str(tmp_path)), log=_quiet)
    (ckpt,) = [p for p in tmp_path.iterdir() if p.name.startswith("ckpt-")]
    before = sorted(p.name for p in ckpt.iterdir())
    for folder in (ckpt, ckpt / "sub"):
        with pytest.raises(ValueError, match=f"is (inside )?the checkpoint {ckpt}.*{tmp_path}"):
            train(_cfg(steps=6, checkpoint_dir=str(folder), resume=resume), log=_quiet)
    assert sorted(p.name for p in ckpt.iterdir()) == before


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"checkpoint_dir": "afile/ck"}, "is under the file"),
        ({"seed": 2**70}, r"--seed must be an int in \[0, 2\^63\)"),
        ({"seed": -1}, "--seed must be"),
    ],
)
def test_options_refused_before_any_work(tmp_path, monkeypatch, kw, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=message):
        _cfg(steps=1, **kw).check()


def test_resume_takes_this_runs_dense_lr_and_refuses_another_seed(tmp_path):
    """A resumed run's dense optimizer steps at this run's --dense-lr (the checkpoint's Adam
    state, this run's rate), as the tables take this run's --lr; another --seed is refused (it
    orders the batches and initialises new keyed rows)."""
    base = tmp_path / "base"
    train(_cfg(steps=5, checkpoint_dir=str(base)), log=_quiet)
    with pytest.raises(ValueError, match="--seed 0, this run asks for 7"):
        train(_cfg(steps=10, seed=7, checkpoint_dir=str(base), resume=True), log=_quiet)
    runs = {}
    for lr in (1e-3, 0.5):
        folder = tmp_path / f"lr{lr}"
        shutil.copytree(base, folder)
        runs[lr] = train(
            _cfg(steps=10, dense_lr=lr, checkpoint_dir=str(folder), resume=True), log=_quiet
        )
        meta = ee.EmbeddingEngine.load(folder).restore(folder).extra_metadata
        assert {g["lr"] for g in meta["dense_optimizer"]["param_groups"]} == {lr}
    assert runs[1e-3].test_logloss != runs[0.5].test_logloss


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"weights_dtype": "bfloat16"}, "--weights-dtype float32, this run asks for bfloat16"),
        ({"slots_dtype": "bfloat16"}, "--slots-dtype float32, this run asks for bfloat16"),
        ({"vocabulary": "dynamic"}, "--vocabulary fixed, this run asks for dynamic"),
        ({"optimizer": "adam"}, "--optimizer ftrl, this run asks for adam"),
        ({"synthetic": {**SYN, "examples_per_epoch": 1024}}, "--epoch-examples 2048, this run"),
        ({"synthetic": {**SYN, "test_examples": 1024}}, "--test-examples 2048, this run asks"),
    ],
)
def test_resume_with_other_table_or_data_options_names_the_flag(tmp_path, kw, message):
    """A resume refuses, naming the flag, the tables' dtypes and vocabulary (the restore's
    error said TableConfig(weights_dtype=...) or "the engine's is keyed") and the synthetic
    data's sizes (another --epoch-examples went on silently from another data position,
    another --test-examples compared validation AUCs of other sets for early stopping)."""
    train(_cfg(steps=3, checkpoint_dir=str(tmp_path)), log=_quiet)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match=f"trained with {message}.*new --checkpoint-dir"):
        train(_cfg(steps=6, checkpoint_dir=str(tmp_path), resume=True, **kw), log=_quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_second_run_on_a_checkpoint_dir_in_use_is_refused(tmp_path):
    """While a run holds its --checkpoint-dir (RUN_LOCK, flock), another run there, resumed
    or not, is refused naming the holder's pid (was: both trained, their checkpoints
    interleaved: ckpt-000413-step394 after ckpt-000412-step416, and a resume went on from
    either); once it is released the run goes ahead."""
    import fcntl
    import os

    from embengine.training.loop import RUN_LOCK

    tmp_path.mkdir(exist_ok=True)
    fd = os.open(tmp_path / RUN_LOCK, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, b"4242\n")
        for resume in (False, True):
            with pytest.raises(ValueError, match=r"in use by another embengine train \(pid 4242\)"):
                train(_cfg(steps=2, checkpoint_dir=str(tmp_path), resume=resume), log=_quiet)
        args = ["train", *SYN_ARGS, "--steps", "2", "--checkpoint-dir", str(tmp_path)]
        assert cli.main([*args, "--nproc-per-node", "2"]) == 2  # refused before launching
    finally:
        os.close(fd)
    assert not any(p.name.startswith("ckpt-") for p in tmp_path.iterdir())
    assert train(_cfg(steps=2, checkpoint_dir=str(tmp_path)), log=_quiet).steps == 2
    assert train(_cfg(steps=4, checkpoint_dir=str(tmp_path), resume=True), log=_quiet).steps == 4


def test_resume_from_a_checkpoint_not_written_by_train_says_so(tmp_path):
    train(_cfg(steps=3, checkpoint_dir=str(tmp_path / "run")), log=_quiet)
    ee.EmbeddingEngine.load(tmp_path / "run").save(tmp_path / "plain")
    with pytest.raises(ValueError, match="not written by `embengine train`"):
        train(_cfg(steps=6, checkpoint_dir=str(tmp_path / "plain"), resume=True), log=_quiet)


def test_resume_without_a_checkpoint_starts_fresh(tmp_path):
    fresh = train(_cfg(steps=6), log=_quiet)
    resumed = train(_cfg(steps=6, checkpoint_dir=str(tmp_path / "empty"), resume=True), log=_quiet)
    assert resumed.test_auc == pytest.approx(fresh.test_auc, abs=1e-6)


def test_resume_on_movielens_1_plus_1_epochs_equals_2(tmp_path):
    kw = dict(dataset="movielens-100k", model="dlrm", batch_size=512, dim=8)
    straight = train(_cfg(epochs=2, **kw), log=_quiet)
    train(_cfg(epochs=1, checkpoint_dir=str(tmp_path), **kw), log=_quiet)
    resumed = train(_cfg(epochs=2, checkpoint_dir=str(tmp_path), resume=True, **kw), log=_quiet)
    assert straight.oracle_auc is None
    assert straight.test_auc > 0.6
    assert resumed.steps == straight.steps
    assert resumed.test_auc == pytest.approx(straight.test_auc, abs=1e-6)
    assert resumed.test_logloss == pytest.approx(straight.test_logloss, abs=1e-6)


# -- the torch baseline --------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_torch_baseline_runs(optimizer):
    result = train(_cfg(embeddings="torch", optimizer=optimizer, steps=12), log=_quiet)
    assert result.steps == 12
    assert np.isfinite(result.test_logloss)
    assert result.test_auc > 0.5


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_torch_baseline_matches_engine(optimizer):
    """Same initial values, same update rule: the engine and torch's sparse tables agree."""
    engine = train(_cfg(optimizer=optimizer, steps=12), log=_quiet)
    torch_ = train(_cfg(embeddings="torch", optimizer=optimizer, steps=12), log=_quiet)
    assert torch_.test_auc == pytest.approx(engine.test_auc, abs=1e-4)
    assert torch_.test_logloss == pytest.approx(engine.test_logloss, abs=1e-4)


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "ftrl", "lion"])
def test_torch_baseline_rejects_engine_only_optimizers(capsys, optimizer):
    assert (
        cli.main(
            ["train", *SYN_ARGS, "--steps", "1", "--embeddings", "torch", "--optimizer", optimizer]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert optimizer in err
    for name in ("sgd", "adagrad", "adam"):
        assert name in err
    with pytest.raises(ValueError, match=optimizer):
        train(_cfg(embeddings="torch", optimizer=optimizer, steps=1), log=_quiet)


def test_torch_baseline_has_no_checkpoints(tmp_path):
    with pytest.raises(ValueError, match="checkpoint"):
        train(_cfg(embeddings="torch", optimizer="sgd", steps=1, checkpoint_dir=str(tmp_path)))


# -- EmbeddingLayer ------------------------------------------------------------------------------


def _layer():
    t = ee.TableConfig(10, 4, name="t", initializer=ee.initializers.RandomUniform(-0.5, 0.5))
    u = ee.TableConfig(7, 4, name="u", combiner="sum")
    engine = ee.EmbeddingEngine(
        {"a": ee.FeatureConfig(t), "b": ee.FeatureConfig(t), "c": ee.FeatureConfig(u)},
        optimizer=opt.SGD(0.5),
    )
    return EmbeddingLayer(engine)


FEATS = {"a": [[1, 2], [3]], "b": [[4], [5, 6, 7]], "c": [[0], []]}


def test_layer_names_missing_and_extra_features():
    layer = _layer()
    with pytest.raises(ValueError) as exc:
        layer({"a": FEATS["a"], "c": FEATS["c"]})
    assert "'b'" in str(exc.value)
    with pytest.raises(ValueError) as exc:
        layer({**FEATS, "zzz": [[1], [2]]})
    assert "'zzz'" in str(exc.value)
    with pytest.raises(ValueError) as exc:
        layer({"a": FEATS["a"], "b": FEATS["b"], "d": [[1], [2]]})
    assert "'c'" in str(exc.value) and "'d'" in str(exc.value)
    assert layer.engine.step == 0


def test_layer_accepts_keyed_jagged():
    layer = _layer()
    keys = ["a", "b", "c"]
    values = [i for k in keys for sample in FEATS[k] for i in sample]
    lengths = [len(sample) for k in keys for sample in FEATS[k]]
    kjt = KeyedJagged(keys, torch.tensor(values), lengths=torch.tensor(lengths))
    layer.eval()
    want = layer(FEATS)
    got = layer(kjt)
    assert got.keys() == want.keys()
    for k in keys:
        torch.testing.assert_close(got[k], want[k])
        assert got[k].shape == (2, 4)
    # A training step from a KeyedJagged updates the tables once.
    layer.train()
    before = layer.engine.embedding_tables["t"].copy()
    out = layer(kjt)
    sum(v.sum() for v in out.values()).backward()
    assert layer.engine.step == 1
    assert not np.array_equal(before, layer.engine.embedding_tables["t"])


def test_layer_eval_and_no_grad_do_not_update():
    layer = _layer()
    tables = {k: v.copy() for k, v in layer.engine.embedding_tables.items()}
    layer.eval()
    out = layer(FEATS)
    assert not any(v.requires_grad for v in out.values())
    layer.train()
    with torch.no_grad():
        out = layer(FEATS)
    assert not any(v.requires_grad for v in out.values())
    assert layer.engine.step == 0
    for k, v in layer.engine.embedding_tables.items():
        np.testing.assert_array_equal(v, tables[k])
    # In training mode the same lookup does update.
    out = layer(FEATS)
    (out["a"].sum() + out["b"].sum() + out["c"].sum()).backward()
    assert layer.engine.step == 1


# -- the reported epoch and early stopping -------------------------------------------------------


def test_best_entry_is_the_first_best_validation_epoch_and_counts_the_epochs_after_it():
    from embengine.training.loop import best_entry

    h = [
        {"epoch": i, "valid_auc": v, "test_auc": 0.5}
        for i, v in enumerate([0.70, 0.75, 0.74, 0.75, 0.73])
    ]
    best, since = best_entry(h)
    assert best["epoch"] == 1 and since == 3
    assert best_entry(h[:2]) == (h[1], 0)
    assert best_entry([]) == (None, 0)


def test_early_stopping_reports_the_best_validation_epoch(capsys):
    """MovieLens overfits within a few epochs at this learning rate: the run stops once the
    validation AUC has not improved for --patience epochs, and the summary reports the best
    validation epoch's test figures, naming it."""
    code = cli.main(
        [
            "train",
            "--dataset",
            "movielens-100k",
            "--optimizer",
            "adam",
            "--lr",
            "0.02",
            "--dim",
            "8",
            "--batch-size",
            "1024",
            "--epochs",
            "12",
            "--patience",
            "1",
            "--no-progress",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^epoch (\d+): .*valid AUC (\d\.\d+), test AUC (\d\.\d+)", out, re.M)
    valid = [float(v) for _, v, _ in rows]
    best = int(np.argmax(valid))
    assert len(rows) == best + 2 < 12  # stopped one epoch after the best one
    assert "stopping early" in out
    summary = out.strip().splitlines()[-1]
    assert summary.startswith(f"test AUC {rows[best][2]}")
    assert f"at epoch {best + 1} (best validation AUC {rows[best][1]}" in summary
    assert f"stopped early at epoch {best + 2}" in summary


def test_steps_runs_never_stop_early():
    result = train(_cfg(steps=24, patience=1), log=_quiet)
    assert result.steps == 24 and not result.stopped_early


# -- the plain torch DLRM twin -------------------------------------------------------------------


def test_baseline_trains_the_plain_torch_dlrm_after_the_engine(capsys):
    assert cli.main(["train", *SYN_ARGS, "--epochs", "2", "--baseline"]) == 0
    out = capsys.readouterr().out
    assert "the plain torch DLRM on the same data" in out
    table = out[out.index("test AUC  logloss") :].splitlines()
    assert table[1].startswith("embengine (ftrl tables)")
    assert table[2].startswith("plain torch DLRM (Adam)")
    for row in table[1:3]:
        assert 0.55 < float(row.split()[-4]) <= 1.0


def test_plain_embeddings_train_the_tables_with_the_dense_adam():
    from embengine.training.baseline import TorchEmbeddings

    result = train(_cfg(embeddings="plain", steps=12), log=_quiet)
    assert result.test_auc > 0.5
    assert not TorchEmbeddings([], 4, 0, sparse=False).bags  # built without sparse gradients


# -- first run: the kernels compile before training, with a message -----------------------------


# The kernel modules of embengine/kernels the first-run test leaves to compile: pooling and
# training lookups (the others come from the suite's cache). A training step's update kernels
# compile too: rendered (kernels/row_math.py), they are cached in another folder, not seeded.
FIRST_RUN_COMPILES = ("pool.", "train_lookup.")


def test_the_kernel_warmup_does_not_overflow_float16_slots():
    """The warmup's backward of the summed activations sent a gradient of 1 per element: 256
    ids of a one-row table (--vocabulary-scale 0.01) summed to an accumulator above float16's
    65504, and `train --slots-dtype float16` died at "step 0" with NonFiniteUpdateError before
    training. Its gradient is now the mean's, as the training loss is."""
    result = train(_cfg(steps=2, slots_dtype="float16"), log=_quiet)
    assert result.steps == 2 and np.isfinite(result.test_auc)


def test_first_run_says_it_compiles_kernels_and_a_second_run_does_not(tmp_path):
    """A fresh numba cache (NUMBA_CACHE_DIR) is a first run: the message comes before the first
    epoch; the second run loads the kernels from that cache and says nothing. (The first run
    compiles a training step's update, pooling and training-lookup kernels, ~16 s here, over
    three times the notice's 5 CPU seconds; its timeout allows for a heavily loaded machine.)"""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from numba.core.caching import UserProvidedCacheLocator

    root = Path(ee.__file__).parent.parent
    # The fresh cache gets the kernels of embengine/kernels the suite has compiled so far except
    # FIRST_RUN_COMPILES: the first run compiles only those and its update kernels, not every
    # kernel again (most of a fresh clone's run: docs/performance.md, "Figures behind the code").
    kernels = root / "embengine" / "kernels"
    seeded = (
        tmp_path
        / "numba"
        / UserProvidedCacheLocator.get_suitable_cache_subpath(str(kernels / "lookup.py"))
    )
    seeded.mkdir(parents=True)
    for f in (kernels / "__pycache__").glob("*.nb[ic]"):
        if not f.name.startswith(FIRST_RUN_COMPILES):
            shutil.copy2(f, seeded / f.name)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "PYTHONPATH": str(root)}
    cmd = [
        sys.executable,
        "-m",
        "embengine",
        "train",
        *SYN_ARGS,
        "--steps",
        "2",
        "--optimizer",
        "sgd",
        "--vocabulary-scale",
        "0.001",
    ]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, cwd=root)
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert lines[0].startswith("compiling kernels, first run only"), first.stdout
    assert re.match(r"kernels compiled in \d+\.\d s", lines[1]), first.stdout
    assert lines[2].startswith("epoch 1:")
    second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=root)
    assert second.returncode == 0, second.stderr
    assert "compiling" not in second.stdout, second.stdout
    assert second.stdout.splitlines()[0].startswith("epoch 1:")


# -- several ranks: torchrun, tables sharded, each rank on its slice of every batch -------------


def test_a_rank_s_slices_of_a_batch_are_the_batch_in_rank_order():
    from embengine.data.dataset import ClickBatch
    from embengine.inputs import Ragged
    from embengine.training.ranks import Ranks

    hist = Ragged(np.arange(9), lengths=[2, 0, 3, 1, 0, 3, 0], weights=np.linspace(0, 1, 9))
    batch = ClickBatch(
        {"user": np.arange(7) * 10, "hist": hist},
        np.arange(14, dtype=np.float32).reshape(7, 2),
        np.array([1, 0, 0, 1, 1, 0, 1], np.float32),
    )
    for world in (1, 2, 3, 8):
        parts = [Ranks(rank, world).slice(batch) for rank in range(world)]
        assert [len(p) for p in parts] == [
            len(range(*Ranks(r, world).bounds(7))) for r in range(world)
        ]
        assert np.array_equal(np.concatenate([p.labels for p in parts]), batch.labels)
        assert np.array_equal(np.concatenate([p.dense for p in parts]), batch.dense)
        assert np.array_equal(np.concatenate([p.sparse["user"] for p in parts]), np.arange(7) * 10)
        for key in ("ids", "weights"):
            got = np.concatenate([getattr(p.sparse["hist"], key) for p in parts])
            assert np.array_equal(got, getattr(hist, key))
        lengths = np.concatenate([np.diff(p.sparse["hist"].offsets) for p in parts])
        assert lengths.tolist() == [2, 0, 3, 1, 0, 3, 0]


def test_the_dense_model_under_ddp_warns_nothing(tmp_path):
    """Ranks.wrap_model: DDP without the deprecated broadcast_buffers (torch 2.13 printed a
    FutureWarning on every rank), the gradient through its sum hook reaching the model. One
    rank of a one-process gloo group, in a process of its own (warnings as errors); the
    sum over real ranks is the torchrun tests'."""
    import subprocess
    import sys

    code = """
import torch, torch.distributed as dist
from embengine.training.ranks import Ranks
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
model = torch.nn.Linear(2, 1, bias=False)
torch.nn.init.ones_(model.weight)
model.register_buffer("scale", torch.ones(1))
ddp = Ranks(0, 2).wrap_model(model)
ddp(torch.ones(3, 2)).sum().backward()
print(model.weight.grad.tolist())
"""
    from embengine.training.ranks import free_port

    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", code % free_port()],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[[3.0, 3.0]]", proc.stdout


def _run_cli(
    args: list[str], timeout: float = 600, env: dict | None = None, stderr: list | None = None
) -> str:
    """``python -m embengine.cli *args`` in its own process group (killed whole on timeout),
    ``env`` added to this process's environment (a value None: removed): its stdout; a
    failure shows stderr, which ``stderr`` (a list) also gets."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(ee.__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), **(env or {})}
    env = {k: v for k, v in env.items() if v is not None}
    proc = subprocess.Popen(
        [sys.executable, "-m", "embengine.cli", *args],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        out, err = proc.communicate()
        what = f"embengine {' '.join(args)}: no result in {timeout} s"
        raise AssertionError(f"{what}\n{err}") from None
    assert proc.returncode == 0, err
    if stderr is not None:
        stderr.append(err)
    return out


def test_two_ranks_take_keyed_and_16_bit_tables(tmp_path):
    """``--nproc-per-node`` with ``--vocabulary dynamic`` and 16-bit tables: refused until the
    ShardedEngine sharded keyed tables and stored 16-bit rows (its equality with one engine:
    tests/test_distributed_precision.py; MovieLens at 2 ranks: docs/performance.md, "Sharded
    16-bit tables"). A sharded keyed run's closing lines give each table's keys on the rank."""
    from embengine.training.loop import TrainResult

    cfg = _cfg(
        steps=1,
        nproc_per_node=2,
        vocabulary="dynamic",
        weights_dtype="bfloat16",
        slots_dtype="float16",
        checkpoint_dir=str(tmp_path / "ck"),
    )
    cfg.check()
    cfg.check_distributed(2)
    keyed = {"kind": "keyed", "rows": 8, "total": {"admitted": 9, "evicted": 1}}
    keyed["bytes"] = {"rows": 2**20, "index": 2**20}
    stats = {  # ShardedEngine.table_stats(): per table this rank's share
        "tables": {
            "u": {"sharding": "keyed", "exchange": "rows", "rows": 8, "bytes": 1, "keyed": keyed},
            "d": {"sharding": "row", "exchange": "sums", "rows": 5, "bytes": 80},
        },
        "bytes_sent": {"lookup": {"lookup ids": 64}},
        "bytes_sent_total": {"lookup ids": 64},
    }
    result = TrainResult(0.5, 0.7, 1.0, 1, [], table_stats=stats)
    assert result.stats_lines() == ["table u: 8 rows, 9 admitted, 1 evicted, 2.0 MiB on this rank"]


def test_a_sharding_in_one_process_is_refused():
    """``train`` of a config asking for a sharding in one process (no torchrun): a
    ValueError naming it, not a run that ignores it."""
    from embengine.training.loop import train

    with pytest.raises(ValueError, match="--sharding auto shards the tables over ranks"):
        train(_cfg(steps=1, sharding="auto"), log=lambda s: None)
    with pytest.raises(ValueError, match="--sharding must be one of row, table, auto"):
        _cfg(sharding="rows").check()


@pytest.mark.parametrize("sharding", ["row", "table"])
def test_training_on_two_ranks_reports_the_single_process_run(tmp_path, sharding):
    """``--nproc-per-node 2`` (torchrun; a ShardedEngine; DDP summing the dense gradients; each
    rank on its slice of every batch) trains the single-process run: every epoch's validation
    and test figures and its running train loss agree up to float rounding, tables sharded
    by row (the default) or whole (``--sharding table``, whose plan the log gives). The run
    leaves no torchrun log folders in the temp folder (by default torchrun leaves one a run)."""
    args = ["train", *SYN_ARGS, "--steps", "30", "--optimizer", "adagrad"]
    figures = re.compile(r"(train loss|valid AUC|test AUC|test logloss) (\d\.\d+)")
    one = [ln for ln in _run_cli(args).splitlines() if ln.startswith("epoch ")]
    temp = tmp_path / "temp"
    temp.mkdir()
    said: list[str] = []
    # Without OMP_NUM_THREADS of its own, torchrun set 1 for every rank and printed a banner
    # saying so; the launch now gives each rank its share of the cores.
    env = {"TMPDIR": str(temp), "OMP_NUM_THREADS": None}
    ranked = [*args, "--nproc-per-node", "2"]
    if sharding != "row":
        ranked += ["--sharding", sharding]
    lines = _run_cli(ranked, env=env, stderr=said).splitlines()
    two = [ln for ln in lines if ln.startswith("epoch ")]
    plans = [ln for ln in lines if ln.startswith("sharding: ")]
    assert len(plans) == (sharding != "row"), lines
    if plans:  # every table whole, on rank 0 or 1 ("C1 table on rank 0; C2 table on ...")
        entries = plans[0].removeprefix("sharding: ").split("; ")
        assert all(re.fullmatch(r"C\d+ table on rank [01]", e) for e in entries), plans
    assert "Setting OMP_NUM_THREADS" not in said[0], said[0]
    runs = ("torchelastic_", "embengine-torchrun-")  # torchrun's own folder, ours for it
    assert [p.name for p in temp.iterdir() if p.name.startswith(runs)] == []
    assert len(one) == len(two) >= 2, (one, two)
    for a, b in zip(one, two, strict=True):
        fa, fb = figures.findall(a), figures.findall(b)
        assert len(fa) == len(fb) == 4, (a, b)
        for (name, x), (_, y) in zip(fa, fb, strict=True):
            assert abs(float(x) - float(y)) <= 2e-4, (name, a, b)


def _descendants(pid: int) -> list[int]:
    """The processes under ``pid``, from /proc (children before grandchildren)."""
    from pathlib import Path

    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(0), [])
        found += kids
        todo += kids
    return found


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process under it (torchrun's ranks run in sessions of their
    own, out of reach of a process-group kill)."""
    import os
    import signal

    for p in [*reversed(_descendants(pid)), pid]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _rank_process(launcher: int, rank: int) -> int | None:
    """The torchrun worker of ``rank`` under the ``launcher`` process, if it runs."""
    from pathlib import Path

    for pid in _descendants(launcher):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"TORCHELASTIC_RUN_ID" in b" ".join(env):
            return pid
    return None


def test_a_rank_killed_mid_run_restarts_and_ends_where_an_unbroken_run_ends(tmp_path):
    """Two ranks with --max-restarts 1 and --resume: rank 1 is killed once the first checkpoint
    exists; both are started again (a fresh torchrun), resume from the newest checkpoint
    (tables, dense model and its Adam, data position) and end with the unbroken run's figures."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    args = [
        "train",
        *SYN_ARGS,
        "--epochs",
        "4",
        "--patience",
        "0",
        "--optimizer",
        "adagrad",
        "--nproc-per-node",
        "2",
        "--resume",
    ]
    unbroken = _run_cli([*args, "--checkpoint-dir", str(tmp_path / "a")])
    root = Path(ee.__file__).parent.parent
    ckpt = tmp_path / "b"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "embengine.cli",
            *args,
            "--checkpoint-dir",
            str(ckpt),
            "--max-restarts",
            "1",
        ],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        killed = None
        deadline = time.monotonic() + 600
        while killed is None and proc.poll() is None and time.monotonic() < deadline:
            if ckpt.is_dir() and any(p.name.startswith("ckpt-") for p in ckpt.iterdir()):
                killed = _rank_process(proc.pid, 1)
                if killed is not None:
                    os.kill(killed, signal.SIGKILL)
            time.sleep(0.02)
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            _kill_tree(proc.pid)
            proc.wait()
    assert killed is not None, "the run ended before a checkpoint appeared"
    assert proc.returncode == 0, err
    assert "resumed from" in out, out
    last = [ln for ln in out.splitlines() if ln.startswith(("epoch 4:", "test AUC"))]
    want = [ln for ln in unbroken.splitlines() if ln.startswith(("epoch 4:", "test AUC"))]
    strip = lambda ln: re.sub(r" in \d+\.\d s$", "", ln)  # noqa: E731 - the time differs
    assert [strip(ln) for ln in last] == [strip(ln) for ln in want], (out, unbroken)


def test_baseline_inside_torchrun_ranks_is_refused(capsys, monkeypatch):
    # torchrun -m embengine.cli train --baseline: each rank would train the twin alone.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["train", *SYN_ARGS, "--baseline"]) == 2
    assert "--baseline runs in one process" in capsys.readouterr().err


def test_sigterm_to_the_launcher_ends_every_rank(tmp_path):
    """torchrun's ranks run in sessions of their own: the launcher passes SIGTERM on, so no
    rank outlives it."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(ee.__file__).parent.parent
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "embengine.cli",
            "train",
            *SYN_ARGS,
            "--epochs",
            "1000",
            "--patience",
            "0",
            "--nproc-per-node",
            "2",
        ],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    ranks = []
    try:
        deadline = time.monotonic() + 300
        while len(ranks) < 2 and proc.poll() is None and time.monotonic() < deadline:
            ranks = [p for p in (_rank_process(proc.pid, r) for r in (0, 1)) if p is not None]
            time.sleep(0.1)
        assert len(ranks) == 2, "the ranks did not start"
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) != 0
        deadline = time.monotonic() + 60
        while any(Path(f"/proc/{p}").exists() for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = [
            p
            for p in ranks
            if Path(f"/proc/{p}").exists()
            and "Z" not in Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1][:3]
        ]
        assert not alive, f"ranks {alive} outlived their launcher"
    finally:
        _kill_tree(proc.pid)
        for p in ranks:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_dynamic_vocabulary_trains_movielens_on_its_raw_ids(capsys):
    """--vocabulary dynamic: keyed tables fed MovieLens' ids as in its files (other tokens
    hashed to 64 bits); one row per distinct id of the training split, and the run learns as
    the fixed-vocabulary one does."""
    from embengine.data.movielens import load_movielens_100k

    raw = load_movielens_100k(valid_fraction=0.05, raw_ids=True)
    fixed = load_movielens_100k(valid_fraction=0.05)
    users = np.unique(raw.train.features["user_id"])
    assert users.min() == 1 and users.max() == 943 and len(users) == 943  # the files' ids
    assert len(np.unique(raw.train.features["gender"])) == 2
    assert np.abs(raw.train.features["gender"]).max() > 2**40  # hashed, not remapped
    assert np.array_equal(raw.train.labels, fixed.train.labels)
    args = ["train", "--dataset", "movielens-100k", "--epochs", "1", "--no-progress"]
    assert cli.main([*args, "--vocabulary", "dynamic"]) == 0
    out = capsys.readouterr().out
    auc = float(re.search(r"^test AUC (\d\.\d+)", out, re.M)[1])
    items = len(np.unique(raw.train.features["item_id"]))
    assert "table user_id: 943 rows, 943 admitted, 0 evicted" in out, out
    assert f"table item_id: {items} rows, {items} admitted" in out, out
    assert cli.main(args) == 0
    want = float(re.search(r"^test AUC (\d\.\d+)", capsys.readouterr().out, re.M)[1])
    assert abs(auc - want) < 0.01, (auc, want)
