"""Signals, and a local Ray among other Rays: SIGTERM to `raysft train` or to torchrun checkpoints the step the
workers are at and exits 143 with a line saying how to resume; Ctrl-C stops at once without a checkpoint; two local
runs on one machine each keep to their own Ray and show raysft's lines only, one of them under a RAY_TMPDIR too long
for Ray's socket paths; a RAY_ADDRESS that nobody answers is named within seconds. That a stopped run resumes to the
uninterrupted one is tests/test_run.py::test_a_stop_request_on_one_rank_stops_every_rank_at_one_checkpointed_step."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, cli_env, cli_in_process, running
from fault_injection import arm

from raysft.checkpoint import MANIFEST_FILE
from raysft.launch.lease import LEASE_FILE
from raysft.launch.signals import EXIT_SIGINT, EXIT_SIGTERM, DriverSignals, Stopped
from raysft.training.metrics import read_metrics

pytestmark = pytest.mark.slow  # starts Ray: not in make test-fast

LONG_RUN = {"data.max_seq_len": 64, "train.max_steps": 100000, "train.warmup_steps": 1, "train.global_batch_size": 2,
            "train.micro_batch_size": 1,
            "train.log_every_n_steps": 1, "checkpoint.every_n_steps": 100000, "run.stop_grace_s": 60}
ANSI = re.compile(r"\x1b\[[0-9;]*m")
RAY_PREFIX = re.compile(r"^\(\w+ pid=\d+(, ip=[\d.]+)?\) ")


def sets(storage: Path, name: str, **over) -> list[str]:
    return [a for k, v in {**LONG_RUN, "run.storage_path": storage, "run.name": name, **over}.items()
            for a in ("--set", f"{k}={v}")]


def wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int, timeout: float = 420) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended early ({proc.returncode})"
        if (run_dir / "metrics.jsonl").is_file() and any(m.get("step", 0) >= step and "loss" in m
                                                          for m in read_metrics(run_dir)):
            return
        time.sleep(0.2)
    raise AssertionError(f"{run_dir} did not reach step {step} in {timeout} s")


def processes_with_env(entry: str) -> list[int]:
    """This user's processes whose environment holds `entry` (a local Ray's processes inherit its RAY_TMPDIR)."""
    found = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            if entry.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") and running(pid):
                found.append(pid)
        except OSError:
            pass
    return found


def wait_gone(entry: str, timeout: float = 60) -> list[int]:
    """The processes still holding `entry` after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (left := processes_with_env(entry)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def assert_stopped_with_checkpoint(run_dir: Path, terminal: str) -> int:
    """The run's stop event, its checkpoint of that step, the resume line, and the lease released."""
    (stopped,) = [m for m in read_metrics(run_dir) if m.get("event") == "stopped"]
    step = stopped["step"]
    assert step >= 2
    assert (run_dir / f"checkpoint_{step:08d}" / MANIFEST_FILE).is_file()
    assert "raysft: stopped by SIGTERM" in terminal and "run the same command again" in terminal, terminal[-3000:]
    assert not (run_dir / LEASE_FILE).exists()
    return step


# What Ray printed on a raysft terminal: another Ray's address, the token-authentication notice, the C++ E-line
# about the PreemptionWatcher actor, its coloured INFO lines ("Started a local Ray instance").
RAY_NOISE = ("Found multiple active Ray instances", "Token authentication", "core_worker.cc", " INFO ")


def ray_noise(terminal: str) -> list[str]:
    return [line for line in terminal.splitlines() if any(n in line for n in RAY_NOISE)]


def raysft_lines(terminal: str) -> list[str]:
    """raysft's own lines, and the workers' behind Ray's `(RayTrainWorker pid=N)` prefix."""
    lines = [RAY_PREFIX.sub("", ANSI.sub("", line)) for line in terminal.splitlines()]
    return [line for line in lines if line.startswith(("raysft: ", "step "))]


def start_train(tmp_path: Path, name: str, env: dict, storage: Path, **over) -> subprocess.Popen:
    """`raysft train` in a process group of its own (as a terminal's foreground job), its terminal in files."""
    with open(tmp_path / f"{name}.out", "w") as out, open(tmp_path / f"{name}.err", "w") as err:
        return subprocess.Popen([sys.executable, "-m", "raysft", "train", *sets(storage, name, **over)], env=env,
                                cwd=REPO, stdout=out, stderr=err, start_new_session=True)


def local_ray_gone(out: str) -> list[int]:
    """The processes of the local Ray whose logs the launch printed, once they have had a minute to end."""
    temp = re.search(r"its logs: (\S+)", out).group(1).split("/ray/session_latest")[0]
    return wait_gone(f"RAY_TMPDIR={temp}")


def test_signals_to_two_local_runs_beside_each_other(tmp_path):
    """Run A under a RAY_TMPDIR of over 60 characters, run B beside it, both with the memory tier every step.
    Ctrl-C to B's process group: B exits 130 at once, without a checkpoint or a traceback. SIGTERM to A's driver: A
    exits 143 with a checkpoint of the step it was at and says how to resume. Neither leaves a process of its Ray,
    its lease or a snapshot in memory, and neither terminal shows Ray's lines about the other Ray or its own
    notices."""
    long_tmp = tmp_path / "scratch-of-a-cluster-job" / "job-0042-with-a-long-name" / "raytmp"
    long_tmp.mkdir(parents=True)
    assert len(str(long_tmp)) >= 60
    storage = tmp_path / "runs"
    with cli_env() as env_b:
        a = start_train(tmp_path, "a", {**env_b, "RAY_TMPDIR": str(long_tmp)}, storage, **tier(tmp_path / "shm-a"))
        b = start_train(tmp_path, "b", env_b, storage, **{"scaling.num_workers": 1, **tier(tmp_path / "shm-b")})
        try:
            wait_for_step(storage / "b", b, 2)
            os.killpg(b.pid, signal.SIGINT)  # what Ctrl-C on B's terminal sends
            assert b.wait(timeout=120) == EXIT_SIGINT
            wait_for_step(storage / "a", a, 2)
            a.send_signal(signal.SIGTERM)
            assert a.wait(timeout=120) == EXIT_SIGTERM
        finally:
            for p in (a, b):
                if p.poll() is None:
                    p.kill()
    a_out, a_err, b_out, b_err = ((tmp_path / f).read_text() for f in ("a.out", "a.err", "b.out", "b.err"))
    assert_stopped_with_checkpoint(storage / "a", a_err)
    assert "raysft: stopped by Ctrl-C; no checkpoint" in b_err and "Traceback" not in b_out + b_err, b_err[-3000:]
    assert not list((storage / "b").glob("checkpoint_*")) and not (storage / "b" / LEASE_FILE).exists()
    logs = re.search(r"its logs: (\S+)", a_out).group(1)
    assert Path(logs).is_dir() and re.search(rf"linked from {re.escape(str(long_tmp))}/raysft-ray-\w+", a_out)
    assert local_ray_gone(a_out) == [] and local_ray_gone(b_out) == []  # GCS, raylet, workers: all gone
    assert [p.name for p in [*(tmp_path / "shm-a").rglob("*"), *(tmp_path / "shm-b").rglob("*")]
            if p.name != ".raysft.lock"] == []  # nor a snapshot (the directory's lock file stays, empty)
    for terminal in (a_out + a_err, b_out + b_err):
        assert ray_noise(terminal) == [] and "raysft: run " in terminal
    assert "step 2/" in "".join(raysft_lines(a_out))  # the workers' lines still reach the terminal


# Makes every Python process of a `raysft train` command (the driver, its local Ray's workers) load
# tests/fault_injection.py's patches when $RAYSFT_FAULTS_DIR is set.
FAULTS_HOOK = ("import os\n"
               "if os.environ.get('RAYSFT_FAULTS_DIR'):\n"
               "    import fault_injection\n"
               "    fault_injection.install_patches()\n")


def with_faults(env: dict, tmp_path: Path) -> tuple[dict, Path]:
    """env for a `raysft train` whose workers take faults armed in the returned directory."""
    from fault_injection import FAULTS_ENV

    hook, faults = tmp_path / "hook", tmp_path / "faults"
    hook.mkdir()
    faults.mkdir()
    (hook / "sitecustomize.py").write_text(FAULTS_HOOK)
    path = os.pathsep.join(p for p in (str(hook), str(REPO / "tests"), env.get("PYTHONPATH")) if p)
    return {**env, "PYTHONPATH": path, FAULTS_ENV: str(faults)}, faults


def newest_checkpoint(run_dir: Path) -> int:
    return max(int(p.name.split("_")[1]) for p in run_dir.glob("checkpoint_*") if (p / MANIFEST_FILE).is_file())


def test_sigterm_to_the_whole_job_then_a_grace_that_expires_end_in_time_and_leave_nothing(tmp_path):
    """First launch: SIGTERM to its whole process group, the driver, the local Ray it started and the workers at
    once (as Slurm's scancel or some container runtimes send it). Ray's processes end on it, so no worker can
    checkpoint: the driver exits 143 well within run.stop_grace_s, says why there is no checkpoint and how to
    resume, and leaves no process or lease. The relaunch resumes from the newest checkpoint taken before. Its
    workers then cannot checkpoint in time (a step made to take 10 minutes: tests/fault_injection.py's
    slow_steps), and SIGTERM to its driver with run.stop_grace_s=5 ends it with 143 once the grace has passed,
    saying so, and leaving no process or lease."""
    storage, run_dir = tmp_path / "runs", tmp_path / "runs" / "c"
    with cli_env() as env:
        env, faults = with_faults(env, tmp_path)
        launch = start_train(tmp_path, "c", env, storage, **{"scaling.num_workers": 1, "checkpoint.every_n_steps": 2})
        try:
            wait_for_step(run_dir, launch, 3)
            os.killpg(launch.pid, signal.SIGTERM)
            assert launch.wait(timeout=300) == EXIT_SIGTERM
            whole_job = [(tmp_path / f).read_text() for f in ("c.out", "c.err")]
            before = newest_checkpoint(run_dir)  # taken before the signal: none is taken at it

            launch = start_train(tmp_path, "c", env, storage, **{"scaling.num_workers": 1,
                                                                 "checkpoint.every_n_steps": 2, "run.stop_grace_s": 5})
            wait_for(lambda: trained_since_resume(run_dir), launch, "a step after the resume")
            arm(faults, "slow_steps", seconds=600)
            wait_for(lambda: (faults / "slowed").exists(), launch, "a slowed step")
            sent = time.monotonic()
            launch.send_signal(signal.SIGTERM)
            assert launch.wait(timeout=300) == EXIT_SIGTERM
            grace_took = time.monotonic() - sent
            grace = [(tmp_path / f).read_text() for f in ("c.out", "c.err")]
        finally:
            if launch.poll() is None:
                os.killpg(launch.pid, signal.SIGKILL)
    # The driver ended on Ray's end, not on the grace of 60 s. Which of its two threads met that end first is a race:
    # the stop request (refused or timed out), or Ray Train's `fit` (its worker actor gone). Either way the driver
    # says no checkpoint was taken, and why.
    assert any(f"raysft: stopped by SIGTERM ({why}" in whole_job[1] for why in (
        "the workers could not be asked to checkpoint: Ray did not take the request",
        "the run failed after the signal: ")) and "no checkpoint was taken" in whole_job[1], whole_job[1][-3000:]
    assert [m["step"] for m in read_metrics(run_dir) if m.get("event") == "resume"] == [before]
    assert grace_took >= 5, grace_took  # the grace was kept to, not cut short
    assert "raysft: stopped by SIGTERM (the workers did not checkpoint within run.stop_grace_s=5); no checkpoint " \
           "was taken at the stop" in grace[1], grace[1][-3000:]
    for out, err in (whole_job, grace):
        assert "run the same command again" in err and "Traceback" not in out + err, err[-3000:]
        assert local_ray_gone(out) == []
    assert not (run_dir / LEASE_FILE).exists()


def wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 420) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None and time.monotonic() < deadline, f"no {what} ({proc.returncode})"
        time.sleep(0.2)


def trained_since_resume(run_dir: Path) -> bool:
    records = read_metrics(run_dir)
    resumes = [i for i, m in enumerate(records) if m.get("event") == "resume"]
    return bool(resumes) and any("loss" in m for m in records[resumes[-1]:])


def test_sigterm_to_torchrun_checkpoints_on_every_rank_and_exits(tmp_path):
    """torchrun's agent forwards SIGTERM to both ranks; they agree on one step, checkpoint it and exit 143, leaving
    no snapshot of the memory tier."""
    import psutil

    storage = tmp_path / "runs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "raysft.run",
           *sets(storage, "t", **tier(tmp_path / "shm"))]
    env = {"PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false", "HOME": str(tmp_path)}
    with open(tmp_path / "t.err", "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_for_step(storage / "t", proc, 2)
        ranks = psutil.Process(proc.pid).children()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    # torchrun's own agent ends with 1 and its SignalException traceback (torch's, not raysft's); the ranks exit 143
    assert proc.returncode == 1
    assert_stopped_with_checkpoint(storage / "t", (tmp_path / "t.err").read_text())
    assert len(ranks) == 2
    for rank in ranks:
        assert not rank.is_running() or rank.status() == psutil.STATUS_ZOMBIE
    assert [p.name for p in (tmp_path / "shm").rglob("*")] in ([], [".raysft.lock"])  # no snapshot


def tier(memory_dir: Path) -> dict:
    """The memory tier every step, its snapshots in memory_dir (made by the run)."""
    return {"checkpoint.memory_every_n_steps": 1, "checkpoint.memory_dir": str(memory_dir)}


def test_the_driver_stops_on_sigterm_after_the_workers_return_and_at_once_on_ctrl_c():
    """DriverSignals around a blocking call: SIGTERM asks the workers (on_term) and waits for the call's return;
    Ctrl-C gives up at once."""
    import threading

    asked = threading.Event()
    signals = DriverSignals(grace_s=60, on_term=asked.set)
    threading.Timer(0.5, os.kill, args=(os.getpid(), signal.SIGTERM)).start()
    with pytest.raises(Stopped) as stop:
        signals.run(lambda: asked.wait(60) and "result")
    assert stop.value.checkpointed and stop.value.result == "result" and stop.value.exit_code == EXIT_SIGTERM

    signals = DriverSignals(grace_s=60, on_term=lambda: None)
    threading.Timer(0.5, os.kill, args=(os.getpid(), signal.SIGINT)).start()
    call = Blocked()
    with pytest.raises(Stopped) as stop:
        signals.run(call)
    assert not call.returned  # given up at once, not when the call returned
    call.release()
    assert not stop.value.checkpointed and stop.value.exit_code == EXIT_SIGINT
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)

    # a driver run from a thread (raysft.train in a script's thread): signals are its caller's; the call just runs
    box = []
    thread = threading.Thread(target=lambda: box.append(DriverSignals(60, lambda: None).run(lambda: "ran")))
    thread.start()
    thread.join(60)
    assert box == ["ran"]


class Blocked:
    """A call that blocks until released (at most 300 s: a driver that waited for it fails the test instead of
    hanging it), and says whether it returned: a driver that stopped while it had not, did not wait for it."""

    def __init__(self):
        import threading

        self.event, self.returned = threading.Event(), False

    def __call__(self):
        self.event.wait(300)
        self.returned = True

    def release(self) -> None:
        self.event.set()


def test_the_driver_keeps_to_its_grace_when_the_stop_request_hangs_or_fails_or_ray_fails_after_it():
    """After a signal to the whole job, Ray's own processes are gone: the stop request to the workers never returns
    or fails, and Ray's fit fails. The driver still stops as SIGTERM says, without a checkpoint and without waiting
    for the call that never returns (or for the stop request, past the grace)."""
    import threading

    def stopped_by_sigterm(on_term, fn, grace_s=1.0) -> Stopped:
        threading.Timer(0.3, os.kill, args=(os.getpid(), signal.SIGTERM)).start()
        with pytest.raises(Stopped) as stop:
            DriverSignals(grace_s, on_term).run(fn)
        assert not stop.value.checkpointed and stop.value.exit_code == EXIT_SIGTERM
        return stop.value

    calls = []
    try:
        request, call = Blocked(), Blocked()
        calls += [request, call]
        stop = stopped_by_sigterm(request, call)
        assert "did not checkpoint within run.stop_grace_s=1" in str(stop) and not call.returned
        assert not request.returned  # the grace passed while the stop request still hung

        def refused():
            raise RuntimeError("Ray did not take the request")

        call = Blocked()
        calls.append(call)
        stop = stopped_by_sigterm(refused, call, grace_s=60)
        assert str(stop) == "the workers could not be asked to checkpoint: Ray did not take the request"
        assert not call.returned  # stopped on the refusal, not on the call's return or the grace of 60 s

        def fit_fails_once_asked():
            asked.wait(300)
            raise ConnectionError("the controller is gone\nand a long story")

        asked, request = threading.Event(), Blocked()
        calls.append(request)
        stop = stopped_by_sigterm(lambda: asked.set() or request(), fit_fails_once_asked, 60)
        assert str(stop) == "the run failed after the signal: ConnectionError: the controller is gone"
        assert not request.returned  # stopped on fit's failure, not on the stop request or the grace of 60 s
    finally:
        for blocked in calls:
            blocked.release()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_a_second_ctrl_c_ends_the_process_at_once():
    code = ("import signal, os, time, threading, importlib.util\n"  # raysft.launch.signals alone: no torch to import
            "spec = importlib.util.spec_from_file_location('signals', 'raysft/launch/signals.py')\n"
            "signals = importlib.util.module_from_spec(spec); spec.loader.exec_module(signals)\n"
            "DriverSignals = signals.DriverSignals\n"
            "s = DriverSignals(60, lambda: None)\n"
            "def twice():\n"
            "    os.kill(os.getpid(), signal.SIGINT); time.sleep(0.2); os.kill(os.getpid(), signal.SIGINT)\n"
            "threading.Timer(0.5, twice).start()\n"
            "try:\n"
            "    s.run(lambda: time.sleep(60))\n"
            "except Exception:\n"
            "    time.sleep(60)  # where a shutdown would hang\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    # 130 from the second Ctrl-C: a process that went on (the call's or the shutdown's sleep) would end with 0
    assert done.returncode == EXIT_SIGINT and "Traceback" not in done.stderr, done.stderr


def test_a_ray_address_nobody_answers_is_named_within_the_connect_timeout(tmp_path, monkeypatch):
    """A closed port on loopback: Ray alone retries it for minutes; raysft names RAY_ADDRESS before tokenizing."""
    from raysft.distributed import local_ray

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nobody listens there
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    if "RAYSFT_RAY_CONNECT_TIMEOUT_S" not in os.environ:
        assert local_ray.CONNECT_TIMEOUT_S == 30  # the default: well within a minute
    monkeypatch.setattr(local_ray, "CONNECT_TIMEOUT_S", 2.0)
    done = cli_in_process("train", "--set", f"run.storage_path={tmp_path / 'runs'}", "--set", "run.name=x")
    assert done.returncode == 1  # raysft's probe, not ray.init's own retries (minutes, and another message)
    assert f"RAY_ADDRESS=127.0.0.1:{port}: nothing answers at 127.0.0.1:{port}" in done.stderr
    assert not (tmp_path / "runs" / "datasets").exists()  # refused before the data is tokenized
