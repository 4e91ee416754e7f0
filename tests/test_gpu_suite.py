"""benchmarks/gpu_suite.py: the dry run's files and figures, budgets, errors.

The dry run runs once for the module (about a minute on 2 CPU cores), in a
subprocess, as a user would run it. A GPU check of the logger's memory
telemetry, which the suite's `gpu_tests` part runs, is at the end.
"""

import json
import math
import os
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITE = os.path.join(REPO, "benchmarks", "gpu_suite.py")
PARTS = ["machine", "gpu_tests", "resnet50", "logical_gpus", "overheads"]
POLICIES = ["float32", "mixed_float16", "mixed_bfloat16"]
# The dry run's whole wall time is meant to stay under a minute; this is the
# hard limit.
DRY_RUN_TIMEOUT = 180


def run_suite(*args, out_env=None, timeout=DRY_RUN_TIMEOUT, python=()):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="-1")
    env.pop("OUT", None)
    env.pop("TF_CONFIG", None)
    if out_env is not None:
        env["OUT"] = out_env
    proc = subprocess.Popen([sys.executable, *python, SUITE, *args],
                            cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM: the suite stops its running part and writes its files.
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
        pytest.fail(f"gpu_suite.py {' '.join(args)} ran past {timeout} s:\n"
                    f"{stdout[-3000:]}\n{stderr[-5000:]}")
    return proc.returncode, stdout, stderr


def positive(value):
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_suite")
    code, stdout, stderr = run_suite("--dry-run", "--out", str(out))
    assert code == 0, f"dry run failed ({code}):\n{stdout[-3000:]}\n" \
                      f"{stderr[-5000:]}"
    with open(out / "gpu_suite.json") as f:
        payload = json.load(f)
    return payload, (out / "gpu_suite.md").read_text(), stdout


def test_dry_run_writes_every_part_ok(dry_run):
    payload, _, stdout = dry_run
    assert payload["schema"] == "keras-mgpu-gpu-suite/1"
    assert payload["mode"] == "dry-run"
    assert list(payload["parts"]) == PARTS
    for name, part in payload["parts"].items():
        assert part["status"] == "ok", (name, part["note"])
        assert sorted(part) == ["budget_s", "note", "results", "seconds",
                                "status"]
        assert positive(part["seconds"]) and positive(part["budget_s"])
        assert isinstance(part["results"], dict)
        # The budgets are printed as each part starts.
        assert f"{name}: budget" in stdout
    assert payload["seconds"] <= payload["budget_s"]
    assert sum(p["seconds"] for p in payload["parts"].values()) <= \
        payload["seconds"]


# The keys the module docstring documents: the GPU run writes the same.
KEYS = {
    "top": ["budget_s", "command", "date", "machine", "mode", "parts",
            "schema", "seconds"],
    "machine": ["cpu_count", "cuda_version", "cudnn_version",
                "driver_version", "gpus", "interconnect", "keras",
                "keras_mgpu", "python", "reason", "tensorflow",
                "tensorflow_gpus"],
    "machine_results": ["doctor", "driver_reason", "driver_version"],
    "gpu_tests": ["collected", "command", "duration_s", "errors", "failed",
                  "failures", "mode", "passed", "skipped", "tests"],
    "resnet50": ["batch_size", "classes", "configs", "device", "image_size",
                 "memory_reason", "model", "model_params", "repeats",
                 "steps", "tensor_float_32", "trained", "trained_params",
                 "warmup_steps"],
    "resnet50_config": ["epoch_seconds", "error", "examples_per_s",
                        "jit_compile", "memory_ratio", "peak_memory_bytes",
                        "policy", "seconds", "speedup", "start_memory_bytes",
                        "status", "step_ms"],
    "logical_gpus": ["all_reduce", "device_kind", "devices", "exactness",
                     "memory_limit_mib"],
    "exactness": ["accum_steps", "max_abs_weight_diff", "micro_batch",
                  "micro_batches", "runs", "tolerance"],
    "exactness_run": ["max_abs_weight_diff", "optimizer", "optimizer_steps",
                      "reference_moved", "tensor_float_32"],
    "all_reduce": ["accum_steps", "executed", "expected", "micro_batches"],
    "overheads": ["backup", "batch_size", "configs", "device",
                  "epochs_per_fit", "jit_compile", "model", "params",
                  "ratios", "rounds", "steps_per_epoch",
                  "timed_epochs_per_fit"],
    "overheads_config": ["epoch_s", "examples_per_s", "name", "step_ms"],
    "overheads_ratio": ["against", "median", "name", "of", "q1", "q3"],
}


def test_dry_run_results_have_the_documented_keys(dry_run):
    payload = dry_run[0]
    parts = payload["parts"]
    found = {
        "top": payload, "machine": payload["machine"],
        "machine_results": parts["machine"]["results"],
        "gpu_tests": parts["gpu_tests"]["results"],
        "resnet50": parts["resnet50"]["results"],
        "resnet50_config": parts["resnet50"]["results"]["configs"][0],
        "logical_gpus": parts["logical_gpus"]["results"],
        "exactness": parts["logical_gpus"]["results"]["exactness"],
        "exactness_run":
            parts["logical_gpus"]["results"]["exactness"]["runs"][0],
        "all_reduce": parts["logical_gpus"]["results"]["all_reduce"],
        "overheads": parts["overheads"]["results"],
        "overheads_config": parts["overheads"]["results"]["configs"][0],
        "overheads_ratio": parts["overheads"]["results"]["ratios"][0],
    }
    for name, keys in KEYS.items():
        assert sorted(found[name]) == keys, name


def test_dry_run_machine_has_no_gpu_figures(dry_run):
    payload, _, _ = dry_run
    machine = payload["machine"]
    assert machine["gpus"] == [] and machine["tensorflow_gpus"] == 0
    assert machine["driver_version"] is None and machine["reason"]
    assert machine["tensorflow"] and machine["keras"]
    results = payload["parts"]["machine"]["results"]
    assert results["doctor"]["schema"] == "keras-mgpu-doctor/1"
    assert results["driver_version"] is None and results["driver_reason"]


def test_dry_run_collects_the_gpu_tests(dry_run):
    results = dry_run[0]["parts"]["gpu_tests"]["results"]
    assert results["mode"] == "collect-only"
    assert results["collected"] == len(results["tests"]) >= 10
    assert all(t.startswith("tests/") and "::" in t for t in results["tests"])
    assert ("tests/test_fp32_output_head.py::"
            "test_nonfinite_counts_show_in_fit_logs[1]" in results["tests"])
    assert ("tests/test_gpu_suite.py::"
            "test_logger_records_gpu_memory_where_a_gpu_exists"
            in results["tests"])
    # Nothing ran: no counts made up.
    for key in ("passed", "failed", "skipped", "errors", "duration_s"):
        assert results[key] is None


def test_dry_run_resnet_figures(dry_run):
    results = dry_run[0]["parts"]["resnet50"]["results"]
    # ResNet-50 as the GPU run builds it (224x224, 1000 classes).
    assert results["model_params"] == 25_636_712
    assert results["trained_params"] < results["model_params"]
    assert results["tensor_float_32"] is None and results["memory_reason"]
    configs = results["configs"]
    assert sorted((c["policy"], c["jit_compile"]) for c in configs) == sorted(
        (p, jit) for jit in (False, True) for p in POLICIES)
    # The baseline runs first.
    assert (configs[0]["policy"], configs[0]["jit_compile"]) == (
        "float32", False)
    for c in configs:
        assert c["status"] == "ok", c
        assert positive(c["examples_per_s"]) and positive(c["step_ms"])
        assert positive(c["speedup"])
        assert c["peak_memory_bytes"] is None and c["memory_ratio"] is None
    assert configs[0]["speedup"] == 1.0


def test_dry_run_logical_devices_are_exact_with_one_all_reduce_per_step(
        dry_run):
    results = dry_run[0]["parts"]["logical_gpus"]["results"]
    assert results["device_kind"] == "CPU" and len(results["devices"]) == 2
    assert results["memory_limit_mib"] is None
    exact = results["exactness"]
    assert exact["runs"]
    for run in exact["runs"]:
        assert run["tensor_float_32"] is None
        assert run["optimizer_steps"] == 6
        # The reference moved, so a small difference means something.
        assert run["reference_moved"] > 1e-2
    assert 0 <= exact["max_abs_weight_diff"] <= 1e-5
    reduce = results["all_reduce"]
    assert reduce["executed"] == {
        "plain": {"all_reduces": 12, "optimizer_steps": 12,
                  "per_optimizer_step": 1.0},
        "accumulated": {"all_reduces": 3, "optimizer_steps": 3,
                        "per_optimizer_step": 1.0}}


def test_dry_run_overhead_ratios(dry_run):
    results = dry_run[0]["parts"]["overheads"]["results"]
    assert results["rounds"] >= 1
    names = [c["name"] for c in results["configs"]]
    assert names == ["plain fit", "keras gradient_accumulation_steps=4",
                     "GradientAccumulationModel(accum_steps=4)",
                     "GradientAccumulationModel(accum_steps=4, "
                     "mode='in_step')",
                     "DistributedLogger(update_freq=1)",
                     "DistributedLogger(update_freq=100)",
                     "BackupAndRestore(save_freq=100)"]
    for c in results["configs"]:
        assert positive(c["epoch_s"]) and positive(c["examples_per_s"])
    pairs = [(r["of"], r["against"]) for r in results["ratios"]]
    assert pairs == [(names[2], names[0]), (names[1], names[0]),
                     (names[2], names[1]), (names[3], names[0]),
                     (names[3], names[1]), (names[3], names[2]),
                     (names[4], names[0]), (names[5], names[0]),
                     (names[6], names[0])]
    for r in results["ratios"]:
        assert positive(r["median"]) and r["q1"] <= r["median"] <= r["q3"]
    # Each timed epoch of the backup configuration held a save.
    assert results["backup"]["saves"] >= results["rounds"] * (
        results["timed_epochs_per_fit"])
    assert positive(results["backup"]["stall_ms"])


def test_dry_run_markdown_names_every_part(dry_run):
    payload, markdown, _ = dry_run
    assert markdown.startswith("# keras-mgpu GPU suite")
    assert "Mode: dry-run" in markdown
    for name in PARTS:
        assert f"## {name}" in markdown
        assert f"| {name} | ok |" in markdown
    for config in payload["parts"]["overheads"]["results"]["ratios"]:
        assert config["name"] in markdown


def test_a_tiny_budget_skips_parts_and_still_writes_the_files(tmp_path):
    env_out, out = tmp_path / "from_env", tmp_path / "from_flag"
    code, stdout, stderr = run_suite("--dry-run", "--budget-s", "0.05",
                                     "--out", str(out),
                                     out_env=str(env_out), timeout=60)
    assert code == 1, stderr
    # --out wins over $OUT.
    assert not env_out.exists()
    with open(out / "gpu_suite.json") as f:
        payload = json.load(f)
    assert list(payload["parts"]) == PARTS
    for name, part in payload["parts"].items():
        assert part["status"] == "skipped", name
        assert "budget" in part["note"], part["note"]
    assert payload["machine"]["reason"]
    markdown = (out / "gpu_suite.md").read_text()
    for name in PARTS:
        assert f"| {name} | skipped |" in markdown


def test_a_python_without_tensorflow_gets_one_clear_note(tmp_path):
    # -S: no site-packages, so neither TensorFlow nor Keras is found.
    code, _, stderr = run_suite("--out", str(tmp_path), python=("-S",),
                                timeout=60)
    assert code == 1, stderr
    with open(tmp_path / "gpu_suite.json") as f:
        payload = json.load(f)
    assert payload["mode"] == "gpu"
    for name, part in payload["parts"].items():
        assert part["status"] == "skipped", name
        assert "has no tensorflow, keras" in part["note"]
        assert "pip install" in part["note"]


@pytest.mark.parametrize("args, env_out, message", [
    ((), None, "pass --out DIR or set $OUT"),
    (("--budget-s", "0"), "unused", "--budget-s must be a positive number"),
])
def test_usage_errors_name_the_problem(args, env_out, message, tmp_path):
    code, _, stderr = run_suite(*args, out_env=env_out and str(tmp_path),
                                timeout=60)
    assert code == 2
    assert message in stderr


@pytest.mark.gpu
def test_logger_records_gpu_memory_where_a_gpu_exists(tmp_path):
    """DistributedLogger's memory figures, on a GPU (on a CPU they are {}:
    tests/test_distributed_logger.py)."""
    import keras
    import numpy as np
    import tensorflow as tf

    from keras_mgpu.callbacks import DistributedLogger

    if not tf.config.list_logical_devices("GPU"):
        pytest.skip("no GPU visible: the logger records no memory on CPUs")
    x = np.random.RandomState(0).rand(256, 16).astype("float32")
    y = (x.sum(axis=1) > 8).astype("int64")
    # The default strategy: the model lives on GPU:0.
    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(2)])
    model.compile("adam",
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    log_dir = str(tmp_path / "logs")
    model.fit(x, y, batch_size=32, epochs=2, verbose=0,
              callbacks=[DistributedLogger(log_dir, update_freq=4,
                                           console=False)])
    assert "GPU" in model.trainable_variables[0].value.device.upper()
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert {r["kind"] for r in records} == {"goodput", "window", "epoch"}
    for record in records:
        memory = record["memory"]["GPU0"]
        # The weights and optimizer state stay on the GPU between steps.
        assert 0 < memory["current_bytes"] <= memory["peak_bytes"]
