"""Train a feature-level head (EAGLE-3): `specserve train-drafter --kind eagle`.

1. Data: corpus prompts answered greedily by the target itself (as EAGLE does: the
   head learns what the target says), several prompts a pass; the same passes
   capture the target's low, middle and high layer outputs at every position and
   its top-k next-token distribution. Prompts that share an 8-word span with a
   question of `exclude` (the Spec-Bench questions) are dropped first. Generation
   stops at `data_minutes` (or when every prompt is answered).
2. Draft vocabulary: the `draft_vocab` target tokens the target predicts most in
   that data (plus end-of-sequence); the LM head is the target's rows for them.
3. Training-time test: each step runs the head over whole sequences `ttt_steps`
   times; step 0 from the target's features, step j from the head's own outputs
   of step j-1 one position back, attending (as drafting does) to the real
   entries up to j positions back and to its own chain after them. Loss: cross
   entropy to the target's top-k (restricted to the draft vocabulary) at every
   step, step j weighted TTT_DECAY^j; AdamW, cosine schedule over `minutes`.
   The best state by held-out top-1 agreement is written.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from runtime import loading
from runtime.cpu_tuning import CpuTuning
from runtime.eagle_head import EagleHead, HeadConfig, save_head
from runtime.model import Transformer, attention_mask, causal_ancestors

from .corpus import corpus_files

TTT_DECAY = 0.8  # the weight of training-time test step j's loss: TTT_DECAY ** j
INIT_STD = 0.02
WARMUP_STEPS = 10
SPAN_WORDS = 8  # a prompt sharing this many consecutive words with an excluded question is dropped


@dataclass
class EagleTrainConfig:
    target: str | None
    corpus: list[str]
    out: str
    exclude: list[str] = field(default_factory=list)  # question files whose text must not be trained on
    minutes: float = 10.0  # training budget
    data_minutes: float = 6.0  # budget for the target's answers (the data)
    max_prompts: int = 2000
    answer_tokens: int = 96
    max_prompt_tokens: int = 384
    batch_prompts: int = 32  # prompts answered together, one cache row each
    draft_vocab: int = 4096
    intermediate: int = 768
    ttt_steps: int = 3
    top_k: int = 8
    prompt_weight: float = 0.0  # the head drafts answers: prompt positions only feed its cache
    lr: float = 1e-3
    sequences_per_step: int = 4
    eval_fraction: float = 0.08
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        checks = [("minutes", self.minutes > 0), ("data_minutes", self.data_minutes > 0),
                  ("draft_vocab", self.draft_vocab >= 16), ("ttt_steps", self.ttt_steps >= 1),
                  ("corpus", bool(self.corpus)), ("max_prompts", self.max_prompts >= 1)]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')}: invalid value {getattr(self, name)!r}")


# ---- data -------------------------------------------------------------------

def _spans(text: str) -> set[str]:
    w = re.findall(r"\w+", text.lower())
    return {" ".join(w[i:i + SPAN_WORDS]) for i in range(max(len(w) - SPAN_WORDS + 1, 0))}


def excluded_spans(files: list[str]) -> set[str]:
    """Every 8-word span of every turn of the questions in `files` (.jsonl with `turns`)."""
    spans: set[str] = set()
    for f in files:
        for line in Path(f).read_text().splitlines():
            if line.strip():
                for turn in json.loads(line).get("turns", []):
                    spans |= _spans(turn)
    return spans


def corpus_prompts(cfg: EagleTrainConfig, tokenizer) -> tuple[list[list[int]], int]:
    """The corpus's chat prompts as token ids, those sharing text with `exclude` dropped, shuffled;
    and how many were dropped."""
    banned = excluded_spans(cfg.exclude)
    files = corpus_files(cfg.corpus)
    kept, dropped = [], 0
    for f in files:
        for line in f.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            text = record.get("prompt") or (record.get("turns") or [""])[0] or record.get("text", "")
            if banned and _spans(text) & banned:
                dropped += 1
                continue
            kept.append(record)
    random.Random(cfg.seed).shuffle(kept)
    prompts = []
    for record in kept:
        if "text" in record and "prompt" not in record and "turns" not in record:
            continue  # plain text: the head learns from the target's answers only
        messages = record.get("messages") or [{"role": "user",
                                               "content": record.get("prompt") or record["turns"][0]}]
        ids = tokenizer.encode_chat(messages)
        if 2 <= len(ids) <= cfg.max_prompt_tokens:
            prompts.append(ids)
    return prompts[:cfg.max_prompts], dropped


@torch.inference_mode()
def answer_with_features(target: Transformer, prompts: list[list[int]], max_tokens: int, eos: set[int],
                         layers: tuple[int, ...], k: int) -> list[dict]:
    """Greedy answers of several prompts together (one cache row each), with the target's
    captured features [T, 3H] (float16) and top-k next-token ids and probabilities at
    every position of prompt + answer."""
    device, rows = target.device, len(prompts)
    cache = target.new_cache(max(map(len, prompts)) + max_tokens, batch=rows)
    feats, tops = [], []
    for row, p in enumerate(prompts):
        n = len(p)
        logits, f = target(torch.tensor([p], device=device), torch.arange(n, device=device)[None],
                           cache.row_view(row), attention_mask(0, causal_ancestors(n, device)), capture=layers)
        feats.append([f[0].half().cpu()])
        tops.append([_top_k(logits[0], k)])
    answers = [[int(t[0][0][-1, 0])] for t in tops]
    while not all(a[-1] in eos or len(a) >= max_tokens for a in answers):
        lengths = list(cache.lengths)
        mask = torch.zeros(rows, 1, max(lengths) + 1, dtype=torch.bool)
        for r, n in enumerate(lengths):
            mask[r, 0, :n + 1] = True
        tokens = torch.tensor([[a[-1]] for a in answers], device=device)
        logits, f = target(tokens, torch.tensor(lengths, device=device)[:, None], cache, mask.to(device),
                           capture=layers)
        ids, probs = _top_k(logits[:, 0], k)
        for r, a in enumerate(answers):
            if a[-1] not in eos and len(a) < max_tokens:
                feats[r].append(f[r].half().cpu())
                tops[r].append((ids[r:r + 1], probs[r:r + 1]))
                a.append(int(ids[r, 0]))
    items = []
    for p, a, fs, ts in zip(prompts, answers, feats, tops):
        n = len(p) + len(a) - 1  # the last answer token was never fed: no feature there
        items.append({"tokens": torch.tensor(p + a, dtype=torch.int32), "answer_from": len(p),
                      "features": torch.cat(fs)[:n], "top_ids": torch.cat([x for x, _ in ts])[:n],
                      "top_probs": torch.cat([y for _, y in ts])[:n]})
    return items


def _top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    top = torch.topk(torch.softmax(logits.float(), -1), k)
    return top.indices.to(torch.int32).cpu(), top.values.to(torch.float16).cpu()


def prepare_data(cfg: EagleTrainConfig, target: Transformer, tokenizer, layers, log) -> list[dict]:
    """The target's answers with features, cached in OUT/work/data.pt (a rerun reuses them)."""
    path = Path(cfg.out) / "work" / "data.pt"
    if path.exists():
        items = torch.load(path)
        log(f"data: {len(items)} answered prompts from {path}")
        return items
    prompts, dropped = corpus_prompts(cfg, tokenizer)
    log(f"data: {len(prompts)} prompts ({dropped} sharing an {SPAN_WORDS}-word span with an excluded "
        f"question dropped); answering for at most {cfg.data_minutes:g} min")
    eos = set(tokenizer.eos_token_ids or target.config.eos_token_ids)
    items, started = [], time.perf_counter()
    prompts.sort(key=len)  # similar lengths share a batch; the order was shuffled before the cut
    batches = [prompts[i:i + cfg.batch_prompts] for i in range(0, len(prompts), cfg.batch_prompts)]
    random.Random(cfg.seed).shuffle(batches)
    with tqdm(total=len(prompts), desc="target answers", unit="prompt") as bar:
        for batch in batches:
            if time.perf_counter() - started > cfg.data_minutes * 60:
                break
            items.extend(answer_with_features(target, batch, cfg.answer_tokens, eos, layers, cfg.top_k))
            bar.update(len(batch))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(items, path)
    log(f"data: {len(items)} prompts answered, {sum(len(it['tokens']) for it in items)} tokens, "
        f"{time.perf_counter() - started:.0f} s")
    return items


def choose_vocab(items: list[dict], size: int, always: list[int], vocab_size: int) -> list[int]:
    """`always`, then the target tokens the target predicts first most often, to `size` in all."""
    counts = torch.zeros(vocab_size)
    for it in items:
        counts.index_add_(0, it["top_ids"][:, 0].long(), torch.ones(len(it["top_ids"])))
    keep = set(always)
    for tok in torch.argsort(counts, descending=True).tolist():
        if len(keep) >= size or counts[tok] == 0:
            break
        keep.add(tok)
    return sorted(keep)


# ---- training -------------------------------------------------------------------

def new_head(target: Transformer, cfg: EagleTrainConfig, vocab_ids: list[int]) -> EagleHead:
    head = EagleHead(HeadConfig.of_target(target.config, cfg.intermediate), torch.tensor(vocab_ids))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, INIT_STD)
    head.attach(target)
    # the target's tensors were made under inference mode: autograd needs ordinary copies
    for name in ("embed_weight", "lm_head_weight", "rope_cos", "rope_sin"):
        setattr(head, name, getattr(head, name).clone())
    return head


def _batch(items: list[dict], to_draft: torch.Tensor, prompt_weight: float):
    """Padded tensors of a few sequences: features [B, T, 3H], next tokens [B, T] (entry i's
    token i+1), targets: draft ids [B, T, k] and probabilities of the target after position
    i+1, loss weights [B, T]."""
    t = max(len(it["features"]) for it in items) - 1  # entry i needs the target after i+1
    b = len(items)
    fdim, k = items[0]["features"].shape[1], items[0]["top_ids"].shape[1]
    feats = torch.zeros(b, t, fdim)
    nxt = torch.zeros(b, t, dtype=torch.long)
    ids = torch.zeros(b, t, k, dtype=torch.long)
    probs = torch.zeros(b, t, k)
    weight = torch.zeros(b, t)
    for r, it in enumerate(items):
        n = len(it["features"]) - 1
        feats[r, :n] = it["features"][:n].float()
        nxt[r, :n] = it["tokens"][1:n + 1].long()
        d = to_draft[it["top_ids"][1:n + 1].long()]
        p = it["top_probs"][1:n + 1].float() * (d >= 0)
        ids[r, :n], probs[r, :n] = d.clamp(min=0), p / p.sum(-1, keepdim=True).clamp(min=1e-6)
        w = torch.full((n,), prompt_weight)
        w[max(it["answer_from"] - 2, 0):] = 1.0  # entry i predicts token i+2
        weight[r, :n] = w * (p.sum(-1) > 0)
    return feats, nxt, ids, probs, weight


def ttt_forward(head: EagleHead, feats, nxt, steps: int):
    """The head's outputs [B, T, H] at each training-time-test step (see the module doc)."""
    b, t, _ = feats.shape
    positions = torch.arange(t)[None].expand(b, t)
    g = head.fused(feats)
    ks, vs, outs = [], [], []
    i = torch.arange(t)[:, None]
    m = torch.arange(t)[None]
    for j in range(steps):
        if j:
            g = torch.cat((g.new_zeros(b, 1, g.shape[-1]), h[:, :-1]), 1)  # the head's output one back
            blocks = [m <= i - j] + [m == i - j + s for s in range(1, j)] + [m == i]
            mask = torch.cat(blocks, 1)
            past_k, past_v = torch.cat(ks, 2), torch.cat(vs, 2)
            h, k, v = head.layer(g, nxt, positions, past_k, past_v, mask[None].expand(b, -1, -1))
        else:
            empty = g.new_zeros(b, head.config.num_kv_heads, 0, head.config.head_dim)
            h, k, v = head.layer(g, nxt, positions, empty, empty, None)
        ks.append(k)
        vs.append(v)
        outs.append(h)
    return outs


def _loss(head: EagleHead, outs, ids, probs, weight):
    total, norm = 0.0, 0.0
    for j, h in enumerate(outs):
        w = weight.clone()
        w[:, :j] = 0  # no real entry j positions back
        at = w > 0  # the LM head (most of a step's work) only where the loss counts
        logp = torch.log_softmax(head.logits(h[at]), -1).gather(-1, ids[at])
        ce = -(probs[at] * logp).sum(-1)
        total = total + TTT_DECAY ** j * (ce * w[at]).sum()
        norm += TTT_DECAY ** j * float(w.sum())
    return total / max(norm, 1e-6)


@torch.no_grad()
def agreement(head: EagleHead, batches, steps: int) -> list[float]:
    """Top-1 agreement with the target's top-1 on answer positions, per TTT step."""
    hits, counts = [0.0] * steps, [0.0] * steps
    for feats, nxt, ids, probs, weight in batches:
        for j, h in enumerate(ttt_forward(head, feats, nxt, steps)):
            ok = (weight == 1.0) & (probs[..., 0] > 0)
            ok[:, :j] = False
            hits[j] += float((head.logits(h[ok]).argmax(-1) == ids[..., 0][ok]).sum())
            counts[j] += float(ok.sum())
    return [h / max(c, 1) for h, c in zip(hits, counts)]


def train_eagle(cfg: EagleTrainConfig, log=print, *, cache_dir: str | None = None,
                cpu_tuning: CpuTuning = CpuTuning()) -> Path:
    cfg.validate()
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    target, tokenizer = loading.load(cfg.target, cache_dir=cache_dir, cpu_tuning=cpu_tuning)
    layers = HeadConfig.of_target(target.config).layers
    data_started = time.perf_counter()
    items = prepare_data(cfg, target, tokenizer, layers, log)
    data_s = time.perf_counter() - data_started
    if not items:
        raise ValueError("--corpus: no prompts to answer")
    eos = tokenizer.eos_token_ids or target.config.eos_token_ids
    vocab_ids = choose_vocab(items, cfg.draft_vocab, list(eos), target.config.vocab_size)
    head = new_head(target, cfg, vocab_ids)
    to_draft = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    to_draft[torch.tensor(vocab_ids)] = torch.arange(len(vocab_ids))
    answered = sum(len(it["tokens"]) - it["answer_from"] for it in items)
    covered = sum(int((to_draft[it["tokens"][it["answer_from"]:].long()] >= 0).sum()) for it in items)
    log(f"draft vocabulary: {len(vocab_ids)} tokens, {covered / max(answered, 1):.1%} of the answer tokens")
    rng = random.Random(cfg.seed)
    order = list(range(len(items)))
    rng.shuffle(order)
    n_eval = max(1, int(len(items) * cfg.eval_fraction)) if len(items) > 4 else 0
    eval_items = [items[i] for i in order[:n_eval]]
    train_items = [items[i] for i in order[n_eval:]] or items
    evals = [_batch(eval_items[i:i + cfg.sequences_per_step], to_draft, cfg.prompt_weight)
             for i in range(0, len(eval_items), cfg.sequences_per_step)]
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.01)
    budget = cfg.minutes * 60
    best, best_state, step, started = -1.0, None, 0, time.perf_counter()
    history = []
    train_items.sort(key=lambda it: len(it["features"]))  # similar lengths batch with little padding
    groups = [train_items[i:i + cfg.sequences_per_step] for i in range(0, len(train_items), cfg.sequences_per_step)]
    head.train()
    with tqdm(total=round(budget), desc="training eagle head", unit="s") as bar:
        elapsed, next_eval = 0.0, 60.0
        while elapsed < budget:
            rng.shuffle(groups)
            for group in groups:
                lr = cfg.lr * min(1.0, (step + 1) / WARMUP_STEPS) * 0.5 * (1 + math.cos(math.pi * min(elapsed / budget, 1)))
                for pg in opt.param_groups:
                    pg["lr"] = lr
                feats, nxt, ids, probs, weight = _batch(group, to_draft, cfg.prompt_weight)
                loss = _loss(head, ttt_forward(head, feats, nxt, cfg.ttt_steps), ids, probs, weight)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                step += 1
                now = time.perf_counter() - started
                bar.update(round(min(now, budget)) - bar.n)
                bar.set_postfix(loss=f"{loss.item():.3f}", step=step)
                elapsed = now
                if elapsed >= next_eval or elapsed >= budget:
                    next_eval = elapsed + 60.0
                    head.eval()
                    acc = agreement(head, evals, cfg.ttt_steps) if evals else [0.0]
                    head.train()
                    history.append({"step": step, "minutes": round(elapsed / 60, 2), "loss": round(float(loss), 4),
                                    "agreement": [round(a, 4) for a in acc]})
                    bar.write(f"step {step}: loss {float(loss):.3f}, held-out top-1 agreement by TTT step "
                              + " / ".join(f"{a:.3f}" for a in acc))
                    if acc[0] > best:
                        best, best_state = acc[0], {k: v.detach().clone() for k, v in head.state_dict().items()}
                if elapsed >= budget:
                    break
    if best_state is not None:
        head.load_state_dict(best_state)
    info = {"target": {"vocab_size": target.config.vocab_size, "source": str(loading.resolve_source(cfg.target).name)},
            "training": {**{k: v for k, v in asdict(cfg).items() if k not in ("extra", "out")},
                         "prompts_answered": len(items), "tokens": sum(len(it["tokens"]) for it in items),
                         "data_seconds": round(data_s), "train_seconds": round(elapsed), "steps": step,
                         "held_out_agreement": history[-1]["agreement"] if history else None,
                         "best_agreement": round(best, 4), "history": history},
            **cfg.extra}
    save_head(head, out, info)
    log(f"wrote {out} ({(out / 'head.safetensors').stat().st_size / 1e6:.1f} MB); best held-out top-1 "
        f"agreement {best:.3f}")
    return out
