"""Benchmark shardwise against PyTorch's FSDP2, DDP and the compute floor, side by side.

    python benchmarks/compare.py --model small --nproc 2          # local ranks on CPU (Gloo)
    torchrun --nproc_per_node 8 benchmarks/compare.py --model large --mixed-precision bf16

The same as ``shardwise bench``; the harness is shardwise.bench.harness (options: --help).
"""

from shardwise.bench.harness import main

if __name__ == "__main__":
    main()
