"""`trio-llm bench gguf-fidelity`: how faithfully each side runs one Q8_0 (or Q4_0, Q4_K_M) GGUF
file, as the greedy tokens of the float model they keep.

One HF checkpoint; its Q8_0 file made by llama.cpp's own converter (`convert_hf_to_gguf.py`, from
the sources `../shared/tools/llama-server` builds), or with `--type Q4_0` (`Q4_K_M`) its float32
file made by the converter and quantized by llama.cpp's `llama-quantize` with its defaults (which
keep the LM head in Q6_K, as users' files have it); the reference is transformers' float32 greedy
continuation of each prompt from the checkpoint, and a second reference is the same of the file's
weights dequantized to float32 (what the file means: on a random-weight checkpoint at 4 bits the
format's own rounding leaves the float model within a token or two on every side, and only this
one tells the sides apart). Each side then runs the file on the same prompts
(token ids, so no tokenizer stands between them) for the same number of greedy tokens, and a
prompt's figure is how many leading tokens equal the reference's (past the first difference the
sequences part, whatever follows). Sides: llama.cpp's own server (`llama-server`, which rounds
the activations to int8 per block: Q8_0 for Q8_0 and Q4_0 weights, Q8_K for K-quants), trio-llm's
default for the file (its blocks as they are: `q8_0`, `q4_0`, `q4_k`, run eagerly),
trio-llm's `--q8-0-activations float32` (float rows where the default's `auto` takes two int8
levels for 10 or more decodes), `--quantization int8` (the blocks requantized to one scale per
row), `--kv-cache-dtype float16`, and `--q8-0-activations int8` (the decodes' rows rounded to int8
per block, llama.cpp's arithmetic for Q8_0 weights). trio-llm runs 16 prompts at a time, the
kernels' batch.
Greedy decoding is deterministic, so one run is the figure; the prompts are passages of the
engine's corpus (engine/data/corpus.txt).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import trio

from bench import http
from bench.side_by_side import served
from bench.together import tokens_together
from engine import EngineConfig, open_engine
from engine.models.gguf_file import block_formats
from engine.sampling_params import SamplingParams

CORPUS = Path(__file__).resolve().parent.parent / "engine" / "data" / "corpus.txt"
# llama.cpp's converter refuses a tokenizer whose pre-tokenizer hash it does not list (a local one);
# the token ids are what this bench compares, so any pre-tokenizer name it knows serves. For Qwen2 it
# first looks for a SentencePiece model, which needs the sentencepiece package just to find none:
# the checkpoints here have a tokenizer.json only, so it is told there is none.
CONVERT = """
import sys
sys.path[:0] = [{gguf_py!r}, {converter_dir!r}]
import convert_hf_to_gguf as convert
from conversion.base import TextModel
def no_sentencepiece_model(self):
    raise FileNotFoundError("tokenizer.model")
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
TextModel._set_vocab_sentencepiece = no_sentencepiece_model
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outfile", {out!r}, "--outtype", {outtype!r}]
convert.main()
"""


def convert_q8_0(model_dir: str, out: Path, llama_dir: Path, outtype: str = "q8_0") -> Path:
    """The checkpoint as a Q8_0 GGUF file (or `outtype`'s), by llama.cpp's converter."""
    vendored = llama_dir / "src" / "vendor" / "llama.cpp"
    script = CONVERT.format(gguf_py=str(vendored / "gguf-py"), converter_dir=str(vendored), model=model_dir,
                            out=str(out), outtype=outtype)
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True)
    return out


def convert(model_dir: str, workdir: Path, llama_dir: Path, qtype: str) -> Path:
    """The checkpoint as a `qtype` GGUF file made by llama.cpp's tools: Q8_0 by its converter, Q4_0
    by `llama-quantize` (its defaults) from the converter's float32 file."""
    if qtype == "Q8_0":
        return convert_q8_0(model_dir, workdir / "model-q8_0.gguf", llama_dir)
    f32 = convert_q8_0(model_dir, workdir / "model-f32.gguf", llama_dir, "f32")
    out = workdir / f"model-{qtype.lower()}.gguf"
    subprocess.run([str(llama_dir / "build" / "bin" / "llama-quantize"), str(f32), str(out), qtype], check=True,
                   capture_output=True, text=True)
    return out


def corpus_prompts(model_dir: str, count: int, length: int) -> list[list[int]]:
    """`count` passages of the corpus, `length` tokens each, in the checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(CORPUS.read_text())["input_ids"]
    stride = max(length, (len(ids) - length) // count)
    return [ids[i * stride:i * stride + length] for i in range(count)]


def reference(model_dir: str, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """transformers' float32 greedy continuation of each prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            full = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=tokens,
                                  min_new_tokens=tokens, pad_token_id=0)
            out.append(full[0, len(prompt):].tolist())
    return out


async def ours(gguf: Path, tokenizer: str, prompts: list[list[int]], tokens: int, quantization: str | None,
               threads: int, kv_cache_dtype: str = "auto", q8_0_activations: str = "auto") -> list[list[int]]:
    """trio-llm's greedy tokens on the file, 16 prompts at a time (so that its decodes are batches
    the q8_0 kernels take, as a server's at 16 streams: auto's two int8 levels, int8's rows),
    eager."""
    torch.set_num_threads(threads)
    batch = min(16, max(len(prompts), 1))
    config = EngineConfig(model=str(gguf), tokenizer=tokenizer, dtype="float32", quantization=quantization,
                          enforce_eager=True, executor="inproc", num_kv_blocks=len(prompts) * 16 + 16,
                          kv_cache_dtype=kv_cache_dtype, q8_0_activations=q8_0_activations, max_num_seqs=batch)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    async with open_engine(config) as engine:
        return await tokens_together(engine, prompts, params)


async def llama_cpp(gguf: Path, server: Path, prompts: list[list[int]], tokens: int, threads: int,
                    port: int) -> list[list[int]]:
    """llama-server's greedy tokens on the file (one slot per prompt)."""
    command = [str(server), "-m", str(gguf), "-np", str(len(prompts)), "-c", str(len(prompts) * 512), "-t",
               str(threads), "--host", "127.0.0.1", "--port", str(port)]
    out = []
    with tempfile.NamedTemporaryFile(suffix=".log", delete=False) as log:
        async with served("llama-server", command, port, log.name) as (url, _):
            for prompt in prompts:
                body = {"prompt": prompt, "n_predict": tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                        "cache_prompt": False, "return_tokens": True}
                response = await http.request(url, "POST", "/completion", body)
                out.append(list(response.json()["tokens"]))
    return out


def dequantized_checkpoint(gguf: Path, model_dir: str, workdir: Path) -> Path:
    """What the file means, as an HF checkpoint: its weights dequantized to float32 (HF names and
    layout), beside the original's config."""
    import shutil

    from safetensors.torch import save_file

    from engine.models.gguf_file import gguf_config, gguf_weights

    out = workdir / "dequantized"
    out.mkdir(exist_ok=True)
    shutil.copy(Path(model_dir) / "config.json", out)
    weights = {name: t.contiguous() for name, t in gguf_weights(gguf, gguf_config(gguf))}
    save_file(weights, str(out / "model.safetensors"))
    return out


def kept(reference_tokens: list[int], tokens: list[int]) -> int:
    """Leading tokens equal to the reference's."""
    return next((i for i, (a, b) in enumerate(zip(reference_tokens, tokens, strict=False)) if a != b),
                min(len(reference_tokens), len(tokens)))


def run(model_dir: str, llama_dir: Path, prompts: int, prompt_len: int, tokens: int, threads: int, port: int,
        qtype: str = "Q8_0") -> str:
    workdir = Path(tempfile.mkdtemp(prefix="trio-llm-fidelity-"))
    gguf = convert(model_dir, workdir, llama_dir, qtype)
    formats = "/".join(sorted(set(block_formats(gguf).values())))
    texts = corpus_prompts(model_dir, prompts, prompt_len)
    want = reference(model_dir, texts, tokens)
    sides = {
        f"llama.cpp llama-server ({qtype}, int8 activations)": trio.run(llama_cpp, gguf, llama_dir / "build" / "bin" /
                                                            "llama-server", texts, tokens, threads, port),
        "trio-llm default (the file's blocks; auto)": trio.run(ours, gguf, model_dir, texts, tokens, None, threads),
        "trio-llm --q8-0-activations float32": trio.run(ours, gguf, model_dir, texts, tokens, None, threads, "auto",
                                                        "float32"),
        "trio-llm --quantization int8 (per row)": trio.run(ours, gguf, model_dir, texts, tokens, "int8", threads),
        "trio-llm --kv-cache-dtype float16 (llama.cpp's)": trio.run(ours, gguf, model_dir, texts, tokens, None,
                                                                    threads, "float16"),
        "trio-llm --q8-0-activations int8 (llama.cpp's)": trio.run(ours, gguf, model_dir, texts, tokens, None,
                                                                   threads, "auto", "int8"),
    }
    made = "convert_hf_to_gguf.py" if qtype == "Q8_0" else "convert_hf_to_gguf.py (f32) + llama-quantize"
    lines = [f"{Path(model_dir).name}: {qtype} file ({formats} tensors) by llama.cpp's {made}; {prompts} corpus "
             f"prompts of {prompt_len} tokens; greedy tokens kept, of {tokens}; threads={threads} both sides; "
             f"trio-llm a float32 model, eager, 16 prompts at a time"]
    references = {"transformers' float32 model of the checkpoint": want,
                  "transformers' float32 model of the file's dequantized weights": reference(
                      str(dequantized_checkpoint(gguf, model_dir, workdir)), texts, tokens)}
    for title, wanted in references.items():
        lines += ["", f"kept of {title}", f"{'side':<52}{'kept per prompt':>28}{'mean':>7}"]
        for name, got in sides.items():
            each = [kept(w, g) for w, g in zip(wanted, got, strict=True)]
            lines.append(f"{name:<52}{', '.join(map(str, each)):>28}{sum(each) / len(each):>7.1f}")
    return "\n".join(lines)
