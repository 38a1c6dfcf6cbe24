"""ModelRunner: builds the model and the KV cache on the device, runs one scheduled step, samples."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagellm.config import EngineConfig, ModelConfig
from pagellm.engine.request import Request
from pagellm.engine.scheduler import SchedulerOutput
from pagellm.model.attention import AttentionMetadata, LayerKVCache, allocate_kv_caches, get_backend
from pagellm.model.layers import can_pack_for_cpu
from pagellm.model.loader import load_weights
from pagellm.model.registry import model_class
from pagellm.runner.cuda_graphs import DecodeGraphs
from pagellm.runner.input_batch import HostBatch, PromptLogprobRows, build_host_batch, to_device
from pagellm.runner.sampler import (
    SampledTokens,
    Sampler,
    SamplingBatch,
    ScoreTensors,
    TokenScore,
    copy_to_host,
    score_tensors,
    scores_copy_to_host,
    scores_to_host,
    to_host,
)
from pagellm.runner.transfers import to_device_async
from pagellm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagellm.kernels.compile_ahead import Compilation  # imports Triton, which the CPU path does without


# Sampling's [rows, vocab] temporaries (scaled logits, logprobs) count toward the memory peak.
PROFILE_SAMPLING = (SamplingParams(temperature=1.0, top_p=0.9, logprobs=20),)
# One set per sampling kernel variant: fp32 logits (the full path, here through a penalty) and the model's own
# (the plain and greedy paths).
COMPILE_SAMPLING = (SamplingParams(top_p=0.9, repetition_penalty=1.1), SamplingParams(top_p=0.9),
                    SamplingParams(temperature=0))


@dataclass
class RunnerOutput:
    sampled: dict[str, tuple[int, TokenScore | None]] = field(default_factory=dict)  # request id -> token, score
    # request id -> (position of the first scored prompt token, one score per position from there)
    prompt_logprobs: dict[str, tuple[int, list[TokenScore]]] = field(default_factory=dict)


@contextlib.contextmanager
def _default_dtype_and_device(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(old)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, model_dir, max_model_len: int) -> None:
        self.config = model_config
        self.engine_config = engine_config
        self.device = engine_config.resolve_device()
        self.dtype = engine_config.resolve_dtype(model_config, self.device)
        self.kv_dtype = engine_config.resolve_kv_dtype(self.dtype)
        self.block_size = engine_config.block_size
        self.max_model_len = max_model_len
        self.backend = get_backend("triton" if self.device.type == "cuda" else "torch", max_model_len)
        max_positions = max(max_model_len, model_config.max_position_embeddings)
        # What this process held on the GPU before this engine: other engines' memory is not ours to count.
        self._gpu_baseline = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        with _default_dtype_and_device(self.dtype, self.device):
            self.model = model_class(model_config)(model_config, self.backend, max_positions)
        self.model.eval()
        self.sampler = Sampler(engine_config.seed, self.device)
        self._compilation = self._start_compiling()
        load_weights(self.model, model_dir, engine_config.load_format, engine_config.seed, engine_config.quiet)
        if can_pack_for_cpu(self.device, self.dtype):
            self.model.pack_for_cpu()
        self.kv_caches: list[LayerKVCache] = []
        self.num_blocks = 0
        self.graphs: DecodeGraphs | None = None

    def determine_num_blocks(self, max_model_len: int) -> int:
        cfg = self.engine_config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        bytes_per_block = self.config.kv_bytes_per_token(self.kv_dtype) * self.block_size
        if self.device.type == "cuda":
            budget = self._gpu_kv_budget(max_model_len)
        else:
            budget = cfg.cpu_kv_cache_gib * 2**30
        # No point in more blocks than max_num_seqs full-length sequences can use.
        most_useful = cfg.max_num_seqs * -(-max_model_len // self.block_size) + 1
        return max(1, min(int(budget // bytes_per_block), most_useful))

    def _gpu_kv_budget(self, max_model_len: int) -> float:
        """Bytes for the KV cache, like vLLM: this engine may use gpu_memory_utilization of the card, of which its
        weights and a max-size forward pass (one prefill of max_num_batched_tokens, plus sampling max_num_seqs
        rows) take their peak; and no more than is free, leaving room for the activations."""
        cfg = self.engine_config
        weights = torch.cuda.memory_allocated(self.device) - self._gpu_baseline
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run(min(cfg.token_budget, max_model_len), PROFILE_SAMPLING)
        peak = torch.cuda.max_memory_allocated(self.device) - self._gpu_baseline
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = min(cfg.gpu_memory_utilization * total - peak, free - (peak - weights))
        if budget <= 0:
            raise ValueError(f"gpu_memory_utilization={cfg.gpu_memory_utilization} leaves no room for the KV cache "
                             f"(weights + activations peak at {peak / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free): "
                             "raise it, or lower max_num_batched_tokens")
        return budget

    def _start_compiling(self) -> Compilation | None:
        """On CUDA, start compiling every Triton kernel that serving launches, so that none compiles mid-serving,
        all at once, and while the weights load (see `compile_ahead`): those of the longest and of short prefill
        chunks, of one-row steps (the GEMV), of sampling (no logprobs: they would index with samples never
        computed), and of pure-decode steps: of every CUDA-graph batch size, or in eager mode of one batch per size
        class of the decode kernels. The passes run the first decoder layer only, on weights not loaded yet."""
        if self.device.type != "cuda":
            return None
        from pagellm.kernels.compile_ahead import compile_ahead
        from pagellm.kernels.decode_attention import SMALL_BATCH
        from pagellm.runner.cuda_graphs import capture_sizes

        cfg = self.engine_config
        if cfg.enforce_eager:
            decode_batches = sorted({1, min(cfg.max_num_seqs, SMALL_BATCH + 1)})
        else:
            decode_batches = capture_sizes(cfg.max_num_seqs)
        longest = min(cfg.token_budget, self.max_model_len)
        with compile_ahead() as compilation, self.model.first_layer_only():
            for num_tokens in (longest, 16, 1):  # the sampling kernels do not vary with the row count
                self._profile_run(num_tokens, COMPILE_SAMPLING if num_tokens == longest else ())
            for num_seqs in decode_batches:
                self._decode_run(num_seqs)
        return compilation

    def compile_kernels(self) -> None:
        """Wait until the kernels that construction started compiling are ready to launch."""
        if self._compilation is not None:
            self._compilation.wait()

    @torch.inference_mode()
    def _decode_run(self, num_seqs: int) -> None:
        """A pure-decode step of num_seqs one-token sequences, its grid sized for max_model_len as in the graphs."""
        caches = allocate_kv_caches(self.config.num_layers, 1, self.block_size, self.config.num_kv_heads,
                                    self.config.head_dim, self.kv_dtype, self.device)
        zeros = torch.zeros(num_seqs, dtype=torch.int64, device=self.device)
        metadata = AttentionMetadata(
            slot_mapping=zeros, block_tables=torch.zeros(num_seqs, -(-self.max_model_len // self.block_size),
                                                         dtype=torch.int32, device=self.device),
            query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=self.device),
            seq_lens=torch.ones(num_seqs, dtype=torch.int32, device=self.device), max_query_len=1,
            max_seq_len=self.max_model_len, num_decodes=num_seqs)
        self.backend.prepare(metadata, self.block_size)
        self.model.compute_logits(self.model(zeros, zeros, metadata, caches))

    @torch.inference_mode()
    def _profile_run(self, num_tokens: int, sampling: tuple[SamplingParams, ...]) -> None:
        cfg = self.engine_config
        blocks = -(-num_tokens // self.block_size)
        caches = allocate_kv_caches(self.config.num_layers, blocks, self.block_size, self.config.num_kv_heads,
                                    self.config.head_dim, self.kv_dtype, self.device)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        metadata = AttentionMetadata(
            slot_mapping=positions.clone(), block_tables=torch.arange(blocks, dtype=torch.int32,
                                                                      device=self.device)[None],
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            max_query_len=num_tokens, max_seq_len=num_tokens)
        self.backend.prepare(metadata, self.block_size)
        hidden = self.model(ids, positions, metadata, caches)
        rows = min(cfg.max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[:rows])
        for params in sampling:
            self.sampler.sample(logits, SamplingBatch([params] * rows, [[]] * rows, [[0]] * rows, [0] * rows))
        torch.cuda.synchronize(self.device)
        del caches, hidden, logits

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_caches(self.config.num_layers, num_blocks, self.block_size,
                                            self.config.num_kv_heads, self.config.head_dim, self.kv_dtype,
                                            self.device)
        if self.device.type == "cuda" and not self.engine_config.enforce_eager:
            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.engine_config.max_num_seqs,
                                       self.max_model_len, self.block_size, self.device)
            self.graphs.capture()

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Enqueue one step's forward pass and sampling on the device and return without waiting for them.
        With `previous` (a step still in flight), rows whose input token that step is sampling take it from the
        device, where it will be."""
        batch = build_host_batch(sched, self.block_size)
        input_ids = _ids_sampled_by(previous, batch) if previous is not None else None
        if self.graphs is not None and self.graphs.can_run(batch):
            logits = self.graphs.run(batch, input_ids)  # pure decode: every row samples, in order
        else:
            inputs = to_device(batch, self.device)
            if input_ids is not None:
                inputs.input_ids[:input_ids.shape[0]] = input_ids
            self.backend.prepare(inputs.metadata, self.block_size)
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata, self.kv_caches)
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
        num_sampling = len(batch.sampling_requests)
        sampled = None
        if num_sampling:
            sampled = self.sampler.sample(logits[:num_sampling], _sampling_batch(batch.sampling_requests))
        prompt_scores = [(rows, _score_prompt(logits[rows.rows], rows.targets,
                                              rows.request.sampling_params.prompt_logprobs))
                         for rows in batch.prompt_logprob_rows]
        # Start the copies to the host now and mark their end: waiting on a plain `.tolist()` later would also
        # wait for whatever was launched after this step (the next step, under asynchronous scheduling).
        sampled_host = copy_to_host(sampled) if sampled is not None else None
        prompt_scores = [(rows, scores_copy_to_host(scores)) for rows, scores in prompt_scores]
        copied = None
        if self.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record()
        return LaunchedStep(batch, sampled, sampled_host, prompt_scores, copied)

    def collect(self, step: LaunchedStep) -> RunnerOutput:
        """Wait for a launched step's outputs to reach the host; its sampled tokens and logprobs as Python
        values."""
        if step.copied is not None:
            step.copied.synchronize()
        out = RunnerOutput()
        if step.sampled_host is not None:
            sampled = to_host(step.sampled_host)
            out.sampled = {request.request_id: (token, logprobs) for request, token, logprobs
                           in zip(step.batch.sampling_requests, sampled.token_ids, sampled.logprobs)}
        for rows, scores in step.prompt_scores:
            out.prompt_logprobs[rows.request.request_id] = (
                rows.first_position + 1, scores_to_host(scores, [rows.request.sampling_params.prompt_logprobs] *
                                                        len(rows.targets)))
        return out


@dataclass
class LaunchedStep:
    """A step whose device work is enqueued: its inputs and the device tensors its outputs will land in."""

    batch: HostBatch
    sampled: SampledTokens | None  # on the device, where the next step may read its token ids
    sampled_host: SampledTokens | None  # host copies, complete once `copied` has passed
    prompt_scores: list[tuple[PromptLogprobRows, ScoreTensors]]  # host copies, likewise
    copied: torch.cuda.Event | None  # None on the CPU, where everything is done already


def _sampling_batch(requests: list[Request]) -> SamplingBatch:
    return SamplingBatch(
        params=[r.sampling_params for r in requests],
        output_token_ids=[r.output_token_ids for r in requests],
        prompt_token_ids=[r.prompt_token_ids for r in requests],
        draw_indices=[len(r.output_token_ids) + r.num_pending_tokens for r in requests],
    )


def _ids_sampled_by(previous: LaunchedStep, batch: HostBatch) -> torch.Tensor:
    """Input ids [num_decodes] of this step's leading decode rows, gathered from what `previous` samples."""
    row_of = {id(r): i for i, r in enumerate(previous.batch.sampling_requests)}
    rows = [row_of[id(r)] for r in batch.sampling_requests[:batch.num_decodes]]
    sampled = previous.sampled.token_ids
    if rows == list(range(len(rows))):
        return sampled[:len(rows)]
    return sampled[to_device_async(torch.tensor(rows), sampled.device)]


def _score_prompt(logits: torch.Tensor, targets: list[int], top_n: int) -> ScoreTensors:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return score_tensors(logprobs, to_device_async(torch.tensor(targets), logits.device), top_n)
