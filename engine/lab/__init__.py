"""The experiments and measurements the pages run on top of the engine: comparisons on private
engines, the Claims page's rows, A/B timing, agreement with transformers, the side channel, the
as-you-type preview, the memory calculator's sums, workloads and prompt sets, the soak and the GPU
check. Imports everything below it (core, model, observe, speculative); nothing imports it back
but serve, bench and the pages."""
