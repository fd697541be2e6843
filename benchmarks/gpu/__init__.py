"""The GPU check: ``bash benchmarks/gpu/run.sh OUT_DIR`` (or ``python -m benchmarks.gpu OUT_DIR``).

Prepared on the CPU so that a short loan of one GPU goes to measuring (``benchmarks/gpu/README.md``).
Each part is a module with ``NAME``, ``TITLE`` and ``run_part(ctx) -> Part``, in order of value:
"""

# name -> module, in the order they run. The parts that check correctness run at the same time
# (the GPU has room for all their runs); the timed parts run alone after them. At tiny size, where
# nothing is timed, every part runs at once.
PARTS = {
    "e2e": "benchmarks.gpu.e2e",  # one GPU: bf16, kill -9 and resume, ASYNC, EMA, LoRA
    "sharded": "benchmarks.gpu.sharded",  # FSDP2 and ZeRO-3 through the shipped accelerate configs
    "throughput": "benchmarks.gpu.throughput",  # 124M GPT-2: ours vs hand-written loops
    "recipe": "benchmarks.gpu.recipe",  # configs/gpt2_124m.yaml: tokens/s and MFU vs hand-written; Muon
    "species": "benchmarks.gpu.species",  # configs/species.yaml, ConvNeXt-T, JPEG workers: vs hand-written
    "host_sync": "benchmarks.gpu.host_sync",  # no synchronising call on quiet steps
    "checkpoint": "benchmarks.gpu.checkpoint_cost",  # how long a checkpoint blocks, 124M + AdamW
}
CONCURRENT = ("e2e", "sharded", "host_sync")
