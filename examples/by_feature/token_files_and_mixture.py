"""Token files and a weighted mixture: tokenize two corpora, pretrain a tiny causal LM on 80/20 of them.

    python examples/by_feature/token_files_and_mixture.py

Two sources from the help topics that ship with Python, as JSON Lines: the long reference topics
and the short keyword ones. ``tokenize_files`` (what ``linnaeus-accel tokenize`` runs) writes each
as a token file (UTF-8 bytes, an end-of-document token after each document) and its sidecar
``.bin.json`` (dtype, vocabulary, counts). The run is configs/pretrain.yaml's, with these files as
its mixture's sources: 80% of the samples from the reference, 20% from the keywords (the small
source cycles), at every step and after any resume; the model is lm_tiny's Llama, made smaller.
Each run of the script writes to a new directory under ``$EXAMPLES_OUT`` (default: the temp dir).
"""

import json
import os
import pydoc_data.topics
import tempfile
from pathlib import Path

from accelerate.utils import set_seed

from linnaeus_accel import Trainer, load_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.data.tokenize.command import tokenize_files
from linnaeus_accel.models import build_model

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "pretrain.yaml"
OUT = tempfile.mkdtemp(prefix="mixture_", dir=os.environ.get("EXAMPLES_OUT"))

topics = [pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics)]
sources = []
for label, weight, texts in [
    ("reference", 0.8, [t for t in topics if len(t) >= 2000]),
    ("keywords", 0.2, [t for t in topics if len(t) < 2000]),
]:
    corpus, tokens = Path(OUT, f"{label}.jsonl"), Path(OUT, f"{label}.bin")
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    sidecar = tokenize_files(corpus, tokens, overwrite=True)  # writes reference.bin and reference.bin.json
    print(f"{tokens}: {sidecar.num_documents} documents, {sidecar.num_tokens:,} tokens ({sidecar.dtype})")
    options = {"paths": [str(tokens)], "seq_len": 65}
    sources.append({"name": "token_files", "label": label, "weight": weight, "options": options})

small = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "max_position_embeddings": 65}
every_10 = {"INTERVAL_STEPS": 10, "MID_EPOCH": True}
config = load_config(
    {
        "BASE": [str(CONFIG)],
        "EXPERIMENT": {"NAME": "mixture"},
        "ENV": {"OUTPUT": {"BASE_DIR": OUT}},
        "DATA": {"DATASET": {"OPTIONS": {"sources": sources}}},
        "MODEL": {"OPTIONS": small},
        "TRAIN": {"STEPS": 40},
        "SCHEDULE": {"VALIDATION": {**every_10, "MAX_BATCHES": 4}, "CHECKPOINT": every_10},
    }
)
train_data, val_data = build_dataset(config, "train"), build_dataset(config, "val")
set_seed(config.EXPERIMENT.SEED)
summary = Trainer(config, build_model(config, train_data), train_data, val_data).fit()

records = [json.loads(line) for line in Path(config.output_dir, "metrics.jsonl").read_text().splitlines()]
last = [r for r in records if "samples_seen/reference" in r][-1]  # every training record counts by source
seen = {label: last[f"samples_seen/{label}"] for label in ("reference", "keywords")}
assert abs(seen["reference"] - 0.8 * summary["samples_seen"]) <= 2, seen
print(f"{summary['tokens_seen']:,} tokens trained; samples by source {seen}: 80/20, as weighted")
