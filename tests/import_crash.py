"""`moedesk-cli import` that dies like a killed process (SIGKILL) once its first layer is written: a crash."""
import argparse
import os
import signal
import sys

from runtime.exl2 import gptq_import


def main() -> None:
    p = argparse.ArgumentParser()
    gptq_import.add_arguments(p)
    args = p.parse_args()

    def say(msg: str) -> None:
        print(msg, flush=True)
        if msg.startswith("layer 1/"):
            os.kill(os.getpid(), signal.SIGKILL)
    gptq_import.import_model(args.source, args.out, args.bpw, calibrate=False, say=say)
    sys.exit(3)                 # never reached: the process is killed after layer 1


if __name__ == "__main__":
    main()
