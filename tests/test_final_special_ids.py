"""``final/`` carries the run's special token ids, not the model type's defaults (Llama's eos 2, bos 1).

- Bytes: ``config.json`` and ``generation_config.json`` (of ``final/``, ``final/ema/`` and a LoRA
  run's ``final/merged/``) say ``eos_token_id`` 256, the data's end-of-document id, and no
  ``bos_token_id``; ``generate()`` on the loaded model stops at 256 and goes on past byte 0x02.
  The same for a model given through the Python API with Llama's ids; one built from
  ``MODEL.OPTIONS`` has the data's ids from the start.
- A tokenizer: its end-of-document, beginning-of-text and padding ids, the same in the configs and
  in the tokenizer ``AutoTokenizer`` reads from ``final/``.
- An option that contradicts the data's ids is an error naming it. Tokens whose tokenizer.json
  is not at hand decide eos alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.hf import fit, ft_config, lm_config, save_base, tokenized_lm_config
from helpers.tokens import SENTENCES

from linnaeus_accel import Trainer
from linnaeus_accel.config import ConfigError
from linnaeus_accel.data import build_dataset
from linnaeus_accel.data.tokens.packing import BYTE_EOS
from linnaeus_accel.models import build_model

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

LLAMA_EOS, LLAMA_BOS = 2, 1  # LlamaConfig's defaults, which final/ used to keep
TINY_LLAMA = {
    "vocab_size": 257, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "max_position_embeddings": 129, "tie_word_embeddings": True,
}  # fmt: skip


def written_ids(directory: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The special ids of ``directory``'s config.json and generation_config.json, as written and
    as transformers loads them (the same)."""
    names = ("eos_token_id", "bos_token_id", "pad_token_id")
    config = json.loads((directory / "config.json").read_text())
    generation = json.loads((directory / "generation_config.json").read_text())
    loaded = transformers.AutoConfig.from_pretrained(directory)
    loaded_generation = transformers.GenerationConfig.from_pretrained(directory)
    assert {n: getattr(loaded, n) for n in names} == {n: config.get(n) for n in names}
    assert {n: getattr(loaded_generation, n) for n in names} == {n: generation.get(n) for n in names}
    return {n: config.get(n) for n in names}, {n: generation.get(n) for n in names}


def generated(model: Any, tokens: list[int], max_new_tokens: int = 8) -> list[int]:
    """What ``model.generate`` adds to a prompt when its logits pick ``tokens`` in turn (the last
    one repeated); it stops at the loaded generation config's eos_token_id."""
    prompt = torch.tensor([list(b"def ")])

    def forced(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        picked = torch.full_like(scores, -float("inf"))
        picked[:, tokens[min(input_ids.shape[1] - prompt.shape[1], len(tokens) - 1)]] = 0.0
        return picked

    with torch.no_grad():
        out = model.generate(
            prompt,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            logits_processor=transformers.LogitsProcessorList([forced]),
        )
    return [int(t) for t in out[0, prompt.shape[1] :]]


def test_a_byte_level_runs_final_stops_at_the_end_of_a_document(tmp_path: Path) -> None:
    config = lm_config(tmp_path, "CALLBACKS", "[{NAME: ema}]", steps=2)
    train_data, val_data = build_dataset(config, "train"), build_dataset(config, "val")
    built: Any = build_model(config, train_data)  # MODEL.OPTIONS' model: built with the data's ids
    assert (built.config.eos_token_id, built.config.bos_token_id) == (BYTE_EOS, None)
    assert (built.generation_config.eos_token_id, built.generation_config.pad_token_id) == (
        BYTE_EOS,
        BYTE_EOS,
    )
    # A model given through the Python API keeps Llama's ids until final/ is written.
    given = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    assert (given.config.eos_token_id, given.generation_config.eos_token_id) == (LLAMA_EOS, LLAMA_EOS)
    trainer = Trainer(config, given, train_data, val_data)
    trainer.fit()
    final = config.output_dir / "final"
    for directory in (final, final / "ema"):
        model_ids, generation_ids = written_ids(directory)
        assert model_ids == {"eos_token_id": BYTE_EOS, "bos_token_id": None, "pad_token_id": None}
        # pad: what generate() takes anyway for the rows of a batch that have ended.
        assert generation_ids == {"eos_token_id": BYTE_EOS, "bos_token_id": None, "pad_token_id": BYTE_EOS}
    assert not (final / "tokenizer.json").exists()  # bytes need none
    loaded = transformers.AutoModelForCausalLM.from_pretrained(final).eval()
    a, b = ord("a"), ord("b")
    assert generated(loaded, [a, b, BYTE_EOS]) == [a, b, BYTE_EOS]  # stops at the end of a document
    assert generated(loaded, [a, LLAMA_EOS, b]) == [a, LLAMA_EOS, *[b] * 6]  # byte 0x02 is a byte
    # The model in memory generates the same way.
    trained = trainer.accelerator.unwrap_model(trainer.model)
    assert trained.generation_config.eos_token_id == trained.config.eos_token_id == BYTE_EOS


def test_a_tokenizers_special_ids_land_in_final(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = tmp_path / "tokenizer.json"
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<pad>", "<s>"]  # ids 0, 1, 2: not where Llama has its eos and bos
    tokenizer.train_from_iterator(
        SENTENCES * 20,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer.save(str(bpe))
    eos, pad, bos = (tokenizer.token_to_id(t) for t in specials)
    assert eos != LLAMA_EOS
    assert bos != LLAMA_BOS
    config = tokenized_lm_config(tmp_path, bpe, steps=2)
    fit(config)
    final = config.output_dir / "final"
    model_ids, generation_ids = written_ids(final)
    assert model_ids == generation_ids == {"eos_token_id": eos, "bos_token_id": bos, "pad_token_id": pad}
    loaded = transformers.AutoTokenizer.from_pretrained(final)
    assert (loaded.eos_token_id, loaded.bos_token_id, loaded.pad_token_id) == (eos, bos, pad)
    assert (loaded.eos_token, loaded.bos_token, loaded.pad_token) == ("<|endoftext|>", "<s>", "<pad>")


def test_a_lora_runs_merged_model_has_the_datas_ids(tmp_path: Path) -> None:
    base = save_base(tmp_path / "base")  # Llama's ids
    config = ft_config(base, tmp_path, 2)
    fit(config)
    final = config.output_dir / "final"
    model_ids, generation_ids = written_ids(final / "merged")
    assert model_ids == {"eos_token_id": BYTE_EOS, "bos_token_id": None, "pad_token_id": None}
    assert generation_ids == {"eos_token_id": BYTE_EOS, "bos_token_id": None, "pad_token_id": BYTE_EOS}
    adapter = json.loads((final / "adapter_config.json").read_text())
    assert Path(adapter["base_model_name_or_path"]).resolve() == base.resolve()  # the base's, as it was
    assert json.loads((base / "config.json").read_text())["eos_token_id"] == LLAMA_EOS


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("eos_token_id", "2", "is 2 but the data ends its documents with 256: leave it out"),
        ("bos_token_id", "1", "is 1 but the data's tokens have no beginning-of-text token"),
    ],
)
def test_an_option_contradicting_the_datas_ids_is_an_error(
    tmp_path: Path, option: str, value: str, says: str
) -> None:
    config = lm_config(tmp_path, f"MODEL.OPTIONS.{option}", value)
    with pytest.raises(ConfigError, match=rf"MODEL.OPTIONS.{option}: {says}"):
        build_model(config, build_dataset(config, "train"))


def test_without_the_tokenizer_at_hand_the_data_decides_eos_alone(tmp_path: Path) -> None:
    """Bytes have no beginning-of-text token; tokens whose tokenizer.json is not at hand (moved, a
    mixture's) leave the model's bos as it is; data without an end-of-document id decides nothing."""
    from types import SimpleNamespace

    from linnaeus_accel.models.hf import special_ids

    def fields(**declared: Any) -> dict[str, Any] | None:
        ids = special_ids(SimpleNamespace(**declared))
        return None if ids is None else ids.config_fields()

    assert fields(eos_id=BYTE_EOS, vocab_size=257) == {"eos_token_id": BYTE_EOS, "bos_token_id": None}
    assert fields(eos_id=5, vocab_size=100, tokenizer_file=None) == {"eos_token_id": 5}
    unreadable = tmp_path / "tokenizer.json"
    unreadable.write_text("{}")
    assert fields(eos_id=5, vocab_size=100, tokenizer_file=str(unreadable)) == {"eos_token_id": 5}
    assert fields(vocab_size=100) is None
