"""Distil a small drafter from a target model: `specserve train-drafter`.

Sized for a CPU:
1. Data (`corpus.py`): prompts followed by the target's own greedy answers,
   and plain text; the target's top-k next-token distribution at every
   position, computed once.
2. Student: the target's embedding rows for the corpus's most frequent
   tokens (VocabTrim; one extra row stands for all other tokens on input),
   the target's first `layers` decoder layers with their MLPs cut to the
   `intermediate` strongest neurons, the target's final norm, and the head
   tied to the embedding. Starting from the target's own weights is what
   makes minutes of CPU training enough. (With a different `hidden` size the
   embedding is the target's projected on its top principal directions and
   the layers start fresh.)
3. Training: forward KL to the teacher's top-k, restricted to the kept
   vocabulary, on answer and text positions (prompt positions count
   `prompt_weight`); AdamW with a cosine schedule over the time budget.
   Every checkpoint interval the top-1 agreement with the target on held-out
   answers is measured, and the best state is what gets written (early
   stopping: a few hundred prompts are quickly overfitted).

Everything is cached in OUT/work: rerunning the same command resumes from
the last checkpoint (written every `checkpoint_s`) instead of starting over.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from runtime import loading
from runtime.cache import cache_root
from runtime.config import ModelConfig
from runtime.cpu_tuning import CpuTuning
from speculative.domains import DOMAINS
from runtime.model import Transformer

from .checkpoint import load_drafter, save_drafter
from .corpus import answer_with_teacher, corpus_files, read_corpus, teacher_top_k

INIT_STD = 0.02  # weights not copied from the target start at N(0, INIT_STD^2), as Llama's initializer_range
WEIGHT_DECAY = 0.01  # torch AdamW's default, written out
WARMUP_STEPS = 20  # linear learning-rate warm-up before the cosine decay
# a position whose teacher mass on the drafter's trimmed vocabulary is below this is not trained on:
# its target is mostly tokens the drafter cannot propose
MIN_TEACHER_MASS = 0.05


@dataclass
class TrainConfig:
    target: str | None
    corpus: list[str]
    out: str
    layers: int = 2
    hidden: int | None = None        # None: the target's (weights copied from it)
    intermediate: int = 512          # MLP width of each drafter layer
    vocab_trim: int = 6144           # tokens the drafter can propose (0: the target's whole vocabulary)
    minutes: float = 30.0            # training time budget (data preparation not included)
    init: str | None = None          # start from this drafter checkpoint instead of the target
    answer_tokens: int = 128         # length of the target's answers to corpus prompts
    max_prompt_tokens: int = 1536
    window: int = 512                # plain text window, tokens
    top_k: int = 32                  # teacher probabilities kept per position
    prompt_weight: float = 0.25
    lr: float = 5e-4
    tokens_per_step: int = 4096
    checkpoint_s: float = 60.0
    seed: int = 0
    eval_fraction: float = 0.1       # held-out sequences: progress report and early stopping
    domains: list[str] = field(default_factory=list)  # what it specialises in: routing's cold-start prior
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        checks = [("layers", self.layers >= 1), ("intermediate", self.intermediate >= 1),
                  ("vocab_trim", self.vocab_trim >= 0), ("minutes", self.minutes > 0),
                  ("hidden", self.hidden is None or self.hidden >= 64), ("corpus", bool(self.corpus))]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')}: invalid value {getattr(self, name)!r}")
        unknown = [d for d in self.domains if d not in DOMAINS]
        if unknown:
            raise ValueError(f"--domains: unknown domain(s) {', '.join(unknown)}; known: {', '.join(DOMAINS)}")


# ---- data -------------------------------------------------------------------

def prepare_data(cfg: TrainConfig, target: Transformer, tokenizer, log, cache_dir: str | None = None) -> list[dict]:
    """Sequences with teacher targets. Each is cached on its own under the
    specserve cache (`cache_dir`, keyed by target, tokens and settings), so drafters trained
    on overlapping corpora, and reruns, compute the target's work once."""
    prompts, texts = read_corpus(corpus_files(cfg.corpus), tokenizer, cfg.window)
    skipped = [p for p in prompts if not 2 <= len(p) <= cfg.max_prompt_tokens]
    prompts = [p for p in prompts if 2 <= len(p) <= cfg.max_prompt_tokens]
    log(f"data: {len(prompts)} prompts ({len(skipped)} longer than --max-prompt-tokens skipped), "
        f"{len(texts)} text windows")
    store = cache_root(cache_dir) / "distill" / _target_key(cfg.target)
    store.mkdir(parents=True, exist_ok=True)

    def key(kind: str, tokens: list[int]) -> Path:
        digest = hashlib.sha256(f"{kind}:{cfg.answer_tokens}:{cfg.top_k}:{tokens}".encode()).hexdigest()
        return store / f"{digest[:24]}.pt"

    todo = [p for p in prompts if not key("prompt", p).exists()]
    if todo:
        eos = set(tokenizer.eos_token_ids or target.config.eos_token_ids)
        with tqdm(total=len(todo), desc="target answers", unit="prompt") as bar:
            def done(i: int, item: dict) -> None:
                _save(key("prompt", todo[i]), item)
                bar.update()
            answer_with_teacher(target, todo, cfg.answer_tokens, eos, cfg.top_k, on_done=done)
    for t in tqdm([t for t in texts if not key("text", t).exists()], desc="teacher on text", unit="window"):
        ids, probs = teacher_top_k(target, t, cfg.top_k)
        _save(key("text", t), {"tokens": torch.tensor(t, dtype=torch.int32), "answer_from": 0,
                               "top_ids": ids, "top_probs": probs})
    return [torch.load(key("prompt", p)) for p in prompts] + [torch.load(key("text", t)) for t in texts]


def _save(path: Path, item: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(item, tmp)
    tmp.replace(path)  # a run killed mid-write leaves no torn file


def _target_key(source: str | None) -> str:
    path = loading.resolve_source(source)
    weights = path if path.is_file() else path / "config.json"
    stamp = f"{path.resolve()}:{weights.stat().st_size}:{weights.stat().st_mtime_ns}"
    return hashlib.sha256(stamp.encode()).hexdigest()[:16]


def position_weights(item: dict, prompt_weight: float) -> torch.Tensor:
    """Loss weight of each position's next-token prediction (the last has no target)."""
    n = len(item["tokens"])
    w = torch.full((n,), prompt_weight)
    w[max(item["answer_from"] - 1, 0):] = 1.0
    w[-1] = 0.0
    return w


def choose_vocab(items: list[dict], size: int, always: list[int], prompt_weight: float) -> list[int]:
    """The `size` target tokens the teacher predicts most (weighted like the loss), plus `always`."""
    counts: Counter = Counter()
    for it in items:
        w = position_weights(it, prompt_weight)
        for tok, weight in zip(it["top_ids"][:, 0].tolist(), w.tolist()):
            counts[tok] += weight
    keep = set(always)
    for tok, _ in counts.most_common():
        if len(keep) >= size:
            break
        keep.add(tok)
    return sorted(keep)


# ---- student ----------------------------------------------------------------

def build_student(cfg: TrainConfig, target: Transformer, vocab_ids: list[int] | None) -> Transformer:
    t = target.config
    rows = torch.tensor(vocab_ids) if vocab_ids is not None else torch.arange(t.vocab_size)
    hidden = cfg.hidden or t.hidden_size
    copy = hidden == t.hidden_size
    heads = t.num_heads if copy else max(1, hidden // t.head_dim)
    kv_heads = t.num_kv_heads if copy else heads
    scfg = ModelConfig(
        vocab_size=len(rows) + (vocab_ids is not None), hidden_size=hidden,
        intermediate_size=min(cfg.intermediate, t.intermediate_size) if copy else cfg.intermediate,
        num_layers=cfg.layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=t.head_dim,
        rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta, rope_scaling=t.rope_scaling,
        max_position_embeddings=t.max_position_embeddings, tie_word_embeddings=True, model_type="llama")
    torch.manual_seed(cfg.seed)
    student = Transformer(scfg)
    for p in student.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=INIT_STD)
    with torch.no_grad():
        emb = target.embed.weight.float()
        if not copy:  # the target's embedding on its top principal directions
            emb = emb @ torch.linalg.svd(emb - emb.mean(0), full_matrices=False).Vh[:hidden].T
        student.embed.weight[:len(rows)] = emb[rows]
        if vocab_ids is not None:  # the "any other token" row: the mean of the rest
            student.embed.weight[-1] = emb.mean(0)
        if copy:
            student.norm.weight.copy_(target.norm.weight)
            for mine, theirs in zip(student.layers, target.layers):
                _copy_layer(mine, theirs, scfg.intermediate_size)
    return student


def _copy_layer(mine, theirs, width: int) -> None:
    """Copy a target layer, keeping the `width` MLP neurons with the largest output."""
    gate, up = theirs.mlp.gate_up.weight.chunk(2)
    down = theirs.mlp.down.weight
    keep = torch.topk(down.norm(dim=0) * up.norm(dim=1) * gate.norm(dim=1), width).indices.sort().values
    mine.attn_norm.weight.copy_(theirs.attn_norm.weight)
    mine.mlp_norm.weight.copy_(theirs.mlp_norm.weight)
    mine.attn.qkv.weight.copy_(theirs.attn.qkv.weight)
    if theirs.attn.qkv.bias is not None and mine.attn.qkv.bias is not None:
        mine.attn.qkv.bias.copy_(theirs.attn.qkv.bias)
    mine.attn.o.weight.copy_(theirs.attn.o.weight)
    mine.mlp.gate_up.weight.copy_(torch.cat((gate[keep], up[keep])))
    mine.mlp.down.weight.copy_(down[:, keep])


def student_logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Causal logits [B, T, V] with gradients (the serving forward is inference-only)."""
    b, t = tokens.shape
    cfg = model.config
    x = model.embed(tokens)
    cos = model.rope_cos[:t][None, None].to(x.dtype)
    sin = model.rope_sin[:t][None, None].to(x.dtype)
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
    for layer in model.layers:
        k = torch.zeros(b, cfg.num_kv_heads, t, cfg.head_dim)
        v = torch.zeros(b, cfg.num_kv_heads, t, cfg.head_dim)
        x = layer(x, cos, sin, k, v, [0] * b, mask)
    return model.lm_head(model.norm(x))


class Batch:
    """One sequence in the student's vocabulary with its teacher targets."""

    def __init__(self, item: dict, to_student: torch.Tensor, unk: int | None, prompt_weight: float):
        self.tokens = to_student[item["tokens"].long()][None]
        ids = to_student[item["top_ids"].long()]
        probs = item["top_probs"].float()
        if unk is not None:  # the teacher's mass on tokens the drafter cannot propose is dropped
            probs = torch.where(ids == unk, 0.0, probs)
        mass = probs.sum(-1, keepdim=True)
        self.top_ids, self.top_probs = ids, probs / mass.clamp_min(1e-9)
        self.weights = position_weights(item, prompt_weight) * (mass[:, 0] > MIN_TEACHER_MASS)
        self.answer = torch.zeros_like(self.weights, dtype=torch.bool)
        self.answer[max(item["answer_from"] - 1, 0):-1] = True


def distill_loss(model: Transformer, batch: Batch) -> tuple[torch.Tensor, float, float]:
    """(weighted forward KL up to a constant, sum of weights, top-1 agreements on answer positions)."""
    logp = F.log_softmax(student_logits(model, batch.tokens)[0].float(), dim=-1)
    ce = -(batch.top_probs * logp.gather(-1, batch.top_ids)).sum(-1)
    agree = (logp.argmax(-1) == batch.top_ids[:, 0]) & batch.answer
    return (ce * batch.weights).sum(), float(batch.weights.sum()), float(agree.sum())


def evaluate(model: Transformer, batches: list[Batch]) -> float:
    """Top-1 agreement with the target on answer positions of held-out sequences."""
    agree = total = 0.0
    with torch.no_grad():
        for b in batches:
            agree += distill_loss(model, b)[2]
            total += float(b.answer.sum())
    return agree / max(total, 1.0)


# ---- the command -------------------------------------------------------------

def train(cfg: TrainConfig, log=print, *, cache_dir: str | None = None, cpu_tuning: CpuTuning = CpuTuning()) -> Path:
    """Train the drafter `cfg` asks for; the target is loaded tuned by `cpu_tuning`, and
    converted models and the target's answers are cached under `cache_dir` (`runtime.cache.cache_root`)."""
    cfg.validate()
    out = Path(cfg.out)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    target, tokenizer = loading.load(cfg.target, cache_dir=cache_dir, cpu_tuning=cpu_tuning)
    items = prepare_data(cfg, target, tokenizer, log, cache_dir)
    if not items:
        raise ValueError("--corpus: no training text found")
    eval_items = [it for it in items if _held_out(it, cfg.eval_fraction)]
    train_items = [it for it in items if not _held_out(it, cfg.eval_fraction)] or items

    ckpt_path = work / "checkpoint.pt"
    state = torch.load(ckpt_path, weights_only=False) if ckpt_path.exists() else None
    if state is not None and state["config"] != _resume_key(cfg):
        log("checkpoint: settings changed, starting over")
        state = None
    if state is not None:
        vocab_ids, student = state["vocab_ids"], Transformer(ModelConfig(**state["model_config"]))
        student.load_state_dict(state["model"])
        log(f"checkpoint: resuming at step {state['step']} ({state['elapsed'] / 60:.1f} min trained)")
    elif cfg.init:
        student, vocab_ids, _ = load_drafter(cfg.init)
        log(f"init: from drafter {cfg.init}")
    else:
        eos = tokenizer.eos_token_ids or target.config.eos_token_ids
        vocab_ids = (choose_vocab(train_items, cfg.vocab_trim, eos, cfg.prompt_weight)
                     if 0 < cfg.vocab_trim < target.config.vocab_size else None)
        student = build_student(cfg, target, vocab_ids)
    target_vocab = target.config.vocab_size
    del target  # frees memory; the teacher is in the cached data
    student.train()
    to_student = _student_map(vocab_ids, target_vocab)
    unk = None if vocab_ids is None else len(vocab_ids)
    batches = [Batch(it, to_student, unk, cfg.prompt_weight) for it in train_items]
    evals = [Batch(it, to_student, unk, cfg.prompt_weight) for it in eval_items]
    opt = torch.optim.AdamW(student.parameters(), lr=cfg.lr, weight_decay=WEIGHT_DECAY)
    step, elapsed = 0, 0.0
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        step, elapsed = state["step"], state["elapsed"]
    rng = random.Random(cfg.seed + step)
    budget = cfg.minutes * 60
    before = evaluate(student, evals) if state is None else state["agreement_before"]
    log(f"top-1 agreement with the target on held-out answers before training: {before:.3f}")
    # early stopping: a few hundred prompts are easy to overfit, so the drafter
    # written is the one that agreed best with the target on held-out answers
    best = state["best"] if state is not None else {"agreement": before, "step": step, "model": _copy(student)}
    last_ckpt = time.monotonic()
    bar = tqdm(total=round(budget), initial=min(round(elapsed), round(budget)), desc="distilling", unit="s")
    while elapsed < budget:
        t0 = time.monotonic()
        for g in opt.param_groups:  # cosine over the time budget, short warm-up
            g["lr"] = cfg.lr * min(1.0, (step + 1) / WARMUP_STEPS) * 0.5 * (1 + math.cos(math.pi * elapsed / budget))
        opt.zero_grad()
        loss_sum = weight = agree = answer = seen = 0.0
        while seen < cfg.tokens_per_step:  # counts positions, so a step ends even where weights are 0
            b = rng.choice(batches)
            loss, w, a = distill_loss(student, b)
            (loss / cfg.tokens_per_step).backward()
            loss_sum, weight, agree, answer = loss_sum + loss.item(), weight + w, agree + a, answer + float(b.answer.sum())
            seen += b.tokens.shape[1]
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        step += 1
        dt = time.monotonic() - t0
        elapsed += dt
        bar.update(min(round(elapsed), round(budget)) - bar.n)
        bar.set_postfix(loss=f"{loss_sum / max(weight, 1e-9):.3f}", agree=f"{agree / max(answer, 1):.3f}", step=step)
        if time.monotonic() - last_ckpt > cfg.checkpoint_s or elapsed >= budget:
            held_out = evaluate(student, evals)
            if held_out > best["agreement"]:
                best = {"agreement": held_out, "step": step, "model": _copy(student)}
            bar.write(f"step {step}: held-out agreement {held_out:.3f} (best {best['agreement']:.3f} at step {best['step']})")
            _save_checkpoint(ckpt_path, cfg, student, opt, vocab_ids, step, elapsed, before, best)
            last_ckpt = time.monotonic()
    bar.close()
    student.load_state_dict(best["model"])
    student.eval()
    after = best["agreement"]
    log(f"top-1 agreement after {elapsed / 60:.1f} min, {step} steps: {after:.3f} (kept step {best['step']})")
    info = {"target": {"source": cfg.target or loading.DEFAULT_MODEL, "vocab_size": target_vocab},
            "domains": list(cfg.domains),
            "training": {**{k: v for k, v in asdict(cfg).items() if k not in ("out", "extra", "domains")},
                         "steps": step, "kept_step": best["step"], "minutes_trained": round(elapsed / 60, 2),
                         "sequences": len(train_items), "eval_sequences": len(eval_items),
                         "train_positions": int(sum(len(it["tokens"]) for it in train_items)),
                         "top1_agreement_before": round(before, 4), "top1_agreement_after": round(after, 4),
                         **cfg.extra}}
    if vocab_ids is not None:
        info["training"]["vocab_coverage"] = round(_coverage(items, vocab_ids), 4)
    save_drafter(student, vocab_ids, out, info)
    log(f"wrote {out}")
    return out


def _student_map(vocab_ids: list[int] | None, target_vocab: int) -> torch.Tensor:
    """target token id -> student token id (the last row for tokens it does not keep)."""
    if vocab_ids is None:
        return torch.arange(target_vocab)
    m = torch.full((target_vocab,), len(vocab_ids), dtype=torch.long)
    m[torch.tensor(vocab_ids)] = torch.arange(len(vocab_ids))
    return m


def _coverage(items: list[dict], vocab_ids: list[int]) -> float:
    """Fraction of the target's answer tokens the trimmed vocabulary can propose."""
    keep = set(vocab_ids)
    answer = [t for it in items for t in it["tokens"][it["answer_from"]:].tolist()]
    return sum(t in keep for t in answer) / max(len(answer), 1)


def _resume_key(cfg: TrainConfig) -> dict:
    return {k: v for k, v in asdict(cfg).items() if k not in ("minutes", "out", "extra", "checkpoint_s")}


def _held_out(item: dict, fraction: float) -> bool:
    """Whether a sequence is held out, decided by its prompt alone: the same
    prompts are held out in every run, so a drafter specialised from another
    is judged on prompts neither was trained on."""
    key = item["tokens"][:item["answer_from"]] if item["answer_from"] else item["tokens"]  # prompt, or text
    return int.from_bytes(hashlib.sha256(key.numpy().tobytes()).digest()[:8], "big") / 2**64 < fraction


def _copy(model: Transformer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _save_checkpoint(path: Path, cfg, student, opt, vocab_ids, step, elapsed, before, best) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"config": _resume_key(cfg), "model_config": asdict(student.config), "model": student.state_dict(),
                "optimizer": opt.state_dict(), "vocab_ids": vocab_ids, "step": step, "elapsed": elapsed,
                "agreement_before": before, "best": best}, tmp)
    tmp.replace(path)  # a crash mid-write never leaves a torn checkpoint
