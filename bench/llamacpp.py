"""llama.cpp beside us in `specserve bench`: the `llamacpp-ar` and `llamacpp-pld` modes.

They run the GGUF as it is (its own quantized weights, llama.cpp's arithmetic) through
llama-cpp-python, an optional extra: `pip install 'specserve[llamacpp]'` compiles
llama.cpp. Each is fed the very prompt token ids our modes decode from, greedy, with
as many threads as torch has in the bench, and stops on the same end-of-sequence
tokens; `llamacpp-pld` is llama-cpp-python's own prompt-lookup speculative decoding.
Their outputs differ from ours by arithmetic, not by model: `agreement` says how far.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Collection

from speculative.sampling import SamplingParams

LLAMACPP_MODES = ("llamacpp-ar", "llamacpp-pld")
INSTALL_HINT = ("llama-cpp-python is not installed: pip install 'specserve[llamacpp]' "
                "(it compiles llama.cpp, several minutes)")
PLD_NGRAM = 2  # llama-cpp-python's default longest n-gram that prompt lookup matches
THREADS_SOURCE = ("torch.get_num_threads() after LocalEngine.load, which sets it to the cores this process "
                  "may run on (cluster.local.set_cpu_threads: len(os.sched_getaffinity(0))); for prompt and "
                  "decoding alike")
# Every sampler off but greedy: llama-cpp-python's defaults (top_k 40, top_p 0.95, min_p 0.05,
# temperature 0.8) sample; at temperature 0 it picks the argmax after the penalties, all off here.
GREEDY = dict(temp=0.0, top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0,
              frequency_penalty=0.0, presence_penalty=0.0, mirostat_mode=0)


def llama_cpp_missing() -> bool:
    """Whether llama-cpp-python cannot be imported (absent, or its compiled library broken)."""
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError):
        return True
    return False


def built_with_amx() -> bool:
    """Whether the installed llama.cpp runs AMX kernels: on this model they segfaulted
    (`ggml_backend_amx_mul_mat`, llama.cpp issue #20824), so the bench refuses such a build."""
    import llama_cpp

    return "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode()


AMX_HINT = ("was built with AMX, whose kernels crash on this model (llama.cpp issue #20824): rebuild it without, "
            "CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON ...\" "
            "pip install --no-cache-dir --force-reinstall llama-cpp-python (see docs/CLI.md)")


class _CountedDrafts:
    """A draft model that counts its calls and the tokens it proposes: llama-cpp-python
    calls it once before each decoding pass."""

    def __init__(self, draft):
        self.draft, self.calls, self.proposed = draft, 0, 0

    def __call__(self, input_ids, /, **kwargs):
        out = self.draft(input_ids, **kwargs)
        self.calls += 1
        self.proposed += len(out)
        return out


class LlamaCppRunner:
    """The GGUF loaded by llama.cpp once per requested mode: plain decoding keeps only the
    last position's logits, prompt lookup needs every position's."""

    def __init__(self, gguf: Path, modes: Collection[str], n_ctx: int, n_threads: int, pld_tokens: int,
                 eos: Collection[int]):
        import llama_cpp
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.eos = set(eos)
        self.settings = {"llama_cpp_python": llama_cpp.__version__,
                         "system_info": llama_cpp.llama_print_system_info().decode().strip(),
                         "gguf": gguf.name, "n_ctx": n_ctx, "n_threads": n_threads, "n_threads_batch": n_threads,
                         "pld_num_pred_tokens": pld_tokens, "pld_max_ngram_size": PLD_NGRAM}
        self.drafts = _CountedDrafts(LlamaPromptLookupDecoding(PLD_NGRAM, pld_tokens))
        # logits_all=True with the draft model: llama-cpp-python sizes its logits buffer by that
        # argument, not by the draft model, and a context past n_batch (512) then overflows it.
        self.llamas = {mode: Llama(str(gguf), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                                   n_gpu_layers=0, draft_model=self.drafts if mode == "llamacpp-pld" else None,
                                   logits_all=mode == "llamacpp-pld", verbose=False)
                       for mode in modes if mode in LLAMACPP_MODES}

    def run(self, ids: list[int], params: SamplingParams, mode: str, gbnf: str | None = None
            ) -> tuple[list[int], float, int, tuple[int, int]]:
        """Greedy tokens after `ids` up to the first end-of-sequence token (kept) or `params.max_tokens`;
        seconds; target passes (the prompt's, then one per decoding step); (draft tokens
        proposed, draft tokens that became output). `gbnf`: a grammar (llama.cpp's GBNF) the
        output must follow, its sampler's own constraint."""
        llama = self.llamas[mode]
        calls, proposed = self.drafts.calls, self.drafts.proposed
        tokens: list[int] = []
        start = time.perf_counter()
        llama.reset()  # no prompt prefix kept from the last question: our modes keep none either
        grammar = None
        if gbnf is not None:
            from llama_cpp import LlamaGrammar

            grammar = LlamaGrammar.from_string(gbnf, verbose=False)  # a fresh state a request
        for token in llama.generate(ids, **GREEDY, grammar=grammar):
            tokens.append(token)
            if token in self.eos or len(tokens) >= params.max_tokens:
                break
        seconds = time.perf_counter() - start
        steps = self.drafts.calls - calls if llama.draft_model is not None else len(tokens) - 1
        # each decoding step outputs its accepted draft tokens and one token of its own
        return tokens, seconds, 1 + steps, (self.drafts.proposed - proposed, len(tokens) - 1 - steps)

    def report(self, outputs: dict[str, list[list[int]]], categories: list[str], dtype: str) -> dict:
        """The report's `llamacpp` section: the settings, and with `ar` run too, how far the
        llama.cpp modes' outputs agree with it (`outputs`: per mode, its tokens per question)."""
        out = {**self.settings, "threads_source": THREADS_SOURCE}
        if set(LLAMACPP_MODES) <= set(outputs):  # is llama.cpp's prompt lookup lossless against its own decoding?
            ar, pld = outputs["llamacpp-ar"], outputs["llamacpp-pld"]
            out["pld_identical_to_ar"] = f"{sum(a == b for a, b in zip(ar, pld))}/{len(ar)}"
        if "ar" in outputs:
            out["agreement_with_ours"] = {"reference_mode": "ar", "reference_dtype": dtype,
                                          **agreement(outputs["ar"], {m: outputs[m] for m in self.llamas},
                                                      categories)}
        return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(reference: list[list[int]], outputs: dict[str, list[list[int]]], categories: list[str]) -> dict:
    """Per question, how many leading tokens of each mode's output equal the reference's,
    and how many questions came out identical."""
    per_question = [{"category": cat, "reference_tokens": len(ref),
                     **{mode: common_prefix(outs[i], ref) for mode, outs in outputs.items()}}
                    for i, (cat, ref) in enumerate(zip(categories, reference))]
    identical = {mode: f"{sum(out == ref for out, ref in zip(outs, reference))}/{len(reference)}"
                 for mode, outs in outputs.items()}
    return {"per_question": per_question, "identical": identical}


def agreement_lines(report: dict) -> list[str]:
    """The agreement of the llama.cpp modes with our reference mode, as a Markdown table."""
    llama = report.get("llamacpp") or {}
    agree = llama.get("agreement_with_ours")
    if not agree:
        return []
    modes = list(agree["identical"])
    lines = ["", f"Leading tokens of llama.cpp's output equal to ours ({agree['reference_mode']}, "
                 f"{agree['reference_dtype']}; llama.cpp runs the GGUF's own weights), of our tokens:", "",
             "| question | category | " + " | ".join(modes) + " |", "| ---: | --- |" + " ---: |" * len(modes)]
    for i, q in enumerate(agree["per_question"], 1):
        lines.append(f"| {i} | {q['category']} | "
                     + " | ".join(f"{q[m]}/{q['reference_tokens']}" for m in modes) + " |")
    lines.append("| identical | | " + " | ".join(agree["identical"][m] for m in modes) + " |")
    if "pld_identical_to_ar" in llama:
        lines += ["", f"llamacpp-pld's outputs identical to llamacpp-ar's: {llama['pld_identical_to_ar']}"]
    return lines
