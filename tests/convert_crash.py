"""`moedesk-cli convert` that dies like a killed process (SIGKILL) once its first layer is written: a crash."""
import argparse
import os
import signal
import sys
from pathlib import Path

from runtime.exl2 import convert


def main() -> None:
    p = argparse.ArgumentParser()
    convert.add_arguments(p)
    args = p.parse_args()

    def say(msg: str) -> None:
        print(msg, flush=True)
        if msg.startswith("layer 1/"):
            os.kill(os.getpid(), signal.SIGKILL)
    convert.convert(args.model, args.out, args.bpw, head_bits=args.head_bits,
                    calibration_text=convert.DEFAULT_CALIBRATION.read_text(), calibration_source="calibration.txt",
                    say=say)
    sys.exit(3)                 # never reached: the process is killed after layer 1


if __name__ == "__main__":
    main()
