"""Benchmarks of linnaeus-accel against what a user would otherwise run (a hand-written Accelerate
loop, ``transformers.Trainer``, a bare ``save_state``), measured side by side in one run:
``python -m benchmarks`` from the repository root (see ``benchmarks/README.md``).

Each module exposes ``run(smoke: bool) -> list[Row]`` (``common.Row``); ``smoke=True`` is the
seconds-long run the test suite makes so that no benchmark rots.
"""

# In the order ``python -m benchmarks`` runs them.
MODULES = (
    "step_overhead",
    "nanogpt_step",
    "hf_trainer",
    "resume",
    "checkpoint",
    "lora_checkpoint",
    "plan",
    "data_loading",
    "data_scale",
    "sharded_streams",
    "resume_data",
    "species",
    "muon",
)
