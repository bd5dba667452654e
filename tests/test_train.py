"""The main job end to end: launch, train, report (the tiny GPT, so it stays quick)."""

import shutil
import subprocess
import sys

import pytest


def test_shardwise_train_runs_and_the_loss_falls(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "shardwise", "train", "--model-size", "tiny", "--steps", "40",
         "--nproc", "2", "--seq-len", "32", "--log-every", "10", "--report", str(tmp_path / "r.html"),
         "--loss-curve", str(tmp_path / "loss.png")],
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
    assert (tmp_path / "r.html").stat().st_size > 10_000 and (tmp_path / "r.chrome.json").exists()
    assert text.count("ETA ") == 5  # not a terminal: a plain progress line per logged step
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_cli_lists_its_commands():
    out = subprocess.run([sys.executable, "-m", "shardwise", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "train" in out.stdout


def test_train_resumes_from_the_latest_checkpoint(tmp_path):
    args = [sys.executable, "-m", "shardwise", "train", "--model-size", "tiny", "--nproc", "2",
            "--seq-len", "32", "--steps", "8", "--log-every", "8", "--checkpoint-dir", str(tmp_path)]
    first = subprocess.run(args + ["--save-every", "4"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.rmtree(tmp_path / "step-00000008")  # as if the job died after step 4's checkpoint
    again = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {tmp_path / 'step-00000004'} at step 4; RNG restored" in again.stdout
    final = lambda out: out.split("\nloss ")[1].split()[2]  # noqa: E731
    assert final(again.stdout) == final(first.stdout)


def test_train_hybrid_shard_reports_both_links():
    out = subprocess.run(
        [sys.executable, "-m", "shardwise", "train", "--model-size", "tiny", "--steps", "6",
         "--nproc", "4", "--seq-len", "32", "--log-every", "3", "--strategy", "hybrid_shard",
         "--shard-size", "2"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "strategy hybrid_shard" in text and "replicate all-reduce" in text
    assert "theory: 3*psi*b*(S-1)/S + 2*psi*b*(R-1)/(R*S)" in text and "N = 4 = R 2 x S 2" in text
    link = text.split("across the replicas (R = 2) theory ")[1]
    theory, measured = link.split(" MiB, measured ")
    assert float(measured.split()[0]) == float(theory) > 0  # tiny's shards have no padding rows
    assert text.count("  rank ") == 12  # four ranks in all three tables


def test_train_refuses_shard_size_without_hybrid():
    from shardwise.job.train import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--strategy", "full_shard", "--shard-size", "2"])
    assert parse_args(["--strategy", "hybrid_shard", "--shard-size", "2"]).shard_size == 2


def test_train_memory_budget_applies_the_plan(tmp_path):
    """--memory-budget: rank 0 plans, every rank shards as the plan says, and MemTracker's
    peak is within the budget."""
    out = subprocess.run(
        [sys.executable, "-m", "shardwise", "train", "--model-size", "tiny", "--steps", "4", "--nproc", "2",
         "--seq-len", "32", "--batch-size", "2", "--memory-budget", "2MiB"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "budget 2.00 MiB: choose shard_grad_op" in text and "strategy shard_grad_op" in text
    peaks = [float(line.split()[-1]) for line in text.split("peak memory of one step")[1].splitlines()[1:3]]
    assert len(peaks) == 2 and max(peaks) <= 2.0, text


def test_train_memory_budget_refuses_what_it_chooses():
    from shardwise.job.train import parse_args

    for extra in (["--strategy", "no_shard"], ["--cpu-offload"], ["--activation-checkpointing"]):
        with pytest.raises(SystemExit):
            parse_args(["--memory-budget", "1GiB", *extra])
