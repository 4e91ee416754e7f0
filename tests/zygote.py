"""Starts the suite's worker processes by fork from an interpreter that has
imported TensorFlow and Keras already (a zygote), instead of each importing
them again.

`import tensorflow, keras` costs a child process about 4 CPU-seconds; the
suite starts hundreds of workers (`run_local_workers` and `launch` with a
`tests.*` function): tests/test_runtime.py took 156 CPU-seconds with fresh
workers, 83 with forked ones. The
zygote imports them once and runs no TensorFlow op, so no runtime thread
exists to be lost by a fork (`tests/backup_workers.serve_forks` does the
same for its kill tests). A forked worker is otherwise what the launcher
starts: its own session, its parent-death signal, stdout and stderr in the
launcher's files, its environment and directory, the launcher's bootstrap
run as `python -c` runs it, and the interpreter's own exit (atexit
handlers, an uncaught exception's traceback and exit code 1, a signal's
negative code).

A zygote serves one environment: the variables read as the imports run
(the backend, log levels, `PYTHONPATH`, ...) must equal the worker's, so a
worker's environment selects its zygote, all but `_READ_AT_RUN_TIME`
compared. Scripts (the examples, `keras-mgpu`, a test's own script) stay
fresh interpreters, as users run them.

`install()` (tests/conftest.py) puts `start_worker` in the launcher's place
for the pytest process.
"""

import collections
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading

# Set per worker or per attempt by the launcher and `launch`, SLURM's per
# task, the tuner's launch per worker, tests per worker or per test; read
# only once the worker runs, if at all. KerasTuner is not imported by the
# zygote; CUDA_VISIBLE_DEVICES is read by the driver as the first op runs;
# `tempfile` forgets the zygote's TMPDIR in `_become` (absl's test flags
# keep their default of it, which no test uses).
_READ_AT_RUN_TIME = ("TF_CONFIG", "KERAS_MGPU_RESULT", "KERAS_MGPU_ATTEMPT",
                     "KERAS_MGPU_JOB_STARTED", "KERAS_MGPU_PREVIOUS_ENDED",
                     "KERAS_MGPU_TUNER_IDS", "KERASTUNER_", "SLURM_",
                     "PYTEST_CURRENT_TEST", "CUDA_VISIBLE_DEVICES", "TMPDIR")
# Zygotes kept per pytest process, the least recently used closed first:
# each holds an imported TensorFlow (about 0.7 GB, shared with its forks).
_KEPT = 2
# Seconds for a zygote's imports, and for a fork to be reported.
_READY_TIMEOUT = 300
_START_TIMEOUT = 60
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _import_time(env):
    return {k: v for k, v in env.items()
            if not k.startswith(_READ_AT_RUN_TIME)}


# --- the zygote's side -------------------------------------------------------

def serve():
    """The zygote's loop: imports TensorFlow and Keras, prints `READY`,
    then forks a worker for each JSON request line of stdin, printing
    `START <id> <pid>` and, once it ended, `EXIT <pid> <exit code>`.

    Returns only in a forked worker, set up as its request says: (the
    code to run as `python -c` would, its `sys.argv`). Kills its workers
    and exits when stdin closes (the pytest process ended)."""
    import keras  # noqa: F401  (its backend's imports with it)
    import tensorflow  # noqa: F401

    print("READY", flush=True)
    zygote = os.getpid()
    children = set()
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        _report_exits(children)
        if not readable:
            continue
        data = os.read(0, 65536)
        if not data:
            for pid in children:
                _kill_group(pid)
            os._exit(0)
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            set_up, done = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(set_up)
                _become(request, zygote, done)
                return request["code"], request["argv"]
            os.close(done)
            # As `Popen` returns: once the worker's session (the group the
            # launcher signals) exists, or the worker is gone.
            os.read(set_up, 1)
            os.close(set_up)
            children.add(pid)
            print(f"START {request['id']} {pid}", flush=True)


def _report_exits(children):
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        print(f"EXIT {pid} {os.waitstatus_to_exitcode(status)}", flush=True)


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _become(request, zygote, done):
    """Makes this fork of `zygote` (a pid) the worker the launcher would
    have started; then closes `done`, the zygote's sign to report it."""
    import ctypes

    os.setsid()
    # The launcher ties its workers to itself the same way; the zygote
    # ends with the pytest process.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    if os.getppid() != zygote:
        os.kill(os.getpid(), signal.SIGKILL)
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, request["stdout"], os.O_WRONLY | os.O_APPEND),
                            (2, request["stderr"], os.O_WRONLY | os.O_APPEND)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # computed again from this worker's TMPDIR
    os.close(done)


# --- the pytest process's side -----------------------------------------------

class ForkedWorker:
    """A worker forked by a zygote, as the launcher uses a `Popen`: `pid`
    (its process group too), `poll()`, `wait(timeout)`, `returncode`."""

    def __init__(self, pid, zygote):
        self.pid = pid
        self.returncode = None
        self._zygote = zygote

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        with self._zygote.changed:
            if not self._zygote.changed.wait_for(
                    lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(f"worker {self.pid}",
                                                timeout)
        return self.returncode


class Zygote:
    """A `serve` process for one environment, and its workers."""

    def __init__(self, env):
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            [sys.executable, "-u", "-c",
             "from tests import zygote\n"
             "code, sys_argv = zygote.serve()\n"
             "import sys\n"
             "sys.argv = sys_argv\n"
             "del zygote, sys_argv, sys\n"
             "exec(compile(code, '<string>', 'exec'))\n"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._stderr, env=env, cwd=_REPO, start_new_session=True)
        self.changed = threading.Condition()
        self._ready = False
        self._ended = False
        self._started = {}
        self._workers = {}
        self._next_id = 0
        threading.Thread(target=self._read, daemon=True,
                         name="zygote-reader").start()
        with self.changed:
            self.changed.wait_for(lambda: self._ready or self._ended,
                                  _READY_TIMEOUT)
            if not self._ready:
                self._fail("did not become ready")

    def start(self, code, argv, env, cwd, stdout, stderr):
        """Forks a worker that runs `code` with `sys.argv` `argv`."""
        with self.changed:
            request_id = self._next_id
            self._next_id += 1
            self._proc.stdin.write(json.dumps({
                "id": request_id, "code": code, "argv": argv,
                "env": dict(env), "cwd": cwd or os.getcwd(),
                "stdout": stdout, "stderr": stderr}).encode() + b"\n")
            self._proc.stdin.flush()
            if not self.changed.wait_for(
                    lambda: request_id in self._started or self._ended,
                    _START_TIMEOUT):
                self._fail(f"reported no fork for request {request_id}")
            if request_id not in self._started:
                self._fail("ended")
            return self._started.pop(request_id)

    def _read(self):
        for line in self._proc.stdout:
            word, *values = line.decode().split() or [""]
            with self.changed:
                if word == "READY":
                    self._ready = True
                elif word == "START":
                    # Known before its EXIT can come.
                    worker = ForkedWorker(int(values[1]), self)
                    self._workers[worker.pid] = worker
                    self._started[int(values[0])] = worker
                elif word == "EXIT":
                    worker = self._workers.pop(int(values[0]), None)
                    if worker is not None:
                        worker.returncode = int(values[1])
                self.changed.notify_all()
        # Its workers die with it (their parent-death signal).
        with self.changed:
            self._ended = True
            for worker in self._workers.values():
                worker.returncode = -signal.SIGKILL
            self._workers.clear()
            self.changed.notify_all()

    @property
    def alive(self):
        return not self._ended

    @property
    def idle(self):
        with self.changed:
            return not self._workers

    def _fail(self, why):
        self.close()
        self._stderr.seek(0)
        stderr = self._stderr.read().decode(errors="replace")
        raise RuntimeError(f"The test's zygote {why}; its stderr:\n"
                           f"{stderr[-4000:]}")

    def close(self):
        """Ends the zygote and, with it, its workers."""
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=30)


_zygotes = collections.OrderedDict()
_lock = threading.Lock()


def _zygote_for(env):
    key = frozenset(_import_time(env).items())
    with _lock:
        zygote = _zygotes.pop(key, None)
        if zygote is not None and not zygote.alive:
            zygote.close()
            zygote = None
        if zygote is None:
            zygote = Zygote(_import_time(env))
            # Not one whose workers run (a cluster whose workers differ in
            # an import-time variable has a zygote per worker).
            for old in [k for k, z in _zygotes.items() if z.idle]:
                if len(_zygotes) < _KEPT:
                    break
                _zygotes.pop(old).close()
        _zygotes[key] = zygote
        return zygote


def forkable(command):
    """Whether `command` (the launcher's, before its tie to the launcher)
    is the launcher's bootstrap of a function of the test suite."""
    from keras_mgpu.cluster import options

    return (len(command) >= 4 and command[0] == sys.executable
            and command[1] == "-c" and command[2] == options._BOOTSTRAP
            and command[3].startswith("tests."))


def install(workers_module):
    """Puts `start_worker` in `workers_module._start_worker`'s place (the
    one it replaces is its `fresh`); returns the undo."""
    original = workers_module._start_worker

    def start_worker(command, env, cwd, stdout, stderr):
        if not forkable(command):
            return original(command, env, cwd, stdout, stderr)
        return _zygote_for(env).start(command[2], ["-c", *command[3:]], env,
                                      cwd, stdout.name, stderr.name)

    start_worker.fresh = original
    workers_module._start_worker = start_worker

    def undo():
        workers_module._start_worker = original

    return undo


def close_all():
    """Ends every zygote of this process."""
    with _lock:
        while _zygotes:
            _zygotes.popitem()[1].close()
