"""Offline stand-ins for what Accelerate's examples download: the only thing the ported examples change.

Each ported example replaces its import of ``evaluate``, ``datasets.load_dataset``, ``transformers.Auto*`` (and, for
the CV example, ``timm.create_model`` and four ``torchvision`` transforms) with the names below, which keep the
upstream call signatures, so every other line of the example — and every line that touches Accelerate — runs as
written. The stand-ins are deliberately small (a 2-layer, 32-wide randomly initialised model, a generated vocabulary,
a few dozen synthetic GLUE-MRPC-like rows) so that a whole example trains for an epoch in seconds on a CPU.

Nothing here is a fake of the thing under test: the models are real ``transformers`` models, the tokenizer is a real
``BertTokenizerFast`` (over the generated vocabulary), the rows are real ``datasets.Dataset`` objects.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from datasets import Dataset, DatasetDict
from PIL import Image
from transformers import (
    AutoModelForCausalLM as _AutoModelForCausalLM,
)
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertTokenizerFast,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
)

TRAIN_ROWS = 64  # GLUE-MRPC-like training rows (upstream: 3,668)
VALIDATION_ROWS = 41  # odd: on 2 ranks the sampler pads one duplicate that gather_for_metrics must drop
TEXT_ROWS = 48  # wikitext-like lines for the causal-LM examples
MAX_LENGTH = 64  # model_max_length of the tokenizer and max_position_embeddings of the models
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["".join(parts) for parts in itertools.product("bdfklmnprst", "aeiou", "nrs")][:150]
class AutoTokenizer:
    """``AutoTokenizer.from_pretrained(name)``: a WordPiece tokenizer over the generated vocabulary, whatever the name.
    It has an ``eos_token`` so the causal-LM examples' ``tokenizer.pad_token = tokenizer.eos_token`` works."""

    @staticmethod
    def from_pretrained(name_or_path: str, **kwargs) -> BertTokenizerFast:
        vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + WORDS)}
        tokenizer = BertTokenizerFast(vocab=vocab, model_max_length=MAX_LENGTH, eos_token="[SEP]", bos_token="[CLS]")
        if len(tokenizer) != len(vocab):  # an older transformers without `vocab=` would silently map all to [UNK]
            raise RuntimeError(f"the offline tokenizer has {len(tokenizer)} tokens, expected {len(vocab)}")
        return tokenizer


def tiny_bert_config(num_labels: int = 2) -> BertConfig:
    return BertConfig(vocab_size=len(SPECIAL_TOKENS) + len(WORDS), hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=64, max_position_embeddings=MAX_LENGTH,
                      num_labels=num_labels)


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=len(SPECIAL_TOKENS) + len(WORDS), hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                       max_position_embeddings=MAX_LENGTH, pad_token_id=0, bos_token_id=2, eos_token_id=3)


class AutoModelForSequenceClassification:
    """``from_pretrained("bert-base-cased", ...)``: a randomly initialised 2-layer BERT (the caller seeds first)."""

    @staticmethod
    def from_pretrained(name_or_path: str, return_dict: bool = True, **kwargs) -> BertForSequenceClassification:
        return BertForSequenceClassification(tiny_bert_config())


def tiny_gpt2_config() -> GPT2Config:
    return GPT2Config(vocab_size=len(SPECIAL_TOKENS) + len(WORDS), n_embd=32, n_layer=2, n_head=2,
                      n_positions=MAX_LENGTH, bos_token_id=2, eos_token_id=3)


class AutoConfig:
    """``from_pretrained(name)``: a tiny GPT-2 configuration for a ``gpt2`` name, else a tiny Llama one (SmolLM)."""

    @staticmethod
    def from_pretrained(name_or_path: str, **kwargs) -> PretrainedConfig:
        return tiny_gpt2_config() if "gpt2" in name_or_path.lower() else tiny_llama_config()


class AutoModelForCausalLM:
    """``from_pretrained(...)`` / ``from_config(...)``: a randomly initialised 2-layer model of that configuration."""

    @staticmethod
    def from_pretrained(name_or_path: str, config: PretrainedConfig | None = None, **kwargs):
        return _AutoModelForCausalLM.from_config(config or AutoConfig.from_pretrained(name_or_path))

    @staticmethod
    def from_config(config: PretrainedConfig, **kwargs):
        return _AutoModelForCausalLM.from_config(config)


def _sentence(rng: random.Random) -> list[str]:
    return rng.sample(WORDS, rng.randint(4, 10))


def _mrpc_rows(count: int, seed: int) -> dict[str, list]:
    """Sentence pairs whose label says whether the second reuses the first one's words (a paraphrase, learnable)."""
    rng = random.Random(seed)
    rows: dict[str, list] = {"sentence1": [], "sentence2": [], "label": [], "idx": []}
    for idx in range(count):
        first = _sentence(rng)
        label = idx % 2
        second = rng.sample(first, len(first)) if label else _sentence(rng)
        rows["sentence1"].append(" ".join(first))
        rows["sentence2"].append(" ".join(second))
        rows["label"].append(label)
        rows["idx"].append(idx)
    return rows


def _text_rows(count: int, seed: int) -> dict[str, list]:
    """wikitext-like lines, a few of them empty as in wikitext (the examples filter those out)."""
    rng = random.Random(seed)
    return {"text": ["" if i % 7 == 3 else " ".join(_sentence(rng) + _sentence(rng)) for i in range(count)]}


def load_dataset(path: str, name: str | None = None, **kwargs) -> DatasetDict:
    """``load_dataset("nyu-mll/glue", "mrpc")`` or a text corpus (``wikitext``): small synthetic splits."""
    if "glue" in path:
        return DatasetDict(train=Dataset.from_dict(_mrpc_rows(TRAIN_ROWS, seed=0)),
                           validation=Dataset.from_dict(_mrpc_rows(VALIDATION_ROWS, seed=1)),
                           test=Dataset.from_dict(_mrpc_rows(VALIDATION_ROWS, seed=2)))
    return DatasetDict(train=Dataset.from_dict(_text_rows(TEXT_ROWS, seed=0)),
                       validation=Dataset.from_dict(_text_rows(TEXT_ROWS // 3, seed=1)),
                       test=Dataset.from_dict(_text_rows(TEXT_ROWS // 3, seed=2)))


class ClassificationMetric:
    """``evaluate.load("glue", "mrpc")`` / ``evaluate.load("accuracy")``: accumulate with ``add_batch``, ``compute``
    returns accuracy (and binary F1 for MRPC) over everything added since the last ``compute`` and resets.
    Unlike ``evaluate`` it also reports ``samples``, the number of predictions it saw: the tests check with it that
    ``gather_for_metrics`` counted every evaluation row exactly once on 2 ranks (no padding duplicate)."""

    def __init__(self, with_f1: bool) -> None:
        self.with_f1 = with_f1
        self.predictions: list[np.ndarray] = []
        self.references: list[np.ndarray] = []

    def add_batch(self, *, predictions, references) -> None:
        self.predictions.append(np.asarray(torch.as_tensor(predictions).cpu()).reshape(-1))
        self.references.append(np.asarray(torch.as_tensor(references).cpu()).reshape(-1))

    def compute(self, *, predictions=None, references=None) -> dict[str, float]:
        if predictions is not None:
            self.add_batch(predictions=predictions, references=references)
        preds = np.concatenate(self.predictions) if self.predictions else np.zeros(0, dtype=int)
        refs = np.concatenate(self.references) if self.references else np.zeros(0, dtype=int)
        self.predictions, self.references = [], []
        if len(preds) != len(refs):
            raise ValueError(f"{len(preds)} predictions for {len(refs)} references")
        result: dict[str, float] = {"accuracy": float((preds == refs).mean()) if len(refs) else 0.0}
        if self.with_f1:
            true_pos = int(((preds == 1) & (refs == 1)).sum())
            denominator = int((preds == 1).sum() + (refs == 1).sum())
            result["f1"] = 2 * true_pos / denominator if denominator else 0.0
        result["samples"] = len(refs)
        return result


def _load_metric(path: str, config_name: str | None = None, **kwargs) -> ClassificationMetric:
    if path == "glue" and config_name in ("mrpc", "qqp"):
        return ClassificationMetric(with_f1=True)
    if path == "accuracy":
        return ClassificationMetric(with_f1=False)
    raise ValueError(f"no offline stand-in for the metric {path!r} {config_name!r}")


evaluate = SimpleNamespace(load=_load_metric)


# -- the CV examples: timm's create_model and four torchvision transforms ---------------------------------------------


class TinyConvNet(torch.nn.Module):
    """Stands in for timm's ``resnet50d``: a feature extractor and a ``get_classifier()`` head (the example freezes
    everything but the head) and timm's ``default_cfg`` normalisation constants."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.default_cfg = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}
        self.features = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.ReLU(),
                                            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
        self.fc = torch.nn.Linear(8, num_classes)

    def get_classifier(self) -> torch.nn.Module:
        return self.fc

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(images))


def create_model(name: str, pretrained: bool = False, num_classes: int = 1000, **kwargs) -> TinyConvNet:
    """``timm.create_model(...)``: a randomly initialised tiny CNN whatever the name (no download)."""
    return TinyConvNet(num_classes)


def _size(size) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


class Compose:
    def __init__(self, transforms) -> None:
        self.transforms = list(transforms)

    def __call__(self, image):
        for transform in self.transforms:
            image = transform(image)
        return image


class Resize:
    """torchvision's ``Resize`` for a (height, width) size, on PIL images."""

    def __init__(self, size) -> None:
        self.height, self.width = _size(size)

    def __call__(self, image):
        return image.resize((self.width, self.height))


class RandomResizedCrop:
    """torchvision's ``RandomResizedCrop(size, scale)`` on PIL images (aspect ratio kept, python's RNG)."""

    def __init__(self, size, scale=(0.08, 1.0)) -> None:
        self.height, self.width = _size(size)
        self.scale = scale

    def __call__(self, image):
        width, height = image.size
        side = max(1, int(min(width, height) * random.uniform(*self.scale) ** 0.5))
        left, top = random.randint(0, width - side), random.randint(0, height - side)
        return image.crop((left, top, left + side, top + side)).resize((self.width, self.height))


class ToTensor:
    """torchvision's ``ToTensor``: HWC uint8 -> CHW float in [0, 1]."""

    def __call__(self, image) -> torch.Tensor:
        return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()


def write_pet_images(data_dir: Path, labels: tuple[str, ...] = ("abyssinian", "beagle"), per_label: int = 20) -> int:
    """Small JPEGs named like the Oxford-IIIT Pet files the CV examples read (``<label>_<n>.jpg``), the labels told
    apart by colour. Returns how many were written."""
    data_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for index, label in enumerate(labels):
        for n in range(per_label):
            pixels = rng.integers(0, 60, size=(40, 48, 3), dtype=np.uint8)
            pixels[..., index % 3] += 150
            Image.fromarray(pixels).save(data_dir / f"{label}_{n}.jpg")
    return len(labels) * per_label
