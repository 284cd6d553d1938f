"""`trio-llm serve` explains itself: what it serves when it starts, one line when it cannot."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from engine import ModelLoadError
from engine.config import CPU_BURST_STEPS
from engine.executor.worker_group import check_tensor_parallel
from tests.conftest import TEST_SPEC, engine_config
from tests.helpers import log_until
from web.cli import _parser, main


def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "web.cli", "serve", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def unknown_architecture(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("unknown-arch") / "model"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"], config["model_type"] = ["MambaForCausalLM"], "mamba"
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture
def busy_port():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield str(holder.getsockname()[1])


def _failures(tiny_model_dir, unknown_architecture, busy_port):
    return [
        (["/no/such/model"], 1, "model directory '/no/such/model' does not exist"),
        ([unknown_architecture], 1, "MambaForCausalLM"),
        ([tiny_model_dir, "--kv-cache-memory-bytes", "1000"], 1, "raise --kv-cache-memory-bytes"),
        ([tiny_model_dir, "--port", busy_port], 1, "choose another --port"),
    ]


def test_start_up_failures_are_one_line_naming_the_cause(tiny_model_dir, unknown_architecture, busy_port):
    for args, status, phrase in _failures(tiny_model_dir, unknown_architecture, busy_port):
        result = _serve(*args)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == status, (args, result.stderr[-2000:])
        assert 1 <= len(lines) <= 2 and all(line.startswith("trio-llm serve: ") for line in lines), (args, lines)
        assert phrase in result.stderr and "Traceback" not in result.stderr, (args, result.stderr)


def test_every_serve_option_has_help_and_shows_its_default():
    serve = _parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    options = [a for a in serve._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 35
    assert [a.option_strings for a in options if not a.help] == []
    text = serve.format_help()
    assert "(default: 256)" in text and "(default: sha256)" in text and "--no-enable-prefix-caching" in text
    assert "(default: None)" not in text and text.count("(default: the embedded tiny model)") == 1


def test_a_bad_command_line_is_one_line_with_did_you_mean(capsys):
    for args, said in ((["serve", "--no-such-flag"], "unrecognized arguments: --no-such-flag; "),
                       (["serve", "--max-num-sqes", "4"], "(did you mean --max-num-seqs?)"),
                       (["serve", "--dtype", "halff"], "(did you mean half?)"),
                       (["generate", "--temprature", "1"], "(did you mean --temperature?)")):
        with pytest.raises(SystemExit) as exited:
            main(args)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"trio-llm {args[0]}: error: ") and said in err
        assert err.endswith(f"see trio-llm {args[0]} --help\n"), err
    assert "layer" not in _parser().format_help()  # the top-level help is for users, not the module's docstring


def test_a_vllm_serve_command_line_carries_over(capsys, caplog):
    """vLLM's spellings map to the same settings; its flags with no feature behind them here are
    accepted with a logged note, or refused in one line with the reason, before anything loads."""
    from web.options import engine_options
    serve = _parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    args = serve.parse_args(["--model", "m", "--dtype", "half", "--block-size", "32", "--num-gpu-blocks-override",
                             "100", "--disable-log-stats", "--swap-space", "4", "--kv-cache-dtype", "auto",
                             "--disable-log-requests", "--disable-fastapi-docs", "--max-model-len", "64"])
    assert (args.model_option, args.host) == ("m", "0.0.0.0")  # every interface, as vLLM
    chosen = engine_options(args)
    assert (chosen["dtype"], chosen["block_size"], chosen["num_kv_blocks"], chosen["max_model_len"]) == \
        ("float16", 32, 100, 64)
    assert engine_options(serve.parse_args(["m", "--dtype", "float"]))["dtype"] == "float32"
    assert chosen["kv_cache_dtype"] == "auto"
    assert engine_options(serve.parse_args(["m", "--kv-cache-dtype", "float16"]))["kv_cache_dtype"] == "float16"
    assert chosen["q8_0_activations"] == "auto"
    assert engine_options(serve.parse_args(["m", "--q8-0-activations", "int8"]))["q8_0_activations"] == "int8"
    refused = [(["--quantization", "awq"], "--quantization awq: not implemented here; trio-llm quantizes"),
               (["--trust-remote-code"], "runs no code from model directories"),
               (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1], got 1.5"),
               (["--eplb-config", '{"window_size": 10}'], "only with --enable-eplb"),
               (["--speculative-config", "{}"], "speculative decoding is not implemented"),
               (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8: not implemented here; the KV cache is held in the "
                                             "model's dtype (auto), bfloat16 or float16"),
               (["--model", "other"], "two models given")]
    for extra, said in refused:
        assert main(["serve", "m", *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("trio-llm serve: ") and err.count("\n") == 1 and said in err, err
    with caplog.at_level(logging.INFO, logger="trio_llm.serve"):
        assert main(["serve", "m", "--swap-space", "4", "--gpu-memory-utilization", "0.8",
                     "--speculative-config", "{}"]) == 2
    assert "note: --swap-space 4 changes nothing here: preempted requests are recomputed" in caplog.text
    assert "note: --gpu-memory-utilization changes nothing here: it sizes the KV cache on CUDA" in caplog.text
    on_cuda = engine_options(serve.parse_args(["m", "--device", "cuda", "--gpu-memory-utilization", "0.5"]))
    assert (on_cuda["gpu_memory_utilization"], on_cuda["kv_cache_memory_bytes"]) == (0.5, None)


def test_generate_with_a_missing_model_is_one_line(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path / "missing"), "hi"]) == 1
    err = capsys.readouterr().err
    assert err == f"trio-llm generate: cannot load the model: model directory '{tmp_path / 'missing'}' does not exist\n"


def test_the_scheduling_policy_flag_reaches_the_engine_config():
    from web.options import engine_options
    serve = _parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    assert engine_options(serve.parse_args(["m"]))["scheduling_policy"] == "fcfs"
    chosen = serve.parse_args(["m", "--scheduling-policy", "priority"])
    assert engine_options(chosen)["scheduling_policy"] == "priority"


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_fails_before_any_worker(tiny_model_dir):
    check_tensor_parallel(engine_config(tiny_model_dir, tensor_parallel_size=2))  # divides: no error
    with pytest.raises(ModelLoadError, match=rf"does not divide the model's {TEST_SPEC.heads} attention heads "
                                             rf"and {TEST_SPEC.kv_heads} key/value heads; sizes that do: 1, 2"):
        check_tensor_parallel(engine_config(tiny_model_dir, tensor_parallel_size=3))


def test_make_model_refuses_to_overwrite_and_answers_bad_shapes_in_one_line(tmp_path, capsys):
    target = tmp_path / "model"
    small = ["--layers", "1", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--intermediate", "64",
             "--vocab", "300"]
    assert main(["make-model", str(target), *small]) == 0
    written = (target / "config.json").read_text()
    assert main(["make-model", str(target), *small, "--seed", "9"]) == 1
    assert "exists and is not empty; pass --force" in capsys.readouterr().err
    assert (target / "config.json").read_text() == written  # untouched
    assert main(["make-model", str(target), *small, "--force"]) == 0
    assert main(["make-model", str(tmp_path / "bad"), "--hidden", "30", "--heads", "4"]) == 2
    assert capsys.readouterr().err.strip() == \
        "trio-llm make-model: hidden must divide by heads (or give head_dim), and heads by kv_heads"
    assert oct((target / "config.json").stat().st_mode & 0o777) == "0o644"


def test_hypercorns_app_factory_exits_1_when_the_engine_cannot_start(tmp_path):
    environment = {**os.environ, "TRIO_LLM_MODEL": str(tmp_path / "missing")}
    result = subprocess.run([sys.executable, "-m", "hypercorn", "-w", "0", "-k", "trio", "-b", "127.0.0.1:0",
                             "web.app:app_from_env()"], capture_output=True, text=True, timeout=120, env=environment)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "the engine failed to start: cannot load the model: model directory" in result.stderr
    assert "Traceback" not in result.stderr


def test_under_hypercorns_command_line_sigterm_lets_a_stream_finish_then_exits_0(tiny_model_dir):
    """The README's `hypercorn -w 0` form: start-up lines logged, and SIGTERM stops gracefully
    (in-flight streams finish within --graceful-timeout), exit status 0, as `trio-llm serve` does."""
    environment = {**os.environ, "TRIO_LLM_MODEL": tiny_model_dir}
    command = [sys.executable, "-m", "hypercorn", "-w", "0", "-k", "trio", "-b", "127.0.0.1:0", "--graceful-timeout",
               "30", "web.app:app_from_env()"]
    # SIGINT as a shell gives a foreground command: an ignored SIGINT is inherited across exec, and
    # some earlier test of a full run leaves the pytest worker ignoring it (then the server, rightly,
    # cannot stop gracefully: exit -15, the stream cut; it warns at start-up).
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=environment,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    try:
        log = log_until(server, "Running on")
        assert any("engine ready in" in line for line in log), log
        assert any(re.search(r"KV cache: \d+ blocks of \d+ tokens \(\d+ tokens, float32\)", line) for line in log), log
        assert any(f"device cpu; decode bursts of up to {CPU_BURST_STEPS} steps while every request decodes and none "
                   "waits, each token streamed as it is sampled" in line for line in log), log
        url = log[-1].split("Running on ")[1].split()[0]
        body = {"prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            events = response.iter_lines()
            first = next(event for event in events if event)
            server.send_signal(signal.SIGTERM)  # the stream is under way
            try:
                rest = [event for event in events if event]
            except httpx.RemoteProtocolError:  # seen in full runs: keep how the server ended and what it said
                with contextlib.suppress(subprocess.TimeoutExpired):
                    server.wait(timeout=10)
                code = server.returncode  # -15: SIGTERM's default action, no handler of ours
                server.kill()
                assert server.stderr is not None
                pytest.fail(f"the stream was cut after SIGTERM (server exit status {code}); the server's log:\n"
                            f"{server.stderr.read()[-4000:]}")
        # Every token arrives, in however many events (one can carry several when the engine runs
        # ahead of the stream): the usage chunk before [DONE] counts them.
        assert first.startswith("data: {") and rest[-1] == "data: [DONE]" and len(rest) > 2
        assert json.loads(rest[-2].removeprefix("data: "))["usage"]["completion_tokens"] == 200
        assert server.wait(timeout=60) == 0
        assert server.stderr is not None and "received SIGTERM: shutting down gracefully" in server.stderr.read()
    finally:
        server.kill()
        server.wait()


def test_under_hypercorn_with_sigint_ignored_the_server_warns_that_sigterm_stops_it_at_once(tiny_model_dir):
    """`hypercorn ... &` from a script, or nohup: SIGINT ignored, so trio cannot deliver the
    graceful stop SIGTERM is turned into; the server says so rather than seeming to promise it."""
    environment = {**os.environ, "TRIO_LLM_MODEL": tiny_model_dir}
    command = [sys.executable, "-m", "hypercorn", "-w", "0", "-k", "trio", "-b", "127.0.0.1:0",
               "web.app:app_from_env()"]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=environment,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # noqa: PLW1509
    try:
        log = log_until(server, "Running on")
        assert any("SIGTERM will stop the server at once" in line for line in log), log
    finally:
        server.kill()
        server.wait()


def test_the_kv_cache_size_follows_the_flag_then_vllm_cpus_variable():
    """None leaves it to the engine: 1 GiB on CPU, what --gpu-memory-utilization leaves on CUDA."""
    from web.options import kv_cache_bytes
    assert kv_cache_bytes(12345, "cpu", {"VLLM_CPU_KVCACHE_SPACE": "4"}) == 12345
    assert kv_cache_bytes(None, "cpu", {"VLLM_CPU_KVCACHE_SPACE": "4"}) == 4 << 30
    assert kv_cache_bytes(None, "cuda", {"VLLM_CPU_KVCACHE_SPACE": "4"}) is None  # a CPU variable
    assert kv_cache_bytes(None, "cpu", {"VLLM_CPU_KVCACHE_SPACE": "0"}) is kv_cache_bytes(None, "cpu", {}) is None
    with pytest.raises(ValueError, match="number of GiB"):
        kv_cache_bytes(None, "cpu", {"VLLM_CPU_KVCACHE_SPACE": "lots"})


def test_the_command_line_starts_the_engine_process_before_importing_torch():
    """What `trio-llm serve` imports before starting its engine process (web/cli.py) pulls in no
    torch, no quart and no engine internals beyond the spawner and its transport: the engine
    process's imports overlap the server's."""
    code = ("import sys, web.cli; from engine.api import TinyModelSpec, engine_process_started; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'quart') "
            "or m.startswith(('engine.core.', 'engine.worker', 'engine.executor', 'engine.sched'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "['engine.core.engine_spawn']"


def test_make_model_takes_a_named_shape_and_size_options_over_it(tmp_path):
    from engine.api import shaped_spec
    spec = shaped_spec("qwen2.5-0.5b")
    assert (spec.arch, spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.intermediate, spec.vocab) == \
        ("qwen2", 24, 896, 14, 2, 4864, 151936)
    known = "gemma3-270m, gpt-oss-20b, llama3-8b, qwen2.5-0.5b"
    with pytest.raises(ValueError, match=f"unknown shape 'gpt-5'; known: {known}"):
        shaped_spec("gpt-5")
    small = ["--layers", "1", "--hidden", "56", "--heads", "7", "--kv-heads", "1", "--intermediate", "64",
             "--vocab", "600"]
    assert main(["make-model", str(tmp_path / "m"), "--shape", "qwen2.5-0.5b", *small]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["model_type"], config["rope_theta"], config["num_hidden_layers"], config["vocab_size"]) == \
        ("qwen2", 1000000.0, 1, 600)


def test_every_engine_option_is_declared_once_on_its_config_field():
    """The parser is built from `EngineConfig`'s fields (`engine.config.flag`): each flagged field
    has its flag, with its help, in `serve --help` and `generate --help` (but --seed there), and what
    the parser gives back builds the config (`engine_options`); no engine option is written anywhere
    else (the foreign vLLM flags are a table of their own)."""
    from dataclasses import fields

    from engine.config import EngineConfig
    from web.options import engine_options
    from web.vllm_flags import ENGINE_FLAGS

    subcommands = _parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    flagged = {f.name: f.metadata["flag"] for f in fields(EngineConfig) if "flag" in f.metadata}
    assert len(flagged) >= 45
    for command in ("serve", "generate"):
        actions = {a.dest: a for a in subcommands[command]._actions}
        for name, declared in flagged.items():
            if command == "generate" and name == "seed":
                assert actions["seed"].help != declared.help  # generate's own --seed
                continue
            assert actions[name].help == declared.help, name
            assert set(declared.names or ["--" + name.replace("_", "-")]) <= set(actions[name].option_strings)
        foreign = {foreign_flag.flag for foreign_flag in ENGINE_FLAGS}
        server_side = {a.dest for a in subcommands["serve"]._actions} - set(flagged)
        assert not any(a.dest in flagged for a in subcommands[command]._actions
                       if set(a.option_strings) & foreign), "a vLLM flag with no feature is never a field"
        assert "model" not in flagged and server_side  # the server's own options stay the server's
    defaults = engine_options(subcommands["serve"].parse_args(["m"]))
    # serve's own defaults: vLLM-CPU's CPU layout, and a first start's graphs compiled while it serves
    assert EngineConfig(model="m", **defaults) == EngineConfig(model="m", cpu_layout=defaults["cpu_layout"],
                                                               compile_in_background=True)


def test_q8_0_activations_say_so_in_the_start_up_lines():
    """--q8-0-activations int8 changes the results for speed, and auto's two int8 levels change
    their last digits: the weights' line says which, where it applies."""
    from engine.model_info import ModelInfo
    from web.http.startup import _quantization_line

    def line(activations):
        return _quantization_line(ModelInfo(32000, 256, 2048, (2,), "float32", 1024, "decoder", quantization="q8_0",
                                            q8_0_activations=activations))

    assert line("float32") == line(None) == "linear layers q8_0 weight-only"
    assert line("int8") == ("linear layers q8_0; the q8_0 ones round a batch of decodes' rows to int8 per block "
                            "(--q8-0-activations int8)")
    assert line("auto").startswith("linear layers q8_0 weight-only; decodes meet q8_0 layers as two int8 levels "
                                   "a row, ~16 bits a value, on tiles laid out for them (a second copy")
    assert _quantization_line(ModelInfo(32000, 256, 2048, (2,), "float32", 1024, "decoder")) == "not quantized"

