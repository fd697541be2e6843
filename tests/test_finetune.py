"""Fine-tuning a Hugging Face model: from a local ``save_pretrained`` directory, fully or with a LoRA
adapter through peft, and back to transformers and peft.

- The first training loss of a run from ``MODEL.OPTIONS.pretrained`` is the pretrained model's loss
  on the first batch, computed here with transformers alone; run_info names the directory and
  the digest of its weights.
- Overrides that keep the weights' shapes apply; those that change them, a missing directory, one
  without config.json and misplaced keys exit 2 naming the key.
- LoRA: only the adapter trains; checkpoints hold no frozen weight; killed with SIGKILL and rerun,
  the adapter and metrics are byte-identical; a changed base directory is refused at resume;
  ``PeftModel.from_pretrained(base, final)`` gives the trained model's logits, ``final/merged``
  the same model merged, and ``evaluate`` reads the adapter.

The kill is a process of its own; the reference, the rerun and the refused resume run in the test's
process through the same command line (``run_here``: a process of its own is mostly torch's import).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.hf import FT_CFG, fit, ft_config, ft_opts, save_base
from helpers.in_process import reset_accelerate, run_cli, run_here
from helpers.runs import TrainRun, committed, read_metrics, read_summary
from safetensors import safe_open

from linnaeus_accel.config import ConfigError
from linnaeus_accel.data import build_dataset
from linnaeus_accel.evaluate import evaluate
from linnaeus_accel.models import build_model
from linnaeus_accel.models.pretrained import weights_digest

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_base(tmp_path_factory.mktemp("base") / "base")


FULL = ["MODEL.OPTIONS.lora", "null"]  # full fine-tuning


# -- full fine-tuning -----------------------------------------------------------------------------
def test_first_loss_is_the_pretrained_models_loss_on_the_first_batch(tmp_path: Path, base: Path) -> None:
    config = ft_config(base, tmp_path, 4, *FULL, "SCHEDULE.METRICS.STEP_INTERVAL", "1")
    reset_accelerate()
    train_data = build_dataset(config, "train")
    first = []

    class FirstBatch(torch.utils.data.Dataset[Any]):  # records what the run's first batch holds
        tokens_per_sample, vocab_size = train_data.tokens_per_sample, train_data.vocab_size

        def __len__(self) -> int:
            return len(train_data)

        def __getitem__(self, index: int) -> Any:
            if len(first) < config.DATA.BATCH_SIZE:
                first.append(train_data[index]["input_ids"])
            return train_data[index]

    from linnaeus_accel import Callback, Trainer

    class FromTheFirstStep(Callback):  # the trainer reads a sample batch at construction
        def on_fit_start(self, trainer: Any) -> None:
            first.clear()

    model = build_model(config, train_data)
    trainer = Trainer(
        config, model, FirstBatch(), build_dataset(config, "val"), callbacks=[FromTheFirstStep()]
    )
    try:
        summary_ = trainer.fit()
    finally:
        reset_accelerate()
    loss_at_1 = next(r["train/loss"] for r in read_metrics(config.output_dir) if r["global_step"] == 1)
    reference = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    batch = torch.stack(first)
    with torch.no_grad():  # the exact mean over target tokens: every window's tokens but its first
        expected = float(reference(batch, labels=batch).loss)
    assert loss_at_1 == pytest.approx(expected, abs=1e-6)
    info = summary_["run_info"]["model"]
    assert info["pretrained"] == str(base.resolve())
    assert info["pretrained_weights_xxh3"] == weights_digest(base)
    assert info["trainable_parameters"] == info["parameters"]


def test_options_override_a_pretrained_config_only_where_the_weights_fit(tmp_path: Path, base: Path) -> None:
    def build(**options: Any) -> Any:
        more = [x for name, value in options.items() for x in (f"MODEL.OPTIONS.{name}", json.dumps(value))]
        return build_model(ft_config(base, tmp_path, 4, *FULL, *more), None)

    assert build(dtype="bfloat16").dtype == torch.bfloat16
    model = build(attention_dropout=0.25, gradient_checkpointing=True)
    assert model.config.attention_dropout == 0.25
    assert model.is_activation_checkpointing
    assert model.dtype == torch.float32
    reference = transformers.AutoModelForCausalLM.from_pretrained(base)
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), reference.state_dict().values(), strict=True)
    )
    with pytest.raises(ConfigError, match=r"MODEL.OPTIONS.hidden_size: cannot be 64 .*changes the shape"):
        build(hidden_size=64)
    with pytest.raises(
        ConfigError, match=r"MODEL.OPTIONS.model_type: is 'gpt2' but .* holds a 'llama' model"
    ):
        build(model_type="gpt2")


@pytest.mark.parametrize(
    ("options", "key", "message"),
    [
        ({"pretrained": "/no/such/dir"}, "MODEL.OPTIONS.pretrained", "does not exist"),
        ({"pretrained": "EMPTY"}, "MODEL.OPTIONS.pretrained", "holds no config.json: not a model directory"),
        ({"_name_or_path": "/models/x"}, "MODEL.OPTIONS._name_or_path", "use MODEL.OPTIONS.pretrained"),
        ({"cache_dir": "/tmp"}, "MODEL.OPTIONS.cache_dir", "an argument of from_pretrained"),
        ({"_attn_implementation": "eager"}, "MODEL.OPTIONS._attn_implementation", "a private field"),
        (
            {"lora": {"target_modules": ["nope"]}},
            "MODEL.OPTIONS.lora.target_modules",
            "the model's linear layers: down_proj",
        ),
        ({"lora": {"r": 0}}, "MODEL.OPTIONS.lora.r", "greater than or equal to 1"),
        ({"lora": {"rank": 4}}, "MODEL.OPTIONS.lora.rank", "Extra inputs"),
        ({"dtype": "bfloat17"}, "MODEL.OPTIONS.dtype", "is not a torch dtype"),
    ],
)
def test_bad_model_options_exit_2_naming_the_key(
    tmp_path: Path, base: Path, options: dict[str, Any], key: str, message: str
) -> None:
    (tmp_path / "empty").mkdir()
    names = {"EMPTY": str(tmp_path / "empty")}
    more = [
        x
        for name, value in options.items()
        for x in (
            f"MODEL.OPTIONS.{name}",
            json.dumps(names.get(value, value) if isinstance(value, str) else value),
        )
    ]
    if "lora" in options:
        more = [*FULL, *more]  # the option alone, not merged with the config's
    rc, out, err = run_cli("train", "--cfg", FT_CFG, "--opts", *ft_opts(base, tmp_path, 4, *more))
    assert rc == 2, out + err
    assert key in err, err
    assert message in err, err


def test_lora_without_peft_says_how_to_install(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)  # makes the import fail
    config = ft_config(base, Path("unused"), 4)
    with pytest.raises(
        ConfigError, match=r"MODEL.OPTIONS.lora: LoRA needs peft: pip install 'linnaeus-accel\[peft\]'"
    ):
        build_model(config, None)


# -- LoRA ------------------------------------------------------------------------------------------
def test_lora_trains_the_adapter_only_and_transformers_and_peft_load_it(
    tmp_path: Path, base: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = ft_config(base, tmp_path, 20)
    trainer, summary_ = fit(config)
    final = config.output_dir / "final"
    assert {"adapter_config.json", "adapter_model.safetensors", "merged"} <= {p.name for p in final.iterdir()}
    info = summary_["run_info"]["model"]
    assert info["trainable_parameters"] == 4 * 2 * 8 * 32  # r 8 on q, k, v, o (32 x 32) of the one layer
    assert info["trainable_parameters"] < info["parameters"] / 10
    # The start-up summary says what trains.
    total, trained = info["parameters"], info["trainable_parameters"]
    shown = (
        f"Model:    PeftModelForCausalLM from {base.resolve()}: {total:,} parameters, {trained:,} trained ("
    )
    assert shown in capsys.readouterr().out
    trained = trainer.accelerator.unwrap_model(trainer.model).eval()
    loaded = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base), final
    ).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(final / "merged").eval()
    windows = torch.stack([build_dataset(config, "val")[i]["input_ids"] for i in range(4)])
    with torch.no_grad():
        logits = trained(windows).logits
        assert torch.equal(loaded(windows).logits, logits)
        torch.testing.assert_close(merged(windows).logits, logits, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(
            transformers.AutoModelForCausalLM.from_pretrained(base)(windows).logits, logits
        )
    reset_accelerate()
    try:
        result = evaluate(config, final, out=tmp_path / "eval.json")
    finally:
        reset_accelerate()
    assert result["metrics"]["val/loss"] == summary_["last_validation"]["val/loss"]


LORA_RUN = [
    "DATA.BATCH_SIZE", "8", "TRAIN.TARGET_TOKENS", str(40 * 8 * 128),
    "SCHEDULE.CHECKPOINT.INTERVAL_STEPS", "10", "SCHEDULE.CHECKPOINT.INTERVAL_EPOCHS", "null",
    "SCHEDULE.CHECKPOINT.MID_EPOCH", "true", "SCHEDULE.METRICS.STEP_INTERVAL", "5",
    "SCHEDULE.CHECKPOINT.ASYNC", "true",  # the host snapshot drops the frozen base before copying
]  # fmt: skip


@pytest.mark.slow
def test_lora_killed_and_rerun_is_byte_identical_and_a_changed_base_is_refused(tmp_path: Path) -> None:
    base = save_base(tmp_path / "base")
    opts = [*LORA_RUN, "MODEL.OPTIONS.pretrained", str(base), "MODEL.OPTIONS.lora.merge", "false"]
    for name in ("ref", "killed"):
        (tmp_path / name).mkdir()
    reference = run_here(TrainRun(tmp_path / "ref", opts, cfg=FT_CFG)).check_ok()
    run = TrainRun(tmp_path / "killed", opts, cfg=FT_CFG)
    assert run.run(kill_at="checkpoint_committed:2").returncode != 0
    checkpoint = run.dir / "checkpoints" / committed(run.dir)[-1]
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as weights:
        keys = list(weights.keys())
    assert keys
    assert all(".lora_A." in k or ".lora_B." in k for k in keys), keys  # no frozen weight
    tampered = run.clone(tmp_path / "tampered")
    resumed = run_here(run)
    resumed.check_ok()
    assert "resumed from" in resumed.output
    adapter = "adapter_model.safetensors"
    assert (run.dir / "final" / adapter).read_bytes() == (reference.dir / "final" / adapter).read_bytes()
    configs = [json.loads((r.dir / "final" / "adapter_config.json").read_text()) for r in (run, reference)]
    for config in configs:  # peft keeps target_modules as a set: its order varies between processes
        config["target_modules"] = sorted(config["target_modules"])
    assert configs[0] == configs[1]

    def history(run_dir: Path) -> list[dict[str, Any]]:  # what was trained and measured, not how fast
        return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in read_metrics(run_dir)]

    assert history(run.dir) == history(reference.dir)
    assert read_summary(run.dir)["global_step"] == 40

    shutil.rmtree(base)
    save_base(base, seed=1)  # the same path, other weights
    refused = run_here(tampered)
    assert refused.returncode == 2, refused.tail()
    assert "MODEL.OPTIONS.pretrained: the frozen base weights are not those checkpoint" in refused.output
    assert str(base) in refused.output


# -- sequence classification -------------------------------------------------------------------------
def token_classes(count: int, seed: int) -> torch.utils.data.TensorDataset:
    """Sequences of 16 ids below 50, labelled 1 when most of them are below 25."""
    ids = torch.randint(0, 50, (count, 16), generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.TensorDataset(ids, ((ids < 25).sum(1) > 8).long())


@pytest.mark.parametrize("start", ["config", "pretrained"])
def test_sequence_classification_from_a_config_or_a_pretrained_lm(
    tmp_path: Path, base: Path, start: str
) -> None:
    """hf_sequence_classification trains under the classification task; from a causal LM's
    directory its body is the pretrained one and its new head is sized by num_labels; final/ is
    what AutoModelForSequenceClassification loads, with the trained logits."""
    from linnaeus_accel import Trainer
    from linnaeus_accel.config import validate_config

    options: dict[str, Any] = {"num_labels": 2}
    if start == "pretrained":
        options["pretrained"] = str(base)
    else:
        options |= {"vocab_size": 50, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
        options |= {"num_attention_heads": 2, "max_position_embeddings": 16}
    config = validate_config(
        {
            "EXPERIMENT": {"NAME": "cls"},
            "ENV": {"OUTPUT": {"BASE_DIR": str(tmp_path)}},
            "DATA": {"BATCH_SIZE": 32},
            "MODEL": {"TYPE": "hf_sequence_classification", "OPTIONS": options},
            "TASK": {"NAME": "classification"},
            "TRAIN": {"EPOCHS": 3, "CLIP_GRAD": 1.0},
            "LR_SCHEDULER": {"BASE_LR": 3e-3, "REFERENCE_BS": None},
            "SCHEDULE": {"VALIDATION": {"INTERVAL_EPOCHS": 1}},
        }
    )
    reset_accelerate()
    train_data, val_data = token_classes(256, 0), token_classes(64, 1)
    model = build_model(config, train_data)
    if start == "pretrained":
        reference = transformers.AutoModelForCausalLM.from_pretrained(base)
        assert torch.equal(model.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    trainer = Trainer(config, model, train_data, val_data)
    try:
        summary_ = trainer.fit()
    finally:
        reset_accelerate()
    assert summary_["status"] == "completed"
    assert summary_["last_validation"]["val/acc"] > 0.5
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(
        config.output_dir / "final"
    ).eval()
    trained = trainer.accelerator.unwrap_model(trainer.model).eval()
    with torch.no_grad():
        assert torch.equal(loaded(val_data.tensors[0]).logits, trained(val_data.tensors[0]).logits)


def test_a_peft_model_given_in_python_is_checkpointed_without_its_frozen_base(
    tmp_path: Path, base: Path
) -> None:
    """Trainer(model=get_peft_model(...)): the checkpoint holds the adapter alone, and the digest
    of the base it was trained on."""
    from linnaeus_accel import Trainer

    config = ft_config(base, tmp_path, 10, *FULL)  # its last step is a checkpoint
    model = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(base),
        peft.LoraConfig(r=2, target_modules=["q_proj"]),
    )
    reset_accelerate()
    try:
        Trainer(config, model, build_dataset(config, "train")).fit()
    finally:
        reset_accelerate()
    checkpoint = sorted((config.output_dir / "checkpoints").glob("step_*"))[-1]
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as weights:
        assert sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in weights.keys()}) == ["q_proj"]  # noqa: SIM118
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["frozen_weights"]["frozen_parameters"] > 0
