"""Train a byte-level BPE tokenizer with HF `tokenizers`; `<|endoftext|>` is the one special token (BOS/EOS)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pagellm.training.data import EOT


def train_tokenizer(stories: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    if vocab_size < 257:
        raise ValueError(f"vocab_size={vocab_size} is invalid: must be >= 257 (256 bytes + {EOT})")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(stories, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOT, eos_token=EOT, pad_token=EOT)


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    """Writes tokenizer.json and tokenizer_config.json (and special_tokens_map.json)."""
    tokenizer.save_pretrained(str(out_dir))
