"""A stand-in for ``examples/train_moe.py fit --config CFG`` in the tuner's tests: no torch, starts in milliseconds.

It reads the trial's config and writes the CSV the package's monitors would: ``train/tokens_per_sec`` of steps 2 to
``max_steps`` (``1000 * data.batch_size``, or ``FAKE_TRIAL_RATES``: a JSON map of batch size to rate) and
``train/host_peak_rss``. ``model.lr < 0`` crashes it (exit status 1); ``FAKE_TRIAL_SLEEP`` seconds pass before it
writes; every run appends its settings' batch size and lr, its ``max_steps``, whether Lightning was imported before
it started (the tuner's trial server preloads it), its pid and process group to the file ``FAKE_TRIAL_CALLS``.
``FAKE_TRIAL_CHILD=1`` starts a child first (``sleep 60``, a DDP rank's stand-in; its pid and group in the same line),
left running when the trial ends; ``FAKE_TRIAL_KILL=1`` then ends the trial by SIGKILL (the OOM killer's way).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml


def main() -> int:
    preloaded = "lightning.pytorch" in sys.modules
    config = yaml.safe_load(Path(sys.argv[sys.argv.index("--config") + 1]).read_text())
    batch = config["data"]["batch_size"]
    lr = config.get("model", {}).get("lr", 0.003)
    call = {"batch": batch, "lr": lr, "steps": config["trainer"]["max_steps"], "preloaded": preloaded,
            "pid": os.getpid(), "pgid": os.getpgid(0)}  # fmt: skip
    if os.environ.get("FAKE_TRIAL_CHILD"):
        child = subprocess.Popen(["sleep", "60"])
        call.update(child=child.pid, child_pgid=os.getpgid(child.pid))
    calls = os.environ.get("FAKE_TRIAL_CALLS")
    if calls:
        with open(calls, "a") as f:
            f.write(json.dumps(call) + "\n")
    if os.environ.get("FAKE_TRIAL_KILL"):
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(os.environ.get("FAKE_TRIAL_SLEEP", "0")))
    if lr < 0:
        print(f"ValueError: Invalid learning rate: {lr}", file=sys.stderr)
        return 1
    rates = json.loads(os.environ.get("FAKE_TRIAL_RATES", "{}"))
    rate = float(rates.get(str(batch), 1000.0 * batch))
    logger = config["trainer"]["logger"]["init_args"]
    path = Path(logger["save_dir"]) / logger["name"] / f"version_{logger['version']}" / "metrics.csv"
    path.parent.mkdir(parents=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, ["step", "train/tokens_per_sec", "train/host_peak_rss"])
        writer.writeheader()
        for step in range(config["trainer"]["max_steps"]):
            writer.writerow({"step": step, "train/tokens_per_sec": rate if step else "", "train/host_peak_rss": 0.5})
    return 0


if __name__ == "__main__":
    sys.exit(main())
