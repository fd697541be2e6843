"""LoRA fine-tuning of a transformers model: only an adapter trains; peft and transformers load it back.

    python examples/by_feature/lora_finetuning.py

The base is a tiny Llama built from a transformers config and saved with ``save_pretrained`` (it
stands for a model you downloaded; nothing is downloaded here). The run is
configs/lm_finetune.yaml's: ``MODEL.OPTIONS.pretrained`` names the base's directory and
``MODEL.OPTIONS.lora`` the adapter (rank, alpha, target modules; ``merge: true`` also writes the
base with the adapter merged in). Checkpoints hold the adapter and its optimizer state only.
``final/`` is the adapter as peft writes it, and ``final/merged/`` a plain transformers model: the
script loads both and checks they compute the same logits. Needs ``pip install -e '.[lm,peft]'``.
Each run of the script writes to a new directory under ``$EXAMPLES_OUT`` (default: the temp dir).
"""

import os
import tempfile
from pathlib import Path

import torch
from accelerate.utils import set_seed
from peft import PeftModel
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from linnaeus_accel import Trainer, load_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.models import build_model

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "lm_finetune.yaml"
OUT = tempfile.mkdtemp(prefix="lora_", dir=os.environ.get("EXAMPLES_OUT"))
BASE = Path(OUT, "base")

torch.manual_seed(0)
shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
LlamaForCausalLM(LlamaConfig(vocab_size=257, max_position_embeddings=65, **shape)).save_pretrained(BASE)

config = load_config(
    {
        "BASE": [str(CONFIG)],
        "EXPERIMENT": {"NAME": "lora"},
        "ENV": {"OUTPUT": {"BASE_DIR": OUT}},
        "DATA": {"DATASET": {"OPTIONS": {"seq_len": 65}}},  # bytes: the base's vocabulary is 257
        "MODEL": {"OPTIONS": {"pretrained": str(BASE), "lora": {"r": 8, "alpha": 16, "merge": True}}},
        "TRAIN": {"TARGET_TOKENS": None, "STEPS": 30},
    }
)
train_data, val_data = build_dataset(config, "train"), build_dataset(config, "val")
set_seed(config.EXPERIMENT.SEED)
model = build_model(config, train_data)  # the base, frozen, wrapped by peft
trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
assert trained < 0.1 * sum(p.numel() for p in model.parameters())  # the adapter only
summary = Trainer(config, model, train_data, val_data).fit()

final = Path(config.output_dir, "final")
tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), final)  # base + adapter
merged = AutoModelForCausalLM.from_pretrained(final / "merged")
base = AutoModelForCausalLM.from_pretrained(BASE)
ids = torch.tensor([list(b"def main():")])
with torch.no_grad():
    assert torch.allclose(tuned(ids).logits, merged(ids).logits, atol=1e-5)
    assert not torch.allclose(base(ids).logits, merged(ids).logits, atol=1e-5)  # the adapter did something
print(f"{summary['status']} at step {summary['global_step']}: final/ (adapter) and final/merged/ agree")
