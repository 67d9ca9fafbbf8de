"""A screenshot of a run's episode ledger as the MLflow UI shows it (headless Chromium); with --page runs, of
its experiment's runs view (the link a run prints at its end), with --page run of the run's own page.

    .venv/bin/python scripts/screenshot_ledger.py outputs/runs/<date>/<time> [--out docs/ledger_in_mlflow.png]
    .venv/bin/python scripts/screenshot_ledger.py outputs/runs/<date>/<time> --page runs --out docs/runs_in_mlflow.png

Starts `mlflow ui` on a free local port against the run's tracking store (the default SQLite store under
outputs/, or --tracking-uri), waits until it answers, opens the run's `episodes.json` artifact (the table the
ledger logs) in Debian's Chromium (`apt-get install chromium`), saves the PNG and stops the server.
"""

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from mlflow.tracking import MlflowClient

REPO = Path(__file__).resolve().parents[1]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "ledger_in_mlflow.png")
    parser.add_argument("--tracking-uri", default=f"sqlite:///{REPO / 'outputs' / 'mlflow.db'}")
    parser.add_argument("--wait-ms", type=int, default=20000, help="time the page gets to render")
    parser.add_argument("--page", choices=["ledger", "runs", "run"], default="ledger")
    args = parser.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("Chromium is not installed: apt-get install chromium")
    run_id = (args.run_dir / "mlflow_run_id").read_text().strip()
    experiment = MlflowClient(args.tracking_uri).get_run(run_id).info.experiment_id
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", args.tracking_uri,
                               "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(f"http://127.0.0.1:{port}/health", server)
        url = f"http://127.0.0.1:{port}/#/experiments/{experiment}/runs"
        url += {"ledger": f"/{run_id}/artifacts/episodes.json", "runs": "?viewStateShareKey=grpo_pipeline", "run": f"/{run_id}"}[args.page]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run([browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--window-size=1600,1000",
                            f"--virtual-time-budget={args.wait_ms}", f"--screenshot={args.out}", url],
                           check=True, capture_output=True, timeout=180)
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"{args.out} ({url})")
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(url: str, server: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"mlflow ui exited with code {server.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    sys.exit(f"mlflow ui did not answer {url} within {timeout_s:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
