"""`keras-mgpu doctor` and `keras-mgpu bench`, and the console script.

GPU machines are exercised through recorded `nvidia-smi` output in
`tests/fixtures/nvidia_smi/`; the bench runs for real on logical CPUs once,
with tiny steps. The console script (`keras_mgpu.cli:main`) runs as installed, in
child processes: `--help` and argument errors must not import TensorFlow,
and `quiet_tensorflow` is checked against the real TensorFlow's start-up
lines and against a stand-in `tensorflow` module that prints known ones.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from keras_mgpu import _args
from keras_mgpu import _bench
from keras_mgpu import _doctor
from keras_mgpu import cli
from tests.conftest import allow_in_children

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "nvidia_smi")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CPU = {"name": "/physical_device:CPU:0", "type": "CPU"}
# What TensorFlow 2.21 prints while `import tensorflow` loads its libraries.
ABSL_BANNER = "WARNING: All log messages before absl::InitializeLog() is called"
INFO_LINE = re.compile(r"^I\d{4} ", re.MULTILINE)


def fixture_text(name):
    with open(os.path.join(FIXTURES, name)) as f:
        return f.read()


def smi_runner(box):
    """A fake nvidia-smi answering from the recorded files of `box`."""
    topo, query = fixture_text(f"{box}_topo.txt"), fixture_text(
        f"{box}_query.txt")
    return lambda args: topo if args[0] == "topo" else query


def tf_gpus_like(box):
    """TensorFlow's device list on `box`: what get_device_details would say."""
    gpus = _doctor.parse_gpu_query(fixture_text(f"{box}_query.txt"))
    return [CPU] + [
        {"name": f"/physical_device:GPU:{g['index']}", "type": "GPU",
         "device_name": g["name"], "compute_capability": g["compute_capability"]}
        for g in gpus]


def codes(report, level=None):
    return [f["code"] for f in report["findings"]
            if level is None or f["level"] == level]


# --- nvidia-smi parsing ---------------------------------------------------------


@pytest.mark.parametrize("box, count, kind, pcie", [
    ("a100_8x_nvlink", 8, "nvlink", []),
    ("p100_4x_pcie", 4, "pcie", ["NODE", "PHB", "SYS"]),
    ("t4_2x", 2, "pcie", ["PHB"]),
])
def test_parse_topology_fixtures(box, count, kind, pcie):
    topo = _doctor.parse_topology(fixture_text(f"{box}_topo.txt"))
    assert topo["gpus"] == [f"GPU{i}" for i in range(count)]
    assert topo["kind"] == kind
    assert topo["pcie_links"] == pcie
    matrix = topo["matrix"]
    # NIC rows and affinity columns are not part of the GPU matrix.
    assert [len(row) for row in matrix] == [count] * count
    for i in range(count):
        assert matrix[i][i] == "X"
        for j in range(count):
            assert matrix[i][j] == matrix[j][i]
    if box == "a100_8x_nvlink":
        assert matrix[0][7] == "NV12"


def test_parse_topology_variants():
    assert _doctor.parse_topology("") is None
    assert _doctor.parse_topology("No devices were found\n") is None
    # Copied from a terminal: spaces instead of tabs, ANSI bold header.
    text = ("\x1b[4m\tGPU0\tGPU1\tGPU2\x1b[0m\n"
            "GPU0     X      NV2     PHB    0-7\n"
            "GPU1    NV2      X      PHB    0-7\n"
            "GPU2    PHB     PHB      X     0-7\n")
    topo = _doctor.parse_topology(text)
    assert topo["kind"] == "mixed"
    assert topo["matrix"][0] == ["X", "NV2", "PHB"]
    with pytest.raises(ValueError, match="GPU rows"):
        _doctor.parse_topology("\tGPU0\tGPU1\nGPU0\t X \tNV1\n")


@pytest.mark.parametrize("box, name, memory, cc", [
    ("a100_8x_nvlink", "NVIDIA A100-SXM4-80GB", 81920, [8, 0]),
    ("p100_4x_pcie", "Tesla P100-PCIE-16GB", 16384, [6, 0]),
    ("t4_2x", "Tesla T4", 15360, [7, 5]),
])
def test_parse_gpu_query_fixtures(box, name, memory, cc):
    gpus = _doctor.parse_gpu_query(fixture_text(f"{box}_query.txt"))
    assert [g["index"] for g in gpus] == list(range(len(gpus)))
    assert {g["name"] for g in gpus} == {name}
    assert {g["memory_mib"] for g in gpus} == {memory}
    assert all(g["compute_capability"] == cc for g in gpus)
    assert gpus[0]["pci_bus_id"].startswith("00000000:")


def test_parse_gpu_query_without_header_or_compute_cap():
    gpus = _doctor.parse_gpu_query("0, Tesla V100-SXM2-16GB, 16160, 7.0\n")
    assert gpus[0]["memory_mib"] == 16160
    assert gpus[0]["compute_capability"] == [7, 0]
    old_driver = ("index, name, memory.total [MiB], pci.bus_id\n"
                  "0, Tesla K80, 11441 MiB, 00000000:00:04.0\n")
    assert _doctor.parse_gpu_query(old_driver)[0]["compute_capability"] is None


# --- doctor: the report -------------------------------------------------------------


def test_doctor_a100_nvlink_box():
    report = _doctor.collect(nvidia_smi_runner=smi_runner("a100_8x_nvlink"),
                             devices=tf_gpus_like("a100_8x_nvlink"), env={})
    assert report["ok"]
    assert report["interconnect"]["kind"] == "nvlink"
    assert len(report["gpus"]) == 8
    assert report["gpus"][0]["memory_mib"] == 81920
    assert report["strategy"]["kind"] == "mirrored"
    assert "8 GPUs" in report["strategy"]["description"]
    assert report["mixed_precision"]["policy"] == "mixed_bfloat16"
    assert "pcie_only" not in codes(report)
    assert "mixed_precision_unsupported" not in codes(report)
    json.dumps(report)  # JSON-ready


def test_doctor_pcie_box_advises_hierarchical_all_reduce():
    report = _doctor.collect(nvidia_smi_runner=smi_runner("p100_4x_pcie"),
                             devices=tf_gpus_like("p100_4x_pcie"), env={})
    assert report["ok"]  # warnings, no error
    warnings = {f["code"]: f for f in report["findings"]
                if f["level"] == "warning"}
    assert set(warnings) == {"pcie_only", "mixed_precision_unsupported"}
    assert "HierarchicalCopyAllReduce" in warnings["pcie_only"]["advice"]
    assert "6.0" in warnings["mixed_precision_unsupported"]["message"]
    text = _doctor.format_report(report)
    assert "GPU3  SYS   SYS   NODE  X" in text
    assert "[warning] 4 GPUs linked over PCIe only" in text


def test_doctor_two_gpu_pcie_box_is_not_warned():
    report = _doctor.collect(nvidia_smi_runner=smi_runner("t4_2x"),
                             devices=tf_gpus_like("t4_2x"), env={})
    assert codes(report, "warning") == []
    assert "mixed_precision_float16" in codes(report, "info")
    assert report["mixed_precision"]["policy"] == "mixed_float16"


def test_doctor_gpus_that_tensorflow_cannot_see():
    report = _doctor.collect(nvidia_smi_runner=smi_runner("t4_2x"),
                             devices=[CPU], env={"CUDA_VISIBLE_DEVICES": ""})
    assert codes(report, "warning") == ["gpus_invisible_to_tensorflow"]
    assert [g["visible_to_tensorflow"] for g in report["gpus"]] == [False] * 2
    assert report["strategy"]["kind"] == "default"


def test_doctor_on_this_cpu_machine():
    report = _doctor.collect(nvidia_smi_runner=lambda args: None, env={})
    assert report["nvidia_smi"] is False
    assert report["gpus"] == [] and report["interconnect"] is None
    assert any(d["type"] == "CPU" for d in report["devices"])
    no_gpu = next(f for f in report["findings"] if f["code"] == "no_gpu")
    assert "virtual_cpus=N" in no_gpu["advice"]
    assert report["strategy"]["kind"] == "default"
    assert report["keras_backend"] == "tensorflow"
    for name in ("Python", "TensorFlow", "Keras", "KerasTuner", "xprof",
                 "wandb"):
        assert report["software"][name]


def test_doctor_tf_config():
    bad = _doctor.collect(nvidia_smi_runner=lambda args: None, devices=[CPU],
                          env={"TF_CONFIG": '{"cluster": {"worker": ["a"]}}'})
    assert not bad["ok"]
    assert codes(bad, "error") == ["tf_config_invalid"]
    assert "'a'" in bad["findings"][0]["message"]
    assert bad["strategy"]["kind"] is None
    good = _doctor.collect(
        nvidia_smi_runner=lambda args: None, devices=[CPU],
        env={"TF_CONFIG": json.dumps({
            "cluster": {"chief": ["h0:1"], "worker": ["h1:1", "h2:1"]},
            "task": {"type": "worker", "index": 1}})})
    assert good["ok"]
    assert good["strategy"]["kind"] == "multi_worker"
    assert good["cluster"]["num_workers"] == 3
    assert good["cluster"]["worker_index"] == 2
    assert not good["cluster"]["is_chief"]


SRUN_STEP = {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1",
             "SLURM_LOCALID": "1", "SLURM_JOB_ID": "600",
             "SLURM_STEP_NODELIST": "node7",
             "SLURM_STEP_TASKS_PER_NODE": "2"}


def test_doctor_reads_the_cluster_where_auto_strategy_does():
    """Under `srun` without TF_CONFIG, the step's cluster (it said "not
    set: a single process" and "the default strategy" while
    `auto_strategy()` built 2 workers)."""
    step = _doctor.collect(nvidia_smi_runner=lambda args: None,
                           devices=[CPU], env=SRUN_STEP)
    assert step["ok"] and step["cluster"]["source"] == "SLURM step"
    assert step["strategy"]["kind"] == "multi_worker"
    assert (step["cluster"]["num_workers"], step["cluster"]["worker_index"]
            ) == (2, 1)
    text = _doctor.format_report(step)
    assert "Cluster (SLURM step)" in text and "node7:20000" in text
    bad = _doctor.collect(nvidia_smi_runner=lambda args: None, devices=[CPU],
                          env={**SRUN_STEP, "SLURM_STEP_NODELIST": "n[2-1]"})
    assert codes(bad, "error") == ["slurm_invalid"]
    assert "[2-1]" in bad["findings"][0]["message"]
    # TF_CONFIG comes first, as in auto_strategy().
    both = _doctor.collect(
        nvidia_smi_runner=lambda args: None, devices=[CPU],
        env={**SRUN_STEP, "TF_CONFIG": '{"cluster": {"worker": ["a"]}}'})
    assert codes(both, "error") == ["tf_config_invalid"]
    alone = _doctor.collect(nvidia_smi_runner=lambda args: None,
                            devices=[CPU], env={})
    assert alone["cluster"]["source"] is None
    assert "no SLURM step" in _doctor.format_report(alone)


def test_doctor_missing_optional_package(monkeypatch):
    monkeypatch.setitem(_doctor.OPTIONAL_PACKAGES, "wandb",
                        ("surely-not-installed-wandb",))
    quiet = _doctor.collect(nvidia_smi_runner=lambda args: None,
                            devices=[CPU], env={})
    assert quiet["software"]["wandb"] == "not installed"
    assert "missing_wandb" in codes(quiet, "info") and quiet["ok"]
    needed = _doctor.collect(nvidia_smi_runner=lambda args: None,
                             devices=[CPU], env={}, need=["wandb", "tuner"])
    assert codes(needed, "error") == ["missing_wandb"]
    assert not needed["ok"]
    with pytest.raises(ValueError, match="'gpu'"):
        _doctor.collect(nvidia_smi_runner=lambda args: None, devices=[CPU],
                        env={}, need=["gpu"])


# --- doctor: the command ---------------------------------------------------------


def test_doctor_command_json_and_exit_codes(capsys, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert cli.main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schema"] == _doctor.SCHEMA and report["ok"]
    monkeypatch.setenv("TF_CONFIG", "{not json")
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "[error] TF_CONFIG is malformed" in out


def test_doctor_command_with_recorded_nvidia_smi(capsys, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert cli.main([
        "doctor",
        "--nvidia-smi-topo", os.path.join(FIXTURES, "p100_4x_pcie_topo.txt"),
        "--nvidia-smi-query", os.path.join(FIXTURES, "p100_4x_pcie_query.txt"),
        "--assume-tf-sees-smi-gpus"]) == 0
    out = capsys.readouterr().out
    assert "Tesla P100-PCIE-16GB" in out
    assert "MirroredStrategy over 4 GPUs" in out
    assert "HierarchicalCopyAllReduce" in out


def test_doctor_need_rejects_unknown_feature(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["doctor", "--need", "tuner,gpus"])
    assert e.value.code == 2
    assert "'gpus'" in capsys.readouterr().err


# --- bench: arguments ---------------------------------------------------------------


@pytest.mark.parametrize("argv, named", [
    (["--replicas", "0"], "0 is out of range"),
    (["--replicas", "1,two"], "'two'"),
    (["--replicas", "65"], "65 is out of range"),
    (["--precision", "fp64"], "'fp64'"),
    (["--precision", "float32,"], "''"),
    (["--model", "vgg"], "'vgg'"),
    (["--accum", "0"], "--accum: 0"),
    (["--steps", "0"], "--steps: '0'"),
    (["--batch-size", "-4"], "--batch-size: '-4'"),
    (["--precision", "mixed"], "--precision mixed_bfloat16"),
    (["--accum", "99999999999999999999"],
     "--accum: 99999999999999999999 is out of range; each value must be "
     "from 1 to 1000000"),
    (["--steps", "99999999999999999999"],
     "--steps: 99999999999999999999 is out of range; it must be from 1 to "
     "1000000"),
    (["--timeout", str(10**30)], "--timeout: 1000000000000000000000000000000 "
                                 "is out of range"),
    (["--json", "/nonexistent/dir/out.json"],
     "--json: cannot write '/nonexistent/dir/out.json': the directory "
     "'/nonexistent/dir' does not exist. Create it"),
    (["--json", "{tmp}"], "--json: '{tmp}' is a directory; give a file path "
                          "in it, e.g. '{tmp}/bench.json'"),
    (["--plot", "/nonexistent/dir/out.png"],
     "--plot: cannot write '/nonexistent/dir/out.png'"),
    (["--plot", "{tmp}"], "--plot: '{tmp}' is a directory"),
    (["--plot", "{tmp}/chart.json"],
     "--plot: '{tmp}/chart.json' does not end in an image format "
     "matplotlib writes; use e.g. '{tmp}/chart.png'"),
    (["--json", "{tmp}/b.json", "--plot", "{tmp}/b.json"],
     "--json and --plot name the same file"),
])
def test_bench_argument_errors(argv, named, capsys, monkeypatch, tmp_path):
    def run_children(*args, **kwargs):
        raise AssertionError("the benchmark ran before its arguments and "
                             "output paths were checked")

    monkeypatch.setattr(_bench, "run_children", run_children)
    argv = [a.format(tmp=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert named.format(tmp=tmp_path) in err, err
    assert os.listdir(tmp_path) == []  # the checks leave nothing behind


def test_bench_prints_its_results_when_the_json_file_vanished_meanwhile(
        tmp_path, monkeypatch, capsys):
    """The output paths are checked first; if one still cannot be written
    after the run, the results are printed, not lost."""
    folder = tmp_path / "out"
    folder.mkdir()
    payload = fake_payload(on_gpu=False)

    def run_children(settings, policies, timeout, log):
        folder.rmdir()  # removed while the benchmark ran
        return [{"gpus": [], "results": [r for r in payload["results"]
                                         if r["replicas"] == n]}
                for n in settings["replicas"]]

    monkeypatch.setattr(_bench, "run_children", run_children)
    code = cli.main(["bench", "--replicas", "1,2,4", "--precision",
                     "float32,mixed_bfloat16", "--json",
                     str(folder / "bench.json")])
    out, err = capsys.readouterr()
    assert code == 1
    assert f"could not write --json '{folder / 'bench.json'}'" in err
    assert "the results are printed above" in err
    printed = json.loads(out[out.index("{"):])
    _bench.validate(printed)
    assert ([r["examples_per_s"] for r in printed["results"]]
            == [r["examples_per_s"] for r in payload["results"]])


def test_resolve_precisions_uses_choose_policy():
    assert _bench.resolve_precisions(["mixed"], [(7, 5)]) == {
        "mixed": "mixed_float16"}
    assert _bench.resolve_precisions(["mixed_bfloat16"], []) == {
        "mixed_bfloat16": "mixed_bfloat16"}
    with pytest.raises(ValueError, match="compute capability 6.0"):
        _bench.resolve_precisions(["mixed"], [(6, 0)])


# --- bench: results, schema, plot (no child processes) --------------------------


def fake_payload(on_gpu=True):
    settings = {"model": "resnet", "replicas": [1, 2, 4],
                "precisions": ["float32", "mixed"], "accum": [1],
                "batch_size": 32, "steps": 10, "repeats": 3,
                "warmup_steps": 3}
    policies = {"float32": "float32", "mixed": "mixed_bfloat16"}
    rates = {("float32", 1): 1000.0, ("float32", 2): 1900.0,
             ("float32", 4): 3600.0, ("mixed", 1): 2500.0,
             ("mixed", 2): 4500.0, ("mixed", 4): 8000.0}
    outputs = []
    for n in settings["replicas"]:
        results = []
        for precision, policy in policies.items():
            rate = rates[(precision, n)]
            results.append({
                "replicas": n, "precision": precision, "policy": policy,
                "accum_steps": 1, "global_batch_size": 32 * n,
                "epoch_seconds": [320 * n / rate] * 3,
                "step_time_ms": 32000.0 * n / rate, "examples_per_s": rate,
                "scaling_efficiency": None,
                "peak_memory_bytes": ((2 if precision == "float32" else 1)
                                      * 2**30 if on_gpu else None),
                "input_examples_per_s": 1e6, "input_wait_fraction": 0.01})
        outputs.append({"gpus": ["NVIDIA A100-SXM4-80GB"] * n if on_gpu
                        else [], "results": results})
    return _bench.combine(settings, policies, outputs, on_gpu)


def test_combine_efficiency_and_mixed_precision():
    payload = fake_payload()
    _bench.validate(payload)
    eff = {(r["precision"], r["replicas"]): r["scaling_efficiency"]
           for r in payload["results"]}
    assert eff[("float32", 1)] == pytest.approx(1.0)
    assert eff[("float32", 2)] == pytest.approx(0.95)
    assert eff[("float32", 4)] == pytest.approx(0.9)
    assert eff[("mixed", 4)] == pytest.approx(0.8)
    mixed = {m["replicas"]: m for m in payload["mixed_precision"]}
    assert mixed[1]["speedup"] == pytest.approx(2.5)
    assert mixed[1]["peak_memory_change"] == pytest.approx(-0.5)
    assert payload["device"]["kind"] == "gpu" and payload["notes"] == []
    table = _bench.format_table(payload)
    assert "mixed_bfloat16 speed-up 2.50x, peak memory -50%" in table
    cpu = fake_payload(on_gpu=False)
    assert cpu["mixed_precision"][0]["peak_memory_change"] is None
    assert "not GPU performance" in _bench.format_table(cpu)


@pytest.mark.parametrize("mutate, named", [
    (lambda p: p.update(schema="v0"), "schema"),
    (lambda p: p.pop("results"), "'results'"),
    (lambda p: p["results"][0].pop("examples_per_s"), "'examples_per_s'"),
    (lambda p: p["results"][1].update(replicas="2"), "results[1].replicas"),
    (lambda p: p["results"][0].update(epoch_seconds=[]), "epoch_seconds"),
    (lambda p: p["settings"].update(model="vgg"), "settings.model"),
    (lambda p: p["device"].update(logical_cpus="no"), "device.logical_cpus"),
    (lambda p: p["mixed_precision"][0].update(speedup=None),
     "mixed_precision[0].speedup"),
    (lambda p: p["input_wait"].pop("note"), "'note'"),
    (lambda p: p["results"][0].update(input_wait_fraction="1%"),
     "results[0].input_wait_fraction"),
])
def test_validate_names_the_broken_field(mutate, named):
    payload = fake_payload()
    mutate(payload)
    with pytest.raises(ValueError) as e:
        _bench.validate(payload)
    assert named in str(e.value)


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "scaling.png"
    _bench.plot(fake_payload(), str(path))
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 10_000


def test_plot_axes_start_at_zero_and_efficiency_is_in_percent():
    import matplotlib.pyplot as plt

    fig = _bench.figure(fake_payload())
    try:
        throughput, efficiency = fig.axes
        # The lowest throughput is 1000 examples/s: autoscaling alone would
        # start the axis near it.
        assert throughput.get_ylim()[0] == 0
        assert throughput.get_ylim()[1] >= 8000
        assert "%" in efficiency.get_ylabel()
        assert efficiency.get_ylim() == (0, 110)
        curves = {line.get_label(): list(line.get_ydata())
                  for line in efficiency.get_lines()}
        # As the table shows them: 100%, 95%, 90% for float32.
        assert curves["float32"] == pytest.approx([100, 95, 90])
        assert curves["mixed_bfloat16"] == pytest.approx([100, 90, 80])
        assert list(curves["ideal"]) == [100, 100]
    finally:
        plt.close(fig)


# --- bench: end to end on logical CPUs -----------------------------------------


def check_bench_files(out, png, stdout):
    """What `keras-mgpu bench --replicas 1,2 --json OUT --plot PNG` leaves on
    logical CPUs. docs/cli.md's command runs as pasted
    (tests/test_docs_commands.py) and is checked here: running a second
    bench only for these checks would train the same workload again."""
    assert "not GPU performance" in stdout
    assert "examples/s" in stdout
    payload = json.loads(out.read_text())
    _bench.validate(payload)
    assert payload["device"] == {**payload["device"], "kind": "cpu",
                                 "logical_cpus": True, "gpus": []}
    results = {r["replicas"]: r for r in payload["results"]}
    assert sorted(results) == [1, 2]
    assert results[1]["scaling_efficiency"] == pytest.approx(1.0)
    assert results[2]["global_batch_size"] == (
        2 * results[1]["global_batch_size"])
    assert results[2]["scaling_efficiency"] > 0
    assert all(r["peak_memory_bytes"] is None for r in results.values())
    # DistributedLogger's input wait, read from its records for every
    # configuration: a fetch takes time, so a fraction above 0.
    assert all(0 < r["input_wait_fraction"] < 1 for r in results.values())
    assert "fixed cost of fetching a ready batch" in stdout
    # The CPU note, once, under the table.
    assert stdout.count("not GPU performance") == 1
    data = png.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000


# --- The console script: no TensorFlow before the arguments parse -----------------


def console_script() -> str:
    """The installed `keras-mgpu`, checked to be the TensorFlow-free entry."""
    path = os.path.join(os.path.dirname(sys.executable), "keras-mgpu")
    assert os.path.exists(path), (
        f"No console script at {path}: install the package, e.g. "
        "`pip install -e .`.")
    with open(path) as f:
        text = f.read()
    assert "from keras_mgpu.cli import main" in text, (
        f"{path} is an older install: reinstall with `pip install -e .`.")
    return path


def imported_modules(stderr: str) -> set:
    """Top-level modules named in `-X importtime` output."""
    return {m.group(1).split(".")[0]
            for m in re.finditer(r"^import time:.*\|\s*(\S+)\s*$", stderr,
                                 re.MULTILINE)}


@pytest.mark.parametrize("argv, code, named", [
    (["--help"], 0, "{doctor,bench,launch,goodput}"),
    (["launch", "--help"], 0, "--max-restarts"),
    (["launch", "--workers", "2"], 2, "no command to run: put it after '--'"),
    (["launch", "--workers", "0", "--", "true"], 2,
     "--workers: '0' is not a positive integer"),
    (["launch", "--workers", "2", "--max-restarts", "-1", "--", "true"], 2,
     "--max-restarts: '-1' is not an integer >= 0"),
    (["launch", "--workers", "2", "--hang-timeout", "5", "--", "true"], 2,
     "--hang-timeout and --progress-file go together"),
    (["launch", "--workers", "2", "--backoff", "nan", "--", "true"], 2,
     "--backoff: 'nan' is not a number of seconds"),
    (["launch", "--workers", "2", "--", "no-such-program-here", "x"], 2,
     "the command 'no-such-program-here' is not found on PATH"),
    (["launch", "--workers", "2", "--", "./no/such/train.py"], 2,
     "the command './no/such/train.py' does not exist"),
    (["launch", "--workers", "2", "--", "README.md"], 2,
     "the command 'README.md' is not found on PATH"),
    (["launch", "--workers", "2", "--", "./README.md"], 2,
     "the command './README.md' is not an executable file"),
    (["bench", "--help"], 0, "--replicas"),
    (["doctor", "--help"], 0, "--need"),
    (["bench", "--replicas", "0"], 2, "--replicas: 0 is out of range"),
    (["bench", "--model", "vgg"], 2, "'vgg'"),
    (["doctor", "--need", "foo"], 2, "--need: unknown value 'foo'"),
    (["bench", "--json", "/nonexistent/dir/out.json"], 2,
     "the directory '/nonexistent/dir' does not exist"),
    (["bench", "--accum", "99999999999999999999"], 2,
     "--accum: 99999999999999999999 is out of range"),
    ([], 2, "required: {doctor,bench,launch,goodput}"),
])
def test_console_script_answers_without_tensorflow(argv, code, named):
    env = dict(os.environ, PYTHONPROFILEIMPORTTIME="1")
    done = subprocess.run([console_script(), *argv], capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode == code, done.stderr[-3000:]
    assert named in (done.stdout if code == 0 else done.stderr)
    modules = imported_modules(done.stderr)
    assert "keras_mgpu" in modules  # the import log is read right
    assert not {"tensorflow", "keras"} & modules


def test_moved_names_are_the_same_objects():
    # Defined once, in keras_mgpu._args; the old homes keep working.
    assert _bench.parse_int_list is _args.parse_int_list
    assert _bench.parse_choice_list is _args.parse_choice_list
    assert _bench.MODELS is _args.MODELS
    assert _bench.PRECISIONS is _args.PRECISIONS
    assert _bench.MAX_REPLICAS == _args.MAX_REPLICAS
    assert _doctor.FEATURES is _args.FEATURES
    assert set(_doctor.FEATURES) == {"tuner", "profile", "wandb"}
    assert all(name in _doctor.OPTIONAL_PACKAGES
               for names in _doctor.FEATURES.values() for name in names)
    assert cli.build_parser is _args.build_parser


# --- quiet_tensorflow --------------------------------------------------------------


def run_quiet_tensorflow(level=None, path=()):
    """`quiet_tensorflow()`, then `import tensorflow`, in a fresh interpreter.

    Returns:
        The exit code, stdout's lines (TF_CPP_MIN_LOG_LEVEL afterwards, and
        whether quiet_tensorflow imported TensorFlow) and stderr.

    `level`: TF_CPP_MIN_LOG_LEVEL as the user set it (`None`: unset).
    `path`: folders put first on sys.path (a stand-in `tensorflow`).
    """
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="-1")
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    if level is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = level
    env["PYTHONPATH"] = os.pathsep.join(
        [*map(str, path), env.get("PYTHONPATH", "")])
    # Prints the level and whether quiet_tensorflow imported TensorFlow,
    # then imports it (if it did not) as the program would.
    code = textwrap.dedent("""
        import os, sys
        import keras_mgpu
        try:
            keras_mgpu.quiet_tensorflow()
        finally:
            print(os.environ.get("TF_CPP_MIN_LOG_LEVEL"))
            print("tensorflow" in sys.modules, flush=True)
        import tensorflow
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=120, env=env)
    return done.returncode, done.stdout.splitlines(), done.stderr


def test_quiet_tensorflow_hides_the_real_start_up_lines():
    # The control: with the user's level 0, TensorFlow prints its lines.
    code, out, loud = run_quiet_tensorflow(level="0")
    assert code == 0 and out == ["0", "True"], loud
    if ABSL_BANNER not in loud and not INFO_LINE.search(loud):
        pytest.skip("this TensorFlow prints nothing while it loads")
    # Unset, or 3 as exported to silence TensorFlow (which alone does not
    # hide what it prints while it loads).
    for level in (None, "3"):
        code, out, quiet = run_quiet_tensorflow(level)
        assert code == 0 and out == ["3", "True"], (level, quiet)
        assert ABSL_BANNER not in quiet, level
        assert not INFO_LINE.search(quiet), (level, quiet)
        assert "To enable the following instructions:" not in quiet, level


FAKE_TENSORFLOW = """
import os, sys
for line in ({lines!r}):
    os.write(2, (line + "\\n").encode())
sys.stderr.write("python-level warning from the import\\n")
if {fail!r}:
    raise ImportError("stand-in tensorflow failed to load")
"""
FAKE_LINES = (
    ABSL_BANNER + " are written to STDERR",
    "I0000 00:00:1796161893.639087    5602 port.cc:153] oneDNN custom "
    "operations are on.",
    "I0000 00:00:1796161893.715587    5602 cpu_feature_guard.cc:227] This "
    "TensorFlow binary is optimized to use available CPU instructions.",
    "To enable the following instructions: AVX2 FMA, in other operations, "
    "rebuild TensorFlow with the appropriate compiler flags.",
    "W0000 00:00:1796161893.8    5602 something.cc:1] a warning to keep",
    "E0000 00:00:1796161893.9    5602 cuda_platform.cc:52] an error to keep",
)


def fake_tensorflow(tmp_path, fail=False):
    folder = tmp_path / "fake"
    folder.mkdir()
    (folder / "tensorflow.py").write_text(
        FAKE_TENSORFLOW.format(lines=FAKE_LINES, fail=fail))
    return folder


@pytest.mark.parametrize("level, shown", [
    # Unset: quiet_tensorflow sets 3, which hides INFO, WARNING and ERROR.
    (None, []),
    ("3", []),
    # A stricter or looser level the user set wins, line by line.
    ("2", [FAKE_LINES[5]]),
    ("1", [FAKE_LINES[4], FAKE_LINES[5]]),
    ("0", list(FAKE_LINES)),
    # Not an integer: 0, as TensorFlow reads it.
    ("verbose", list(FAKE_LINES)),
])
def test_quiet_tensorflow_applies_the_level_to_the_start_up_lines(
        level, shown, tmp_path):
    code, out, err = run_quiet_tensorflow(level=level,
                                          path=[fake_tensorflow(tmp_path)])
    assert code == 0 and out == ["3" if level is None else level, "True"], err
    # Python's own output during the import is never hidden.
    assert err.splitlines() == [*shown, "python-level warning from the import"]


def test_quiet_tensorflow_after_tensorflow_warns(tmp_path):
    code = textwrap.dedent("""
        import warnings
        import tensorflow
        from keras_mgpu import quiet_tensorflow
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet_tensorflow()
        print(caught[0].message)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(fake_tensorflow(tmp_path)), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert "called after TensorFlow was imported" in done.stdout
    assert "Call it first" in done.stdout


def test_quiet_tensorflow_shows_everything_when_the_import_fails(tmp_path):
    code, out, err = run_quiet_tensorflow(
        path=[fake_tensorflow(tmp_path, fail=True)])
    assert code == 1 and out == ["3", "False"]
    lines = err.splitlines()
    assert lines[:len(FAKE_LINES) + 1] == [
        *FAKE_LINES, "python-level warning from the import"]
    assert lines[-1] == "ImportError: stand-in tensorflow failed to load"
