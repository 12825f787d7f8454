"""Batch-1 decode, same run: kvscope (default GGUF, C path) vs llama.cpp on the same GGUF, prompt
(W16's first) and thread count. Prints one JSON line per thread count.

    python scripts/bs1_vs_llamacpp.py [threads, e.g. 1,2]
"""

import json
import os
import sys

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
from engine.bench import common as C  # noqa: E402
from engine.bench import peers  # noqa: E402
from engine.bench.decode_bs1 import decode_steps  # noqa: E402
from engine.config import SamplingParams  # noqa: E402
from engine.core.llm import LLM  # noqa: E402
from engine.model import kernel_isa  # noqa: E402
from engine.model.models import default_gguf_path, load_tokenizer  # noqa: E402

if __name__ == "__main__":
    n_new = 64
    prompt = C.chat_prompts(load_tokenizer(), 16, seed=0, min_tokens=30, max_tokens=300)[0][0]
    for th in [int(t) for t in (sys.argv[1] if len(sys.argv) > 1 else "1,2").split(",")]:
        llm = LLM(model="default", num_threads=th)
        sp = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
        rates = []
        for i in range(4):  # the first round warms up
            n, wall, _ = decode_steps(llm, prompt, sp, f"r{th}-{i}")
            rates.append(n / wall)
        C.free_llm(llm)
        lc = peers.llamacpp_decode_bs1(default_gguf_path(), prompt, n_new, th, reps=3)
        kv = max(rates[1:])
        row = {"isa": kernel_isa.summary(), "threads": th, "kvscope_tok_s": kv, "kvscope_rates": rates}
        row.update({"llamacpp_tok_s": lc.get("tok_s"), "llamacpp_rates": lc.get("rates"), "why": lc.get("why")})
        row["ratio"] = kv / lc["tok_s"] if lc.get("tok_s") else None
        print(json.dumps(row), flush=True)
    os._exit(0)
