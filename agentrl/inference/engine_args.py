"""The embedded engine's settings and their defaults, in one place (torch-free).

The engine, its HTTP server, the launcher, ``agentrl serve`` and the ``[inference]``
config section all take their defaults from :class:`EngineArgs`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EngineArgs:
    """How an embedded engine is built."""

    max_batch_size: int = 64  # sequences decoded together (KV-cache slots)
    max_model_len: int = 1024  # longest prompt + completion, in tokens
    device: str = "auto"  # auto | cpu | cuda[:i]
    dtype: str = "auto"  # auto (the checkpoint's; float32 ones in bf16 where agentrl.precision says so) | float32 | bfloat16 | float16
    prefill_token_budget: int = 4096  # prompt tokens prefilled together in one step
    enable_prefix_caching: bool = True  # reuse K/V of earlier prompts/turns (vLLM's name)
    prefix_cache_tokens: int = 0  # tokens of K/V the prefix cache keeps; 0 = max_batch_size * max_model_len
    prefix_block_size: int = 16  # tokens per cached block (a prefix is reused in whole blocks)
    keep_prefix_cache_on_weight_update: bool = False  # True reuses K/V computed by older weights (inexact)
    cpu_linear: str = "packed"  # CPU float32 linear layers: packed (oneDNN, weights prepacked: one more copy of them) | onednn | torch (MKL)
    cpu_attention: str = "kernel"  # CPU float32/bf16 decode attention in ragged steps: kernel (C, built on first use) | sdpa
    ragged_batches: bool = True  # one forward per step for its prefills and decodes (a model that cannot: padded, two)
    num_speculative_tokens: int = 0  # n-gram draft tokens per sequence and step (vLLM's name; needs ragged batches)
    speculative_ngram: int = 3  # context tokens an n-gram draft is looked up by
    server_process: str = "same"  # same: HTTP server and model loop in one process | split: the engine core in its own

    def cli_args(self) -> list[str]:
        """The same settings as ``python -m agentrl.inference.server`` flags."""
        out = []
        for key, value in asdict(self).items():
            out += [f"--{key.replace('_', '-')}", str(value)]
        return out
