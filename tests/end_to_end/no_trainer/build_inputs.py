"""Offline inputs for transformers' ``run_*_no_trainer.py`` scripts, built from nothing on this machine.

The scripts take ``--model_name_or_path <dir>`` and ``--train_file``/``--validation_file``; everything they would
download is built here instead: a WordPiece tokenizer trained with ``tokenizers`` on generated sentences and saved
with ``PreTrainedTokenizerFast.save_pretrained``, tiny randomly initialised models (BERT for classification and
masked LM, GPT-2 for causal LM) saved with ``save_pretrained``, and csv/json data files. Run as a module to build
them into a directory: ``python tests/end_to_end/no_trainer/build_inputs.py <dir>``.
"""

from __future__ import annotations

import csv
import json
import random
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
)

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
MAX_LENGTH = 64  # the tokenizer's model_max_length and the models' position embeddings
TRAIN_ROWS = 48
VALIDATION_ROWS = 13  # odd: on 2 ranks the last batch is padded and gather_for_metrics must drop the duplicate
_SUBJECTS = ["the cat", "a dog", "my friend", "the teacher", "our neighbour", "the pilot", "a child", "the cook"]
_VERBS = ["sees", "likes", "paints", "finds", "follows", "answers", "visits", "carries"]
_OBJECTS = ["the river", "a small boat", "the old house", "a red kite", "the garden", "a long letter", "the moon"]


def sentence(rng: random.Random) -> str:
    return f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} ."


def train_tokenizer(lines: list[str], out: Path) -> PreTrainedTokenizerFast:
    """A BERT-style WordPiece tokenizer trained on ``lines`` (a few hundred), saved where ``AutoTokenizer`` finds it."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(lines, trainers.WordPieceTrainer(vocab_size=200, special_tokens=SPECIAL_TOKENS))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=MAX_LENGTH, pad_token="[PAD]",
                                   unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                   bos_token="[CLS]", eos_token="[SEP]")
    fast.save_pretrained(out)
    return fast


def build(root: Path) -> dict[str, Path]:
    """Build every input under ``root``; returns the paths by name (models, tokenizer, data files)."""
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    lines = [sentence(rng) for _ in range(400)]
    tokenizer = train_tokenizer(lines, root / "tokenizer")
    vocab = len(tokenizer)
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                 max_position_embeddings=MAX_LENGTH, vocab_size=vocab, pad_token_id=tokenizer.pad_token_id)
    paths: dict[str, Path] = {}
    for name, model in [("bert-classifier", BertForSequenceClassification(BertConfig(num_labels=2, **small))),
                        ("bert-mlm", BertForMaskedLM(BertConfig(**small))),
                        ("gpt2", GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=2,
                                                            n_positions=MAX_LENGTH,
                                                            bos_token_id=tokenizer.bos_token_id,
                                                            eos_token_id=tokenizer.eos_token_id)))]:
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths[name] = root / name
    # Sentence-pair classification (the glue script's csv path: sentence1, sentence2, label).
    for split, rows in [("train", TRAIN_ROWS), ("validation", VALIDATION_ROWS)]:
        with open(root / f"pairs-{split}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["sentence1", "sentence2", "label"])
            for _ in range(rows):
                first = sentence(rng)
                same = rng.random() < 0.5
                writer.writerow([first, first if same else sentence(rng), int(same)])
        paths[f"pairs-{split}"] = root / f"pairs-{split}.csv"
        # Plain text for the language-modeling scripts (json lines with a "text" field).
        with open(root / f"text-{split}.json", "w") as f:
            for _ in range(rows):
                f.write(json.dumps({"text": " ".join(sentence(rng) for _ in range(3))}) + "\n")
        paths[f"text-{split}"] = root / f"text-{split}.json"
    return paths


if __name__ == "__main__":
    for key, value in build(Path(sys.argv[1])).items():
        print(key, value)
