"""docs/cli.md and docs/strategy.md as a newcomer uses them: every shell
command runs as pasted, from a fresh clone after the README's install.

Each command of a ```bash, ```sh, ```shell or ```console block (a console
block's commands are its `$ ` lines) runs with bash from the root of a
checkout: a folder of links to this checkout's files, outside it, so that
what the commands write (bench.json, runs/) lands there, and whose `.venv`
is the environment running the tests; `.venv/bin` comes first on PATH, as
after `. .venv/bin/activate`. A command left out needs what no test
machine has: `EXCLUDED` names each, with the reason. The SLURM batch script
is one of them: its `srun` step's program runs instead as the two tasks of
an emulated step (the variables srun sets, no `TF_CONFIG`), preempted by
SIGTERM (which the script requeues on) and run again, as a requeued job.
"""

import os
import re
import select
import shlex
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import allow_in_children
from tests.test_cli import check_bench_files
from tests.test_launch import free_slurm_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ("docs/cli.md", "docs/strategy.md")
SHELLS = ("bash", "sh", "shell", "console")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)

# Text that identifies a command (or a script block): why it is not run.
EXCLUDED = {
    "#SBATCH": "a SLURM batch script (sbatch runs it; srun and scontrol "
               "need a cluster): test_the_slurm_scripts_step_... runs its "
               "srun step's program as an emulated step of 2 tasks instead",
    "sbatch ": "needs a SLURM cluster; test_the_slurm_scripts_step_... "
               "runs the script's srun step instead",
}
# What a command's output must show (besides exit code 0 and no traceback).
EXPECTED = {
    "keras-mgpu bench ": ("Wrote bench.json", "Wrote bench.png"),
    "keras-mgpu launch ": ("keras-mgpu launch: all 2 workers finished",
                           "[worker 0] optimizer steps: "),
}
TIMEOUT = 300  # seconds, for each command and each wait


def shell_blocks(doc):
    with open(os.path.join(ROOT, doc)) as f:
        text = f.read()
    return [(language, body) for language, body in FENCE.findall(text)
            if language in SHELLS]


def commands(language, block):
    """A block's commands, as a user pastes them: a script (`#!` first) as
    one; a console block's `$ ` lines (with their continuation lines);
    otherwise each line with the lines its trailing backslashes continue."""
    if block.startswith("#!"):
        return [block]
    found, current = [], None
    for line in block.splitlines():
        if current is not None:
            current += "\n" + line
        elif language == "console":
            if not line.startswith("$ "):
                continue  # output
            current = line[2:]
        elif line.strip() and not line.lstrip().startswith("#"):
            current = line
        else:
            continue
        if not current.endswith("\\"):
            found.append(current)
            current = None
    assert current is None, f"a command ends with a backslash: {current!r}"
    return found


COMMANDS = [(doc, command) for doc in DOCS
            for language, block in shell_blocks(doc)
            for command in commands(language, block)]


def command_id(doc_command):
    doc, command = doc_command
    return f"{os.path.basename(doc)}:{command.split(chr(10))[0][:60]}"


def excluded(command):
    return next((why for key, why in EXCLUDED.items() if key in command),
                None)


def test_the_docs_have_commands_and_every_exclusion_is_used():
    assert {doc for doc, _ in COMMANDS} == set(DOCS)
    run = [c for _, c in COMMANDS if not excluded(c)]
    assert any("keras-mgpu launch" in c for c in run), run
    for key in EXCLUDED:
        assert any(key in command for _, command in COMMANDS), (
            f"EXCLUDED[{key!r}] matches no command: remove it")


def checkout(tmp_path):
    """A fresh clone's root as the commands see it: links to this
    checkout's files (tracked, or new and not ignored: not runs/ or other
    outputs), and `.venv`, the environment running these tests."""
    root = tmp_path / "checkout"
    root.mkdir()
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    if listed.returncode == 0:
        names = {path.split("/", 1)[0] for path in listed.stdout.split("\n")
                 if path}
    else:  # not a git checkout (an unpacked archive): all but outputs
        names = set(os.listdir(ROOT)) - {"runs", "logs", ".venv", ".git"}
    for name in sorted(names):
        if os.path.lexists(os.path.join(ROOT, name)):
            os.symlink(os.path.join(ROOT, name), root / name)
    # The environment: the tests' virtual environment (or ROOT's .venv).
    venv = sys.prefix if sys.prefix != sys.base_prefix else os.path.join(
        ROOT, ".venv")
    os.symlink(venv, root / ".venv")
    return root


def doc_env(root):
    """A user's environment after `. .venv/bin/activate`, on a machine
    without GPUs, TensorFlow's log level as they leave it."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="-1",
               PATH=f"{root}/.venv/bin{os.pathsep}{os.environ['PATH']}",
               VIRTUAL_ENV=f"{root}/.venv")
    for name in ("TF_CONFIG", "TF_CPP_MIN_LOG_LEVEL", "KERAS_BACKEND",
                 "PYTHONHOME"):
        env.pop(name, None)
    for name in [n for n in env if n.startswith("SLURM_")]:
        del env[name]
    return env


# What runs here: every command but the EXCLUDED ones (each checked above
# to match a command, and covered by its own test below).
RUN = [(doc, c) for doc, c in COMMANDS if not excluded(c)]


@pytest.mark.parametrize("doc, command", RUN,
                         ids=[command_id(c) for c in RUN])
def test_command_runs_as_pasted(doc, command, tmp_path):
    root = checkout(tmp_path)
    env = doc_env(root)
    if "--plot" in command:
        env = allow_in_children(env, "matplotlib")
    proc = subprocess.run(["bash", "-c", command], cwd=root, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"{doc}: {command}\nexit {proc.returncode}\n{proc.stdout[-3000:]}\n"
        f"{proc.stderr[-5000:]}")
    assert "Traceback" not in output, output[-5000:]
    for key, texts in EXPECTED.items():
        if key in command:
            for text in texts:
                assert text in output, (text, output[-5000:])
    if "keras-mgpu bench " in command:
        check_bench_files(root / "bench.json", root / "bench.png",
                          proc.stdout)


# --- The SLURM batch script ---------------------------------------------


def slurm_script():
    scripts = [c for _, c in COMMANDS if "#SBATCH" in c]
    assert len(scripts) == 1, scripts
    return scripts[0]


def srun_step(script, shared):
    """The script's `srun` line's program; its backup folder on shared
    storage (`/nfs/...`, which every node reads the same) under `shared`."""
    lines = [line for line in script.splitlines()
             if line.startswith("srun ")]
    assert len(lines) == 1, lines
    words = shlex.split(lines[0])[1:]
    assert any(word.startswith("/nfs/") for word in words), words
    return [str(shared) + word if word.startswith("/nfs/") else word
            for word in words]


class Step:
    """The 2 tasks of an `srun` step on one node, as srun starts them:
    SLURM's variables, no TF_CONFIG. Task 0's stdout is read line by line;
    the rest goes to files (nothing blocks on a full pipe)."""

    def __init__(self, program, root, job, logs, name):
        self.tasks, self.files = [], []
        for rank in range(2):
            env = dict(doc_env(root), SLURM_JOB_ID=str(job),
                       SLURM_STEP_NUM_TASKS="2", SLURM_PROCID=str(rank),
                       SLURM_LOCALID=str(rank),
                       SLURM_STEP_NODELIST="localhost",
                       SLURM_STEP_TASKS_PER_NODE="2")
            out = open(logs / f"{name}-task{rank}.stdout", "w+")
            err = open(logs / f"{name}-task{rank}.stderr", "w+")
            self.files.append((out, err))
            self.tasks.append(subprocess.Popen(
                program, cwd=root, env=env, text=True, stderr=err,
                stdout=subprocess.PIPE if rank == 0 else out,
                start_new_session=True))
        self.lines = []

    def output(self):
        text = "".join(self.lines)
        for rank, (out, err) in enumerate(self.files):
            out.seek(0)
            err.seek(0)
            text += (f"\n--- task {rank} stdout:\n{out.read()[-3000:]}"
                     f"\n--- task {rank} stderr:\n{err.read()[-5000:]}")
        return text

    def read_until(self, marker):
        """Reads task 0's stdout until a line containing `marker`."""
        deadline = time.monotonic() + TIMEOUT
        stdout = self.tasks[0].stdout
        while True:
            ready, _, _ = select.select(
                [stdout], [], [], max(deadline - time.monotonic(), 0))
            line = stdout.readline() if ready else ""
            if not line:
                self.kill()
                pytest.fail(f"no line with {marker!r} from task 0 "
                            f"({'output ended' if ready else 'timeout'}):"
                            f"\n{self.output()}")
            self.lines.append(line)
            if marker in line:
                return

    def signal(self, signum):
        for task in self.tasks:
            task.send_signal(signum)

    def wait(self):
        """Waits for both tasks; their exit codes."""
        deadline = time.monotonic() + TIMEOUT
        try:
            self.lines.append(self.tasks[0].communicate(
                timeout=TIMEOUT)[0])
            for task in self.tasks:
                task.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the step did not end:\n{self.output()}")
        return [task.returncode for task in self.tasks]

    def kill(self):
        for task in self.tasks:
            if task.poll() is None:
                os.killpg(task.pid, signal.SIGKILL)
            task.wait(timeout=60)


def test_the_slurm_scripts_step_trains_is_preempted_and_resumes(tmp_path):
    """The batch script's `srun` line as 2 tasks of one node: SIGTERM (what
    `--signal=TERM@120` sends every task) after epoch 1 makes every task
    save and exit 143, the code the script requeues on; the requeued job
    (the same job id, so the same ports) runs the step again, which resumes
    from that save and finishes."""
    root = checkout(tmp_path)
    program = srun_step(slurm_script(), tmp_path / "shared")
    job = free_slurm_job()
    step = Step(program, root, job, tmp_path, "preempted")
    try:
        step.read_until("MultiWorkerMirroredStrategy: 2 replica(s), "
                        "2 worker(s)")
        step.read_until("Epoch 1 done.")
        step.signal(signal.SIGTERM)
        codes = step.wait()
    finally:
        step.kill()
    assert codes == [143, 143], f"exit codes {codes}:\n{step.output()}"
    assert "SIGTERM received; saved generation" in step.output()

    requeued = Step(program, root, job, tmp_path, "requeued")
    try:
        codes = requeued.wait()
    finally:
        requeued.kill()
    output = requeued.output()
    assert codes == [0, 0], f"exit codes {codes}:\n{output}"
    assert "BackupAndRestore: resumed from " in output, (
        output)
    assert "optimizer steps: " in output, output
    assert "Traceback" not in output, output


def test_the_docs_batch_script_is_examples_train_sbatch():
    with open(os.path.join(ROOT, "examples", "train.sbatch")) as f:
        assert slurm_script() == f.read()


def test_the_docs_train_py_excerpt_is_examples_train_py():
    """The lines docs/strategy.md quotes from examples/train.py are in it."""
    with open(os.path.join(ROOT, "docs", "strategy.md")) as f:
        text = f.read()
    excerpt = re.search(r"examples/train\.py`[^`]*?:\n\n```python\n(.*?)^```",
                        text, re.M | re.S)
    assert excerpt, "no excerpt of examples/train.py in docs/strategy.md"
    with open(os.path.join(ROOT, "examples", "train.py")) as f:
        script = f.read()
    for line in excerpt[1].splitlines():
        if line.strip() and line.strip() != "...":
            assert line in script, f"not in examples/train.py: {line!r}"
