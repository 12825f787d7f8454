"""`python -m engine serve`: options map onto EngineConfig, bad options exit 2 with the field
named, and the real command serves on 127.0.0.1 (and writes the tokenizer with --save-tokenizer)."""

import importlib.util
import os
import subprocess
import sys

import httpx
import pytest

from engine.serve import cli
from engine.serve.ports import free_port
from tests.waiting import wait_until


def config_of(*argv):
    return cli.build_config(cli.parser().parse_args(list(argv)))


def test_every_engine_config_field_is_an_option():
    c = config_of(
        "--model",
        "tiny",
        "--block-size",
        "8",
        "--enable-prefix-caching",
        "false",
        "--set",
        "max_num_seqs=3",
        "--set",
        'speculative_config={"method": "ngram", "num_speculative_tokens": 2}',
        "--kv-cache-bytes",
        "1048576",
    )
    assert (c.model, c.block_size, c.enable_prefix_caching, c.max_num_seqs, c.kv_cache_bytes) == (
        "tiny",
        8,
        False,
        3,
        1048576,
    )
    assert c.speculative.method == "ngram" and c.speculative.num_speculative_tokens == 2
    assert config_of("--set", 'speculative={"method": "ngram"}').speculative.method == "ngram"


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--set", "bogus=1"], "'bogus' is not an EngineConfig field"),
        (["--set", "block_size"], "FIELD=VALUE"),
        (["--block-size", "0"], r"block_size must be an integer in \[1, 256\], got 0"),
        (["--preemption-mode", "teleport"], "preemption_mode must be one of"),
    ],
)
def test_bad_options_name_the_field(argv, match):
    with pytest.raises(ValueError, match=match):
        config_of(*argv)


def test_main_exits_2_on_bad_input(capsys):
    assert cli.main(["--model", "tiny", "--port", "70000"]) == 2
    assert "--port must be in [1, 65535]" in capsys.readouterr().err
    assert cli.main(["--model", "tiny", "--set", "max_model_len=1"]) == 2
    assert "max_model_len must be an integer in [2, 1048576], got 1" in capsys.readouterr().err


@pytest.mark.skipif(
    importlib.util.find_spec("engine.observe.kv_events") is not None,
    reason="engine.observe.kv_events is present: its own tests cover publishing",
)
def test_kv_events_without_the_module_is_a_clear_error():
    from engine.core.thread import EngineThread

    with pytest.raises(ValueError, match="no engine.kv_events module"):
        cli.attach_kv_events(EngineThread.__new__(EngineThread), "tcp://127.0.0.1:5557", None, "current")


def test_the_command_serves_and_saves_the_tokenizer(tmp_path):
    port = free_port()
    tok_dir = tmp_path / "tok"
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", KVSCOPE_API_KEY=""
    )
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine",
            "serve",
            "--model",
            "tiny",
            "--port",
            str(port),
            "--num-kv-blocks",
            "64",
            "--save-tokenizer",
            str(tok_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:

        def up_or_exited() -> bool:
            if p.poll() is not None:
                return True  # exited: the assert below shows its output
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up_or_exited, "the server to load the model and answer /health", 600, 0.5)
        assert p.poll() is None, p.stdout.read().decode()[-2000:]
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert models["data"][0]["id"] == "tiny"
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=120,
            json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0},
        )
        assert r.json()["usage"]["completion_tokens"] == 2
        assert (tok_dir / "tokenizer.json").exists() and (tok_dir / "tokenizer_config.json").exists()
    finally:
        p.terminate()
        p.wait(60)
        p.stdout.close()
