"""Batch-1 decode of the default model with weight_format auto (gguf) and fp32, rounds alternating
in one process, plus the per-kernel step split in wall and CPU time (what `bench roofline` does
for its batch-1 fields, without the rest of the suite). Prints one JSON line.

    python scripts/decode_bs1_by_format.py [new_tokens]
"""

import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
from engine.bench import common as C  # noqa: E402
from engine.bench import roofline as R  # noqa: E402
from engine.model.models import load_tokenizer  # noqa: E402

if __name__ == "__main__":
    torch.set_num_threads(1)
    ctx = C.BenchContext(quick=True)
    prompts, _ = C.chat_prompts(load_tokenizer(), 16, seed=0, min_tokens=30, max_tokens=300)
    out = R.decode_bs1_by_format(ctx, prompts[0], int(sys.argv[1]) if len(sys.argv) > 1 else 32, rounds=2)
    print(json.dumps({"prompt_len": len(prompts[0]), **out}, default=str))
