"""What several test modules share, by topic; no test module imports another.

- ``configs``: the repository's paths, the shipped configs, option lists and config builders.
- ``in_process``: the command line in this process, a ``TrainRun`` trained here (``run_here``), and
  forgetting Accelerate's state between runs.
- ``processes``: a free port, the environment and launcher command lines of started processes,
  and ending them.
- ``runs``: a ``linnaeus-accel train`` subprocess (``TrainRun``), killed or not, and reading and
  comparing what it leaves (metrics, summary, checkpoints).
- ``launches``: training under ``accelerate launch`` or ``torchrun``, each process's output kept.
- ``checkpoints``: checkpoints made by hand, and planted pickles.
- ``hf``: Hugging Face models: the small causal-LM config, training in this process, ``final/``
  read back by transformers, a pretrained base to fine-tune.
- ``tokens``: token files, their sidecars, a tiny tokenizer, and configs training on them.
- ``trackers``: what W&B wrote, read back by wandb itself.
- ``datasets``: small datasets several modules train on.
- ``markdown_blocks``: the fenced code blocks of a Markdown page, and which of them run.
- ``host_sync``: recording reads of tensor values back to the host, and where they were made.
- ``s3_server``: a real S3 endpoint on localhost (moto's server mode), a bucket on it, its keys.
- ``nodes``: two "machines" on this one, each with its own working directory (``torchrun --nnodes 2``).

Fixtures several modules use live in ``conftest.py``. Test modules (and the scripts they start
with ``python tests/<script>.py``) import these as ``helpers.<module>``: ``tests/`` is on the
module path (pytest puts a conftest's folder there; a script's own folder is there).
"""
