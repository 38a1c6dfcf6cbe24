"""Train a small Llama (HF transformers' LlamaForCausalLM) on TinyStories-format text.

AdamW, linear warmup then cosine decay, gradient clipping, bf16 autocast on GPU, token-packed rows, periodic
validation loss, and checkpoints that resume exactly (model, optimizer, scheduler, data position, RNG). The output
directory is always a loadable HF checkpoint; `checkpoint.pt` next to it holds the training state.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from pagellm.training.data import PackedStream, read_stories
from pagellm.training.export import CHECKPOINT, export_hf
from pagellm.training.tokenizer_training import save_tokenizer, train_tokenizer

# Shapes like the well-known TinyStories models (stories15M, stories110M); `tiny` is for tests.
PRESETS = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        seq_len=128,
        vocab_size=2048,
    ),
    "15m": dict(
        hidden_size=288,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=6,
        seq_len=256,
        vocab_size=32000,
    ),
    "110m": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        seq_len=1024,
        vocab_size=32000,
    ),
}


@dataclass
class TrainConfig:
    data: str
    output: str
    preset: str = "tiny"
    max_steps: int = 1000
    vocab_size: int | None = None  # default: the preset's
    batch_size: int = 16
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 8
    save_every: int = 200
    val_every: int = 20  # every 20th story is validation
    seed: int = 0
    device: str | None = None
    quiet: bool = False

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset={self.preset!r} is invalid: must be one of {list(PRESETS)}")
        if self.max_steps < 1:
            raise ValueError(f"max_steps={self.max_steps} is invalid: must be >= 1")


def model_config(cfg: TrainConfig, vocab_size: int, eos_id: int) -> dict:
    shape = {k: v for k, v in PRESETS[cfg.preset].items() if k not in ("seq_len", "vocab_size")}
    return dict(
        shape,
        vocab_size=vocab_size,
        max_position_embeddings=PRESETS[cfg.preset]["seq_len"],
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        rope_theta=10000.0,
        torch_dtype="float32",
    )


def lr_lambda(cfg: TrainConfig):
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class Trainer:
    def __init__(self, cfg: TrainConfig, resume: bool = False) -> None:
        self.cfg = cfg
        self.out = Path(cfg.output)
        self.out.mkdir(parents=True, exist_ok=True)
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        state = self._load_state() if resume else None
        self.tokenizer = self._tokenizer(state is not None)
        self.seq_len = PRESETS[cfg.preset]["seq_len"]
        eos = self.tokenizer.eos_token_id
        if state is None:
            torch.manual_seed(cfg.seed)
            random.seed(cfg.seed)
        self.model_config = model_config(cfg, len(self.tokenizer), eos)
        self.model = LlamaForCausalLM(LlamaConfig(**self.model_config)).to(self.device)
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(0.9, 0.95),
            fused=self.device.type == "cuda",
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        train_state = PackedStream.state_from_dict(state["data"]) if state else None
        self.train_stream = PackedStream(cfg.data, encode, eos, self.seq_len, "train", cfg.val_every, train_state)
        self.encode = encode
        self.step = 0
        self.history: dict[str, list] = {"train": [], "val": []}
        if state is not None:
            self._restore(state)

    # ---- state ----------------------------------------------------------------------------------------------

    def _tokenizer(self, resuming: bool) -> PreTrainedTokenizerFast:
        if resuming or (self.out / "tokenizer.json").exists():
            return PreTrainedTokenizerFast.from_pretrained(str(self.out))
        vocab = self.cfg.vocab_size or PRESETS[self.cfg.preset]["vocab_size"]
        tokenizer = train_tokenizer(read_stories(self.cfg.data), vocab)
        save_tokenizer(tokenizer, self.out)
        return tokenizer

    def _load_state(self) -> dict:
        path = self.out / CHECKPOINT
        if not path.exists():
            raise ValueError(f"resume: no {CHECKPOINT} in output={str(self.out)!r}")
        return torch.load(path, map_location="cpu", weights_only=False)

    def _restore(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.history = state["history"]
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if self.device.type == "cuda" and state["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(state["rng"]["cuda"])

    def save(self) -> None:
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "history": self.history,
            "data": self.train_stream.state_dict(),
            "model_config": self.model_config,
            "train_config": asdict(self.cfg),
            "rng": {
                "torch": torch.get_rng_state(),
                "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state() if self.device.type == "cuda" else None,
            },
        }
        tmp = self.out / (CHECKPOINT + ".tmp")
        torch.save(state, tmp)
        tmp.replace(self.out / CHECKPOINT)
        export_hf(self.model, self.tokenizer, self.out)
        self.plot()

    # ---- training -------------------------------------------------------------------------------------------

    def _batch(self, stream: PackedStream) -> torch.Tensor:
        rows = [stream.next_row() for _ in range(self.cfg.batch_size)]
        return torch.tensor(rows, device=self.device)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            return self.model(input_ids=batch, labels=batch).loss

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        stream = PackedStream(
            self.cfg.data, self.encode, self.tokenizer.eos_token_id, self.seq_len, "val", self.cfg.val_every
        )
        losses = [self._loss(self._batch(stream)).item() for _ in range(self.cfg.eval_batches)]
        self.model.train()
        return sum(losses) / len(losses)

    def train(self, until: int | None = None) -> dict[str, list]:
        """Train to max_steps (or stop after step `until`, saving there, as an interrupted run would)."""
        cfg = self.cfg
        stop = min(cfg.max_steps, until or cfg.max_steps)
        self.model.train()
        tokens_per_step = cfg.batch_size * self.seq_len
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="Training", disable=cfg.quiet)
        if self.step == 0:
            self.history["val"].append((0, self.evaluate()))
        last = started = time.perf_counter()
        first_step = self.step
        while self.step < stop:
            loss = self._loss(self._batch(self.train_stream))
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
            self.history["train"].append((self.step, loss.item()))
            now = time.perf_counter()
            bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens_per_step / (now - last):,.0f}")
            last = now
            bar.update()
            if self.step % cfg.eval_every == 0 or self.step == cfg.max_steps:
                self.history["val"].append((self.step, self.evaluate()))
                bar.write(f"step {self.step}: val loss {self.history['val'][-1][1]:.4f}")
            if self.step % cfg.save_every == 0 or self.step == stop:
                self.save()
        bar.close()
        elapsed = time.perf_counter() - started
        self.history["tokens_per_second"] = (self.step - first_step) * tokens_per_step / max(elapsed, 1e-9)
        (self.out / "metrics.json").write_text(json.dumps(self.history))
        return self.history

    def plot(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        if self.history["train"]:
            ax.plot(*zip(*self.history["train"]), label="train", alpha=0.7)
        if self.history["val"]:
            ax.plot(*zip(*self.history["val"]), "o-", label="validation")
        ax.set(xlabel="step", ylabel="loss", title=f"{self.cfg.preset} on {Path(self.cfg.data).name}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(self.out / "loss.png", dpi=100)
        plt.close(fig)
