"""Peak memory of the trainer's logprob path vs the naive one, on a large-vocabulary model.

The naive path (what agentrl did before) materialises the whole ``[B, T, V]`` float32 logits
and their ``log_softmax`` and keeps both for the backward; the trainer's path
(:func:`agentrl.trainer.logprobs.token_logprobs_from_hidden`) sends only the loss positions'
hidden states through the LM head, a chunk at a time under activation checkpointing.  Each path runs forward + backward in its
own fresh subprocess so the peak RSS (``ru_maxrss``) is its own; the ratio is printed last.

    python benchmarks/trainer_memory.py [--vocab 150000] [--tokens 2048] [--hidden 64]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def child(path: str, vocab: int, tokens: int, hidden_size: int) -> None:
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from agentrl.trainer.logprobs import head_of, token_logprobs_from_hidden

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=tokens + 1)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, vocab, (1, tokens))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    target = ids[:, 1:]
    if path == "naive":  # full logits, full log-softmax and entropy, both kept for backward
        logits = model(input_ids=ids).logits[:, :-1]
        logsm = F.log_softmax(logits.float() / 0.7, dim=-1)
        logp = logsm.gather(-1, target[..., None]).squeeze(-1)
        ent = -(logsm.exp() * logsm).sum(-1)
        (logp.sum() + 0 * ent.sum()).backward()
    else:  # what the trainer does: hidden states at the loss positions, LM head per chunk
        decoder, logits_fn = head_of(model)
        hidden = decoder(input_ids=ids).last_hidden_state[:, :-1].reshape(-1, hidden_size)
        logp, ent, _ = token_logprobs_from_hidden(hidden, logits_fn, target.reshape(-1),
                                                  torch.zeros(tokens - 1, dtype=torch.long), 0.7, vocab=vocab)
        logp.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"path": path, "peak_rss_mb": peak / 1024, "above_model_mb": (peak - base) / 1024}))


def measure(path: str, args) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", path, "--vocab", str(args.vocab), "--tokens", str(args.tokens),
         "--hidden", str(args.hidden)], capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=150_000)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.vocab, args.tokens, args.hidden)
        return
    naive, chunked = measure("naive", args), measure("chunked", args)
    ratio = chunked["above_model_mb"] / naive["above_model_mb"]
    logits_mb = args.tokens * args.vocab * 4 / 2**20
    print(f"vocab {args.vocab}, {args.tokens} tokens: one [T, V] float32 tensor is {logits_mb:.0f} MiB")
    for r in (naive, chunked):
        print(f"  {r['path']:>8}: peak RSS {r['peak_rss_mb']:.0f} MiB, {r['above_model_mb']:.0f} MiB above the model")
    print(json.dumps({"benchmark": "trainer_memory", "vocab": args.vocab, "tokens": args.tokens,
                      "naive_mb": naive["above_model_mb"], "chunked_mb": chunked["above_model_mb"],
                      "ratio_chunked_vs_naive": ratio}))


if __name__ == "__main__":
    main()
