"""Built-in datasets and models beyond ``digits``/``digits_mlp``: ``python_docs``, ``digits_images``,
``hf_causal_lm`` and ``digits_convnet``, built by name as a run builds them."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from linnaeus_accel.config import Config, ConfigError, validate_config
from linnaeus_accel.data import build_dataset
from linnaeus_accel.data.text import load_topics
from linnaeus_accel.data.tokens.packing import decode_bytes
from linnaeus_accel.models import build_model


def dataset_config(
    dataset: str = "python_docs",
    options: dict[str, Any] | None = None,
    model: str = "digits_mlp",
    model_options: dict[str, Any] | None = None,
    **top: Any,
) -> Config:
    data: dict[str, Any] = {"NAME": dataset, "OPTIONS": options or {}}
    if "val_fraction" in top:
        data["VAL_FRACTION"] = top.pop("val_fraction")
    return validate_config(
        {
            "DATA": {"DATASET": data},
            "MODEL": {"TYPE": model, "OPTIONS": model_options or {}},
            "EXPERIMENT": {"SEED": top.pop("seed", 0)},
        }
    )


def problem_keys(exc: pytest.ExceptionInfo[ConfigError]) -> set[str]:
    return {key for key, _ in exc.value.problems}


def as_lists(samples: Any) -> list[list[int]]:
    return [s["input_ids"].tolist() for s in samples]


# -- python_docs -------------------------------------------------------------------------------------


def test_python_docs_splits_by_topic_disjoint_and_complete() -> None:
    import pydoc_data.topics

    config = dataset_config()
    train, val = build_dataset(config, "train"), build_dataset(config, "val")
    assert not set(train.topics) & set(val.topics)
    assert set(train.topics) | set(val.topics) == set(pydoc_data.topics.topics)
    n = len(pydoc_data.topics.topics)
    assert len(val.topics) == int(0.2 * n + 0.5)  # VAL_FRACTION 0.2, rounded half up
    # The split does not move with the experiment seed: every run validates on the same text.
    assert build_dataset(dataset_config(seed=123), "val").topics == val.topics
    # At least one topic on each side, whatever the fraction.
    assert len(build_dataset(dataset_config(val_fraction=0.0), "val").topics) == 1
    assert len(build_dataset(dataset_config(val_fraction=1.0), "train").topics) == 1


def test_python_docs_is_deterministic_byte_text_with_one_eos_per_topic() -> None:
    config = dataset_config(options={"seq_len": 64})
    a, b = build_dataset(config, "val"), build_dataset(config, "val")
    assert np.array_equal(a.tokens, b.tokens)
    assert (a.vocab_size, a.eos_id, a.tokens_per_sample) == (257, 256, 63)
    assert int(a.tokens.max()) <= 256
    assert int((a.tokens == 256).sum()) == len(a.topics)
    item = a[0]
    assert item["input_ids"].shape == item["labels"].shape == (64,)
    text = dict(load_topics())[a.topics[0]].decode("utf-8")
    assert text.startswith(decode_bytes(item["input_ids"]))  # topics in order, from the first one
    assert len(a) == (len(a.tokens) - 1) // 63


def test_python_docs_streaming_len_is_what_iterating_gives() -> None:
    config = dataset_config(options={"seq_len": 256, "streaming": True}, seed=5)
    train, val = build_dataset(config, "train"), build_dataset(config, "val")
    assert (train.vocab_size, train.eos_id, train.tokens_per_sample) == (257, 256, 255)
    epoch0 = as_lists(train)
    assert len(epoch0) == len(train)
    train.set_epoch(1)
    epoch1 = as_lists(train)
    assert len(epoch1) == len(train)
    assert epoch0 != epoch1  # training topics are reshuffled each epoch
    # Validation streams in the fixed order: the same samples as the map-style dataset.
    mapped = build_dataset(dataset_config(options={"seq_len": 256}), "val")
    assert as_lists(val) == as_lists(mapped[k] for k in range(len(mapped)))
    assert len(val) == len(mapped)
    # A DataLoader batches the stream as it does a map-style dataset.
    batch = next(iter(DataLoader(val, batch_size=4)))
    assert batch["input_ids"].shape == (4, 256)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"seq_lenght": 64}, "takes seq_len, streaming and windows, not seq_lenght"),
        ({"seq_len": 1}, "seq_len must be an integer of at least 2"),
        ({"seq_len": True}, "seq_len must be an integer"),
        ({"seq_len": "64"}, "seq_len must be an integer"),
        ({"streaming": "yes"}, "streaming must be true or false"),
        ({"seq_len": 10_000_000}, "fewer than seq_len"),
    ],
)
def test_python_docs_options_are_validated(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as exc:
        build_dataset(dataset_config(options=options), "train")
    assert problem_keys(exc) == {"DATA.DATASET.OPTIONS"}


@pytest.fixture
def without_pydoc_data(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    load_topics.cache_clear()
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", None)  # makes the import fail
    yield
    load_topics.cache_clear()


@pytest.mark.usefixtures("without_pydoc_data")
def test_python_docs_without_pydoc_data_says_so() -> None:
    with pytest.raises(ConfigError, match="lacks") as exc:
        build_dataset(dataset_config(), "train")
    assert problem_keys(exc) == {"DATA.DATASET.NAME"}


# -- digits_images -----------------------------------------------------------------------------------


def test_digits_images_are_whole_images_with_the_digit_as_label_on_digits_split() -> None:
    config = dataset_config(dataset="digits_images")
    digits = build_dataset(dataset_config(dataset="digits"), "val")
    images = build_dataset(config, "val")
    assert len(images) + len(build_dataset(config, "train")) == 1797
    assert images.num_classes == 10
    item = images[0]
    assert set(item) == {"image", "labels"}
    assert item["image"].shape == (1, 8, 8)
    assert item["image"].dtype == torch.float32
    assert item["labels"].shape == ()
    assert item["labels"].dtype == torch.int64
    assert float(images.images.min()) >= 0.0
    assert float(images.images.max()) <= 1.0
    # The same images in the same split: digits shows their top rows and labels (shape, digit).
    assert torch.equal(images.labels, digits.labels[:, 1])
    assert torch.equal(images.images[:, :, :4], digits.images[:, :, :4])
    assert float(images.images[:, :, 4:].sum()) > 0  # nothing hidden
    with pytest.raises(ConfigError, match="takes no options") as exc:
        build_dataset(dataset_config(dataset="digits_images", options={"x": 1}), "train")
    assert problem_keys(exc) == {"DATA.DATASET.OPTIONS"}


# -- digits_convnet ----------------------------------------------------------------------------------


def test_digits_convnet_gives_logits_per_class() -> None:
    config = dataset_config(dataset="digits_images", model="digits_convnet", model_options={"channels": 8})
    dataset = build_dataset(config, "train")
    model = build_model(config, dataset)
    batch = next(iter(DataLoader(dataset, batch_size=5)))
    logits = model(batch["image"])
    assert logits.shape == (5, 10)
    loss = torch.nn.functional.cross_entropy(logits, batch["labels"])
    loss.backward()  # trainable end to end
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(
    ("dataset", "options", "key", "match"),
    [
        ("digits_images", {"hidden": 64}, "MODEL.OPTIONS", "takes channels and dropout, not hidden"),
        ("digits_images", {"channels": 0}, "MODEL.OPTIONS.channels", "must be an integer from 1 to 4096"),
        ("digits_images", {"dropout": 1.5}, "MODEL.OPTIONS.dropout", r"must be a probability in \[0, 1\)"),
        ("digits", {}, "MODEL.TYPE", "use DATA.DATASET.NAME digits_images"),  # two label levels
    ],
)
def test_digits_convnet_errors(dataset: str, options: dict[str, Any], key: str, match: str) -> None:
    config = dataset_config(dataset=dataset, model="digits_convnet", model_options=options)
    with pytest.raises(ConfigError, match=match) as exc:
        build_model(config, build_dataset(config, "train"))
    assert problem_keys(exc) == {key}


# -- hf_causal_lm ------------------------------------------------------------------------------------

TINY = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.mark.usefixtures("offline")
def test_hf_causal_lm_builds_offline_and_returns_logits_over_the_byte_vocab() -> None:
    config = dataset_config(options={"seq_len": 16}, model="hf_causal_lm", model_options=TINY)
    dataset = build_dataset(config, "train")
    model = build_model(config, dataset)
    batch = next(iter(DataLoader(dataset, batch_size=3)))
    out = model(batch["input_ids"], attention_mask=torch.ones_like(batch["input_ids"]))
    assert out.logits.shape == (3, 16, 257)  # vocab_size from the dataset
    loss = torch.nn.functional.cross_entropy(
        out.logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten()
    )
    assert abs(float(loss.detach()) - torch.log(torch.tensor(257.0))) < 1.0  # randomly initialised


@pytest.mark.usefixtures("offline")
def test_hf_causal_lm_sizes_and_explicit_options() -> None:
    lm_tiny = {**TINY, "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4}
    lm_tiny |= {"intermediate_size": 384, "max_position_embeddings": 256}
    config = dataset_config(model="hf_causal_lm", model_options=lm_tiny)
    model = build_model(config, build_dataset(config, "val"))
    assert 0.9e6 < sum(p.numel() for p in model.parameters()) < 1.0e6  # about 1M parameters
    # gpt2 names its sizes n_embd, n_layer, ...; transformers maps the usual names onto them.
    options = {"model_type": "gpt2", "vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 1}
    options |= {"num_attention_heads": 2, "max_position_embeddings": 16}
    gpt2 = build_model(dataset_config(model="hf_causal_lm", model_options=options), object())
    assert type(gpt2).__name__ == "GPT2LMHeadModel"
    assert gpt2(torch.zeros(2, 4, dtype=torch.int64)).logits.shape == (2, 4, 50)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({**TINY, "hiden_size": 32}, "has no field hiden_size"),  # transformers would ignore it
        ({**TINY, "hidden_size": 30, "num_attention_heads": 4}, "transformers rejects the options"),
        ({**TINY, "hidden_size": "big"}, "transformers rejects the options"),
        ({**TINY, "model_type": "no_such_model"}, "is not a transformers model type"),
        ({"model_type": "vit", "hidden_size": 32, "num_attention_heads": 2}, "cannot build a causal LM"),
    ],
)
@pytest.mark.usefixtures("offline")
def test_hf_causal_lm_option_errors(options: dict[str, Any], match: str) -> None:
    config = dataset_config(model="hf_causal_lm", model_options=options)
    with pytest.raises(ConfigError, match=match) as exc:
        build_model(config, build_dataset(config, "val"))
    assert problem_keys(exc) == {"MODEL.OPTIONS"}


def test_hf_causal_lm_needs_a_vocab_size() -> None:
    config = dataset_config(dataset="digits_images", model="hf_causal_lm", model_options=TINY)
    with pytest.raises(ConfigError, match="set vocab_size") as exc:
        build_model(config, build_dataset(config, "val"))
    assert problem_keys(exc) == {"MODEL.OPTIONS"}


def test_hf_causal_lm_without_transformers_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes the import fail
    config = dataset_config(model="hf_causal_lm", model_options=TINY)
    with pytest.raises(ConfigError, match=r"pip install 'linnaeus-accel\[lm\]'") as exc:
        build_model(config, build_dataset(config, "val"))
    assert problem_keys(exc) == {"MODEL.TYPE"}
