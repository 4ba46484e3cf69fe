"""`specserve bench --workload extraction|tools`: structured outputs with speculation
against without, on prompts built from Spec-Bench dev questions.

- extraction: each question with a JSON schema over a short answer to it (a category
  from a fixed list, a one-sentence answer, up to three key terms); the output must
  validate against the schema.
- tools: each question with three tools and `tool_choice: required`; the output must be a
  `<tool_call>` whose JSON names one of the tools and whose arguments validate against its
  parameter schema (the grammar router/tools.py builds for the served API).

Every mode decodes the same prompts under the same grammar, greedy, in this process,
interleaved per question. Reported per mode: tokens/s, target passes, the share of output
tokens the grammar forced (jump-forward, drafted for free), schema validity, and whether
its tokens equal plain decoding's. Then the grammar's own cost, measured on the outputs:
the mask per emitted token, and per draft-tree node (consume the node's token, compute the
next mask, roll back), as the verifier walks a tree.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from bench.questions import load_questions
from cluster.local import LocalEngine, Request
from protos import specserve_pb2 as pb
from router.tools import CLOSE, OPEN, call_grammar, call_schema, functions, parse_calls, template_messages
from speculative.grammar import Grammars
from speculative.sampling import SamplingParams

WORKLOADS = ("extraction", "tools")
LLAMACPP_AR = "llamacpp-ar"  # llama.cpp's plain decoding under its own grammar sampler
CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
              "translation", "summarization", "qa", "rag"]
EXTRACTION_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["category", "answer", "key_terms"],
    "properties": {"category": {"enum": CATEGORIES},
                   "answer": {"type": "string", "maxLength": 160},
                   "key_terms": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3}}}
TOOLS = [
    pb.Tool(name="web_search", description="Search the web and return the top results.",
            parameters=json.dumps({"type": "object", "additionalProperties": False, "required": ["query"],
                                   "properties": {"query": {"type": "string", "maxLength": 120},
                                                  "results": {"type": "integer", "minimum": 1, "maximum": 10}}})),
    pb.Tool(name="calculator", description="Evaluate an arithmetic expression.",
            parameters=json.dumps({"type": "object", "additionalProperties": False, "required": ["expression"],
                                   "properties": {"expression": {"type": "string", "maxLength": 80}}})),
    pb.Tool(name="get_weather", description="The current weather in a city.",
            parameters=json.dumps({"type": "object", "additionalProperties": False, "required": ["city"],
                                   "properties": {"city": {"type": "string", "maxLength": 40},
                                                  "unit": {"enum": ["celsius", "fahrenheit"]}}})),
]


@dataclass
class Case:
    """One prompt of a workload: its token ids and the grammar its output must follow (ours,
    and the same structure in llama.cpp's GBNF for `llamacpp-ar`)."""
    question: str
    ids: list[int]
    grammar: str
    schema: dict


def gbnf(workload: str, schema: dict) -> str:
    """The output's structure for llama.cpp: its JSON-schema converter's grammar, inside a
    `<tool_call>` block for the tools workload."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    grammar = json_schema_to_gbnf(json.dumps(schema))
    if workload == "extraction":
        return grammar
    body = grammar.replace("root ::=", "call ::=", 1)
    return f'root ::= "{OPEN}\\n" call "\\n{CLOSE}"\n{body}'


def extraction_case(engine: LocalEngine, grammars: Grammars, question: str) -> Case:
    prompt = ("Read the question below. Reply with only a JSON object: its category (one of "
              f"{', '.join(CATEGORIES)}), a one-sentence answer, and up to three key terms.\n\n"
              f"Question: {question}")
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    return Case(question, ids, grammars.compile("json_schema", EXTRACTION_SCHEMA, "json_schema"), EXTRACTION_SCHEMA)


def tools_case(engine: LocalEngine, grammars: Grammars, question: str) -> Case:
    tools = functions(TOOLS)
    messages, specs = template_messages([pb.ChatMessage(role="user", content=question)], tools,
                                        engine.tokenizer.template_knows_tools)
    ids = engine.tokenizer.encode_chat(messages, tools=specs)
    return Case(question, ids, grammars.compile("grammar", call_grammar(tools, "required", False), "tool_choice"),
                call_schema(tools))


def valid(workload: str, text: str) -> bool:
    """Whether the output is what its workload asks for, by jsonschema (not by the grammar)."""
    import jsonschema

    try:
        if workload == "extraction":
            jsonschema.validate(json.loads(text), EXTRACTION_SCHEMA)
            return True
        if not text.strip().startswith(OPEN) or not text.strip().endswith(CLOSE):
            return False
        _, calls = parse_calls(text)
        schemas = {t.name: json.loads(t.parameters) for t in TOOLS}
        if len(calls) != 1 or calls[0].name not in schemas:
            return False
        jsonschema.validate(json.loads(calls[0].arguments), schemas[calls[0].name])
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def mask_costs(grammars: Grammars, grammar: str, tokens: list[int], eos: list[int], alternatives: int = 3
               ) -> tuple[list, list]:
    """Seconds of the grammar's work along an output: the mask before each token, and, at
    each position, `alternatives` tree nodes' worth (consume an allowed token, its mask,
    roll back)."""
    matcher = grammars.matcher(grammar)
    stops = torch.tensor(eos)
    per_token, per_node = [], []
    for token in tokens:
        t = time.perf_counter()
        allowed = matcher.mask()
        per_token.append(time.perf_counter() - t)
        ids = allowed.nonzero().flatten()
        ids = ids[~torch.isin(ids, stops)]  # an end token stops the output; the nodes are tokens after it
        for alt in ids[torch.linspace(0, len(ids) - 1, alternatives).long().unique()].tolist() if len(ids) else []:
            t = time.perf_counter()
            matcher.consume(alt)
            matcher.mask()
            matcher.rollback(1)
            per_node.append(time.perf_counter() - t)
        if matcher.is_done():
            break
        matcher.consume(token)
    return per_token, per_node


def _ms(samples: list[float]) -> dict:
    ms = sorted(s * 1e3 for s in samples)
    return {"median_ms": round(statistics.median(ms), 4), "p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 4)} \
        if ms else {}


def run_structured(args) -> dict:
    questions = load_questions(args.questions, args.limit_per_category)
    engine = LocalEngine.load(args.model, args.device, args.dtype)
    grammars = Grammars.for_tokenizer(engine.tokenizer, engine.model.config.vocab_size)
    make = extraction_case if args.workload == "extraction" else tools_case
    cases = [make(engine, grammars, q["turns"][0]) for q in questions]
    modes = [m if m != "ar" else "none" for m in args.modes]
    rows = {m: {"tokens": 0, "seconds": 0.0, "passes": 0, "forced": 0, "valid": 0, "same_as_plain": 0}
            for m in modes}
    outputs: dict[str, list[list[int]]] = {m: [] for m in modes}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    bar = tqdm(total=len(cases) * len(modes), desc=f"bench {args.workload}", unit="gen")
    llama = _llama(args, engine, cases) if LLAMACPP_AR in modes else None
    eos = list(engine.tokenizer.eos_token_ids or engine.model.config.eos_token_ids)
    for case in cases:
        llama_grammar = gbnf(args.workload, case.schema) if llama is not None else None
        for mode in modes:
            seconds = []
            for _ in range(args.repeats):
                if mode == LLAMACPP_AR:  # llama.cpp's own grammar sampler, on the GGUF as it is
                    tokens, took, passes, _ = llama.run(case.ids, params, mode, llama_grammar)
                    tokens, forced = [t for t in tokens if t not in eos], 0
                else:
                    req = Request("", True, dataclasses.replace(params, grammar=case.grammar), mode,
                                  args.draft_length, args.tree_budget, namespace=f"bench-{mode}")
                    result = engine.run(req, grammars=grammars, prompt_ids=case.ids)
                    tokens, took, passes, forced = (result.token_ids, result.seconds, result.target_forward_passes,
                                                    result.forced_tokens)
                seconds.append(took)
            row = rows[mode]
            row["tokens"] += len(tokens)
            row["seconds"] += statistics.median(seconds)
            row["passes"] += passes
            row["forced"] += forced
            row["valid"] += valid(args.workload, engine.tokenizer.decode(tokens))
            outputs[mode].append(tokens)
            bar.update()
    bar.close()
    plain = outputs.get("none")
    for mode, row in rows.items():
        if plain is not None:
            row["same_as_plain"] = sum(a == b for a, b in zip(outputs[mode], plain))
        row["tokens_per_s"] = round(row["tokens"] / row["seconds"], 2) if row["seconds"] else None
        row["tokens_per_pass"] = round(row["tokens"] / row["passes"], 3) if row["passes"] else None
        row["forced_share"] = round(row["forced"] / row["tokens"], 3) if row["tokens"] else None
    per_token, per_node = [], []
    ours = next(m for m in modes if m != LLAMACPP_AR)
    for case, tokens in zip(cases, outputs[ours]):
        t, n = mask_costs(grammars, case.grammar, tokens, eos)
        per_token += t
        per_node += n
    base = rows.get("none", {}).get("tokens_per_s")
    for row in rows.values():
        row["speedup_vs_plain"] = round(row["tokens_per_s"] / base, 3) if base and row["tokens_per_s"] else None
    report = {"workload": args.workload, "prompts": len(cases), "max_tokens": args.max_tokens,
              "draft_length": args.draft_length, "tree_budget": args.tree_budget, "repeats": args.repeats,
              "dtype": args.dtype, "modes": rows, "mask_per_token": _ms(per_token),
              "mask_per_tree_node": _ms(per_node)}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(to_markdown(report))
    return report


def _llama(args, engine: LocalEngine, cases: list[Case]):
    """llama.cpp on the GGUF the engine loaded, sized for the longest prompt and answer."""
    from bench.llamacpp import LlamaCppRunner
    from runtime.loading import resolve_source

    n_ctx = max(len(c.ids) for c in cases) + args.max_tokens + 8
    eos = engine.tokenizer.eos_token_ids or engine.model.config.eos_token_ids
    return LlamaCppRunner(resolve_source(args.model), [LLAMACPP_AR], n_ctx, torch.get_num_threads(),
                          args.draft_length, eos)


def to_markdown(report: dict) -> str:
    lines = [f"{report['workload']}: {report['prompts']} prompts, greedy, max {report['max_tokens']} tokens",
             "", "| mode | tokens/s | vs plain | tokens/pass | forced share | schema-valid | same as plain |",
             "|---|---|---|---|---|---|---|"]
    n = report["prompts"]
    for mode, r in report["modes"].items():
        lines.append(f"| {mode} | {r['tokens_per_s']} | {r['speedup_vs_plain']}x | {r['tokens_per_pass']} | "
                     f"{r['forced_share']:.1%} | {r['valid']}/{n} | {r['same_as_plain']}/{n} |")
    t, node = report["mask_per_token"], report["mask_per_tree_node"]
    lines += ["", f"grammar mask per token: median {t.get('median_ms')} ms, p99 {t.get('p99_ms')} ms; "
                  f"per tree node (consume, mask, roll back): median {node.get('median_ms')} ms, "
                  f"p99 {node.get('p99_ms')} ms"]
    return "\n".join(lines)
