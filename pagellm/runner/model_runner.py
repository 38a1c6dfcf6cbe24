"""ModelRunner: builds the model and the KV cache on the device, runs one scheduled step, samples. It receives
plain step data (`core/step.py`) and imports nothing from `engine/`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagellm.config import EngineConfig, ModelConfig, cdiv
from pagellm.core.step import GrammarBitmask, RunnerOutput, SamplingRow, SchedulerOutput, StepRow
from pagellm.distributed.parallel import TensorParallel, shard_config
from pagellm.kernels.ops import ops_for
from pagellm.model.attention import LayerKVCache, allocate_kv_caches, get_backend
from pagellm.model.layers import can_pack_for_cpu
from pagellm.model.loader import load_config_dict, load_weights
from pagellm.model.registry import model_class
from pagellm.quantization.config import resolve_quantization
from pagellm.runner.cuda_graphs import StepGraphs, capture_sizes
from pagellm.runner.input_batch import HostBatch, PromptLogprobRows, build_host_batch, to_device
from pagellm.runner.sampler import SampledTokens, Sampler, SamplingInputs, ScoreTensors, score_tensors
from pagellm.runner.transfers import (
    sampled_to_host_async,
    sampled_values,
    score_values,
    scores_to_host_async,
    to_device_async,
)
from pagellm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagellm.kernels.compile_ahead import Compilation  # imports Triton, which the CPU path does without


# Sampling's [rows, vocab] temporaries (scaled logits, logprobs) count toward the memory peak.
PROFILE_SAMPLING = (SamplingParams(temperature=1.0, top_p=0.9, logprobs=20),)
# One set per sampling kernel variant: fp32 logits (the full path, here through a penalty) and the model's own
# (the plain and greedy paths).
COMPILE_SAMPLING = (
    SamplingParams(top_p=0.9, repetition_penalty=1.1),
    SamplingParams(top_p=0.9),
    SamplingParams(temperature=0),
)


@contextlib.contextmanager
def _default_dtype_and_device(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(old)


@dataclass
class LaunchedStep:
    """A step whose device work is enqueued: its inputs and the device tensors its outputs will land in. A step
    with constrained rows (structured outputs) has only its forward pass enqueued until `sample_constrained`
    brings their bitmask."""

    batch: HostBatch
    prompt_scores: list[tuple[PromptLogprobRows, ScoreTensors]]  # host copies, complete once `copied` has passed
    logits: torch.Tensor | None = None  # kept while sampling waits for the bitmask
    sampling_inputs: SamplingInputs | None = None  # likewise (prepared at launch: off the bitmask's critical path)
    sampled: SampledTokens | None = None  # on the device, where the next step may read its token ids
    sampled_host: SampledTokens | None = None  # host copies, likewise
    copied: torch.cuda.Event | None = None  # None on the CPU, where everything is done already

    @property
    def awaits_bitmask(self) -> bool:
        return self.logits is not None


class ModelRunner:
    """One rank's runner: under tensor parallelism (`tp`) it holds its share of the model and of every layer's KV
    cache (`self.config` is that share), and the ranks run every step together."""

    def __init__(
        self,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        model_dir,
        max_model_len: int,
        tp: TensorParallel | None = None,
    ) -> None:
        self.tp = tp = tp or TensorParallel()
        self.config = shard_config(model_config, tp)
        self.engine_config = engine_config
        self.device = engine_config.resolve_device()
        if self.device.type == "cuda" and tp.size > 1:
            self.device = torch.device("cuda", torch.cuda.current_device())  # the rank's GPU (set when it joined)
        # Decode steps replay CUDA graphs; not yet under tensor parallelism, whose NCCL calls would be captured.
        self.use_cuda_graphs = self.device.type == "cuda" and not engine_config.enforce_eager and tp.size == 1
        self.dtype = engine_config.resolve_dtype(model_config, self.device)
        self.kv_dtype = engine_config.resolve_kv_dtype(self.dtype)
        self.block_size = engine_config.block_size
        self.max_model_len = max_model_len
        self.ops = ops_for(self.device)
        self.backend = get_backend("triton" if self.device.type == "cuda" else "torch", self.block_size, max_model_len)
        max_positions = max(max_model_len, model_config.max_position_embeddings)
        # What this process held on the GPU before this engine: other engines' memory is not ours to count.
        self._gpu_baseline = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        self.quantization = resolve_quantization(engine_config, load_config_dict(model_dir))
        with _default_dtype_and_device(self.dtype, self.device):
            self.model = model_class(model_config)(
                model_config, self.backend, self.ops, max_positions, tp, self.quantization
            )
        self.model.eval()
        self.sampler = Sampler(engine_config.seed, self.device, self.ops)
        self.kv_caches: list[LayerKVCache] = []
        self.num_blocks = 0
        self.memory_blocks = 0  # set by determine_num_blocks
        self.graphs: StepGraphs | None = None  # captured once the KV cache exists; warm-ups run eagerly
        self._last_launched: LaunchedStep | None = None  # whose sampled tokens a look-ahead step feeds on
        self._compilation = self._start_compiling()
        load_weights(self.model, model_dir, engine_config.load_format, engine_config.seed, engine_config.quiet)
        if can_pack_for_cpu(self.device, self.dtype):
            self.model.pack_for_cpu()

    # ---- start-up -------------------------------------------------------------------------------------------

    def determine_num_blocks(self) -> int:
        """The KV blocks to allocate: what the memory budget holds (kept as `memory_blocks`, which grows by the
        weight bytes a quantized format saves), but no more than `_most_useful_blocks`."""
        cfg = self.engine_config
        blocks = cfg.budgeted_kv_blocks(self.config)
        if blocks is not None:
            self.memory_blocks = blocks
            return blocks if cfg.num_kv_blocks is not None else min(blocks, self._most_useful_blocks())
        bytes_per_block = self.config.kv_bytes_per_token(self.kv_dtype) * self.block_size
        self.memory_blocks = max(1, int(self._gpu_kv_budget() // bytes_per_block))
        blocks = min(self.memory_blocks, self._most_useful_blocks())
        if blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"max_model_len={self.max_model_len} does not fit: the KV cache holds "
                f"{blocks * self.block_size} tokens; lower max_model_len or raise gpu_memory_utilization"
            )
        return blocks

    def _most_useful_blocks(self) -> int:
        """No point in more blocks than max_num_seqs full-length sequences can use."""
        return self.engine_config.max_num_seqs * cdiv(self.max_model_len, self.block_size) + 1

    def _gpu_kv_budget(self) -> float:
        """Bytes for the KV cache, like vLLM: this engine may use gpu_memory_utilization of the card, of which its
        weights and a max-size step (max_num_batched_tokens, sampling max_num_seqs rows) take their peak; and no
        more than is free, leaving room for the activations."""
        cfg = self.engine_config
        weights = torch.cuda.memory_allocated(self.device) - self._gpu_baseline
        torch.cuda.reset_peak_memory_stats(self.device)
        self._warmup(self._longest_rows(), PROFILE_SAMPLING)
        peak = torch.cuda.max_memory_allocated(self.device) - self._gpu_baseline
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = min(cfg.gpu_memory_utilization * total - peak, free - (peak - weights))
        if budget <= 0:
            raise ValueError(
                f"gpu_memory_utilization={cfg.gpu_memory_utilization} leaves no room for the KV cache "
                f"(weights + activations peak at {peak / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free): "
                "raise it, or lower max_num_batched_tokens"
            )
        return budget

    def _start_compiling(self) -> Compilation | None:
        """On CUDA, start compiling every Triton kernel that serving launches, so that none compiles mid-serving,
        all at once, and while the weights load (see `compile_ahead`): those of the longest step (a prefill chunk
        beside decodes) and of a short prefill chunk alone and beside one or two decodes, of one-row steps (the
        GEMV), of sampling (no logprobs: they would index with samples never computed), and of pure-decode steps:
        of every CUDA-graph batch size, or in eager mode of one batch per kind of decode launch. The passes run the
        first two decoder layers only, on weights not loaded yet."""
        if self.device.type != "cuda":
            return None
        from pagellm.kernels.compile_ahead import compile_ahead
        from pagellm.kernels.decode_attention import NEW_TOKENS_BATCHES, SMALL_BATCH

        cfg = self.engine_config
        if not self.use_cuda_graphs:  # a batch of each kind of decode launch: PDL, small or not, RoPE inside or not
            kinds = (1, 2, SMALL_BATCH + 1, NEW_TOKENS_BATCHES.stop)
            decode_batches = sorted({min(cfg.max_num_seqs, b) for b in kinds})
        else:
            decode_batches = capture_sizes(cfg.max_num_seqs)
        with compile_ahead() as compilation, self.model.first_layers_only():
            # The sampling kernels vary with the row count only in PDL, which one sampled row launches with.
            self._warmup(self._longest_rows(), COMPILE_SAMPLING)
            for num_tokens in (16, 1):
                self._warmup([self._dummy_row(num_tokens)], COMPILE_SAMPLING)
            # Eager steps of one or two decodes beside a prefill chunk (16 tokens in all, as the pass above): their
            # decode kernels read K/V that the RoPE kernel stored, unlike pure-decode steps' (NEW_TOKENS_BATCHES).
            for num_decodes in (n for n in (1, 2) if n < cfg.max_num_seqs):
                self._warmup([self._dummy_row(1) for _ in range(num_decodes)] + [self._dummy_row(16 - num_decodes)], ())
            for num_seqs in decode_batches:
                self._warmup([self._dummy_row(1) for _ in range(num_seqs)], ())
        return compilation

    def compile_kernels(self) -> None:
        """Wait until the kernels that construction started compiling are ready to launch."""
        if self._compilation is not None:
            self._compilation.wait()

    def _longest_rows(self) -> list[StepRow]:
        """A step of the most tokens and sampled rows serving may schedule: decodes, and one prefill chunk taking
        the rest of the token budget."""
        cfg = self.engine_config
        num_tokens = min(cfg.token_budget, self.max_model_len)
        num_rows = min(cfg.max_num_seqs, num_tokens)
        return [self._dummy_row(1) for _ in range(num_rows - 1)] + [self._dummy_row(num_tokens - num_rows + 1)]

    @torch.inference_mode()
    def _warmup(self, rows: list[StepRow], sampling: tuple[SamplingParams, ...]) -> None:
        """A step of dummy rows through the normal path, on scratch KV caches for the layers that run; its logits
        are sampled with each parameter set in turn."""
        batch = build_host_batch(SchedulerOutput(rows), self.block_size)
        blocks = max(len(row.block_ids) for row in rows)
        caches = allocate_kv_caches(
            len(self.model.layers),
            blocks,
            self.block_size,
            self.config.num_kv_heads,
            self.config.head_dim,
            self.kv_dtype,
            self.device,
        )
        logits = self._forward(batch, None, caches)
        for params in sampling:
            sampling_rows = [SamplingRow(params, 0, [0], []) for _ in batch.sampling_rows]
            self.sampler.sample(logits, self.sampler.prepare(sampling_rows))
        if sampling:  # structured outputs' mask, allowing every token
            rows = len(batch.sampling_rows)
            bitmask = torch.full((rows, cdiv(logits.shape[1], 32)), -1, dtype=torch.int32, device=self.device)
            self.ops.apply_token_bitmask(logits, bitmask, torch.arange(rows, dtype=torch.int32, device=self.device))
        torch.cuda.synchronize(self.device)
        del caches, logits

    def _dummy_row(self, num_tokens: int) -> StepRow:
        """A warm-up row from position 0 that samples its last token (so that its logits are computed)."""
        return StepRow(
            "warmup",
            0,
            num_tokens,
            [0] * num_tokens,
            list(range(cdiv(num_tokens, self.block_size))),
            sampling=SamplingRow(SamplingParams(temperature=0), 0, [0], []),
        )

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_caches(
            self.config.num_layers,
            num_blocks,
            self.block_size,
            self.config.num_kv_heads,
            self.config.head_dim,
            self.kv_dtype,
            self.device,
        )
        if self.use_cuda_graphs:
            self.graphs = StepGraphs(
                self.model,
                self.kv_caches,
                self.engine_config.max_num_seqs,
                self.engine_config.token_budget,
                self.max_model_len,
                self.block_size,
                self.device,
            )
            self.graphs.capture()

    # ---- steps ----------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def launch(self, step: SchedulerOutput) -> LaunchedStep:
        """Enqueue one step's forward pass and sampling on the device and return without waiting for them.
        Rows whose input token is still being sampled (asynchronous scheduling) take it from the device, where
        the step launched before this one leaves it. With constrained rows, sampling waits for
        `sample_constrained`."""
        return self.launch_batch(build_host_batch(step, self.block_size))

    def launch_batch(self, batch: HostBatch) -> LaunchedStep:
        """`launch` of a step already built (a tensor-parallel rank gets it built by rank 0)."""
        logits = self._forward(batch, self._pending_input_ids(batch), self.kv_caches)
        scored = batch.prompt_logprob_rows if self.tp.rank == 0 else []  # only rank 0's outputs are read
        prompt_scores = [(rows, _score_prompt(logits[rows.rows], rows.targets, rows.top_n)) for rows in scored]
        # Start the copies to the host now: waiting on a plain `.tolist()` later would also wait for whatever was
        # launched after this step (the next step, under asynchronous scheduling).
        launched = LaunchedStep(batch, [(rows, scores_to_host_async(scores)) for rows, scores in prompt_scores])
        self._last_launched = launched
        # Prepared once the forward is enqueued: the host work overlaps the device's.
        inputs = self.sampler.prepare(batch.sampling_rows) if batch.sampling_rows and self.tp.rank == 0 else None
        if batch.constrained:
            launched.logits, launched.sampling_inputs = logits[: len(batch.sampling_ids)], inputs
        else:
            self._sample(launched, logits[: len(batch.sampling_ids)], inputs)
        return launched

    @torch.inference_mode()
    def sample_constrained(self, launched: LaunchedStep, grammar: GrammarBitmask | None) -> None:
        """Sample a launched step whose constrained rows waited for their bitmask: the tokens it clears get -inf
        logits first. None: those rows' requests finished meanwhile (their rows are wasted)."""
        logits, inputs = launched.logits, launched.sampling_inputs
        launched.logits = launched.sampling_inputs = None
        if grammar is not None:
            row_of = {request_id: i for i, request_id in enumerate(launched.batch.sampling_ids)}
            rows = torch.tensor([row_of[request_id] for request_id in grammar.request_ids], dtype=torch.int32)
            bitmask = to_device_async(grammar.bitmask, self.device)
            self.ops.apply_token_bitmask(logits, bitmask, to_device_async(rows, self.device))
        self._sample(launched, logits, inputs)

    def _sample(self, launched: LaunchedStep, logits: torch.Tensor, inputs: SamplingInputs | None) -> None:
        """Rank 0 samples (the only rank under tensor parallelism: the others get the tokens, which their next
        step's inputs may need, by a broadcast on the device)."""
        batch = launched.batch
        if inputs is not None:
            launched.sampled = self.sampler.sample(logits, inputs)
            launched.sampled_host = sampled_to_host_async(launched.sampled)
        elif batch.sampling_ids:
            token_ids = torch.empty(len(batch.sampling_ids), dtype=torch.int64, device=self.device)
            launched.sampled = SampledTokens(token_ids, None, [])
        if batch.sampling_ids and self.tp.size > 1:
            self.tp.broadcast(launched.sampled.token_ids)
        if self.device.type == "cuda":  # marks the end of this step's copies to the host
            launched.copied = torch.cuda.Event()
            launched.copied.record()

    def _forward(self, batch: HostBatch, input_ids: torch.Tensor | None, kv_caches: list[LayerKVCache]) -> torch.Tensor:
        """Logits of the batch's logits rows; `input_ids` (on the device) replace its leading placeholders."""
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch, input_ids)
        inputs = to_device(batch, self.device)
        if input_ids is not None:
            inputs.input_ids[: input_ids.shape[0]] = input_ids
        metadata = self.backend.build_metadata(inputs.metadata)
        hidden = self.model(inputs.input_ids, inputs.positions, metadata, kv_caches)
        return self.model.compute_logits(hidden[inputs.logits_indices])

    def _pending_input_ids(self, batch: HostBatch) -> torch.Tensor | None:
        """Input ids [len(pending_ids)] of the leading rows, gathered from what the last launched step samples."""
        if not batch.pending_ids:
            return None
        previous = self._last_launched
        row_of = {request_id: i for i, request_id in enumerate(previous.batch.sampling_ids)}
        rows = [row_of[request_id] for request_id in batch.pending_ids]
        sampled = previous.sampled.token_ids
        if rows == list(range(len(rows))):
            return sampled[: len(rows)]
        return sampled[to_device_async(torch.tensor(rows), sampled.device)]

    def collect(self, step: LaunchedStep) -> RunnerOutput:
        """Wait for a launched step's outputs to reach the host; its sampled tokens and logprobs as Python
        values."""
        if step.copied is not None:
            step.copied.synchronize()
        out = RunnerOutput()
        if step.sampled_host is not None:
            token_ids, scores = sampled_values(step.sampled_host)
            out.sampled = dict(zip(step.batch.sampling_ids, zip(token_ids, scores)))
        for rows, scores in step.prompt_scores:
            out.prompt_logprobs[rows.request_id] = (
                rows.first_position + 1,
                score_values(scores, [rows.top_n] * len(rows.targets)),
            )
        return out


def _score_prompt(logits: torch.Tensor, targets: list[int], top_n: int) -> ScoreTensors:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return score_tensors(logprobs, to_device_async(torch.tensor(targets), logits.device), top_n)
