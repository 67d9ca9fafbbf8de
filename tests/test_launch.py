"""`python -m grpo_pipeline launch`'s process handling, with stand-ins for `trl vllm-serve` and `accelerate launch`
(real processes and signals; GPUs are not needed to test who stops whom, and when)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

SERVER = r'''
import http.server, json, signal, sys, time
out = sys.argv[2]
def stop(signum, frame):
    open(out + "/server_stopped", "w").write(json.dumps(time.time())); sys.exit(0)
signal.signal(signal.SIGTERM, stop)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args): pass
open(out + "/server_pid", "w").write(str(__import__("os").getpid()))
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
'''

TRAIN = r'''
import json, os, signal, sys, time
out = sys.argv[1]
signals = []
signal.signal(signal.SIGTERM, lambda s, f: signals.append(s))
signal.signal(signal.SIGINT, lambda s, f: signals.append(s))
open(out + "/train_pid", "w").write(str(os.getpid()))
while not signals:  # "training"
    time.sleep(0.05)
time.sleep(1.0)  # "finish the step and save a checkpoint"
open(out + "/train_stopped", "w").write(json.dumps({"at": time.time(), "signals": signals}))
sys.exit(128 + signals[0])
'''

LAUNCH = r'''
import sys
from grpo_pipeline.tools.launch import LaunchPlan, run
port, out = sys.argv[1], sys.argv[2]
plan = LaunchPlan([0], [1], [sys.executable, out + "/server.py", port, out], [sys.executable, out + "/train.py", out],
                  f"http://127.0.0.1:{port}/health")
sys.exit(run(plan, ready_timeout_s=60))
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, f"{path.name} did not appear"
        time.sleep(0.05)


def _gone(pid: int, timeout: float = 30) -> bool:
    try:
        psutil.Process(pid).wait(timeout=timeout)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return True


@pytest.fixture
def launcher(tmp_path):
    (tmp_path / "server.py").write_text(SERVER)
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "launch.py").write_text(LAUNCH)
    port = _free_port()
    started = []

    def start():
        proc = subprocess.Popen([sys.executable, str(tmp_path / "launch.py"), str(port), str(tmp_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started.append(proc)
        _wait_for(tmp_path / "train_pid")  # the server answered and training runs
        return proc

    yield start, tmp_path, port
    for proc in started:
        proc.kill()
    for name in ("server_pid", "train_pid"):
        if (tmp_path / name).exists():
            try:
                os.kill(int((tmp_path / name).read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_stops_training_first_then_the_server(launcher, signum):
    start, out, _ = launcher
    proc = start()
    proc.send_signal(signum)
    code = proc.wait(timeout=60)
    stopped = json.loads((out / "train_stopped").read_text())
    assert stopped["signals"] == [signum]  # forwarded exactly once: one signal checkpoints, a second is a hard stop
    assert code == 128 + signum  # the training's exit code
    assert json.loads((out / "server_stopped").read_text()) >= stopped["at"]  # the server outlived the training
    assert _gone(int((out / "server_pid").read_text()), timeout=5)


def test_the_server_and_the_training_die_with_a_killed_launcher(launcher):
    start, out, _ = launcher
    proc = start()
    proc.kill()  # SIGKILL: no handler runs in the launcher
    assert _gone(int((out / "server_pid").read_text()))
    assert _gone(int((out / "train_pid").read_text()))


def test_a_port_already_served_is_refused_before_anything_starts(tmp_path):
    (tmp_path / "launch.py").write_text(LAUNCH)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, str(tmp_path / "launch.py"), str(port), str(tmp_path)],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and f"something already listens on 127.0.0.1:{port}" in done.stderr
    assert not (tmp_path / "server_pid").exists()
