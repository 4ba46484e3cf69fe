"""Drafters: per-request proposers of draft tokens.

Each drafter implements `speculative.decoding.Drafter`: given every verified
token so far, propose a tree with the distributions its tokens were drawn
from. A drafter that lost its state (a new process) simply rebuilds it from
the context it is given.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

import torch

from runtime.graphs import SharedPasses, StaticPasses, runs_static
from runtime.model import Transformer, attention_mask, causal_ancestors
from speculative.decoding import DraftRequest
from speculative.easyspec import fuzzy_forward, run_sequentially
from speculative.drafter_kinds import Abilities, abilities as kind_abilities
from runtime.cpu_tuning import PAD_ROWS_TO
from speculative.ngram import lookup_draft
from speculative.recycling import RecycledCandidates
from speculative.sampling import SamplingParams, choice_scores, probabilities, sample
from speculative.suffix import SuffixFeed, SuffixIndex, suffix_draft
from speculative.tree import DraftTree, one_hot, sample_tree

FIRST_CACHE_SLOTS = 256  # a model drafter's first KV cache: most requests fit, and it doubles as they grow
# passes of this many tokens or more go to a model drafter's `wide_model` when it has one: the
# float target's prepacked layers take a prompt faster than int4's kernel (docs/DRAFTERS.md)
WIDE_ROWS = 64


def _top_k_renormalised(q: torch.Tensor, k: int) -> torch.Tensor:
    top = torch.topk(q, min(k, q.shape[-1]))
    out = torch.zeros_like(q)
    out[top.indices] = top.values / top.values.sum()
    return out


class PromptLookupDrafter:
    """Model-free: copies what followed the latest earlier match of the text's
    last n-gram. Its draws are deterministic, so q is one-hot."""

    name = "pld"
    abilities = kind_abilities("pld")

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1):
        self.vocab_size, self.max_ngram, self.min_ngram = vocab_size, max_ngram, min_ngram

    def propose(self, request: DraftRequest) -> DraftTree:
        return lookup_draft(request.context, request.depth, self.vocab_size, request.params.deterministic,
                            self.max_ngram, self.min_ngram)


class SuffixDrafter:
    """Model-free trees from a suffix index shared by every request of the process
    (SuffixDecoding): it holds the prompts and outputs of all requests, this one's
    included, fed as tokens are verified. Its tree is deterministic, so each node's
    q is one-hot, which multi-draft verification handles exactly."""

    name = "suffix"
    abilities = kind_abilities("suffix")

    def __init__(self, index: SuffixIndex, vocab_size: int):
        self.index, self.vocab_size = index, vocab_size
        self.fed = SuffixFeed()

    def propose(self, request: DraftRequest) -> DraftTree:
        self.fed.feed(self.index, request.known)  # a guess ahead is not fed
        return suffix_draft(self.index, request.context, request.nodes, request.depth, self.vocab_size,
                            request.params.deterministic)


class RecyclingDrafter:
    """Model-free trees from the target's own earlier top-k predictions (Token
    Recycling, `speculative.recycling`), a table shared by every request of the
    process and fed after each verification pass (`observe`). Its tree is
    deterministic, so each node's q is one-hot, as the suffix drafter's."""

    name = "recycle"
    abilities = kind_abilities("recycle")

    def __init__(self, table: RecycledCandidates):
        self.table = table

    def observe(self, tokens: Sequence[int], ids: torch.Tensor, probs: torch.Tensor) -> None:
        self.table.observe(tokens, ids, probs)

    def propose(self, request: DraftRequest) -> DraftTree:
        tree = self.table.propose(request.context[-1], request.nodes, request.depth)
        if not request.params.deterministic and len(tree):
            tree.draw_q = one_hot([tree.tokens[node] for node in tree.draw_nodes], self.table.vocab_size)
        return tree


class ModelDrafter:
    """Drafts autoregressively with a small causal LM, or with a subset of the
    target's own layers (layer-skip self-drafting), keeping its own KV cache.

    A drafter with a trimmed vocabulary (VocabTrim) gives `vocab_ids`: its
    token i is the target's token vocab_ids[i], and its one extra last row
    stands for every other target token on input and is never proposed. Its
    q, spread back over the target's vocabulary, is still exactly what the
    draft was drawn from.

    `parallel_layers` set drafts EasySpec-style (speculative.easyspec): each group of
    that many consecutive layers runs its attentions on the group's input, at the same
    time (`layer_runner`); 1 is the exact forward, op for op. Above 1 the keys and
    values drafting writes are fuzzy: the drafter counts how many of the first cached
    entries are exact (`exact`), and the next `_sync` recomputes the accepted tokens'
    entries in one exact pass (bonus calibration), whose logits give each draft's
    first token."""

    abilities = Abilities(stops_on_confidence=True)

    def __init__(self, model: Transformer, layers: Sequence[int] | None = None, name: str = "model",
                 max_len: int | None = None, draft_top_k: int | None = None,
                 vocab_ids: Sequence[int] | None = None, target_vocab_size: int | None = None,
                 parallel_layers: int | None = None, layer_runner=run_sequentially,
                 wide_model: Transformer | None = None, cuda_graphs: bool | None = None,
                 shared_passes: SharedPasses | None = None):
        if parallel_layers is not None and parallel_layers < 1:
            raise ValueError(f"parallel_layers must be >= 1, got {parallel_layers}")
        self.parallel_layers, self.layer_runner = parallel_layers, layer_runner
        self.model, self.layers, self.name = model, list(layers) if layers is not None else None, name
        # scores exact passes of WIDE_ROWS tokens or more (a prompt) into this drafter's cache: a
        # model of the same shapes and cache dtype (self-int4's float target)
        self.wide_model = wide_model
        # Sampling from the top-k renormalised distribution makes q exactly
        # sparse: k (id, prob) pairs per draft token on the wire, still exact.
        self.draft_top_k = draft_top_k
        self.vocab_ids = self.to_draft = None
        self.target_vocab_size = target_vocab_size or model.config.vocab_size
        if vocab_ids is not None:
            self.vocab_ids = torch.tensor(list(vocab_ids), dtype=torch.long)
            self.to_draft = torch.full((self.target_vocab_size,), len(self.vocab_ids), dtype=torch.long)
            self.to_draft[self.vocab_ids] = torch.arange(len(self.vocab_ids))
        self.max_len = max_len or model.config.max_position_embeddings
        # SpecDec++-style stop: no more tokens after one drawn with less confidence than this
        self.stop_below = 0.0
        self.cache = None
        # draft steps at static shapes, CUDA graphs replayed (runtime/graphs.py; None: on CUDA);
        # the cache is then made at max_len once, since a graph is bound to its cache
        self.cuda_graphs = model.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.shared_passes = shared_passes  # whose cache and graphs to use, when several drafters take turns
        self._static = None
        self.cached: list[int] = []  # tokens whose keys and values the cache holds
        self.exact = 0  # how many of them have exact entries (the rest were drafted fuzzily)

    def use_model(self, model: Transformer) -> None:
        """Draft with `model` (a newer version of this drafter, same vocabulary) from the next
        proposal on. Its cache is dropped and refills from the verified context, so nothing
        the old model computed carries over; call between rounds only."""
        self.model, self.cache, self.cached, self.exact = model, None, [], 0
        self._static = None

    def _sync(self, context: Sequence[int], depth: int) -> torch.Tensor:
        """Bring the cache to context[:-1] plus the last token; return logits after it."""
        # the cache grows with the request (doubling), never past max_len; PAD_ROWS_TO spare
        # slots hold a padded pass
        need = min(len(context) + depth + PAD_ROWS_TO, self.max_len)
        if self.cache is None and self.cuda_graphs and self.shared_passes is not None \
                and isinstance(self.model, Transformer):
            self._static = self.shared_passes.get(self.model, self.layers, self.max_len)
            self.cache, self.cached, self.exact = self._static.cache, [], 0
            self.cache.rollback(0)  # what the last drafter to use it left
        elif self.cache is None:
            n_layers = len(self.layers) if self.layers is not None else None
            first = self.max_len + 1 if self.cuda_graphs else min(max(need, FIRST_CACHE_SLOTS), self.max_len)
            self.cache = self.model.new_cache(first, num_layers=n_layers)
        elif need > self.cache.max_len:
            self.cache = self.cache.grown(min(max(need, 2 * self.cache.max_len), self.max_len))
        common = 0
        # fuzzy entries (drafted tokens that were accepted) are recomputed exactly: bonus calibration
        limit = min(self.exact, len(context) - 1)
        while common < limit and self.cached[common] == context[common]:
            common += 1
        self.cache.rollback(common)
        return self._feed(list(context[common:]), common)

    def _feed(self, tokens: list[int], start: int, exact: bool = True) -> torch.Tensor:
        """Append `tokens` at cache slot `start`; logits after the last. Not `exact`: a drafted
        token, through the layer-parallel forward when `parallel_layers` > 1."""
        device = self.model.device
        t = len(tokens)
        ids = torch.tensor([tokens])
        if self.to_draft is not None:
            ids = self.to_draft[ids]
        forward = self.model if exact else self._draft_forward
        if exact and self.wide_model is not None and t >= WIDE_ROWS:
            forward = self.wide_model
        logits = forward(ids.to(device), torch.arange(start, start + t, device=device)[None], self.cache,
                         attention_mask(start, causal_ancestors(t, device)), layers=self.layers,
                         logits_from=t - 1)
        self.cached = self.cached[:start] + tokens
        self.exact = len(self.cached) if exact or (self.parallel_layers or 1) == 1 else min(self.exact, start)
        logits = logits[0, -1]
        if self.vocab_ids is not None:  # the "any other token" row is never proposed
            logits = torch.cat((logits[:-1], logits.new_full((1,), float("-inf"))))
        return logits

    def _draft_forward(self, tokens, positions, cache, mask, layers=None, logits_from=0) -> torch.Tensor:
        """The forward that scores drafted tokens: the model's own (at static shapes, from a
        captured graph, with `cuda_graphs`), or EasySpec's layer-parallel one."""
        if self.parallel_layers is None:
            static = self._static_passes(cache)
            if static is not None and static.fits(1, tokens.shape[1], mask.shape[-1]):
                return static(tokens, positions, mask, [0], logits_from=logits_from)
            return self.model(tokens, positions, cache, mask, layers=layers, logits_from=logits_from)
        return fuzzy_forward(self.model, tokens, positions, cache, mask, self.parallel_layers, layers=layers,
                             logits_from=logits_from, run=self.layer_runner)

    def _static_passes(self, cache):
        """This drafter's static passes over `cache` (None: off)."""
        if not self.cuda_graphs or not runs_static(self.model, cache):
            return None
        if self._static is None or self._static.cache is not cache:
            self._static = StaticPasses(self.model, cache, layers=self.layers)
        return self._static

    def propose(self, request: DraftRequest) -> DraftTree:
        context, params, generator = request.context, request.params, request.generator
        depth = min(request.depth, self.max_len - len(context))  # the cache holds no more
        nodes = depth if request.max_nodes is None else request.max_nodes
        if depth > 0 and nodes > depth:
            if params.deterministic:
                return self._propose_tree(context, depth, nodes, params)
            if nodes >= 2 * depth:
                return self._sample_tree(context, depth, nodes // depth, params, generator)
        logits = self._sync(context, depth)
        tokens, qs, confidence = [], [], []
        for i in range(depth):
            if params.deterministic:  # guess the target's choice: the drafter's own, keyed alike
                scores = self._choice_scores(logits[None], params, len(context) + i)[0]
                tok = int(scores.argmax())
                confidence.append(float(torch.softmax(scores.float(), -1)[tok]))
            else:
                q = self._draft_q(logits, params)
                tok = sample(q, generator)
                confidence.append(float(q[tok]))
                qs.append(self._spread(q))
            if self.vocab_ids is not None:
                tok = int(self.vocab_ids[tok])
            tokens.append(tok)
            # The token just drawn stays (dropping it for its own value would bias sampling);
            # whether to draw another depends on it, which verification allows.
            if confidence[-1] < self.stop_below:
                break
            if i + 1 < depth:
                logits = self._feed([tok], len(self.cached), exact=False)
        return DraftTree.chain(tokens, torch.stack(qs) if qs else None, confidence)

    def _propose_tree(self, context: Sequence[int], depth: int, max_nodes: int, params: SamplingParams) -> DraftTree:
        """Deterministic requests only (greedy or keyed, on the choice scores): a tree of at
        most `max_nodes` nodes and `depth` levels, grown level by level (as EAGLE-2 does):
        each level's candidates are the top children of the level above, and the `width` of
        them likeliest by path probability under the drafter become nodes, all scored together in one forward with tree attention. The nodes come out
        best-first by path probability, so every parent precedes its children and
        `truncated(k)` keeps the best k. Any tree is lossless under greedy verification;
        this one holds the tokens the target most likely takes. The tree's keys and values
        are dropped from the cache afterwards: the next round feeds what was accepted."""
        width = -(-max_nodes // depth)  # ceil: enough nodes per level to fill the budget
        base = len(context)
        logits = self._sync(context, depth * width)
        tree_tokens: list[int] = []  # drafter's own ids
        parents: list[int] = []
        local: list[float] = []  # each node's probability after its parent
        path_logp: list[float] = []
        slot: dict[int, int] = {}  # node -> its KV cache slot, once fed
        frontier, frontier_logits = [-1], logits[None]  # the last level's nodes, and logits after each
        for level in range(depth):
            scores = self._choice_scores(frontier_logits, params, base + level)
            top = torch.topk(torch.softmax(scores.float(), -1), min(width, scores.shape[-1]))
            candidates = []
            for node, probs, toks in zip(frontier, top.values.tolist(), top.indices.tolist()):
                logp = path_logp[node] if node >= 0 else 0.0
                for p, tok in zip(probs, toks):
                    if p > 0:
                        candidates.append((logp + math.log(p), node, tok, p))
            candidates.sort(key=lambda c: -c[0])
            level_nodes = []
            for logp, parent, tok, p in candidates[:width]:
                level_nodes.append(len(tree_tokens))
                tree_tokens.append(tok)
                parents.append(parent)
                local.append(p)
                path_logp.append(logp)
            if level + 1 == depth or not level_nodes:
                break
            frontier = level_nodes
            frontier_logits = self._score_level(level_nodes, tree_tokens, parents, slot, base, level)
        self.cache.rollback(base)  # keep the verified context only
        order = sorted(range(len(tree_tokens)), key=lambda n: (-path_logp[n], n))[:max_nodes]
        kept = set(order)
        order = [n for n in order if parents[n] < 0 or parents[n] in kept]  # closed under parents
        new_index = {n: i for i, n in enumerate(order)}
        tokens = [tree_tokens[n] for n in order]
        if self.vocab_ids is not None:
            tokens = self.vocab_ids[torch.tensor(tokens, dtype=torch.long)].tolist()
        return DraftTree(tokens, [new_index.get(parents[n], -1) for n in order],
                         confidence=[local[n] for n in order])

    def _score_level(self, level_nodes: list[int], tree_tokens: list[int], parents: list[int],
                     slot: dict[int, int], base: int, level: int) -> torch.Tensor:
        """Logits after each of one tree level's nodes, in one forward with tree attention:
        each node sees the context and its own ancestors (whose cache slots `slot` holds,
        and gains the nodes'). The caller rolls the cache back to `base` when done."""
        start = self.cache.lengths[0]
        mask = torch.zeros(len(level_nodes), start + len(level_nodes), dtype=torch.bool)
        mask[:, :base] = True
        for row, node in enumerate(level_nodes):
            mask[row, start + row] = True
            up = parents[node]
            while up >= 0:
                mask[row, slot[up]] = True
                up = parents[up]
            slot[node] = start + row
        device = self.model.device
        ids = torch.tensor([[tree_tokens[n] for n in level_nodes]], device=device)
        positions = torch.tensor([[base + level] * len(level_nodes)], device=device)
        out = self._draft_forward(ids, positions, self.cache, mask[None].to(device), layers=self.layers)[0]
        if self.vocab_ids is not None:  # the "any other token" row is never proposed
            out = torch.cat((out[:, :-1], out.new_full((len(level_nodes), 1), float("-inf"))), 1)
        return out

    def _sample_tree(self, context: Sequence[int], depth: int, branches: int, params: SamplingParams,
                     generator: torch.Generator) -> DraftTree:
        """Sampling: `branches` chains drawn independently from the drafter, grown together
        level by level (one forward per level scores every distinct node), shared prefixes
        merged. Each chain's draw at a node comes from q after that node's path, so the
        draws below a node are independent draws of one q, which multi-draft verification
        takes exactly (as MultiSampleDrafter's chains, at a chain's cost instead of
        `branches` chains' cost). A chain stops after a draw under `stop_below`, as a
        single chain does."""
        base = len(context)
        logits = self._sync(context, depth * branches)
        slot: dict[int, int] = {}

        def draw(node_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q = self._draft_q(node_logits, params)
            return q, self._spread(q)

        def expand(level_nodes, tokens, parents, states, frontier, level):  # tokens: the drafter's own ids
            return self._score_level(level_nodes, tokens, parents, slot, base, level)

        tree = sample_tree(logits[None], depth, branches, draw, expand, generator, self.stop_below)
        self.cache.rollback(base)  # keep the verified context only
        if self.vocab_ids is None:
            return tree
        return replace(tree, tokens=self.vocab_ids[torch.tensor(tree.tokens, dtype=torch.long)].tolist())

    def _choice_scores(self, logits: torch.Tensor, params: SamplingParams, position: int) -> torch.Tensor:
        """`speculative.sampling.choice_scores` of rows [N, V'] all guessing the token at
        `position`, over the drafter's vocabulary: keyed by the target's token ids, the same
        noise the verifier adds, so a drafter close to the target guesses its choice."""
        if params.greedy:
            return logits
        if self.vocab_ids is None:
            return choice_scores(logits, params, [position] * len(logits))
        full = logits.new_full((len(logits), self.target_vocab_size), float("-inf"))
        full[:, self.vocab_ids] = logits[:, :-1]
        scores = choice_scores(full, params, [position] * len(logits))
        out = scores.new_full((len(logits), len(self.vocab_ids) + 1), float("-inf"))  # "any other token": never
        out[:, :-1] = scores[:, self.vocab_ids]
        return out

    def _draft_q(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The distribution a sampled draft token is drawn from, over the drafter's vocabulary."""
        q = probabilities(logits, params)
        return _top_k_renormalised(q, self.draft_top_k) if self.draft_top_k else q

    def _spread(self, q: torch.Tensor) -> torch.Tensor:
        """q over the drafter's vocabulary as a distribution over the target's."""
        if self.vocab_ids is None:
            return q
        full = torch.zeros(self.target_vocab_size, dtype=q.dtype, device=q.device)
        full[self.vocab_ids] = q[:-1]
        return full


def layer_skip_layers(num_layers: int, keep_first: int, keep_last: int = 0) -> list[int]:
    """The layers a layer-skip drafter runs: the first `keep_first` and the last `keep_last`."""
    first = list(range(min(keep_first, num_layers)))
    last = list(range(max(num_layers - keep_last, len(first)), num_layers))
    return first + last


class MultiSampleDrafter:
    """A token tree from `branches` independent proposals of one drafter,
    shared prefixes merged (multi-draft speculative sampling keeps it exact)."""

    def __init__(self, base, branches: int):
        self.base, self.branches = base, branches
        self.abilities = base.abilities
        self.name = f"{getattr(base, 'name', 'drafter')}x{branches}"

    def propose(self, request: DraftRequest) -> DraftTree:
        if request.params.deterministic:  # every proposal would be the same: the base drafter's tree instead
            return self.base.propose(request)
        tree = DraftTree()
        for _ in range(self.branches):
            chain = self.base.propose(replace(request, max_nodes=None))
            tree.add_chain(chain.tokens, chain.draw_q, confidence=chain.confidence)
        return tree
