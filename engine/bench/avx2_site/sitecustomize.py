"""Started first by every Python of the bench's vLLM peer on the AVX2 path (engine/bench/peers.py
puts this directory on its PYTHONPATH under KVSCOPE_ISA=avx2; nothing else imports it).

vLLM's CPU wheel ships its own kernels three times (vllm._C for AVX-512 with bf16, _C_AVX512,
_C_AVX2) and loads one by asking torch.cpu whether the CPU has AVX-512. On an AVX-512 machine
that answer is yes whatever ATen / oneDNN / MKL are limited to, so the AVX2 comparison ran vLLM's
AVX-512 attention and cache kernels. Here torch.cpu's AVX-512 and AMX probes answer False, as on an
AVX2-only CPU, so vLLM loads _C_AVX2 and picks its attention ISA the way it would there."""

import torch.cpu

for _name in (
    "_is_avx512_supported",
    "_is_avx512_vnni_supported",
    "_is_avx512_bf16_supported",
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
):
    if hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, lambda: False)
