"""The model and its kernels: loading weights and tokenizers, the forward pass over a flattened
batch (ModelRunner), paged attention, the KV pool's layout and storage formats, packed and
quantized Linears, the C kernels (csrc/) and the fused C decoder stack, and the device decisions.

May import: engine.config, engine.observe.
(never the step loop or anything above it: tests/engine/test_import_graph.py)"""
