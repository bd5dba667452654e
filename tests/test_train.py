"""The main job end to end: launch, train, report (the tiny GPT, so it stays quick)."""

import subprocess
import sys


def test_shardwise_train_runs_and_the_loss_falls():
    out = subprocess.run(
        [sys.executable, "-m", "shardwise", "train", "--model-size", "tiny", "--steps", "40",
         "--nproc", "2", "--seq-len", "32", "--log-every", "10"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    first, last = (float(v) for v in text.split("\nloss ")[1].split()[0:3:2])
    assert last < first - 1.0, text  # byte-level loss starts near ln(256) = 5.5
    assert "memory held per rank" in text and "DDP total" in text
    assert "theory: 3*psi*b*(N-1)/N" in text
    assert text.count("  rank ") == 6  # both ranks in all three tables
    assert "peak memory of one step" in text


def test_cli_lists_its_commands():
    out = subprocess.run([sys.executable, "-m", "shardwise", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "train" in out.stdout
