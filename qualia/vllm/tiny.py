"""Tiny random Llama checkpoints for testing and measuring ``qualia.vllm.Scheduler`` offline.

``make_tiny_llama(path)`` writes a two-layer Llama (head_dim 32, as vLLM's CPU attention needs)
with seeded random weights, its matrices scaled up so that greedy decoding has no near-ties: fp32
greedy outputs of vLLM's engine then equal Hugging Face ``generate`` token for token, whatever the
scheduler does.  ``engine_env()`` is the environment vLLM's CPU engine needs to run offline and
in-process.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence

ENGINE_ENV: Dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}

#: vLLM LLM(...) arguments for a tiny checkpoint (token-id prompts, no tokenizer).
LLM_ARGS = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="float32", seed=0)

VOCAB = 512
EOS = 2


def engine_env() -> None:
    """Set (without overriding) the environment of ``ENGINE_ENV``."""
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)


def make_tiny_llama(path: str, seed: int = 0, layers: int = 2, hidden: int = 64,
                    scale: float = 8.0, max_positions: int = 2048) -> str:
    """Write a tiny random Llama checkpoint (config, generation config, safetensors) to
    ``path`` and return ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=hidden // 32,
                      num_key_value_heads=hidden // 32, head_dim=32,
                      max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=EOS,
                      pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    model.save_pretrained(path, safe_serialization=True)
    return path


class HFGreedy:
    """Hugging Face ``generate`` on the same checkpoint: the reference outputs."""

    def __init__(self, path: str) -> None:
        import torch
        from transformers import LlamaForCausalLM

        self._torch = torch
        self.model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()

    def generate(self, prompt: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = (),
                 min_new_tokens: int = 0) -> List[int]:
        """Greedy continuation of ``prompt``: up to ``max_new_tokens`` tokens, ending at the
        first of ``stop_ids`` (included) once ``min_new_tokens`` were generated (before that,
        the stop ids are masked, as vLLM's min_tokens does)."""
        torch = self._torch
        ids = torch.tensor([list(prompt)])
        kw: Dict[str, Any] = dict(max_new_tokens=max_new_tokens, do_sample=False,
                                  pad_token_id=0)
        if stop_ids:
            kw["eos_token_id"] = list(stop_ids)
            if min_new_tokens:
                kw["min_new_tokens"] = min_new_tokens
        else:
            kw["eos_token_id"] = None
        with torch.no_grad():
            out = self.model.generate(ids, **kw)[0, len(prompt):].tolist()
        if stop_ids:
            for i, t in enumerate(out):
                if t in stop_ids and i + 1 >= max(min_new_tokens, 1):
                    return out[:i + 1]
        return out
