"""A tiny random-weight Llama that vLLM serves on CPU in seconds, for the vLLM tests and the
benchmark: hidden 256, 4 layers, 4 query heads and 2 KV heads of 64, a 4,096-word vocabulary
with a WordLevel tokenizer (one word, one token), contexts up to 8,192 tokens.

Made locally (nothing is downloaded): ``make_model(dir)`` writes a Hugging Face model
directory (config, safetensors weights, tokenizer) that ``vllm.LLM(model=dir)`` loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import List, Sequence

CHILD = Path(__file__).resolve().parent / "vllm_child.py"

VOCAB = 4096
HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 256, 4, 4, 2, 512
MAX_LEN = 8192


def make_model(where: os.PathLike, seed: int = 0) -> Path:
    """Write the tiny model to ``where`` (once: an existing complete directory is kept)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(where)
    done = path / ".complete"
    if done.exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, VOCAB):
        vocab[word(i)] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        model_max_length=MAX_LEN,
    )
    fast.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_LEN, bos_token_id=1, eos_token_id=2,
        torch_dtype="bfloat16", tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    done.write_text("ok")
    return path


def word(i: int) -> str:
    """Token ``i``'s word: short (vLLM bounds a prompt's characters by 5 per token)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        out = letters[i % 26] + out
        i //= 26
        if i == 0:
            return out


def prompt(n_tokens: int, seed: int) -> str:
    """A prompt of exactly ``n_tokens`` words (tokens), deterministic in ``seed``."""
    import random

    r = random.Random(seed)
    return " ".join(word(r.randrange(3, VOCAB)) for _ in range(n_tokens))


def words(text: str) -> List[str]:
    return text.split()


def run_child(python: str, spec: dict, env: dict, prefix: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """Run one vLLM instance (``vllm_child.py`` with ``spec``; ``prefix``: a command it runs
    under, such as ``ip netns exec NAME``), output captured, and its result (JSON text, or
    None) as ``.result``. vLLM's
    sockets between its processes go to a directory of their own, removed afterwards (by
    default they are left in the temporary directory)."""
    with tempfile.TemporaryDirectory(prefix="vllm-rpc-") as rpc:
        result = os.path.join(rpc, "result.json")
        env = dict(env, VLLM_RPC_BASE_PATH=rpc, MARU_VLLM_RESULT=result)
        out = subprocess.run([*prefix, python, str(CHILD), json.dumps(spec)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=900)
        # The child's result, from its file (its stdout is shared with vLLM's processes).
        out.result = open(result).read() if os.path.exists(result) else None
        return out


def barrier(path: str, limit_s: float = 600) -> None:
    """Say this process is at ``path`` (``<path>.ready``) and wait until ``path`` exists."""
    open(path + ".ready", "w").close()
    deadline = time.monotonic() + limit_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"nobody opened {path}")
        time.sleep(0.05)
