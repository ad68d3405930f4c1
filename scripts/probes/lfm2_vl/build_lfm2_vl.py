"""Build the probe's tiny LFM2-VL (``Lfm2VlForConditionalGeneration``) for vLLM CPU.

The builder moved into the product (``hybrid-offload make-model --arch lfm2_vl``,
:func:`hybrid_offload.testing.vision_models.build_vl_model`); this keeps the probe's recipe
working.

Usage: .venv/bin/python scripts/probes/lfm2_vl/build_lfm2_vl.py OUT_DIR
"""

import sys
from pathlib import Path

from hybrid_offload.testing.vision_models import build_vl_model

if __name__ == "__main__":
    print(build_vl_model(Path(sys.argv[1] if len(sys.argv) > 1 else "DIR"), arch="lfm2_vl"))
