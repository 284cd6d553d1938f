"""Pooling: all-MiniLM-L6-v2 embeddings against sentence-transformers, the OpenAI client, score, rerank,
late interaction, cross-encoders, decoders as embedders, and bad input."""

from __future__ import annotations

import base64
import json

import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from bench.http import request
from engine import open_engine
from engine.config import PoolerOptions
from engine.pooling_params import PoolingParams
from tests.conftest import engine_config
from tests.server_fixtures import running_server

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Structured concurrency keeps every task inside a nursery.",
    "A cat sleeps on the warm windowsill in the afternoon sun.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Hi",
]


def reference_embeddings(model_dir: str, texts: list[str]) -> torch.Tensor:
    """sentence-transformers itself, on the checkpoint's own modules (Transformer, mean Pooling,
    Normalize)."""
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(model_dir, device="cpu", local_files_only=True)
    return model.encode(texts, convert_to_tensor=True).float()


@pytest.fixture(scope="session")
def reference(minilm_dir) -> torch.Tensor:
    return reference_embeddings(minilm_dir, SENTENCES)


@pytest.fixture
async def server(minilm_dir):
    async with running_server(engine_config(minilm_dir, num_kv_blocks=None, max_num_seqs=64)) as running:
        yield running


async def embed(server, payload) -> dict:
    response = await request(server.url, "POST", "/v1/embeddings", payload)
    assert response.status == 200, response.body[:300]
    return response.json()


def cosines(vectors, reference: torch.Tensor) -> list[float]:
    got = torch.tensor(vectors, dtype=torch.float32)
    return F.cosine_similarity(got, reference, dim=-1).tolist()


async def test_embeddings_match_the_reference_single_and_batched(server, reference):
    batched = await embed(server, {"input": SENTENCES})
    assert [d["index"] for d in batched["data"]] == list(range(len(SENTENCES)))
    assert min(cosines([d["embedding"] for d in batched["data"]], reference)) >= 0.99999
    for i, sentence in enumerate(SENTENCES):
        single = await embed(server, {"input": sentence})
        assert cosines([single["data"][0]["embedding"]], reference[i:i + 1])[0] >= 0.99999
    assert batched["usage"]["prompt_tokens"] > len(SENTENCES) * 2 and batched["object"] == "list"


async def test_the_openai_client_float_and_base64(server, reference):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    async with client:
        as_float = await client.embeddings.create(model=server.state.model_name, input=SENTENCES,
                                                  encoding_format="float")
        as_b64 = await client.embeddings.create(model=server.state.model_name, input=SENTENCES,
                                                encoding_format="base64")
    floats = [d.embedding for d in as_float.data]
    assert min(cosines(floats, reference)) >= 0.99999
    raw = await embed(server, {"input": SENTENCES[:1], "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, floats[0], atol=1e-6)
    # Asked for explicitly, the client hands base64 back as is: little-endian float32.
    decoded_all = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in as_b64.data]
    assert np.allclose(decoded_all, floats, atol=1e-6)


async def test_bytes_and_embed_dtypes_decode_as_vllm_writes_them(server, reference):
    """encoding_format bytes: the vectors back to back, their places in a `metadata` header;
    bytes_only: no header; embed_dtype and endianness apply to base64 and bytes alike."""
    response = await request(server.url, "POST", "/v1/embeddings",
                             {"input": SENTENCES[:2], "encoding_format": "bytes", "endianness": "big"})
    assert response.status == 200 and response.headers["content-type"] == "application/octet-stream"
    metadata = json.loads(response.headers["metadata"])
    assert metadata["usage"]["prompt_tokens"] > 2 and metadata["model"] == server.state.model_name
    vectors = [np.frombuffer(response.body[item["start"]:item["end"]], dtype=">f4").reshape(item["shape"])
               for item in metadata["data"]]
    assert [item["index"] for item in metadata["data"]] == [0, 1]
    assert min(cosines(np.stack(vectors), reference[:2])) >= 0.99999
    only = await request(server.url, "POST", "/v1/embeddings",
                         {"input": SENTENCES[:2], "encoding_format": "bytes_only", "embed_dtype": "float16"})
    assert "metadata" not in only.headers and len(only.body) == 2 * 384 * 2
    halves = np.frombuffer(only.body, dtype="<f2").reshape(2, 384).astype(np.float32)
    assert min(cosines(halves, reference[:2])) >= 0.9999
    as_bf16 = await embed(server, {"input": SENTENCES[:1], "encoding_format": "base64", "embed_dtype": "bfloat16"})
    words = np.frombuffer(base64.b64decode(as_bf16["data"][0]["embedding"]), dtype="<i2").copy()
    widened = torch.from_numpy(words).view(torch.bfloat16).float()
    assert cosines(widened.unsqueeze(0).tolist(), reference[:1])[0] >= 0.999
    bad = await request(server.url, "POST", "/v1/embeddings", {"input": "x", "embed_dtype": "int4"})
    assert bad.status == 400 and bad.json()["error"]["param"] == "embed_dtype"


async def test_token_ids_truncation_and_bad_input(server, minilm_dir):
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(minilm_dir)(SENTENCES[1])["input_ids"]
    by_ids = await embed(server, {"input": ids})
    by_text = await embed(server, {"input": SENTENCES[1]})
    assert cosines([by_ids["data"][0]["embedding"]], torch.tensor([by_text["data"][0]["embedding"]]))[0] > 0.99999
    long_text = "word " * 600
    cut = await embed(server, {"input": long_text, "truncate_prompt_tokens": 16})
    assert cut["usage"]["prompt_tokens"] == 16
    bad = {
        "empty input": ({"input": []}, "input"),
        "empty string": ({"input": ["fine", ""]}, "input"),
        "too long": ({"input": long_text}, "input"),
        "out of vocabulary": ({"input": [101, 999999, 102]}, "prompt"),
        "no matryoshka": ({"input": "x", "dimensions": 8}, "dimensions"),
        "bad format": ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    }
    for name, (payload, param) in bad.items():
        response = await request(server.url, "POST", "/v1/embeddings", payload)
        assert response.status == 400 and response.json()["error"]["param"] == param, (name, response.body[:200])
    assert (await embed(server, {"input": "still serving"}))["data"]


async def test_generation_endpoints_answer_400_on_an_encoder(server):
    response = await request(server.url, "POST", "/v1/completions", {"prompt": "hello"})
    assert response.status == 400 and "pooling model" in response.json()["error"]["message"]
    chat = await request(server.url, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert chat.status == 400


async def test_score_is_the_cosine_of_the_embeddings_and_symmetric(server, reference):
    for path in ("/score", "/v1/score"):
        response = await request(server.url, "POST", path, {"queries": SENTENCES[0], "documents": SENTENCES[1:3]})
        scores = [d["score"] for d in response.json()["data"]]
        expected = [float(reference[0] @ reference[i]) for i in (1, 2)]
        assert scores == pytest.approx(expected, abs=1e-5)
    forward = await request(server.url, "POST", "/score", {"text_1": SENTENCES[2], "text_2": SENTENCES[3]})
    backward = await request(server.url, "POST", "/score", {"text_1": SENTENCES[3], "text_2": SENTENCES[2]})
    assert forward.json()["data"][0]["score"] == pytest.approx(backward.json()["data"][0]["score"], abs=1e-6)
    expected = forward.json()["data"][0]["score"]
    for first, second in (("queries", "items"), ("data_1", "data_2")):  # vLLM 0.32's names, and older ones
        named = await request(server.url, "POST", "/score", {first: SENTENCES[2], second: SENTENCES[3]})
        assert named.json()["data"][0]["score"] == pytest.approx(expected, abs=1e-6)
    both = await request(server.url, "POST", "/score", {"queries": "a", "text_1": "b", "items": "c"})
    assert both.status == 400 and "give one of queries, text_1, data_1" in both.json()["error"]["message"]


async def test_rerank_orders_by_relevance(server, reference):
    documents = SENTENCES[1:]
    response = await request(server.url, "POST", "/v1/rerank",
                             {"query": SENTENCES[0], "documents": documents, "top_n": 3})
    results = response.json()["results"]
    expected = sorted(range(len(documents)), key=lambda i: float(reference[0] @ reference[i + 1]), reverse=True)
    assert [r["index"] for r in results] == expected[:3]
    assert [r["relevance_score"] for r in results] == sorted((r["relevance_score"] for r in results), reverse=True)
    assert results[0]["document"]["text"] == documents[expected[0]]
    cohere_v2 = await request(server.url, "POST", "/v2/rerank",
                              {"query": SENTENCES[0], "documents": documents, "top_n": 3})
    assert cohere_v2.json()["results"] == results
    plain = await request(server.url, "POST", "/rerank", {"query": "x", "documents": documents,
                                                           "return_documents": False})
    assert len(plain.json()["results"]) == len(documents) and "document" not in plain.json()["results"][0]


async def test_late_interaction_is_max_sim_over_token_embeddings(server):
    query, document = SENTENCES[1], SENTENCES[3]
    tokens = await request(server.url, "POST", "/pooling", {"input": [query, document], "task": "token_embed"})
    q, d = (torch.tensor(item["data"]) for item in tokens.json()["data"])
    expected = float((q @ d.T).max(dim=1).values.sum())
    scored = await request(server.url, "POST", "/score", {"queries": query, "documents": [document, query],
                                                          "score_type": "late-interaction"})
    scores = [item["score"] for item in scored.json()["data"]]
    assert scores[0] == pytest.approx(expected, rel=1e-5)
    assert scores[1] == pytest.approx(q.shape[0], rel=1e-4)  # a normalized text against itself: 1 per token
    cross = await request(server.url, "POST", "/score", {"queries": "a", "documents": "b",
                                                         "score_type": "cross-encoder"})
    assert cross.status == 400 and cross.json()["error"]["param"] == "score_type"


def make_colbert(path, tokenizer_dir: str):
    """A tiny ColBERT as colbert-ai saves one: `HF_ColBERT`, `bert.`-prefixed weights, a bias-free
    `linear` projection, and no projection size in config.json. Returns (BertModel, projection)."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoTokenizer, BertConfig, BertModel
    torch.manual_seed(1)
    bert = BertModel(BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=128), add_pooling_layer=False).eval()
    projection = torch.randn(24, 64) / 8
    weights = {f"bert.{name}": tensor.contiguous() for name, tensor in bert.state_dict().items()}
    save_file({**weights, "linear.weight": projection}, str(path / "model.safetensors"))
    config = bert.config.to_dict() | {"architectures": ["HF_ColBERT"]}
    (path / "config.json").write_text(json.dumps(config))
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return bert, projection


async def test_a_colbert_model_scores_by_late_interaction_from_its_config(tmp_path, minilm_dir):
    from transformers import AutoTokenizer
    bert, projection = make_colbert(tmp_path, minilm_dir)
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)

    def reference_tokens(text: str) -> torch.Tensor:
        with torch.inference_mode():
            hidden = bert(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
        return F.normalize(hidden @ projection.T, dim=-1)

    query, documents = SENTENCES[1], [SENTENCES[3], SENTENCES[0]]
    async with running_server(engine_config(str(tmp_path), num_kv_blocks=None)) as colbert:
        tokens = await request(colbert.url, "POST", "/pooling", {"input": query, "task": "token_embed"})
        got = torch.tensor(tokens.json()["data"][0]["data"])
        assert got.shape[1] == 24 and torch.allclose(got, reference_tokens(query), atol=1e-5)
        scored = await request(colbert.url, "POST", "/score", {"queries": query, "documents": documents})
        q = reference_tokens(query)
        expected = [float((q @ reference_tokens(d).T).max(dim=1).values.sum()) for d in documents]
        assert [d["score"] for d in scored.json()["data"]] == pytest.approx(expected, rel=1e-5)
        reranked = await request(colbert.url, "POST", "/rerank", {"query": query, "documents": documents})
        assert [r["index"] for r in reranked.json()["results"]] == sorted(
            range(2), key=lambda i: expected[i], reverse=True)
        single = await request(colbert.url, "POST", "/v1/embeddings", {"input": query})
        assert single.status == 400 and "late-interaction" in single.json()["error"]["message"]
        cosine = await request(colbert.url, "POST", "/score", {"queries": query, "documents": documents,
                                                               "score_type": "embedding"})
        assert cosine.status == 400 and cosine.json()["error"]["param"] == "score_type"


async def test_a_cross_encoder_scores_pairs_with_its_head(tmp_path, minilm_dir):
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, num_labels=1)
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    tokenizer.save_pretrained(tmp_path)
    pairs = [(SENTENCES[0], SENTENCES[2]), (SENTENCES[1], SENTENCES[3])]
    from sentence_transformers import CrossEncoder
    cross_encoder = CrossEncoder(str(tmp_path), device="cpu", local_files_only=True)
    expected = cross_encoder.predict(pairs).tolist()  # with its activation: a sigmoid for one label
    async with running_server(engine_config(str(tmp_path), num_kv_blocks=None)) as cross_server:
        response = await request(cross_server.url, "POST", "/score",
                                 {"queries": [a for a, _ in pairs], "documents": [b for _, b in pairs]})
        assert [d["score"] for d in response.json()["data"]] == pytest.approx(expected, abs=1e-5)
        reranked = await request(cross_server.url, "POST", "/rerank",
                                 {"query": SENTENCES[0], "documents": SENTENCES[1:4]})
        assert len(reranked.json()["results"]) == 3


async def test_a_decoder_embeds_with_last_token_pooling(tiny_model_dir):
    async with open_engine(engine_config(tiny_model_dir)) as engine:
        prompts = [[5, 17, 99, 3], list(range(40, 80))]
        pooled = await engine.encode(prompts, PoolingParams(task="embed"))
        per_token = await engine.encode(prompts, PoolingParams(task="token_embed"))
        for vector, tokens, prompt in zip(pooled, per_token, prompts, strict=True):
            assert tokens.data.shape == (len(prompt), engine.info.hidden_size)
            assert torch.allclose(vector.data, tokens.data[-1], atol=1e-5)
            assert vector.data.norm().item() == pytest.approx(1.0, abs=1e-5)
        assert engine.core.scheduler.kv.usage == 0  # no blocks kept after the step


async def test_decoder_pooling_is_selectable(tiny_model_dir):
    prompt = list(range(10, 30))
    async with open_engine(engine_config(tiny_model_dir, pooling_type="mean")) as engine:
        (mean,) = await engine.encode([prompt])
        (raw,) = await engine.encode([prompt], PoolingParams(task="token_embed", normalize=False))
    assert torch.allclose(mean.data, F.normalize(raw.data.mean(dim=0), dim=-1), atol=1e-5)
    assert not torch.allclose(mean.data, F.normalize(raw.data[-1], dim=-1), atol=1e-3)  # not the last token


def test_the_blocking_facade_embeds(minilm_dir, reference):
    from engine import LLM
    llm = LLM(minilm_dir, num_kv_blocks=64)
    outputs = llm.embed(SENTENCES[:2])
    got = torch.stack([o.data for o in outputs])
    assert F.cosine_similarity(got, reference[:2], dim=-1).min().item() >= 0.99999


async def test_classify_answers_as_vllm_with_the_heads_labels(tmp_path, minilm_dir):
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification
    torch.manual_seed(1)
    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, num_labels=3, id2label={0: "neg", 1: "neu", 2: "pos"},
                        label2id={"neg": 0, "neu": 1, "pos": 2})
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    tokenizer.save_pretrained(tmp_path)
    with torch.inference_mode():
        expected = torch.softmax(model(**tokenizer(SENTENCES[:2], padding=True, return_tensors="pt")).logits, -1)
    async with running_server(engine_config(str(tmp_path), num_kv_blocks=None)) as server:
        response = await request(server.url, "POST", "/classify", {"input": SENTENCES[:2]})
        assert response.status == 200, response.body
        data = response.json()["data"]
        assert [d["probs"] for d in data] == [pytest.approx(row, abs=1e-5) for row in expected.tolist()]
        assert [d["label"] for d in data] == [config.id2label[int(i)] for i in expected.argmax(-1)]
        assert data[0]["num_classes"] == 3 and response.json()["usage"]["prompt_tokens"] > 0
        raw = await request(server.url, "POST", "/classify", {"input": SENTENCES[:2], "use_activation": False})
        logits = torch.tensor([d["probs"] for d in raw.json()["data"]])  # use_activation false: the logits
        assert torch.allclose(torch.softmax(logits, -1), expected, atol=1e-5)
        assert not torch.allclose(logits.sum(-1), torch.ones(2), atol=1e-3)
        pooled = await request(server.url, "POST", "/pooling", {"input": SENTENCES[:2], "task": "classify"})
        assert [d["data"] for d in pooled.json()["data"]] == [pytest.approx(r, abs=1e-5) for r in expected.tolist()]
        embed = await request(server.url, "POST", "/v1/embeddings", {"input": "a classifier"})
        assert embed.status == 400 and embed.json()["error"]["message"].startswith(
            "Try switching the model's pooling_task via --pooler-config")
    switched = engine_config(str(tmp_path), num_kv_blocks=None, pooler_config=PoolerOptions(task="embed"))
    async with running_server(switched) as embedder:
        vector = await request(embedder.url, "POST", "/v1/embeddings", {"input": "a classifier"})
        assert len(vector.json()["data"][0]["embedding"]) == 64
        refused = await request(embedder.url, "POST", "/classify", {"input": "no longer"})
        assert refused.json()["error"]["message"].startswith("Try switching the model's pooling_task via")
    async with running_server(engine_config(str(minilm_dir), num_kv_blocks=None)) as plain:
        refused = await request(plain.url, "POST", "/classify", {"input": "no head"})
        assert refused.status == 400 and refused.json()["error"]["type"] == "BadRequestError"
        assert refused.json()["error"]["message"].startswith("Unsupported task: 'classify' Supported tasks: "
                                                             "['embed', 'token_embed']")


async def test_embeddings_take_chat_messages_and_normalize(tiny_model_dir):
    async with running_server(engine_config(tiny_model_dir)) as server:
        messages = [{"role": "user", "content": "embed this conversation"}]
        chat = await request(server.url, "POST", "/v1/embeddings", {"messages": messages})
        assert chat.status == 200, chat.body
        tokenized = await request(server.url, "POST", "/tokenize", {"messages": messages,
                                                                    "add_generation_prompt": False})
        assert chat.json()["usage"]["prompt_tokens"] == tokenized.json()["count"]
        raw = await request(server.url, "POST", "/v1/embeddings", {"input": "abc", "normalize": False})
        unit = await request(server.url, "POST", "/v1/embeddings", {"input": "abc", "normalize": True})
        norm = sum(v * v for v in unit.json()["data"][0]["embedding"]) ** 0.5
        raw_norm = sum(v * v for v in raw.json()["data"][0]["embedding"]) ** 0.5
        assert abs(norm - 1) < 1e-4 and abs(raw_norm - 1) > 1e-3
        both = await request(server.url, "POST", "/v1/embeddings", {"input": "x", "messages": messages})
        assert both.status == 400
        activated = await request(server.url, "POST", "/v1/embeddings", {"input": "abc", "use_activation": False})
        assert activated.json()["data"][0]["embedding"] == raw.json()["data"][0]["embedding"]
        disagree = await request(server.url, "POST", "/v1/embeddings", {"input": "abc", "normalize": True,
                                                                         "use_activation": False})
        assert disagree.status == 400 and disagree.json()["error"]["param"] == "use_activation"


async def test_padding_to_max_length_pads_with_the_pad_token(server):
    plain = await embed(server, {"input": SENTENCES[0]})
    padded = await embed(server, {"input": SENTENCES[0], "padding": "max_length"})
    limit = server.state.engine.processor.pooling_input_limit
    assert padded["usage"]["prompt_tokens"] == limit > plain["usage"]["prompt_tokens"]
    assert padded["data"][0]["embedding"] != plain["data"][0]["embedding"]  # mean pooling counts the pads
    same = await embed(server, {"input": SENTENCES[0], "padding": "do_not_pad"})
    assert same["data"][0]["embedding"] == plain["data"][0]["embedding"]


async def test_cohere_v2_embed_answers_in_cohere_shape(server):
    texts = SENTENCES[:2]
    openai_vectors = [d["embedding"] for d in (await embed(server, {"input": texts}))["data"]]
    response = await request(server.url, "POST", "/v2/embed", {
        "model": server.state.model_name, "texts": texts, "embedding_types": ["float", "base64", "binary", "ubinary"]})
    assert response.status == 200, response.body[:300]
    body = response.json()
    assert body["texts"] == texts and body["meta"]["api_version"] == {"version": "2"}
    assert body["meta"]["tokens"]["input_tokens"] > 0 and body["id"].startswith("embd-")
    floats = body["embeddings"]["float"]
    assert [pytest.approx(v, abs=1e-6) for v in openai_vectors] == floats
    decoded = [np.frombuffer(base64.b64decode(b), dtype="<f4").tolist() for b in body["embeddings"]["base64"]]
    assert decoded == [pytest.approx(v, abs=1e-6) for v in floats]
    for vector, unsigned, signed in zip(floats, body["embeddings"]["ubinary"], body["embeddings"]["binary"],
                                        strict=True):
        bits = np.unpackbits(np.array(unsigned, dtype=np.uint8)).tolist()
        assert bits == [int(x >= 0) for x in vector] and signed == [u - 128 for u in unsigned]
    long_text = " ".join(SENTENCES) * 3
    ends = {}
    for side in ("END", "START"):
        cut = await request(server.url, "POST", "/v2/embed", {"texts": [long_text], "truncate": side, "max_tokens": 8})
        ends[side] = cut.json()["embeddings"]["float"][0]
        assert cut.json()["meta"]["tokens"]["input_tokens"] == 8
    assert ends["END"] != ends["START"]
    over = await request(server.url, "POST", "/v2/embed", {"texts": [long_text], "truncate": "NONE", "max_tokens": 8})
    assert over.status == 400 and "truncate=NONE" in over.json()["error"]["message"]
    typed = await request(server.url, "POST", "/v2/embed", {"texts": texts, "input_type": "search_query"})
    assert typed.status == 400 and typed.json()["error"]["param"] == "input_type"
    images = await request(server.url, "POST", "/v2/embed", {"images": ["data:image/png;base64,AA=="]})
    assert images.status == 400 and images.json()["error"]["param"] == "images"


def test_input_type_prefixes_come_from_the_models_config(tmp_path):
    from web.pooling.cohere import read_prefixes
    assert read_prefixes(tmp_path) == {}
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"query": "q: "}}))
    assert read_prefixes(tmp_path) == {"query": "q: "}
    (tmp_path / "config.json").write_text(json.dumps({"task_instructions": {"search_document": "doc: "}}))
    assert read_prefixes(tmp_path) == {"search_document": "doc: "}
