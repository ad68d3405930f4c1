"""Build the tiny Qwen3.5 VL model (Qwen3_5ForConditionalGeneration) for vLLM CPU.

The builder moved into the product (``hybrid-offload make-model --arch qwen3_5_vl``); this
keeps the probe's recipe working.

Usage: .venv/bin/python scripts/probes/qwen3_5_vl/build_vl.py OUT_DIR
"""

import sys
from pathlib import Path

from hybrid_offload.testing.vision_models import build_vl_model

if __name__ == "__main__":
    print(build_vl_model(Path(sys.argv[1] if len(sys.argv) > 1 else "DIR")))
