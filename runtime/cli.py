"""moedesk-cli: the headless front door. Each subcommand lives in its own module and is imported lazily.

    moedesk-cli chat --model NAME_OR_DIR [--temperature T] [--max-tokens N] [--seed S]
                     [--draft none|ngram|mtp|DIR] [--draft-tokens K] [--vram-budget GB] [--json] PROMPT
    moedesk-cli import-demo [--bits B] [--force]
    moedesk-cli synth --shape NAME --bpw B --out DIR
    moedesk-cli convert --model HF_DIR --bpw B --out DIR [--calibration FILE] [--head-bits H]
    moedesk-cli import PATH_OR_REPO [--out DIR] [--bpw B] [--width W] [--no-calibrate]
    moedesk-cli requantize --model EXL2_DIR --bpw B --out DIR [--experts all|cold] [--linears experts|mlp]
    moedesk-cli bench --model NAME_OR_DIR [...] --out bench/results/
    moedesk-cli setup-gpu [--check] [--arch-list "8.6;9.0"] [--json]
    moedesk-cli bench-spec --model NAME_OR_DIR [--what lookup|verify|all] [--forced-acceptance] --out bench/results/
    moedesk-cli bench-worker --model NAME_OR_DIR [--vram-budget GB] [--draft both|ngram|none|mtp] --out bench/results/
"""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help)
SUBCOMMANDS = {
    "chat": ("runtime.chat_cli", "Ask a model one question through a real worker process."),
    "import-demo": ("runtime.demo", "Import the demo model (SmolLM2-135M-Instruct) into the models folder."),
    "synth": ("runtime.exl2.synth", "Write a random-weight EXL2 model with the shapes of a real one."),
    "convert": ("runtime.exl2.convert", "Quantize a Hugging Face checkpoint to EXL2 with calibration (GPTQ), "
                                        "layer by layer; resumable."),
    "import": ("runtime.exl2.gptq_import", "Import a GPTQ / AutoRound / AWQ build (a folder or a Hub repository) "
                                           "into EXL2, layer by layer; resumable."),
    "bench": ("bench.engine", "Measure prefill and decode speed; write JSON to bench/results/."),
    "setup-gpu": ("runtime.setup_gpu", "Build the GPU engine's kernels once (exllamav2's CUDA extension), "
                                      "with a CUDA toolkit or NVIDIA's Python packages."),
    "bench-spec": ("bench.spec", "Measure speculative decoding (n-gram lookup, verify cost); "
                                                "write JSON to bench/results/."),
    "bench-worker": ("bench.worker", "Hold a conversation through a real worker process as the GUI does; "
                                     "per answer TTFT, decode speed, longest token gap; JSON to bench/results/."),
    "requantize": ("runtime.exl2.requantize", "Quantize an EXL2 model's experts again at a lower width, calibrated "
                                              "on its own activations; no bf16 checkpoint needed."),
}



def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="moedesk-cli", description="MoE Desk, headless.")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    module = None
    for name, (modname, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == chosen:              # only the chosen subcommand's module is imported
            module = importlib.import_module(modname)
            module.add_arguments(p)
    args = parser.parse_args(argv)
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print("moedesk-cli: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from runtime.client import WorkerError       # the client's side of the protocol (loaded when needed)
        if not isinstance(e, WorkerError):
            raise
        print(f"moedesk-cli {chosen}: {e.message}", file=sys.stderr)
        if e.detail:                                 # a dead worker's: its last log lines
            print(e.detail, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
