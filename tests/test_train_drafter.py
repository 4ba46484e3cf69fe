"""`specserve train-drafter` end to end on a tiny target: it writes a standard
checkpoint that transformers reads as the same model, resumes from its
checkpoint, and the drafter it makes decodes losslessly."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch

from commands.cli import main as cli_main
from drafter_service.checkpoint import hf_state_dict, load_drafter
from drafter_service.registry import drafter_domains, make_drafter
from runtime import loading
from runtime.gguf_convert import converted_gguf_dir
from speculative.decoding import generate
from runtime.model import Transformer
from speculative.sampling import SamplingParams
from tiny import TINY

QUESTIONS = ["Name three colours.", "What is two plus two?", "Translate 'good morning' to French.",
             "Write one sentence about the sea."]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A small random Llama with SmolLM2's tokenizer, saved as a Hugging Face directory."""
    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp("target")
    tok_dir = converted_gguf_dir(loading.default_gguf_path())
    for f in tok_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    cfg = replace(TINY, vocab_size=49152, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                  head_dim=16, max_position_embeddings=512, tie_word_embeddings=True, eos_token_ids=[2])
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    save_file({k: v.contiguous() for k, v in hf_state_dict(model).items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg.to_hf()))
    return out


def test_train_resume_and_decode_losslessly(tiny_target, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    corpus = tmp_path / "questions.jsonl"
    corpus.write_text("".join(json.dumps({"turns": [q]}) + "\n" for q in QUESTIONS))
    text = tmp_path / "notes.txt"
    text.write_text("Speculative decoding drafts tokens and verifies them. " * 40)
    out = tmp_path / "drafter"
    argv = ["train-drafter", "--target", str(tiny_target), "--corpus", str(corpus), str(text), "--out", str(out),
            "--layers", "1", "--intermediate", "32", "--vocab-trim", "300", "--answer-tokens", "12",
            "--domains", "math", "coding"]
    assert cli_main(argv + ["--minutes", "0.05"]) == 0
    first = json.loads((out / "drafter.json").read_text())["training"]
    assert first["steps"] >= 1 and (out / "work" / "checkpoint.pt").exists()

    # the same command with a larger budget resumes where it stopped
    assert cli_main(argv + ["--minutes", "0.25"]) == 0
    log = capsys.readouterr().out
    assert f"resuming at step {first['steps']}" in log
    info = json.loads((out / "drafter.json").read_text())
    assert info["training"]["steps"] > first["steps"]
    assert info["training"]["command"].startswith("specserve train-drafter")
    assert len(info["vocab_ids"]) <= 300 and 2 in info["vocab_ids"]  # eos is always kept
    assert drafter_domains(str(out)) == ("math", "coding")  # what routing's cold start reads

    # a standard checkpoint: transformers loads it as the same network
    from transformers import AutoModelForCausalLM

    ours, vocab_ids, _ = load_drafter(out)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor([[0, 3, 1, len(vocab_ids), 2]])  # drafter ids; the last row is "any other token"
    cache = ours.new_cache(8)
    with torch.inference_mode():
        mine = ours(ids, torch.arange(5)[None], cache, torch.ones(1, 5, 5, dtype=torch.bool).tril())
        theirs = hf(ids).logits
    assert torch.allclose(mine, theirs, atol=1e-4)

    # and decoding with it (a path is a drafter name) gives exactly the target's greedy tokens
    target, tok = loading.load(str(tiny_target))
    prompt = tok.encode_chat([{"role": "user", "content": QUESTIONS[0]}])
    params = SamplingParams(max_tokens=24)
    plain = generate(target, prompt, params, None).token_ids
    drafted = generate(target, prompt, params, make_drafter(str(out), target), 4)
    assert drafted.token_ids == plain
    assert drafted.draft_tokens > 0


def test_bad_arguments_name_the_flag(capsys):
    assert cli_main(["train-drafter", "--corpus", "x.jsonl", "--out", "o", "--layers", "0"]) == 2
    assert "--layers" in capsys.readouterr().err
    assert cli_main(["train-drafter", "--corpus", "/no/such/file", "--out", "o", "--minutes", "1"]) == 2
    assert "/no/such/file" in capsys.readouterr().err
    assert cli_main(["train-drafter", "--corpus", "x.jsonl", "--out", "o", "--domains", "poetry"]) == 2
    assert "--domains" in capsys.readouterr().err
