"""Exact resume from records on disk: a worker SIGKILLed in the middle of an epoch, restarted by the launcher,
ends bitwise equal to an uninterrupted run (config.deterministic=True, CPU); then a flipped byte in a record
ends the next run with one line naming the file and the record, exit 2, its checkpoints kept."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from mwloop.data import records
from tests import records_task, warm_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 60


def command(workdir: str, data: str, steps: int = STEPS) -> list[str]:
    # 600 records, 32 per step: 60 steps are 3.2 epochs; checkpoints every 20 steps (position 640: mid-epoch 1).
    return [sys.executable, "-m", "mwloop.launch", "--num_workers=1", "--max_restarts=1", "--grace_s=2", "--",
            f"--config=tests/records_task.py:{data}", "--mode=train", f"--config.train.steps={steps}",
            "--config.train.steps_per_loop=5", "--config.train.log_every_steps=5",
            "--config.train.checkpoint_every_steps=20", "--config.deterministic=True", f"--workdir={workdir}"]


def final_weights(workdir: str) -> dict[str, np.ndarray]:
    reader = tf.train.load_checkpoint(os.path.join(workdir, "checkpoints", f"ckpt-{STEPS}"))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if name.startswith(("model/", "optimizer/", "step/"))}


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_is_bitwise_equal(tmp_path):
    data = records_task.write_records(str(tmp_path / "data"))
    # The launchers fork their warm-start servers from the test's (no TensorFlow import of their own).
    env = warm_main.serving(dict(os.environ, GCE_METADATA_IP="127.0.0.1:9"))
    subprocess.run(command(str(tmp_path / "reference"), data), cwd=ROOT, env=env, check=True, capture_output=True,
                   timeout=300)
    proc = subprocess.Popen(command(str(tmp_path / "killed"), data), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    output, killed_at = [], None
    for line in proc.stdout:
        output.append(line)
        step = re.search(r"step (\d+)/", line)
        # After the checkpoint at 20 (mid-epoch 1 of 600 records), before the one at 40.
        if killed_at is None and step and int(step[1]) >= 25:
            pid = re.findall(r"started worker \d+ \(pid (\d+)\)", "".join(output))[-1]
            os.kill(int(pid), signal.SIGKILL)
            killed_at = int(step[1])
    code = proc.wait(timeout=300)
    text = "".join(output)
    assert killed_at is not None and code == 0 and "restart 1/1" in text, text[-3000:]
    # Resumed from a checkpoint in the middle of an epoch (positions 640 and 1280 of 600-record epochs).
    assert re.search(r"resumed from step (20|40) ", text), text[-3000:]
    reference, resumed = final_weights(str(tmp_path / "reference")), final_weights(str(tmp_path / "killed"))
    assert reference.keys() == resumed.keys()
    assert all(np.array_equal(reference[k], resumed[k]) for k in reference), f"killed at step {killed_at}"

    # The run continued to step 100 after one byte of record 100 flipped: steps 76-93 read all of epoch 4.
    on_disk = records.open_records(os.path.join(data, "train"))
    row = on_disk.index[100]
    part = on_disk.files[row["file"]]
    with open(part, "r+b") as f:
        f.seek(int(row["offset"]) + records.HEADER_BYTES + 5)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    bad = subprocess.run(command(str(tmp_path / "killed"), data, steps=100), cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    last = bad.stdout.strip().splitlines()[-1] if bad.stdout.strip() else ""
    assert bad.returncode == 2, bad.stdout[-3000:] + bad.stderr[-3000:]
    assert re.search(rf"error: {re.escape(part)}: record 100 \(offset {int(row['offset'])}\) does not match its "
                     rf"checksum; .* python -m mwloop.data.convert", bad.stdout + bad.stderr), last
    # Nothing lost: the newest checkpoint is the one before the bad record's step (80: the record is read later),
    # whole and readable.
    latest = tf.train.latest_checkpoint(str(tmp_path / "killed" / "checkpoints"))
    assert latest.endswith("ckpt-80")
    assert tf.train.load_checkpoint(latest).get_tensor("step/.ATTRIBUTES/VARIABLE_VALUE") == 80
