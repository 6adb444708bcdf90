"""Every setting, named once: its YAML key, its flag, its type, its help.

The CLI builds its parser from `OPTIONS` and `server.settings` merges YAML and flags through it,
so a flag cannot exist without a YAML key and documentation.
"""

from __future__ import annotations

from types import MappingProxyType

from engine import (
    ATTENTION_BACKENDS,
    CPU_ACTIVATIONS,
    CPU_ATTENTION,
    DEVICES,
    DRAFT_LENGTH_POLICIES,
    DTYPES,
    KV_CACHE_DTYPES,
    MODEL_IMPLS,
    QUANTIZATIONS,
    SPEC_METHODS,
    TREE_DRAFTS,
    VERIFICATIONS,
)
from server.option import Option, optional, parse_bool

__all__ = ["BY_KEY", "CONFIG_ENV", "LOG_LEVELS", "OPTIONS", "Option", "parse_bool"]

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
CONFIG_ENV = "TANDEM_CONFIG"


OPTIONS: tuple[Option, ...] = (
    Option(
        "model.path",
        "--model",
        str,
        "target model: a local Hugging Face model directory, a .gguf file (converted once and "
        "cached, tokenizer and chat template from the file), or pkg://PACKAGE/FILE for a file "
        "an installed Python package ships",
        metavar="PATH",
        is_path=True,
    ),
    Option(
        "model.cache_dir",
        "--model-cache-dir",
        optional(str),
        "where GGUF files are converted to and found again, keyed by content hash "
        "(default $XDG_CACHE_HOME/tandem/models, else ~/.cache/tandem/models)",
        metavar="DIR",
        is_path=True,
    ),
    Option(
        "model.dtype",
        "--dtype",
        str,
        "weight and activation dtype (auto = float32 on CPU, bfloat16 on CUDA)",
        choices=DTYPES,
    ),
    Option(
        "model.device", "--device", str, "auto = cuda when available, else cpu", choices=DEVICES
    ),
    Option(
        "model.max_model_len",
        "--max-model-len",
        optional(int, ("auto", "none", "null")),
        "longest prompt + output in tokens (auto = the model's max_position_embeddings)",
        metavar="N",
    ),
    Option(
        "model.seed", "--seed", int, "seed for requests that do not bring their own", metavar="N"
    ),
    Option(
        "model.attention_backend",
        "--attention-backend",
        str,
        "paged attention: triton (one GPU kernel reading the block tables), cpu (Tandem's C "
        "kernel reading the block tables, float32) or reference (padded SDPA); auto = triton on "
        "CUDA when Triton is installed, cpu on the CPU when its kernels build, else reference",
        choices=ATTENTION_BACKENDS,
    ),
    Option(
        "model.cuda_graphs",
        "--cuda-graphs",
        parse_bool,
        "on: decode and verification steps with one query length per request run on padded "
        "fixed shapes, replayed as CUDA graphs on CUDA (needs the triton attention backend; "
        "ignored without it); off: every step eagerly",
        metavar="on|off",
    ),
    Option(
        "model.model_impl",
        "--model-impl",
        str,
        "forward pass of both models: native = Tandem's own for the Llama family (Llama, "
        "Mistral, Qwen2, Qwen3), transformers = the Hugging Face module; auto = native where "
        "supported and checked against transformers at start-up",
        choices=MODEL_IMPLS,
    ),
    Option(
        "model.cpu_packed_linear",
        "--cpu-packed-linear",
        parse_bool,
        "on (default): on the CPU in float32, both models run on Tandem's C kernels: linear "
        "layers on packed weights (bfloat16 panels where the weights are exactly bfloat16 "
        "values) and, with the native forward, every step of a layer; ignored on CUDA or "
        "without a C compiler",
        metavar="on|off",
    ),
    Option(
        "model.quantization",
        "--quantization",
        str,
        "weight-only quantization of Hugging Face checkpoints, a change to the served model "
        "(both models; activations, KV and sums stay float32; CPU only): bf16 = weights rounded "
        "to bfloat16, int8 = GGUF Q8_0 blocks (32 weights, one float16 scale), int4 = GGUF Q4_1 "
        "blocks (LM head int8); none (default) = the checkpoint's float32 weights",
        choices=QUANTIZATIONS,
    ),
    Option(
        "model.gguf_blocks",
        "--gguf-blocks",
        parse_bool,
        "on (default): with the CPU kernels, a .gguf model's linear layers read the file's own "
        "Q8_0/Q4_1/Q4_0 blocks: the same weights as the converted float32 ones, summed per block "
        "and then scaled (the same sums in another rounding order), about a fifth of the bytes "
        "per pass; off = its dequantized float32 weights",
        metavar="on|off",
    ),
    Option(
        "model.cpu_activations",
        "--cpu-activations",
        str,
        "how the CPU kernels take a quantized linear's input (GGUF blocks, --quantization "
        "int8/int4): int8 = rounded to int8 per block of 32 and multiplied on integer dot "
        "products (AVX-512 VNNI), as llama.cpp does: a change to the served model's numbers "
        "(docs/CPU.md measures it) that makes prefill and verified rows much cheaper; float32 "
        "= as it is; auto (default) = int8 where the CPU has VNNI, else float32. Speculative "
        "output stays exactly the same server's output in every mode",
        choices=CPU_ACTIVATIONS,
    ),
    Option(
        "model.cpu_attention",
        "--cpu-attention",
        str,
        "how the CPU kernels attend: bfloat16 = keys and values kept in bfloat16, queries and "
        "softmax weights rounded to bfloat16, products summed in float32 on the CPU's "
        "bfloat16 dot products (AVX-512 BF16), as FlashAttention runs on GPUs: a change to the "
        "served model's numbers (docs/CPU.md measures it) that makes a long context's "
        "verified rows about 3x cheaper; float32 = exact float32 (over --kv-cache-dtype's "
        "values); auto (default) = bfloat16 where the CPU has the instructions and "
        "--kv-cache-dtype is auto or bfloat16, else float32",
        choices=CPU_ATTENTION,
    ),
    Option(
        "model.cpu_bind",
        "--cpu-bind",
        parse_bool,
        "on (default): on the CPU, the engine thread binds to the first N cores the process may "
        "use (N = torch's thread count, e.g. OMP_NUM_THREADS), leaving the rest to the HTTP "
        "side; nothing is bound when there are no more cores than threads",
        metavar="on|off",
    ),
    Option(
        "speculative.method",
        "--speculative-method",
        str,
        "draft = small draft model, ngram = prompt lookup, suffix = suffix decoding (suffix "
        "tries over the request's tokens and recent outputs), off = plain decoding",
        choices=SPEC_METHODS,
    ),
    Option(
        "speculative.draft_model",
        "--draft-model",
        optional(str),
        "draft model for --speculative-method draft, sharing the target's tokenizer: a "
        "Hugging Face directory, a .gguf file or pkg://PACKAGE/FILE, as for --model",
        metavar="PATH",
        is_path=True,
    ),
    Option(
        "speculative.max_draft_tokens",
        "--max-draft-tokens",
        int,
        "K_max: most draft tokens per request per step (0..16)",
        metavar="K",
    ),
    Option(
        "speculative.draft_length",
        "--draft-length",
        str,
        "adaptive = K chosen each step from a cost model, fixed = always --max-draft-tokens",
        choices=DRAFT_LENGTH_POLICIES,
    ),
    Option(
        "speculative.draft_branches",
        "--draft-branches",
        optional(int, ("auto", "none", "null")),
        "draft trees: the most candidates drafted for a request's next token, each continued "
        "as a chain of K and verified in the same target pass; 1 = a single chain, auto = "
        "the adaptive policy chooses from the cost model (a fixed K gets a chain; its estimate "
        "of a tree is optimistic for a poor draft)",
        metavar="N|auto",
    ),
    Option(
        "speculative.tree_drafts",
        "--tree-drafts",
        str,
        "a sampling request's tree candidates: sampled = N draws without replacement "
        "(recursive rejection sampling), top = the draft's top N - 1 plus one draw from the "
        "rest (the optimal verifier for that sampler)",
        choices=TREE_DRAFTS,
    ),
    Option(
        "speculative.verification",
        "--verification",
        str,
        "how sampled drafts are verified: block = the draft block jointly (keeps at least as "
        "many drafts), token = token by token; both keep the target's distribution exactly",
        choices=VERIFICATIONS,
    ),
    Option(
        "speculative.draft_quantization",
        "--draft-quantization",
        str,
        "weight-only quantization of the draft model's Hugging Face checkpoint (the choices "
        "of --quantization), or auto = the target's --quantization, and int4 for a Hugging "
        "Face draft beside a .gguf target whose linears run on its file's blocks (a draft pass "
        "there is bound by reading its weights); the output stays the target's, the draft's "
        "rounding moves acceptance and its pass time",
        choices=("auto", *QUANTIZATIONS),
    ),
    Option(
        "speculative.recalibrate",
        "--recalibrate",
        parse_bool,
        "on = time the adaptive-K cost model afresh at start; off = reuse the calibration "
        "cached for this machine, these models and settings (~/.cache/tandem/calibration)",
        metavar="on|off",
    ),
    Option("speculative.ngram_max", None, int, "longest suffix n-gram prompt lookup matches"),
    Option("speculative.ngram_min", None, int, "shortest suffix n-gram prompt lookup takes"),
    Option(
        "speculative.ngram_assist",
        None,
        int,
        "with a draft model, a request whose last N+ tokens occurred earlier in its context may "
        "verify what followed them in place of the draft's drafts (0..16; 0 = never)",
    ),
    Option(
        "speculative.suffix_max_depth",
        None,
        int,
        "suffix decoding: the depth of its suffix tries, a matched suffix of the context and "
        "the drafts after it together (2..64, above --max-draft-tokens)",
    ),
    Option(
        "speculative.max_request_slowdown",
        None,
        optional(float),
        "adaptive K: most a request's rate may fall for the batch's drafts (0..1, null: no cap)",
    ),
    Option(
        "speculative.suffix_cache_tokens",
        None,
        int,
        "suffix decoding: the most tokens of finished requests' outputs kept to draft from "
        "(the oldest go first; 0 = each request's own tokens only)",
    ),
    Option(
        "cache.block_size", "--block-size", int, "tokens per KV cache block (1..256)", metavar="N"
    ),
    Option(
        "cache.num_blocks",
        "--kv-cache-blocks",
        optional(int, ("auto", "none", "null")),
        "KV cache blocks in the pool (auto = size the pool from the memory budget)",
        metavar="N",
    ),
    Option("cache.memory_gb", None, float, "KV cache budget in GiB on CPU when num_blocks is auto"),
    Option(
        "cache.gpu_memory_utilization",
        "--gpu-memory-utilization",
        float,
        "fraction of GPU memory for weights + KV cache when --kv-cache-blocks is auto (0..1]",
        metavar="F",
    ),
    Option(
        "cache.enable_prefix_caching", None, parse_bool, "reuse KV blocks of shared prompt prefixes"
    ),
    Option(
        "cache.kv_cache_dtype",
        "--kv-cache-dtype",
        str,
        "what the KV cache holds: auto = the model's dtype; float16 | bfloat16 = keys and values "
        "rounded to 16 bits (CPU only; half the bytes attention reads, twice the tokens the "
        "cache holds; a change to the served model's numerics); float32",
        choices=KV_CACHE_DTYPES,
    ),
    Option(
        "scheduler.max_num_seqs",
        "--max-num-seqs",
        int,
        "most requests in the running batch",
        metavar="N",
    ),
    Option(
        "scheduler.max_num_batched_tokens",
        "--max-num-batched-tokens",
        int,
        "token budget per engine step (prefill chunks + decode + draft verification)",
        metavar="N",
    ),
    Option(
        "scheduler.max_waiting",
        "--max-waiting",
        int,
        "most requests waiting for admission; more are refused with HTTP 503",
        metavar="N",
    ),
    Option(
        "server.host",
        "--host",
        str,
        "address to listen on (0.0.0.0 to accept other machines)",
        metavar="ADDR",
    ),
    Option("server.port", "--port", int, "port to listen on", metavar="PORT"),
    Option(
        "server.served_model_name",
        "--served-model-name",
        optional(str),
        "model name clients use (default: the --model path as given)",
        metavar="NAME",
    ),
    Option(
        "server.api_key",
        "--api-key",
        optional(str),
        "require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize (default: no key)",
        metavar="KEY",
    ),
    Option(
        "server.api_key_file",
        "--api-key-file",
        optional(str),
        "read the API key from this file instead (off the command line, where ps shows it)",
        metavar="FILE",
    ),
    Option(
        "server.api_key_scope",
        "--api-key-scope",
        str,
        "where the key is required: v1 (the API only; /metrics, /version, /docs and /openapi.json "
        "open to scrapers and browsers) or all (every path but /health)",
        choices=("v1", "all"),
    ),
    Option(
        "server.max_body_bytes",
        "--max-body-bytes",
        int,
        "a request body over this many bytes gets 413 before it is parsed",
        metavar="N",
    ),
    Option(
        "server.max_json_number_digits",
        "--max-json-number-digits",
        int,
        "structured JSON output (response_format, guided_json, tool calls): each number takes at "
        "most this many digits, so a small model cannot write one forever (0 = no limit)",
        metavar="N",
    ),
    Option("server.log_level", "--log-level", str, "logging level", choices=LOG_LEVELS),
    Option(
        "server.max_request_tokens",
        "--max-request-tokens",
        optional(int, ("auto", "none", "null")),
        "most tokens one request may ask for: its prompts plus max_tokens x n for each (a chat "
        "request without max_tokens gets what fits); more: HTTP 400 (auto: 8 x --max-model-len)",
        metavar="N",
    ),
    Option(
        "server.request_timeout",
        "--request-timeout",
        optional(float, ("none", "null", "off")),
        "seconds a request may take from arrival to its last token, queueing included; past it "
        "it is aborted and the client gets HTTP 504 (an error event in a stream); off: no limit",
        metavar="SECONDS",
    ),
    Option(
        "server.drain_timeout",
        "--drain-timeout",
        float,
        "on SIGTERM, seconds to let in-flight requests finish before exiting (new ones get "
        "503); keep it below the orchestrator's kill grace period",
        metavar="SECONDS",
    ),
)
BY_KEY = MappingProxyType({option.key: option for option in OPTIONS})
# YAML keys whose dataclass field is spelled differently.
