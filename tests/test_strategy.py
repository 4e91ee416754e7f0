import json
import subprocess
import sys
import textwrap

import pytest
import tensorflow as tf

import keras_mgpu
from keras_mgpu import strategy as s
from tests.conftest import mirrored


def tf_config(cluster, task_type="worker", index=0):
    return json.dumps({"cluster": cluster,
                       "task": {"type": task_type, "index": index}})


TWO_WORKERS = {"worker": ["localhost:1", "localhost:2"]}
CHIEF_AND_TWO = {"chief": ["h:3"], "worker": ["h:1", "h:2"]}


@pytest.mark.parametrize("text, expected", [
    ("", (1, 0, True)),
    (tf_config({"worker": ["h:1"]}), (1, 0, True)),
    (tf_config(TWO_WORKERS, index=0), (2, 0, True)),
    (tf_config(TWO_WORKERS, index=1), (2, 1, False)),
    (tf_config(CHIEF_AND_TWO, "chief", 0), (3, 0, True)),
    (tf_config(CHIEF_AND_TWO, "worker", 0), (3, 1, False)),
    (tf_config(CHIEF_AND_TWO, "worker", 1), (3, 2, False)),
    (tf_config({**TWO_WORKERS, "evaluator": ["h:9"]}, "evaluator"),
     (2, 0, False)),
])
def test_parse_tf_config(text, expected):
    info = s.parse_tf_config(text)
    assert (info.num_workers, info.worker_index, info.is_chief) == expected


@pytest.mark.parametrize("text, field", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"cluster": ["h:1"]}', "'cluster' must map"),
    (tf_config({"gpu": ["h:1"]}), "unknown task type 'gpu'"),
    (tf_config({"worker": []}), "'cluster.worker' must be a non-empty"),
    (tf_config({"worker": ["nohostport"]}), "address 'nohostport'"),
    (tf_config({"worker": [5]}), "address 5"),
    (tf_config({"worker": ["h:abc"]}), "address 'h:abc'"),
    (tf_config({"worker": ["h:99999"]}), "address 'h:99999'"),
    (tf_config({"worker": ["h:0"]}), "port from 1 to 65535"),
    (tf_config({"worker": [":12"]}), "address ':12'"),
    (tf_config({"worker": ["h:1", "h:1"]}), "'h:1' twice (worker:0 and worker:1)"),
    (tf_config({"chief": ["h:1"], "worker": ["h:1"]}, "chief"),
     "'h:1' twice (chief:0 and worker:0)"),
    (tf_config({"chief": ["h:1", "h:2"]}, "chief"), "at most one chief"),
    (json.dumps({"cluster": TWO_WORKERS}), "'task' must be an object"),
    (tf_config(TWO_WORKERS, "chief"), "'task.type' is 'chief'"),
    (tf_config({"worker": ["[::1]:7", "[::1]:8"]}, index=9), "'task.index' is 9"),
    (tf_config(TWO_WORKERS, index=2), "'task.index' is 2"),
    (tf_config(TWO_WORKERS, index="0"), "'task.index' is '0'"),
    (json.dumps({"task": {"type": "worker", "index": 0}}), "no 'cluster'"),
])
def test_malformed_tf_config_names_the_bad_field(text, field):
    with pytest.raises(ValueError) as info:
        s.parse_tf_config(text)
    assert field in str(info.value)


def test_bad_tf_config_in_environment_fails_auto_strategy(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config(TWO_WORKERS, index=7))
    with pytest.raises(ValueError, match="'task.index' is 7"):
        keras_mgpu.auto_strategy()


@pytest.mark.parametrize("workers_, gpus, virtual_cpus, devices, kind", [
    (2, 0, None, None, "multi_worker"),
    (2, 8, None, None, "multi_worker"),
    (1, 0, None, None, "default"),
    (1, 1, None, None, "default"),
    (1, 2, None, None, "mirrored"),
    (1, 8, None, None, "mirrored"),
    (1, 0, 2, None, "mirrored"),
    (1, 0, 1, None, "mirrored"),
    (1, 0, None, ["/cpu:0"], "one_device"),
    (1, 0, None, ["/gpu:0", "/gpu:1"], "mirrored"),
])
def test_selection_table(workers_, gpus, virtual_cpus, devices, kind):
    cluster = {"worker": [f"h:{i + 1}" for i in range(workers_)]}
    info = s.parse_tf_config(tf_config(cluster))
    assert s.strategy_kind(info, gpus, virtual_cpus, devices) == kind


def test_selection_rejects_conflicting_arguments():
    info = s.parse_tf_config(tf_config(TWO_WORKERS))
    with pytest.raises(ValueError, match="virtual_cpus=2"):
        s.strategy_kind(info, 0, 2, None)
    with pytest.raises(ValueError, match="either `virtual_cpus` or `devices`"):
        s.strategy_kind(s.ClusterInfo(), 0, 2, ["/cpu:0"])


def test_auto_strategy_in_process(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert keras_mgpu.auto_strategy() is tf.distribute.get_strategy()
    assert keras_mgpu.num_replicas(keras_mgpu.auto_strategy()) == 1
    two = keras_mgpu.auto_strategy(virtual_cpus=2)
    assert isinstance(two, tf.distribute.MirroredStrategy)
    assert two.num_replicas_in_sync == 2
    one = keras_mgpu.auto_strategy(devices=["/cpu:0"])
    assert isinstance(one, tf.distribute.OneDeviceStrategy)
    hier = keras_mgpu.auto_strategy(
        devices=["/cpu:0", "/cpu:1", "/cpu:2"],
        cross_device_ops=tf.distribute.HierarchicalCopyAllReduce())
    assert hier.num_replicas_in_sync == 3
    assert isinstance(hier.extended._cross_device_ops,
                      tf.distribute.HierarchicalCopyAllReduce)


def test_auto_strategy_argument_errors(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="got 0"):
        keras_mgpu.auto_strategy(virtual_cpus=0)
    with pytest.raises(ValueError, match="got True"):
        keras_mgpu.auto_strategy(virtual_cpus=True)
    with pytest.raises(TypeError, match="cross_device_ops='nccl'"):
        keras_mgpu.auto_strategy(virtual_cpus=2, cross_device_ops="nccl")


def test_bad_devices_and_startup_timeout_name_the_value(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    for devices in ([], "/gpu:0", ["/cpu:0", 0], ["", "/cpu:0"]):
        with pytest.raises(ValueError, match="devices must be a non-empty") as e:
            keras_mgpu.auto_strategy(devices=devices)
        assert repr(devices) in str(e.value)
    for timeout in (0, -1, "10", True):
        with pytest.raises(ValueError, match="startup_timeout") as e:
            keras_mgpu.auto_strategy(startup_timeout=timeout)
        assert repr(timeout) in str(e.value)


def test_devices_this_machine_lacks_are_refused(monkeypatch):
    # TensorFlow would run a OneDeviceStrategy on a missing GPU on the CPU.
    monkeypatch.delenv("TF_CONFIG", raising=False)
    for devices, missing in ((["/gpu:7"], "'/gpu:7'"),
                             (["/cpu:0", "/cpu:9"], "'/cpu:9'")):
        with pytest.raises(ValueError, match=f"no device {missing};") as e:
            keras_mgpu.auto_strategy(devices=devices)
        assert f"devices={devices!r}" in str(e.value)
        assert "TensorFlow sees /device:CPU:0, /device:CPU:1" in str(e.value)
    with pytest.raises(ValueError, match="'gpu7' is not a device name"):
        keras_mgpu.auto_strategy(devices=["gpu7"])
    # Other spellings of devices it has.
    one = keras_mgpu.auto_strategy(
        devices=["/job:localhost/replica:0/task:0/device:CPU:1"])
    assert isinstance(one, tf.distribute.OneDeviceStrategy)


def test_a_worker_that_never_starts_is_named_after_the_startup_timeout():
    import socket

    from keras_mgpu.launcher import free_ports

    # Worker 1 is a bare listening socket (up, never joins); worker 2
    # never starts. Only worker 2 may be named.
    with socket.socket() as up:
        up.bind(("localhost", 0))
        up.listen()
        # One call for both: two calls can each get the port the other
        # just closed, and TF_CONFIG refuses the duplicate.
        first, last = free_ports(2)
        ports = [first, up.getsockname()[1], last]
        cluster = {"worker": [f"localhost:{p}" for p in ports]}
        proc = run_python("""
            import keras_mgpu
            try:
                keras_mgpu.auto_strategy(startup_timeout=3)
            except RuntimeError as e:
                print("ERROR", e)
        """, env={"TF_CONFIG": tf_config(cluster)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(
        "ERROR Worker 0 of 3 waited 3 s for the cluster to start; these "
        "workers never connected (nothing listens at their TF_CONFIG "
        f"address): worker 2 (localhost:{ports[2]}). "), proc.stdout
    assert "worker 1 (" not in proc.stdout


def test_virtual_cpus_after_device_initialisation_is_a_clear_error():
    # This process already initialised 4 logical CPUs.
    with pytest.raises(RuntimeError, match="already initialised") as info:
        keras_mgpu.auto_strategy(virtual_cpus=8)
    assert "at the start of the program" in str(info.value)


def run_python(code, env=None, timeout=120):
    import os

    full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    full_env.pop("TF_CONFIG", None)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=full_env,
        capture_output=True, text=True, timeout=timeout)


def test_virtual_cpus_in_a_fresh_process():
    proc = run_python("""
        import keras_mgpu
        strategy = keras_mgpu.auto_strategy(virtual_cpus=3)
        print("REPLICAS", strategy.num_replicas_in_sync,
              type(strategy).__name__)
        import tensorflow as tf
        tf.constant(1.0)
        try:
            keras_mgpu.auto_strategy(virtual_cpus=5)
        except RuntimeError as e:
            print("ERROR", e)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "REPLICAS 3 MirroredStrategy" in proc.stdout
    assert "ERROR Cannot split the CPU into 5 logical devices" in proc.stdout


def test_multi_worker_strategy_after_initialisation_is_a_clear_error():
    proc = run_python("""
        import tensorflow as tf
        tf.constant(1.0)
        import keras_mgpu
        keras_mgpu.auto_strategy()
    """, env={"TF_CONFIG": tf_config(TWO_WORKERS)})
    assert proc.returncode != 0
    assert "Collective ops must be configured at program startup" in proc.stderr
    assert "call keras_mgpu.auto_strategy() first" in proc.stderr


def test_global_batch_size():
    assert keras_mgpu.global_batch_size(16, tf.distribute.get_strategy()) == 16
    assert keras_mgpu.global_batch_size(16, mirrored(4)) == 64
    with mirrored(2).scope():
        assert keras_mgpu.global_batch_size(8) == 16
        assert keras_mgpu.num_replicas() == 2
    with pytest.raises(ValueError, match="got 0"):
        keras_mgpu.global_batch_size(0)
    with pytest.raises(TypeError, match="got 2.5"):
        keras_mgpu.global_batch_size(2.5)


def test_replica_counts_outside_a_scope_need_the_strategy():
    strategy = mirrored(2)
    # Without the check, both return 16 and 1 here: the default strategy's.
    with pytest.raises(ValueError, match=r"global_batch_size\(16\) was called "
                       "outside a strategy scope.*Pass the strategy"):
        keras_mgpu.global_batch_size(16)
    with pytest.raises(ValueError, match=r"num_replicas\(\) was called outside"):
        keras_mgpu.num_replicas()
    assert keras_mgpu.global_batch_size(16, strategy) == 32
    with strategy.scope():
        assert keras_mgpu.global_batch_size(16) == 32


def test_process_helpers_read_tf_config(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config(CHIEF_AND_TWO, "worker", 1))
    assert (keras_mgpu.num_workers(), keras_mgpu.worker_index(),
            keras_mgpu.is_chief()) == (3, 2, False)
    monkeypatch.delenv("TF_CONFIG")
    assert (keras_mgpu.num_workers(), keras_mgpu.worker_index(),
            keras_mgpu.is_chief()) == (1, 0, True)


def test_make_tf_config_round_trips():
    text = s.make_tf_config(["localhost:5", "localhost:6"], 1)
    info = s.parse_tf_config(text)
    assert (info.num_workers, info.worker_index) == (2, 1)
    with pytest.raises(ValueError, match="'task.index' is 2"):
        s.make_tf_config(["localhost:5"], 2)


def test_multi_worker_strategy_makes_tensorflow_swallow_sigterm():
    """What docs/strategy.md documents: once MultiWorkerMirroredStrategy exists,
    TensorFlow's preemption notifier handles SIGTERM and the process lives
    on (without BackupAndRestore(save_on_sigterm=True))."""
    from keras_mgpu.launcher import free_ports

    proc = run_python("""
        import os, signal
        import tensorflow as tf
        tf.distribute.MultiWorkerMirroredStrategy()
        # Delivered before kill() returns: the default action ends us here.
        os.kill(os.getpid(), signal.SIGTERM)
        print("ALIVE AFTER SIGTERM")
    """, env={"TF_CONFIG": tf_config({"worker": [f"localhost:{free_ports(1)[0]}"]})})
    assert proc.returncode == 0, proc.stderr
    assert "ALIVE AFTER SIGTERM" in proc.stdout
