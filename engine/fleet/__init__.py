"""A fleet of kvscope (or vLLM) servers behind vLLM's router: launcher, collector, workload, what-if."""
