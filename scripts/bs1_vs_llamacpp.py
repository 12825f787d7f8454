"""Batch-1 decode, same run: kvscope (default GGUF, C path) vs llama.cpp on the same GGUF, prompt
(W16's first) and thread count, their timed rounds alternating (llama.cpp kept loaded in its
subprocess, engine/bench/peers.LlamaCppBs1; each engine warmed up first). Prints one JSON line per
thread count: each engine's best round and every round.

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
    n_new, ROUNDS = 64, 4
    prompt = C.chat_prompts(load_tokenizer(), 16, seed=0, min_tokens=30, max_tokens=300)[0][0]
    for th in [int(t) for t in (sys.argv[1] if len(sys.argv) > 1 else "1,2").split(",")]:
        llm = LLM(model="default", num_threads=th)
        sp = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
        decode_steps(llm, prompt, sp, f"warm{th}")
        rates = []
        with peers.LlamaCppBs1(default_gguf_path(), prompt, n_new, th, max_passes=ROUNDS) as lcw:
            for i in range(ROUNDS):
                n, wall, _ = decode_steps(llm, prompt, sp, f"r{th}-{i}")
                rates.append(n / wall)
                lcw.one()
            lc = lcw.result()
        C.free_llm(llm)
        kv = max(rates)
        row = {"isa": kernel_isa.summary(), "threads": th, "kvscope_tok_s": kv, "kvscope_rates": rates}
        row.update({"llamacpp_tok_s": lc.get("tok_s"), "llamacpp_rates": lc.get("rates"), "why": lc.get("why")})
        row["ratio"] = kv / lc["tok_s"] if lc.get("tok_s") else None
        print(json.dumps(row), flush=True)
    os._exit(0)
