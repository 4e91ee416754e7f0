"""BackupAndRestore: exact resume after SIGKILL/SIGTERM, atomic generations."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import keras
import tensorflow as tf

from keras_mgpu.callbacks import (RESTART_EXIT_CODE, RETRIED_EXIT_CODES,
                                  BackupAndRestore, list_presets)
from keras_mgpu.callbacks.backup import generation as generation_lib
from keras_mgpu.callbacks.backup import writer
from tests import backup_workers, workers


def backup_files(backup_dir):
    """Each file of backup_dir and its bytes, the owner lock aside (a run
    that raised leaves it, a refusal releases it)."""
    from pathlib import Path

    return {str(p): p.read_bytes() for p in sorted(Path(backup_dir).rglob("*"))
            if p.is_file() and p.name != "LOCK.json"}


def max_diff(a, b):
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
               for x, y in zip(a, b))


def run(run_workers, backup_dir, num_workers=1, kill_at=None, env=None,
        **kwargs):
    """Runs backup_workers.train; kills it when it prints `STEP <kill_at>;`."""
    options = {} if env is None else {"env": env}
    if kill_at is not None:
        options["kill_when_printed"] = f"STEP {kill_at};"
    return run_workers(backup_workers.train, num_workers,
                       kwargs={"backup_dir": str(backup_dir),
                               "pause_at": kill_at, **kwargs},
                       **options)


@pytest.fixture(scope="module")
def uninterrupted():
    """Final weights of uninterrupted runs, keyed by training arguments."""
    from keras_mgpu import launcher

    cache = {}

    def get(tmp_path, num_workers=1, **kwargs):
        key = (num_workers, tuple(sorted(kwargs.items())))
        if key not in cache:
            results = launcher.run_local_workers(
                backup_workers.train, num_workers, timeout=240,
                kwargs={"backup_dir": str(tmp_path / "uninterrupted"),
                        **kwargs})
            cache[key] = results[0].result
        return cache[key]

    return get


# Kills mid-window and mid-epoch, each rerun resuming the last one's backup:
# one kill of each such run is in the default run (test_runtime.py's on two
# workers, tests/models/'s mid-window on GPT-2), three in a row here.
@pytest.mark.exhaustive
def test_sigkill_at_several_steps_resumes_exactly(run_workers, uninterrupted,
                                                  tmp_path):
    # accum_steps=3 with 8 batches per epoch: kills land mid-window and
    # mid-epoch; save_freq=4 so each restart repeats nothing it saved.
    kwargs = {"accum_steps": 3}
    full = uninterrupted(tmp_path, **kwargs)
    backup_dir = tmp_path / "backup"
    for kill_at in (5, 13, 19):
        results = run(run_workers, backup_dir, kill_at=kill_at, **kwargs)
        assert results[0].killed and results[0].returncode == -signal.SIGKILL
        assert generation_lib.generations(str(backup_dir))
    resumed = run(run_workers, backup_dir, **kwargs)[0]
    assert resumed.result["iterations"] == full["iterations"] == 9
    assert max_diff(resumed.result["weights"], full["weights"]) <= 1e-6
    assert not backup_dir.exists(), "a finished run deletes its backups"


def test_sigkill_resumes_in_step_accumulation_exactly(run_workers,
                                                      uninterrupted, tmp_path):
    # Each batch of 16 split into micro-batches of 4, 6 and 6, with dropout:
    # the resumed run draws the same masks.
    kwargs = {"accum_steps": 3, "mode": "in_step"}
    full = uninterrupted(tmp_path, **kwargs)
    backup_dir = tmp_path / "backup"
    for kill_at in (5, 13):
        results = run(run_workers, backup_dir, kill_at=kill_at, **kwargs)
        assert results[0].killed and results[0].returncode == -signal.SIGKILL
    resumed = run(run_workers, backup_dir, **kwargs)[0]
    assert resumed.result["iterations"] == full["iterations"] == 24
    assert max_diff(resumed.result["weights"], full["weights"]) <= 1e-6


class CrashAt13(keras.callbacks.Callback):
    """Raises after the 13th optimizer step: mid-epoch 2 of fit_24_steps."""

    def on_train_batch_end(self, batch, logs=None):
        if self.model.optimizer.iterations.numpy() == 13:
            raise RuntimeError("crash")


def fit_24_steps(callbacks):
    """3 epochs of 8 batches of a small regression, in this process."""
    x, y = workers.regression_data(128)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    model = workers.build_mlp()
    model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(dataset, epochs=3, verbose=0, callbacks=callbacks)
    return model


def test_plain_keras_backup_and_restore_is_not_exact(tmp_path):
    """The gap this callback closes (KERAS3-FACTS gap 3), measured here."""
    full = fit_24_steps([])
    keras_backup = keras.callbacks.BackupAndRestore(str(tmp_path / "k"),
                                                    save_freq=4)
    with pytest.raises(RuntimeError, match="crash"):
        fit_24_steps([keras_backup, CrashAt13()])
    resumed = fit_24_steps([keras_backup])
    assert int(resumed.optimizer.iterations.numpy()) > 24
    assert max_diff(resumed.get_weights(), full.get_weights()) > 1e-3

    ours = BackupAndRestore(str(tmp_path / "ours"), save_freq=4)
    with pytest.raises(RuntimeError, match="crash"):
        fit_24_steps([ours, CrashAt13()])
    resumed = fit_24_steps([ours])
    assert int(resumed.optimizer.iterations.numpy()) == 24
    assert max_diff(resumed.get_weights(), full.get_weights()) <= 1e-6


@pytest.mark.parametrize("save_freq, generation, where", [
    # Saved at steps 4, 8, 12: the last is mid-epoch 2.
    (4, 3, "at epoch 2, step 4"),
    # Saved at the end of epoch 1: epoch 2 starts anew.
    ("epoch", 1, "at the start of epoch 2"),
])
def test_a_resume_says_where_it_resumed_from(tmp_path, capsys, save_freq,
                                             generation, where):
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="crash"):
        fit_24_steps([BackupAndRestore(backup_dir, save_freq=save_freq),
                      CrashAt13()])
    assert "resumed" not in capsys.readouterr().out
    fit_24_steps([BackupAndRestore(backup_dir, save_freq=save_freq)])
    assert capsys.readouterr().out.splitlines() == [
        f"BackupAndRestore: resumed from backup generation {generation} "
        f"{where} ({backup_dir})"]


def test_kill_during_an_asynchronous_write_falls_back_to_the_last_commit(
        run_workers, uninterrupted, tmp_path):
    kwargs = {"accum_steps": 3}
    full = uninterrupted(tmp_path, **kwargs)
    backup_dir = tmp_path / "backup"
    # Generations 1 and 2 are saved at steps 4 and 8. The write of the
    # step-12 generation (3) is held half done while training goes on; the
    # kill lands at step 14, inside that write.
    results = run_workers(
        backup_workers.train, 1,
        kwargs={"backup_dir": str(backup_dir), "hold_write_of": 3,
                "report_held_at": 14, **kwargs},
        kill_when_printed="STEP 14;")
    assert results[0].killed
    assert "HOLDING variables.npz;" in results[0].stdout
    entries = os.listdir(backup_dir)
    assert any(e.startswith(".tmp-") for e in entries), entries
    assert generation_lib.generations(str(backup_dir)) == [2, 1]
    resumed = run(run_workers, backup_dir, **kwargs)[0]
    assert resumed.result["iterations"] == full["iterations"]
    assert max_diff(resumed.result["weights"], full["weights"]) <= 1e-6


def test_sigterm_saves_and_exits_with_the_restart_code(
        run_workers, uninterrupted, tmp_path):
    full = uninterrupted(tmp_path)
    backup_dir = tmp_path / "backup"
    # save_freq larger than the run: only the SIGTERM save can exist.
    results = run_workers(
        backup_workers.train, 1,
        kwargs={"backup_dir": str(backup_dir), "save_freq": 1000,
                "pause_at": 10},
        kill_when_printed="STEP 10;", kill_signal=signal.SIGTERM,
        check=False)
    # The "preemptible" preset's code, one TFJob's ExitCode policy reruns.
    assert results[0].returncode in RETRIED_EXIT_CODES["tfjob"].codes
    assert results[0].returncode == RESTART_EXIT_CODE == list_presets()[
        "preemptible"]["exit_code"]
    # Paused at global batch 10 of 6-batch epochs. Epochs counted from 1
    # in both messages (the save said "epoch 1, batch 4", the resume
    # "epoch 2, step 4").
    assert ("SIGTERM received; saved generation 1 at epoch 2, step 4."
            in results[0].stderr)
    assert generation_lib.generations(str(backup_dir)) == [1]
    resumed = run(run_workers, backup_dir, save_freq=1000)[0]
    assert "resumed from backup generation 1 at epoch 2, step 4 " in (
        resumed.stdout)
    assert resumed.result["iterations"] == full["iterations"] == 24
    assert max_diff(resumed.result["weights"], full["weights"]) <= 1e-6


def test_multi_worker_kill_and_restart_matches_uninterrupted(
        run_workers, uninterrupted, tmp_path):
    full = uninterrupted(tmp_path, num_workers=2)
    backup_dir = tmp_path / "backup"
    temp_dirs = [tmp_path / "tmp0", tmp_path / "tmp1"]
    for d in temp_dirs:
        d.mkdir()
    env = lambda i: {"TMPDIR": str(temp_dirs[i]),  # noqa: E731
                     "TF_CPP_MIN_LOG_LEVEL": "2"}
    results = run(run_workers, backup_dir, num_workers=2, kill_at=9, env=env)
    assert all(r.killed for r in results)
    assert generation_lib.generations(str(backup_dir))
    resumed = run(run_workers, backup_dir, num_workers=2, env=env)
    for r in resumed:
        assert r.result["iterations"] == full["iterations"] == 24
        assert max_diff(r.result["weights"], full["weights"]) <= 1e-6
    # The non-chief wrote nothing anywhere, not even temporary files.
    assert os.listdir(temp_dirs[1]) == []


def test_multi_worker_local_tier_resumes_from_local_then_from_durable(
        run_workers, uninterrupted, tmp_path):
    """2 workers, each with its own local tier (a save every step, a durable
    one every 4): the first rerun resumes from the local copy both have;
    after worker 1's local tier is lost, from the durable tier; the run
    ends where an uninterrupted one ends."""
    full = uninterrupted(tmp_path, num_workers=2)
    backup_dir = tmp_path / "backup"
    local = {"local_dir": str(tmp_path / "local"), "local_save_freq": 1}
    results = run(run_workers, backup_dir, num_workers=2, kill_at=13,
                  **local)
    assert all(r.killed for r in results)
    # The step-14 save of each worker (batch 13 from 0); durable at 12.
    assert [generation_lib.generations(str(tmp_path / "local" / f"worker-{i}"))
            for i in (0, 1)] == [[14, 13], [14, 13]]
    results = run(run_workers, backup_dir, num_workers=2, kill_at=18,
                  **local)
    assert all(r.killed for r in results)
    assert ("resumed from local generation 14 at epoch 2, step 6 "
            f"({tmp_path / 'local' / 'worker-0'})") in results[0].stdout
    shutil.rmtree(tmp_path / "local" / "worker-1")
    resumed = run(run_workers, backup_dir, num_workers=2, **local)
    # The durable save at step 16 (worker 0's local copy of step 19 is
    # not on worker 1).
    assert "resumed from backup generation 4 at the start of epoch 3" in (
        resumed[0].stdout)
    for r in resumed:
        assert r.result["iterations"] == full["iterations"] == 24
        assert max_diff(r.result["weights"], full["weights"]) <= 1e-6
    assert not (tmp_path / "local" / "worker-0").exists()
    assert not (tmp_path / "local" / "worker-1").exists()


def fit_in_process(backup, epochs=3, crash_at=None, extra_callbacks=(),
                   model=None):
    x, y = workers.regression_data(128)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    model = model or workers.build_mlp()
    model.compile(keras.optimizers.Adam(0.01), "mse")

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.optimizer.iterations.numpy() == crash_at:
                raise RuntimeError("crash")

    callbacks = [backup, *extra_callbacks, Crash()]
    if crash_at is None:
        return model, model.fit(dataset, epochs=epochs, verbose=0,
                                callbacks=callbacks)
    with pytest.raises(RuntimeError, match="crash"):
        model.fit(dataset, epochs=epochs, verbose=0, callbacks=callbacks)
    workers.finish_backup_writes()
    return model, None


def test_corrupt_newest_generation_falls_back_with_a_warning(tmp_path):
    backup_dir = str(tmp_path / "b")
    fit_in_process(BackupAndRestore(backup_dir, save_freq=8, keep=3),
                   crash_at=20)
    assert generation_lib.generations(backup_dir) == [2, 1]
    newest = generation_lib.generation_dir(backup_dir, 2)
    with open(os.path.join(newest, "weights.weights.h5"), "r+b") as f:
        f.truncate(100)
    full, _ = fit_in_process(BackupAndRestore(str(tmp_path / "full")))
    with pytest.warns(UserWarning, match="generation 2 .* unusable"):
        model, history = fit_in_process(BackupAndRestore(backup_dir))
    # Resumed from generation 1 (end of epoch 0): two epochs left.
    assert len(history.history["loss"]) == 2
    assert int(model.optimizer.iterations.numpy()) == 24
    assert max_diff(model.get_weights(), full.get_weights()) <= 1e-6


@pytest.fixture(scope="module")
def two_generations(tmp_path_factory):
    """A backup_dir with generations 1 (end of epoch 0) and 2 (end of epoch
    1) of `fit_in_process`, to be copied, and the uninterrupted weights."""
    root = tmp_path_factory.mktemp("two_generations")
    backup_dir = str(root / "b")
    fit_in_process(BackupAndRestore(backup_dir, save_freq=8,
                                    double_checkpoint=True), crash_at=20)
    assert generation_lib.generations(backup_dir) == [2, 1]
    full, _ = fit_in_process(BackupAndRestore(str(root / "full")))
    return backup_dir, full.get_weights()


def _edit_json(path, edit):
    with open(path) as f:
        value = json.load(f)
    value = edit(value)
    with open(path, "w") as f:
        json.dump(value, f)


def _forge_state(edit):
    """Rewrites state.json and its manifest entry to match: damage that
    checksums cannot see."""
    import hashlib

    def forge(newest):
        path = os.path.join(newest, "state.json")
        with open(path) as f:
            data = json.dumps(edit(json.load(f))).encode()
        with open(path, "wb") as f:
            f.write(data)
        _edit_json(os.path.join(newest, "MANIFEST.json"), lambda m: {
            **m, "files": {**m["files"], "state.json": {
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest()}}})
    return forge


def _unlisted_weights_with_a_flipped_byte(newest):
    import h5py

    path = os.path.join(newest, "weights.weights.h5")
    with h5py.File(path, "r") as f:
        offset = f["layers/dense/vars/0"].id.get_offset()
    with open(path, "r+b") as f:
        f.seek(offset)  # the lowest byte of the first kernel value
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 1]))
    _edit_json(os.path.join(newest, "MANIFEST.json"), lambda m: {
        **m, "files": {k: v for k, v in m["files"].items()
                       if k != "weights.weights.h5"}})


def _write(name, data):
    def write(newest):
        with open(os.path.join(newest, name), "wb") as f:
            f.write(data)
    return write


def _edit_manifest(edit):
    return lambda newest: _edit_json(os.path.join(newest, "MANIFEST.json"),
                                     edit)


_DAMAGE = {
    "checksum": lambda newest: _edit_json(
        os.path.join(newest, "state.json"), lambda s: {**s, "epoch": 1}),
    "missing": lambda newest: os.remove(
        os.path.join(newest, "variables.npz")),
    "manifest-null": _write("MANIFEST.json", b"null"),
    "manifest-list": _write("MANIFEST.json", b"[]"),
    "manifest-half": _write("MANIFEST.json", b'{"generation": 2, "fi'),
    "files-a-list": _edit_manifest(
        lambda m: {**m, "files": sorted(m["files"])}),
    "entry-a-string": _edit_manifest(lambda m: {**m, "files": {
        **m["files"], "variables.npz": "0" * 64}}),
    "negative-size": _edit_manifest(lambda m: {**m, "files": {
        **m["files"], "variables.npz": {
            **m["files"]["variables.npz"], "size": -1}}}),
    "only-state-listed": _edit_manifest(lambda m: {**m, "files": {
        "state.json": m["files"]["state.json"]}}),
    "another-generation": _edit_manifest(lambda m: {**m, "generation": 1}),
    "unlisted-weights-flipped": _unlisted_weights_with_a_flipped_byte,
    "state-a-list": _forge_state(lambda s: []),
    "state-without-runtime": _forge_state(
        lambda s: {k: v for k, v in s.items() if k != "runtime"}),
    "step-in-epoch-negative": _forge_state(
        lambda s: {**s, "step_in_epoch": -3}),
    "global-step-a-string": _forge_state(
        lambda s: {**s, "runtime": {**s["runtime"], "global_step": "16"}}),
}


@pytest.mark.parametrize("damage", sorted(_DAMAGE))
def test_every_kind_of_damage_is_detected(two_generations, tmp_path, capsys,
                                          damage):
    """Damage to the newest generation, however the manifest and state are
    broken or forged, falls back to the intact older one, with a warning
    naming it, and resumes exactly; nothing is loaded unverified."""
    import shutil

    saved, full = two_generations
    backup_dir = str(tmp_path / "b")
    shutil.copytree(saved, backup_dir)
    _DAMAGE[damage](generation_lib.generation_dir(backup_dir, 2))
    with pytest.warns(UserWarning, match=(
            f"generation 2 in {backup_dir} is unusable .*; falling back "
            "to generation 1")):
        model, history = fit_in_process(BackupAndRestore(backup_dir))
    assert ("resumed from backup generation 1 at the start of epoch 2"
            in capsys.readouterr().out)
    assert len(history.history["loss"]) == 2
    assert int(model.optimizer.iterations.numpy()) == 24
    assert max_diff(model.get_weights(), full) <= 1e-6


def test_a_kill_before_the_first_commit_leaves_no_backup_yet(tmp_path,
                                                             recwarn):
    """What a kill before the first manifest leaves (the files moved in, no
    manifest) is no backup: the rerun trains from the start, and the
    leftover goes. tests/test_backup_kills.py kills real commits."""
    backup_dir = tmp_path / "b"
    (backup_dir / "gen-00000001").mkdir(parents=True)
    (backup_dir / "gen-00000001" / "state.json").write_text("{}")
    model, history = fit_in_process(BackupAndRestore(
        str(backup_dir), save_freq=4, delete_checkpoint=False), epochs=1)
    assert int(model.optimizer.iterations.numpy()) == 8
    assert not [w for w in recwarn if "unusable" in str(w.message)]
    assert generation_lib.generations(str(backup_dir)) == [2]


def test_a_generation_without_its_manifest_is_a_leftover_not_damage(
        two_generations, tmp_path, capsys, recwarn):
    """The manifest is the commit marker: without it the generation was
    never committed. It is skipped without a word, and removed."""
    import shutil

    saved, full = two_generations
    backup_dir = tmp_path / "b"
    shutil.copytree(saved, backup_dir)
    os.remove(backup_dir / "gen-00000002" / "MANIFEST.json")
    seen = {}

    class Probe(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen["entries"] = sorted(p.name for p in backup_dir.iterdir())

    model, history = fit_in_process(BackupAndRestore(str(backup_dir)),
                                    extra_callbacks=[Probe()])
    assert seen["entries"] == ["LOCK.json", "gen-00000001"]
    assert not [w for w in recwarn if "unusable" in str(w.message)]
    assert ("resumed from backup generation 1 at the start of epoch 2"
            in capsys.readouterr().out)
    assert int(model.optimizer.iterations.numpy()) == 24
    assert max_diff(model.get_weights(), full) <= 1e-6


def test_keep_bounds_generations_and_success_deletes(tmp_path):
    kept = str(tmp_path / "kept")
    fit_in_process(BackupAndRestore(kept, save_freq=2, keep=2,
                                    delete_checkpoint=False))
    assert generation_lib.generations(kept) == [12, 11]  # 24 / 2 saves
    only = str(tmp_path / "only")
    fit_in_process(BackupAndRestore(only, save_freq=2, keep=1), crash_at=7)
    assert generation_lib.generations(only) == [3]
    # Keras's defaults: one generation; double_checkpoint=True: two.
    single = str(tmp_path / "single")
    fit_in_process(BackupAndRestore(single, save_freq=2), crash_at=7)
    assert generation_lib.generations(single) == [3]
    double = str(tmp_path / "double")
    fit_in_process(BackupAndRestore(double, 2, True), crash_at=7)
    assert generation_lib.generations(double) == [3, 2]
    deleted = str(tmp_path / "deleted")
    fit_in_process(BackupAndRestore(deleted, save_freq=2))
    assert not os.path.exists(deleted)


def test_ram_filesystem(tmp_path):
    backup_dir = f"ram://keras_mgpu_test/{tmp_path.name}"
    full, _ = fit_in_process(BackupAndRestore(str(tmp_path / "full")))
    fit_in_process(BackupAndRestore(backup_dir, save_freq=5,
                                    double_checkpoint=True), crash_at=14)
    assert generation_lib.generations(backup_dir) == [2, 1]
    model, history = fit_in_process(BackupAndRestore(backup_dir))
    assert len(history.history["loss"]) == 2
    assert max_diff(model.get_weights(), full.get_weights()) <= 1e-6
    assert not tf.io.gfile.exists(backup_dir)


def test_callback_state_survives_a_restart(tmp_path):
    backup_dir = str(tmp_path / "b")
    stopper = keras.callbacks.EarlyStopping("loss", patience=50)
    checkpoint = keras.callbacks.ModelCheckpoint(
        str(tmp_path / "best.keras"), monitor="loss", save_best_only=True)
    fit_in_process(BackupAndRestore(backup_dir), crash_at=20,
                   extra_callbacks=[stopper, checkpoint])
    best, wait = stopper.best, stopper.wait
    assert best is not None and checkpoint.best == best
    fresh_stopper = keras.callbacks.EarlyStopping("loss", patience=50)
    fresh_checkpoint = keras.callbacks.ModelCheckpoint(
        str(tmp_path / "best.keras"), monitor="loss", save_best_only=True)
    seen = {}

    class Probe(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen.setdefault("state", (fresh_stopper.best, fresh_stopper.wait,
                                      fresh_checkpoint.best))

    fit_in_process(BackupAndRestore(backup_dir),
                   extra_callbacks=[fresh_stopper, fresh_checkpoint, Probe()])
    assert seen["state"] == (best, wait, best)


def test_different_architecture_is_refused_and_backup_kept(tmp_path):
    backup_dir = str(tmp_path / "b")
    fit_in_process(BackupAndRestore(backup_dir, save_freq=8), crash_at=12)
    before = backup_files(backup_dir)
    other = keras.Sequential([keras.Input((workers.FEATURES,)),
                              keras.layers.Dense(4), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="different variables"):
        fit_in_process(BackupAndRestore(backup_dir), model=other)
    assert backup_files(backup_dir) == before


def _rewrite_state(backup_dir, number, **changes):
    """Changes generation `number`'s state.json and re-signs its manifest."""
    import hashlib

    generation = generation_lib.generation_dir(backup_dir, number)
    state_path = os.path.join(generation, "state.json")
    state = json.load(open(state_path))
    state.update(changes)
    data = json.dumps(state).encode()
    open(state_path, "wb").write(data)
    manifest_path = os.path.join(generation, "MANIFEST.json")
    manifest = json.load(open(manifest_path))
    manifest["files"]["state.json"] = {
        "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    json.dump(manifest, open(manifest_path, "w"))
    return state_path


def test_incompatible_version_is_refused_and_backup_kept(tmp_path):
    backup_dir = str(tmp_path / "b")
    fit_in_process(BackupAndRestore(backup_dir, save_freq=8), crash_at=12)
    state_path = _rewrite_state(backup_dir, 1, format=99,
                                keras_mgpu_version="9.0.0")
    with pytest.raises(ValueError, match=r"keras-mgpu 9.0.0 in format 99; "
                       r"this keras-mgpu \(.*\) reads formats 2 and 3"):
        fit_in_process(BackupAndRestore(backup_dir))
    assert json.load(open(state_path))["format"] == 99


def test_a_format_2_backup_still_resumes(tmp_path):
    """Written before callback states had their own entries ("values", no
    callbacks.npz): resumed, its EarlyStopping state restored."""
    backup_dir = str(tmp_path / "b")
    stopper = keras.callbacks.EarlyStopping("loss", patience=50)
    fit_in_process(BackupAndRestore(backup_dir, save_freq=8),
                   crash_at=20, extra_callbacks=[stopper])
    newest = generation_lib.generations(backup_dir)[0]
    _rewrite_state(backup_dir, newest, format=2, callbacks=[
        {"class": "EarlyStopping",
         "values": {"wait": 7, "stopped_epoch": 0, "best": 0.25,
                    "best_epoch": 0}}])
    resumed = keras.callbacks.EarlyStopping("loss", patience=50)
    seen = {}

    class Peek(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.setdefault("wait", resumed.wait)

    model, _ = fit_in_process(BackupAndRestore(backup_dir),
                              extra_callbacks=[resumed, Peek()])
    assert seen["wait"] == 7
    assert int(model.optimizer.iterations.numpy()) == 24


def test_unwritable_backup_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(PermissionError, match="cannot write to backup_dir"):
        fit_in_process(BackupAndRestore(str(blocker / "backup")))


def test_presets():
    presets = list_presets()
    assert set(presets) >= {"epoch", "preemptible", "multi_worker"}
    cb = BackupAndRestore.from_preset("preemptible", "/tmp/x", keep=5)
    assert (cb.save_freq, cb.keep, cb.save_on_sigterm) == (
        presets["preemptible"]["save_freq"], 5, True)
    # Presets keep their explicit `keep`; keep=None falls back to the
    # Keras meaning of double_checkpoint.
    assert [BackupAndRestore.from_preset(name, "/tmp/x").keep
            for name in ("epoch", "preemptible", "multi_worker")] == [2, 2, 3]
    assert BackupAndRestore.from_preset("epoch", "/tmp/x",
                                        keep=None).keep == 1
    assert BackupAndRestore.from_preset("epoch", "/tmp/x", keep=None,
                                        double_checkpoint=True).keep == 2
    with pytest.raises(ValueError, match="needs keep >= 2, got keep=1"):
        BackupAndRestore.from_preset("epoch", "/tmp/x", keep=1,
                                     double_checkpoint=True)
    with pytest.raises(ValueError, match=r"Unknown .* 'spot'.*'epoch'"):
        BackupAndRestore.from_preset("spot", "/tmp/x")


def test_the_presets_local_tier_is_a_tenth_of_save_freq_in_ram():
    """`local_dir="auto"`: a folder under /dev/shm named after backup_dir
    (one per run), saving every tenth of save_freq; none where save_freq
    gives no room for more frequent saves."""
    first = BackupAndRestore.from_preset("preemptible", "/tmp/run1/backup")
    if not os.access("/dev/shm", os.W_OK):
        assert first.local_dir is None  # and the local tier off
        return
    again = BackupAndRestore.from_preset("multi_worker", "/tmp/run1/backup/")
    other = BackupAndRestore.from_preset("preemptible", "/tmp/run2/backup",
                                         save_freq=25)
    assert first.local_dir.startswith(f"/dev/shm/keras-mgpu-{os.getuid()}/")
    assert again.local_dir == first.local_dir != other.local_dir
    assert (first.local_save_freq, again.local_save_freq,
            other.local_save_freq) == (5, 20, 2)
    for save_freq in ("epoch", 1, False):
        off = BackupAndRestore.from_preset(
            "preemptible", "/tmp/x", save_freq=save_freq)
        assert (off.local_dir, off.local_save_freq) == (None, None)
    assert BackupAndRestore("/tmp/x", save_freq=50).local_dir is None


@pytest.mark.parametrize("kwargs, message", [
    ({"save_freq": 0}, "Invalid value for save_freq: 0. Use 'epoch', a "
     "positive number of batches, or False"),
    ({"save_freq": True}, "Invalid value for save_freq: True.*that is "
     "save_freq=1"),
    ({"save_freq": -2}, "Invalid value for save_freq: -2"),
    ({"save_freq": "batch"}, "Invalid value for save_freq: 'batch'"),
    ({"save_freq": 0.15}, "Invalid value for save_freq: 0.15"),
    ({"save_freq": False}, "save_freq=False makes no periodic saves: only "
     "the SIGTERM save, which needs save_on_sigterm=True"),
    ({"keep": 0}, "keep must be None or a positive integer, got 0"),
    ({"keep": 2.0}, "keep must be None or a positive integer, got 2.0"),
    ({"double_checkpoint": True, "keep": 1}, r"double_checkpoint=True keeps "
     r"the previous generation as a fallback, which needs keep >= 2, got "
     r"keep=1. Pass keep=2 \(or more, or leave keep=None\), or "
     "double_checkpoint=False"),
    ({"local_save_freq": 5}, "local_save_freq=5 needs local_dir: the folder "
     "on each machine for the local tier"),
    ({"local_dir": "gs://b/local", "save_freq": 10}, "local_dir='gs://b/local'"
     " is a URL: the local tier is a folder on each worker's own machine"),
    ({"local_dir": "/tmp/x/", "save_freq": 10}, "local_dir='/tmp/x/' is "
     "backup_dir: give the local tier a folder of its own"),
    ({"local_dir": "", "save_freq": 10}, "local_dir must be None, 'auto' or "
     "a non-empty path, got ''"),
    ({"local_dir": "/dev/shm/r", "save_freq": 10, "local_save_freq": 10},
     "local_save_freq=10 saves no more often than save_freq=10: the local "
     "tier would add nothing"),
    ({"local_dir": "/dev/shm/r", "save_freq": 10, "local_save_freq": 0},
     "local_save_freq must be None or a positive number of batches between "
     "local saves, got 0"),
    ({"local_dir": "/dev/shm/r"}, "local_dir needs local_save_freq with "
     "save_freq='epoch': pass the number of batches between local saves"),
    ({"local_dir": "/dev/shm/r", "save_freq": 1}, "local_dir needs "
     "local_save_freq with save_freq=1"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BackupAndRestore("/tmp/x", **kwargs)


@pytest.mark.parametrize("backup_dir, message", [
    ("gs://", "backup_dir='gs://' names a filesystem but no bucket or "
     "directory in it (the path would be a local folder named 'gs:'). Give "
     "the directory for this run's backups, e.g. 'gs://bucket/run1/backup'"),
    ("ram:///", "backup_dir='ram:///' names a filesystem but no bucket"),
    ("/", "backup_dir='/' is the filesystem root: BackupAndRestore creates "
     "and deletes its generations in backup_dir, and the directory itself "
     "after a finished run. Give a directory of its own, e.g. "
     "'/tmp/run1/backup'"),
    ("//", "backup_dir='//' is the filesystem root"),
])
def test_a_backup_dir_that_names_no_directory_is_refused(backup_dir, message):
    with pytest.raises(ValueError) as error:
        BackupAndRestore(backup_dir)
    assert message in str(error.value)


def test_pruning_and_cleanup_never_follow_links(tmp_path):
    """A `gen-*` link (a warm start pointing at an older run's generation)
    and a `.tmp-*` link in backup_dir: their targets survive every prune
    and the final cleanup; only the links go."""
    older = tmp_path / "older_run" / "gen-00000007"
    older.mkdir(parents=True)
    (older / "weights.weights.h5").write_bytes(b"the older run's only backup")
    # Committed there, as generation 7: here it is a damaged generation 1.
    (older / "MANIFEST.json").write_text('{"generation": 7, "files": {}}')
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "keep.txt").write_text("not backup_dir's")
    backup_dir = tmp_path / "backup"
    backup_dir.mkdir()
    os.symlink(older, backup_dir / "gen-00000001")
    os.symlink(scratch, backup_dir / ".tmp-1-0123abcd")

    x, y = workers.regression_data(64)
    model = workers.build_mlp()
    model.compile("sgd", "mse")
    backup = BackupAndRestore(str(backup_dir), save_freq=1, keep=1,
                              delete_checkpoint=False,
                              restart_if_unusable=True)
    with pytest.warns(UserWarning, match="Every backup generation .* "
                      "unusable: generation 1 "):
        model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                  callbacks=[backup])
    assert (older / "weights.weights.h5").read_bytes() == (
        b"the older run's only backup")
    assert (older / "MANIFEST.json").exists()
    assert (scratch / "keep.txt").read_text() == "not backup_dir's"
    assert not any(p.is_symlink() for p in backup_dir.iterdir())
    assert generation_lib.generations(str(backup_dir)) == [9]

    # The next run resumes from generation 9, finishes, and deletes its
    # backups: the link among them goes, its target stays.
    os.symlink(older, backup_dir / "gen-00000002")
    model.fit(x, y, batch_size=16, epochs=3, verbose=0,
              callbacks=[BackupAndRestore(str(backup_dir), save_freq=1)])
    assert int(model.optimizer.iterations.numpy()) == 12
    assert not backup_dir.exists()
    assert (older / "weights.weights.h5").exists()
    assert (older / "MANIFEST.json").exists()


_FIT_RAISES_THEN_SIGTERM = r"""
import os, signal, sys
import numpy as np, keras
from keras_mgpu.callbacks import BackupAndRestore

model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
crash = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: 1 / 0)
backup = BackupAndRestore(sys.argv[1], save_on_sigterm=True)
try:
    model.fit(np.ones((8, 2)), np.ones((8, 1)), verbose=0,
              callbacks=[backup, crash])
except ZeroDivisionError:
    print("fit raised", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
print("still alive", flush=True)
"""


def test_sigterm_after_a_failed_fit_terminates_the_process(tmp_path):
    """`fit` raised, so `on_train_end` never removed the SIGTERM handler: a
    later SIGTERM still terminates the process instead of being swallowed."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="-1")
    proc = subprocess.run(
        [sys.executable, "-c", _FIT_RAISES_THEN_SIGTERM,
         str(tmp_path / "backup")],
        capture_output=True, text=True, timeout=120, env=env)
    assert "fit raised" in proc.stdout, proc.stderr[-3000:]
    assert proc.returncode == -signal.SIGTERM, (proc.returncode,
                                                proc.stdout, proc.stderr[-3000:])


def corrupt_generations(backup_dir, model, x, y):
    """Two committed generations, then every one of them damaged."""
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[
        BackupAndRestore(str(backup_dir), save_freq=2, double_checkpoint=True,
                         delete_checkpoint=False)])
    numbers = generation_lib.generations(str(backup_dir))
    for number in numbers:
        path = backup_dir / f"gen-{number:08d}" / "weights.weights.h5"
        path.write_bytes(path.read_bytes()[:100])
    return numbers


def test_every_generation_unusable_is_an_error_not_a_silent_restart(tmp_path):
    x, y = workers.regression_data(64)
    model = workers.build_mlp()
    model.compile("sgd", "mse")
    backup_dir = tmp_path / "backup"
    numbers = corrupt_generations(backup_dir, model, x, y)
    assert numbers == [2, 1]
    before = sorted(p.name for p in backup_dir.iterdir())
    with pytest.warns(UserWarning, match="generation 2 .* falling back to "
                      "generation 1"):
        with pytest.raises(RuntimeError) as error:
            model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                      callbacks=[BackupAndRestore(str(backup_dir))])
    message = str(error.value)
    assert str(backup_dir) in message
    assert "generation 2 (weights.weights.h5 has 100 bytes" in message
    assert "generation 1 (" in message and "restart_if_unusable=True" in message
    assert sorted(p.name for p in backup_dir.iterdir()) == before

    start = int(model.optimizer.iterations.numpy())
    with pytest.warns(UserWarning, match="Training from the start"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0,
                  callbacks=[BackupAndRestore(str(backup_dir),
                                              restart_if_unusable=True)])
    assert int(model.optimizer.iterations.numpy()) == start + 4


def test_a_rerun_past_the_last_epoch_keeps_the_backups(tmp_path):
    x, y = workers.regression_data(64)
    model = workers.build_mlp()
    model.compile("sgd", "mse")
    backup_dir = tmp_path / "backup"
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[
        BackupAndRestore(str(backup_dir), delete_checkpoint=False)])
    saved = generation_lib.generations(str(backup_dir))
    with pytest.warns(UserWarning, match=r"at the start of epoch 3, but "
                      r"fit\(epochs=2\) ends with epoch 2: nothing is trained "
                      "and the backups are kept"):
        model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                  callbacks=[BackupAndRestore(str(backup_dir))])
    assert generation_lib.generations(str(backup_dir)) == saved
    assert int(model.optimizer.iterations.numpy()) == 8


@pytest.mark.parametrize("preset", [
    name for name, args in list_presets().items()
    if args.get("save_on_sigterm")])
@pytest.mark.parametrize("scheduler", sorted(RETRIED_EXIT_CODES))
def test_presets_exit_with_a_code_the_job_runners_rerun(preset, scheduler):
    """Each preset that exits on SIGTERM exits with a code every job runner
    in the table reruns by default; SLURM reruns none by default, and its
    row says how to list that code."""
    code = BackupAndRestore.from_preset(preset, "unused").exit_code
    row = RETRIED_EXIT_CODES[scheduler]
    if row.codes:
        assert code in row.codes, (preset, code, row)
    else:
        assert f"RequeueExit={code}" in row.note, (preset, code, row)


def test_docs_show_the_exit_code_table_as_the_data_says():
    from pathlib import Path

    from keras_mgpu.cluster import exit_codes as _exit_codes

    docs = (Path(__file__).parents[1] / "docs" / "backup.md").read_text()
    assert _exit_codes.exit_code_table() in docs, (
        "docs/backup.md's exit-code table differs from RETRIED_EXIT_CODES; "
        "paste keras_mgpu.cluster.exit_codes.exit_code_table() there.")


@pytest.mark.parametrize("kwargs, message", [
    ({"exit_code": 256}, "exit_code must be an integer from 0 to 255"),
    ({"exit_code": "75"}, "exit_code must be an integer"),
    ({"delete_checkpoint": "false"}, "delete_checkpoint must be True or "
                                     "False, got 'false'"),
    ({"save_on_sigterm": 1}, "save_on_sigterm must be True or False"),
    ({"double_checkpoint": 1}, "double_checkpoint must be True or False, "
     "got 1"),
    ({"delete_checkpoint": None}, "delete_checkpoint must be True or "
     "False, got None"),
    ({"restart_if_unusable": "yes"}, "restart_if_unusable must be True or "
     "False"),
])
def test_bad_flags_and_exit_codes_are_named(tmp_path, kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        BackupAndRestore(str(tmp_path), **kwargs)


def test_saves_and_restores_without_a_usable_tmpdir(tmp_path, monkeypatch):
    """Generations are staged in backup_dir itself: a TMPDIR that cannot
    hold a directory does not matter."""
    import tempfile

    not_a_dir = tmp_path / "tmpdir-is-a-file"
    not_a_dir.write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(not_a_dir))
    with pytest.raises(OSError):
        tempfile.mkdtemp()  # the fault is real
    full, _ = fit_in_process(BackupAndRestore(str(tmp_path / "full")))
    backup_dir = str(tmp_path / "backup")
    fit_in_process(BackupAndRestore(backup_dir, save_freq=4), crash_at=13)
    assert generation_lib.generations(backup_dir)
    resumed, _ = fit_in_process(BackupAndRestore(backup_dir, save_freq=4))
    assert int(resumed.optimizer.iterations.numpy()) == 24
    assert max_diff(resumed.get_weights(), full.get_weights()) <= 1e-6


_FULL_BACKUP_DIR = r"""
import resource, signal, sys
import numpy as np, keras
from keras_mgpu.callbacks import BackupAndRestore
from tests import workers

model = workers.build_mlp()
model.compile("sgd", "mse")
x, y = workers.regression_data(64)
if sys.argv[2] == "full":
    # No file may grow past 4 KiB (a weights file is bigger): writes fail
    # with EFBIG, as on a full disk, instead of killing the process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
model.fit(x, y, batch_size=16, epochs=int(sys.argv[3]), verbose=0,
          callbacks=[BackupAndRestore(sys.argv[1], save_freq=2,
                                      double_checkpoint=True,
                                      delete_checkpoint=False)])
print("finished", flush=True)
"""


def test_a_save_to_a_full_backup_dir_stops_clearly_and_keeps_the_last(
        tmp_path):
    backup_dir = tmp_path / "backup"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="-1")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def run_script(disk, epochs):
        return subprocess.run(
            [sys.executable, "-c", _FULL_BACKUP_DIR, str(backup_dir), disk,
             str(epochs)], capture_output=True, text=True, timeout=120,
            env=env, cwd=repo)

    first = run_script("roomy", 1)
    assert "finished" in first.stdout, first.stderr[-3000:]
    saved = generation_lib.generations(str(backup_dir))
    assert saved == [2, 1]
    for attempt in range(2):  # a restart fails the same way, and says so
        failed = run_script("full", 2)
        assert failed.returncode == 1, failed.stderr[-3000:]
        assert ("BackupAndRestore could not write generation 3 to "
                f"{backup_dir}/.tmp-3-") in failed.stderr
        assert "File too large" in failed.stderr
        assert "Generation 2 is intact" in failed.stderr
        assert generation_lib.generations(str(backup_dir)) == saved
        assert not [p for p in os.listdir(backup_dir) if p.startswith(".tmp")]
    finished = run_script("roomy", 2)
    assert "finished" in finished.stdout, finished.stderr[-3000:]


def test_a_backup_dir_replaced_during_training_is_not_called_intact(
        tmp_path):
    """The folder removed and a file put in its place after the first
    save: the failed save says no generation is left (it said
    "Generation 1 is intact", and the rerun started over)."""
    backup_dir = tmp_path / "backup"
    x, y = workers.regression_data(64)

    class Replace(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:  # after the save at batch 2's end is written
                workers.finish_backup_writes()
                shutil.rmtree(backup_dir)
                backup_dir.write_text("not a folder")

    model = workers.build_mlp()
    model.compile("sgd", "mse")
    with pytest.raises(RuntimeError) as error:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[
            BackupAndRestore(str(backup_dir), save_freq=2), Replace()])
    message = str(error.value)
    assert f"BackupAndRestore could not write to {backup_dir} (" in message
    assert "is intact" not in message
    assert f"No committed generation is left in {backup_dir}" in message


class _CrashAfter(keras.callbacks.Callback):
    def __init__(self, batches):
        super().__init__()
        self.batches = batches

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == self.batches:
            raise RuntimeError("crash")


def _sgd_mlp(dropout=False, accum_steps=None):
    keras.utils.set_random_seed(3)
    model = workers.build_mlp()
    if dropout:
        model = keras.Sequential([keras.Input((workers.FEATURES,)),
                                  keras.layers.Dropout(0.1), model])
    if accum_steps:
        from keras_mgpu import GradientAccumulationModel

        model = GradientAccumulationModel(model, accum_steps=accum_steps)
    model.compile(keras.optimizers.SGD(0.05), "mse")
    return model


def _crash_mid_epoch(backup_dir, x, y, **model_kwargs):
    """Batches of 16, saved and killed after 4 of the epoch's 8 batches."""
    with pytest.raises(RuntimeError, match="crash"):
        _sgd_mlp(**model_kwargs).fit(x, y, batch_size=16, epochs=2, shuffle=False,
                       verbose=0, callbacks=[
                           BackupAndRestore(str(backup_dir), save_freq=4),
                           _CrashAfter(4)])
    workers.finish_backup_writes()


def test_a_resume_with_another_batch_size_skips_the_same_samples(tmp_path):
    x, y = workers.regression_data(128)
    _crash_mid_epoch(tmp_path / "b", x, y)
    resumed = _sgd_mlp()
    with pytest.warns(UserWarning, match="saved after 64 samples of epoch 1 "
                      r"\(4 batches of 16\); this run's batches hold 32: "
                      "skipping 2 batches, the same 64 samples"):
        resumed.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                    callbacks=[BackupAndRestore(str(tmp_path / "b"))])
    # The same samples in the same batches, trained once each.
    expected = _sgd_mlp()
    for begin, end, size in ((0, 64, 16), (64, 128, 32), (0, 128, 32)):
        expected.fit(x[begin:end], y[begin:end], batch_size=size,
                     shuffle=False, verbose=0)
    assert int(resumed.optimizer.iterations.numpy()) == 4 + 2 + 4
    assert max_diff(resumed.get_weights(), expected.get_weights()) < 1e-6


def test_a_batch_size_that_cannot_skip_exactly_is_refused(tmp_path):
    x, y = workers.regression_data(128)
    backup_dir = tmp_path / "b"
    _crash_mid_epoch(backup_dir, x, y)
    files = backup_files(backup_dir)
    model = _sgd_mlp()
    with pytest.raises(ValueError) as error:
        model.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0,
                  callbacks=[BackupAndRestore(str(backup_dir))])
    assert ("saved after 64 samples of epoch 1 (4 batches of 16); this run's "
            "batches hold 24, and no whole number of them is 64 samples"
            ) in str(error.value)
    assert "Resume with the saved global batch size 16" in str(error.value)
    assert backup_files(backup_dir) == files
    # Refused before it trained anything: only the restored 4 steps.
    assert int(model.optimizer.iterations.numpy()) == 4


@pytest.mark.parametrize("change, message", [
    (lambda m: m.compile(keras.optimizers.Adam(0.05), "mse"),
     "optimizer SGD -> Adam"),
    (lambda m: m.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse"),
     "optimizer momentum 0.0 -> 0.9"),
    (lambda m: m.compile(keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.05, 10, 0.5)), "mse"),
     "optimizer learning_rate.class_name None -> 'ExponentialDecay'"),
    ("dropout", "holds 0 random-generator state(s) (Dropout, noise and "
     "other random layers); this model has 1"),
    ("accum_steps", "accum_steps 1 -> 2"),
])
def test_a_resume_that_would_change_the_math_is_refused(tmp_path, change,
                                                        message):
    x, y = workers.regression_data(128)
    backup_dir = tmp_path / "b"
    accumulating = change == "accum_steps"
    _crash_mid_epoch(backup_dir, x, y, accum_steps=1 if accumulating else None)
    files = backup_files(backup_dir)
    model = _sgd_mlp(dropout=change == "dropout",
                     accum_steps=2 if accumulating else None)
    if callable(change):
        change(model)
    with pytest.raises(ValueError) as error:
        model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                  callbacks=[BackupAndRestore(str(backup_dir))])
    assert message in str(error.value)
    assert "new backup_dir" in str(error.value)
    assert backup_files(backup_dir) == files


def test_one_callback_across_fits_and_a_recompile(tmp_path, monkeypatch):
    """A callback given to several fits walks the model once while it
    saves the same objects, and again after a recompile with a new
    optimizer: the save then holds the new optimizer's state, and the run
    resumes exactly."""
    from keras_mgpu import compat

    walks = []
    walk = compat.weights_layout
    monkeypatch.setattr(compat, "weights_layout",
                        lambda model: walks.append(1) or walk(model))
    x, y = workers.regression_data(128)
    backup_dir = str(tmp_path / "b")
    model = _sgd_mlp()
    callback = BackupAndRestore(backup_dir, save_freq=4)
    for _ in range(2):
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                  callbacks=[callback])
    assert len(walks) == 1
    start = model.get_weights()
    model.compile(keras.optimizers.Adam(0.05), "mse")
    with pytest.raises(RuntimeError, match="crash"):
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                  callbacks=[callback, _CrashAfter(12)])
    assert len(walks) == 2

    def adam_model():
        fresh = _sgd_mlp()
        fresh.set_weights(start)
        fresh.compile(keras.optimizers.Adam(0.05), "mse")
        return fresh

    resumed, reference = adam_model(), adam_model()
    resumed.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                callbacks=[BackupAndRestore(backup_dir)])
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert int(resumed.optimizer.iterations.numpy()) == 16
    for a, b in zip(resumed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_a_learning_rate_changed_by_a_callback_still_resumes(tmp_path):
    x, y = workers.regression_data(128)
    backup_dir = str(tmp_path / "b")
    model = _sgd_mlp()
    model.optimizer.learning_rate.assign(0.01)  # as ReduceLROnPlateau does
    with pytest.raises(RuntimeError, match="crash"):
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[
            BackupAndRestore(backup_dir, save_freq=4), _CrashAfter(4)])
    resumed = _sgd_mlp()
    resumed.fit(x, y, batch_size=16, epochs=2, verbose=0,
                callbacks=[BackupAndRestore(backup_dir)])
    assert float(resumed.optimizer.learning_rate.numpy()) == pytest.approx(
        0.01)
    assert int(resumed.optimizer.iterations.numpy()) == 16


# --- steps_per_execution and the shape of the data ----------------------------

_PARTIAL_FULL = {}


@pytest.fixture(scope="module")
def forks(tmp_path_factory):
    """Runs killed in forks of one process that imported TensorFlow
    (`backup_workers.serve_forks`): seconds less per run than a fresh
    interpreter."""
    server = backup_workers.Forks(str(tmp_path_factory.mktemp("forks")))
    yield server
    server.close()


@pytest.mark.parametrize("data", ["numpy", "unknown_length"])
def test_a_save_at_a_partial_execution_resumes_exactly(forks, tmp_path, data):
    """13 batches per epoch in calls of 3: each epoch's last call holds one
    batch (Keras reports it as batch 14). Killed right after that call's
    save in epoch 0 and again in epoch 1, then resumed: numpy arrays, and a
    dataset of unknown length (saved mid-epoch there: its end is not known
    until the data runs out)."""
    if not _PARTIAL_FULL:
        _PARTIAL_FULL.update(backup_workers.train_partial_executions(
            str(tmp_path / "full")))
    full = _PARTIAL_FULL
    # The runtime counts what trained: 13 steps per epoch, not 15 or 18.
    assert full["iterations"] == full["global_step"] == 39
    backup_dir = str(tmp_path / "backup")
    for kill_at in (13, 26):
        marker = f"STEP {kill_at};"
        code, lines = forks.run(
            target="train_partial_executions",
            kill_when=lambda line: 0.0 if line == marker else None,
            backup_dir=backup_dir, data=data, kill_at=kill_at)
        assert code == -signal.SIGKILL and marker in lines, (
            code, lines[-10:], forks.stderr()[-3000:])
    resumed = backup_workers.train_partial_executions(backup_dir, data)
    assert resumed["iterations"] == resumed["global_step"] == 39
    assert max_diff(resumed["weights"], full["weights"]) <= 1e-5


class _CrashAtStep(keras.callbacks.Callback):
    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        from keras_mgpu.runtime import training_runtime

        if training_runtime(self.model).global_step >= self.step:
            raise RuntimeError("crash")


def _fit_reshaped(backup_dir=None, crash_at=None, spe=1, samples=128,
                  infinite=False, unknown_length=False, built=None):
    """3 epochs of 8 batches of 16 (of `samples`); `infinite`: the data
    repeated, with steps_per_epoch=8. The model goes into `built` too."""
    x, y = workers.regression_data(samples)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    steps = {}
    if infinite:
        dataset, steps = dataset.repeat(), {"steps_per_epoch": 8}
    if unknown_length:
        dataset = dataset.filter(lambda *_: True)
    model = workers.build_mlp()
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse",
                  steps_per_execution=spe)
    if built is not None:
        built.append(model)
    callbacks = []
    if backup_dir is not None:
        callbacks.append(BackupAndRestore(str(backup_dir), save_freq=1))
    if crash_at is None:
        model.fit(dataset, epochs=3, verbose=0, callbacks=callbacks, **steps)
        return model
    with pytest.raises(RuntimeError, match="crash"):
        model.fit(dataset, epochs=3, verbose=0,
                  callbacks=callbacks + [_CrashAtStep(crash_at)], **steps)
    workers.finish_backup_writes()
    return model


@pytest.mark.parametrize("first, crash_at, rerun", [
    # Calls of 5 over 8 batches: the epoch's second call holds 3.
    ({"spe": 5}, 8, {"spe": 5}),
    # Calls of 5 with steps_per_epoch=8 over repeated data: each epoch reads
    # 10 batches, and the next one reads on from the same iterator.
    ({"spe": 5, "infinite": True}, 15, {"spe": 5, "infinite": True}),
    # Saved at batch 3 of epoch 1, resumed in calls of 2.
    ({"spe": 1}, 11, {"spe": 2}),
], ids=["spe5_finite", "spe5_steps_per_epoch", "spe_1_to_2"])
def test_a_resume_with_steps_per_execution_is_exact(tmp_path, first,
                                                    crash_at, rerun):
    full = _fit_reshaped(**first)
    _fit_reshaped(tmp_path / "b", crash_at=crash_at, **first)
    resumed = _fit_reshaped(tmp_path / "b", **rerun)
    assert (int(resumed.optimizer.iterations.numpy())
            == int(full.optimizer.iterations.numpy()))
    assert max_diff(resumed.get_weights(), full.get_weights()) <= 1e-5


@pytest.mark.parametrize("first, crash_at, rerun, message", [
    # Saved after 96 samples of epoch 2; the rerun's epochs hold 64.
    ({}, 14, {"samples": 64}, "saved after 96 samples of epoch 2 (6 batches "
     "of 16); this run's epochs hold 4 batches of 16: this run's data is "
     "shorter than the saved run's"),
    ({"unknown_length": True}, 14, {"samples": 64, "unknown_length": True},
     "saved after 96 samples of epoch 2 (6 batches of 16); this run's data "
     "ended after 4 of them: this run's data is shorter than the saved "
     "run's"),
    # Epoch 1 began 10 batches into the repeated data; the rerun reads the
    # data afresh each epoch.
    ({"spe": 5, "infinite": True}, 15, {"spe": 5},
     "saved after 80 samples of epoch 2 (5 batches of 16), which began 10 "
     "batches into data that steps_per_epoch read on across epochs; this "
     "run reads its data afresh each epoch"),
], ids=["known_length", "unknown_length", "without_steps_per_epoch"])
def test_a_resume_on_data_it_cannot_continue_is_refused(
        tmp_path, first, crash_at, rerun, message):
    backup_dir = tmp_path / "b"
    crashed = _fit_reshaped(backup_dir, crash_at=crash_at, **first)
    files = backup_files(backup_dir)
    built = []
    with pytest.raises(ValueError) as error:
        _fit_reshaped(backup_dir, built=built, **rerun)
    text = str(error.value)
    assert message in text
    assert "Nothing was trained" in text and "new backup_dir" in text
    assert backup_files(backup_dir) == files
    # Refused before training: the model as restored, as the crash left it.
    # (Keras's own iterations count one more step per epoch of unknown
    # length than it trained, where the data's end fails a step.)
    refused = built[0]
    assert (int(refused.optimizer.iterations.numpy())
            == int(crashed.optimizer.iterations.numpy()))
    assert max_diff(refused.get_weights(), crashed.get_weights()) == 0


_HOLD_BACKUP_DIR = r"""
import sys
import time
import keras
from keras_mgpu.callbacks import BackupAndRestore
from tests import workers

x, y = workers.regression_data(64)
model = workers.build_mlp()
model.compile("sgd", "mse")
hold = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: (
    batch == 1 and (workers.finish_backup_writes(), print("HOLDING",
                    flush=True), sys.stdin.readline())))
model.fit(x, y, batch_size=16, epochs=1, verbose=0,
          callbacks=[BackupAndRestore(sys.argv[1], save_freq=1), hold])
print("DONE", flush=True)
"""


def _wait_for_line(proc, text, timeout=120):
    import selectors

    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if selector.select(deadline - time.monotonic()):
            line = proc.stdout.readline()
            if text in line:
                return
            if not line:
                break  # the child exited
    proc.kill()
    raise AssertionError(f"no {text!r} from the child: "
                         f"{proc.communicate()[1][-3000:]}")


def test_a_second_live_run_on_one_backup_dir_is_refused(tmp_path):
    from keras_mgpu.callbacks import BackupDirInUse

    backup_dir = tmp_path / "b"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="-1",
               PYTHONPATH=os.getcwd())
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLD_BACKUP_DIR, str(backup_dir)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env)
    try:
        _wait_for_line(child, "HOLDING")
        files = sorted(p.name for p in backup_dir.iterdir())
        x, y = workers.regression_data(64)
        model = workers.build_mlp()
        model.compile("sgd", "mse")
        with pytest.raises(BackupDirInUse) as error:
            model.fit(x, y, batch_size=16, epochs=1, verbose=0,
                      callbacks=[BackupAndRestore(str(backup_dir))])
        assert (f"backup_dir {backup_dir} is in use by another run: pid "
                f"{child.pid} on host ") in str(error.value)
        assert sorted(p.name for p in backup_dir.iterdir()) == files
        assert int(model.optimizer.iterations.numpy()) == 0
        out, err = child.communicate("go\n", timeout=120)
    finally:
        child.kill()
    assert child.returncode == 0 and "DONE" in out, err[-3000:]
    # The owner finished and released it: the directory is free again.
    model.fit(x, y, batch_size=16, epochs=1, verbose=0,
              callbacks=[BackupAndRestore(str(backup_dir))])


def test_the_folder_is_claimed_before_anything_is_written(tmp_path,
                                                          monkeypatch):
    """The owner lock comes before the write probe: the loser of two runs
    started at once named the folder unwritable (its probe file swept by
    the winner's restore), not the owner."""
    from keras_mgpu.callbacks.backup import store as store_lib

    backup_dir = tmp_path / "b"
    locked_at_probe = []
    probe = store_lib.GenerationStore.check_writable

    def check_writable(self):
        locked_at_probe.append((backup_dir / "LOCK.json").exists())
        return probe(self)

    monkeypatch.setattr(store_lib.GenerationStore, "check_writable",
                        check_writable)
    x, y = workers.regression_data(32)
    model = workers.build_mlp()
    model.compile("sgd", "mse")
    model.fit(x, y, batch_size=16, verbose=0,
              callbacks=[BackupAndRestore(str(backup_dir))])
    assert locked_at_probe == [True]
    # An unwritable folder, where the lock cannot be taken: named as that
    # by test_unwritable_backup_dir.


def test_two_fits_of_one_process_on_one_backup_dir(tmp_path):
    """A fit on another thread holds the folder: a second fit there is
    refused, naming this process (both trained into it, both wrote the
    same generations). Once the first is done (returned, or raised and
    never released the lock), the folder is free."""
    import threading

    from keras_mgpu.callbacks import BackupDirInUse

    backup_dir = str(tmp_path / "b")
    x, y = workers.regression_data(64)
    started, finish = threading.Event(), threading.Event()
    outcome = {}

    class Hold(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            started.set()
            assert finish.wait(timeout=workers.HOLD_SECONDS)

    def first():
        model = workers.build_mlp()
        model.compile("sgd", "mse")
        try:
            model.fit(x, y, batch_size=16, epochs=1, verbose=0,
                      callbacks=[BackupAndRestore(backup_dir), Hold()])
        except BaseException as e:  # shown by the assertion below
            outcome["error"] = e

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert started.wait(timeout=workers.HOLD_SECONDS)
        model = workers.build_mlp()
        model.compile("sgd", "mse")
        with pytest.raises(BackupDirInUse,
                           match=r"is in use by another run of this "
                                 rf"process: pid {os.getpid()} "):
            model.fit(x, y, batch_size=16, epochs=1, verbose=0,
                      callbacks=[BackupAndRestore(backup_dir)])
        assert int(model.optimizer.iterations.numpy()) == 0
    finally:
        finish.set()
        thread.join(timeout=workers.HOLD_SECONDS)
    assert not thread.is_alive() and "error" not in outcome, outcome

    class Boom(Exception):
        pass

    class Raise(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise Boom()

    with pytest.raises(Boom):  # keeps its lock: on_train_end never runs
        model.fit(x, y, batch_size=16, epochs=1, verbose=0,
                  callbacks=[BackupAndRestore(backup_dir), Raise()])
    model.fit(x, y, batch_size=16, epochs=1, verbose=0,
              callbacks=[BackupAndRestore(backup_dir)])


def test_each_save_is_the_state_of_its_step_while_training_goes_on(
        tmp_path, monkeypatch):
    """Each background write is held until the training thread needs it
    done (the next save, or the end of fit), two batches later: every
    generation still holds what Keras's own `save_weights` wrote at its
    save step, and no two writes ever overlap."""
    import threading

    import h5py

    backup_dir = tmp_path / "b"
    release = threading.Semaphore(0)
    overlaps = []

    class Held(BackupAndRestore):
        def _write_generation(self, *args):
            assert release.acquire(timeout=workers.HOLD_SECONDS)
            return super()._write_generation(*args)

        def _finish_write(self, durable=True):
            if self._write is not None and not self._write.done():
                release.release()  # the one write in flight may go on
            return super()._finish_write(durable)

    original_write = writer.BackgroundWrite

    def start_write(*args):
        overlaps.append([t.name for t in threading.enumerate()
                         if t.name == "keras-mgpu-backup-write"])
        return original_write(*args)

    monkeypatch.setattr(writer, "BackgroundWrite", start_write)
    reference = {}  # global step -> Keras's save_weights, same moment

    class Reference(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            path = tmp_path / f"step{step}.weights.h5"
            self.model.save_weights(str(path))
            reference[step] = path

    x, y = workers.regression_data(128)
    model = workers.build_mlp()
    model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
              callbacks=[Held(str(backup_dir), save_freq=2, keep=100,
                              delete_checkpoint=False), Reference()])
    assert overlaps == [[]] * 8  # 16 steps / 2, none started beside another
    generations = generation_lib.generations(str(backup_dir))
    assert generations == list(range(8, 0, -1))
    kernel = "layers/dense/vars/0"
    for number in generations:
        state, files = generation_lib.read_generation(
            str(backup_dir), number)
        step = state["runtime"]["global_step"]
        assert step == 2 * number
        with h5py.File(reference[step], "r") as theirs, h5py.File(
                backup_dir / f"gen-{number:08d}" / "weights.weights.h5",
                "r") as ours:
            names = []
            theirs.visititems(lambda name, item: names.append(name)
                              if isinstance(item, h5py.Dataset) else None)
            assert kernel in names and len(names) > 10
            for name in names:
                np.testing.assert_array_equal(ours[name][()],
                                              theirs[name][()], err_msg=name)
            if step + 2 in reference:
                # Training moved on while this generation was written.
                with h5py.File(reference[step + 2], "r") as later:
                    assert not np.array_equal(ours[kernel][()],
                                              later[kernel][()])


_CRASH_WITH_A_WRITE_IN_FLIGHT = r"""
import sys
import threading
import keras
from keras_mgpu.callbacks import BackupAndRestore
from keras_mgpu import _fs
from tests import workers

# The write of the step-4 generation is held until the exception that ends
# the script has reached the top: only the process's exit can let it finish.
release = threading.Event()
write = _fs.write_file
def held_write(path, data):
    if "/.tmp-2-" in path:
        assert release.wait(timeout=workers.HOLD_SECONDS)
    write(path, data)
_fs.write_file = held_write
hook = sys.excepthook
def excepthook(*args):
    hook(*args)
    print("UNCAUGHT", flush=True)
    release.set()
sys.excepthook = excepthook

class Crash(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == 4:
            raise RuntimeError("crash")

x, y = workers.regression_data(128)
model = workers.build_mlp()
model.compile(keras.optimizers.Adam(0.01), "mse")
model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
          callbacks=[BackupAndRestore(sys.argv[1], save_freq=2), Crash()])
"""


def test_an_exception_in_fit_lets_the_write_in_flight_commit(tmp_path):
    backup_dir = tmp_path / "b"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="-1")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    crashed = subprocess.run(
        [sys.executable, "-c", _CRASH_WITH_A_WRITE_IN_FLIGHT,
         str(backup_dir)], capture_output=True, text=True, timeout=120,
        env=env, cwd=repo)
    assert crashed.returncode == 1, crashed.stderr[-3000:]
    assert "RuntimeError: crash" in crashed.stderr
    assert "UNCAUGHT" in crashed.stdout
    # The process waited for the write of the step-4 save before it ended.
    assert generation_lib.generations(str(backup_dir)) == [2]
    assert not [p for p in os.listdir(backup_dir) if p.startswith(".tmp")]
    # Released as the process exited: a rerun has no dead owner to take
    # over from (and says nothing about one).
    assert not (backup_dir / "LOCK.json").exists()
    state, _ = generation_lib.read_generation(str(backup_dir), 2)
    assert state["runtime"]["global_step"] == 4
    resumed, _ = fit_in_process(BackupAndRestore(str(backup_dir)), epochs=2)
    full, _ = fit_in_process(BackupAndRestore(str(tmp_path / "full")),
                             epochs=2)
    assert int(resumed.optimizer.iterations.numpy()) == 16
    assert max_diff(resumed.get_weights(), full.get_weights()) <= 1e-6
