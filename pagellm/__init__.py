"""pagellm: a readable LLM inference engine with a paged KV cache and continuous batching."""

from pagellm.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagellm.engine.llm import LLM
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput
from pagellm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
]
__version__ = "0.1.0"
