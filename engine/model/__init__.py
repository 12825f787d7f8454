"""The model and its kernels: loading weights and tokenizers, the forward pass over a flattened
batch (ModelRunner), paged attention, the KV pool's layout and storage formats, packed and
quantized Linears, the C kernels (csrc/) and the fused C decoder stack. Imports engine.config and
engine.observe only where a step reports; never engine.core, engine.lab or engine.serve."""
